"""The reference side of tests/test_speculators.py, run in an interpreter that has the `speculators` package (its
version pins differ from spekit's, so it lives in a venv of its own). It imports nothing of spekit's: drafters are
built, saved, loaded and run by speculators' own code.

    python speculators_reference.py make-eagle3 TARGET_DIR OUT_DIR DRAFT_VOCAB L1,L2,L3
    python speculators_reference.py make-mtp TARGET_DIR OUT_DIR STEPS
    python speculators_reference.py forward DRAFT_DIR INPUTS.safetensors OUTPUTS.safetensors

make-*: a drafter with random weights for the saved target in TARGET_DIR (the verifier), saved by
`save_pretrained`. forward: the drafter loaded by `from_pretrained` (speculators' loader, which also reads the
verifier's embedding and LM head) and run by its own `forward` on the inputs (EAGLE-3: `hidden_states` [1, L, 3H]
fused target features, `input_ids` [1, L], `position_ids` [1, L]; MTP: `input_ids` [1, L], `hidden_states`
[1, L, H] the target's last hidden states). Outputs: EAGLE-3 `logits` [1, L, Vd] (the LM head's output inside
the forward, one step) and `tokens` [1, L] (its drafted ids in the draft vocabulary); MTP `logits_k` [1, L', V]
for each step k.
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.mtp import MTPDraftModel
from speculators.models.mtp.config import MTPSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig


def speculators_config(algorithm: str, target_dir: str, steps: int) -> SpeculatorsConfig:
    return SpeculatorsConfig(algorithm=algorithm, default_proposal_method="greedy",
                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
                             verifier=VerifierConfig.from_pretrained(target_dir))


def sharpen(model, skip=("embed_tokens", "lm_head")) -> None:
    """Random 2-D weights of std 0.08, 4x the init's (confident draft distributions, no near-ties at the top)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and not any(s in name for s in skip):
                p.normal_(0, 0.08)


def make_eagle3(target_dir: str, out: str, draft_vocab: str, layers: str) -> None:
    torch.manual_seed(0)
    verifier = AutoConfig.from_pretrained(target_dir)
    layer = AutoConfig.for_model("llama", **{k: getattr(verifier, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "rms_norm_eps", "max_position_embeddings")}, num_hidden_layers=1)
    config = Eagle3SpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=int(draft_vocab),
                                    eagle_aux_hidden_state_layer_ids=[int(i) for i in layers.split(",")],
                                    speculators_config=speculators_config("eagle3", target_dir, 3))
    model = Eagle3DraftModel(config)
    vocab, size = verifier.vocab_size, int(draft_vocab)
    if size < vocab:
        ids = torch.randperm(vocab)[:size].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(size))
    model.load_verifier_weights()
    sharpen(model)
    model.save_pretrained(out)


def make_mtp(target_dir: str, out: str, steps: str) -> None:
    torch.manual_seed(0)
    verifier = AutoConfig.from_pretrained(target_dir)
    config = MTPSpeculatorConfig(transformer_layer_config=verifier,
                                 speculators_config=speculators_config("mtp", target_dir, int(steps)))
    model = MTPDraftModel(config)
    model.load_verifier_weights()
    sharpen(model)
    with torch.no_grad():          # the norms too: a random init leaves them at 1
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)


@torch.no_grad()
def forward(draft_dir: str, inputs: str, outputs: str) -> None:
    x = load_file(inputs)
    kind = json.loads(open(f"{draft_dir}/config.json").read())["speculators_model_type"]
    if kind == "eagle3":
        config = Eagle3SpeculatorConfig.from_pretrained(draft_dir)
        config.transformer_layer_config._attn_implementation = "eager"      # a dense mask on the CPU
        model = Eagle3DraftModel.from_pretrained(draft_dir, config=config).float().eval()
        seen = []
        model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))
        tokens = model(hidden_states=x["hidden_states"], input_ids=x["input_ids"],
                       document_ids=torch.zeros_like(x["input_ids"]), position_ids=x["position_ids"], ttt_steps=1)
        save_file({"logits": seen[0].contiguous(), "tokens": tokens[0].contiguous()}, outputs)
        return
    model = MTPDraftModel.from_pretrained(draft_dir).float().eval()
    logits, _, _ = model(input_ids=x["input_ids"], hidden_states=x["hidden_states"])
    save_file({f"logits_{k}": v.contiguous() for k, v in enumerate(logits)}, outputs)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"make-eagle3": make_eagle3, "make-mtp": make_mtp, "forward": forward}[command](*args)
