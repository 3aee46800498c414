"""An answer's content blocks in Anthropic's form, built as its text and tool calls arrive, with the stream events
each addition makes.

Blocks come in the order the model wrote them: a text block for each run of text, a ``tool_use`` block
(``{"type": "tool_use", "id", "name", "input": {...}}``) for each call. A text block holds text (an empty one would
be refused when a client sends the answer back as history), except the one empty text block of an answer with no
content at all. Streamed, a text block is ``content_block_start`` (empty text), a ``text_delta`` per piece and
``content_block_stop``; a call is ``content_block_start`` with ``input: {}``, one ``input_json_delta`` carrying the
whole input (a call is parsed once its end marker is generated), and ``content_block_stop``. Indexes count blocks.

The whole answer (``content``) and the stream are built by the same calls, so they always agree.
"""

from __future__ import annotations

import json
from typing import Any

from mlxkv.server.tools import Part

#: A server-sent event before formatting: its type and payload.
StreamEvent = tuple[str, dict[str, Any]]


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """The ``tool_use`` block of a parsed call (OpenAI's ``{"id", "function": {"name", "arguments"}}``, arguments a
    serialized JSON object)."""
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}


class Blocks:
    """The content blocks of one answer.

    Attributes:
        content: the blocks so far (the answer's ``content`` once :meth:`finish` ran).
    """

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._open_text = False  # the last block is a text block not stopped yet
        self._finished = False

    def open_text(self) -> list[StreamEvent]:
        """Start a text block now (a stream without tools opens one before the first token; with tools the answer
        may start with a call, and a text block starts at its first text)."""
        if self._open_text:
            return []
        self.content.append({"type": "text", "text": ""})
        self._open_text = True
        return [("content_block_start", {"index": len(self.content) - 1, "content_block": {"type": "text", "text": ""}})]

    def add(self, parts: list[Part]) -> list[StreamEvent]:
        """Add generated text (``str`` parts) and calls (``dict`` parts), in order."""
        events: list[StreamEvent] = []
        for part in parts:
            if isinstance(part, str):
                if part:
                    events += self.open_text()
                    self.content[-1]["text"] += part
                    events.append(("content_block_delta", {"index": len(self.content) - 1,
                                                           "delta": {"type": "text_delta", "text": part}}))
                continue
            events += self._stop()
            block = tool_use_block(part)
            self.content.append(block)
            index = len(self.content) - 1
            events += [("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                       ("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                          "partial_json": part["function"]["arguments"]}}),
                       ("content_block_stop", {"index": index})]
        return events

    def finish(self) -> list[StreamEvent]:
        """The answer is complete: its last block stops (an answer with no blocks gets one empty text block)."""
        if self._finished:
            return []
        self._finished = True
        events = [] if self.content else self.open_text()
        return events + self._stop()

    def _stop(self) -> list[StreamEvent]:
        if not self._open_text:
            return []
        self._open_text = False
        return [("content_block_stop", {"index": len(self.content) - 1})]
