"""The valid values of every setting a user gives (CLI options, config fields): one rule or constant each.

Pure Python with no mlxkv import, so every layer may read it: the config dataclasses validate their fields with
these rules (:mod:`mlxkv.config`), the Typer options refuse a bad value with the same words before the command
runs (:mod:`mlxkv.cli.shared_options`), and the KV layouts and kernels guard their arguments with the same sets.
A rule's message is about the value alone (``2.5 is not in the range 0<=x<=2: ...``); callers add the name the
user typed (``temp``, ``--temp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_BACKENDS = ("dense", "paged")
KV_LAYOUTS = ("mlxkv", "mlx-lm")
KV_BITS = (4, 8)  # quantized KV storage; None (not a member) is full precision
KV_GROUP_SIZES = (32, 64, 128)
KV_OVERFLOW_POLICIES = ("preempt", "window", "h2o", "offload")
MAX_KV_KEEP = 4  # sink tokens a --max-kv-size window keeps at its start: the window must be larger
MAX_BLOCK_SIZE = 256


def shown(value: Any) -> str:
    """``value`` as a user typed it: strings quoted, floats without a trailing ``.0``."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Rule:
    """The valid values of one setting. ``check(value)`` returns it or raises ValueError saying why not."""

    def problem(self, value: Any) -> str | None:  # pragma: no cover - every rule overrides it
        raise NotImplementedError

    def check(self, value: Any) -> Any:
        if (why := self.problem(value)) is not None:
            raise ValueError(why)
        return value


@dataclass(frozen=True)
class OneOf(Rule):
    """One of ``choices``."""

    choices: tuple

    def problem(self, value: Any) -> str | None:
        ok = value in self.choices and not isinstance(value, bool)
        return None if ok else f"{shown(value)} is not one of {', '.join(str(c) for c in self.choices)}"


@dataclass(frozen=True)
class Range(Rule):
    """A number (an integer with ``integer``) between ``low`` and ``high`` (``None``: unbounded); ``open_low`` and
    ``open_high`` exclude the bound itself. ``why`` says what the bound is for."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    integer: bool = False
    why: str = ""

    @property
    def notation(self) -> str:
        low = "" if self.low is None else f"{shown(self.low)}{'<' if self.open_low else '<='}"
        high = "" if self.high is None else f"{'<' if self.open_high else '<='}{shown(self.high)}"
        if self.high is None:
            return f"x {'>' if self.open_low else '>='} {shown(self.low)}"
        return f"{low}x{high}"

    def problem(self, value: Any) -> str | None:
        kind = "an integer" if self.integer else "a number"
        if not (_is_int(value) if self.integer else _is_number(value)):
            return f"{shown(value)} is not {kind}"
        below = self.low is not None and (value <= self.low if self.open_low else value < self.low)
        above = self.high is not None and (value >= self.high if self.open_high else value > self.high)
        if not (below or above):
            return None
        if below:
            must = f"greater than {shown(self.low)}" if self.open_low else f"greater than or equal to {shown(self.low)}"
        else:
            must = f"less than {shown(self.high)}" if self.open_high else f"less than or equal to {shown(self.high)}"
        return f"{shown(value)} is not in the range {self.notation}: it must be {must}" + (
            f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class PowerOfTwo(Rule):
    """A power of two from 1 to ``high``."""

    high: int

    def problem(self, value: Any) -> str | None:
        if _is_int(value) and 1 <= value <= self.high and not value & (value - 1):
            return None
        return f"{shown(value)} is not a power of two in 1..{self.high} (1, 2, 4, ..., {self.high})"


#: The rule of each setting, by the name of its config field (the CLI option is the same name with dashes).
TEMP = Range(0.0, 2.0, why="OpenAI's range; 0 is greedy")
TOP_P = Range(0.0, 1.0, open_low=True)
TOP_K = Range(0, integer=True)
MIN_P = Range(0.0, 1.0, open_high=True)
MAX_TOKENS = Range(1, integer=True)
KV_BACKEND = OneOf(KV_BACKENDS)
KV_LAYOUT = OneOf(KV_LAYOUTS)
KV_BITS_RULE = OneOf(KV_BITS)
KV_GROUP_SIZE = OneOf(KV_GROUP_SIZES)
KV_BLOCK_SIZE = PowerOfTwo(MAX_BLOCK_SIZE)
MAX_KV_SIZE = Range(MAX_KV_KEEP, open_low=True, integer=True, why=f"the window keeps {MAX_KV_KEEP} sink tokens")
STATE_SNAPSHOT_INTERVAL = Range(0, integer=True)
KV_OVERFLOW = OneOf(KV_OVERFLOW_POLICIES)
KV_OVERFLOW_BUDGET = Range(2, integer=True)
KV_OVERFLOW_SINKS = Range(0, integer=True)
KV_OVERFLOW_RECENT = Range(1, integer=True)


def check_field(name: str, rule: Rule, value: Any, *, optional: bool = False) -> None:
    """Raise ValueError naming the config field ``name`` when ``value`` breaks ``rule`` (``None`` passes when
    ``optional``)."""
    if optional:
        if value is None:
            return
        if isinstance(rule, OneOf):
            rule = OneOf((None, *rule.choices))
    if (why := rule.problem(value)) is not None:
        raise ValueError(f"{name}: {why}")
