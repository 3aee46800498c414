"""Request bodies of the OpenAI-compatible API, validated with pydantic (the OpenAPI spec comes from them).

Fields follow OpenAI's chat and completions APIs: every field of OpenAI's reference is implemented, accepted with
the meaning it has on a local server (:mod:`mlxkv.server.openai_fields`; docs/api.md lists them all), or refused
with a 400 naming it; a field outside the reference is refused with a 400 naming it (OpenAI refuses unknown fields
too), never accepted and ignored. ``user`` is accepted: it names the end user and changes no output. Message objects pass their other fields (``name``) on to the chat template.
``null`` means the field's default for every optional field (the server's default where ``mlxkv serve`` sets
one). mlxkv extensions: ``cache_salt``, ``retention`` and ``priority`` (prefix-cache isolation, block retention
and scheduling; they act on the paged KV backend, the default, and are carried but unused with ``--kv-backend
dense``), ``kv_overflow`` (the request's per-sequence KV budget policy, :mod:`mlxkv.server.kv_overflow`),
``top_k`` / ``min_p``, and mlx_lm.server's ``repetition_penalty`` and ``*_context_size`` windows.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mlxkv.config import check_template_kwargs
from mlxkv.engine.request import (
    DEFAULT_RETENTION_PRIORITY,
    MAX_TOP_LOGPROBS,
    RetentionRange,
    RetentionSpec,
)
from mlxkv.engine.sampling import LOGIT_BIAS_RANGE, MAX_PENALTY_CONTEXT, PENALTY_RANGE
from mlxkv.server.kv_overflow import KvOverflowBody
from mlxkv.server.openai_fields import ChatSpecFields
from mlxkv.server.tool_schemas import ToolMessageFields, ToolRequestFields

MAX_STOP_STRINGS = 16
MAX_N = 16
#: A token id has at most this many digits (ids are below 2**31).
MAX_TOKEN_ID_DIGITS = 10


class _NullIsDefault(BaseModel):
    """A body in which ``null`` for a field means its default (OpenAI's clients send ``null`` for "not set")."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_NullIsDefault):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool = Field(False, description="accepted; no obfuscation padding is added (a local "
                                                         "stream has no network side channel to hide)")


class RetentionRangeBody(_NullIsDefault):
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


class SaltRangeBody(_NullIsDefault):
    """Prompt tokens ``[start, end)`` whose KV blocks are shared only under ``salt`` (so are all later blocks:
    a block's hash covers its whole prefix)."""

    model_config = ConfigDict(extra="forbid")
    start: int = Field(0, ge=0)
    end: Optional[int] = Field(None, ge=1, description="exclusive; null runs to the end of the prompt")
    salt: str = Field(..., min_length=1, max_length=256)

    @model_validator(mode="after")
    def _ordered(self) -> "SaltRangeBody":
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"end ({self.end}) must be greater than start ({self.start})")
        return self


class RetentionBody(_NullIsDefault):
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


#: Most tokens a request may ask each of its choices to propose per step.
MAX_DRAFT_TOKENS = 16


class SpeculativeBody(BaseModel):
    """``speculative`` as an object: this request's draft length."""

    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: int = Field(..., ge=1, le=MAX_DRAFT_TOKENS,
                                  description="tokens each choice proposes per step at most")


#: The ``speculative`` field's schema, shared by every generating route.
SPECULATIVE_FIELD = Field(
    None, description="mlxkv extension, on a server started with --prompt-lookup or --draft-model: false turns "
                      "speculative decoding off for this request, {\"num_draft_tokens\": K} sets its draft length, "
                      "true or null keep the server's")


NOT_DRAFTING = "speculative: this server does not draft tokens (start it with --prompt-lookup or --draft-model)"


def draft_tokens_of(value: "bool | SpeculativeBody | None", enabled: bool) -> int | None:
    """The engine request's ``num_draft_tokens`` for a body's ``speculative`` value (None: the server's).

    Raises:
        APIError: 400 naming ``speculative`` when it asks for speculation from a server that does not draft.
    """
    from mlxkv.server.errors import APIError

    if value is None or value is True:
        if value is True and not enabled:
            raise APIError(400, NOT_DRAFTING, "invalid_value", "speculative")
        return None
    if value is False:
        return 0
    if not enabled:
        raise APIError(400, NOT_DRAFTING, "invalid_value", "speculative")
    return value.num_draft_tokens


