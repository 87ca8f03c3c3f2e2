"""EAGLE-1/2 and EAGLE-3: lossless drafting over dynamic and static trees, training, export, drift check, bad input.
Heads are random (untrained) unless a test trains them: exactness does not depend on their quality."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

import spekit.proposers.eagle as eagle_proposer
from spekit.proposers.eagle_growth import Growth
import torch
from safetensors.torch import load_file

from spekit import proposers
from spekit.config import SamplingConfig, UserError
from spekit.heads.export import export, load_export
from spekit.heads import HEADS, FeatureBatch, load_head, save_head
from spekit.pacing import Budget
from spekit.backends.torch_target import Target
from test_engine import DIST_PROMPT, V_SMALL, both_ways, fixed_verify_cost  # noqa: F401  (fixture)
from conftest import PENALISED, penalised_greedy

PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 11, 4, 6, 9, 10, 3], [4, 4, 4, 4, 4, 4]]


def make_heads(model, directory, kind: str, seed: int = 0, sharpen: float = 1.0, **options):
    """A random head of `kind` for model, saved in directory; returns the path. sharpen > 1 scales its matrices
    (sharper, more confident draft distributions than the init gives)."""
    torch.manual_seed(seed)
    head = HEADS[kind].create(Target(model), **options)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.mul_(sharpen)
    return str(save_head(head, directory / kind))


@pytest.fixture(scope="module")
def heads(tmp_path_factory, llama, small_target):
    root = tmp_path_factory.mktemp("heads")
    out = {}
    # llama: confident heads (deep dynamic trees); small (8 tokens): flat heads, so the best nodes of a dynamic
    # tree are the root's children and drafts get accepted
    for name, model, sharpen in (("llama", llama, 3.0), ("small", small_target, 1.0)):
        d = root / name
        vocab = model.config.vocab_size
        out[name] = {"eagle": make_heads(model, d, "eagle", sharpen=sharpen),
                     "eagle3": make_heads(model, d, "eagle3", sharpen=sharpen, draft_vocab_size=vocab - 2,
                                          layers=(0, 1, 2)),
                     "eagle-vocab": vocab_heads(model, d, sharpen, vocab - 2)}
    return out


def vocab_heads(model, directory, sharpen: float, size: int) -> str:
    """The random eagle head of make_heads (the same seed) with a draft vocabulary: the `size` highest ids (the
    two lowest never counted), chosen as training chooses it."""
    path = make_heads(model, directory / "full", "eagle", sharpen=sharpen)
    head = load_head(path, Target(model)).reconfigured(draft_vocab=size)
    counts = torch.ones(model.config.vocab_size)
    counts[:model.config.vocab_size - size] = 0
    head.choose_vocab(counts)
    return str(save_head(head, directory / "eagle-vocab"))


def kind_of(method: str) -> str:
    """The head kind a method drafts with (eagle3-lookup: eagle3's)."""
    return method.split("-")[0]


# --- lossless: greedy output equals plain greedy, batched, both tree kinds -----------------------------------------

@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_a_draft_vocabulary_keeps_greedy_output_and_drafts_only_its_tokens(engine_for, heads, llama, tree, tmp_path,
                                                                           fixed_verify_cost):  # noqa: F811
    """An EAGLE-1 head over a reduced draft vocabulary drafts only its tokens, at a lower estimated cost per level,
    and the output is plain greedy's; the vocabulary is saved with the head and left out of an export."""
    fixed_verify_cost(1.0)
    vocab = llama.config.vocab_size
    loaded = load_head(heads["llama"]["eagle-vocab"], Target(llama))
    assert loaded.vocab_chosen and loaded.draft_ids.tolist() == list(range(2, vocab))
    eng = engine_for("eagle", llama, heads=heads["llama"]["eagle-vocab"], tree=tree, depth=4, branching=4,
                     total_tokens=12)
    full = engine_for("eagle", llama, heads=heads["llama"]["eagle"], tree=tree)
    assert eng.proposer.level_cost < full.proposer.level_cost
    seen = []
    propose = eng.proposer.propose
    eng.proposer.propose = lambda ctx: seen.append(propose(ctx)) or seen[-1]
    cfg = SamplingConfig(max_new_tokens=16)
    prompts = [[p % vocab for p in ids] for ids in PROMPTS]
    assert [r.token_ids for r in eng.generate(prompts, cfg)] == \
        [r.token_ids for r in engine_for("plain", llama).generate(prompts, cfg)]
    drafted = {t for tree_ in seen for t in tree_.tokens[:, 1:].flatten().tolist()}
    assert drafted and drafted <= set(range(2, vocab))
    back = load_export(export(heads["llama"]["eagle-vocab"], "vllm", tmp_path / "e1v"), Target(llama))
    assert back.draft_ids is None and "token_map" not in back.state_dict()


@pytest.mark.parametrize("tree", ["dynamic", "static"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3-lookup"])
@pytest.mark.parametrize("model_name", ["llama", "small"])
def test_greedy_output_equals_plain(engine_for, request, heads, method, tree, model_name,
                                   fixed_verify_cost, monkeypatch):  # noqa: F811
    fixed_verify_cost(1.0)     # full-size trees: the measured cost of this shared CPU does not shrink them
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)   # nor the heads' own cost
    model = request.getfixturevalue({"llama": "llama", "small": "small_target"}[model_name])
    prompts = [[p % model.config.vocab_size for p in ids] for ids in PROMPTS]
    cfg = SamplingConfig(max_new_tokens=16)
    plain = engine_for("plain", model).generate(prompts, cfg)
    top_k = 8 if model_name == "small" else 4      # small: the root's children cover the draft vocabulary
    eng = engine_for(method, model, heads=heads[model_name][kind_of(method)], tree=tree, depth=4,
                     branching=top_k, total_tokens=12)
    spec = eng.generate(prompts, cfg)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    if method == "eagle3-lookup":
        assert eng.proposer.grafted > 0, "the lookup added nodes to the head's trees"
    if model_name == "small" and tree == "dynamic":   # drafts get accepted, ragged across the batch
        assert sum(r.stats.tau for r in spec) / len(spec) > 1.5


def test_eagle3_lookup_with_token_recycling_equals_plain(engine_for, heads, llama, fixed_verify_cost,
                                                        monkeypatch):  # noqa: F811
    """`--recycle K` reaches eagle3-lookup's retrieval part: its table learns from the merged trees' logits."""
    fixed_verify_cost(1.0)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    cfg = SamplingConfig(max_new_tokens=16)
    plain = engine_for("plain", llama).generate(PROMPTS, cfg)
    eng = engine_for("eagle3-lookup", llama, heads=heads["llama"]["eagle3"], depth=4, branching=4, total_tokens=12,
                     recycle=4)
    assert eng.proposer.needs_logits
    for _ in range(2):
        assert [r.token_ids for r in eng.generate(PROMPTS, cfg)] == [r.token_ids for r in plain]
    assert eng.proposer.lookup.table, "the verified trees filled the table"


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafting_that_does_not_pay_rests_and_stays_exact(engine_for, heads, small_target, method,
                                                         fixed_verify_cost, monkeypatch):  # noqa: F811
    """Never slower than plain: when the head's own forwards cost more than its drafts can win, the proposer
    takes plain steps (the head idle) and tries again later; its output is still plain's."""
    fixed_verify_cost(1.0)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 50.0)
    prompts = [[p % small_target.config.vocab_size for p in ids] for ids in PROMPTS]
    cfg = SamplingConfig(max_new_tokens=24)
    plain = engine_for("plain", small_target).generate(prompts, cfg)
    eng = engine_for(method, small_target, heads=heads["small"][method], depth=4, branching=8, total_tokens=12)
    spec = eng.generate(prompts, cfg)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    forwards = sum(r.stats.target_forwards for r in spec)
    drafted = sum(sum(r.stats.position_offered) for r in spec)
    assert drafted <= forwards / 3      # mostly plain steps


def test_a_head_whose_drafting_takes_long_by_the_clock_drafts_less_and_stays_exact(engine_for, heads, small_target,
                                                                               fixed_verify_cost, monkeypatch):  # noqa: F811
    """The weights' ratio says a head level is nearly free; where the clock says each drafting step took three
    plain steps (an H200's host launching the head's small kernels one by one), the greedy dynamic tree charges
    that overhead from the generation's second drafting step on and mostly rests."""
    fixed_verify_cost(1.0)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    prompts = [[p % small_target.config.vocab_size for p in ids] for ids in PROMPTS]
    cfg = SamplingConfig(max_new_tokens=24)
    plain = engine_for("plain", small_target).generate(prompts, cfg)
    free = engine_for("eagle3", small_target, heads=heads["small"]["eagle3"], depth=4, branching=8, total_tokens=12)
    free_drafted = sum(sum(r.stats.position_offered) for r in free.generate(prompts, cfg))
    monkeypatch.setattr(Budget, "spent", lambda self: 3.0)
    eng = engine_for("eagle3", small_target, heads=heads["small"]["eagle3"], depth=4, branching=8, total_tokens=12)
    spec = eng.generate(prompts, cfg)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert eng.pacer.trees.overhead.value > 0.5
    assert sum(sum(r.stats.position_offered) for r in spec) < free_drafted / 2


@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3-lookup"])
def test_a_short_head_context_feeds_the_latest_entries_and_stays_exact(engine_for, heads, small_target, method,
                                                                       fixed_verify_cost, monkeypatch):  # noqa: F811
    """--head-context W: a catch-up feeds the head at most the W latest unseen entries of each row (the first one
    over a long prompt is the costly one), at their true positions; the output is still plain's, and the head's
    drafts still get accepted."""
    fixed_verify_cost(1.0)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    fed = []
    skip_old = eagle_proposer.Eagle._skip_old

    def recorded(self):
        skip_old(self)
        fed.append(max(len(t) for t in self.todo_tokens))
    monkeypatch.setattr(eagle_proposer.Eagle, "_skip_old", recorded)
    prompts = [[p % small_target.config.vocab_size for p in ids] for ids in PROMPTS]
    cfg = SamplingConfig(max_new_tokens=16)
    plain = engine_for("plain", small_target).generate(prompts, cfg)
    eng = engine_for(method, small_target, heads=heads["small"][kind_of(method)], depth=4, branching=8,
                     total_tokens=12, head_context=3)
    spec = eng.generate(prompts, cfg)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert fed and max(fed) <= 3
    assert sum(r.stats.tau for r in spec) / len(spec) > 1.5


# --- lossless under sampling: the first three tokens follow the target's distribution ----------------------------

@torch.inference_mode()
def first_three_exact(model, prompt: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """Exact distribution of the first three generated tokens under cfg (penalties counted over the generated
    tokens, as the engine does): [V, V, V]."""
    from spekit.sampling import seen_of, target_probs
    v, start = model.config.vocab_size, len(prompt)

    def probs(rows):
        seen = seen_of(rows, [start] * len(rows), cfg, v, "cpu")
        return target_probs(model(torch.tensor(rows)).logits[:, -1], cfg, seen)
    p0 = probs([prompt])[0]                                                                  # [V]
    p1 = probs([prompt + [a] for a in range(v)])                                             # [V, V]
    p2 = probs([prompt + [a, b] for a in range(v) for b in range(v)]).reshape(v, v, v)
    return p0[:, None, None] * p1[:, :, None] * p2


PENALTIES = dict(frequency_penalty=0.9, presence_penalty=0.4, logit_bias=((3, 0.8),))


@pytest.mark.parametrize("method,tree,temperature,top_p,penalties", [
    ("eagle", "dynamic", 0.7, 0.9, {}), ("eagle", "dynamic", 1.0, 0.95, {}), ("eagle", "static", 1.0, 0.95, {}),
    ("eagle3", "dynamic", 0.7, 0.9, {}), ("eagle3", "static", 0.7, 0.9, {}),
    ("eagle3-lookup", "dynamic", 1.0, 0.95, {}), ("eagle3", "dynamic", 1.0, 1.0, PENALTIES)])
def test_sampled_tokens_follow_the_target_distribution(engine_for, follows, small_target, heads, method, tree,
                                                       temperature, top_p, penalties, fixed_verify_cost,
                                                       monkeypatch):  # noqa: F811
    """penalties: OpenAI's, which the head's drafts know nothing of; the rule corrects for them at every node."""
    three_token_law(engine_for, follows, small_target, heads["small"][kind_of(method)], method, tree, temperature,
                    top_p, penalties, fixed_verify_cost, monkeypatch)


def test_a_draft_vocabulary_keeps_the_sampled_law(engine_for, follows, small_target, heads, fixed_verify_cost,
                                                  monkeypatch):  # noqa: F811
    """An EAGLE-1 head drafting over 6 of the 8 tokens: its q is zero at the other two, the rule stays exact."""
    three_token_law(engine_for, follows, small_target, heads["small"]["eagle-vocab"], "eagle", "dynamic", 1.0, 0.95,
                    {}, fixed_verify_cost, monkeypatch)


def three_token_law(engine_for, follows, small_target, head_dir, method, tree, temperature, top_p, penalties,
                    fixed_verify_cost, monkeypatch):  # noqa: F811
    """The first three tokens of 2500 samples follow the exact law; drafts at two levels were accepted."""
    fixed_verify_cost(1.0)
    # every level pays: sampled chains grow to full depth (a random head's chances would stop them at once)
    monkeypatch.setattr(Growth, "_row_rate", lambda self, cal, chance, depth: 2 + depth + 0 * chance)
    cfg = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=3, n=2500, seed=5, **penalties)
    eng = engine_for(method, small_target, heads=head_dir, tree=tree, depth=3, branching=4, total_tokens=9)
    results = eng.generate([DIST_PROMPT], cfg)
    if method == "eagle3-lookup":
        assert eng.proposer.grafted > 0, "point-mass lookup nodes sit beside the drawn ones"
    codes = torch.tensor([(r.token_ids[0] * V_SMALL + r.token_ids[1]) * V_SMALL + r.token_ids[2]
                          for r in results])
    follows(codes, first_three_exact(small_target, DIST_PROMPT, cfg).flatten())
    both_ways(results)
    deeper = sum(r.stats.position_accepted[1] for r in results if len(r.stats.position_accepted) > 1)
    assert deeper > 0, "second-level drafts get accepted too"


@pytest.mark.parametrize("method", ["eagle3", "eagle3-lookup"])
def test_sampled_chains_sized_by_their_own_costs_stay_exact(engine_for, follows, small_target, heads, method,
                                                            monkeypatch):
    """The sampled chain's depth is decided by the real rule (not patched) at a steep prior cost, with a head
    whose q puts 0.9 on one token and 0.1 on another at every node. Keeping a level only when its drawn token's
    own q is high would keep the likely token and drop the other (the 0.1 draw would then never be verified, and
    the accepted tokens would over-represent the likely one); the decision may only use what is known before the
    draw: the distribution it is drawn from and the levels above."""
    from spekit.pacing import priors
    for n, c in {2: 1.15, 4: 1.3, 8: 1.6, 16: 2.2}.items():
        monkeypatch.setitem(priors.PRIOR, n, c)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=3, n=4000, seed=7)
    eng = engine_for(method, small_target, heads=heads["small"]["eagle3"], depth=3)
    split = torch.full((V_SMALL - 2,), -30.0)
    split[0], split[1] = math.log(0.9), math.log(0.1)
    monkeypatch.setattr(eng.proposer.head, "draft_logits", lambda out, target: split.expand(*out.shape[:2], -1))
    results = eng.generate([DIST_PROMPT], cfg)
    codes = torch.tensor([(r.token_ids[0] * V_SMALL + r.token_ids[1]) * V_SMALL + r.token_ids[2]
                          for r in results])
    follows(codes, first_three_exact(small_target, DIST_PROMPT, cfg).flatten())
    offered = [sum(r.stats.position_offered[i] for r in results if len(r.stats.position_offered) > i)
               for i in range(2)]
    assert offered[0] > 0 and offered[1] > 0, "chains of one and more levels are verified"


@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3-lookup"])
def test_batch_rows_equal_single_runs_under_sampling(engine_for, llama, heads, method, monkeypatch):
    """A row's sample depends on its seed, sample index and prompt, not on its batch: each row sizes, rests and
    calibrates its own chain and draws random numbers only for the levels it keeps (the real sizing rule, at a
    steep prior cost, so that rows keep different depths and some rest)."""
    from spekit.pacing import priors
    from test_engine import BATCH, SAMPLED
    for n, c in {2: 1.0, 4: 1.1, 8: 1.25, 16: 1.5}.items():
        monkeypatch.setitem(priors.PRIOR, n, c)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    cfg = dataclasses.replace(SAMPLED, top_k=3, max_new_tokens=24)     # top-3: confident q, chains that pay

    def run(prompts):
        return engine_for(method, llama, heads=heads["llama"][kind_of(method)], depth=4).generate(prompts, cfg)
    batch = run(BATCH)
    alone = [r for p in BATCH for r in run([p])]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    offered = [tuple(r.stats.position_offered) for r in batch]
    assert len(set(offered)) > 1 and min(o[0] if o else 0 for o in offered) > 0, "every row drafted, differently"
    reordered = run(BATCH[::-1])
    assert [r.token_ids for r in reordered] == [r.token_ids for p in BATCH[::-1] for r in batch if r.prompt_ids == p]


