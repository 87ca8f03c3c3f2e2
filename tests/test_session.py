"""Continuous batching: rows that join a running batch at step boundaries, or leave it early, get exactly the
output they get alone (greedy: token for token; sampled: the same sample for the same seed)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from spekit.config import SamplingConfig, UserError
from spekit.proposers import Proposer
from spekit.batching import Session

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 4], [40, 41, 42, 43, 40, 41]]


def _run(session: Session, arrivals: dict[int, list[tuple[list[int], SamplingConfig]]], cancel_at=None):
    """Step the session; at step i add the prompts of arrivals[i]. Returns {row: tokens} and {row: finish}."""
    tokens, finish, step = {}, {}, 0
    cancel_at = cancel_at or {}
    while session.busy or any(k >= step for k in arrivals):
        for prompt, cfg in arrivals.get(step, []):
            for row in session.add([prompt], cfg):
                tokens[row] = []
        for row in cancel_at.get(step, []):
            session.cancel(row)
        for ev in session.step():
            tokens[ev.row] += ev.tokens
            if ev.finish:
                finish[ev.row] = ev.finish
        step += 1
    return tokens, finish


@pytest.mark.parametrize("method, options", [("plain", {}), ("ngram", {"ngram_max": 3}), ("draft", {}),
                                             ("rest", {"datastore": "none"}), ("recycle", {}),
                                             ("rest", {"datastore": "none", "recycle": 4})])
def test_joining_rows_equal_alone_greedy(engine_for, llama, llama_draft, method, options):
    engine = engine_for(method, llama, llama_draft if method == "draft" else None, **options)
    lengths = [12, 5, 10, 7]
    cfgs = [SamplingConfig(max_new_tokens=n) for n in lengths]
    alone = [engine.generate([p], c)[0].token_ids for p, c in zip(PROMPTS, cfgs)]
    session = Session(engine, cfgs[0])
    # two start together, one joins at step 3, one at step 5 (after row 1 has left)
    arrivals = {0: [(PROMPTS[0], cfgs[0]), (PROMPTS[1], cfgs[1])], 3: [(PROMPTS[2], cfgs[2])],
                5: [(PROMPTS[3], cfgs[3])]}
    tokens, finish = _run(session, arrivals)
    assert [tokens[r] for r in sorted(tokens)] == alone
    assert all(f == "length" for f in finish.values())
    assert not session.rows and session.kv is None


def test_a_row_that_left_is_drafted_from_by_a_later_one(engine_for, llama, always_draft):
    """rest's history in a server's running batch: a row that finished (left through select_rows) goes into the
    history, and the same prompt joining later drafts from it; every row still equals its output alone."""
    engine = engine_for("rest", llama, datastore="none")
    short, long = SamplingConfig(max_new_tokens=12), SamplingConfig(max_new_tokens=40)
    alone = [engine.generate([p], c)[0].token_ids for p, c in ((PROMPTS[0], short), (PROMPTS[1], long))]
    engine.proposer.forget()
    session = Session(engine, short)
    tokens, _ = _run(session, {0: [(PROMPTS[0], short), (PROMPTS[1], long)], 14: [(PROMPTS[0], short)]})
    assert [tokens[r] for r in sorted(tokens)] == [alone[0], alone[1], alone[0]]
    first = engine.proposer.history.texts[0]      # up to its last verified step: a few tokens past the limit
    assert first[:len(PROMPTS[0]) + 12] == PROMPTS[0] + alone[0]


def test_joining_rows_equal_alone_sampled(engine_for, llama):
    engine = engine_for("ngram", llama)
    cfgs = [SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=8, seed=s, n=2) for s in (1, 2, 3)]
    alone = [[r.token_ids for r in engine.generate([p], c)] for p, c in zip(PROMPTS, cfgs)]
    session = Session(engine, cfgs[0])
    tokens, _ = _run(session, {0: [(PROMPTS[0], cfgs[0])], 2: [(PROMPTS[1], cfgs[1]), (PROMPTS[2], cfgs[2])]})
    got = [tokens[r] for r in sorted(tokens)]
    assert got == [t for pair in alone for t in pair]


def test_cancel_frees_the_row_and_others_go_on(engine_for, llama):
    engine = engine_for("ngram", llama)
    cfg = SamplingConfig(max_new_tokens=16)
    alone = engine.generate([PROMPTS[0]], cfg)[0].token_ids
    session = Session(engine, cfg)
    tokens, finish = _run(session, {0: [(PROMPTS[0], cfg), (PROMPTS[1], cfg)]}, cancel_at={3: [1]})
    assert tokens[0] == alone and finish == {0: "length"}
    assert 0 < len(tokens[1]) < 16 and not session.rows


def test_stop_ids_and_limits_are_per_row(engine_for, llama):
    engine = engine_for("plain", llama)
    free = engine.generate([PROMPTS[1]], SamplingConfig(max_new_tokens=10))[0].token_ids
    stopper = SamplingConfig(max_new_tokens=10, stop_ids=(free[3],))
    session = Session(engine, SamplingConfig())
    tokens, finish = _run(session, {0: [(PROMPTS[1], stopper), (PROMPTS[1], SamplingConfig(max_new_tokens=6))]})
    assert tokens[0] == free[:free.index(free[3]) + 1] and finish[0] == "stop"
    assert tokens[1] == free[:6] and finish[1] == "length"


def test_other_sampling_settings_are_refused_and_bad_prompts_raise(engine_for, llama):
    session = Session(engine_for("plain", llama), SamplingConfig())
    with pytest.raises(ValueError):
        session.add([[1, 2]], SamplingConfig(temperature=0.5))
    with pytest.raises(UserError):
        session.add([[]], SamplingConfig())
    assert not session.busy


class _Stateful(Proposer):
    """A proposer without add_rows: newcomers wait for the batch to drain, outputs stay exact."""
    name = "test-stateful"
    speculates = False

    def begin(self, ctx, hidden=None):
        self.rows = len(ctx.tokens)

    def propose(self, ctx):
        from spekit.tree import chain
        assert len(ctx.tokens) == self.rows
        batch = ctx.pending.shape[0]
        return chain(ctx.pending, ctx.pending[:, None][:, :0], torch.zeros(batch, dtype=torch.long))

    def select_rows(self, rows):
        self.rows = len(rows)


def test_proposer_without_add_rows_waits_for_the_batch_to_drain(llama):
    from spekit.engine import Engine
    from spekit.backends.torch_target import Target
    target = Target(llama)
    engine = Engine(target, _Stateful(target, None))
    cfg = SamplingConfig(max_new_tokens=6)
    alone = [engine.generate([p], cfg)[0].token_ids for p in PROMPTS[:2]]
    tokens, _ = _run(Session(engine, cfg), {0: [(PROMPTS[0], cfg)], 2: [(PROMPTS[1], dataclasses.replace(cfg))]})
    assert [tokens[0], tokens[1]] == alone


def test_merge_keeps_every_rows_attention(llama):
    """Merged caches (rows of different lengths, and rows without any forward yet, on either side) give each row
    the logits it gets alone."""
    from spekit.backends.torch_target import Target
    target = Target(llama)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11]]

    def prefilled(p):
        kv = target.new_state(1)
        target.prefill(kv, [p])
        return kv

    merged = target.new_state(1)                    # no forward yet: its row is all holes
    merged.merge(prefilled(prompts[0]))
    merged.merge(prefilled(prompts[1]))
    merged.merge(target.new_state(1))               # and one without layers on the right
    assert merged.slot_pos.shape == (4, 7)
    assert merged.next_positions().tolist() == [0, 7, 2, 0]
    one = torch.ones(4, 1, 1, dtype=torch.bool)
    logits, _ = target.forward(merged, torch.ones(4, 1, dtype=torch.long), merged.next_positions()[:, None], one)
    for i, p in enumerate(prompts):
        ref, _ = target.forward(prefilled(p), torch.tensor([[1]]), torch.tensor([[len(p)]]), one[:1])
        assert torch.allclose(logits[i + 1], ref[0], atol=1e-5)
    unwritten = target.new_state(1)                 # neither side written yet (a draft model that has not drafted)
    unwritten.merge(target.new_state(2))
    assert unwritten.slot_pos.shape == (3, 0)
    logits, _ = target.forward(unwritten, torch.ones(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long),
                               one[:3])
    assert logits.shape[0] == 3


def test_a_server_batch_hands_its_cache_buffers_on_and_its_rows_equal_alone(engine_for, llama):
    """With CUDA graphs (here their static form), a batch that empties and a newcomer merged into a running batch
    give their KV buffers to the target's pool, for the next batch to take (and replay the graphs recorded on
    them); every row still decodes what it decodes alone."""
    from spekit import proposers
    from spekit.engine import Engine
    from spekit.backends.torch_target import Target
    target = Target(llama, static=True)
    engine = Engine(target, proposers.get("ngram")(target, proposers.get("ngram").Options()))
    cfgs = [SamplingConfig(max_new_tokens=n) for n in (12, 5, 10, 7)]
    alone = [engine_for("ngram", llama).generate([p], c)[0].token_ids for p, c in zip(PROMPTS, cfgs)]
    session = Session(engine, cfgs[0])
    tokens, _ = _run(session, {0: [(PROMPTS[0], cfgs[0]), (PROMPTS[1], cfgs[1])], 3: [(PROMPTS[2], cfgs[2])],
                               30: [(PROMPTS[3], cfgs[3])]})
    assert [tokens[r] for r in sorted(tokens)] == alone
    assert session.kv is None and sum(len(spare) for spare in target.pool.free.values()) > 0
