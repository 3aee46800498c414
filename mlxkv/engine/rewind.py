"""Rewinding a sequence's layer caches after speculative verification.

Attention caches rewind with ``trim(n)``, which must remove exactly ``n`` tokens; a cache that removes fewer
would leave unverified K/V behind and silently change every later token, so that is an error here, never a
quiet divergence. Recurrent layers (mlx-lm's ``ArraysCache``: conv + SSM / gated-delta state) hold one running
state that cannot be trimmed. For those we snapshot the state before a multi-token forward and restore it
afterwards; whoever rewinds then replays the tokens that were kept (see :class:`CacheRewinder`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mlxkv.kv import RewindError

# mlx-lm layouts that report themselves trimmable but cannot rewind exactly: a RotatingKVCache that has
# wrapped trims 0 (or moves its cursor over overwritten rows), and a ChunkedKVCache trimmed back into a chunk
# whose front it dropped attends to the wrong keys. mlxkv's own layouts rewind these exactly.
_INEXACT_MLX_LM = {"RotatingKVCache", "ChunkedKVCache"}


def flatten_caches(caches: Iterable[Any]) -> list:
    """Layer caches with mlx-lm ``CacheList`` containers expanded into their members."""
    out = []
    for cache in caches:
        members = getattr(cache, "caches", None) if type(cache).__name__ == "CacheList" else None
        out.extend(flatten_caches(members) if members is not None else [cache])
    return out


def is_recurrent(cache: Any) -> bool:
    """True for caches holding a running (untrimmable) state rather than per-token K/V."""
    from mlx_lm.models.cache import ArraysCache

    return isinstance(cache, ArraysCache) or not callable(getattr(cache, "trim", None))


def check_rewindable(caches: Iterable[Any]) -> None:
    """Refuse cache layouts known to rewind inexactly.

    Raises:
        ValueError: a layer uses mlx-lm's ``RotatingKVCache`` or ``ChunkedKVCache``.
    """
    for cache in flatten_caches(caches):
        cls = type(cache)
        if cls.__module__ == "mlx_lm.models.cache" and cls.__name__ in _INEXACT_MLX_LM:
            raise ValueError(
                f"speculative decoding needs caches that rewind exactly; mlx-lm's {cls.__name__} does not "
                "(once wrapped or past a chunk). Use the 'mlxkv' cache layout."
            )


def _copy_tree(value: Any) -> Any:
    """Copy list/tuple/dict containers, keep arrays (MLX arrays are immutable values)."""
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_tree(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy_tree(v) for k, v in value.items()}
    return value


class CacheRewinder:
    """Rewinds one sequence's layer caches by a token count.

    ``trim`` layers are trimmed exactly; recurrent layers are restored from a :meth:`snapshot`. A snapshot
    exists only where the caller took one (between forwards), so after a multi-token forward a model with
    recurrent layers rewinds to the snapshot before it and feeds the tokens it keeps again (``needs_replay``).

    Args:
        caches: the sequence's layer caches (as the model receives them).
        max_trim: the most tokens one rewind will remove; mlxkv's rotating and chunked layouts rewind
            exactly only as far as their ``max_rewind`` undo record, which must cover it.

    Raises:
        ValueError: see :func:`check_rewindable`; a layer whose ``max_rewind`` is below ``max_trim``.
    """

    def __init__(self, caches: list, max_trim: int = 0):
        check_rewindable(caches)
        layers = flatten_caches(caches)
        self.recurrent = [c for c in layers if is_recurrent(c)]
        self.trimmable = [c for c in layers if not is_recurrent(c)]
        for cache in self.trimmable:
            limit = getattr(cache, "max_rewind", None)
            if isinstance(limit, int) and limit < max_trim:
                raise ValueError(
                    f"{type(cache).__name__} keeps an undo record of {limit} tokens (max_rewind) but speculation "
                    f"may rewind {max_trim}: use fewer draft tokens or caches with max_rewind >= {max_trim}"
                )

    @property
    def needs_replay(self) -> bool:
        """True if rewinding part of a forward needs a replay (the model has recurrent layers)."""
        return bool(self.recurrent)

    def snapshot(self) -> list | None:
        """The recurrent layers' current state (``None`` without recurrent layers); cheap: arrays are shared."""
        return [_copy_tree(c.state) for c in self.recurrent] if self.recurrent else None

    def restore(self, snapshot: list | None) -> None:
        """Put the recurrent layers back to ``snapshot`` (from :meth:`snapshot`)."""
        assert (snapshot is None) == (not self.recurrent), "snapshot does not match these caches"
        for cache, state in zip(self.recurrent, snapshot or ()):
            cache.state = _copy_tree(state)

    def trim(self, n: int) -> None:
        """Remove the last ``n`` tokens from every trimmable layer, exactly.

        Raises:
            RewindError: a layer removed fewer than ``n`` tokens.
        """
        assert n >= 0, n
        if n == 0:
            return
        for cache in self.trimmable:
            removed = cache.trim(n)
            if removed != n:
                raise RewindError(
                    f"{type(cache).__name__}.trim({n}) removed {removed} tokens: this cache cannot rewind "
                    "speculative tokens exactly"
                )
