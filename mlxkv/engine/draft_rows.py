"""Draft-model proposals for the engine step: one small model drafting for every speculating decode row at once.

``mlxkv serve --draft-model M`` gives each speculating row a :class:`ModelRowDrafter`; before a decode step the
scheduler asks all of them together (:meth:`DraftModelRows.propose`), and the draft model runs a few batched
forwards over the rows, not one per row per token: the first feeds each row's committed tokens that the draft has
not seen yet (ragged rows, one forward) and samples ``d_1``; each further forward feeds the rows' last draft token
and samples the next, dropping rows whose proposal is long enough. A row's draft is sampled from the draft model's
own distribution under the row's sampling settings, and those log-probabilities travel with the proposal: the
target's rejection sampling needs them (greedy rows take the argmax and need none).

The draft model keeps its KV in a paged :class:`~mlxkv.kv.CachePool` of its own, one sequence per row, with prefix
caching: a request whose prompt shares a prefix with an earlier one takes that prefix from the draft's cache too.
Only committed tokens are committed there (block hashes never see a rejected draft): the catch-up positions are
committed after the first forward, ``d_1..d_{k-1}`` stay uncommitted until the target's verdict, then the rejected
ones are trimmed (paged slots returned) and the rest committed. A preempted row releases its draft sequence and
reopens it, as a prefix hit, when it proposes again; a closed, failed or cancelled row releases it for good.

The draft's pool is its own, not a layer group of the target's: the two models have different layer counts, head
sizes and prefix hashes (a draft block holds other K/V for the same tokens), and the target's pool sizes, admits,
preempts and tiers blocks for the target's layers; sharing one block manager would make every target block
allocation also allocate draft pages it may not need (``speculative: false`` rows, rows that cannot speculate).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import mlx.core as mx

from mlxkv.engine.drafters import Draft
from mlxkv.engine.prefill_batch import forward_together, last_rows
from mlxkv.engine.rewind import CacheRewinder
from mlxkv.engine.verify import logprobs, sampling_logprobs
from mlxkv.kv import BatchUnsupported, CachePool, CacheRequest, cache_arrays, check_attended, make_batch_views

#: Committed tokens a row may feed in the shared first forward; a longer catch-up (a new row's prompt) runs alone
#: first, so that the other rows are not padded to its length.
MAX_SHARED_CATCH_UP = 16
#: Tokens per forward when a row catches up alone.
CATCH_UP_STEP = 512


def draft_pool_blocks(target_tokens: int, max_sequences: int, num_draft_tokens: int, block_size: int) -> int:
    """Blocks for a draft pool that holds every token the target's pool holds, plus, per sequence, its unverified
    drafts and two partial blocks (a row's tail and a fork's copy): the draft never runs out before the target."""
    per_sequence = 2 + math.ceil(num_draft_tokens / block_size)
    return math.ceil(target_tokens / block_size) + max_sequences * per_sequence


class DraftModelRows:
    """The draft model shared by every speculating row: its model, its paged pool, and batched proposals.

    Args:
        model: the draft model (mlx-lm module) sharing the target's vocabulary.
        pool: its own paged CachePool (prefix caching on).

    Raises:
        ValueError: a dense ``pool``.
    """

    def __init__(self, model: Any, pool: CachePool):
        if not pool.is_paged:
            raise ValueError("the draft model's pool must be paged (prefix caching of its own)")
        self.model = model
        self.pool = pool
        self.batched = True  # switched off for good by the first forward whose layers cannot be batched
        self.totals = dict(draft_forwards=0, draft_rows=0, draft_catch_up_tokens=0, draft_cached_tokens=0,
                           draft_failures=0)

    def row(self, prompt: Sequence[int], sampler: Any, k: int, salt: Any = None) -> "ModelRowDrafter":
        """A drafter for one decoding choice of ``prompt`` sampled by ``sampler``, proposing up to ``k`` tokens."""
        return ModelRowDrafter(self, list(prompt), sampler, k, salt)

    def stats(self) -> dict:
        """Forwards, rows per forward, prefix hits and the draft pool's blocks and bytes."""
        t = self.totals
        blocks = self.pool.block_stats().get("kv_blocks", {})
        return {"forwards": t["draft_forwards"],
                "rows_per_forward": t["draft_rows"] / t["draft_forwards"] if t["draft_forwards"] else 0.0,
                "catch_up_tokens": t["draft_catch_up_tokens"], "cached_tokens": t["draft_cached_tokens"],
                "failures": t["draft_failures"],
                "sequences": len(self.pool), "kv_bytes": self.pool.memory_usage_bytes(),
                "kv_blocks": {key: blocks.get(key) for key in ("total", "used", "free", "cached", "allocated_bytes")}}

    # ---- proposing ---------------------------------------------------------------------------------------------
    def propose(self, rows: Sequence["ModelRowDrafter"], budgets: Sequence[int]) -> list[Draft]:
        """Each row's proposal of up to ``min(row.length, budget)`` tokens (empty where the budget is < 1 or the draft
        pool has no room), in as many batched forwards over the rows as the longest proposal has tokens."""
        out = [Draft([]) for _ in rows]
        want = {}
        for i, (row, budget) in enumerate(zip(rows, budgets)):
            n = min(row.length, budget)
            if n > 0 and row.prepare():
                want[i] = n
        if not want:
            return out
        try:
            return self._propose(rows, want, out)
        except Exception:  # noqa: BLE001 - the draft is an optimisation: these rows decode without it this step
            self.totals["draft_failures"] += 1
            for i in want:
                rows[i].suspend()
            return [Draft([]) for _ in rows]

    def _propose(self, rows: Sequence["ModelRowDrafter"], want: dict[int, int], out: list[Draft]) -> list[Draft]:
        """:meth:`propose` for rows ``want`` (row index -> tokens wanted), prepared."""
        active = list(want)
        # first forward: every row's catch-up (committed tokens the draft has not seen), d_1 from its last position
        feeds = [rows[i].catch_up() for i in active]
        for i, feed in zip(active, feeds):
            rows[i].announce(feed)
        last = self._forward([rows[i] for i in active], feeds)  # (B, V)
        for i in active:
            rows[i].seq.commit()  # the catch-up tokens are committed ones
            rows[i].written = len(rows[i].tokens)
        drafted = {i: [] for i in active}
        lps: dict[int, list] = {i: [] for i in active}
        while True:
            tokens = self._sample([rows[i] for i in active], last, [lps[i] for i in active])
            for i, t in zip(active, tokens):
                drafted[i].append(t)
            active = [i for i in active if len(drafted[i]) < want[i]]
            if not active:
                break
            for i in active:
                rows[i].announce([drafted[i][-1]])
                rows[i].unverified += 1
            last = self._forward([rows[i] for i in active], [[drafted[i][-1]] for i in active])
        for i in want:
            rows[i].drafted(len(drafted[i]))
            out[i] = Draft(drafted[i], mx.concatenate(lps[i], axis=0) if lps[i] else None)
        return out

    def _forward(self, rows: Sequence["ModelRowDrafter"], feeds: Sequence[list[int]]) -> mx.array:
        """``feeds[b]`` into row b's draft caches in one forward; each row's last position's logits ``(B, V)``."""
        self.totals["draft_rows"] += len(rows)
        if self.batched and len(rows) > 1:
            try:
                if all(len(f) == 1 for f in feeds):  # a draft step: the decode views (cheaper than prefill views)
                    views = make_batch_views([r.seq.caches for r in rows])
                    last = self.model(mx.array(feeds, dtype=mx.uint32), cache=views)[:, -1, :]  # (B, V)
                    check_attended(views)
                else:
                    logits = forward_together(self.model, [r.seq.caches for r in rows], feeds)  # (B, Lmax, V)
                    last = last_rows(logits, [len(f) for f in feeds])
            except BatchUnsupported:
                self.batched = False  # from now on one forward per row; this step's rows start over (suspended)
                raise
            else:
                self.totals["draft_forwards"] += 1
                return last
        self.totals["draft_forwards"] += len(rows)
        return mx.concatenate([self.model(mx.array(f, dtype=mx.uint32)[None], cache=r.seq.caches)[:, -1, :]
                               for r, f in zip(rows, feeds)], axis=0)  # (B, V)

    @staticmethod
    def _sample(rows: Sequence["ModelRowDrafter"], last: mx.array, lps: Sequence[list]) -> list[int]:
        """Each row's next draft token from ``last`` ``(B, V)``: the argmax for greedy rows, a draw from the row's
        sampling distribution otherwise (its log-probabilities ``(1, V)`` appended to the row's ``lps``)."""
        greedy = mx.argmax(logprobs(last), axis=-1)  # (B,)
        draws = []
        for b, row in enumerate(rows):
            if row.sampler.greedy:
                draws.append(greedy[b : b + 1])
            else:
                lp = sampling_logprobs(last[b : b + 1], row.sampler.params)  # (1, V)
                lps[b].append(lp)
                draws.append(mx.random.categorical(lp, axis=-1))  # (1,)
        tokens = mx.concatenate(draws)  # (B,)
        mx.eval(tokens, *[lp[-1] for lp in lps if lp])
        return tokens.tolist()


