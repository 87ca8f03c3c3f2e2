"""The llama.cpp backend on tiny random GGUF files written in seconds (spekit.backends.gguf_write): the file gives
the torch model's logits; a tree verified in one decode gives every node its own path's logits and keeps exactly
the accepted path; with the exact kernels every method's greedy output equals plain decoding on this backend,
token for token, alone and in a batch; sampled outputs follow the backend's own distribution (chains and trees);
a kept prefix is reused; bad input gets one line and exit code 2; the bench's llama.cpp peers step in lockstep."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from spekit import proposers
from spekit.backends import llama_lib
from spekit.backends.llama_seqs import NotDrawable, assign, is_chain
from spekit.pacing.step_costs import StepCosts
from spekit.config import SamplingConfig, UserError
from spekit.engine import Engine
from spekit.sampling import seen_of, target_probs
from spekit.tree import build

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: bash scripts/install.sh --dev --llamacpp")

from spekit.backends.gguf_write import write_llama_gguf  # noqa: E402
from spekit.backends.llama_model import LlamaModel, LlamaSettings
from spekit.backends.llama_cpp import LlamaTarget  # noqa: E402
from spekit.backends.llama_prefill import MIN_TOKENS, Prefill, Unmovable, relayout  # noqa: E402

N = 24
REPEATS = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
DISTINCT = [3, 17, 42, 99, 11, 64, 23]
SPECULATORS = ["ngram", "rest", "recycle", "lookahead", "jacobi", "draft"]
exact_build = pytest.mark.skipif(bool(llama_lib.rounding_apart()),
                                 reason="this llama.cpp rounds wide forwards otherwise: "
                                 + "; ".join(llama_lib.rounding_apart()))


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory, llama, llama_draft, small_target, small_drafts):
    folder = tmp_path_factory.mktemp("gguf")
    return {"tiny": str(write_llama_gguf(llama, folder / "tiny.gguf")),
            "draft": str(write_llama_gguf(llama_draft, folder / "draft.gguf")),
            "small": str(write_llama_gguf(small_target, folder / "small.gguf")),
            "small_draft": str(write_llama_gguf(small_drafts["noisy_copy"], folder / "small_draft.gguf"))}


def target_of(path: str, kernels: str = "exact", parallel: int = 4, ctx: int = 512,
              costs: str = "none", prefill: str = "fast") -> LlamaTarget:
    settings = LlamaSettings(ctx_size=ctx, parallel=parallel, kernels=kernels, prefill=prefill)
    return LlamaTarget(LlamaModel(path, settings), settings, cost_profile=costs)


def engine_of(method: str, target: LlamaTarget, draft: LlamaTarget | None = None, **options) -> Engine:
    cls = proposers.get(method)
    return Engine(target, cls(target, cls.Options(**options), draft))


@pytest.fixture(scope="module")
def targets(ggufs):
    """One llama context per file and kernels (contexts are slow to make; generations leave them clean)."""
    made: dict = {}

    def get(name: str, kernels: str = "exact") -> LlamaTarget:
        if (name, kernels) not in made:
            made[(name, kernels)] = target_of(ggufs[name], kernels)
        return made[(name, kernels)]
    return get


# --- the attention sets as sequence ids (pure) --------------------------------------------------------------------

def tree_mask(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    out = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            out[i][j] = True
            j = parents[j]
    return out


def test_a_chain_is_one_sequence_and_a_tree_one_per_leaf():
    chain = [-1, 0, 1, 2]
    assert assign([10, 11, 12, 13], tree_mask(chain)) == [[0]] * 4
    assert is_chain([10, 11, 12, 13], tree_mask(chain))
    parents = [-1, 0, 0, 1, 1, 2]                   # root; two children; three grandchildren (leaves 3, 4, 5)
    seqs = assign([7, 8, 8, 9, 9, 9], tree_mask(parents))
    assert len({s for node in seqs for s in node}) == 3
    for i in range(6):        # the first sequence of a node holds exactly its ancestors among earlier positions
        first = seqs[i][0]
        holders = {j for j in range(6) if first in seqs[j]}
        assert {j for j in holders if j <= i or parents.count(j) == 0 and j == i} >= {i}
        assert {j for j in holders if [7, 8, 8, 9, 9, 9][j] <= [7, 8, 8, 9, 9, 9][i]} == \
            {j for j in range(6) if tree_mask(parents)[i][j]}
    assert not is_chain([7, 8, 8, 9, 9, 9], tree_mask(parents))


def test_padding_gets_no_sequence_and_lookahead_side_nodes_are_drawable():
    assert assign([-1, 4, 5], tree_mask([-1, -1, 1]))[0] == []
    # root, then a 2-level window of 2 columns: level 0 sees the root and earlier level-0 columns, level 1 its column
    pos = [0, 1, 2, 2, 3]
    allowed = [[True, False, False, False, False],
               [True, True, False, False, False],
               [True, True, True, False, False],
               [True, True, False, True, False],
               [True, True, True, False, True]]
    seqs = assign(pos, allowed)
    for i in range(5):
        first = seqs[i][0]
        seen = {j for j in range(5) if first in seqs[j] and pos[j] <= pos[i]}
        assert seen == {j for j in range(5) if allowed[i][j]}


def test_a_pattern_sequence_ids_cannot_draw_is_refused():
    with pytest.raises(NotDrawable):
        assign([0, 2], [[True, False], [True, True]])                 # a gap at position 1
    with pytest.raises(NotDrawable):
        assign([0, 1], [[True, True], [True, True]])                  # a token that sees a later one


# --- the backend's forward ---------------------------------------------------------------------------------------

def test_the_written_gguf_gives_the_torch_models_logits(llama, ggufs, targets):
    ids = [5, 17, 99, 3, 42, 7, 8, 120]
    got = targets("tiny").score(ids)
    with torch.inference_mode():
        want = llama(torch.tensor([ids])).logits[0]
    assert torch.allclose(got, want, atol=2e-3), float((got - want).abs().max())


def test_a_tree_in_one_decode_gives_each_path_its_logits_and_keeps_the_accepted_one(ggufs):
    """kernels fast: one decode over a tree (sequence per leaf); every node's logits are those of its own path
    decoded alone (to rounding), and after `keep` the cache holds the prompt and the accepted path only."""
    target = target_of(ggufs["tiny"], "fast")
    prompt = [4, 9, 33, 61, 2, 17]
    kv, _, _ = target.prefilled([prompt], 64)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 5]])
    tokens = torch.tensor([[50, 11, 12, 13, 14, 15, 16]])
    tree = build(tokens, parents, torch.ones_like(tokens, dtype=torch.bool), None)
    start = kv.length
    logits, _ = target.forward(kv, tree.tokens, len(prompt) + tree.depth, tree.ancestors)
    for node in range(7):
        path, j = [], node
        while j >= 0:
            path.insert(0, int(tokens[0, j]))
            j = int(parents[0, j])
        alone = target.score(prompt + path)[-1]
        assert torch.allclose(logits[0, node], alone, atol=1e-3), node
    kv.keep(start, torch.tensor([[0, 2, 5, 6]]), torch.tensor([4]))            # root, 12, 15, 16
    after, _ = target.forward(kv, torch.tensor([[77]]), torch.tensor([[len(prompt) + 4]]),
                              torch.ones(1, 1, 1, dtype=torch.bool))
    assert torch.allclose(after[0, 0], target.score(prompt + [50, 12, 15, 16, 77])[-1], atol=1e-3)
    assert not torch.allclose(after[0, 0], target.score(prompt + [50, 11, 13, 77])[-1], atol=1e-2)  # it can tell
    assert kv.rows[0].tokens == prompt + [50, 12, 15, 16, 77]
    kv.release()


@exact_build
@pytest.mark.parametrize("prompt", [REPEATS, DISTINCT])
@pytest.mark.parametrize("method", SPECULATORS)
def test_every_method_reproduces_this_backends_plain_greedy(targets, always_draft, method, prompt):
    """The exact kernels: a verified chain gives each token the logits a one-token step gives it, so the output is
    plain decoding's, token for token (drafting forced at every step)."""
    target = targets("tiny")
    cfg = SamplingConfig(max_new_tokens=N)
    plain = engine_of("plain", target).generate([prompt], cfg)[0].token_ids
    draft = targets("draft") if method == "draft" else None
    [result] = engine_of(method, target, draft).generate([prompt], cfg)
    assert result.token_ids == plain
    assert result.stats.tau >= 1.0