# --- training ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_few_training_steps_lower_the_loss(kind):
    from conftest import tiny_llama
    llama = tiny_llama(seed=4, logit_scale=8)         # sharp distributions: far from the entropy floor
    target = Target(llama, fast=False)
    torch.manual_seed(0)
    options = {"draft_vocab_size": 100, "ttt_steps": 2} if kind == "eagle3" else {}
    head = HEADS[kind].create(target, **options)
    if kind == "eagle3":
        head.choose_vocab(torch.arange(128, 0, -1).float())
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = llama(tokens, output_hidden_states=True).hidden_states
    batch = FeatureBatch(tokens, torch.ones_like(tokens, dtype=torch.bool),
                         {i: hs[i] for i in set(head.feature_layers()) | {target.num_layers}})
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss, figures = head.training_loss(batch, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses   # the floor is the target's own entropy
    assert "loss" in figures


def test_choose_vocab_maps_draft_ids_to_the_most_frequent_tokens(llama):
    head = HEADS["eagle3"].create(Target(llama), draft_vocab_size=4)
    counts = torch.zeros(128)
    counts[[5, 9, 77, 120]] = torch.tensor([3.0, 10.0, 4.0, 8.0])
    head.choose_vocab(counts)
    assert head.draft_ids.tolist() == [5, 9, 77, 120]
    assert (torch.arange(4) + head.d2t).tolist() == [5, 9, 77, 120]
    assert head.t2d.nonzero().flatten().tolist() == [5, 9, 77, 120]


# --- export to vLLM / SGLang ------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export_names_and_shapes(heads, tmp_path, engine):
    h, i, kv = 64, 128, 2 * 16
    out = export(heads["llama"]["eagle"], engine, tmp_path / "e1")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert tensors["fc.weight"].shape == (h, 2 * h)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (h, h)
    assert tensors["layers.0.mlp.down_proj.weight"].shape == (h, i)
    assert not any(k.startswith("layer.") or "input_layernorm" in k for k in tensors)

    out = export(heads["llama"]["eagle3"], engine, tmp_path / "e3")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 126
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (h, 2 * h)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (kv, 2 * h)
    assert tensors["midlayer.hidden_norm.weight"].shape == (h,)
    assert tensors["norm.weight"].shape == (h,) and tensors["lm_head.weight"].shape == (126, h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].shape == (128,)
    assert ((torch.arange(126) + tensors["d2t"]) == tensors["t2d"].nonzero().flatten()).all()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_an_export_read_back_drafts_the_same_tokens(engine_for, llama, heads, tmp_path, kind,
                                                    fixed_verify_cost):  # noqa: F811
    fixed_verify_cost(1.0)     # tree sizes must not depend on timing
    target = Target(llama)
    # shipped heads are bf16: round the random head the same way, so the export loses nothing
    original = load_head(heads["llama"][kind], target).to(torch.bfloat16).float()
    source = save_head(original, tmp_path / "source" / kind)
    back = load_export(export(source, "vllm", tmp_path / "export" / kind), target)
    again = save_head(back, tmp_path / "again" / kind)
    for (name, a), b in zip(original.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    proposals = []
    for directory in (source, again):
        proposals.append(_first_tree(engine_for, llama, kind, directory).tokens.tolist())
    assert proposals[0] == proposals[1]


def _first_tree(engine_for, model, kind, directory):
    eng = engine_for(kind, model, heads=str(directory), depth=3, branching=3, total_tokens=8)
    seen = []
    propose = eng.proposer.propose
    eng.proposer.propose = lambda ctx: seen.append(propose(ctx)) or seen[-1]
    eng.generate([PROMPTS[1]], SamplingConfig(max_new_tokens=2))
    return seen[0]


# --- drift check ------------------------------------------------------------------------------------------------

def test_check_warns_when_tau_falls_below_the_recorded_one(engine_for, llama, heads):
    from spekit.commands.check import drift_report
    results = engine_for("eagle", llama, heads=heads["llama"]["eagle"]).generate(PROMPTS, SamplingConfig(
        max_new_tokens=8))
    report = drift_report(results, recorded=3.5)
    assert report["drifted"] and report["tau"] < 2.8 and len(report["position_acceptance"]) >= 1
    assert not drift_report(results, recorded=None)["drifted"]


# --- bad input --------------------------------------------------------------------------------------------------

def test_heads_for_another_model_are_refused(llama_other_vocab, heads):
    cls = proposers.get("eagle")
    with pytest.raises(UserError, match="another model.*vocab_size"):
        cls(Target(llama_other_vocab), cls.Options(heads=heads["llama"]["eagle"]))


def test_a_truncated_weights_file_is_refused(llama, heads, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(heads["llama"]["eagle3"], bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    cls = proposers.get("eagle3")
    with pytest.raises(UserError, match="corrupt or truncated"):
        cls(Target(llama), cls.Options(heads=str(bad)))


def test_a_tree_larger_than_the_context_is_refused(llama, heads):
    cls = proposers.get("eagle")
    with pytest.raises(UserError, match="does not fit the model's context"):
        cls(Target(llama), cls.Options(heads=heads["llama"]["eagle"], total_tokens=600))


@pytest.mark.parametrize("options,match", [(dict(tree="wide"), "tree must be"), (dict(depth=0), "depth"),
                                           (dict(head_context=-1), "head_context")])
def test_bad_options_are_refused(options, match):
    with pytest.raises(UserError, match=match):
        proposers.get("eagle").Options(**options)


def test_missing_shipped_heads_name_the_fix(llama):
    cls = proposers.get("eagle3")
    with pytest.raises(UserError, match="spekit train eagle3"):
        cls(Target(llama), cls.Options())


def test_export_and_check_commands(heads, tmp_path):
    from spekit.commands.check import read_prompts
    from spekit.commands import main
    assert main(["export", heads["llama"]["eagle3"], "--to", "sglang", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert main(["export", str(tmp_path), "--to", "vllm", "--out", str(tmp_path / "x")]) == 2   # not a head dir
    (tmp_path / "p.jsonl").write_text('{"turns": ["one", "two"]}\n\nplain text line\n{"prompt": "three"}\n')
    assert read_prompts(tmp_path / "p.jsonl") == ["one", "plain text line", "three"]
    with pytest.raises(UserError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3-lookup"])
def test_shipped_heads_reproduce_plain_on_the_bundled_model(method, monkeypatch, always_draft):
    from spekit.engine import Engine
    # drafting on every step (neither the heads' cost nor the wider verification charged, so they never rest, however
    # busy the machine), to exercise the real trees
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    from spekit.backends.torch_models import load_model
    loaded = load_model("smollm2-135m")
    target = Target(loaded.model)
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of Python."}],
                                                   add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    cfg = SamplingConfig(max_new_tokens=24)
    plain = Engine(target, proposers.get("plain")(target, proposers.get("plain").Options())).generate([prompt], cfg)
    cls = proposers.get(method)
    spec = Engine(target, cls(target, cls.Options())).generate([prompt], cfg)
    assert spec[0].token_ids == plain[0].token_ids
    assert sum(spec[0].stats.position_offered) > 0      # the shipped heads did draft (they are weak: see README)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3-lookup"])
def test_greedy_with_penalties_and_logit_bias_equals_plain(engine_for, heads, llama, method, fixed_verify_cost,
                                                          monkeypatch):  # noqa: F811
    """Repetition, frequency and presence penalties and a logit bias: each tree node is processed with its own
    path's tokens, so the trees change nothing."""
    fixed_verify_cost(1.0)
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    eng = engine_for(method, llama, heads=heads["llama"][kind_of(method)], depth=4, branching=4, total_tokens=12)
    results = eng.generate(PROMPTS, PENALISED)
    assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in PROMPTS]
    assert sum(sum(r.stats.position_offered) for r in results) > 0, "trees were drafted"
