"""Draft sizing: speculate only where it pays for its measured cost (never slower than plain)."""
import copy
import dataclasses

import pytest
import torch

from spekit.config import SamplingConfig
from spekit.pacing import Budget
from spekit.pacing import pacer as pacer_module, priors
from spekit.pacing.chains import ChainPacer
from spekit.pacing.governor import Governor
from spekit.pacing.priors import EMULATED_PRIOR, FLAT_PRIOR, GROWTH, PRIOR, prior_cost, prior_for, smooth_prior_cost
from spekit.pacing.sizing import best_widths, expected_gain
from spekit.pacing.step_costs import StepCosts
from spekit.engine import Engine
from spekit.proposers import Proposer
from spekit.proposers.base import NoOptions
from spekit.proposers.draft_model import DraftModel
from spekit.backends.weight_quant import is_packed, quantize
from spekit.batching import Session
from spekit.backends.torch_target import Target
from spekit.tree import chain

GOVERNOR_ALLOWS = Governor.allows        # the real one (conftest switches it off for the other tests)


def two_rates(first: float, cont: float):
    """accepted(k) of the two-rate chain model"""
    return lambda k: expected_gain(first, cont, k) - 1.0


def test_no_draft_when_nothing_is_accepted_or_nothing_matches():
    assert best_widths([(two_rates(0.0, 0.0), 8)], lambda n: 1.0 if n == 1 else 1.2) == 0
    assert best_widths([(two_rates(0.9, 0.9), 0)], lambda n: 1.0) == 0
    assert best_widths([], lambda n: 1.0) == 0


def test_long_drafts_when_copies_run_long_and_short_when_verification_is_dear():
    cheap = best_widths([(two_rates(0.9, 0.95), 16)], lambda n: 1.0 + 0.02 * (n - 1))
    dear = best_widths([(two_rates(0.9, 0.95), 16)], lambda n: 1.0 + 0.4 * (n - 1))
    assert cheap == 16 and 0 < dear < cheap


def test_one_width_for_a_batch_weighs_every_row():
    cost = lambda n: 1.0 + 0.3 * (n - 1)                      # noqa: E731
    alone = best_widths([(two_rates(0.8, 0.8), 8)], cost)
    with_idle_rows = best_widths([(two_rates(0.8, 0.8), 8)] + [(two_rates(0.0, 0.0), 0)] * 7, cost)
    assert alone > 0 and with_idle_rows == 0                   # one hopeful row does not make 7 others wait


def test_expected_gain_and_costs():
    assert expected_gain(0.5, 1.0, 0) == 1.0 and expected_gain(0.5, 1.0, 3) == 2.5
    costs = StepCosts()
    assert costs.relative(1, 4) == prior_cost(4) and costs.relative(1, 1) == 1.0
    for seconds in (0.010, 0.011, 0.500, 0.010):               # a hiccup does not move the median
        costs.record(1, 1, seconds)
    for seconds in (0.015, 0.015, 0.016):
        costs.record(1, 4, seconds)
    assert abs(costs.relative(1, 4) - 1.5) < 0.1
    assert costs.relative(2, 4) == prior_cost(4, 2)            # another batch size has its own figures


def test_wide_forwards_cost_more_at_long_contexts_and_each_context_keeps_its_own_figures():
    """The new tokens of a wide forward attend to every cached key: its cost relative to a one-token step grows with
    the context, so a short prompt's measurements must not size a long prompt's drafts (nor the reverse)."""
    short, long = prior_cost(16, table=FLAT_PRIOR), prior_cost(16, table=FLAT_PRIOR, context=4000)
    assert prior_cost(16, table=FLAT_PRIOR, context=300) == short and long - 1 > 2.5 * (short - 1)
    assert prior_cost(1, table=FLAT_PRIOR, context=4000) == 1.0
    costs = StepCosts(prior=FLAT_PRIOR)
    for _ in range(3):
        costs.record(1, 1, 0.050, context=300)
        costs.record(1, 16, 0.060, context=300)                # 1.2x at 300 keys
        costs.record(1, 1, 0.100, context=3000)
        costs.record(1, 16, 0.200, context=3000)               # 2.0x at 3000 keys
    assert abs(costs.relative(1, 16, context=300) - 1.2) < 1e-9
    assert abs(costs.relative(1, 16, context=3000) - 2.0) < 1e-9
    assert costs.plain_seconds(1, 300) == 0.050 and costs.plain_seconds(1, 3000) == 0.100
    # a context bucket not measured: the nearest measured one's ratio, scaled by the prior's growth between them
    grow = GROWTH[id(FLAT_PRIOR)]
    assert abs(costs.relative(1, 16, context=8000) - (1 + 1.0 * grow[8192] / grow[4096])) < 1e-9
    assert costs.plain_seconds(1, 8000) == 0.100 and costs.plain_seconds(1, 8000, nearest=False) is None