@exact_build
def test_rows_of_a_batch_get_what_each_gets_alone(targets, always_draft):
    target = targets("tiny")
    prompts = [REPEATS, DISTINCT, [9, 9, 8, 9, 9, 8, 9]]
    cfg = SamplingConfig(max_new_tokens=N)
    alone = [engine_of("plain", target).generate([p], cfg)[0].token_ids for p in prompts]
    for method in ("plain", "ngram", "rest"):
        together = [r.token_ids for r in engine_of(method, target).generate(prompts, cfg)]
        assert together == alone, method


def test_a_plain_step_on_host_ints_gives_the_tensor_steps_tokens_and_yields_to_what_reads_logits(targets,
                                                                                                 monkeypatch):
    """A step that drafts nothing runs in host ints (`Engine._plain_step`: one decode, the greedy rule on llama.cpp's
    buffer) and gives the very tokens of the general step through tensors, a batch too; settings that change the
    logits (a bias, a penalty, sampling) or read them (log-probabilities) take the general step."""
    target = targets("tiny")
    prompts = [REPEATS, DISTINCT]
    calls: list[int] = []
    one = LlamaTarget.one_token
    monkeypatch.setattr(LlamaTarget, "one_token",
                        lambda self, kv, toks: (calls.append(len(toks)), one(self, kv, toks))[1])
    cfg = SamplingConfig(max_new_tokens=N)
    on_host = [r.token_ids for r in engine_of("plain", target).generate(prompts, cfg)]
    assert len(calls) >= N - 1
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(LlamaTarget, "host_steps", property(lambda self: False))
        general = [r.token_ids for r in engine_of("plain", target).generate(prompts, cfg)]
    assert not calls and on_host == general
    favoured = on_host[0][3]
    others = [dataclasses.replace(cfg, logit_bias=((favoured, 30.0),)),
              dataclasses.replace(cfg, repetition_penalty=1.5), dataclasses.replace(cfg, logprobs=True),
              dataclasses.replace(cfg, temperature=0.7, seed=1)]
    for other in others:
        engine_of("plain", target).generate(prompts, other)
        assert not calls, other
    biased = engine_of("plain", target).generate(prompts, others[0])[0].token_ids
    assert biased == [favoured] * N
    # a drafter that backs off takes it too (rest: ranking, its recycled table refreshed on some steps)
    with monkeypatch.context() as m:
        m.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0 if n == 1 else 100.0)
        backed_off = [r.token_ids for r in engine_of("rest", target, datastore="none").generate(prompts, cfg)]
    assert backed_off == on_host and len(calls) >= N - 1


