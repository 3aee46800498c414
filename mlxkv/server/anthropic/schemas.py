"""Request bodies of the Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

As Anthropic's API does, a field it does not define is refused (400, "Extra inputs are not permitted"). Fields it
defines that mlxkv cannot honour (images, extended thinking, structured output, containers, and tools for now) are
declared here so they parse, and refused by :mod:`mlxkv.server.anthropic.translate` with a message naming them.
Accepted without effect on the output: ``cache_control`` (mlxkv caches every prompt's prefix by itself),
``metadata.user_id``, ``service_tier``, ``inference_geo`` and ``speed`` (one local machine, one speed).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Stop sequences per request, and characters per stop sequence.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """A prompt-caching breakpoint. Accepted; mlxkv's prefix cache keeps every prompt's blocks without one."""

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str = Field(..., min_length=1, description="text blocks must be non-empty")
    cache_control: Optional[CacheControl] = None
    citations: Optional[list[dict[str, Any]]] = Field(None, description="refused unless empty")


class ToolUseBlock(_Strict):
    """An assistant's call of a tool (maps onto an OpenAI assistant message's ``tool_calls``)."""

    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class UnsupportedBlock(BaseModel):
    """Content blocks mlxkv cannot read (a text-only model; no server tools): parsed, then refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use",
                  "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "mcp_tool_use", "mcp_tool_result", "container_upload"]


class ToolResultBlock(_Strict):
    """A tool's answer in a user turn (maps onto an OpenAI ``tool`` message)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: Union[str, list[Annotated[Union[TextBlock, UnsupportedBlock], Field(discriminator="type")]]] = ""
    is_error: Optional[bool] = None
    cache_control: Optional[CacheControl] = None


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, UnsupportedBlock],
                         Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(BaseModel):
    """A client tool's definition (fields beyond these belong to the tool-calling implementation)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1, max_length=128)
    description: Optional[str] = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(None, description="the tool to call, with type 'tool'")
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool' and allowed only with it")
        return self


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None
    display: Optional[str] = None


class Metadata(_Strict):
    user_id: Optional[str] = Field(None, max_length=256)


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: the conversation whose prompt is counted."""

    model: str
    messages: list[Message] = Field(..., min_length=1)
    system: Optional[Union[str, list[TextBlock]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    cache_control: Optional[CacheControl] = None
    output_config: Optional[dict[str, Any]] = Field(None, description="structured output: not supported yet")
    speed: Optional[Literal["standard", "fast"]] = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(..., ge=1, description="most tokens to generate (required)")
    stop_sequences: Optional[list[str]] = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: Optional[bool] = False
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0, description="default 1.0; 0 is greedy")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0, description="0 disables it")
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    inference_geo: Optional[str] = None
    container: Optional[Union[str, dict[str, Any]]] = Field(None, description="not supported")
    diagnostics: Optional[dict[str, Any]] = Field(None, description="not supported")

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        for s in v or ():
            if not s.strip():
                raise ValueError("each stop sequence must contain non-whitespace characters")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got {len(s)}")
        return v
