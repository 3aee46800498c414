"""Overflow layout: a full-attention layer cache that holds at most ``budget`` rows between steps.

The resident rows keep the keys as cached (after RoPE) and their true token positions; ``offset`` stays the
number of tokens seen, so new tokens get their true RoPE positions and every resident row stays visible to
every new query (all are older). The rows returned to attention are therefore ``[resident rows][new rows]``
and the mask is the plain cache's: ``None`` for one query, ``"causal"`` aligned to the last key otherwise —
the same for every layer, whichever positions each layer kept.

Each step: (1) if the previous step left more than ``budget`` rows, evict down to ``budget`` (sinks and the
recent window are protected, then the highest accumulated attention mass stays: H2O); (2) append the new rows;
(3) ``attend`` runs the plain cache's attention (:func:`~mlxkv.kv.layouts.dense_attention.attend`: its output
while nothing was evicted) and adds each row's attention mass. ``offload`` also keeps every evicted row in an
:class:`~mlxkv.kv.overflow.offload.OffloadTier` and, before attending, brings back the rows whose proxy-estimated
share of the current queries' attention passes ``restore_threshold``; they join this step's attention.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.kv.layouts.base import LayerCache
from mlxkv.kv.layouts.dense_attention import attend
from mlxkv.kv.overflow.mass import attention_mass, masked_scores
from mlxkv.kv.overflow.offload import OffloadTier
from mlxkv.kv.overflow.selection import compaction_plan, eviction_scores

POLICIES = ("h2o", "offload")


class OverflowKVCache(LayerCache):
    """Budgeted full-attention cache (mlx-lm ``KVCache`` protocol) evicting by attention mass.

    Rewind: ``trim(n)`` removes the last ``n`` rows exactly while none of them predates the last eviction
    (always for any ``n`` before the first eviction; afterwards up to the tokens appended since). The mass those
    tokens' queries added to older rows stays (it only ranks rows for later evictions).

    Args:
        policy: ``"h2o"`` (evicted rows are dropped) or ``"offload"`` (moved to host memory, restorable).
        budget: rows kept between steps; a step attends at most ``budget`` + its new rows (+ restored rows).
        sinks: the first positions never evicted.
        recent: the last positions never evicted.
        restore_threshold: offload: restore a row when its estimated attention share passes this.
        restore_limit: offload: most rows restored per layer and step.
        step: storage growth granularity in rows.
    """

    def __init__(self, policy: str, budget: int, sinks: int = 4, recent: int = 64, restore_threshold: float = 0.01,
                 restore_limit: int | None = None, step: int = 256):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if sinks < 0 or recent < 1 or budget < sinks + recent + 1:
            raise ValueError(f"need sinks >= 0, recent >= 1 and budget > sinks + recent, got budget={budget}, "
                             f"sinks={sinks}, recent={recent}")
        self.policy, self.budget, self.sinks, self.recent = policy, budget, sinks, recent
        self.restore_threshold = restore_threshold
        self.restore_limit = restore_limit if restore_limit is not None else max(1, budget // 8)
        self.tier = OffloadTier() if policy == "offload" else None
        self._rows = 0  # storage slots [0, _rows) hold resident rows
        self._pos: mx.array | None = None  # (_rows,) int32 token position of each slot
        self._mass: mx.array | None = None  # (n_kv, _rows) float32 accumulated attention mass
        self._since_evict: int | None = None  # tokens appended since the last eviction (None: never evicted)
        self.evicted = 0  # rows evicted so far (h2o: dropped, offload: moved to the tier)
        self.restored = 0  # rows brought back from the tier so far
        super().__init__(step)

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def size(self) -> int:
        """Resident rows (what the next step attends besides its own)."""
        return self._rows

    @property
    def positions(self) -> mx.array | None:
        """``(size(),)`` token positions of the resident rows, in slot order."""
        return self._pos

    @property
    def nbytes(self) -> int:
        """Resident bytes: the K/V buffers plus the offload tier's key proxy (host rows not included)."""
        return self._store.nbytes + (self.tier.proxy_nbytes if self.tier else 0)

    def arrays(self) -> list[mx.array]:
        extra = [a for a in (self._pos, self._mass) if a is not None]
        return [*self._store.arrays(), *extra, *(self.tier.arrays() if self.tier else ())]

    # -- eviction -------------------------------------------------------------------------------------------
    def _evict(self) -> None:
        """Bring the resident rows down to ``budget`` (H2O ranking; offload moves the evicted rows to the tier)."""
        E = self._rows - self.budget
        scores = eviction_scores(self._mass, self._pos, self.offset, self.sinks, self.recent)  # (R,)
        holes, movers, evicted = compaction_plan(scores, self.budget)  # (E,) each
        k, v = self._store.buffer("k"), self._store.buffer("v")  # (B, n_kv, capacity, D)
        if self.tier is not None:
            self.tier.add(self._pos[evicted], k[:, :, evicted], v[:, :, evicted], self._mass[:, evicted])
        k[:, :, holes] = k[:, :, movers]
        v[:, :, holes] = v[:, :, movers]
        self._store.set_buffer("k", k)
        self._store.set_buffer("v", v)
        pos, mass = self._pos, self._mass
        pos[holes] = pos[movers]
        mass[:, holes] = mass[:, movers]
        self._pos, self._mass = pos[: self.budget], mass[:, : self.budget]
        self._rows = self.budget
        self.evicted += E
        self._since_evict = 0

    def _append(self, k: mx.array, v: mx.array, positions: mx.array, mass: mx.array) -> None:
        self._store.write(self._rows, (k,), (v,))
        self._rows += k.shape[2]
        self._pos = positions if self._pos is None else mx.concatenate([self._pos, positions])
        self._mass = mass if self._mass is None else mx.concatenate([self._mass, mass], axis=1)

    # -- protocol -------------------------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        """Evict down to the budget if the last step overflowed it, append ``(B, n_kv, L, D)`` rows and return
        the resident rows followed by the new ones, ``(B, n_kv, size(), D)`` (views)."""
        if self._rows > self.budget:
            self._evict()
        L = keys.shape[2]
        self._append(keys, values, mx.arange(self.offset, self.offset + L, dtype=mx.int32),
                     mx.zeros((keys.shape[1], L), dtype=mx.float32))
        self.offset += L
        if self._since_evict is not None:
            self._since_evict += L
        return self._store.read(0, self._rows)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The plain cache's mask over ``[resident][new]`` rows: every resident row is older than every query."""
        if window_size is not None:
            raise ValueError("the overflow layout serves full-attention layers only (no window_size)")
        if N == 1:
            return None
        if not return_array:
            return "causal"
        resident = min(self._rows, self.budget)
        K = resident + N
        return mx.arange(K - N, K)[:, None] >= mx.arange(K)[None]  # (N, K)

    def attend(self, queries: mx.array, keys, values, scale: float, mask=None, sinks: mx.array | None = None):
        """Attention over the rows ``update_and_fetch`` returned (plus restored rows, offload), adding each
        row's attention mass to its statistics. ``queries (B, n_q, L, D)`` -> ``(B, n_q, L, D_v)``."""
        assert not isinstance(keys, tuple) and keys.shape[2] == self._rows, \
            "the overflow layout attends the rows its update_and_fetch returned (no transformed keys)"
        scores = masked_scores(queries, keys, scale, mask)  # (B, n_kv, rep, L, K)
        n = 0
        if self.tier is not None and len(self.tier):
            picked = self.tier.select(queries, scores, scale, sinks, self.restore_threshold, self.restore_limit)
            n = int(picked.size)
        if n:
            pos, k_r, v_r, mass_r = self.tier.take(picked)
            self._append(k_r, v_r, pos, mass_r)  # resident from now on, slots after this step's rows
            self.restored += n
            keys = mx.concatenate([k_r, keys], axis=2)  # (B, n_kv, n + K, D): restored rows are older than queries
            values = mx.concatenate([v_r, values], axis=2)
            mask = _widen(mask, n)
            scores = mx.concatenate([masked_scores(queries, k_r, scale), scores], axis=-1)
        out = attend(queries, keys, values, scale, mask, sinks)  # the plain cache's attention
        mass = attention_mass(scores, sinks)  # (n_kv, n + K), restored rows first
        if n:
            mass = mx.concatenate([mass[:, n:], mass[:, :n]], axis=1)  # slot order: rows, then restored
        self._mass = self._mass + mass
        return out

    # -- rewind ---------------------------------------------------------------------------------------------
    def rewindable(self) -> int:
        return self.offset if self._since_evict is None else self._since_evict

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens' rows; returns the number removed.

        Raises:
            RewindError: some of those tokens came before the last eviction.
        """
        n = self._check_rewind(n)
        if n == 0:
            return 0
        cut = self.offset - n
        keep = self._rows - n  # every position >= cut is resident (none was evicted since)
        slot = mx.arange(self._rows)
        order = mx.argsort(mx.where(self._pos < cut, slot, self._rows + slot))[:keep]  # (keep,) slots, in order
        k, v = self._store.buffer("k"), self._store.buffer("v")
        self._store.load((k[:, :, order],), (v[:, :, order],))
        self._pos, self._mass = self._pos[order], self._mass[:, order]
        self._rows = keep
        self.offset = cut
        if self._since_evict is not None:
            self._since_evict -= n
        return n

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def state(self):
        raise NotImplementedError("an overflow cache (--kv-overflow h2o|offload) cannot be saved: its rows are a "
                                  "subset of the context; save with the plain cache")

    @state.setter
    def state(self, v) -> None:
        raise NotImplementedError("an overflow cache cannot be loaded from a state")


def _widen(mask, n: int):
    """A mask over ``K`` keys extended to ``n`` visible keys placed before them."""
    if mask is None or isinstance(mask, str):
        return mask  # "causal" is aligned to the last key: the extra older keys are visible
    pad = [(0, 0)] * (mask.ndim - 1) + [(n, 0)]
    return mx.pad(mask, pad, constant_values=True if mask.dtype == mx.bool_ else 0)
