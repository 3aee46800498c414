"""Request bodies of the OpenAI-compatible API, validated with pydantic (the OpenAPI spec comes from them).

Fields follow OpenAI's chat and completions APIs; unknown fields are accepted and ignored, as OpenAI does.
mlxkv extensions: ``cache_salt``, ``retention`` and ``priority`` (prefix-cache isolation, block retention and
scheduling; they act on the paged KV backend, the default, and are carried but unused with ``--kv-backend
dense``), and ``top_k`` / ``min_p``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlxkv.engine.request import (
    DEFAULT_RETENTION_PRIORITY,
    RetentionRange,
    RetentionSpec,
)
from mlxkv.server.tool_schemas import ToolMessageFields, ToolRequestFields

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class RetentionRangeBody(BaseModel):
    """Prompt tokens ``[start, end)`` kept at ``priority`` (0-100) for ``duration`` seconds (``null``: no expiry)."""

    model_config = ConfigDict(extra="forbid")
    start: int = Field(0, ge=0)
    end: Optional[int] = Field(None, ge=1, description="exclusive; null runs to the end of the prompt")
    priority: int = Field(..., ge=0, le=100)
    duration: Optional[float] = Field(None, gt=0, description="seconds")

    @model_validator(mode="after")
    def _ordered(self) -> "RetentionRangeBody":
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


class RetentionBody(BaseModel):
    """KV retention rules for the request's blocks (TensorRT-LLM style)."""

    model_config = ConfigDict(extra="forbid")
    token_ranges: list[RetentionRangeBody] = Field(default_factory=list, max_length=64)
    decode_priority: int = Field(DEFAULT_RETENTION_PRIORITY, ge=0, le=100)
    decode_duration: Optional[float] = Field(None, gt=0, description="seconds")

    def to_spec(self) -> RetentionSpec:
        """The engine's form (raises ``ValueError`` on overlapping ranges)."""
        ranges = tuple(RetentionRange(r.start, r.end, r.priority, r.duration) for r in self.token_ranges)
        return RetentionSpec(ranges, self.decode_priority, self.decode_duration)

    @model_validator(mode="after")
    def _no_overlap(self) -> "RetentionBody":
        self.to_spec()
        return self


class _Common(BaseModel):
    """Sampling, stopping and mlxkv extension fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="prefix-cache isolation: only requests with the same salt share KV")
    retention: Optional[RetentionBody] = None
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="admission order: lower values first")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(ToolMessageFields):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(ToolRequestFields, _Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is text, a one-element list of text, or token ids."""

    prompt: Union[str, list[str], list[int]]
    echo: Literal[False] = Field(False, description="echoing the prompt is not supported")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("one prompt per request: send a string (batched prompts are not supported)")
        elif not v:
            raise ValueError("prompt must not be empty")
        return v

    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens
