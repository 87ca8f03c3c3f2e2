"""Tiny random models built from configs (no downloads); the reference decoder the guarantees are stated against
(transformers' own `generate(do_sample=False)`); the goodness-of-fit check the statistical tests share."""
from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from spekit import proposers
from spekit.pacing import Budget, profiles
from spekit.pacing import pacer as pacer_module
from spekit.config import SamplingConfig
from spekit.pacing.governor import Governor
from spekit.pacing.step_costs import StepCosts
from spekit.engine import Engine
from spekit.backends.decoder_layers import Stack
from spekit.proposers.draft_model import DraftModel
from spekit.backends.torch_target import Target
from spekit.backends.draft_vocab import reduce_head


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core this process may run on (psutil counts the host's, not the container's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Under pytest-xdist each worker gets its share of the cores: torch's default (all of them in every worker) makes
# the workers fight over them and runs slower than one process.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, pytest_xdist_auto_num_workers(None) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


VOCAB = 128
MAX_POSITIONS = 512
WINDOW = 8


def tiny_llama(seed: int, layers: int = 2, vocab: int = VOCAB, hidden: int = 64,
               logit_scale: float = 1.0) -> LlamaForCausalLM:
    """A random Llama in eval mode, fp32. `logit_scale` sharpens the output distributions (a random init gives
    nearly uniform ones, which would make a distribution test blind to context)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_POSITIONS)
    model = LlamaForCausalLM(config).float().eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


def tiny_gemma3(seed: int, window: int = WINDOW) -> Gemma3ForCausalLM:
    """A random Gemma 3 text model mixing sliding-window (window 8) and full-attention layers."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                              max_position_embeddings=MAX_POSITIONS, sliding_window=window,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return Gemma3ForCausalLM(config).float().eval()


@torch.inference_mode()
def plain_greedy_hf(model, ids: list[int], n: int, repetition_penalty: float = 1.0) -> list[int]:
    """The reference: n new tokens of transformers' greedy decoding (no EOS, so exactly n). New ids only."""
    # eos_token_id=[]: None would be filled in from the model's defaults (Llama's EOS is id 2)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, pad_token_id=0, eos_token_id=[],
                         repetition_penalty=repetition_penalty)
    new = out[0, len(ids):].tolist()
    assert len(new) == n
    return new


# OpenAI's sampling options under greedy decoding, and a repetition penalty with them: the settings every method's
# output must keep exact (each tree node is processed with its own path's counts)
PENALISED = SamplingConfig(max_new_tokens=16, repetition_penalty=1.2, frequency_penalty=0.6, presence_penalty=0.3,
                           logit_bias=((8, 2.0), (9, -100.0)))


@torch.inference_mode()
def penalised_greedy(model, ids: list[int], cfg: SamplingConfig = PENALISED) -> list[int]:
    """Greedy decoding written out from the definitions, one full forward per token: logit bias, the repetition
    penalty over prompt and answer (as transformers), then minus count * frequency_penalty and presence_penalty
    for each token the answer holds (as OpenAI)."""
    out: list[int] = []
    for _ in range(cfg.max_new_tokens):
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        for tok, bias in cfg.logit_bias:
            logits[tok] += bias
        for tok in set(ids + out):
            r = cfg.repetition_penalty
            logits[tok] = logits[tok] * r if logits[tok] < 0 else logits[tok] / r
        for tok in set(out):
            logits[tok] -= out.count(tok) * cfg.frequency_penalty + cfg.presence_penalty
        out.append(int(logits.argmax()))
    return out


def make_engine(method: str, model, draft_model=None, stop_ids: tuple[int, ...] = (), **options) -> Engine:
    """An engine for `method` over `model`, with `draft_model` wrapped as its draft when given."""
    cls = proposers.get(method)
    target = Target(model)
    draft = None if draft_model is None else Target(draft_model)
    return Engine(target, cls(target, cls.Options(**options), draft), stop_ids=stop_ids)


def tv_noise(p: torch.Tensor, n: int) -> float:
    """Expected total-variation distance of an n-sample empirical distribution from p [K]."""
    p = p.double()
    return 0.5 * float((2 * p * (1 - p) / (math.pi * n)).sqrt().sum())


def assert_follows(codes: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor | None = None) -> None:
    """Samples codes [n] (outcome ids) follow expected [K]: nothing lands outside its support; the total-variation
    distance is within 2.5x the expected sampling noise; Pearson's chi-square (cells expecting < 5 draws pooled)
    is within 5 standard deviations of its mean. The seeds are fixed; under the null hypothesis either bound fails
    with probability well below 1e-4. `wrong` [K], what a broken decider would give, must lie far outside."""
    n = codes.shape[0]
    counts = torch.bincount(codes, minlength=expected.shape[0]).double()
    exp = expected.double() / expected.sum()
    assert counts[exp == 0].sum() == 0, "an outcome of probability 0 came out"
    noise = tv_noise(exp, n)
    tv = 0.5 * float((counts / n - exp).abs().sum())
    assert tv < 2.5 * noise, f"TV {tv:.4f} >= 2.5 x expected noise {noise:.4f}"
    big = exp * n >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    want = torch.cat([exp[big], exp[~big].sum()[None]]) * n
    keep = want > 0
    chi2 = float(((obs[keep] - want[keep]) ** 2 / want[keep]).sum())
    dof = int(keep.sum()) - 1
    z = (chi2 - dof) / math.sqrt(2 * dof)
    assert z < 5, f"chi-square {chi2:.1f} with {dof} degrees of freedom (z = {z:.1f})"
    if wrong is not None:
        assert 0.5 * float((wrong.double() - exp).abs().sum()) > 8 * noise, "the test could not tell"