def test_a_kept_prefix_is_taken_over_and_not_computed_again(targets, monkeypatch):
    target = targets("tiny")
    decoded: list[int] = []
    real = LlamaTarget._decode

    def spy(self, plan, outputs, on=None):
        decoded.append(len(plan))
        return real(self, plan, outputs, on)
    monkeypatch.setattr(LlamaTarget, "_decode", spy)
    cfg = SamplingConfig(max_new_tokens=8)
    first = engine_of("plain", target).generate([DISTINCT], cfg)[0].token_ids
    decoded.clear()
    follow_up = DISTINCT + first + [12, 13]
    again = engine_of("plain", target).generate([follow_up], cfg)[0].token_ids
    assert decoded[0] <= 3                        # the new turn's prefill: only what the kept prefix lacks
    fresh = target_of(target.lm.path)
    assert again == engine_of("plain", fresh).generate([follow_up], cfg)[0].token_ids


# --- prompts through the fast kernels (LlamaSettings.prefill "fast") ----------------------------------------------

LONG = [(7 * i + 3) % 97 + 5 for i in range(MIN_TOKENS + 6)]


def test_a_cache_moves_between_the_layouts_byte_for_byte(targets):
    """The exact context's state, relaid for flash attention and back, is the very same bytes; what is not a state
    this code reads is refused (and prompts then stay in the exact context)."""
    target = targets("tiny")
    kv = target.new_state(1)
    target.prefill(kv, [DISTINCT])
    fast = target._prompts()
    state = fast._state(target.ctx, kv.rows[0].seq)
    there = relayout(state, transposed=False)
    assert not np.array_equal(there, state)
    assert np.array_equal(relayout(there, transposed=True), state)
    with pytest.raises(Unmovable):
        relayout(state, transposed=True)                # already in that layout
    with pytest.raises(Unmovable):
        relayout(state[:-5], transposed=False)          # cut short
    kv.release()
    target.drop_prefixes()