def test_sampled_rows_size_drafts_at_their_own_context_length():
    """Under sampling each row's cost is the prior at its own length (prompt + generated), not the cache's (which
    counts the batch's padding): a long row pays more for a wide forward, a short one in the same batch does not."""
    sampled = Budget(room=[8, 8], greedy=False, prior=FLAT_PRIOR, lengths=[100, 4000])
    assert sampled.row_cost(0)(16) == prior_cost(16, table=FLAT_PRIOR, context=100)
    assert sampled.row_cost(1)(16) == prior_cost(16, table=FLAT_PRIOR, context=4000) > sampled.row_cost(0)(16)
    # a row whose tree already holds 5 nodes of another drafter (eagle3-lookup's lookup): n more tokens cost what
    # a forward over 1 + 5 + n costs against one over 1 + 5, read between the prior's points (one more node past
    # a point costs its share of the step to the next, not the whole step); a row holding none is sized alone
    on_top = dataclasses.replace(sampled, beneath=[5, 0])
    smooth = [smooth_prior_cost(n, table=PRIOR) for n in (1, 2, 3, 4, 6, 8)]
    assert smooth == sorted(smooth) and smooth[1] == prior_cost(2) and smooth[3] == prior_cost(4)
    assert smooth[2] == (prior_cost(2) + prior_cost(4)) / 2 and smooth[4] == (prior_cost(4) + prior_cost(8)) / 2
    assert on_top.row_cost(0)(1) == 1.0
    assert on_top.row_cost(0)(3) == smooth_prior_cost(8, table=FLAT_PRIOR, context=100) / smooth_prior_cost(
        6, table=FLAT_PRIOR, context=100)
    past_a_point = dataclasses.replace(sampled, beneath=[3, 0]).row_cost(0)(2)     # 4 tokens paid, a 5th added
    assert 1.0 < past_a_point < sampled.row_cost(0)(5) / sampled.row_cost(0)(4)
    assert on_top.row_cost(1)(16) == sampled.row_cost(1)(16)
    greedy = Budget(room=[8, 8], greedy=True, cost=lambda n: 1.0, lengths=[100, 4000])
    assert greedy.row_cost(0)(16) == greedy.row_cost(1)(16) == 1.0           # greedy: the batch's measured cost
    pacer = ChainPacer(2, 4, 8)
    short, long = pacer.widths([8, 8], False, prior_cost, 0.0,
                               [sampled.row_cost(0), lambda n: 1.0 if n == 1 else 5.0])
    assert short > 0 and long == 0                              # each sampled row pays its own cost


def test_the_governor_compares_steps_at_the_same_context():
    """Plain steps timed at a short context do not make drafting at a long one look slow."""
    gov = Governor()
    for _ in range(4):
        gov.record(1, False, 1, 0.030, None, context=200)      # plain, short context: 33 tokens/s
        gov.record(1, False, 1, 0.100, None, context=3000)     # plain, long context: 10 tokens/s
    for _ in range(Governor.window):
        gov.record(1, True, 2, 0.120, None, context=3000)      # drafting at 3000 keys: 17 tokens/s
    assert gov.held == 0


def _pace(pacer: ChainPacer, accepted_share: float, steps: int, step_cost: float) -> list[int]:
    """Run a one-row pacer for `steps` steps where the row keeps `accepted_share` of what it drafts."""
    widths = []
    for _ in range(steps):
        [w] = pacer.widths([64], True, prior_cost, step_cost)
        widths.append(w)
        kept = int(w * accepted_share)
        pacer.observe([w], [[0] * (kept + 1)])
    return widths


def test_a_chain_drafter_stops_drafting_when_nothing_is_accepted_and_tries_again_later():
    widths = _pace(ChainPacer(1, start=5, top=12), 0.0, 60, step_cost=0.05)
    assert widths[0] > 0 and widths[10:].count(0) > 40       # backs off to plain steps ...
    assert any(w > 0 for w in widths[10:])                     # ... and probes again from time to time


