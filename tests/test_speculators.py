"""Drafters in and out in the ecosystem's formats: the speculators format (EAGLE-3, MTP) checked against the
`speculators` package's own code, the EAGLE repository's EAGLE-1 / EAGLE-3 checkpoints, FasterDecoding's Medusa heads,
a DeepSeek-V3 checkpoint's MTP layers; round trips; bad input.

The reference tests run speculators (0.9.0; its pins differ from spekit's) in an interpreter of its own, named by
SPEKIT_SPECULATORS_PYTHON, else /work/venv-spec/bin/python where it exists; without one they skip, saying so. The
reference builds, saves, loads and runs drafters with its own code (tests/speculators_reference.py); inputs and
outputs cross as safetensors files. Tolerance: fp32, max |logit difference| <= 1e-4 (the two forwards run the same
matrices in different orders; the differences seen are ~1e-6)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from spekit.backends.torch_target import Target
from spekit.config import SamplingConfig
from spekit.heads import HEADS, load_head, save_head
from spekit.heads.eagle import additive
from spekit.heads.export import export
from spekit.heads.mtp import MtpHead

REFERENCE_SCRIPT = Path(__file__).with_name("speculators_reference.py")
TOLERANCE = 1e-4
PROMPT = [3, 17, 42, 9, 88, 5, 61, 23, 7, 100, 12, 64]


def reference_python() -> str | None:
    """An interpreter with speculators, or None."""
    named = os.environ.get("SPEKIT_SPECULATORS_PYTHON") or "/work/venv-spec/bin/python"
    if not Path(named).exists():
        return None
    ok = subprocess.run([named, "-c", "import speculators.models.eagle3, speculators.models.mtp"],
                        capture_output=True, timeout=300)
    return named if ok.returncode == 0 else None


@pytest.fixture(scope="module")
def ref():
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter with the speculators package: set SPEKIT_SPECULATORS_PYTHON to one "
                    "(python -m venv V && V/bin/pip install speculators==0.9.0) to check against its code")

    def run(*args: str) -> None:
        done = subprocess.run([python, str(REFERENCE_SCRIPT), *map(str, args)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    return run


@torch.no_grad()
def hidden_of(model, tokens: list[int]) -> tuple:
    return model(torch.tensor([tokens]), output_hidden_states=True).hidden_states


@torch.no_grad()
def eagle3_inputs(model, head) -> dict[str, torch.Tensor]:
    """speculators' alignment: token t+1 beside the target's fused features at t, positions from 1."""
    hidden = hidden_of(model, PROMPT)
    feats = torch.cat([hidden[i] for i in head.feature_layers()], dim=-1)
    n = len(PROMPT) - 1
    return {"hidden_states": feats[:, :n].contiguous(), "input_ids": torch.tensor([PROMPT[1:]]),
            "position_ids": torch.arange(1, n + 1)[None]}


@torch.no_grad()
def spekit_eagle3_logits(head, model, x: dict) -> torch.Tensor:
    """spekit's EAGLE-3 head over the inputs: one causal step, [1, L, Vd]."""
    emb = model.get_input_embeddings()(x["input_ids"])
    n = emb.shape[1]
    mask = additive(torch.ones(n, n, dtype=torch.bool).tril()[None], emb.dtype)
    out = head.step(emb, head.project(x["hidden_states"]), x["position_ids"], mask, DynamicCache())
    return head.draft_logits(out)


@torch.no_grad()
def spekit_mtp_logits(head, model) -> list[torch.Tensor]:
    """spekit's MTP modules teacher-forced along PROMPT: [1, L-k-1, V] per module k."""
    target = Target(model, fast=False)
    last = hidden_of(model, PROMPT)[-1]
    return [head.logits(target, out) for _, out in head.chain(target, torch.tensor([PROMPT]), last)]


def reference_forward(ref, draft_dir: Path, inputs: dict, tmp: Path) -> dict[str, torch.Tensor]:
    save_file(inputs, str(tmp / "inputs.safetensors"))
    ref("forward", draft_dir, tmp / "inputs.safetensors", tmp / "outputs.safetensors")
    return load_file(str(tmp / "outputs.safetensors"))


def report(what: str, diff: float) -> None:
    print(f"[speculators reference] {what}: max |logit difference| {diff:.2e}", file=sys.stderr)
    assert diff <= TOLERANCE, f"{what}: {diff}"


# --- 1: checked against speculators' own code ----------------------------------------------------------------------

