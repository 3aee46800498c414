"""KV-cache groups: layers grouped by attention type. Every group shares the pool and the block size.

Each group has its own block table per sequence. What differs is which past tokens a layer still needs
to compute the token at position ``n`` (``first_needed(n)``): full attention needs all of them, a sliding
window of W tokens needs the last W-1 (the query itself is the W-th), chunked attention with chunk C needs
the tokens of the current chunk only. Blocks wholly before ``first_needed`` can be released to the pool
(they stay cached) and replaced by the null block in the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class FullAttention:
    """Every past token is attended: nothing is released while the sequence runs."""

    name = "full"
    window: int | None = None
    chunk_size: int | None = None

    def first_needed(self, num_tokens: int) -> int:
        """First position still needed to compute the token at position ``num_tokens`` (and every later one)."""
        return 0

    def span(self) -> int | None:
        """Tokens a sequence's table of this kind holds real K/V for at most (None: unbounded)."""
        return None


@dataclass(frozen=True, slots=True)
class SlidingWindow(FullAttention):
    """A window of ``window`` tokens: the query itself and the ``window - 1`` before it."""

    window: int
    name = "sliding"

    def first_needed(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window + 1)

    def span(self) -> int:
        return self.window


@dataclass(frozen=True, slots=True)
class ChunkedAttention(FullAttention):
    """Llama-4 local chunks of ``chunk_size`` tokens: the current chunk only."""

    chunk_size: int
    name = "chunked"

    def first_needed(self, num_tokens: int) -> int:
        return (num_tokens // self.chunk_size) * self.chunk_size

    def span(self) -> int:
        return self.chunk_size


ATTENTION_KINDS = ("full", "sliding", "chunked")


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One group of layers sharing an attention pattern.

    kind: "full", "sliding" (needs ``window``) or "chunked" (needs ``chunk_size``).
    layer_ids: model layers using this group (for the storage layer; the manager ignores it).
    """

    kind: str = "full"
    window: int | None = None
    chunk_size: int | None = None
    layer_ids: tuple[int, ...] = ()
    attention: FullAttention = field(init=False, repr=False, compare=False)  # the kind's rules, from kind

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"group kind={self.kind!r}: expected one of {', '.join(ATTENTION_KINDS)}")
        if self.kind == "sliding" and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"sliding group window={self.window!r}: expected an integer >= 1")
        if self.kind == "chunked" and (not isinstance(self.chunk_size, int) or self.chunk_size < 1):
            raise ValueError(f"chunked group chunk_size={self.chunk_size!r}: expected an integer >= 1")
        if self.kind == "full" and (self.window is not None or self.chunk_size is not None):
            raise ValueError("a full-attention group takes neither window nor chunk_size")
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        attention = {"full": FullAttention, "sliding": lambda: SlidingWindow(self.window),
                     "chunked": lambda: ChunkedAttention(self.chunk_size)}[self.kind]()
        object.__setattr__(self, "attention", attention)

    @property
    def is_full(self) -> bool:
        return self.kind == "full"

    def first_needed(self, num_tokens: int) -> int:
        """First position whose K/V is still needed to compute the token at position ``num_tokens``
        (and every later one)."""
        return self.attention.first_needed(num_tokens)

    def needed_blocks(self, num_tokens: int, block_size: int) -> range:
        """Block indices that must hold real K/V for a cached prefix of ``num_tokens`` tokens."""
        return range(self.first_needed(num_tokens) // block_size, -(-num_tokens // block_size))