@exact_build
@pytest.mark.parametrize("method", ["ngram", "rest", "draft"])
def test_a_long_prompt_goes_through_the_fast_kernels_and_every_method_still_equals_plain(targets, always_draft,
                                                                                          monkeypatch, method):
    """A prompt of MIN_TOKENS or more is computed by the flash-attention context and moved in: its logits are the
    exact context's up to rounding, and every method's greedy output is plain's on this backend, token for token,
    for the prompt and for a next turn that takes the kept prefix over (moved out and back)."""
    target = targets("tiny")
    moved: list[int] = []
    push = Prefill.push
    monkeypatch.setattr(Prefill, "push", lambda self, seq: (moved.append(seq), push(self, seq))[1])
    cfg = SamplingConfig(max_new_tokens=N)
    draft = targets("draft") if method == "draft" else None
    runs = []
    for name in ("plain", method):
        first = engine_of(name, target, draft).generate([LONG], cfg)[0].token_ids
        follow = LONG + first + LONG[:MIN_TOKENS]
        runs.append((first, engine_of(name, target, draft).generate([follow], cfg)[0].token_ids))
        target.drop_prefixes()
    assert runs[0] == runs[1]
    assert len(moved) == 4
    exact = target_of(target.lm.path, prefill="exact")
    kv, fast_logits, _ = target.prefilled([LONG], 8)
    kv2, exact_logits, _ = exact.prefilled([LONG], 8)
    assert exact._fast is None and target._fast
    assert torch.allclose(fast_logits, exact_logits, atol=1e-2)
    kv.release()
    kv2.release()
    target.drop_prefixes()


def test_a_moved_sequence_is_not_cut_back_inside_its_missing_window(targets, monkeypatch):
    """A sliding-window layer's moved state holds the window of the prompt's last position only: a later prompt
    that shares less than the moved prompt is computed afresh, not taken over from a cut below that point."""
    target = targets("tiny")
    target.drop_prefixes()                 # what earlier tests on this shared target kept (the order varies: xdist)
    monkeypatch.setattr(target, "window", 8)
    cfg = SamplingConfig(max_new_tokens=4)
    engine_of("plain", target).generate([LONG], cfg)
    [seq] = target.parked
    assert target.floor[seq] == len(LONG) - 1
    kv = target.new_state(1)
    assert target._reuse(kv.rows[0], LONG[:20] + [1, 2, 3]) == 0
    assert target._reuse(kv.rows[0], LONG + [1, 2]) == len(LONG)
    kv.release()
    target.drop_prefixes()