def test_a_chain_drafter_drafts_long_when_all_is_accepted_and_never_when_drafts_are_dear():
    assert max(_pace(ChainPacer(1, start=2, top=12), 1.0, 20, step_cost=0.02)) >= 8
    assert max(_pace(ChainPacer(1, start=5, top=12), 1.0, 20, step_cost=1.5)) == 0


def test_under_sampling_each_row_is_paced_alone():
    pacer = ChainPacer(2, start=4, top=8)
    for _ in range(15):
        pacer.observe([4, 4], [[0] * 5, [0]])                  # row 0 accepts everything, row 1 nothing
    alone = ChainPacer(1, start=4, top=8)
    for _ in range(15):
        alone.observe([4], [[0] * 5])
    assert pacer.widths([8, 8], False, prior_cost, 0.05)[0] == alone.widths([8], False, prior_cost, 0.05)[0] > 0
    assert pacer.widths([8, 8], False, prior_cost, 0.05)[1] == 0


def test_a_draft_model_that_is_never_right_costs_few_draft_steps(engine_for, reference, llama, llama_draft,
                                                                   monkeypatch):
    """With its true cost counted, an unrelated draft is tried, fails and rests; the output stays exact."""
    monkeypatch.setattr(DraftModel, "draft_cost", lambda self: 0.3)
    prompt = [5, 17, 42, 9, 3, 88, 61]
    [r] = engine_for("draft", llama, llama_draft).generate([prompt], SamplingConfig(max_new_tokens=40))
    assert r.token_ids == reference(llama, prompt, 40)
    tried = r.stats.position_offered[0] if r.stats.position_offered else 0
    assert 0 < tried < 15                                      # of 40 steps


def test_the_governor_holds_speculation_back_while_it_is_slower_than_plain_steps():
    gov = Governor()
    for _ in range(4):
        gov.record(1, False, 1, 0.030, None)                   # plain steps: 33 tokens/s
    for _ in range(Governor.window):
        gov.record(1, True, 1, 0.040, None)                    # drafting gains nothing and costs more
    held = [not GOVERNOR_ALLOWS(gov) for _ in range(40)]
    assert held[:Governor.first_hold] == [True] * Governor.first_hold and not any(held[Governor.first_hold:])
    for _ in range(Governor.window):                           # failing again: held twice as long
        gov.record(1, True, 1, 0.040, None)
    assert sum(not GOVERNOR_ALLOWS(gov) for _ in range(100)) == 2 * Governor.first_hold


def test_the_governor_holds_one_row_at_once_when_its_drafting_costs_several_plain_steps():
    """Where a step's drafting costs several plain steps (an H200's host launching a drafter's small kernels one
    by one: 31 ms against 7), the window's eight steps before a verdict lost more than any draft could win; a row
    is held as soon as its speculative steps have lost `most_lost_one` plain steps."""
    gov = Governor()
    for _ in range(4):
        gov.record(1, False, 1, 0.007, None)                   # plain steps: 7 ms a token
    gov.record(1, True, 2, 0.031, None)                        # 2 tokens in 31 ms: 2.4 plain steps lost
    assert gov.held == 0
    gov.record(1, True, 2, 0.031, None)                        # 4.9 lost: held, two steps in
    assert gov.held == Governor.first_hold


def test_the_governor_lets_paying_speculation_run_and_keeps_batch_sizes_apart():
    gov = Governor()
    for _ in range(3 * Governor.window):
        gov.record(1, True, 2, 0.035, 0.030)                   # 57 tokens/s against a plain guess of 33
        gov.record(8, True, 8, 0.100, 0.040)                   # a batch of 8: 80 tokens/s against 200
    assert gov.held > 0                                        # the batch of 8 was held back ...
    gov.held = 0
    for _ in range(3 * Governor.window):
        gov.record(1, True, 2, 0.035, 0.030)
    assert gov.held == 0                                       # ... batch size 1 never was


class _Slow(Proposer):
    """A test drafter (not registered) that always proposes one token, mostly wrong, and takes 20 ms to do it."""
    name = "test-slow"

    def propose(self, ctx):
        import time
        time.sleep(0.02)
        draft = ((ctx.pending + 1) % self.target.vocab_size)[:, None]
        return chain(ctx.pending, draft, torch.tensor([min(1, r) for r in ctx.room]))