@pytest.fixture(scope="session")
def follows():
    return assert_follows


@pytest.fixture(autouse=True)
def draft_models_cost_nothing(monkeypatch):
    """The `draft` method paces itself by the draft's cost (its share of the target's weights); a tiny test draft
    is as large as its target, so it would rightly never draft and the guarantees would be tested on plain steps.
    Every test sees free draft models; test_costs.py checks the pacing itself."""
    monkeypatch.setattr(DraftModel, "draft_cost", lambda self: 0.0)


@pytest.fixture(autouse=True)
def drafting_time_unmeasured(monkeypatch):
    """Chain drafters charge what drafting took by the clock (Budget.spent, greedy); on tiny random models it
    is dear and they would rightly stop drafting. test_costs.py tests that pacing itself."""
    monkeypatch.setattr(Budget, "spent", lambda self: None)


@pytest.fixture(autouse=True)
def governor_off(monkeypatch):
    """The engine's governor (pacing.governor.Governor) holds speculation back while drafting is slower than plain steps, by
    the clock; on tiny random models it usually is, and the tests of what proposers draft would see plain steps.
    test_costs.py tests the governor itself, and that held steps keep the output exact."""
    monkeypatch.setattr(Governor, "allows", lambda self: True)


@pytest.fixture(autouse=True)
def tied_rows_draft(monkeypatch):
    """A static batch drafts only while at most pacer.MOST_BEHIND rows are furthest from their end; the tests of
    batched drafting (exactness, batch independence) use 3+ equal rows, so every test lets tied rows draft.
    test_costs.py tests the rule itself."""
    monkeypatch.setattr(pacer_module, "MOST_BEHIND", 1 << 20)


@pytest.fixture(autouse=True)
def cost_profiles_apart(monkeypatch, tmp_path):
    """Step costs kept between runs (spekit.pacing.profiles) go to this test's own folder: a test never reads what an
    earlier test or the user's own runs measured, nor writes into the user's cache."""
    monkeypatch.setattr(profiles, "default_path", lambda key, folder: tmp_path / "costs" / "profile.json")


@pytest.fixture(scope="session")
def llama():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def llama_draft():
    """An unrelated 1-layer draft of the same vocabulary: most of its tokens get rejected."""
    return tiny_llama(seed=1, layers=1)


@pytest.fixture(scope="session")
def gemma_sliding():
    return tiny_gemma3(seed=0)


@pytest.fixture(scope="session")
def gemma_wide():
    """gemma_sliding's weights with a window longer than any test text."""
    return tiny_gemma3(seed=0, window=MAX_POSITIONS)


@pytest.fixture(scope="session")
def gemma_draft():
    return tiny_gemma3(seed=1)


@pytest.fixture(scope="session")
def llama_other_vocab():
    return tiny_llama(seed=1, layers=1, vocab=96)


@pytest.fixture(scope="session")
def small_target():
    """A sharp 8-token model whose distributions depend strongly on the context (for distribution tests)."""
    return tiny_llama(seed=2, vocab=8, logit_scale=10)


@pytest.fixture(scope="session")
def small_drafts(small_target):
    """Drafts for small_target: a noisy copy (accepts often, not always) and an unrelated model (rarely)."""
    noisy = copy.deepcopy(small_target)
    torch.manual_seed(9)
    with torch.no_grad():
        for p in noisy.parameters():
            if p.numel() > 1:
                p.add_(torch.randn_like(p) * 0.6 * p.std())
    reduced = copy.deepcopy(noisy)
    reduce_head(reduced, [0, 2, 3, 5, 6])       # a draft vocabulary: it can never propose 1, 4 or 7
    return {"noisy_copy": noisy, "unrelated": tiny_llama(seed=3, layers=1, vocab=8, logit_scale=10),
            "reduced_vocab": reduced}


@pytest.fixture(scope="session")
def reference():
    """plain_greedy_hf as a fixture, memoised: (model, prompt, n, repetition_penalty=1.0) -> new ids."""
    memo: dict = {}

    def ref(model, ids: list[int], n: int, repetition_penalty: float = 1.0) -> list[int]:
        key = (id(model), tuple(ids), n, repetition_penalty)
        if key not in memo:
            memo[key] = plain_greedy_hf(model, ids, n, repetition_penalty)
        return memo[key]
    return ref


@pytest.fixture(scope="session")
def engine_for():
    return make_engine


@pytest.fixture
def always_draft(monkeypatch):
    """Verifying k tokens costs what one does and self-drafts are free, so every method drafts its widest at every
    step (on tiny random models the cost models would rightly back off, and the tests would exercise nothing)."""
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0)
    monkeypatch.setattr(Stack, "relative_cost", lambda self, layers: 0.0)


@pytest.fixture
def forward_widths(monkeypatch):
    """The new tokens per row of every target forward, in order (the prefill first)."""
    from spekit.backends.torch_target import Target
    widths: list[int] = []
    target_forward = Target.forward

    def spy(self, kv, tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return target_forward(self, kv, tokens, *args, **kwargs)
    monkeypatch.setattr(Target, "forward", spy)
    return widths


# --- tiny targets saved in a folder, for drafters that name the model they were made for (tests/test_speculators.py,
# tests/test_published.py) ---------------------------------------------------------------------------------------

def saved(model, directory: Path):
    """The model saved and loaded back from `directory` (so it names that folder: the verifier a drafter names)."""
    model.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def saved_llama(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return saved(LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp("llama-saved") / "target")


@pytest.fixture(scope="session")
def saved_qwen3(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return saved(Qwen3ForCausalLM(config).eval(), tmp_path_factory.mktemp("qwen3-saved") / "target")
