"""A small LoRA fine-tune, to try spekit's adapter support on a model you have (it is not a training recipe):

    python scripts/make_lora.py --model smollm2-135m --out runs/lora-pydoc [--steps 60] [--rank 8]

It teaches the model passages of Python's reference documentation (`pydoc_data.topics`, on every machine with
Python), as a user's domain fine-tune would, and saves a PEFT adapter whose adapter_config.json names --model as
its base. Then `spekit generate --model runs/lora-pydoc --method rest --compare "..."`.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from peft import LoraConfig, get_peft_model
from pydoc_data.topics import topics

from spekit.backends.torch_models import load_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--length", type=int, default=256, help="tokens a training sequence")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    loaded = load_model(args.model)
    ids = loaded.tokenizer("\n\n".join(topics[k] for k in sorted(topics))).input_ids
    model = get_peft_model(loaded.model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.base_model.model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)
    rng = random.Random(0)
    start = time.time()
    for step in range(1, args.steps + 1):
        starts = [rng.randrange(len(ids) - args.length) for _ in range(args.batch)]
        batch = torch.tensor([ids[s:s + args.length] for s in starts])              # [B, L]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == 1:
            print(f"step {step}/{args.steps} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.save_pretrained(args.out)
    print(f"saved {args.out} (base {args.model})")


if __name__ == "__main__":
    main()
