"""The hand-rolled textbook example (examples/handrolled_speculative.py) keeps its guarantees on tiny random models."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "handrolled_speculative.py"
PROMPTS = [[1], [5, 17, 42, 9, 3], list(range(2, 40, 3))]


def load_example():
    spec = importlib.util.spec_from_file_location("handrolled_speculative", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hr = load_example()


def tiny_llama(seed: int, layers: int = 2, vocab: int = 128, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).float().eval()


@torch.inference_mode()
def plain_greedy(model, ids: list[int], n: int) -> list[int]:
    """Reference: n tokens of greedy decoding, one cached forward per token. Returns the new ids only."""
    cache = DynamicCache(config=model.config)
    tokens = torch.tensor([ids], device=model.device)  # [1, P]
    out = []
    for _ in range(n):
        logits = model(input_ids=tokens, cache=cache, use_cache=True).logits  # [1, len(tokens), V]
        tokens = logits[:, -1:].argmax(-1)  # [1, 1]
        out.append(int(tokens))
    return out


def noisy_copy(model, scale: float = 0.005, seed: int = 7) -> LlamaForCausalLM:
    """A draft that agrees with `model` often but not always: partial acceptances, 0 < n < k."""
    noisy = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn_like(param) * scale)
    return noisy


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft():
    """An unrelated random draft: nearly every draft token is rejected."""
    return tiny_llama(seed=1, layers=1)


@pytest.fixture(scope="module")
def close_draft(target):
    return noisy_copy(target)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("which", ["draft", "close_draft"])
def test_greedy_equals_plain_greedy(request, target, which, prompt, k):
    drafter = request.getfixturevalue(which)
    assert hr.speculative_generate(target, drafter, prompt, 30, k=k) == plain_greedy(target, prompt, 30)


def test_close_draft_gives_partial_acceptance(target, close_draft, monkeypatch):
    """Guards the test above: with the close draft, steps accept some but not all of the k draft tokens."""
    verifies = []
    forward = hr.forward

    def spy(model, cache, tokens):
        verifies.append(model is target and tokens.shape[1] == 5)
        return forward(model, cache, tokens)

    monkeypatch.setattr(hr, "forward", spy)
    hr.speculative_generate(target, close_draft, PROMPTS[1], 30, k=4)
    assert 30 / 5 < sum(verifies) < 30


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_perfect_draft_greedy_equals_plain_greedy(target, prompt, k):
    assert hr.speculative_generate(target, target, prompt, 30, k=k) == plain_greedy(target, prompt, 30)


def test_max_new_tokens_and_eos(target, draft):
    prompt = PROMPTS[1]
    expected = plain_greedy(target, prompt, 30)
    for n in (1, 2, 5, 13):  # truncation inside a step
        assert hr.speculative_generate(target, draft, prompt, n, k=4) == expected[:n]
    eos = expected[6]
    out = hr.speculative_generate(target, draft, prompt, 30, k=4, eos_id=eos)
    assert out == expected[:expected.index(eos) + 1]


def test_same_seed_same_sample(target, draft):
    def run(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return hr.speculative_generate(target, draft, PROMPTS[1], 30, k=4, temperature=1.0, generator=g)

    first = run(123)
    assert len(first) == 30 and all(0 <= t < 128 for t in first)
    assert run(123) == first
    assert run(124) != first


def test_first_token_follows_target_distribution():
    """Rejection sampling is lossless: the first sampled token is distributed as the target's p, not the draft's q."""
    target, draft = tiny_llama(seed=2, vocab=8), tiny_llama(seed=3, vocab=8)
    with torch.no_grad():  # spread the near-uniform logits: p and q then differ clearly (TV ~0.4)
        target.lm_head.weight.mul_(3)
        draft.lm_head.weight.mul_(3)
    prompt = [1, 2, 3]
    with torch.inference_mode():
        p = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)  # [V]
        q = torch.softmax(draft(input_ids=torch.tensor([prompt])).logits[0, -1], -1)  # [V]
    g = torch.Generator().manual_seed(0)
    n = 1500
    counts = torch.zeros(8)
    for _ in range(n):
        counts[hr.speculative_generate(target, draft, prompt, 1, k=2, temperature=1.0, generator=g)[0]] += 1
    assert 0.5 * (p - q).abs().sum() > 0.3, "the test needs a draft that differs from the target"
    assert 0.5 * (counts / n - p).abs().sum() < 0.05, (counts / n, p)  # sampling noise alone: TV ~0.026


def test_handrolled_and_spekit_draft_and_accept_the_same_tokens(target, close_draft):
    """The textbook loop and spekit's engine, given the same target and the same close draft, draft the same tokens
    at every step and accept the same prefix of them, and both give plain greedy's output. The engine sizes its
    drafts step by step; the loop is given the engine's sizes. The draft agrees often but not always, so the
    comparison covers full, partial and empty acceptances (asserted)."""
    from spekit.backends.torch_target import Target
    from spekit.config import SamplingConfig
    from spekit.engine import Engine
    from spekit.proposers import get

    prompt, n = [5, 17, 42, 9, 3, 88], 40
    cls = get("draft")
    tgt = Target(target, cost_profile="flat")          # never held back: every step drafts
    engine = Engine(tgt, cls(tgt, cls.Options(num_draft_tokens=4, max_draft_tokens=6, confidence=0.0),
                             Target(close_draft, cost_profile="flat")))
    drafted = []
    propose = engine.proposer.propose

    def spy(ctx):
        tree = propose(ctx)
        drafted.append(tree.tokens[0, 1:].tolist())          # the drafted chain, without the root
        return tree

    engine.proposer.propose = spy
    result = engine.generate([prompt], SamplingConfig(max_new_tokens=n))[0]
    accepted = [gained - 1 for gained in result.stats.accept_lengths[1:]]   # [0]: the prefill's token
    assert len(accepted) == len(drafted) and all(drafted)

    first = result.token_ids[:1]     # the engine's prefill gives the first token: the loop starts drafting after it
    steps = []
    out = first + hr.speculative_generate(target, close_draft, prompt + first, n - 1,
                                          k=[len(d) for d in drafted], steps=steps)
    assert out == result.token_ids == plain_greedy(target, prompt, n)
    last = len(steps) - 1               # the last step is cut at max_new_tokens: compare its drafts only
    assert [d for d, _ in steps] == drafted
    assert [a for _, a in steps][:last] == accepted[:last]
    kinds = {("none" if a == 0 else "all" if a == len(d) else "some") for d, a in steps[:last]}
    assert kinds == {"none", "some", "all"}, kinds
