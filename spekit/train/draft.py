"""The `draft` kind: a small model of the target's own architecture and vocabulary, distilled from the target,
for the classic draft-model method (`--method draft --draft DIR`).

Design (kept small enough to ship): the draft has the target's hidden size and `layers` decoder layers,
initialised from the target's first layers, the target's final norm, and the
target's own embedding and LM head (one tied matrix for SmolLM2). Only the decoder layers and the
norm are trained; the embedding stays the target's. The draft is saved as a Hugging Face folder WITHOUT the
embedding matrix: config.json carries `"spekit_shared_from": "<target name or path>"`, and
`spekit.backends.torch_models.load_model(DIR)` fills the embedding (and the tokenizer) from that model when it loads the folder.
`save_draft(..., standalone=True)` writes an ordinary self-contained folder instead (embedding and tokenizer
included) for other engines.

Loss on the answer tokens: hidden_weight x smooth-L1 between the draft's and the target's final (post-norm)
hidden states (cheap: the LM head is shared, so equal hidden states give equal distributions), plus, on up to
`logit_positions` strided positions per batch, KL(target || draft) over the full vocabulary and ce_weight x
cross-entropy to the target's greedy token (what greedy verification accepts).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import UserError, read_user_text
from ..heads.base import (FeatureBatch, check_made_for, check_numbers, check_out, folder_kind, read_weights,
                          staged_dir, target_info)

from ..backends.torch_models import SHARED_KEY
from ..backends.draft_vocab import most_frequent

SHARED_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")   # the target's: shipped only by a standalone draft


@dataclass(frozen=True)
class DraftConfig:
    layers: int = 2              # decoder layers, initialised from the target's first layers
    ce_weight: float = 0.5       # weight of the cross-entropy to the target's greedy token (beside the KL)
    hidden_weight: float = 1.0   # weight of the regression of the draft's final hidden state onto the target's
    logit_positions: int = 256   # answer positions per batch that get the full-vocabulary KL + CE
    draft_vocab: int = 8192      # LM head over the N most frequent answer tokens at inference (0: the full one)

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise UserError(f"--layers must be >= 1, got {self.layers}")
        if self.draft_vocab < 0:
            raise UserError(f"--draft-vocab must be >= 0 (0 = the full vocabulary), got {self.draft_vocab}")
        if self.logit_positions < 1:
            raise UserError(f"--logit-positions must be >= 1, got {self.logit_positions}")
        check_numbers(self, 0, "ce_weight", "hidden_weight")


def source_layers(n: int, k: int) -> list[int]:
    """The target layers a k-layer draft starts from: the first k. On smollm2-135m (4 distilled answers) the
    untrained 2-layer draft from layers [0, 1] agrees with the target's top-1 on 4% of answer tokens at KL 16.5,
    from [0, 29] (first and last) on 0% at KL 66, from [28, 29] on 0% at KL 19."""
    return list(range(min(k, n)))


class DraftHead(torch.nn.Module):
    """Trains like a Head (create, feature_layers, training_loss); saved as a model folder (save_draft)."""

    kind = "draft"
    Config = DraftConfig
    reconfigurable = frozenset({"ce_weight", "hidden_weight", "logit_positions"})   # the loss's, no weight's

    def __init__(self, config: DraftConfig, target_config: dict, model: torch.nn.Module, source: list[int]):
        super().__init__()
        self.config, self.target_config, self.model, self.source = config, dict(target_config), model, source
        size = config.draft_vocab if 0 < config.draft_vocab < int(target_config["vocab_size"]) else 0
        # the reduced draft vocabulary (target ids), set by choose_vocab; a buffer, so checkpoints keep it
        self.register_buffer("vocab", torch.full((size,), -1, dtype=torch.long))

    @classmethod
    def create(cls, target, **options) -> "DraftHead":
        from transformers import AutoModelForCausalLM
        config = DraftConfig(**options)
        base = target.model
        cfg = base.config.__class__.from_dict(base.config.to_dict())
        source = source_layers(target.num_layers, config.layers)
        cfg.num_hidden_layers = config.layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = [cfg.layer_types[i] for i in source]
        model = AutoModelForCausalLM.from_config(cfg).to(dtype=torch.float32, device=target.device)
        with torch.no_grad():
            for mine, i in zip(model.model.layers, source):
                mine.load_state_dict(base.model.layers[i].state_dict())
            model.model.norm.load_state_dict(base.model.norm.state_dict())
        # share the target's embedding and LM head (frozen; tied or not, as the target has them): they are not
        # part of what is trained or shipped
        model.get_input_embeddings().weight = base.get_input_embeddings().weight
        model.get_output_embeddings().weight = base.get_output_embeddings().weight
        return cls(config, target_info(target), model, source)

    @classmethod
    def load(cls, directory: str | Path, target, **changes) -> "DraftHead":
        """A draft that save_draft wrote, to train on (`spekit train draft --init DIR`): its layers, norm and draft
        vocabulary from the folder, the target's embedding and LM head shared as `create` shares them; `changes`:
        reconfigurable Config fields (the loss's weights)."""
        mark = read_draft_config(directory)
        check_made_for(mark["target"], target, f"{directory} is a draft for another model",
                       "train one for it with `spekit train draft`")
        try:
            config = replace(DraftConfig(**mark["config"]), **changes)
        except TypeError as err:
            raise UserError(f"{Path(directory) / 'config.json'}: its draft config does not fit ({err})") from None
        head = cls.create(target, **asdict(config))
        own = {k: v for k, v in read_weights(directory).items() if k not in SHARED_WEIGHTS}  # not a standalone's copies
        missing, unexpected = head.model.load_state_dict(own, strict=False)
        missing = [k for k in missing if k not in SHARED_WEIGHTS]
        if missing or unexpected:
            raise UserError(f"{directory}/model.safetensors does not fit its config.json's draft (missing "
                            f"{missing[:3]}, unexpected {unexpected[:3]})")
        ids = mark.get("draft_vocab")
        if len(head.vocab) and ids:
            if len(ids) != len(head.vocab):
                raise UserError(f"{directory}/config.json: {len(ids)} draft vocabulary ids for draft_vocab "
                                f"{len(head.vocab)}")
            head.vocab.copy_(torch.tensor(ids, dtype=torch.long))
        return head

    @property
    def vocab_chosen(self) -> bool:
        return not len(self.vocab) or int(self.vocab.min()) >= 0

    def choose_vocab(self, counts: torch.Tensor) -> None:
        """The draft vocabulary: the draft_vocab most frequent answer tokens, counts [V] (none when 0 or when
        that covers the whole vocabulary). Training keeps the full head; the saved draft computes only these."""
        if len(self.vocab):
            self.vocab.copy_(most_frequent(counts, len(self.vocab)))

    def trainable(self) -> list[torch.nn.Parameter]:
        shared = {id(self.model.get_input_embeddings().weight), id(self.model.get_output_embeddings().weight)}
        return [p for p in self.model.parameters() if id(p) not in shared]

    def feature_layers(self) -> list[int]:
        return [self.target_config["num_layers"]]

    def training_loss(self, batch: FeatureBatch, target) -> tuple[torch.Tensor, dict[str, float]]:
        attention = torch.ones_like(batch.tokens)
        out = self.model.model(input_ids=batch.tokens, attention_mask=attention, use_cache=False)
        mask = batch.loss_mask                                                  # [B, L]
        mine = out.last_hidden_state[mask]                                      # [M, H] after the final norm
        theirs = batch.hidden[self.target_config["num_layers"]][mask].to(mine.dtype)   # [M, H]
        hidden_loss = F.smooth_l1_loss(mine, theirs)
        # the LM head is the dear part: the full-vocabulary terms on an evenly strided subset of positions
        stride = -(-mine.shape[0] // self.config.logit_positions)
        weight = self.model.get_output_embeddings().weight                     # [V, H]
        q_logits = mine[::stride] @ weight.T                                    # [m, V]
        with torch.no_grad():
            p_logits = theirs[::stride] @ weight.T                              # [m, V]
            greedy = p_logits.argmax(-1)                                         # [m]
        kl = F.kl_div(q_logits.float().log_softmax(-1), p_logits.float().log_softmax(-1), log_target=True,
                      reduction="batchmean")
        ce = F.cross_entropy(q_logits.float(), greedy)
        top1 = (q_logits.argmax(-1) == greedy).float().mean()
        loss = self.config.hidden_weight * hidden_loss + kl + self.config.ce_weight * ce
        return loss, {"hid": float(hidden_loss.detach()), "kl": float(kl.detach()), "ce": float(ce.detach()),
                      "top1": float(top1)}


def save_draft(head: DraftHead, directory: str | Path, target_name: str, meta: dict | None = None,
               tokenizer=None, standalone: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the draft as a model folder, atomically. Without standalone, the embedding is left out and
    config.json names the model it comes from (`target_name`, as given to --model)."""
    directory = check_out(directory, "draft")
    with staged_dir(directory) as tmp:
        model = head.model
        tied = model.config.tie_word_embeddings
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()
                 if standalone and not (tied and k == "lm_head.weight") or k not in SHARED_WEIGHTS}
        from safetensors.torch import save_file
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg["dtype"] = str(dtype).replace("torch.", "")
        cfg["spekit"] = {"kind": "draft", "config": asdict(head.config), "source_layers": head.source,
                         "target": head.target_config, "meta": meta or {}}
        if len(head.vocab) and int(head.vocab.min()) >= 0:
            cfg["spekit"]["draft_vocab"] = head.vocab.tolist()
        if not standalone:
            cfg[SHARED_KEY] = target_name
        elif tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(config_text(cfg) + "\n")
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
    return directory


def read_draft_config(directory: str | Path) -> dict:
    """The `spekit` section of a draft folder's config.json (what save_draft wrote); UserError when the folder
    holds no draft spekit wrote."""
    path = Path(directory) / "config.json"
    try:
        info = json.loads(read_user_text(path, "draft config"))
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON ({err})") from None
    if folder_kind(info) != "draft":
        raise UserError(f"{directory} is not a draft model spekit trained (its config.json has no spekit draft "
                        f"section); --init for a draft takes the folder `spekit train draft` wrote")
    mark = info["spekit"]
    if not isinstance(mark.get("config"), dict) or not isinstance(mark.get("target"), dict):
        raise UserError(f"{path}: its spekit section lacks 'config' or 'target' (it was edited)")
    return mark


def config_text(cfg: dict) -> str:
    """config.json's text: indented, with the draft vocabulary (thousands of ids) on one line."""
    ids = cfg.get("spekit", {}).get("draft_vocab")
    if not ids:
        return json.dumps(cfg, indent=2)
    marker = "@draft_vocab@"
    text = json.dumps({**cfg, "spekit": {**cfg["spekit"], "draft_vocab": marker}}, indent=2)
    return text.replace(json.dumps(marker), json.dumps(ids))
