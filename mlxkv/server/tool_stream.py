"""Tool calls in the chat route's output: each choice's generated text through a :class:`~mlxkv.server.tools.
ToolCallParser`, as whole messages or as OpenAI's streamed deltas.

A streamed call is sent whole in one delta, once its end marker has been generated: ``{"index", "id", "type":
"function", "function": {"name", "arguments"}}`` (the official clients accumulate deltas by ``index``, so one
delta with every field rebuilds the call). A choice that made a call and stopped by itself finishes with
``"tool_calls"``.
"""

from __future__ import annotations

from typing import Any

from mlxkv.server.tools import ToolCallParser


class ToolOutput:
    """Tool-call parsing of one request's ``n`` choices.

    Args:
        tokenizer: the engine's tokenizer (with a tool parser).
        tools: the request's tool definitions.
        n: choices.
        parallel: ``parallel_tool_calls``; False keeps only each choice's first call.
        streaming: add each call's ``index`` within its choice (streamed deltas carry it, whole messages do not).
    """

    def __init__(self, tokenizer: Any, tools: list[dict], n: int, *, parallel: bool = True, streaming: bool = False):
        self._parsers = [ToolCallParser(tokenizer, tools) for _ in range(n)]
        self._sent = [0] * n  # calls given out per choice
        self._parallel = parallel
        self._streaming = streaming

    def feed(self, index: int, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """Choice ``index``'s next text: ``(content, calls, finish_reason)``; on its last token (a finish reason
        given) whatever the parser still holds comes out, and ``"stop"`` becomes ``"tool_calls"`` after a call."""
        parser = self._parsers[index]
        content, calls = parser.feed(text)
        if finish_reason is not None:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
            if finish_reason == "stop" and parser.calls:
                finish_reason = "tool_calls"
        return content, self._number(index, calls), finish_reason

    def _number(self, index: int, calls: list[dict]) -> list[dict]:
        if not self._parallel:
            calls = calls[:max(0, 1 - self._sent[index])]
        if self._streaming:
            calls = [{"index": self._sent[index] + k, **call} for k, call in enumerate(calls)]
        self._sent[index] += len(calls)
        return calls
