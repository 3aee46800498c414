"""Tool calls in the chat route's output: each choice's generated text through a :class:`~mlxkv.server.tools.
ToolCallParser`, as whole messages or as OpenAI's streamed deltas.

A streamed call is sent whole in one delta, once its end marker has been generated: ``{"index", "id", "type":
"function", "function": {"name", "arguments"}}`` (the official clients accumulate deltas by ``index``, so one
delta with every field rebuilds the call). A choice that made a call and stopped by itself finishes with
``"tool_calls"``; one cut by ``max_tokens`` keeps ``"length"`` and the calls that read whole, never a cut call's
markup (:class:`~mlxkv.server.tools.ToolCallParser`). A call repeated verbatim within a choice (same function,
same arguments) is the same call and is given once: small models asked for calls tend to write it again before
they end.
"""

from __future__ import annotations

import json
from typing import Any

from mlxkv.server.tools import Part, ToolCallParser, split_parts


class ToolOutput:
    """Tool-call parsing of one request's ``n`` choices.

    Args:
        tokenizer: the engine's tokenizer (with a tool parser).
        tools: the request's tool definitions.
        n: choices.
        parallel: ``parallel_tool_calls``; False keeps only each choice's first call.
        streaming: add each call's ``index`` within its choice (streamed deltas carry it, whole messages do not).
        id_prefix: the prefix of the ids given to calls (OpenAI's ``call_``; the Messages API's ``toolu_``).
    """

    def __init__(self, tokenizer: Any, tools: list[dict], n: int, *, parallel: bool = True, streaming: bool = False,
                 id_prefix: str = "call_"):
        self._parsers = [ToolCallParser(tokenizer, tools, id_prefix=id_prefix) for _ in range(n)]
        self._sent = [0] * n  # calls given out per choice
        self._seen: list[set[tuple[str, str]]] = [set() for _ in range(n)]  # (name, arguments) given out
        self._parallel = parallel
        self._streaming = streaming

    def feed(self, index: int, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """Choice ``index``'s next text: ``(content, calls, finish_reason)``; on its last token (a finish reason
        given) whatever the parser still holds comes out, and ``"stop"`` becomes ``"tool_calls"`` after a call."""
        parts, finish_reason = self.feed_parts(index, text, finish_reason)
        return (*split_parts(parts), finish_reason)

    def feed_parts(self, index: int, text: str, finish_reason: str | None) -> tuple[list[Part], str | None]:
        """:meth:`feed` with the content and calls in generated order: ``(parts, finish_reason)``."""
        parser = self._parsers[index]
        parts = parser.feed_parts(text)
        if finish_reason is not None:
            parts += parser.finish_parts(cut=finish_reason == "length")
            if finish_reason == "stop" and parser.calls:
                finish_reason = "tool_calls"
        return self._number(index, parts), finish_reason

    def dropped(self, index: int) -> bool:
        """Whether choice ``index`` ended in a call cut off by ``max_tokens`` that did not read (so dropped)."""
        return self._parsers[index].dropped

    def _number(self, index: int, parts: list[Part]) -> list[Part]:
        out: list[Part] = []
        for part in parts:
            if isinstance(part, dict):
                key = (part["function"]["name"], _canonical(part["function"]["arguments"]))
                if (not self._parallel and self._sent[index]) or key in self._seen[index]:
                    continue
                self._seen[index].add(key)
                if self._streaming:
                    part = {"index": self._sent[index], **part}
                self._sent[index] += 1
            out.append(part)
        return out


def _canonical(arguments: str) -> str:
    """A call's serialized arguments in one spelling (key order and spacing aside), to tell a repeat."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return arguments
