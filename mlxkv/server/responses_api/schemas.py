"""The ``POST /v1/responses`` request body, validated with pydantic.

Fields follow OpenAI's Responses API. A field this server does not implement is refused with a 400 naming it,
never accepted and ignored. Accepted with no effect on a local server, as documented in docs/api.md: ``user``,
``safety_identifier``, ``service_tier``, ``prompt_cache_key`` (one engine: there is no cache to route to),
``prompt_cache_retention`` (retention is the server's ``--responses-ttl``), ``stream_options.include_obfuscation``
(loopback needs no padding), ``include`` (only the values that change nothing here), ``truncation: "disabled"``,
``text.verbosity``. ``metadata`` is stored and echoed. Input items are checked by :mod:`.items`, which names the
offending item. mlxkv extension: ``cache_salt`` (prefix-cache isolation, as on the other routes).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictBool, field_validator

from mlxkv.server.schemas import SPECULATIVE_FIELD, SpeculativeBody, _NullIsDefault

#: Values of ``include`` that ask for nothing this server leaves out (reasoning items carry their text in the clear).
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})
MAX_METADATA_PAIRS = 16


class _Body(_NullIsDefault):
    """``null`` means the field's default (as on the chat route); unknown fields: 400."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_obfuscation: StrictBool = False


class Reasoning(_Body):
    """``reasoning``: ``effort`` switches a thinking template's thinking off at ``none`` / ``minimal`` (on
    otherwise); ``summary`` is accepted (the reasoning item carries the model's own reasoning text)."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class TextConfig(_Body):
    """``text``: ``format`` is ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "name", "schema", "strict", "description"}`` (constrained decoding); ``verbosity`` is accepted."""

    format: Optional[dict[str, Any]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponsesRequest(_Body):
    """``POST /v1/responses``."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = Field(..., description="a string, or a list of input items")
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(None, min_length=1, max_length=128)
    store: StrictBool = True
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=128)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[Reasoning] = None
    metadata: Optional[dict[str, str]] = None
    include: Optional[list[str]] = None
    truncation: Optional[Literal["disabled"]] = Field(
        None, description='"disabled" only: an input over the context is refused, never cut')
    background: Optional[Literal[False]] = Field(None, description="false only: responses run in the foreground")
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="prefix-cache isolation: only requests with the same salt share KV")
    speculative: Optional[Union[StrictBool, SpeculativeBody]] = SPECULATIVE_FIELD

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if v is not None:
            if len(v) > MAX_METADATA_PAIRS:
                raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
            for key, value in v.items():
                if len(key) > 64 or len(value) > 512:
                    raise ValueError("keys are at most 64 characters, values at most 512")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        for value in v or ():
            if value not in HARMLESS_INCLUDES:
                raise ValueError(f"{value!r} is not supported (supported: {', '.join(sorted(HARMLESS_INCLUDES))})")
        return v

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, str) and not v:
            raise ValueError("input must not be empty")
        if isinstance(v, list) and not v:
            raise ValueError("input must hold at least one item")
        return v