# --- sampling follows the backend's own distribution --------------------------------------------------------------

V_SMALL = 8
DIST_PROMPT = [3, 1, 4, 1, 5, 2, 6, 7, 0, 2]
DIST_SAMPLES = 4000


def first_two_exact(target: LlamaTarget, prompt: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """The law of the first two tokens under cfg, from this backend's own one-token logits: [V * V]."""
    first = target.score(prompt)[-1:]                                                       # [1, V]
    second = torch.stack([target.score(prompt + [a])[-1] for a in range(V_SMALL)])          # [V, V]
    rows = [prompt + [a] for a in range(V_SMALL)]
    p0 = target_probs(first, cfg, seen_of([prompt], [len(prompt)], cfg, V_SMALL, first.device))[0]
    p1 = target_probs(second, cfg, seen_of(rows, [len(prompt)] * V_SMALL, cfg, V_SMALL, first.device))
    return (p0[:, None] * p1).flatten()


@pytest.mark.parametrize("config", [SamplingConfig(temperature=1.0),
                                    SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)])
@pytest.mark.parametrize("method,kernels", [("draft", "exact"), ("ngram", "exact"), ("rest", "fast")])
def test_sampled_tokens_follow_the_backends_distribution(ggufs, follows, always_draft, monkeypatch, method, kernels,
                                                         config):
    """Chains (exact kernels) and trees of point masses (fast kernels, one decode): the first two tokens of many
    samples, the second from the first speculative step."""
    from spekit.backends import llama_cpp
    branched = []

    def spy(positions, allowed):
        out = assign(positions, allowed)
        branched.append(len({s for node in out for s in node}) > 1)
        return out
    monkeypatch.setattr(llama_cpp, "assign", spy)
    rows = 200 if kernels == "exact" else 40       # a stream per row (exact); sequences for every leaf (fast)
    # flat costs: under sampling drafts are sized by the prior, which on this backend would rarely let them pay
    target = target_of(ggufs["small"], kernels, parallel=rows, ctx=32, costs="flat")
    draft = target_of(ggufs["small_draft"], kernels, parallel=rows, ctx=32) if method == "draft" else None
    engine = engine_of(method, target, draft)
    results = [r for seed in range(DIST_SAMPLES // rows) for r in engine.generate(
        [DIST_PROMPT], dataclasses.replace(config, max_new_tokens=2, n=rows, seed=seed))]
    cfg = dataclasses.replace(config, max_new_tokens=2)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(target, DIST_PROMPT, cfg))
    offered = sum(r.stats.position_offered[0] for r in results if r.stats.position_offered)
    assert offered > DIST_SAMPLES // 4, "the samples' second tokens came through verified drafts"
    assert any(branched) == (kernels == "fast"), "trees in one decode with the fast kernels, chains with the exact"


# --- bad input ---------------------------------------------------------------------------------------------------

def run_cli(capsys, *argv) -> tuple[int, str]:
    from spekit.commands import main
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("make,match", [
    (lambda d: d / "none.gguf", "not found"),
    (lambda d: (d / "text.gguf").write_text("hello") and d / "text.gguf", "not a GGUF file"),
    (lambda d: (d / "cut.gguf").write_bytes(open(d / "tiny.gguf", "rb").read()[:5000]) and d / "cut.gguf",
     "truncated"),
])
def test_a_missing_foreign_or_truncated_file_is_one_line(tmp_path, ggufs, capsys, make, match):
    (tmp_path / "tiny.gguf").write_bytes(open(ggufs["tiny"], "rb").read())
    path = make(tmp_path)
    code, err = run_cli(capsys, "generate", "--backend", "llama.cpp", "--model", str(path), "--raw", "hi")
    assert code == 2 and match in err and "Traceback" not in err, err