class CacheFields(BaseModel):
    """The prefix-cache and scheduling fields every generating route takes (OpenAI's and Anthropic's alike; the
    request preparation applies them, :mod:`mlxkv.server.preparation`; tenancy: :mod:`mlxkv.server.tenancy`)."""

    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="prefix-cache isolation: only requests with the same salt (of the "
                                                  "same tenant) share KV")
    cache_salt_ranges: Optional[list[SaltRangeBody]] = Field(
        None, max_length=16, description="per-range salts: prompt token ranges shared only under their salt; ranges "
                                         "covering the prompt from token 0 share it across tenants (opt-in)")
    retention: Optional[RetentionBody] = None
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="admission order: lower values first")
    speculative: Optional[Union[StrictBool, SpeculativeBody]] = SPECULATIVE_FIELD

    def salt_ranges(self, prompt_length: int) -> tuple[tuple[int, int, str], ...]:
        """``cache_salt_ranges`` as the engine's ``(start, end, salt)`` tuples (``end`` null: the prompt's end)."""
        return tuple((r.start, prompt_length if r.end is None else r.end, r.salt)
                     for r in self.cache_salt_ranges or ())


class _Common(CacheFields, _NullIsDefault):
    """Sampling, stopping and mlxkv extension fields shared by both endpoints (``None``: not set; the server's
    default applies, see :mod:`mlxkv.server.sampling_args`)."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0.0, lt=1.0)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="the end user's id (accepted; changes no output)")
    presence_penalty: Optional[float] = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    frequency_penalty: Optional[float] = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, description="mlx-lm's multiplicative penalty; 1 is off")
    presence_context_size: Optional[int] = Field(None, ge=1, le=MAX_PENALTY_CONTEXT,
                                                  description="tokens the presence penalty looks back")
    frequency_context_size: Optional[int] = Field(None, ge=1, le=MAX_PENALTY_CONTEXT,
                                                   description="tokens the frequency penalty looks back")
    repetition_context_size: Optional[int] = Field(None, ge=1, le=MAX_PENALTY_CONTEXT,
                                                    description="tokens the repetition penalty looks back")
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    kv_overflow: Optional[KvOverflowBody] = Field(
        None, description='this request\'s KV budget policy, e.g. {"policy": "h2o", "budget": 2048}; fields left out: '
                          "the server's --kv-overflow*")
    response_format: Optional[dict[str, Any]] = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}}: the output follows it by constrained decoding')

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids written as strings of digits, got {key[:40]!r}")
            if len(key) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"keys must be token ids below 2**31, got a key of {len(key)} digits")
            if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise ValueError(f"values must be in [-100, 100], got {value} for token {key}")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (``None`` when empty)."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(..., description="a data URL (data:image/png;base64,...), or file:// in an allowed folder")
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(BaseModel):
    """An image content part (vision-language models; see docs/vision.md)."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(ToolMessageFields):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(getattr(p, "text", "") for p in self.content)
        return self.content or ""


class ChatCompletionRequest(ToolRequestFields, ChatSpecFields, _Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: StrictBool = Field(False, description="report each output token's log-probability")
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                        description="and this many most likely alternatives (needs logprobs)")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="extra variables for the chat template, e.g. {\"enable_thinking\": false}")
    multi_modal_uuids: Optional[dict[Literal["image"], list[Optional[str]]]] = Field(
        None, description='{"image": [uuid or null, ...]}: one per image; a named image is cached under '
                          'H(uuid || content) and KV events show its UUID')

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        return None if v is None else check_template_kwargs(v)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: Optional[int], info: ValidationInfo) -> Optional[int]:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def conflicting_max(self) -> Optional[str]:
        """Why ``max_tokens`` and ``max_completion_tokens`` cannot both be honoured (``None``: they agree or one
        is unset)."""
        if None in (self.max_tokens, self.max_completion_tokens) or self.max_tokens == self.max_completion_tokens:
            return None
        return (f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) differ: "
                "max_tokens is the older name of max_completion_tokens, send one")

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> Optional[int]:
        """Alternatives to report per token (``None``: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is text, a one-element list of text, or token ids."""

    prompt: Union[str, list[str], list[StrictInt]]
    echo: Optional[bool] = Field(None, description="false only: echoing the prompt is not supported")
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N, description="n (or unset) only: candidates are not ranked")
    suffix: Optional[str] = Field(None, description="empty (or unset) only: insertion is not supported")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: Optional[bool]) -> Optional[bool]:
        if v:
            raise ValueError("echoing the prompt is not supported: send echo false or omit it")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Optional[str]) -> Optional[str]:
        if v:
            raise ValueError("insertion (text after the completion) is not supported: omit suffix")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, v: Optional[int], info: ValidationInfo) -> Optional[int]:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"best_of ({v}) other than n ({n}) is not supported (candidates are not ranked): omit "
                             "best_of or send it equal to n")
        return v
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                          description="report each output token's log-probability and this many "
                                                      "most likely alternatives")

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_boolean_ids(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(t, bool) for t in v):
            raise ValueError("prompt token ids must be integers, not true/false")
        return v

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

    def logprobs_count(self) -> Optional[int]:
        """Alternatives to report per token (``None``: no log-probabilities)."""
        return self.logprobs
