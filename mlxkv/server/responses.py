"""OpenAI response objects: whole completions and streamed (server-sent events) chunks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from mlxkv.engine.request import Usage


def usage_dict(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _message(text: str, tool_calls: list[dict] | None) -> dict:
    if not tool_calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": tool_calls}


def sse(payload: dict | str) -> str:
    """One server-sent event line pair."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class ResponseBuilder:
    """Builds the response objects of one request (chat or text completion)."""

    chat: bool
    model: str
    id: str = ""
    system_fingerprint: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def _envelope(self, obj: str, choices: list, usage: Usage | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        if usage is not None:
            out["usage"] = usage_dict(usage)
        return out

    # ---- whole responses -----------------------------------------------------------------------------------
    def complete(self, texts: list[str], finish_reasons: list[str | None], usage: Usage,
                 tool_calls: list[list[dict]] | None = None) -> dict:
        """The whole response; ``tool_calls[i]``: choice ``i``'s calls (its content is then null when empty)."""
        if self.chat:
            choices = [{"index": i, "message": _message(t, tool_calls[i] if tool_calls else None), "logprobs": None,
                        "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finish_reasons))]
            return self._envelope("chat.completion", choices, usage)
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                   for i, (t, f) in enumerate(zip(texts, finish_reasons))]
        return self._envelope("text_completion", choices, usage)

    # ---- streamed chunks -----------------------------------------------------------------------------------
    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with the assistant role."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def delta_chunk(self, index: int, text: str, finish_reason: str | None = None,
                    tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            delta: dict = {"content": text} if text or (finish_reason is None and not tool_calls) else {}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the whole request's usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