def test_a_slow_drafter_is_held_back_and_the_output_stays_exact(reference, llama, monkeypatch):
    monkeypatch.setattr(Governor, "allows", GOVERNOR_ALLOWS)
    prompt = [5, 17, 42, 9, 3, 88, 61]
    target = Target(llama)
    [r] = Engine(target, _Slow(target, NoOptions())).generate([prompt], SamplingConfig(max_new_tokens=80))
    assert r.token_ids == reference(llama, prompt, 80)
    drafted = r.stats.position_offered[0]
    assert 0 < drafted < Governor.window                       # of 80 steps: each draft loses several plain steps


def test_a_batch_is_held_back_as_soon_as_its_drafts_have_lost_two_plain_steps(reference, llama, monkeypatch):
    """In a batch a failed wide forward costs a whole plain step: the governor does not wait for its window."""
    monkeypatch.setattr(Governor, "allows", GOVERNOR_ALLOWS)
    prompts = [[5, 17, 42, 9, 3, 88, 61], [7, 8, 9, 10, 11, 12, 13]]
    target = Target(llama)
    results = Engine(target, _Slow(target, NoOptions())).generate(prompts, SamplingConfig(max_new_tokens=80))
    for p, r in zip(prompts, results):
        assert r.token_ids == reference(llama, p, 80)
    assert 0 < sum(r.stats.position_offered[0] for r in results) < 2 * Governor.window


def test_a_bfloat16_target_starts_from_the_prior_of_its_cpu(llama, engine_for, monkeypatch, tmp_path):
    """In bfloat16 a forward over 8 tokens costs about one over 1 on a CPU with native bf16 arithmetic (float32:
    about 1.9x), and about 3.6x where it is emulated (AVX2): before anything is measured, and always under
    sampling, drafts are sized with the table of the target's precision on this CPU (its flags in /proc/cpuinfo)."""
    low = copy.deepcopy(llama).bfloat16()
    packed = copy.deepcopy(llama)
    quantize(packed, "int4")
    native_half = priors.native_half
    for native, table in ((True, FLAT_PRIOR), (False, EMULATED_PRIOR)):
        monkeypatch.setattr(priors, "native_half", lambda dtype: native)
        assert prior_of(llama) is PRIOR and prior_of(low) is table
        assert prior_of(packed) is PRIOR                           # packed int4 rows cost like float32 ones
        engine = engine_for("ngram", low)
        assert engine.pacer.costs.prior is table
        assert engine.pacer.costs.relative(1, 8) == table[8]
    assert FLAT_PRIOR[8] < PRIOR[8] < EMULATED_PRIOR[8]
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16\n")
    assert native_half(torch.bfloat16, str(cpuinfo)) and not native_half(torch.float16, str(cpuinfo))
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2\n")
    assert not native_half(torch.bfloat16, str(cpuinfo))
    assert not native_half(torch.bfloat16, str(tmp_path / "none"))


def prior_of(model) -> dict[int, float]:
    """The prior the target gives a model: from the facts it passes (dtype, packing, device)."""
    param = next(model.parameters())
    return prior_for(param.dtype, is_packed(model), param.device.type)


def test_a_greedy_generation_starts_from_the_acceptance_the_last_one_learnt(engine_for, llama, llama_draft):
    """A chain drafter that rarely pays is not probed from scratch at every prompt: the next greedy generation on the
    engine starts from the learnt acceptance rate; a sampled one always from the fixed prior (seeds fix output)."""
    pacer = ChainPacer(2, 4, 8)
    pacer.observe([4, 4], [[1], [1]])                          # both rows: nothing accepted
    ok, bad = pacer.learned()
    assert ok / (ok + bad) < 2 / 3 and ok + bad == sum(ChainPacer.prior)
    engine = engine_for("draft", llama, llama_draft)           # an unrelated draft: rarely accepted
    greedy = SamplingConfig(max_new_tokens=16)
    engine.generate([[5, 17, 42, 9]], greedy)
    learnt = engine.pacer.chain.learned()
    first = engine.generate([[7, 8, 9]], greedy)[0].token_ids
    assert engine.pacer.chain.prior == learnt
    engine.generate([[7, 8, 9]], SamplingConfig(max_new_tokens=4, temperature=1.0, seed=0))
    assert engine.pacer.chain.prior == ChainPacer.prior
    assert engine_for("draft", llama, llama_draft).generate([[7, 8, 9]], greedy)[0].token_ids == first


