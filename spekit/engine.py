"""The loop: propose, verify, accept, commit, observe. Tokens in, tokens out; batched; streaming.

Each step, for every row of the batch:
  1. the proposer drafts a tree whose root is the pending token (chosen, not yet in the cache);
  2. the target runs ONE forward over all tree nodes (4-D mask, explicit positions), and over the side nodes the
     proposer asks for (never verified, dropped from the cache right after);
  3. the acceptance module picks the accepted path and the token after it;
  4. the cache keeps the accepted path's slots; the new tokens are committed, stops are checked;
  5. the proposer observes the verdict.
"""
from __future__ import annotations

import hashlib
import time
from functools import partial
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from . import acceptance
from .logprobs import TokenLogprob, committed as committed_logprobs
from .config import SamplingConfig, UserError
from .pacing import Pacer
from .backends.cuda_graphs import capture_seconds
from .grammar import Constraint, Grammars
from .proposers import Proposer, SideNodes, StepContext
from .sampling import check_token_ids, make_generators, seen_of, untouched
from .stats import Result, SequenceStats
from .backends.torch_target import Target
from .tree import DraftTree, build, first_branch, roots

DRAFT_SLACK = 256   # cache slots reserved beyond prompt + max_new_tokens: a step's draft tree and side nodes


@dataclass
class _Row:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    stats: SequenceStats = field(default_factory=SequenceStats)
    finish: str | None = None
    cfg: SamplingConfig | None = None     # the row's own max_new_tokens / stop_ids (rows joining a running batch)
    t0: float | None = None               # when the row's clock started (None: with its batch)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # when its settings ask for them
    until: Callable[[list[int]], bool] | None = None   # told each commit's new tokens; True ends the row ("stop")
    constraint: Constraint | None = None  # structured output: the row's grammar state (spekit.grammar)


@dataclass(frozen=True)
class Event:
    """Tokens a row gained in one step (streaming)."""
    row: int              # index into the expanded rows (prompt_index * n + sample_index)
    tokens: list[int]
    finish: str | None    # None while running, else "stop" or "length"
    result: Result | None = None   # the whole sequence, on the row's last event
    logprobs: list[TokenLogprob] | None = None   # one per token, when the row's settings ask for them
    drafted: int = 0      # how many of the tokens, from the first, came from accepted drafts (the rest: the target's)


