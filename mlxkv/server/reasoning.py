"""Thinking models' output split in two: text between the think markers is ``reasoning_content``, the rest is
``content`` (the convention of DeepSeek's API and vLLM's reasoning parsers; mlx_lm.server names the field
``reasoning``).

The markers are the tokenizer's own (mlx-lm's ``TokenizerWrapper.think_start`` / ``think_end``, e.g. ``<think>``
and ``</think>``) and never reach either field. A template that opens the think block in the prompt (DeepSeek-R1
style, or Qwen3 until ``enable_thinking`` turns it off) starts the output in reasoning; see :func:`starts_in_reasoning`.
Text is split as it streams: a piece that may be the start of a marker is held back until the next piece settles it.
"""

from __future__ import annotations

from typing import Any, Sequence


def splitter_for(tokenizer: Any, prompt: Sequence[int]) -> "ReasoningSplitter | None":
    """A splitter for a chat completion of ``prompt`` when the tokenizer has think markers, else ``None``."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    return ReasoningSplitter(tokenizer.think_start, tokenizer.think_end, starts_in_reasoning(tokenizer, prompt))


def starts_in_reasoning(tokenizer: Any, prompt: Sequence[int]) -> bool:
    """Whether the prompt leaves a think block open (its last start marker comes after its last end marker)."""
    prompt = list(prompt)
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)


class ReasoningSplitter:
    """Splits one choice's streamed text into ``(reasoning, content)`` pieces.

    Args:
        start: the marker opening a think block.
        end: the marker closing it.
        reasoning: whether the text starts inside a think block.
    """

    def __init__(self, start: str, end: str, reasoning: bool = False):
        assert start and end, "think markers must be non-empty"
        self.start, self.end = start, end
        self.reasoning = reasoning
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add the next piece of text; return the reasoning and content now safe to show."""
        parts: tuple[list[str], list[str]] = ([], [])
        text = self._held + text
        while True:
            marker = self.end if self.reasoning else self.start
            at = text.find(marker)
            if at < 0:
                break
            parts[0 if self.reasoning else 1].append(text[:at])
            text = text[at + len(marker):]
            self.reasoning = not self.reasoning
        hold = _prefix_suffix(text, self.end if self.reasoning else self.start)
        self._held = text[len(text) - hold:] if hold else ""
        parts[0 if self.reasoning else 1].append(text[: len(text) - hold])
        return "".join(parts[0]), "".join(parts[1])

    def flush(self) -> tuple[str, str]:
        """At the end of the choice: the held-back text (it never completed a marker)."""
        held, self._held = self._held, ""
        return (held, "") if self.reasoning else ("", held)


def _prefix_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