def test_a_chain_drafter_charges_its_measured_overhead_per_batch_size_and_tries_again_later():
    """Greedy: what drafting took beyond its per-token cost (a catch-up, bookkeeping), in plain steps, is charged to
    later drafts of that batch size: a drafter accepted half the time pays alone when drafting is cheap, and not
    when a draft step takes two plain steps; the overhead fades on plain steps, so it is tried again. Sampling
    never looks at it."""
    def widths(pacer, batch):
        return pacer.widths([8] * batch, True, lambda n: 1.0, 0.05)

    pacer = ChainPacer(4, start=4, top=8, prior=(5.0, 5.0))
    assert max(widths(pacer, 4)) > 0
    pacer.observe([4] * 4, [[0, 0, 0]] * 4, spent=2.0, step_cost=0.05)      # a batch-4 draft step: 2 plain steps
    assert pacer.overhead[4] == pytest.approx(1.8)
    assert max(widths(pacer, 4)) == 0                                        # not worth it at batch 4 ...
    assert max(pacer.widths([8], True, lambda n: 1.0, 0.05)) > 0             # ... another batch size is apart
    assert max(pacer.widths([8] * 4, False, lambda n: 1.0, 0.05)) > 0        # sampling ignores the clock
    tries = [max(widths(pacer, 4)) > 0 for _ in range(300)]
    assert 30 < tries.index(True) < 300                                      # faded: tried again, much later
    renewed = ChainPacer.renew(pacer, 4, 4, 8, greedy=True)
    assert renewed.overhead == pacer.overhead and ChainPacer.renew(pacer, 4, 4, 8, greedy=False).overhead == {}


def test_a_chain_drafter_weighs_what_it_must_read_before_drafting_against_what_the_answer_has_left():
    """Greedy: a draft that first read more than twice its ceiling of tokens (a prompt, the text written during a
    pause) teaches the pacer a cost per token read, not an overhead of every draft; a pause then ends only where
    reading what it missed, spread over the steps the answer has left, still leaves drafting ahead."""
    pacer = ChainPacer(1, start=4, top=8, prior=(8.0, 2.0))
    assert max(pacer.widths([8], True, lambda n: 1.0, 0.1, unread=[600], remaining=[200])) > 0   # nothing known
    pacer.observe([4], [[0] * 5], spent=6.4, step_cost=0.1, unread=[600])    # read 600 tokens: 6 plain steps
    assert pacer.feed[1] == pytest.approx(0.01) and 1 not in pacer.overhead
    assert max(pacer.widths([8], True, lambda n: 1.0, 0.1, unread=[3], remaining=[200])) > 0     # caught up
    assert max(pacer.widths([8], True, lambda n: 1.0, 0.1, unread=[600], remaining=[200])) > 0   # a long answer
    assert max(pacer.widths([8], True, lambda n: 1.0, 0.1, unread=[600], remaining=[10])) == 0   # near its end
    assert max(pacer.widths([8], False, lambda n: 1.0, 0.1, unread=[600], remaining=[10])) > 0   # sampling: no clock
    assert ChainPacer.renew(pacer, 1, 4, 8, greedy=True).feed == pacer.feed


def test_what_a_generation_learnt_leaves_out_the_optimism_of_rows_that_did_not_draft():
    pacer = ChainPacer(2, start=4, top=8)
    pacer.observe([4, 0], [[1], [1]])                          # row 0 drafts, nothing accepted; row 1 does not
    observed = pacer.learned()
    for _ in range(60):                                        # plain steps: the rows' estimates drift upwards
        pacer.widths([8, 8], True, lambda n: 50.0, 0.05)
    assert pacer.hits[0][0] / sum(pacer.hits[0]) > 0.5
    assert pacer.learned() == observed and observed[0] / sum(observed) < 0.5
    assert ChainPacer(1, 4, 8, prior=(1.0, 2.0)).learned() == (1.0, 2.0)     # none drafted: what it started from


