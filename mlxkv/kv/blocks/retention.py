"""Retention priorities: which cached blocks to keep longest, by token range (TensorRT-LLM's model).

Priorities run 0..100 (higher is kept longer), default 35. A ``RetentionConfig`` gives prompt token ranges
``(start, end | None, priority, duration_s | None)`` and a priority for generated (decode) tokens. A block
takes the highest priority among its tokens; a priority with a duration expires that many seconds after it
was set and then reads as the default 35 again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from mlxkv.kv.blocks.block import DEFAULT_PRIORITY

MIN_PRIORITY = 0
MAX_PRIORITY = 100


def _check_priority(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"{what}={value!r}: expected an integer priority in {MIN_PRIORITY}..{MAX_PRIORITY}")
    return value


def _check_duration(value: object, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what}={value!r}: expected None (no expiry) or a duration in seconds > 0")
    return float(value)


@dataclass(frozen=True, slots=True)
class TokenRangeRetention:
    """Priority for prompt tokens ``[start, end)`` (``end=None``: to the end of the prompt)."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"token range start={self.start!r}: expected an integer >= 0")
        if self.end is not None and (
            isinstance(self.end, bool) or not isinstance(self.end, int) or self.end <= self.start
        ):
            raise ValueError(
                f"token range [{self.start}, {self.end}): end must be None or an integer > start ({self.start})"
            )
        _check_priority(self.priority, f"token range [{self.start}, {self.end}) priority")
        object.__setattr__(self, "duration_s", _check_duration(self.duration_s, "token range duration_s"))


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Per-request retention rules. ``ranges`` may hold TokenRangeRetention or plain 3/4-tuples.

    Raises ValueError for priorities outside 0..100, bad bounds or durations, and overlapping ranges.
    """

    ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        ranges: list[TokenRangeRetention] = []
        for item in self.ranges:
            if isinstance(item, TokenRangeRetention):
                ranges.append(item)
            elif isinstance(item, (tuple, list)) and len(item) in (3, 4):
                ranges.append(TokenRangeRetention(*item))
            else:
                raise ValueError(
                    f"retention range {item!r}: expected (start, end|None, priority[, duration_s|None])"
                )
        ranges.sort(key=lambda r: r.start)
        for prev, cur in pairwise(ranges):
            if prev.end is None or cur.start < prev.end:
                raise ValueError(
                    f"retention ranges [{prev.start}, {prev.end}) and [{cur.start}, {cur.end}) overlap: "
                    "each prompt token may be covered by at most one range"
                )
        object.__setattr__(self, "ranges", tuple(ranges))
        _check_priority(self.decode_priority, "decode_priority")
        object.__setattr__(self, "decode_duration_s", _check_duration(self.decode_duration_s, "decode_duration_s"))

    def _rules(self, start: int, end: int, prompt_len: int) -> Iterable[tuple[int, float | None]]:
        """(priority, duration) of every rule that touches tokens [start, end)."""
        lo, hi = start, min(end, prompt_len)
        if lo < hi:
            covered = 0
            for r in self.ranges:
                r_end = prompt_len if r.end is None else min(r.end, prompt_len)
                a, b = max(lo, r.start), min(hi, r_end)
                if a < b:
                    covered += b - a
                    yield r.priority, r.duration_s
            if covered < hi - lo:
                yield DEFAULT_PRIORITY, None
        if end > prompt_len:
            yield self.decode_priority, self.decode_duration_s

    def block_retention(self, start: int, end: int, prompt_len: int, now: float) -> tuple[int, float | None]:
        """``(priority, expiry)`` of a block holding tokens ``[start, end)`` of a sequence whose prompt has
        ``prompt_len`` tokens, set at clock time ``now``: the highest priority among its tokens; among equal
        priorities the longest-lived (no duration beats any duration). ``expiry`` is None for no expiry."""
        assert end > start, "a block holds at least one token"
        best_p, best_d, seen = -1, None, False
        for p, d in self._rules(start, end, prompt_len):
            if p > best_p or (p == best_p and best_d is not None and (d is None or d > best_d)):
                best_p, best_d, seen = p, d, True
        if not seen:
            return DEFAULT_PRIORITY, None
        return best_p, (None if best_d is None else now + best_d)


DEFAULT_RETENTION = RetentionConfig()


def merge_retention(
    current: tuple[int, float | None], new: tuple[int, float | None], now: float
) -> tuple[int, float | None]:
    """Combine a block's retention with a new request's: the higher effective priority wins; at equal
    priority the later expiry (None = never) wins. An expired current priority counts as the default."""
    cur_p, cur_exp = current
    if cur_exp is not None and now >= cur_exp:
        cur_p, cur_exp = DEFAULT_PRIORITY, None
    new_p, new_exp = new
    if new_p > cur_p:
        return new
    if new_p == cur_p and cur_exp is not None and (new_exp is None or new_exp > cur_exp):
        return new
    return cur_p, cur_exp
