"""Retrieval drafting (`--method rest`, after REST, He et al. 2024): a tree of continuations found by matching
the context's last tokens in three places, verified in one target forward.

- The context (prompt and text so far): every earlier occurrence of its last n tokens (longest n first, up to
  `ngram_max`), most recent first; where prompt lookup (`ngram`) drafts the latest occurrence's continuation
  alone, this drafts several.
- A datastore (`spekit.retrieval.datastore`) of the target's own earlier answers to training prompts (the shipped one for
  smollm2-135m: its answers to the self-instruct and template prompts of `data/distill/`): the continuations of
  the longest n-gram (`retrieve_max` down to `retrieve_min`) it holds. Phrasing a model repeats across answers
  ("Here is a ...", the steps of a worked example) is drafted where nothing in the context matches.
- At greedy steps, the history (`spekit.retrieval.history`, `history_tokens`): the texts this engine finished earlier in
  the process, prompts and answers, where a server's or a batch job's repeated templates recur. Never under
  sampling: a sample then depends on its seed and its own text only, not on what ran before.

- Under structured output, the tokens the row's grammar forces next (a JSON schema's keys, StepContext.forced).
- With `recycle` K > 0 (the default, 8), token recycling's tree (`recycle.py`): the pending token's likeliest
  next tokens as the target ranked them the last time it ran on it, and theirs, and so on; each node's chance is
  the one the recycling table's rates give it (its own calibration, match length 0). Its table learns from every
  verified tree's logits (eagle3-lookup's merged trees too).

The continuations are merged into one trie per row. Each node's chance to be accepted is estimated per source as
the share of that source's continuations through it, times a decay per depth, times a calibration the row learns
per source and match length (decayed counts of accepted nodes against the sum of their raw estimates); the
sources combine as a noisy-or. A row drafts the most likely nodes, as many as give the most tokens per unit of
verification cost (`ctx.budget.cost`); where none pays, the step is a plain one-token step (never slower than plain).
Greedy batches share one node count (every row pays for the widest); under sampling each row decides alone from
its own history and the prior cost, so that a row's sample does not depend on its batch.

Backing off costs little: a step where no row drafts is a plain one (`propose` gives None, which a CPU backend
runs in host ints), the recycled table takes the logits of such steps only every few (recycle.Refreshing),
and a resting row (`resting.py`) consults its dear sources (datastore, history, recycled table) only every few
steps, the context at every one.

Lossless: the nodes are point masses, verified by the core's tree walk (greedy) or its recursive rejection rule
(sampling), so the output is the target's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import UserError
from ..retrieval.datastore import Datastore, load_datastore
from ..heads.base import shipped_dir
from ..retrieval.history import History
from ..tree import DraftTree, best_chain, from_sequences
from .recycle import Recycler, Refreshing
from .base import Proposer, StepContext, register
from .resting import Idle, Resting

SOURCES = ("context", "datastore", "history", "recycled", "grammar")
# raw estimate per depth: copy runs go on longer; a grammar's forced text is all but certain (only its
# tokenization may differ from the model's choice)
DECAY = {"context": 0.85, "datastore": 0.7, "history": 0.8, "grammar": 0.97}
# calibration: accepted / estimated (recycled nodes come with their own calibrated chances)
PRIOR = {"context": (0.6, 1.0), "datastore": (0.4, 1.0), "history": (0.5, 1.0), "recycled": (1.0, 1.0),
         "grammar": (0.9, 1.0)}
CONTEXT_CANDIDATES = 8


@dataclass(frozen=True)
class RestOptions:
    datastore: str = ""          # datastore folder; "" = the shipped one for the model, if any; "none" = no datastore
    tree_size: int = 24          # most draft nodes per row and step
    num_draft_tokens: int = 10   # longest continuation drafted
    ngram_max: int = 4           # longest suffix matched in the context
    ngram_min: int = 1           # shortest suffix matched in the context
    retrieve_max: int = 6        # longest suffix matched in the datastore
    retrieve_min: int = 2        # shortest suffix matched in the datastore
    retrieve_count: int = 64     # most datastore continuations per step
    history_tokens: int = 16384  # greedy: most tokens of this engine's finished texts drafted from (0 = none)
    recycle: int = 8             # token recycling as a fourth source: next tokens kept per token (0 = off)

    def __post_init__(self) -> None:
        if self.recycle < 0:
            raise UserError(f"recycle must be >= 0 (0 = off), got {self.recycle}")
        if self.history_tokens < 0:
            raise UserError(f"history_tokens must be >= 0 (0 = none), got {self.history_tokens}")
        for name in ("tree_size", "num_draft_tokens", "retrieve_count"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UserError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if not 1 <= self.retrieve_min <= self.retrieve_max:
            raise UserError(f"need 1 <= retrieve_min <= retrieve_max, got {self.retrieve_min} and "
                            f"{self.retrieve_max}")


def datastore_dir(option: str, target) -> Path | None:
    """--datastore, else the shipped datastore made for a model of this target's shape; None for "none", and
    where nothing was shipped for this model (then the context and the history are the sources)."""
    if option == "none":
        return None
    if option:
        return Path(option)
    return shipped_dir("rest", target)


class _Row:
    """One row: where each context n-gram occurred (continuation starts, in order), how far the text was indexed,
    and the calibration counts per (source, match length)."""

    def __init__(self, o: RestOptions):
        self.seen: dict[tuple[int, ...], list[int]] = {}
        self.fed = 0
        self.ngrams = range(o.ngram_min, o.ngram_max + 1)
        self.cal: dict[tuple[str, int], list[float]] = {}
        self.plan: list[tuple[tuple[int, ...], dict[str, float]]] = []   # drafted nodes and their raw estimates
        self.shadow: list[tuple[tuple[int, ...], dict[str, float]]] = []  # first nodes ranked but not drafted
        self.matched: dict[str, int] = {}                                 # match length per source, last step
        self.last: tuple[list[int], list[int]] = ([], [])   # context and gained tokens of its last step (history)
        self.recycler: Recycler | None = None             # token recycling (`recycle`), else None
        self.ranks: dict[tuple[int, ...], int] = {}         # recycled nodes' ranks among their siblings, last step
        self.idle = Idle()            # resting (resting.py): a row resting consults the context alone

    def feed(self, tokens: list[int]) -> None:
        for end in range(max(1, self.fed), len(tokens)):     # the n-grams ending before `end` get a continuation
            for n in self.ngrams:
                if end >= n:
                    self.seen.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self.fed = max(self.fed, len(tokens))

    def context_candidates(self, tokens: list[int], depth: int) -> tuple[int, list[list[int]]]:
        for n in reversed(self.ngrams):
            starts = self.seen.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if starts:
                return n, [tokens[s:s + depth] for s in reversed(starts[-CONTEXT_CANDIDATES:])]
        return 0, []

    def rate(self, source: str, n: int) -> float:
        ok, est = self.cal.get((source, n), PRIOR[source])
        return ok / est


@register
class Rest(Proposer):
    name = "rest"
    Options = RestOptions
    help = "retrieval: a tree of continuations of the context's last tokens, from the context, a datastore of " \
           "the model's own earlier answers (where one ships or is given) and the engine's earlier texts"

    def __init__(self, target, options, draft=None):
        super().__init__(target, options, draft)
        self.needs_logits = options.recycle > 0      # the recycled table learns from every forward's logits
        if options.recycle > target.vocab_size:
            raise UserError(f"recycle must be at most the vocabulary ({target.vocab_size}), got {options.recycle}")
        where = datastore_dir(options.datastore, target)
        self.store: Datastore | None = None if where is None else \
            load_datastore(where, target.vocab_size, options.retrieve_min, options.retrieve_max)
        self.expected: list[float] = []        # per row: the extra tokens the last draft promised
        self.sequences: list[list[list[int]]] = []   # per row: the drafted continuations (the trie's leaves)
        # the texts this engine finished, drafted from at greedy steps only: a sample then depends on its seed
        # alone, not on what ran before (greedy output cannot depend on drafts at all)
        self.history = History(options.history_tokens, options.retrieve_min, options.retrieve_max)
        self.rows: list[_Row] = []
        self.table: dict[int, list[int]] = {}     # token recycling's table at greedy steps (`recycle`)
        self.tree: DraftTree | None = None      # this step's tree; None: no row drafted (the roots alone)
        self.resting = Resting()      # how often a resting row consults its dear sources
        self.fresh: list[bool] = []                 # per row: this step's logits go into its recycled table
        self.refreshing = Refreshing(1)             # how often; a sampled row's table at every step

    def forget(self) -> None:
        """Drop the history of finished texts (after a warm-up on a prompt that will be asked again)."""
        self.history.clear()
        shared, self.table = self.table, {}
        for row in self.rows:                   # nor the last generation's texts, retired at the next begin
            row.last = ([], [])
            if row.recycler is not None:        # nor what running rows' recycling tables hold (greedy: shared)
                row.recycler.table = self.table if row.recycler.table is shared else {}

    def _retire(self, rows: list[_Row]) -> None:
        for row in rows:
            self.history.add(row.last[0] + row.last[1])      # joined once, when the row has finished

    def begin(self, ctx: StepContext, hidden=None) -> None:
        self._retire(self.rows)                 # the last generation's rows are finished
        self.rows: list[_Row] = []
        # greedy batches: the extra tokens the rows' estimates promised last step, and the running ratio of extra
        # tokens gained to promised. A batch pays for its widest tree, so its own record tempers the rows' chances
        self.promised, self.kept = 0.0, 1.0
        self.add_rows(ctx)

    def add_rows(self, ctx: StepContext, hidden=None) -> None:
        k = self.options.recycle
        for _ in ctx.tokens:
            row = _Row(self.options)
            row.recycler = Recycler(self.table if ctx.cfg.greedy else {}, k) if k else None
            self.rows.append(row)

    def propose(self, ctx: StepContext) -> DraftTree | None:
        if not any(ctx.room):         # held back, or at the context's end: a plain step, without ranking anything
            self.withdraw()
            self._refreshes(ctx.cfg.greedy)
            self.tree = None
            return None
        forced = ctx.forced or [[]] * len(ctx.tokens)
        full = self.resting.full([row.idle for row in self.rows], ctx.cfg.greedy)
        ranked = [self._rank(self.rows[b], tokens, ctx.room[b], ctx.cfg.greedy, forced[b], full[b])
                  for b, tokens in enumerate(ctx.tokens)]
        self.resting.ranked(ctx, full)
        if ctx.chains_only:
            ranked = [best_chain(nodes) for nodes in ranked]
        scale = self.kept if ctx.cfg.greedy and len(ranked) > 1 else 1.0
        counts = ctx.budget.node_counts(ranked, scale)
        sequences, self.expected, self.promised = [], [], 0.0
        for row, nodes, m in zip(self.rows, ranked, counts):
            chosen = nodes[:m]
            row.plan = [(path, raw) for path, _, raw in chosen]
            Resting.drafted(row.idle, bool(chosen))
            self.promised += sum(p for _, p, _ in chosen)
            self.expected.append(scale * sum(p for _, p, _ in chosen))
            # drafting did not pay: the first nodes are judged anyway, by the token the step commits (a shadow
            # draft, free), so a source that has come right is found out without paying for drafts first
            row.shadow = [(path, raw) for path, _, raw in nodes if len(path) == 1] if not chosen else []
            sequences.append(_leaves([path for path, _, _ in chosen]))
            if row.recycler is not None:
                row.recycler.plan = [(path, row.ranks[path]) for path, _, raw in chosen if "recycled" in raw]
        self.sequences = sequences
        self._refreshes(ctx.cfg.greedy)
        # no row drafts: a plain step (the roots alone), which a CPU backend takes without tensors
        self.tree = from_sequences(ctx.pending, sequences) if any(sequences) else None
        return self.tree

    def _refreshes(self, greedy: bool) -> None:
        """Which rows' recycled tables take this step's logits, if it is a plain one (recycle.Refreshing: a row
        whose recycled nodes have not been drafted for a while may refresh every few steps only, so that a
        backed-off step does not pay a top-k over the vocabulary, nor a copy of the logits out of a CPU backend's
        buffer)."""
        if self.options.recycle:
            self.fresh = self.refreshing.flags([row.recycler for row in self.rows], greedy)
        else:
            self.fresh = [False] * len(self.rows)

    def reads_plain_logits(self) -> bool:
        return any(self.fresh)

    def _rank(self, row: _Row, tokens: list[int], room: int, greedy: bool,
              forced: list[int] = (), full: bool = True) -> list[tuple[tuple[int, ...], float, dict]]:
        """The row's candidate nodes (paths from the root), most likely first: (path, chance, raw per source);
        the history is a source at greedy steps only; forced: the tokens the row's grammar forces next
        (StepContext.forced), a source of its own; full: False for the context and the grammar alone (resting)."""
        row.matched = {}
        if room == 0:        # the index catches up when the row may draft again (a held batch never pays for it)
            return []
        row.feed(tokens)
        depth = min(self.options.num_draft_tokens, room)
        found = {"context": row.context_candidates(tokens, depth)}
        if self.store is not None and full:
            found["datastore"] = self.store.lookup(tokens, depth, self.options.retrieve_count)
        if greedy and len(self.history) and full:
            found["history"] = self.history.lookup(tokens, depth, self.options.retrieve_count)
        if forced:
            found["grammar"] = (1, [list(forced[:depth])])
        raw: dict[tuple[int, ...], dict[str, float]] = {}
        if row.recycler is not None and full:
            recycled = row.recycler.rank(tokens[-1], self.options.tree_size, depth)
            row.ranks = {path: r for path, _, r in recycled}
            for path, chance, _ in recycled:
                raw[path] = {"recycled": chance}
            if recycled:
                row.matched["recycled"] = 0
        for source, (n, conts) in found.items():
            conts = [c for c in conts if c]
            if not n or not conts:
                continue
            row.matched[source] = n
            share = 1.0 / len(conts)
            for c in conts:
                for d in range(1, len(c) + 1):
                    per = raw.setdefault(tuple(c[:d]), {})
                    per[source] = per.get(source, 0.0) + share * DECAY[source] ** (d - 1)
        nodes = []
        for path, per in raw.items():
            miss = 1.0
            for source, r in per.items():
                miss *= 1.0 - min(1.0, r * row.rate(source, row.matched[source]))
            nodes.append((path, 1.0 - miss, per))
        nodes.sort(key=lambda x: (-x[1], len(x[0])))     # a parent's chance is at least its child's: it comes first
        return _closed(nodes)[: self.options.tree_size]

    def withdraw(self) -> None:
        """The last drafts were not verified (a proposer that uses this one chose otherwise): learn nothing."""
        for row in self.rows:
            row.plan, row.shadow = [], []
            if row.recycler is not None:
                row.recycler.plan = []
        self.expected, self.promised = [0.0] * len(self.rows), 0.0
        self.sequences = [[] for _ in self.rows]

    def observe(self, ctx: StepContext, verdict, gained: list[list[int]], hidden=None, logits=None,
                own: list[list[int]] | None = None, tree: DraftTree | None = None) -> None:
        """own: where this proposer's tree was part of another's (eagle3-lookup), the part of each row's gained
        tokens its own continuations held (then the bonus token); the estimates learn from that. tree: the tree
        verified, whose nodes `logits` are of, where it was not this proposer's own."""
        credited = gained if own is None else own
        if ctx.cfg.greedy and self.promised > 0:
            extra = sum(len(g) - 1 for g in credited)
            self.kept = min(1.5, max(0.05, 0.8 * self.kept + 0.2 * extra / self.promised))
        elif ctx.cfg.greedy:
            self.kept = min(1.0, self.kept + 0.01)     # no draft this step: drift back, the text may change
        if self.history.capacity:                # references only: the engine builds both lists anew each step
            for row, tokens, got in zip(self.rows, ctx.tokens, gained):
                row.last = (tokens, got)
        if self.options.recycle:
            self.refreshing.refresh(ctx, [row.recycler for row in self.rows], self.fresh, logits, tree or self.tree,
                                    self.options.recycle)
            for row, got in zip(self.rows, credited):
                row.recycler.learn(got)
        for row, got in zip(self.rows, credited):
            plan, accepted = row.plan, {tuple(got[:d]) for d in range(1, len(got))}
            if not plan and row.shadow:
                plan, accepted = row.shadow, {tuple(got[:1])}
            row.shadow = []
            if not plan:
                continue
            for source, n in row.matched.items():
                mine = [(path, r[source]) for path, r in plan if source in r]
                if not mine:
                    continue
                c = row.cal.setdefault((source, n), list(PRIOR[source]))
                c[0] = 0.9 * c[0] + sum(path in accepted for path, _ in mine)
                c[1] = 0.9 * c[1] + sum(r for _, r in mine)
            row.plan = []

    def select_rows(self, rows: list[int]) -> None:
        kept = set(rows)
        self._retire([row for r, row in enumerate(self.rows) if r not in kept])
        self.rows = [self.rows[r] for r in rows]


def _closed(nodes: list) -> list:
    """Drop nodes whose parent is not listed before them (ties in chance can order a child first)."""
    kept, out = set(), []
    for node in nodes:
        if len(node[0]) == 1 or node[0][:-1] in kept:
            kept.add(node[0])
            out.append(node)
    return out


def _leaves(paths: list[tuple[int, ...]]) -> list[list[int]]:
    """The paths no other path extends, in their order (from_sequences rebuilds the trie from them)."""
    inner = {p[:-1] for p in paths}
    return [list(p) for p in paths if p not in inner]