class _Oracle(Proposer):
    """A test drafter (not registered): row 0 drafts the next reference token (always accepted), other rows
    nothing; it records each step's room and counted rows."""
    name = "test-oracle"

    def __init__(self, target, options, refs):
        super().__init__(target, options)
        self.refs, self.seen = refs, []

    def propose(self, ctx):
        self.seen.append((list(ctx.room), ctx.budget.counted()))
        prompt, ref = self.refs[0]
        nxt = ref[len(ctx.tokens[0]) - len(prompt)] if len(ctx.tokens[0]) - len(prompt) < len(ref) else 0
        draft = torch.tensor([[nxt]] * len(ctx.tokens))
        lengths = torch.tensor([min(1, ctx.room[0])] + [0] * (len(ctx.tokens) - 1))
        return chain(ctx.pending, draft, lengths)


def test_in_a_static_batch_only_the_rows_furthest_from_their_end_draft(reference, llama):
    """A static batch ends when its last row does, so a token gained by a row ahead ends it no sooner: rows ahead
    get no room, and decisions weigh the rows behind. A server's continuous batch lets every row draft."""
    prompts = [[5, 17, 42, 9, 3, 88, 61], [7, 8, 9, 10, 11, 12, 13]]
    refs = [(p, reference(llama, p, 12)) for p in prompts]
    target = Target(llama)
    oracle = _Oracle(target, NoOptions(), refs)
    results = Engine(target, oracle).generate(prompts, SamplingConfig(max_new_tokens=12))
    assert [r.token_ids for r in results] == [ref for _, ref in refs]
    first, later = oracle.seen[0], oracle.seen[1:]
    assert first[0][0] > 0 and first[1] == [0, 1]             # level at the start: both count, row 0 drafts
    assert all(room[0] == 0 and counted == [1] for room, counted in later if len(room) == 2)   # row 0 is ahead
    assert results[0].stats.position_offered[0] == 1

    oracle.seen.clear()
    session = Session(Engine(target, oracle), SamplingConfig(max_new_tokens=12))
    session.add(prompts, SamplingConfig(max_new_tokens=12))
    while session.busy:
        list(session.step())
    assert all(room[0] > 0 and counted == [0, 1] for room, counted in oracle.seen if len(room) == 2)


def test_a_static_batch_drafts_only_while_few_rows_are_furthest_from_their_end(reference, llama, monkeypatch):
    """With three rows tied behind, a draft brings the batch's end nearer only if all three gain: no room then (the
    steps are plain ones, output exact); two rows draft."""
    monkeypatch.setattr(pacer_module, "MOST_BEHIND", 2)
    prompts = [[5, 17, 42, 9, 3, 88, 61], [7, 8, 9, 10, 11, 12, 13], [3, 4, 5]]
    refs = [(p, reference(llama, p, 12)) for p in prompts]
    target = Target(llama)
    for rows in (3, 2):
        oracle = _Oracle(target, NoOptions(), refs)
        results = Engine(target, oracle).generate(prompts[:rows], SamplingConfig(max_new_tokens=12))
        assert [r.token_ids for r in results] == [ref for _, ref in refs[:rows]]
        drafted = [room for room, _ in oracle.seen if any(room)]
        assert (len(drafted) > 0) == (rows == 2)


def test_the_governor_weighs_a_static_batch_by_how_much_nearer_its_slowest_row_came():
    """A static batch ends when its slowest row does: a step is worth the rows times the advance of the row with the
    most tokens left (capped by the most a row gained, so a stop token ends nothing sooner for drafts than for plain
    steps), not the sum of tokens; one row and a server's continuous batch count every token."""
    from spekit.engine import _Row, _most_left
    from spekit.pacing.pacer import progress
    cfg = SamplingConfig(max_new_tokens=10)
    rows = [_Row(0, 0, [1], generated=[2] * 5), _Row(1, 0, [1], generated=[2] * 3)]

    def step(gains: list[int], static: bool = True) -> int:
        before = [list(r.generated) for r in rows]
        for r, n in zip(rows, gains):
            r.generated += [2] * n
        got = progress([[2] * n for n in gains], 7, _most_left(rows, [0, 1], cfg), static)
        for r, old in zip(rows, before):
            r.generated = old
        return got

    assert step([1, 1]) == 2                      # a plain step: every row one nearer
    assert step([4, 1]) == 2                      # the row ahead ran further ahead: worth a plain step
    assert step([1, 2]) == 4                      # the slowest row came 2 nearer
    assert step([1, 3]) == 6                      # 3 nearer: both rows have 4 left
    assert step([4, 1], static=False) == 5
    rows[1].finish = "stop"                       # the slowest row stopped: the batch is as near as a row gained
    assert step([1, 1]) == 2


