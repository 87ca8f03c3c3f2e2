"""Medusa: lossless (plain greedy exactly, batched; sampled outputs follow the target), the opt-in typical rule
labelled lossy, tree construction from accuracies, training makes the loss fall, vLLM export round-trips, and
bad input gives clear errors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from spekit import proposers
from spekit.acceptance import TypicalAcceptance, verify
from spekit.config import SamplingConfig, UserError
from spekit.engine import Engine
from spekit.heads.export_medusa import export_medusa, read_vllm_medusa
from spekit.heads import HEADS, FeatureBatch, load_head, save_head
from spekit.proposers.medusa import best_paths, default_accuracy
from spekit.backends.torch_target import Target
from spekit.tree import from_paths
from test_engine import DIST_PROMPT, DISTINCT, REPEATS, SHORT, V_SMALL, both_ways, first_two_exact
from conftest import PENALISED, penalised_greedy

N = 24
SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def random_heads(model, path, seed=0, scale=0.05, meta=None, **options):
    """Medusa heads with random blocks for `model`, saved to `path`."""
    target = Target(model)
    head = HEADS["medusa"].create(target, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "blocks" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return save_head(head, path, meta=meta or {})


@pytest.fixture(scope="module")
def llama_heads(llama, tmp_path_factory):
    return random_heads(llama, tmp_path_factory.mktemp("medusa") / "heads", num_heads=3)


@pytest.fixture(scope="module")
def small_heads(small_target, tmp_path_factory):
    """Heads for the 8-token model (untrained: each guesses the target's next-token distribution, right about half
    the time here), with a small tree and accuracies that make the whole tree pay under the prior cost."""
    meta = {"tree": SMALL_TREE, "accuracy": [[0.9, 0.9, 0.9]] * 3}
    return random_heads(small_target, tmp_path_factory.mktemp("medusa") / "small", num_heads=3, scale=0.0, meta=meta)


def medusa(model, heads, **options) -> Engine:
    target = Target(model)
    cls = proposers.get("medusa")
    return Engine(target, cls(target, cls.Options(heads=str(heads), **options)))


@pytest.fixture
def fixed_cost(monkeypatch):
    from spekit.pacing.step_costs import StepCosts

    def fix(cost: float) -> None:
        monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else cost)
    return fix


# --- lossless -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("acceptance", ["lossless", "typical"])
def test_medusa_reproduces_plain_greedy_batched(llama, llama_heads, reference, fixed_cost, acceptance):
    """Rows of different lengths, two samples each, decoded together, trees drafted at every step."""
    fixed_cost(1.0)
    prompts = [DISTINCT, REPEATS, SHORT]
    eng = medusa(llama, llama_heads, acceptance=acceptance, tree_size=16)
    results = eng.generate(prompts, SamplingConfig(max_new_tokens=N, n=2))
    for r in results:
        assert r.token_ids == reference(llama, r.prompt_ids, N), (r.prompt_index, r.sample_index)
    assert all(sum(r.stats.position_offered) > 0 for r in results), "trees were drafted"


def test_medusa_backs_off_to_plain_steps_when_drafts_do_not_pay(llama, llama_heads, reference, fixed_cost):
    fixed_cost(50.0)
    [r] = medusa(llama, llama_heads).generate([DISTINCT], SamplingConfig(max_new_tokens=N))
    assert r.token_ids == reference(llama, DISTINCT, N)
    assert sum(r.stats.position_offered) == 0


def test_heads_that_do_not_pay_rest_and_the_next_generation_starts_from_what_was_learnt(
        llama, llama_heads, reference, fixed_cost, monkeypatch):
    """Greedy: a step where no tree pays makes the heads rest (4, 8, ... 64 plain steps with the heads idle); the
    output stays exact; a new greedy generation starts from the accuracies learnt, not the stored ones."""
    fixed_cost(50.0)
    eng = medusa(llama, llama_heads)
    runs = []
    forward = type(eng.proposer.head).forward
    monkeypatch.setattr(type(eng.proposer.head), "forward",
                        lambda self, *a, **k: runs.append(1) or forward(self, *a, **k))
    [r] = eng.generate([DISTINCT], SamplingConfig(max_new_tokens=40))
    assert r.token_ids == reference(llama, DISTINCT, 40)
    assert 0 < len(runs) <= 4                                  # of 40 steps: probes at 1, 6, 15, 32
    starts = []
    begin = type(eng.proposer).begin
    monkeypatch.setattr(type(eng.proposer), "begin", lambda self, ctx, hidden=None: begin(self, ctx, hidden)
                        or starts.append(self.hits[0] / self.seen[0, :, None]))
    eng.generate([SHORT], SamplingConfig(max_new_tokens=4))
    eng.generate([SHORT], SamplingConfig(max_new_tokens=4, temperature=1.0))
    prior = eng.proposer.prior
    assert not torch.allclose(starts[0], prior) and torch.allclose(starts[1], prior)


@pytest.mark.parametrize("config", ["t1", "all", "openai"])
def test_sampled_tokens_follow_the_target_distribution(follows, small_target, small_heads, fixed_cost, config):
    """Several point-mass siblings per node (top-3 of each head): the recursive rejection keeps the target's law."""
    fixed_cost(1.0)
    base = {"t1": SamplingConfig(temperature=1.0),
            "all": SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
            "openai": SamplingConfig(temperature=1.0, frequency_penalty=0.8, presence_penalty=0.5,
                                     logit_bias=((2, -100.0), (5, 0.6)))}[config]
    cfg = dataclasses.replace(base, max_new_tokens=2, n=4000, seed=7)
    results = medusa(small_target, small_heads).generate([DIST_PROMPT], cfg)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(small_target, DIST_PROMPT, cfg).flatten())
    both_ways(results, 3000)


