"""The fields of OpenAI's chat-completions reference that concern OpenAI's service rather than the model's output,
each with the meaning it has on a local server (docs/api.md lists every field of every route).

- **Accepted, no effect on the output** (validated as OpenAI validates them): ``metadata``, ``store`` (nothing is
  stored: there is no ``GET /v1/chat/completions/{id}`` here), ``service_tier``, ``safety_identifier``, ``user``,
  ``verbosity`` (a hint OpenAI gives its own models; a local model's length is set by ``max_tokens``),
  ``prompt_cache_retention`` (the server's cache configuration decides how long blocks live),
  ``prompt_cache_options`` with ``mode: "implicit"`` (mlxkv caches every prompt's prefix by itself) and ``ttl:
  "30m"``, ``stream_options.include_obfuscation`` (no padding is added), and ``prediction`` (a predicted output only
  speeds OpenAI's answer up, never changes it; ``mlxkv serve`` does not draft, so the usage reports
  ``accepted_prediction_tokens: 0``).
- **A local meaning**: ``reasoning_effort`` switches the chat template's thinking (:mod:`mlxkv.server.
  reasoning_effort`), ``prompt_cache_key`` narrows prefix-cache sharing within the tenant (:func:`cache_key_span`),
  ``max_completion_tokens`` is ``max_tokens``, ``modalities: ["text"]`` is what the server does.
- **Refused with a 400 naming the field**: ``audio`` and ``modalities`` with ``"audio"`` (text only),
  ``moderation`` (no moderation model), ``web_search_options`` (no web search), ``prompt_cache_options.mode:
  "explicit"`` (no breakpoints: every prefix is cached).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: OpenAI's limits on ``metadata``: pairs, key and value characters.
METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
#: The longest ``prompt_cache_key`` taken (OpenAI documents none; a cache key is an id, not a document).
MAX_PROMPT_CACHE_KEY = 1024
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: Starts the salt a ``prompt_cache_key`` adds to every prompt block's hash. A client could send the same text as a
#: ``cache_salt_ranges`` salt; that only reaches requests of its own tenant (the ``cache_salt`` still applies).
PROMPT_CACHE_KEY_SALT = "prompt_cache_key\x1f"


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptCacheOptions(_Forbid):
    """OpenAI's prompt caching options: only what mlxkv does (an implicit cache of every prefix) is accepted."""

    mode: Optional[str] = None
    ttl: Optional[Literal["30m"]] = None

    @field_validator("mode")
    @classmethod
    def _implicit(cls, v: Optional[str]) -> Optional[str]:
        if v == "explicit":
            raise ValueError('"explicit" needs cache breakpoints, which this server does not take: it caches every '
                             'prompt\'s prefix ("implicit")')
        if v not in (None, "implicit"):
            raise ValueError(f"{v!r} is not one of implicit, explicit")
        return v


class TextContentPart(_Forbid):
    type: Literal["text"]
    text: str


class Prediction(_Forbid):
    """A predicted output: accepted as a hint (see the module docstring)."""

    type: Literal["content"]
    content: Union[str, list[TextContentPart]]


class ChatSpecFields(BaseModel):
    """The chat-completion fields of OpenAI's reference with no effect, a local meaning, or a refusal (module
    docstring). Mixed into :class:`mlxkv.server.schemas.ChatCompletionRequest`."""

    metadata: Optional[dict[str, str]] = Field(None, description="up to 16 string pairs; stored nowhere")
    store: Optional[bool] = Field(None, description="accepted; this server stores no completions (nothing to "
                                                    "retrieve later)")
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority", "fast"]] = Field(
        None, description="accepted; one local machine has one tier")
    safety_identifier: Optional[str] = Field(None, max_length=64, description="accepted; changes no output")
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(None, description="accepted; no effect")
    reasoning_effort: Optional[Literal[REASONING_EFFORTS]] = Field(  # type: ignore[valid-type]
        None, description="none, minimal: thinking off; low and above: on (the chat template's thinking switch)")
    prompt_cache_key: Optional[str] = Field(
        None, min_length=1, max_length=MAX_PROMPT_CACHE_KEY,
        description="only requests with the same key (and the same cache_salt) share prefix-cache blocks")
    prompt_cache_options: Optional[PromptCacheOptions] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = Field(None, description="accepted; no effect")
    prediction: Optional[Prediction] = Field(None, description="accepted as a hint; no drafting in mlxkv serve")
    modalities: Optional[list[Literal["text", "audio"]]] = Field(None, description='["text"] only')
    audio: Optional[dict[str, Any]] = Field(None, description="refused: text output only")
    moderation: Optional[dict[str, Any]] = Field(None, description="refused: no moderation model")
    web_search_options: Optional[dict[str, Any]] = Field(None, description="refused: no web search")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if v is None:
            return v
        if len(v) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} pairs, got {len(v)}")
        for key, value in v.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"keys have at most {METADATA_KEY_CHARS} characters, got {len(key)}")
            if len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"values have at most {METADATA_VALUE_CHARS} characters, got {len(value)}")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v and "audio" in v:
            raise ValueError('audio output is not supported (the model writes text): send ["text"] or omit it')
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: Any) -> Any:
        raise ValueError("audio output is not supported (the model writes text): omit audio")

    @field_validator("moderation")
    @classmethod
    def _no_moderation(cls, v: Any) -> Any:
        raise ValueError("moderation is not supported (this server runs no moderation model): omit it")

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, v: Any) -> Any:
        raise ValueError("web search is not supported (the server reaches no network): omit web_search_options")


def cache_key_span(key: str | None, prompt_length: int) -> tuple[tuple[int, int, str], ...]:
    """The per-range salt a ``prompt_cache_key`` adds: the whole prompt salted by the key, so only requests with
    the same key share its blocks. It adds to the request's ``cache_salt`` (the tenant) and ``cache_salt_ranges``,
    never replaces them: a key narrows sharing within a tenant and cannot widen it."""
    return () if key is None else ((0, prompt_length, PROMPT_CACHE_KEY_SALT + key),)
