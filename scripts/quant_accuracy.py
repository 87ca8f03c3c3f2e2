"""How much weight-only quantization changes the model: the float32 model's greedy answers to Spec-Bench
questions, teacher-forced through the int8 and int4 models.

    python scripts/quant_accuracy.py [--model smollm2-135m] [--per-category 2] [--max-new-tokens 96]

Prints, per scheme: top-1 agreement with float32 over the answer tokens, mean KL(float32 || quantized) per
token, and how many answers the quantized model's own greedy decoding reproduces token for token.
"""
from __future__ import annotations

import argparse
import sys

import torch

from spekit.api import Spekit
from spekit.bench.questions import encode_turn, load_questions, pick
from spekit.config import SamplingConfig
from spekit.backends.torch_models import load_model


@torch.inference_mode()
def teacher_forced(sk: Spekit, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Log-probabilities [len(answer), V] of the model at each answer position."""
    ids = torch.tensor([prompt + answer])
    logits = sk.loaded.model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return logits.float().log_softmax(-1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    questions = pick(load_questions(None), args.per_category, None)
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens)
    ref = Spekit(load_model(args.model))
    prompts = [encode_turn(ref.tokenizer, [{"role": "user", "content": q["turns"][0]}], True) for q in questions]
    answers = [r.token_ids for r in ref.engine.generate(prompts, cfg)]
    ref_lp = [teacher_forced(ref, p, a) for p, a in zip(prompts, answers)]
    print(f"{args.model}: {len(prompts)} Spec-Bench questions, float32 greedy answers of up to "
          f"{args.max_new_tokens} tokens ({sum(map(len, answers))} tokens)")
    for scheme in ("int8", "int4"):
        sk = Spekit(load_model(args.model, quantize=scheme))
        agree = kl = total = 0.0
        for prompt, answer, want in zip(prompts, answers, ref_lp):
            got = teacher_forced(sk, prompt, answer)
            agree += float((got.argmax(-1) == want.argmax(-1)).sum())
            kl += float((want.exp() * (want - got)).sum())
            total += len(answer)
        same = sum(r.token_ids == a for r, a in zip(sk.engine.generate(prompts, cfg), answers))
        print(f"  {scheme}: top-1 agreement {agree / total:.1%}, KL {kl / total:.4f} nats/token, greedy answers "
              f"identical to float32 {same}/{len(prompts)}")


if __name__ == "__main__":
    sys.exit(main())
