"""Request bodies of the Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

As Anthropic's API does, a field it does not define is refused (400, "Extra inputs are not permitted"). Fields it
defines that mlxkv cannot honour (images, extended thinking, containers, server tools) are
declared here so they parse, and refused here or by :mod:`mlxkv.server.anthropic.translate` with a message naming
them. Accepted without effect on the output: ``cache_control`` (mlxkv caches every prompt's prefix by itself),
``metadata.user_id``, ``service_tier``, ``inference_geo`` and ``speed`` (one local machine, one speed),
``output_config.effort`` (a local model has one effort level; its thinking is ``thinking``'s), and a tool's
``eager_input_streaming`` (each call's input is streamed whole, in one delta, as soon as the call is generated).
Structured output — ``output_config.format`` (and the beta's top-level ``output_format``), ``{"type": "json_schema",
"schema": {...}}`` — is enforced by constrained decoding, as the OpenAI routes' ``response_format``.
mlxkv extensions, as on the OpenAI routes: ``kv_overflow`` (the request's per-sequence KV budget policy,
:mod:`mlxkv.server.kv_overflow`) and the cache fields ``cache_salt``, ``cache_salt_ranges``, ``retention`` and
``priority`` (:class:`mlxkv.server.schemas.CacheFields`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlxkv.server.kv_overflow import KvOverflowBody
from mlxkv.server.schemas import CacheFields

#: Stop sequences per request, and characters per stop sequence.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
#: Anthropic's tool names.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"


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


class DirectCaller(_Strict):
    """Who called a tool: the model itself (the only caller without server tools)."""

    type: Literal["direct"]


class ToolUseBlock(_Strict):
    """An assistant's call of a tool (maps onto an OpenAI assistant message's ``tool_calls``)."""

    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None
    caller: Optional[DirectCaller] = None


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


class Tool(_Strict):
    """A client ("custom") tool's definition. Anthropic's server tools (``type`` ``web_search_...``,
    ``bash_...``, ...) are refused by name; so are the fields that need what mlxkv has not (tool search, programmatic
    callers, rendered input examples). ``strict: true`` is refused with the OpenAI route's ``strict`` (it needs
    constrained decoding): see :func:`mlxkv.server.tools.tools_in_use`."""

    type: Optional[Literal["custom"]] = None
    name: str = Field(..., pattern=TOOL_NAME)
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(..., description='a JSON Schema with "type": "object"')
    cache_control: Optional[CacheControl] = None
    strict: Optional[bool] = None
    eager_input_streaming: Optional[bool] = None
    defer_loading: Optional[bool] = Field(None, description="true (tool search) is not supported")
    allowed_callers: Optional[list[str]] = Field(None, description='only ["direct"]')
    input_examples: Optional[list[dict[str, Any]]] = Field(None, description="not supported (unless empty)")

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tools of type {kind!r} (Anthropic's server tools) are not supported: only custom tools "
                             "(name, description, input_schema)")
        return data

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError('input_schema must be a JSON Schema with "type": "object"')
        return v

    @model_validator(mode="after")
    def _supported(self) -> "Tool":
        if self.defer_loading:
            raise ValueError("defer_loading needs tool search, which this server does not have")
        if self.allowed_callers not in (None, ["direct"]):
            raise ValueError('allowed_callers: only "direct" is supported (no code execution tool)')
        if self.input_examples:
            raise ValueError("input_examples are not supported")
        return self


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


class OutputFormat(_Strict):
    """A JSON schema the answer's text follows (constrained decoding)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(..., alias="schema", description="the JSON schema of the answer")


class OutputConfig(_Strict):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = Field(
        None, description="accepted; a local model has one effort level")
    format: Optional[OutputFormat] = None


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
    output_config: Optional[OutputConfig] = None
    output_format: Optional[OutputFormat] = Field(None, description="the structured-outputs beta's form of "
                                                                    "output_config.format")
    speed: Optional[Literal["standard", "fast"]] = None
    multi_modal_uuids: Optional[dict[Literal["image"], list[Optional[str]]]] = Field(
        None, description='mlxkv extension: {"image": [uuid or null, ...]}, one per image block (docs/vision.md)')

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: Optional[list[Tool]]) -> Optional[list[Tool]]:
        names = [t.name for t in v or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return v


class MessagesRequest(CountTokensRequest, CacheFields):
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
    kv_overflow: Optional[KvOverflowBody] = Field(None, description="mlxkv extension: this request's KV budget "
                                                                    "policy (as on /v1/chat/completions)")

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        for s in v or ():
            if not s.strip():
                raise ValueError("each stop sequence must contain non-whitespace characters")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got {len(s)}")
        return v