@pytest.mark.parametrize("draft_vocab", [100, 128])
def test_a_speculators_eagle3_drafter_gives_the_reference_logits_and_tokens(ref, saved_llama, tmp_path, draft_vocab,
                                                                           engine_for):
    ref("make-eagle3", saved_llama.name_or_path, tmp_path / "e3", draft_vocab, "1,2,4")
    head = load_head(tmp_path / "e3", Target(saved_llama, fast=False), "eagle3")
    assert head.feature_layers() == [1, 2, 4] and head.config.draft_vocab_size == draft_vocab
    x = eagle3_inputs(saved_llama, head)
    want = reference_forward(ref, tmp_path / "e3", x, tmp_path)
    got = spekit_eagle3_logits(head, saved_llama, x)
    report(f"speculators eagle3 (Vd {draft_vocab}) in spekit", float((got - want["logits"]).abs().max()))
    assert torch.equal(head.draft_ids[got.argmax(-1)], head.draft_ids[want["tokens"]])
    # and it drafts losslessly through --method eagle3 --heads DIR
    out = engine_for("eagle3", saved_llama, heads=str(tmp_path / "e3")).generate([PROMPT], SamplingConfig(
        max_new_tokens=12))
    plain = engine_for("plain", saved_llama).generate([PROMPT], SamplingConfig(max_new_tokens=12))
    assert out[0].token_ids == plain[0].token_ids


@pytest.mark.slow
def test_a_speculators_eagle3_drafter_for_smollm2_gives_the_reference_logits(ref, tmp_path):
    """The same for the bundled SmolLM2-135M (hidden 576, 30 layers, 49152 tokens, draft vocabulary 8192)."""
    from spekit.backends.torch_models import load_model
    model = load_model("smollm2-135m").model
    model.save_pretrained(tmp_path / "smollm2")          # the verifier folder speculators reads (bundled as GGUF)
    ref("make-eagle3", tmp_path / "smollm2", tmp_path / "e3", 8192, "2,15,27")
    head = load_head(tmp_path / "e3", Target(model, fast=False), "eagle3")
    x = eagle3_inputs(model, head)
    want = reference_forward(ref, tmp_path / "e3", x, tmp_path)
    got = spekit_eagle3_logits(head, model, x)
    report("speculators eagle3 for SmolLM2-135M in spekit", float((got - want["logits"]).abs().max()))
    assert torch.equal(head.draft_ids[got.argmax(-1)], head.draft_ids[want["tokens"]])


def test_spekits_eagle3_export_loads_in_speculators_and_gives_spekits_logits(ref, saved_llama, tmp_path):
    torch.manual_seed(1)
    head = HEADS["eagle3"].create(Target(saved_llama, fast=False), draft_vocab_size=100, layers=(1, 2, 4))
    head.choose_vocab(torch.rand(128))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    export(save_head(head, tmp_path / "own"), "speculators", tmp_path / "out")
    x = eagle3_inputs(saved_llama, head)
    want = reference_forward(ref, tmp_path / "out", x, tmp_path)
    got = spekit_eagle3_logits(head.eval(), saved_llama, x)
    report("spekit eagle3 export in speculators", float((got - want["logits"]).abs().max()))
    assert torch.equal(got.argmax(-1), want["tokens"])


def test_a_speculators_mtp_drafter_gives_the_reference_logits(ref, saved_qwen3, tmp_path, engine_for):
    ref("make-mtp", saved_qwen3.name_or_path, tmp_path / "mtp", 2)
    head = load_head(tmp_path / "mtp", Target(saved_qwen3, fast=False), "mtp")
    assert len(head.layers) == 2           # one layer applied twice: two modules with its weights
    want = reference_forward(ref, tmp_path / "mtp", {"input_ids": torch.tensor([PROMPT]),
                                                      "hidden_states": hidden_of(saved_qwen3, PROMPT)[-1]}, tmp_path)
    got = spekit_mtp_logits(head, saved_qwen3)
    for k in range(2):
        ours, theirs = got[k], want[f"logits_{k}"]
        n = theirs.shape[1]                                 # speculators runs every step over L - steps - 1
        report(f"speculators mtp step {k} in spekit", float((ours[:, :n] - theirs).abs().max()))
    out = engine_for("mtp", saved_qwen3, heads=str(tmp_path / "mtp")).generate([PROMPT], SamplingConfig(
        max_new_tokens=12))
    plain = engine_for("plain", saved_qwen3).generate([PROMPT], SamplingConfig(max_new_tokens=12))
    assert out[0].token_ids == plain[0].token_ids


def test_spekits_mtp_export_loads_in_speculators_and_gives_spekits_logits(ref, saved_qwen3, tmp_path):
    torch.manual_seed(2)
    head = MtpHead.create(Target(saved_qwen3, fast=False), num_modules=1, init_from_target=False)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    export(save_head(head, tmp_path / "own"), "speculators", tmp_path / "out")
    want = reference_forward(ref, tmp_path / "out", {"input_ids": torch.tensor([PROMPT]),
                                                      "hidden_states": hidden_of(saved_qwen3, PROMPT)[-1]}, tmp_path)
    got = spekit_mtp_logits(head.eval(), saved_qwen3)[0]
    report("spekit mtp export in speculators", float((got[:, :want["logits_0"].shape[1]] - want["logits_0"]).abs()
                                                     .max()))