def test_chain_odds_learn_from_verdicts_and_drift_back_at_their_pace():
    """The odds `ngram` and `jacobi` keep per row: a verdict moves the first-token and later-token counts; a row
    that does not draft drifts towards optimism at its pace, which under sampling halves after each block of which
    nothing was accepted (down to an eighth) and comes back with the first accepted token."""
    from spekit.pacing.odds import ChainOdds
    odds = ChainOdds(pace=0.02)
    odds.learn(3, 4)                                  # 3 of 4 accepted: the first, then 2 later ones, then a miss
    first, later = odds.rates()
    assert first > 0.5 and 0.5 < later < 1.0
    odds.learn(0, 4)
    assert odds.rates()[0] < first
    before = odds.rates()[0]
    odds.drift()
    assert odds.rates()[0] > before
    for _ in range(5):
        odds.slow(0.02, accepted=0)
    assert odds.pace == pytest.approx(0.02 / 8)
    odds.slow(0.02, accepted=1)
    assert odds.pace == 0.02


def test_ngram_copies_from_the_place_that_matches_longest_and_repeats_a_short_loop():
    from spekit.proposers.ngram import NgramOptions, _Row, bucket
    o = NgramOptions(num_draft_tokens=6, ngram_max=8)
    row = _Row(o.num_draft_tokens)
    tokens = [1, 2, 3, 9, 4, 5, 3, 7, 1, 2, 3]      # 3 follows 1 2 at 2 (match 3), 5 at 6 (match 1, but later)
    row.catch_up(tokens)
    cont, key, source = row.lookup(tokens, o)
    assert source == 3 and cont[:2] == [9, 4] and key == bucket(3)
    loop = [8, 6, 5, 6, 5]                           # a two-token loop, copied over and over past its end
    row = _Row(o.num_draft_tokens)
    row.catch_up(loop)
    assert row.lookup(loop, o)[0] == [6, 5, 6, 5, 6, 5]
    assert _Row(4).lookup([4, 5], o) == ([], 0, -1)  # nothing earlier to copy


def test_ngram_learns_how_far_copies_run_from_the_text_without_drafting_them():
    """A loop's copies are followed as the text arrives: their estimate learns they run long although nothing
    was drafted (where wide forwards are dear nothing would be), and a guess that fails at once learns that."""
    from spekit.proposers.ngram import NgramOptions, _Row, bucket
    o = NgramOptions(num_draft_tokens=8, ngram_max=4)
    row = _Row(o.num_draft_tokens)
    text = [7, 1, 2, 3, 1, 2, 3]
    for _ in range(12):                              # the loop goes on, one token a step, never drafted
        row.catch_up(text)
        cont, key, source = row.lookup(text, o)
        row.follow(key, source, len(text))
        text = text + [cont[0]]
    assert key == bucket(4) and row.estimate(key).accepted(8) > 4.0
    guess = _Row(o.num_draft_tokens)
    text = [5, 20]
    for i in range(21, 33):                          # 5 comes back, followed by a new token each time
        for t in (5, i):
            text.append(t)
            guess.catch_up(text)
            cont, key, source = guess.lookup(text, o)
            if cont:
                guess.follow(key, source, len(text))
    assert guess.estimate(bucket(1)).accepted(8) < 0.2


def test_the_replay_script_counts_what_a_drafter_gains_on_a_recorded_answer(capsys, tmp_path):
    """scripts/replay_drafts.py, which chose ngram's estimates: on an answer that loops, ngram's drafts gain
    several tokens a step at a flat cost and none where a wide forward costs its width; bad input is an error."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "replay_drafts.py"
    spec = importlib.util.spec_from_file_location("replay_drafts", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompt, answer = [3, 4, 5, 6, 7], [8] + [4, 5, 6, 7, 8] * 12
    tokens, steps, spent = script.replay("ngram", prompt, answer, script.curve("1:1,32:1"))
    assert tokens == len(answer) - 1 and tokens / steps > 3 and spent == steps
    tokens, steps, spent = script.replay("ngram", prompt, answer, script.curve("1:1,2:2,32:32"))
    assert steps == tokens and spent == steps                  # no draft pays where tokens cost their width
    assert script.main(["--answers", str(tmp_path), "--costs", "1-1"]) == 2 and "--costs" in capsys.readouterr().err
    assert script.main(["--answers", str(tmp_path), "--method", "nope"]) == 2
