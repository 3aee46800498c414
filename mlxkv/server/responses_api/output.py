"""One response's output items, built from the engine's token events, whole or as the stream's events.

The generated text goes through the chat route's readers (:class:`~mlxkv.server.choice_output.ChoiceOutput`): the
reasoning split of a thinking template and, with tools in use, the tool-call parser, so calls become
``function_call`` items and their markup never reaches a message. Items come in the order the model wrote them:
a ``reasoning`` item (its text as ``reasoning_text`` content), a ``message`` with one ``output_text`` part, then
``function_call`` items (a text after a call opens a new message).

Streamed, each item is announced (``response.output_item.added``), filled (``response.reasoning_text.delta``,
``response.content_part.added`` and ``response.output_text.delta``, ``response.function_call_arguments.delta``)
and closed (the matching ``.done`` events, then ``response.output_item.done``) as OpenAI sends them, every event
numbered by ``sequence_number``.

A response stopped by ``max_output_tokens`` (or the context) is ``incomplete`` with reason ``max_output_tokens``,
its last item ``incomplete``; otherwise ``completed``. Usage: ``input_tokens`` is the whole prompt, of which
``input_tokens_details.cached_tokens`` came from the prefix cache; ``output_tokens_details.reasoning_tokens`` counts
the tokens whose text was reasoning.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from mlxkv.engine.request import Event, Usage
from mlxkv.server.choice_output import ChoiceOutput


def new_id(prefix: str) -> str:
    """A fresh id: ``prefix`` and 32 hex digits (``resp_``, ``msg_``, ``fc_``, ``rs_``)."""
    return f"{prefix}{uuid.uuid4().hex}"


def usage_body(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's ``usage`` (with mlxkv's ``speculative`` counts when the request speculated)."""
    out = {"input_tokens": usage.prompt_tokens,
           "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
           "output_tokens": usage.completion_tokens,
           "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
           "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    if usage.speculative() is not None:
        out["speculative"] = usage.speculative()
    return out


class ResponseOutput:
    """One response being generated: its items and its stream events.

    Args:
        envelope: the response object's fields other than ``output``, ``status``, ``usage`` (its echo of the
            request: model, tools, ``text``, ...); ``id`` among them.
        choice: reads the generated text (reasoning split, tool calls).
    """

    def __init__(self, envelope: dict[str, Any], choice: ChoiceOutput):
        self.envelope = envelope
        self.choice = choice
        self.items: list[dict[str, Any]] = []
        self.tokens: list[int] = []  # generated token ids, as the KV cache holds them
        self.reasoning_tokens = 0
        self.finish_reason: str | None = None
        self._open: dict[str, Any] | None = None  # the item being filled (reasoning or message)
        self._seq = 0

    @property
    def id(self) -> str:
        return self.envelope["id"]

    # --- the response object -----------------------------------------------------------------------------------

    def body(self, status: str, usage: Usage | None = None) -> dict[str, Any]:
        """The response object now (``usage``: the finished request's)."""
        body = {**self.envelope, "status": status, "output": [dict(i) for i in self.items]}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if usage is not None:
            body["usage"] = usage_body(usage, self.reasoning_tokens)
        if status in ("completed", "incomplete"):
            body["completed_at"] = int(time.time())
        return body

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message the next turn's template renders (text and calls, no reasoning)."""
        text = "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return message

    # --- events ------------------------------------------------------------------------------------------------

    def event(self, kind: str, **payload: Any) -> dict[str, Any]:
        """One stream event of ``kind`` with the next sequence number."""
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **payload}

    def opening(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        body = self.body("in_progress")
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """Take a token event; returns the stream events it makes."""
        if event.token is not None:
            self.tokens.append(event.token)
        if event.finish_reason:
            self.finish_reason = event.finish_reason
        delta = self.choice.feed(event.text, event.logprob, event.finish_reason)
        out: list[dict[str, Any]] = []
        if delta.reasoning:
            self.reasoning_tokens += 1
            out += self._append("reasoning", delta.reasoning)
        if delta.content:
            out += self._append("message", delta.content)
        for call in delta.tool_calls:
            out += self._close()
            function = call["function"]
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                    "name": function["name"], "arguments": ""}
            self.items.append(item)
            index = len(self.items) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            item["arguments"] = function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=function["arguments"]))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=function["arguments"]))
            item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        if event.finish_reason:
            out += self._close()
        return out

    def closing(self, usage: Usage) -> list[dict[str, Any]]:
        """What ends the stream: open items closed, then ``response.completed`` (or ``response.incomplete``)."""
        out = self._close()
        status = self.status
        out.append(self.event(f"response.{status}", response=self.body(status, usage)))
        return out

    def whole(self, usage: Usage) -> dict[str, Any]:
        """The finished response object (a non-streaming answer)."""
        self._close()
        return self.body(self.status, usage)

    def _append(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close()
            out += self._start(kind)
        item, index = self._open, len(self.items) - 1
        if kind == "reasoning":
            item["content"][0]["text"] += text
            out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text))
        else:
            item["content"][0]["text"] += text
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text, logprobs=[]))
        return out

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "status": "in_progress",
                                    "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        index = len(self.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item={**item, "content": []})]
        item["content"].append(part)
        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                              part=dict(part)))
        self._open = item
        return out

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        item["status"] = "incomplete" if self.finish_reason == "length" and item is self.items[-1] else "completed"
        if item["type"] == "reasoning":
            done = self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"])
        else:
            done = self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=part["text"], logprobs=[])
        return [done, self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=index,
                           item={**item, "content": [dict(part)]})]