def test_a_method_that_needs_hidden_states_is_refused_with_why(ggufs, capsys):
    code, err = run_cli(capsys, "generate", "--backend", "llama.cpp", "--model", ggufs["tiny"], "--method", "medusa",
                        "--raw", "hi")
    assert code == 2 and "hidden states" in err and "--backend torch" in err


def test_a_draft_that_cannot_write_the_targets_text_is_refused(ggufs, capsys):
    """The 8-token file's tokenizer drops what it has no token for: it cannot read the 128-token target's text
    (tests/test_cross_vocab.py runs drafts of other vocabularies that can)."""
    code, err = run_cli(capsys, "generate", "--backend", "llama.cpp", "--model", ggufs["tiny"], "--method", "draft",
                        "--draft", ggufs["small"], "--raw", "hi")
    assert code == 2 and "cannot write the target's text" in err and "Traceback" not in err


def test_without_llama_cpp_python_the_backend_says_how_to_install(ggufs, capsys, monkeypatch):
    monkeypatch.setattr(llama_lib, "available", lambda: False)
    llama_lib.lib.cache_clear()
    try:
        code, err = run_cli(capsys, "generate", "--backend", "llama.cpp", "--model", ggufs["tiny"], "--raw", "hi")
    finally:
        llama_lib.lib.cache_clear()
    assert code == 2 and "install.sh --llamacpp" in err


def test_settings_out_of_range_are_user_errors():
    for bad in (dict(ctx_size=4), dict(parallel=0), dict(threads=-1), dict(kernels="turbo")):
        with pytest.raises(UserError):
            LlamaSettings(**bad)


# --- the bench's llama.cpp peers in lockstep -----------------------------------------------------------------------

BENCH_QUESTIONS = [{"question_id": 1, "category": "writing", "turns": ["abc abc abc abc", "and ! ! ! then?"]},
                   {"question_id": 2, "category": "qa", "turns": ["hello hello world"]}]


def test_in_lockstep_llamacpps_peers_step_among_the_methods_and_answer_as_alone(ggufs, tmp_path, capsys,
                                                                                  monkeypatch):
    """`spekit bench --lockstep --backend llama.cpp`: llama.cpp's peers join the spekit methods' lockstep group
    (both turns, the second over their own first answer) and answer token for token as they do run alone; each
    spekit method there steps on a llama.cpp context of its own (one context that methods take turns on rebuilds
    its compute graph at every switch)."""
    import json

    from spekit.bench import runner
    from spekit.commands import main
    groups = []
    real = runner.lockstep
    monkeypatch.setattr(runner, "lockstep", lambda runs: groups.append(sorted(runs)) or real(runs))
    siblings, sibling = [], LlamaTarget.sibling
    monkeypatch.setattr(LlamaTarget, "sibling", lambda self: siblings.append(1) or sibling(self))
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in BENCH_QUESTIONS))
    names = ["plain", "ngram", "llamacpp-plain", "llamacpp-lookup"]
    got = {}
    for lock in (False, True):
        folder = tmp_path / f"a{lock}"
        assert main(["bench", "--backend", "llama.cpp", "--model", ggufs["tiny"], "--questions", str(questions),
                     "--methods", ",".join(names), "--answers", str(folder), "--max-new-tokens", "12", "--raw",
                     "--ctx-size", "256", "--cost-profile", "none"] + (["--lockstep"] if lock else [])) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert set(report["results"]) == set(names), report["skipped"]
        got[lock] = {n: [(r["question_id"], r["spekit"]["token_ids"]) for r in
                         map(json.loads, (folder / f"{n}.jsonl").read_text().splitlines())] for n in names}
        assert groups == ([sorted(names)] * 3 if lock else []), "2 questions, 3 turns, each in one lockstep call"
        assert len(siblings) == (2 if lock else 0), "plain and ngram: a context each"
    assert got[True] == got[False]
    assert [len(turns) for _, turns in got[True]["llamacpp-lookup"]] == [2, 1]


