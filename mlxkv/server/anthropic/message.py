"""Anthropic ``Message`` objects from the engine's events: the content blocks, why it stopped, and usage.

The generated text becomes content blocks (:mod:`mlxkv.server.anthropic.blocks`); with tools in use it goes through
the chat route's tool-call parser first (:class:`~mlxkv.server.tool_stream.ToolOutput`), so calls become ``tool_use``
blocks and their markup never reaches a text block.

Stop reasons: the engine ends a choice with ``length`` (``max_tokens``, or ``model_context_window_exceeded`` when the
context ran out first) or ``stop`` (the end-of-turn token, or a stop string): ``tool_use`` when the answer made a call
(as the chat route's ``tool_calls``), else ``end_turn`` or ``stop_sequence``. A stop string is never emitted, so
which one matched is read from the generated tokens: decoded, they continue the emitted text with it.

Usage follows Anthropic's split of the prompt: ``input_tokens`` + ``cache_read_input_tokens`` (prompt tokens the
prefix cache served) + ``cache_creation_input_tokens`` (always 0: mlxkv caches every prompt's blocks as a matter of
course, nothing is written on request) is the whole prompt, as ``count_tokens`` counts it.
"""

from __future__ import annotations

import uuid
from typing import Any

from mlxkv.engine.request import Event, Usage
from mlxkv.server.anthropic.blocks import Blocks, StreamEvent
from mlxkv.server.tool_stream import ToolOutput
from mlxkv.server.tools import Part


def usage_body(usage: Usage) -> dict[str, int]:
    """Anthropic's ``usage`` for a finished request."""
    out = {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
           "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}
    if usage.speculative() is not None:  # mlxkv extension
        out["speculative"] = usage.speculative()
    return out


class Reply:
    """One request's answer as its events arrive, and the Anthropic objects that describe it.

    Args:
        tokenizer: the engine's tokenizer (its streaming detokenizer decodes the generated tokens again, to
            find the stop sequence).
        model: the model id reported.
        max_tokens: the request's ``max_tokens``.
        stop_sequences: the request's stop sequences.
        prompt_tokens: the rendered prompt's length.
        tools: parses the answer's tool calls (``None``: the request uses no tools).
    """

    def __init__(self, tokenizer: Any, *, model: str, max_tokens: int, stop_sequences: tuple[str, ...],
                 prompt_tokens: int, tools: ToolOutput | None = None):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.max_tokens = max_tokens
        self.stop_sequences = stop_sequences
        self.prompt_tokens = prompt_tokens
        self._tokenizer = tokenizer
        self._texts: list[str] = []
        self._tokens: list[int] = []
        self.finish_reason: str | None = None
        self.blocks = Blocks()
        self._tools = tools
        self._called = False  # the answer made a tool call and stopped by itself

    @property
    def text(self) -> str:
        """Everything generated, as the engine emitted it (tool-call markup included)."""
        return "".join(self._texts)

    def opening(self) -> list[StreamEvent]:
        """The content events a stream sends before the first token: a text block without tools (with tools the
        answer may start with a call)."""
        return self.blocks.open_text() if self._tools is None else []

    def add(self, event: Event) -> list[StreamEvent]:
        """Take a token event; returns the content events it makes (none, while text may still be a call's)."""
        assert event.kind == "token", event.kind
        if event.token is not None:
            self._tokens.append(event.token)
        if event.text:
            self._texts.append(event.text)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
        if self._tools is None:
            parts: list[Part] = [event.text]
        else:
            parts, reason = self._tools.feed_parts(0, event.text, event.finish_reason)
            self._called = self._called or reason == "tool_calls"
        events = self.blocks.add(parts)
        return events + self.blocks.finish() if event.finish_reason else events

    def finish(self) -> list[StreamEvent]:
        """The content events that close the answer (none if its last token closed it)."""
        return self.blocks.finish()

    def stop(self) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)`` of the finished answer."""
        if self.finish_reason == "length":
            return ("max_tokens" if len(self._tokens) >= self.max_tokens else "model_context_window_exceeded"), None
        if self._called:
            return "tool_use", None
        matched = self._matched_stop()
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def _matched_stop(self) -> str | None:
        if not self.stop_sequences:
            return None
        eos = set(getattr(self._tokenizer, "eos_token_ids", None) or ())
        detok = self._tokenizer.detokenizer  # a fresh copy, as the engine's text stream decodes
        for t in self._tokens:
            if t not in eos:
                detok.add_token(t)
        detok.finalize()
        raw = detok.text
        text = self.text
        at = [s for s in self.stop_sequences if raw.startswith(s, len(text))]
        if not at:  # the emitted text is not a prefix of the decode: take the first stop in it
            found = [(raw.find(s), s) for s in self.stop_sequences if s in raw]
            at = [min(found)[1]] if found else []
        return min(at, key=len) if at else None  # two starting there: the shorter one completed first

    def message(self, usage: Usage) -> dict[str, Any]:
        """The whole ``Message`` (a non-streaming response)."""
        self.finish()
        reason, sequence = self.stop()
        return {**self._envelope(self.blocks.content), "stop_reason": reason,
                "stop_sequence": sequence, "usage": usage_body(usage)}

    def started(self, usage: Usage | None = None) -> dict[str, Any]:
        """The ``message`` of a stream's ``message_start``: no content yet, and ``usage`` (the first token's: the
        prompt split into new and cached tokens, as the final ``message_delta`` reports it) with no output yet
        (``None``: the whole prompt as new input)."""
        usage = Usage(self.prompt_tokens, 0) if usage is None else Usage(usage.prompt_tokens, 0, usage.cached_tokens)
        return {**self._envelope([]), "stop_reason": None, "stop_sequence": None, "usage": usage_body(usage)}

    def _envelope(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content}