def test_batch_rows_equal_single_runs_under_sampling(small_target, small_heads):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=12, n=2, seed=3)
    prompts = [DIST_PROMPT, [1, 2, 3], [5]]
    batch = medusa(small_target, small_heads).generate(prompts, cfg)
    alone = [r for p in prompts for r in medusa(small_target, small_heads).generate([p], cfg)]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


def test_point_mass_siblings_walk_is_exact(follows):
    """The decider alone: three point-mass siblings under the root, one row per sample; the first token (accepted
    or recovered) is distributed as p."""
    rows = 4000
    p = torch.tensor([0.1, 0.4, 0.3, 0.15, 0.05])
    tree = from_paths(torch.zeros(rows, dtype=torch.long), [[0], [1], [2]], torch.tensor([[1, 2, 3]] * rows))
    logits = p.log()[None, None].expand(rows, 4, 5)
    gens = [torch.Generator().manual_seed(s) for s in range(rows)]
    v = verify(tree, logits, SamplingConfig(temperature=1.0), None, gens)
    first = torch.where(v.accepted > 0, tree.tokens.gather(1, v.path[:, 1:2].clamp(min=0))[:, 0], v.next_token)
    follows(first, p, wrong=torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3, 0.0]))


# --- the lossy opt-in is labelled ---------------------------------------------------------------------------------

def test_typical_acceptance_is_labelled_lossy(llama, llama_heads):
    eng = medusa(llama, llama_heads, acceptance="typical", typical_epsilon=0.2, typical_delta=0.5)
    assert eng.proposer.lossless is False and eng.proposer.lossy_rule == TypicalAcceptance(0.2, 0.5)
    [r] = eng.generate([DISTINCT], SamplingConfig(max_new_tokens=8, temperature=1.0))
    assert r.stats.lossless is False and r.as_dict()["lossless"] is False
    [ok] = medusa(llama, llama_heads).generate([DISTINCT], SamplingConfig(max_new_tokens=8))
    assert ok.stats.lossless is True and ok.as_dict()["lossless"] is True
    assert "LOSSY" in proposers.get("medusa").help


def test_typical_rule_accepts_by_threshold():
    """Under sampling: a draft token with p above min(epsilon, delta * exp(-H)) is accepted, one below is not."""
    p = torch.tensor([0.5, 0.45, 0.05, 0.0])
    tree = from_paths(torch.tensor([0]), [[0], [0, 0]], torch.tensor([[1, 2]]))
    logits = p.clamp(min=1e-9).log()[None, None].expand(1, 3, 4)
    gens = [torch.Generator().manual_seed(0)]
    v = verify(tree, logits, SamplingConfig(temperature=1.0), None, gens, lossy=TypicalAcceptance(0.09, 0.3))
    assert int(v.accepted[0]) == 1 and v.path[0, :2].tolist() == [0, 1]


# --- the static tree ----------------------------------------------------------------------------------------------

def test_tree_construction_from_accuracies():
    acc = [[0.6, 0.2], [0.5, 0.1]]
    assert best_paths(acc, 4) == [[0], [0, 0], [1], [1, 0]]
    paths = best_paths(default_accuracy(4), 64)
    assert len(paths) == 64 and len({tuple(p) for p in paths}) == 64
    from_paths(torch.tensor([0]), paths, torch.zeros(1, 64, dtype=torch.long))   # parents come first


def test_the_medusa_tree_command_rebuilds_the_stored_tree(llama, tmp_path, capsys):
    from spekit.commands import main
    heads = random_heads(llama, tmp_path / "h", num_heads=2, meta={"accuracy": [[0.6, 0.2], [0.5, 0.1]]})
    assert main(["medusa", "tree", str(heads), "--nodes", "3"]) == 0
    assert json.loads((heads / "config.json").read_text())["meta"]["tree"] == [[0], [0, 0], [1]]