def test_a_stepped_llamacpp_peer_is_timed_on_its_own_steps_only(ggufs, monkeypatch):
    """What runs between a llama.cpp peer's steps (the other contestants, in lockstep) is not counted in its time:
    the peers' clock only moves when read, and jumps 100 s between steps. Its rows go one after another, each a
    token per step, and give what its whole-answer run gives."""
    import types

    from spekit.bench import peers
    clock = types.SimpleNamespace(now=0.0)

    def perf_counter():
        clock.now += 0.001
        return clock.now
    monkeypatch.setattr(peers, "time", types.SimpleNamespace(perf_counter=perf_counter))
    (peer,), skipped = peers.peer_contestants(["llamacpp-plain"], None, None, (), ggufs["tiny"], None)
    assert not skipped and peer.steps is not None
    prompts, cfg = [REPEATS, DISTINCT], SamplingConfig(max_new_tokens=8)
    gen, between, seen = peer.steps(prompts, cfg), 0.0, []
    while True:
        try:
            seen.append(next(gen))
        except StopIteration as stop:
            outs = stop.value
            break
        clock.now += 100.0
        between += 100.0
    assert [o.token_ids for o in outs] == [o.token_ids for o in peer.run(prompts, cfg)]
    assert seen == list(range(1, sum(len(o.token_ids) for o in outs) + 1))
    assert between >= 100 * len(seen) and all(0 < o.wall_s == o.charged_s < 1 for o in outs)
    assert [o.forwards for o in outs] == [len(o.token_ids) for o in outs]


# --- the server on llama.cpp --------------------------------------------------------------------------------------

@exact_build
def test_concurrent_requests_on_llama_cpp_get_what_each_gets_alone(ggufs):
    """Continuous batching on the llama.cpp backend: requests that join a running batch (their rows merged into
    the same llama context) answer as each prompt does alone."""
    import socket
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import uvicorn

    from spekit.api import Spekit
    from spekit.server.app import Settings, create_app

    sk = Spekit.load(ggufs["tiny"], "ngram", backend="llama.cpp", cost_profile="none",
                     llama=LlamaSettings(ctx_size=256, parallel=6))
    prompts = ["abc abc abc abc", "hello hello world", "! ! ! ! !"]
    cfg = SamplingConfig(max_new_tokens=20)
    alone = [sk.generate([p], cfg, chat=False)[0].text for p in prompts]
    app = create_app(sk, Settings(model_id="tiny", max_prompt_tokens=100, max_new_tokens=50, max_batch_size=6,
                                  max_body_bytes=4000, api_key="k", method="ngram"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        ask = lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0)  # noqa: E731
        with ThreadPoolExecutor(3) as pool:
            got = [r.choices[0].text for r in pool.map(ask, prompts * 2)]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert got == alone * 2


# --- the bundled SmolLM2-135M as it ships (slow) ------------------------------------------------------------------

@pytest.mark.slow
@exact_build
def test_the_bundled_file_on_llama_cpp_every_method_equals_plain(always_draft):
    """The bundled Q4_1 file on llama.cpp (not dequantized): every method it runs gives plain's greedy answer,
    drafting at every step, alone and as a batch of two; the shipped draft model runs as a GGUF written from it."""
    from spekit.api import Spekit
    base = Spekit.load("smollm2-135m", backend="llama.cpp", cost_profile="none",
                       llama=LlamaSettings(ctx_size=1024, parallel=2))
    prompts = ["Summarize: The council approved the park budget. The park will open next spring with a pond.",
               "Write a Python function that returns the squares of a list of numbers."]
    cfg = SamplingConfig(max_new_tokens=40)
    ids = [base.encode(p) for p in prompts]
    plain = [r.token_ids for r in base.engine.generate(ids, cfg)]
    assert plain == [base.engine.generate([i], cfg)[0].token_ids for i in ids]
    for method in SPECULATORS:
        sk = base.with_method(method)
        assert [r.token_ids for r in sk.engine.generate(ids, cfg)] == plain, method
