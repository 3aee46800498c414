"""FetchedRows: what a cache's ``update_and_fetch`` handed the model this step, as explicit state.

Attention may read the pages in place (or run the paged kernel) instead of the K/V tensors it is handed only when
those tensors are the rows the cache returned, untransformed: a model may instead hand over tensors it derived
from them (mlx-lm's DeepSeek attention expands its cached latents, or passes the latent as both keys and values).
Each cache or batch view keeps one :class:`FetchedRows`: :meth:`record` at the fetch, :meth:`handed_back` at
attention (the one place that compares what came back with what was handed out), :meth:`clear` when a write
makes the record stale or attention has consumed it (a view of the old pages kept alive would make the next
write copy the whole page array instead of updating it in place).
"""

from __future__ import annotations

from typing import Any


class FetchedRows:
    """The K/V one ``update_and_fetch`` returned, with what the caller knows of them.

    Attributes:
        keys, values: what was returned (None once cleared).
        span: the positions ``[start, end)`` they hold (single sequence) or per-sequence spans (batch views).
        view: whether they are a zero-copy view of consecutive pages.
    """

    __slots__ = ("keys", "values", "span", "view")

    def __init__(self) -> None:
        self.keys: Any = None
        self.values: Any = None
        self.span: Any = (0, 0)
        self.view = False

    def record(self, keys: Any, values: Any, span: Any = (0, 0), view: bool = False) -> tuple[Any, Any]:
        """Remember ``(keys, values)`` as this step's fetched rows; returns them."""
        self.keys, self.values, self.span, self.view = keys, values, span, view
        return keys, values

    def clear(self) -> None:
        """Forget the rows (the span stays: :meth:`~mlxkv.kv.paged.PagedLayerCache.refetch` reads it again)."""
        self.keys = self.values = None
        self.view = False

    @property
    def current(self) -> bool:
        """Whether rows are recorded and not yet cleared."""
        return self.keys is not None

    def handed_back(self, keys: Any, values: Any) -> bool:
        """Whether attention was handed exactly the recorded rows (the model passed them through untransformed)."""
        return self.keys is not None and keys is self.keys and values is self.values
