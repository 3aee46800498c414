"""What a new chat turn has to prefill, and which turns a long conversation drops (pure Python, no MLX).

A turn's prompt is the chat template's rendering of the whole conversation. The KV cache holds the tokens of the
previous turns (prompt and answer), so the new turn reuses the longest common token prefix of the two and
prefills only the rest: normally just what the template adds after the last answer (its end-of-turn marker, the
new user message and the generation prompt). Where the template renders the history differently from what was
generated (an answer re-tokenized differently, a template that drops earlier reasoning), the common prefix is
shorter and the cache is trimmed back to it; the result always equals prefilling the whole rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Message = dict[str, str]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """How a turn reaches its prompt from the cached tokens.

    Attributes:
        keep: cached tokens reused (the cache is trimmed back to this many).
        new_tokens: prompt tokens to prefill after them (never empty: the last one gives the first logits).
    """

    keep: int
    new_tokens: tuple[int, ...]


def plan_turn(cached: Sequence[int], prompt: Sequence[int]) -> TurnPlan:
    """The reuse of ``cached`` (the tokens the KV cache holds) for ``prompt`` (the whole rendered conversation).

    Raises:
        ValueError: ``prompt`` is empty.
    """
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed")
    # The last prompt token always runs, even when cached, so the turn starts from its logits.
    keep = min(common_prefix(cached, prompt), len(prompt) - 1)
    return TurnPlan(keep=keep, new_tokens=tuple(prompt[keep:]))


def first_turn_index(messages: Sequence[Message]) -> int:
    """Index of the first message that may be dropped: the system message (if first) always stays."""
    return 1 if messages and messages[0].get("role") == "system" else 0


def fit_conversation(messages: Sequence[Message], render: Callable[[Sequence[Message]], list[int]], limit: int,
                     reserve: int) -> tuple[list[Message], list[int], int]:
    """Drop whole turns from the front until the rendered conversation leaves ``reserve`` tokens of room.

    A turn is a user message and every message after it up to the next user message (the answer). The system
    message and the last turn (the new user message) are never dropped.

    Args:
        messages: the conversation, ending with the new user message.
        render: the conversation's prompt tokens (the template with the generation prompt).
        limit: most tokens the context holds.
        reserve: tokens wanted for the answer.

    Returns:
        ``(messages kept, their prompt tokens, turns dropped)``; the prompt may still leave less than
        ``reserve`` tokens when nothing more can be dropped.
    """
    kept = list(messages)
    tokens = render(kept)
    dropped = 0
    start = first_turn_index(kept)
    while len(tokens) + reserve > limit:
        users = [i for i in range(start, len(kept)) if kept[i].get("role") == "user"]
        if len(users) < 2:
            break  # only the new message is left
        kept = kept[:start] + kept[users[1]:]
        tokens = render(kept)
        dropped += 1
    return kept, tokens, dropped


__all__ = ["Message", "TurnPlan", "common_prefix", "plan_turn", "first_turn_index", "fit_conversation"]
