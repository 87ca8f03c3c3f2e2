"""Classic draft-model speculative sampling, written by hand on the public transformers API.

The textbook loop of Leviathan et al. (2023) and Chen et al. (2023): a small draft model proposes k tokens, the
target model checks all of them in one forward, and a rejection rule keeps the output distributed exactly as the
target's (at temperature 0: identical to greedy decoding of the target). It imports nothing from spekit.

Cache bookkeeping: `seq` holds every committed token (prompt + output). Its last token, the "pending" one, is in
neither cache; each step feeds it first. Both caches are cropped back to committed tokens after every step.

    python examples/handrolled_speculative.py --target HuggingFaceTB/SmolLM2-360M --draft HuggingFaceTB/SmolLM2-135M
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()  # sliding-window layers (Gemma-3) can then still be cropped
    return cache


def forward(model, cache: DynamicCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed `tokens` [1, n] after what `cache` holds; return fp32 logits [1, n, V]."""
    return model(input_ids=tokens, cache=cache, use_cache=True).logits.float()


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Next-token distributions from `logits` [..., V]; at temperature 0 a point mass on the argmax."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def pick(probs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token from each row of `probs` [n, V]: argmax if greedy, else a sample. Returns [n]."""
    if temperature == 0:
        return probs.argmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def speculative_generate(target, draft, input_ids: list[int], max_new_tokens: int, k: int | list[int] = 4,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         eos_id: int | None = None, steps: list | None = None) -> list[int]:
    """Generate up to `max_new_tokens` ids after `input_ids` (not included in the result). k: tokens drafted per
    step, or a list of them, step by step (its last repeats). steps: if a list, each step appends (its drafted ids,
    how many of them were accepted)."""
    schedule = [k] if isinstance(k, int) else list(k)
    assert len(input_ids) >= 1 and schedule and min(schedule) >= 1 and temperature >= 0
    device = target.device
    seq = list(input_ids)
    target_cache, draft_cache = new_cache(target), new_cache(draft)
    if len(seq) > 1:  # prefill everything but the pending token
        prefix = torch.tensor([seq[:-1]], device=device)  # [1, P-1]
        forward(target, target_cache, prefix)
        forward(draft, draft_cache, prefix)

    step = 0
    while len(seq) - len(input_ids) < max_new_tokens:
        k = schedule[min(step, len(schedule) - 1)]
        # (1) Draft k tokens autoregressively. The first draft forward feeds every committed token the draft cache
        #     lacks: the pending token, plus the previous step's last draft token after a full acceptance.
        tokens = torch.tensor([seq[draft_cache.get_seq_length():]], device=device)  # [1, 1 or 2]
        drafted, q = [], []
        for _ in range(k):
            q_i = probs(forward(draft, draft_cache, tokens)[0, -1], temperature)  # [V]
            tokens = pick(q_i[None], temperature, generator)[None]  # [1, 1]
            drafted.append(tokens[0, 0])
            q.append(q_i)
        drafted, q = torch.stack(drafted), torch.stack(q)  # [k], [k, V]

        # (2) One target forward over [pending, *drafted]: row i scores the token after drafted[:i].
        verify = torch.cat([torch.tensor([seq[-1]], device=device), drafted])[None]  # [1, k+1]
        p = probs(forward(target, target_cache, verify)[0], temperature)  # [k+1, V]

        # (3) Accept drafted[i] with probability min(1, p(x)/q(x)); greedy: while it equals argmax p.
        #     For one-hot p and q that rule is the same: accept iff p(x) = 1.
        p_x = p[:-1].gather(-1, drafted[:, None]).squeeze(-1)  # [k]
        q_x = q.gather(-1, drafted[:, None]).squeeze(-1)  # [k]
        u = torch.rand(k, generator=generator, device=device) if temperature > 0 else torch.zeros(k, device=device)
        accepted = u * q_x < p_x  # [k]
        n = int(accepted.long().cumprod(0).sum())  # accepted prefix length, 0..k (one host sync per step)

        # (4) The token after the accepted prefix: on a rejection a sample from norm(max(p - q, 0)), the recovered
        #     token (greedy: argmax p); after a full acceptance a bonus token from p at the last position.
        if n < k:
            residual = (p[n] - q[n]).clamp(min=0)  # [V]; multinomial normalizes it
            last = pick((residual if residual.sum() > 0 else p[n])[None], temperature, generator)
        else:
            last = pick(p[k][None], temperature, generator)
        new = drafted[:n].tolist() + last.tolist()
        if steps is not None:
            steps.append((drafted.tolist(), n))

        # (5) Roll back both caches to the committed tokens, all but the new pending one. The target cache holds
        #     pending + k drafts; the draft cache holds pending + the first k-1 drafts (the last was never fed).
        target_cache.crop(-(k - n))
        if n < k - 1:
            draft_cache.crop(-(k - 1 - n))

        new = new[:max_new_tokens - (len(seq) - len(input_ids))]  # stop at max_new_tokens ...
        if eos_id in new:  # ... or just after the first eos
            seq += new[:new.index(eos_id) + 1]
            break
        seq += new
        step += 1
    return seq[len(input_ids):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="HF folder or hub id of the target model")
    parser.add_argument("--draft", required=True, help="HF folder or hub id of a smaller model, same tokenizer")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    ids = tokenizer(args.prompt).input_ids
    out = speculative_generate(target, draft, ids, args.max_new_tokens, k=args.k, temperature=args.temperature,
                               generator=torch.Generator().manual_seed(args.seed), eos_id=tokenizer.eos_token_id)
    print(args.prompt + tokenizer.decode(out, skip_special_tokens=True))


if __name__ == "__main__":
    main()