def row_seed(seed: int, row: _Row) -> int:
    """A row's seed depends on the user's seed, its sample index and its prompt, not on its place in the batch."""
    digest = hashlib.sha256(repr((seed, row.sample_index, row.prompt)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Engine:
    def __init__(self, target: Target, proposer: Proposer, stop_ids: tuple[int, ...] = (),
                 grammars: Grammars | None = None):
        """grammars: the model's grammar compiler (from its tokenizer), for rows whose settings constrain the
        answer (json_schema, regex); None: such rows are refused."""
        self.target, self.proposer, self.stop_ids = target, proposer, tuple(stop_ids)
        self.grammars = grammars
        # what drafts may cost and whether they pay, over the target's step costs (one set per target)
        self.pacer = Pacer(target.costs, proposer.speculates, capture_seconds)
        # what each step's forward keeps of the target's hidden states: nothing, those the proposer reads, or all
        self.hidden = (proposer.hidden_layers() or True) if proposer.needs_hidden_states else False

    def generate(self, prompts: list[list[int]], cfg: SamplingConfig,
                 until: Callable[[int, list[int]], bool] | None = None) -> list[Result]:
        """All prompts, `cfg.n` samples each, decoded together; results in (prompt, sample) order. until(row, new
        tokens): called at each commit of a row (numbered prompt_index * n + sample_index) with its new tokens; True
        ends the row there with finish "stop" (text stop sequences, decided by the caller)."""
        results = [e.result for e in self.stream(prompts, cfg, until) if e.result is not None]
        return sorted(results, key=lambda r: (r.prompt_index, r.sample_index))

    def stream(self, prompts: list[list[int]], cfg: SamplingConfig,
               until: Callable[[int, list[int]], bool] | None = None) -> Iterator[Event]:
        """Like generate, yielding each row's new tokens as soon as they are committed."""
        rows = self._rows(prompts, cfg)
        if until is not None:
            for i, row in enumerate(rows):
                row.until = partial(until, i)
        yield from self._steps(rows, cfg)

    def check_settings(self, cfg: SamplingConfig) -> None:
        """UserError for settings every prompt would fail on: a logit bias or stop id outside the vocabulary, a
        grammar (json_schema, regex) without the tokenizer or that does not compile (compiled once, kept)."""
        check_token_ids(cfg, self.target.vocab_size)
        if cfg.constrained and self.grammars is None:
            raise UserError("structured output (json_schema, regex) needs the model's tokenizer: use spekit's "
                            "API or CLI, which give it to the engine")
        if cfg.constrained:
            self.grammars.constraint(cfg)

    def _rows(self, prompts: list[list[int]], cfg: SamplingConfig) -> list[_Row]:
        if not prompts:
            raise UserError("no prompt given")
        for i, p in enumerate(prompts):
            if not p:
                raise UserError(f"prompt {i} is empty")
            if len(p) >= self.target.max_positions:
                raise UserError(f"prompt {i} has {len(p)} tokens; the model's context is "
                                f"{self.target.max_positions} tokens")
            bad = [t for t in p if not 0 <= t < self.target.vocab_size]
            if bad:
                raise UserError(f"prompt {i} has token ids outside the vocabulary (size "
                                f"{self.target.vocab_size}): {bad[:5]}")
        self.check_settings(cfg)
        lossless = self.proposer.keeps_law(cfg)
        rows = [_Row(i, s, list(p), stats=SequenceStats(lossless=lossless))
                for i, p in enumerate(prompts) for s in range(cfg.n)]
        if cfg.constrained:
            for row in rows:
                row.constraint = self.grammars.constraint(cfg)
        return rows

    def _steps(self, rows: list[_Row], cfg: SamplingConfig) -> Iterator[Event]:
        t0 = time.perf_counter()
        live = list(range(len(rows)))
        gens = None if cfg.greedy else make_generators([row_seed(cfg.seed, r) for r in rows], self.target.device)
        kv, hidden, gens, events = self._prefill(rows, live, cfg, gens, t0)
        try:
            yield from events
            if not live:
                return
            self._calibrate(kv, self._context(rows, live, kv, cfg, gens))
            self._begin(self._context(rows, live, kv, cfg, gens), hidden)
            while live:
                ctx = self._context(rows, live, kv, cfg, gens, step=True)
                yield from self._one_step(rows, live, kv, ctx, cfg, gens, t0)
                gens = self._drop_finished(rows, live, kv, gens, begun=True)
            self.pacer.save(force=True)
        finally:
            kv.release()              # its buffers serve the next generation (and its CUDA graphs)

    def _prefill(self, rows, live: list[int], cfg: SamplingConfig, gens, t0: float):
        """Prefill the rows `live` (ids into `rows`) into a new cache and commit their first tokens; rows that
        finish at once leave `live`. Returns (cache, hidden states of the rows still live or None, their
        generators, the events of the first tokens)."""
        prompts = [rows[r].prompt for r in live]
        # room for the answers, up to the context's end (a max_new_tokens far past it must not size the cache)
        room = min(cfg.max_new_tokens, max(0, self.target.max_positions - min(len(p) for p in prompts)))
        kv, logits, hidden = self.target.prefilled(prompts, room + DRAFT_SLACK,
                                                   hidden=self.proposer.needs_hidden_states)
        root = torch.tensor([p[-1] for p in prompts], device=self.target.device)
        empty = roots(root)
        masked = self._constrain(rows, live, empty, logits[:, None], cfg)
        first = self._decide(empty, masked, prompts, [len(p) for p in prompts], cfg, gens).next_token
        prefill_s = time.perf_counter() - t0
        for r in live:
            rows[r].stats.prefill_s = prefill_s
        before = list(live)
        gained = [[t] for t in first.tolist()]
        lps = self._logprobs(rows, live, cfg, logits[:, None], [[0]] * len(live), gained)
        events = list(self._commit(rows, live, gained, [0] * len(live), cfg, t0, lps))
        gens = self._drop_finished(rows, live, kv, gens, begun=False)
        if hidden is not None and live and len(live) < len(before):
            kept = torch.tensor([before.index(r) for r in live], device=hidden[0].device)
            hidden = tuple(h[kept] for h in hidden)
        return kv, hidden, gens, events

    def _begin(self, ctx: StepContext, hidden) -> None:
        """A generation starts (after prefill): the pacer and the proposer begin."""
        self.pacer.begin(len(ctx.tokens), ctx.cfg.greedy, self.proposer.chain_pacing(), self.proposer.draft_cost(),
                         self.proposer.paced_trees)
        self.proposer.begin(ctx, hidden)

    @torch.inference_mode()
    def _calibrate(self, kv, ctx: StepContext) -> None:
        """Time a few widths of forward once per batch size, in the real context, then roll them back (the pacer
        decides which and when: Pacer.calibrate). Not counted as target forwards."""
        self.pacer.calibrate(ctx.pending.shape[0], kv.length, ctx.cfg.greedy, partial(self._trial_forward, kv, ctx),
                             warm_up=self.target.compiled or self.target.captures)

    def _trial_forward(self, kv, ctx: StepContext, n: int) -> float:
        """Seconds of one forward over n copies of the pending tokens, rolled back at once."""
        batch = ctx.pending.shape[0]
        start, t = kv.length, time.perf_counter()
        steps = torch.arange(n, device=ctx.positions.device)
        mask = torch.ones(n, n, dtype=torch.bool, device=steps.device).tril().expand(batch, n, n)
        logits, _ = self.target.forward(kv, ctx.pending[:, None].expand(batch, n), ctx.positions[:, None] + steps,
                                        mask)
        logits.argmax(-1).tolist()                                             # wait for the device
        seconds = time.perf_counter() - t
        kv.keep(start, steps[None, :0].expand(batch, 0), torch.zeros_like(ctx.positions))
        return seconds

    def _drop_finished(self, rows, live, kv, gens, begun: bool):
        """Finished rows leave the batch (cache, generators, proposer state). Returns the remaining generators."""
        kept = [i for i, row in enumerate(live) if rows[row].finish is None]
        if len(kept) == len(live):
            return gens
        live[:] = [live[i] for i in kept]
        if live:
            kv.select_rows(torch.tensor(kept, device=self.target.device))
            if begun:
                self.proposer.select_rows(kept)
                self.pacer.select_rows(kept)
        return None if gens is None else [gens[i] for i in kept]

    def _one_step(self, rows, live, kv, ctx, cfg, gens, t0) -> Iterator[Event]:
        """One step: propose -> verify -> decide -> commit -> observe. The pacer's clock for the step times its
        phases (marked where they end: `_propose`, `_commit`), from drafting to the proposer's observe, less the
        consumer's time between events, and `_observe` gives the pacer what the step cost and returned."""
        clock = self.pacer.clock(ctx.budget, kv.length)
        tree, side = self._propose(ctx, clock)
        if (tree is None or tree.size == 1) and side is None and self._plain_on_host(rows, live, cfg):
            yield from self._plain_step(rows, live, kv, ctx, cfg, t0, clock)
            return
        if tree is None:                                   # no row drafted
            tree = roots(ctx.pending)
        logits, hidden, start, width = self._verify(kv, ctx, tree, side)
        verdict = self._decide(tree, self._constrain(rows, live, tree, logits[:, : tree.size], cfg), ctx.tokens,
                               ctx.starts, cfg, gens)
        gained, path, depths = self._keep(kv, verdict, tree, side, start)
        lps = self._logprobs(rows, live, cfg, logits, [p[: len(g)] for p, g in zip(path, gained)], gained)
        most_left = _most_left(rows, live, cfg)
        yield from self._commit(rows, live, gained, depths, cfg, t0, lps, clock, width)
        self._observe(ctx, verdict, gained, hidden, logits, clock, depths, tree.size > 1 or side is not None,
                      (most_left, _most_left(rows, live, cfg)))

    def _plain_on_host(self, rows, live, cfg: SamplingConfig) -> bool:
        """Whether a plain step (no row drafted) may take `_plain_step`: a target that decodes one token a row with
        host logits (`one_token`: the llama.cpp backend), greedy settings that leave the logits as they are, and
        nothing else a step reads of them (no grammar, min_new_tokens, log-probabilities, hidden states)."""
        if not getattr(self.target, "host_steps", False) or self.hidden or not _untouched_greedy(cfg):
            return False
        for r in live:                                     # a row's own settings (rows joining a running batch)
            row = rows[r]
            limits = row.cfg or cfg
            if (not _untouched_greedy(limits) or limits.wants_logprobs or row.constraint is not None
                    or len(row.generated) < limits.min_new_tokens):
                return False
        return True

    def _plain_step(self, rows, live, kv, ctx: StepContext, cfg: SamplingConfig, t0: float, clock) -> Iterator[Event]:
        """A plain greedy step in host ints: one decode of the pending tokens, the acceptance module's greedy rule
        on the target's host logits (`acceptance.plain_greedy`), commit, observe. The general step does the same
        through tensors, whose many small operations cost a tenth of a small model's step on a few CPU cores (the
        decode leaves the caches cold for them); this keeps it near llama.cpp's own loop."""
        host = self.target.one_token(kv, [t[-1] for t in ctx.tokens])                          # [B, V]
        nxt = acceptance.plain_greedy(host)
        # a proposer that reads the step's logits gets a copy: the buffer is the target's next decode's
        logits = torch.from_numpy(host.copy())[:, None] if self.proposer.reads_plain_logits() else None  # [B, 1, V]
        gained, depths = [[t] for t in nxt], [0] * len(nxt)
        most_left = _most_left(rows, live, cfg)
        yield from self._commit(rows, live, gained, depths, cfg, t0, None, clock, 1)
        self._observe(ctx, acceptance.PlainVerdict(nxt, self.target.device), gained, None, logits, clock, depths,
                      False, (most_left, _most_left(rows, live, cfg)))

    def _propose(self, ctx: StepContext, clock) -> tuple[DraftTree | None, SideNodes | None]:
        """The proposer's tree (fitted to each row's room; None: no row drafted) and side nodes; drafting ends here
        on the clock."""
        tree = self.proposer.propose(ctx)
        tree = None if tree is None else self._fit(tree, ctx)
        side = None if self.target.chains_only else self.proposer.side_nodes(ctx)
        clock.drafted()
        return tree, side

    def _observe(self, ctx, verdict, gained, hidden, logits, clock, depths, drafted: bool, most_left) -> None:
        """The proposer learns from the verdict; the pacer settles what the step cost and returned."""
        extra = {"logits": logits} if self.proposer.needs_logits else {}
        self.proposer.observe(ctx, verdict, gained, hidden, **extra)
        self.pacer.settle(clock, depths, drafted, gained, most_left)

    def _verify(self, kv, ctx: StepContext, tree: DraftTree, side: SideNodes | None):
        """ONE target forward over the tree's nodes and the side nodes. Returns its logits [B, N+M, V], hidden
        states, where the step's slots begin in the cache and the tokens per row it ran (N+M)."""
        positions = torch.where(tree.valid, ctx.positions[:, None] + tree.depth, -1)   # [B, N]
        inputs, mask = tree.tokens, tree.ancestors & tree.valid[:, None, :]
        if side is not None:
            inputs, positions, mask = _with_side(inputs, positions, mask, side, self.target.max_positions - 1)
        start = kv.length
        logits, hidden = self.target.forward(kv, inputs, positions, mask, hidden=self.hidden)
        return logits, hidden, start, inputs.shape[1]

    def _keep(self, kv, verdict: acceptance.Verdict, tree: DraftTree, side: SideNodes | None, start: int):
        """The cache keeps the accepted path's slots. Returns per row its gained tokens (accepted + next), the
        accepted path's node ids and the tree's depth."""
        batch = verdict.next_token.shape[0]
        if tree.size == 1 and side is None:
            # a plain step (every row's root alone): each row keeps its one new slot, so there is nothing to roll
            # back, and the next tokens are all there is to read from the device (on a GPU each read and each
            # small operation is host time: a plain step read it 9 times, now once; 107 operations, now 40)
            nxt = verdict.next_token.tolist()
            return [[t] for t in nxt], [[0]] * batch, [0] * batch
        path, tokens, nxt, depths = _read_step(verdict, tree)              # one read of the device
        kept = [sum(1 for j in p if j >= 0) for p in path]                # slots kept: root + accepted
        in_place = all(p[i] == i for p, k in zip(path, kept) for i in range(k))
        kv.keep(start, verdict.path[:, : max(kept)].clamp(min=0), verdict.accepted + 1, in_place=in_place)
        kv.compact()
        return [[tokens[b][j] for j in path[b][1:] if j >= 0] + [nxt[b]] for b in range(batch)], path, depths

    def _decide(self, tree: DraftTree, logits, contexts, starts, cfg, gens) -> acceptance.Verdict:
        """contexts: each row's prompt + generated tokens; starts: where its generated tokens begin."""
        seen = seen_of(contexts, starts, cfg, logits.shape[-1], logits.device)
        return acceptance.verify(tree, logits, cfg, seen, gens, lossy=self.proposer.lossy_rule)

    def _constrain(self, rows, live, tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
        """logits [B, N, V] with -inf where a constrained row's grammar forbids the token after the node (the
        grammar's mask of each node's own path, spekit.grammar), and at the stop tokens after a node whose token
        would come before the row's min_new_tokens; the same tensor when neither applies."""
        constrained = [b for b, r in enumerate(live) if rows[r].constraint is not None]
        short = [b for b, r in enumerate(live) if rows[r].constraint is None     # a grammar says where it ends
                 and len(rows[r].generated) < (rows[r].cfg or cfg).min_new_tokens]
        if not constrained and not short:
            return logits
        out = logits.clone()
        if constrained:
            tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
        for b in constrained:
            allowed = rows[live[b]].constraint.masks(tokens[b], parents[b], valid[b])     # [N, V]
            out[b].masked_fill_(~allowed.to(out.device), float("-inf"))
        for b in short:                 # the node at depth d predicts new token number len(generated) + d
            row = rows[live[b]]
            limits = row.cfg or cfg
            early = tree.depth[b] < limits.min_new_tokens - len(row.generated)               # [N]
            stops = torch.zeros(out.shape[-1], dtype=torch.bool, device=out.device)          # [V]
            stops[[t for t in {*self.stop_ids, *limits.stop_ids} if t < out.shape[-1]]] = True
            out[b].masked_fill_(early.to(out.device)[:, None] & stops, float("-inf"))
        return out

    def _fit(self, tree: DraftTree, ctx: StepContext) -> DraftTree:
        """Drop nodes deeper than the context length allows, and for a target that verifies chains only (the
        llama.cpp backend's exact kernels), every branch but the first."""
        if self.target.chains_only and tree.size > 1:
            tree = first_branch(tree)
        if min(ctx.room) >= tree.size - 1:       # no node can be deeper than the tree has nodes (no read needed)
            return tree
        room = torch.tensor(ctx.room, device=tree.depth.device)
        too_deep = tree.depth > room[:, None]
        if not bool(too_deep.any()):
            return tree
        return build(tree.tokens, tree.parents, tree.valid & ~too_deep, tree.q)

    @staticmethod
    def _logprobs(rows, live, cfg, logits, nodes, gained) -> list[list[TokenLogprob] | None] | None:
        """The log-probabilities of the gained tokens for the rows whose settings ask for them (spekit.logprobs);
        None when no row does. logits [B, N, V]; nodes[b][i]: the node that predicted gained[b][i]."""
        wants = [(rows[r].cfg or cfg) for r in live]
        if not any(w.wants_logprobs for w in wants):
            return None
        tops = [w.top_logprobs if w.wants_logprobs else None for w in wants]
        return committed_logprobs(logits, nodes, gained, tops)

    def _commit(self, rows, live, gained, depths, cfg, t0, lps=None, clock=None, width: int = 1) -> Iterator[Event]:
        """lps: the gained tokens' log-probabilities (`_logprobs`), or None; clock: the step's (verification of
        `width` tokens a row ends here, and its seconds drafting and verifying go to each row's stats; observing
        starts once the last event is consumed), None for the first tokens."""
        if clock is not None:
            clock.verified(width)
        now = time.perf_counter()
        for b, row_id in enumerate(live):
            row = rows[row_id]
            new, limits = gained[b], row.cfg or cfg
            row.stats.record_step(len(new), depths[b])
            if clock is not None:
                row.stats.record_times(clock.draft_s, clock.verify_s, clock.recording_s)
            for i, tok in enumerate(new):
                if tok in self.stop_ids or tok in limits.stop_ids:
                    new, row.finish = new[: i + 1], "stop"
                    break
            if len(row.generated) + len(new) >= limits.max_new_tokens:
                new = new[: limits.max_new_tokens - len(row.generated)]
                row.finish = row.finish or "length"
            if len(row.prompt) + len(row.generated) + len(new) >= self.target.max_positions:
                row.finish = row.finish or "length"
            if row.constraint is not None and new:
                kept = row.constraint.commit(new)
                if row.constraint.complete:
                    new, row.finish = new[:kept], "stop"
            if row.until is not None and new and row.until(new):
                row.finish = "stop"
            row.generated.extend(new)
            mine = None if lps is None or lps[b] is None else lps[b][: len(new)]
            if mine is not None:
                row.logprobs.extend(mine)
            row.stats.new_tokens = len(row.generated)
            row.stats.wall_s = now - (t0 if row.t0 is None else row.t0)
            wants = (row.cfg or cfg).wants_logprobs
            done = None if row.finish is None else Result(
                row.prompt_index, row.sample_index, row.prompt, row.generated, row.finish, row.stats,
                row.logprobs if wants else None)
            yield Event(row_id, new, row.finish, done, mine, min(len(new), len(gained[b]) - 1))
        if clock is not None:
            clock.resume()

    def _context(self, rows, live, kv, cfg, gens, step: bool = False, static: bool = True) -> StepContext:
        """The proposer's view of the batch, its budget from the pacer; step: for a decoding step (the governor may
        hold drafting back); static: the batch ends when its last row does (generate, stream), so only the rows
        furthest from their end may draft (Budget.behind)."""
        tokens = [rows[r].prompt + rows[r].generated for r in live]
        limit = self.target.max_positions - 1
        room = [max(0, limit - len(t)) for t in tokens]
        remaining = [(rows[r].cfg or cfg).max_new_tokens - len(rows[r].generated) for r in live]
        unread = self.proposer.unread(tokens) if step else None
        budget = self.pacer.budget(room, [len(t) for t in tokens], cfg.greedy, kv.length, step,
                                   remaining if static else None, remaining, unread)
        forced = None
        if step and any(rows[r].constraint is not None for r in live):
            forced = [[] if rows[r].constraint is None else rows[r].constraint.forced(room_b)
                      for r, room_b in zip(live, budget.room)]
        # a target whose plain steps run on host ints gets its tensors made when a proposer reads them; any other
        # now, before a proposer that drafts with the target's own layers appends to its cache (the positions move)
        lazy = getattr(self.target, "host_steps", False)
        pending = None if lazy else torch.tensor([t[-1] for t in tokens], device=self.target.device)
        return StepContext(tokens, pending, None if lazy else kv.next_positions(), cfg, gens, self.target, budget, kv,
                           starts=[len(rows[r].prompt) for r in live], forced=forced,
                           chains_only=self.target.chains_only)


def _untouched_greedy(cfg: SamplingConfig) -> bool:
    """Greedy, exact, and no logit bias or penalty: the next token is the raw logits' argmax."""
    return cfg.greedy and not cfg.relaxed and untouched(cfg)


def _most_left(rows, live, cfg: SamplingConfig) -> int:
    """The most tokens any running row of the batch has left to write (to its max_new_tokens)."""
    return max(((rows[r].cfg or cfg).max_new_tokens - len(rows[r].generated)
                for r in live if rows[r].finish is None), default=0)


def _read_step(verdict: acceptance.Verdict, tree: DraftTree) -> tuple[list, list, list, list]:
    """What the host needs of a verified step, in one read of the device (on a GPU each read waits for it): per
    row the accepted path's node ids (-1 padded), the tree's tokens, the next token and the tree's depth."""
    width, n = verdict.path.shape[1], tree.size
    depth = tree.depth.masked_fill(~tree.valid, 0).amax(dim=1)                           # [B]
    packed = torch.cat([verdict.path.long(), tree.tokens.long(), verdict.next_token.long()[:, None],
                        depth.long()[:, None]], dim=1).tolist()                          # [B, W + N + 2]
    return ([r[:width] for r in packed], [r[width:width + n] for r in packed], [r[width + n] for r in packed],
            [r[width + n + 1] for r in packed])


def _with_side(tokens, positions, mask, side: SideNodes, limit: int):
    """The forward's inputs with side nodes after the tree's N nodes: tokens, positions [B, N+M] and mask
    [B, N+M, N+M]. Side nodes see the root and each other as side.mask allows; no tree node sees them. Side nodes
    placed beyond the last position the context allows become padding."""
    batch, n = tokens.shape
    m = side.tokens.shape[1]
    eye = torch.eye(m, dtype=torch.bool, device=mask.device)
    below = torch.zeros(batch, m, n, dtype=torch.bool, device=mask.device)
    below[:, :, 0] = True
    mask = torch.cat([torch.cat([mask, mask.new_zeros(batch, n, m)], dim=2),
                      torch.cat([below, side.mask | eye], dim=2)], dim=1)
    side_pos = torch.where(side.positions <= limit, side.positions, -1)
    return torch.cat([tokens, side.tokens], dim=1), torch.cat([positions, side_pos], dim=1), mask
