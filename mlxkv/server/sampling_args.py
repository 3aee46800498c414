"""A request body's sampling settings, resolved: the body's own value, else the server's default, else OpenAI's.

Every route builds its :class:`~mlxkv.engine.sampling.SamplingParams` here, so ``mlxkv serve --temp`` and friends
apply the same way to chat and text completions, and a field set to ``null`` means "not set" everywhere.
"""

from __future__ import annotations

from typing import Any

from mlxkv.config import SamplingDefaults
from mlxkv.engine.sampling import DEFAULT_PENALTY_CONTEXT, SamplingParams
from mlxkv.server.errors import APIError

#: OpenAI's ``max_tokens`` default for /v1/completions (chat defaults to the rest of the context).
DEFAULT_COMPLETION_TOKENS = 16
#: Chat default when the model's context length is unknown.
DEFAULT_CHAT_TOKENS = 4096


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def max_new_tokens(body: Any, defaults: SamplingDefaults, prompt_tokens: int, context_length: int | None,
                   chat: bool) -> int:
    """Tokens to generate at most: the body's ``max_completion_tokens`` / ``max_tokens``, else ``--max-tokens``,
    else the rest of the context (chat) or 16 (completions, as OpenAI)."""
    wanted = _pick(body.max_new_tokens(), defaults.max_tokens)
    if wanted is not None:
        return wanted
    if not chat:
        return DEFAULT_COMPLETION_TOKENS
    return max(1, (context_length or DEFAULT_CHAT_TOKENS + prompt_tokens) - prompt_tokens)


#: The request fields that size a window over the token history.
WINDOW_FIELDS = ("presence_context_size", "frequency_context_size", "repetition_context_size")


def sampling_params(body: Any, defaults: SamplingDefaults, max_tokens: int, vocab_size: int | None,
                    context_length: int | None = None) -> SamplingParams:
    """The engine's sampling settings for ``body`` (a chat or completions request).

    Raises:
        APIError: 400 for a penalty window wider than the model's context (``context_length``), a ``logit_bias``
            token outside the vocabulary, or settings the engine refuses.
    """
    for name in WINDOW_FIELDS:
        size = getattr(body, name)
        if size is not None and context_length is not None and size > context_length:
            raise APIError(400, f"{name} must be at most the model's context of {context_length} tokens, got {size}",
                           "invalid_value", name)
    bias = body.bias()
    if bias and vocab_size is not None and max(bias) >= vocab_size:
        raise APIError(400, f"logit_bias token {max(bias)} is outside the vocabulary (ids 0-{vocab_size - 1})",
                       "invalid_value", "logit_bias")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temp=_pick(body.temperature, defaults.temp),
            top_p=_pick(body.top_p, defaults.top_p), top_k=_pick(body.top_k, defaults.top_k),
            min_p=_pick(body.min_p, defaults.min_p), seed=body.seed, stop=body.stop_strings(),
            presence_penalty=_pick(body.presence_penalty, 0.0), frequency_penalty=_pick(body.frequency_penalty, 0.0),
            repetition_penalty=_pick(body.repetition_penalty, defaults.repetition_penalty),
            presence_context_size=_pick(body.presence_context_size, DEFAULT_PENALTY_CONTEXT),
            frequency_context_size=_pick(body.frequency_context_size, DEFAULT_PENALTY_CONTEXT),
            repetition_context_size=_pick(body.repetition_context_size, DEFAULT_PENALTY_CONTEXT),
            logit_bias=bias)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value") from None


def template_kwargs(body: Any, defaults: SamplingDefaults) -> dict:
    """The chat template's extra variables: ``--chat-template-kwargs``, then the request's own (its keys win)."""
    return {**defaults.chat_template_kwargs, **(body.chat_template_kwargs or {})}
