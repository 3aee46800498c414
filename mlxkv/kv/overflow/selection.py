"""Which resident rows an overflowing layer gives up, and how the survivors are packed without a copy.

Every cached position gets an eviction score: its accumulated attention mass, or +inf when it is protected (one
of the first ``sinks`` positions, or within the last ``recent`` positions). The ``budget`` highest scores stay.
The ``E = rows - budget`` rows that go leave holes below ``budget``; the survivors above ``budget`` move into
them (``E`` row moves, not a rebuild of the buffer), so the resident rows end up in slots ``[0, budget)``.
All of it is lazy MLX with static shapes: no host round trip is needed to evict.
"""

from __future__ import annotations

import mlx.core as mx


def eviction_scores(mass: mx.array, positions: mx.array, offset: int, sinks: int, recent: int) -> mx.array:
    """``(R,)`` scores of the resident rows, higher kept first.

    Args:
        mass: ``(n_kv, R)`` accumulated attention mass of each row, summed over its KV heads here (one set of
            positions per layer keeps the mask and the RoPE positions one vector for all heads).
        positions: ``(R,)`` token position of each row.
        offset: tokens seen (the next position).
        sinks: the first positions always kept.
        recent: the last positions always kept.
    """
    protected = (positions < sinks) | (positions >= offset - recent)  # (R,)
    return mx.where(protected, mx.inf, mass.sum(axis=0))  # (R,)


def compaction_plan(scores: mx.array, budget: int) -> tuple[mx.array, mx.array, mx.array]:
    """Slots to empty and fill so that the ``budget`` best-scored of ``R`` rows occupy slots ``[0, budget)``.

    Ties are broken by slot (the older slot stays), so the plan is deterministic.

    Returns:
        ``(holes, movers, evicted)``, each ``(E,)`` uint32 slot indices with ``E = R - budget``: ``evicted`` are
        the rows that go; row ``movers[i]`` is copied into slot ``holes[i]`` (pairs past the real holes copy a
        survivor into a slot at or past ``budget``, which is then unused: harmless).
    """
    R = scores.shape[0]
    E = R - budget
    assert 0 < E < R, f"nothing to evict: {R} rows for a budget of {budget}"
    slot = mx.arange(R)
    # stable ranking: by score descending, then slot ascending
    order = mx.argsort(-scores, axis=0)  # (R,); argsort is stable on equal keys in MLX's sort
    kept = mx.zeros((R,), dtype=mx.bool_)
    kept[order[:budget]] = True
    big = 2 * R
    spare = mx.where(slot >= budget, big + slot, 2 * big + slot)  # slots past the budget: safe to overwrite
    holes = mx.argsort(mx.where(~kept & (slot < budget), slot, spare))[:E]  # real holes first, then spare slots
    movers = mx.argsort(mx.where(kept & (slot >= budget), slot, big + slot))[:E]  # survivors above budget first
    evicted = mx.argsort(mx.where(kept, big + slot, slot))[:E]
    return holes, movers, evicted
