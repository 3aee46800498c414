"""Streaming a Messages response as Anthropic's server-sent events.

The sequence Anthropic sends, each as an ``event: <type>`` line and a ``data: <json>`` line: ``message_start``,
``ping``, then each content block's ``content_block_start``, ``content_block_delta`` events (``text_delta``, or a
tool call's ``input_json_delta``) and ``content_block_stop`` (see :mod:`mlxkv.server.anthropic.blocks`), then
``message_delta`` (stop reason and the final, cumulative usage) and ``message_stop``; a failure mid-stream ends it
with an ``error`` event. A ``ping`` is sent at once, so a client sees the stream start during a long prefill;
``message_start`` follows with the first token, whose event carries the prompt's split into new and cached tokens:
its ``usage`` (``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``) is the same as the
final ``message_delta``'s, as Anthropic reports them. Without tools the opening includes the text block's
``content_block_start``.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from mlxkv.engine.request import RequestHandle, Usage
from mlxkv.server.anthropic.message import Reply, usage_body
from mlxkv.server.errors import anthropic_error_body
from mlxkv.server.generation import bursts, failure


def event(kind: str, payload: dict[str, Any]) -> str:
    """One server-sent event of ``kind`` (``payload`` gets its ``type``)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n"


async def message_events(handle: RequestHandle, reply: Reply, keepalive_s: float | None = None) -> AsyncIterator[str]:
    """The events of ``handle``'s answer, one write per burst of engine events, and a ``ping`` after each
    ``keepalive_s`` seconds without one (a long prefill, a wait for admission); the request is cancelled if the
    client disconnects (the generator is closed)."""
    started = False
    try:
        yield event("ping", {})
        async for burst in bursts(handle, idle_s=keepalive_s):
            if not burst:
                yield event("ping", {})
                continue
            parts: list[str] = []
            for e in burst:
                if not started and e.kind in ("token", "done"):
                    started = True
                    parts.append(event("message_start", {"message": reply.started(e.usage)})
                                 + "".join(event(kind, payload) for kind, payload in reply.opening()))
                if e.kind == "token":
                    parts += [event(kind, payload) for kind, payload in reply.add(e)]
                elif e.kind == "done":
                    parts.append(_closing(reply, e.usage or Usage(reply.prompt_tokens, 0)))
                else:
                    error = failure(e)
                    parts.append(event("error", anthropic_error_body(error.status, error.message)))
            if parts:
                yield "".join(parts)
    finally:
        handle.cancel()  # a no-op once the request has finished


def _closing(reply: Reply, usage: Usage) -> str:
    closing = "".join(event(kind, payload) for kind, payload in reply.finish())
    reason, sequence = reply.stop()
    return (closing + event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": usage_body(usage)})
            + event("message_stop", {}))