class ModelRowDrafter:
    """One decoding choice's drafter over the shared draft model: its draft sequence and what it holds.

    ``tokens`` is the row's committed text (prompt, then every emitted token); the draft sequence holds its first
    ``written`` positions, committed, and after a proposal of ``k`` tokens also ``d_1..d_{k-1}``, uncommitted until
    :meth:`verified`.

    The proposal length adapts as prompt lookup's does: it doubles (up to ``k``) after a step that accepted every
    proposed token and falls back to one more than the accepted count after a rejection, so a draft that seldom
    agrees with the served model pays for short proposals only. Which tokens are proposed never changes the output.

    Args:
        source: the shared :class:`DraftModelRows`.
        prompt: the request's prompt tokens.
        sampler: the row's sampler (``greedy``, ``params``).
        k: most tokens proposed per step.
        salt: the request's cache salt (its draft blocks are shared only with requests of the same salt).
    """

    def __init__(self, source: DraftModelRows, prompt: list[int], sampler: Any, k: int, salt: Any = None):
        self.source = source
        self.tokens = prompt
        self.sampler = sampler
        self.k = k
        self.length = k  # the next proposal's length
        self.salt = salt
        self.seq: Any = None
        self.written = 0  # positions of `tokens` in the draft caches, committed
        self.known = 0  # positions the draft pool was told at open (slots taken on demand; later ones fed)
        self.unverified = 0  # draft tokens written past `written` by the last proposal (d_1..d_{k-1})
        self.proposed = 0  # the last proposal's length (0: none outstanding)

    # ---- the row interface (see mlxkv.engine.speculation) -------------------------------------------------------
    def propose(self, budget: int) -> list[int]:
        """Up to ``min(length, budget)`` tokens (one row alone; the scheduler asks every row at once instead)."""
        return self.source.propose([self], [budget])[0].tokens

    def emitted(self, token: int) -> None:
        """``token`` was emitted (committed)."""
        self.tokens.append(token)

    def verified(self, proposed: int, accepted: int) -> None:
        """The last proposal's outcome: ``accepted`` of its ``proposed`` tokens were kept (``proposed`` 0: it was
        dropped before verification). The rejected draft positions are trimmed, the rest committed."""
        if not self.proposed:
            return
        if proposed:
            self.length = min(self.k, 2 * self.length) if accepted == proposed else max(1, accepted + 1)
        keep = min(accepted if proposed else 0, self.unverified)
        try:
            if self.seq is not None:
                CacheRewinder(self.seq.caches, max_trim=self.unverified).trim(self.unverified - keep)
                self.seq.commit()
                self.written += keep
        except Exception:  # noqa: BLE001 - a draft that cannot rewind starts over, as after a preemption
            self.suspend()
        self.unverified = self.proposed = 0

    def suspend(self) -> None:
        """Release the draft sequence (the row was preempted, or its draft fell out of step); the next proposal
        reopens it over the committed tokens, taking its prefix hit."""
        if self.seq is not None:
            if self.seq.id in self.source.pool:
                self.source.pool.release(self.seq.id)
            self.seq = None
        self.written = self.known = self.unverified = self.proposed = 0

    def end(self) -> None:
        """The row is done: release its draft sequence (safe to call more than once)."""
        self.suspend()

    # ---- what DraftModelRows asks ---------------------------------------------------------------------------------
    def prepare(self) -> bool:
        """Open the draft sequence if need be and bring it to one committed token short of ``tokens`` (a long
        catch-up runs alone here); False when the draft pool has no room (the row proposes nothing this step)."""
        pool = self.source.pool
        if self.proposed:  # a proposal never verified (its step did not run): start over
            self.suspend()
        try:
            if self.seq is None:
                opened = self.tokens[:-1] or self.tokens  # the last token is always fed: its logits draft d_1
                self.seq = pool.open(prompt_length=len(opened), prompt=opened,
                                     cache_request=CacheRequest(salt=self.salt))
                self.written, self.known = self.seq.num_cached, len(opened)
                if self.written >= len(self.tokens):  # a one-token prompt wholly cached: feed it again
                    CacheRewinder(self.seq.caches, max_trim=1).trim(1)
                    self.written = self.known = len(self.tokens) - 1
                self.source.totals["draft_cached_tokens"] += self.written
            if not pool.can_extend(self.seq, len(self.tokens) - self.written + self.k):
                self.suspend()
                return False
            behind = len(self.tokens) - self.written - 1
            if behind > MAX_SHARED_CATCH_UP:
                self._catch_up_alone(self.tokens[self.written : self.written + behind])
        except Exception:  # noqa: BLE001 - the draft is an optimisation: this row decodes without it
            self.source.totals["draft_failures"] += 1
            self.suspend()
            return False
        return True

    def _catch_up_alone(self, tokens: list[int]) -> None:
        """``tokens`` into the draft caches, ``CATCH_UP_STEP`` per forward, committed."""
        for start in range(0, len(tokens), CATCH_UP_STEP):
            chunk = tokens[start : start + CATCH_UP_STEP]
            self.announce(chunk)
            self.source.model(mx.array(chunk, dtype=mx.uint32)[None], cache=self.seq.caches)
            mx.eval(cache_arrays(self.seq.caches))
            self.seq.commit()
            self.written += len(chunk)
            self.source.totals["draft_catch_up_tokens"] += len(chunk)

    def catch_up(self) -> list[int]:
        """The committed tokens the draft caches do not hold yet (at least one: the last)."""
        feed = self.tokens[self.written :]
        self.source.totals["draft_catch_up_tokens"] += len(feed)
        return feed

    def announce(self, tokens: list[int]) -> None:
        """Take the slots of the next ``tokens``: positions the pool was told at open are reserved, later ones fed."""
        start = self.written + self.unverified
        end = start + len(tokens)
        if start < self.known:
            self.seq.reserve(start, min(end, self.known))
        if end > self.known:
            self.seq.feed(tokens[max(0, self.known - start) :])

    def drafted(self, n: int) -> None:
        """A proposal of ``n`` tokens was made: ``d_1..d_{n-1}`` are in the draft caches, uncommitted."""
        assert self.unverified == n - 1, (self.unverified, n)
        self.proposed = n
