"""Every size-like field of a generating request checked against the model and its context before the request is
queued, on every route: a value that can name nothing real (a reply or a token position past the context, a
``top_k`` above the vocabulary, a seed outside OpenAI's 64-bit range, a stop string longer than any reply could end
with) is a 400 naming the field and the bound, never a failure in the middle of a decode batch that other requests
share.

Already bounded elsewhere: ``n`` and ``logprobs`` / ``top_logprobs`` (the schemas), the penalty windows and the
``logit_bias`` token ids (:mod:`mlxkv.server.sampling_args`), the prompt against the context
(:mod:`mlxkv.server.generation`), ``kv_overflow`` against the pool (:mod:`mlxkv.server.kv_overflow`).

On the OpenAI routes a ``max_tokens`` (``max_completion_tokens``) above the context is refused, as OpenAI does;
one within the context but beyond what the prompt leaves of it runs to the end of the context (``finish_reason:
"length"``). Anthropic's Messages API allows any ``max_tokens`` and says where the context ended the reply
(``stop_reason: "model_context_window_exceeded"``), so there it is not refused.
"""

from __future__ import annotations

from typing import Any

from mlxkv.server.errors import APIError

#: OpenAI's ``seed``: a signed 64-bit integer.
SEED_RANGE = (-(2**63), 2**63 - 1)
#: Characters of one stop string (Anthropic's stop sequences have the same bound).
MAX_STOP_CHARS = 1024


def _refuse(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", "invalid_value", field)


def check_sizes(body: Any, *, context_length: int | None, vocab_size: int | None) -> None:
    """Refuse ``body``'s size-like fields that exceed the model (see the module docstring); fields the body does
    not have are skipped, so one check serves OpenAI's and Anthropic's requests.

    Raises:
        APIError: 400 ``invalid_value`` naming the field and its bound.
    """
    seed = getattr(body, "seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise _refuse("seed", f"must be a 64-bit signed integer, got {str(seed)[:40]}")
    top_k = getattr(body, "top_k", None)
    if top_k is not None and vocab_size is not None and top_k > vocab_size:
        raise _refuse("top_k", f"must be at most the vocabulary size ({vocab_size}), got {str(top_k)[:40]}")
    stops = getattr(body, "stop", None) or getattr(body, "stop_sequences", None) or ()
    for stop in [stops] if isinstance(stops, str) else stops:
        if len(stop) > MAX_STOP_CHARS:
            name = "stop_sequences" if hasattr(body, "stop_sequences") else "stop"
            raise _refuse(name, f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(stop)}")
    if context_length is None:
        return
    if callable(getattr(body, "max_new_tokens", None)):  # the OpenAI bodies (see the module docstring)
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(body, name, None)
            if value is not None and value > context_length:
                raise _refuse(name, f"must be at most the model's context of {context_length} tokens, "
                                    f"got {str(value)[:40]}")
    retention = getattr(body, "retention", None)
    for i, r in enumerate(retention.token_ranges if retention is not None else ()):
        _position(f"retention.token_ranges.{i}", r.start, r.end, context_length)
    for i, r in enumerate(getattr(body, "cache_salt_ranges", None) or ()):
        _position(f"cache_salt_ranges.{i}", r.start, r.end, context_length)
    overflow = getattr(body, "kv_overflow", None)
    for name in ("budget", "sinks", "recent"):
        value = getattr(overflow, name, None) if overflow is not None else None
        if value is not None and value > context_length:
            raise _refuse(f"kv_overflow.{name}", f"must be at most the model's context of {context_length} tokens, "
                                                 f"got {str(value)[:40]}")


def _position(field: str, start: int, end: int | None, context_length: int) -> None:
    """A token range ``[start, end)`` must lie inside the context."""
    if start >= context_length:
        raise _refuse(f"{field}.start", f"must be below the model's context of {context_length} tokens, "
                                        f"got {str(start)[:40]}")
    if end is not None and end > context_length:
        raise _refuse(f"{field}.end", f"must be at most the model's context of {context_length} tokens, "
                                      f"got {str(end)[:40]}")