# --- training -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_vocab", [0, 6])
def test_a_few_training_steps_make_the_loss_fall(small_target, draft_vocab):
    target = Target(small_target, fast=False)
    head = HEADS["medusa"].create(target, num_heads=2, draft_vocab=draft_vocab)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V_SMALL, (4, 32), generator=g)
    with torch.no_grad():
        hidden = small_target(tokens, output_hidden_states=True).hidden_states
    layer = head.feature_layers()[0]
    batch = FeatureBatch(tokens, torch.ones(4, 32, dtype=torch.bool), {layer: hidden[layer]})
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss, figures = head.training_loss(batch, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
    assert {"top1_0", "top5_0", "top1_1", "top5_1"} <= set(figures)


# --- export -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("share", [True, False])
def test_vllm_export_names_shapes_and_round_trip(llama, tmp_path, share):
    from safetensors.torch import load_file
    target = Target(llama)
    heads = random_heads(llama, tmp_path / "h", num_heads=3, share_lm_head=share, draft_vocab=64)
    out = export_medusa(heads, tmp_path / "vllm", "vllm", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["num_hidden_layers"] == 1
    assert config["truncated_vocab_size"] == 64 and config["original_lm_head"] is share
    state = load_file(str(out / "model.safetensors"))
    assert state["blocks.2.layers.0.weight"].shape == (64, 64) and state["blocks.0.layers.0.bias"].shape == (64,)
    assert state["token_map"].shape == (64,)
    lm = ["lm_heads.0.weight"] if share else [f"lm_heads.{h}.weight" for h in range(3)]
    assert sorted(k for k in state if k.startswith("lm_heads")) == lm
    assert state["lm_heads.0.weight"].shape == ((128, 64) if share else (64, 64))
    mine, back = load_head(heads, target), read_vllm_medusa(out, target)
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    weight = mine.output_weight(llama.lm_head.weight)
    draft = lambda head: head.to_tokens(head(h, weight).topk(4, dim=-1).indices)     # noqa: E731
    assert torch.equal(draft(mine), draft(back))


def test_sglang_export_says_it_has_no_medusa(llama, llama_heads, tmp_path):
    with pytest.raises(UserError, match="SGLang does not load Medusa"):
        export_medusa(llama_heads, tmp_path / "out", "sglang", target=Target(llama))


# --- bad input ----------------------------------------------------------------------------------------------------

def test_heads_for_another_model_are_refused(llama, llama_other_vocab, tmp_path):
    heads = random_heads(llama_other_vocab, tmp_path / "other", num_heads=2)
    with pytest.raises(UserError, match="another model"):
        medusa(llama, heads)


def test_truncated_weights_are_refused(llama, tmp_path):
    heads = random_heads(llama, tmp_path / "h", num_heads=2)
    data = (heads / "model.safetensors").read_bytes()
    (heads / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="corrupt or truncated"):
        medusa(llama, heads)


def test_a_tree_larger_than_the_context_is_refused(llama, tmp_path):
    paths = best_paths(default_accuracy(3, 20), 600)
    heads = random_heads(llama, tmp_path / "h", num_heads=3, meta={"tree": paths,
                                                                   "accuracy": default_accuracy(3, 20)})
    with pytest.raises(UserError, match="context"):
        medusa(llama, heads)


def test_no_heads_for_a_model_without_shipped_heads(llama):
    cls = proposers.get("medusa")
    with pytest.raises(UserError, match="--heads"):
        cls(Target(llama), cls.Options())


@pytest.mark.parametrize("options", [dict(tree_size=-1), dict(acceptance="fast"), dict(typical_epsilon=0.0)])
def test_bad_options_are_user_errors(options):
    with pytest.raises(UserError):
        proposers.get("medusa").Options(**options)


# --- the bundled model with the shipped heads ---------------------------------------------------------------------

@pytest.mark.slow
def test_shipped_heads_reproduce_plain_greedy_on_the_bundled_model():
    from spekit.api import Spekit
    from spekit.heads.base import SHIPPED
    if not (SHIPPED / "smollm2-135m" / "medusa" / "config.json").is_file():
        pytest.skip("no shipped Medusa heads")
    sk = Spekit.load("smollm2-135m")
    ids = [sk.encode("Write a Python function that returns the squares of a list of numbers."),
           sk.encode("Explain what a hash table is.")]
    cfg = SamplingConfig(max_new_tokens=32)
    plain = sk.engine.generate(ids, cfg)
    medusa_sk = sk.with_method("medusa")
    assert [r.token_ids for r in medusa_sk.engine.generate(ids, cfg)] == [r.token_ids for r in plain]
    assert medusa_sk.engine.generate([ids[0]], cfg)[0].token_ids == plain[0].token_ids


def test_medusa_with_penalties_and_logit_bias_equals_plain(llama, llama_heads, fixed_cost):
    fixed_cost(1.0)
    prompts = [DISTINCT, REPEATS, SHORT]
    results = medusa(llama, llama_heads, tree_size=16).generate(prompts, PENALISED)
    assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in prompts]
    assert all(sum(r.stats.position_offered) > 0 for r in results), "trees were drafted"
