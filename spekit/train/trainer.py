"""The generic training loop for every drafter kind: AdamW, linear warm-up then cosine decay, gradient clipping,
batches by token budget, a progress bar with the loss and the head's own figures, atomic checkpoints every N
steps and resume from them. Runs single-process on the CPU, and on several GPUs under `accelerate launch` or
`torchrun` (accelerate's Accelerator sets up the process group and devices; each process takes every N-th batch, the
gradients are averaged with one all-reduce per parameter, rank 0 writes).

What a head needs to plug in (spekit.heads.base.Head): `feature_layers()` (or `training_layers()` when the loss
reads more layers than drafting does) and `training_loss(batch, target)`;
optionally `choose_vocab(counts [V])` (called once before training with the answer-token counts) and
`trainable()` (the parameters to optimise; default: every parameter that requires grad, the target's frozen).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import UserError
from .features import FeatureStore, epochs

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_tokens: int = 4096      # padded tokens per optimiser step (per process)
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_tokens", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr < math.inf:           # nan fails every comparison
            raise UserError(f"--lr must be a number > 0, got {self.lr}")
        if not 0 < self.clip < math.inf:
            raise UserError(f"--clip (the gradient norm clip) must be a number > 0, got {self.clip}")
        if not 0 <= self.weight_decay < math.inf:
            raise UserError(f"--weight-decay must be a number >= 0, got {self.weight_decay}")
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup}")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine decay to 10% at cfg.steps."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _trainable(head) -> list[torch.nn.Parameter]:
    if hasattr(head, "trainable"):
        return [p for p in head.trainable() if p.requires_grad]
    return [p for p in head.parameters() if p.requires_grad]


def own_state(head, target) -> dict[str, torch.Tensor]:
    """The head's state without the target's tensors it shares (embedding, LM head)."""
    shared = {p.data_ptr() for p in target.model.parameters()}
    return {k: v for k, v in head.state_dict().items() if v.data_ptr() not in shared}


class Trainer:
    def __init__(self, head, target, store: FeatureStore, train_ids: list[str], cfg: TrainConfig, out: str | Path,
                 accelerator=None):
        from accelerate import Accelerator
        self.acc = accelerator or Accelerator(cpu=target.device.type == "cpu")
        self.head, self.target, self.store, self.cfg = head, target, store, cfg
        self.out = Path(out)
        self.layers = sorted(set(getattr(head, "training_layers", head.feature_layers)()))
        self.lengths = {n: store.length(n) for n in train_ids}
        if not self.lengths:
            raise UserError("no training sequences left after the held-out split")
        target.model.requires_grad_(False)
        self.params = _trainable(head)
        if not self.params:
            raise UserError(f"the '{head.kind}' head has no trainable parameters")
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        self.step = 0

    def token_counts(self) -> torch.Tensor:
        """[V] how often each token is an answer token of the training sequences (for choose_vocab)."""
        counts = torch.zeros(self.target.vocab_size, dtype=torch.float64)
        for n in self.lengths:
            _, length, prompt_len = self.store.sequences[self.store.position[n]]
            counts += torch.bincount(self.store.tokens(n)[prompt_len:length], minlength=len(counts)).double()
        return counts

    def save_checkpoint(self) -> None:
        if not self.acc.is_main_process:
            return
        head = self.acc.unwrap_model(self.head)
        state = {"step": self.step, "head": own_state(head, self.target), "opt": self.opt.state_dict(),
                 "sched": self.sched.state_dict(), "kind": head.kind}
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{CHECKPOINT}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out / CHECKPOINT)

    def load_checkpoint(self) -> bool:
        path = self.out / CHECKPOINT
        if not path.is_file():
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except (RuntimeError, EOFError, OSError) as err:
            raise UserError(f"{path} cannot be read ({err}); delete it to start over") from None
        if state.get("kind") != self.head.kind:
            raise UserError(f"{path} is a '{state.get('kind')}' checkpoint, not '{self.head.kind}'")
        missing, unexpected = self.head.load_state_dict(state["head"], strict=False)
        lacking = set(own_state(self.head, self.target)) - set(state["head"])
        if unexpected or lacking:
            raise UserError(f"{path} does not fit this head (unexpected {unexpected[:3]}, missing "
                            f"{sorted(lacking)[:3]}); delete it or give the options it was made with")
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.step = int(state["step"])
        return True

    def _average_gradients(self) -> None:
        """Several processes: every process holds the same head; average its gradients (one all-reduce each)."""
        if self.acc.num_processes == 1:
            return
        import torch.distributed as dist
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= self.acc.num_processes

    def train(self, progress: bool = True) -> dict[str, float]:
        """Run from self.step to cfg.steps. Returns the mean loss and figures of the last 20 steps."""
        self.store.ensure(self.layers, progress=progress and self.acc.is_main_process)
        head, opt = self.head, self.opt
        batches = epochs(self.lengths, self.cfg.batch_tokens, self.cfg.seed)
        for _ in range(self.step * self.acc.num_processes):       # the same data order after a resume
            next(batches)
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {head.kind}", unit="step",
                   file=sys.stderr, disable=not progress or not self.acc.is_main_process)
        recent: list[dict[str, float]] = []
        head.train()
        while self.step < self.cfg.steps:
            group = [next(batches) for _ in range(self.acc.num_processes)][self.acc.process_index]
            batch = self.store.batch(group, self.layers, self.acc.device)
            with self.acc.autocast():
                loss, figures = head.training_loss(batch, self.target)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            self._average_gradients()
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip)
            opt.step()
            self.sched.step()
            self.step += 1
            recent = (recent + [{"loss": float(loss.detach()), **figures}])[-20:]
            bar.update(1)
            bar.set_postfix({k: f"{v:.3g}" for k, v in recent[-1].items()})
            if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                self.save_checkpoint()
        bar.close()
        head.eval()
        return {k: sum(r[k] for r in recent) / len(recent) for k in recent[0]} if recent else {}
