"""OpenAI response objects: whole completions and streamed (server-sent events) chunks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from mlxkv.engine.request import Usage
from mlxkv.server.choice_output import ChoiceOutput, Delta


def usage_dict(usage: Usage, predicted: bool = False) -> dict:
    """OpenAI's ``usage``; with a ``prediction`` in the request, ``completion_tokens_details`` says none of it was
    accepted (``mlxkv serve`` does not draft from it) nor rejected (it was never checked)."""
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if predicted:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    if usage.speculative() is not None:  # mlxkv extension
        out["speculative"] = usage.speculative()
    return out


def _message(text: str, tool_calls: list[dict] | None, dropped_call: bool = False) -> dict:
    """A choice's message: its content is ``null`` when empty beside calls, or when all it wrote was a call cut
    off by ``max_tokens`` (its markup is dropped, see :class:`~mlxkv.server.tools.ToolCallParser`)."""
    if not tool_calls:
        return {"role": "assistant", "content": text or (None if dropped_call else text)}
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
    predicted: bool = False  # the request sent a prediction (reported in usage)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def _envelope(self, obj: str, choices: list, usage: Usage | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        if usage is not None:
            out["usage"] = usage_dict(usage, self.predicted)
        return out

    # ---- whole responses -----------------------------------------------------------------------------------
    def complete(self, outputs: list[ChoiceOutput], usage: Usage) -> dict:
        """The whole response; a choice's message carries its tool calls (its content is then null when empty)
        and ``reasoning_content`` when the model thinks."""
        if self.chat:
            choices = []
            for i, out in enumerate(outputs):
                message = _message(out.text(), out.calls, out.dropped_call)
                if out.splitter is not None:
                    message["reasoning_content"] = out.reasoning_text()
                choices.append({"index": i, "message": message, "logprobs": out.logprobs(),
                                "finish_reason": out.finish_reason})
            return self._envelope("chat.completion", choices, usage)
        choices = [{"index": i, "text": out.text(), "logprobs": out.logprobs(), "finish_reason": out.finish_reason}
                   for i, out in enumerate(outputs)]
        return self._envelope("text_completion", choices, usage)

    # ---- streamed chunks -----------------------------------------------------------------------------------
    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with the assistant role."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def delta_chunk(self, index: int, delta: Delta, finish_reason: str | None = None) -> dict:
        """A chunk with what ``delta`` adds to choice ``index`` (and its finish reason on its last chunk)."""
        if self.chat:
            fields: dict = {}
            if delta.reasoning:
                fields["reasoning_content"] = delta.reasoning
            if delta.content or (finish_reason is None and not delta.reasoning and not delta.tool_calls):
                fields["content"] = delta.content
            if delta.tool_calls:
                fields["tool_calls"] = delta.tool_calls
            choice = {"index": index, "delta": fields, "logprobs": delta.logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": delta.content, "logprobs": delta.logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the whole request's usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
