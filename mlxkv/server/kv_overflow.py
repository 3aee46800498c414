"""The ``kv_overflow`` request field (an mlxkv extension of the OpenAI and Anthropic routes): the per-sequence KV
budget policy of one request.

``{"kv_overflow": {"policy": "h2o", "budget": 2048, "sinks": 4, "recent": 256}}`` runs the request's sequences
under that policy (:class:`mlxkv.config.KvOverflowConfig`); ``{"policy": "preempt"}`` runs them uncapped. A field
left out takes the server's value (``mlxkv serve --kv-overflow*``) where it applies to the chosen policy, so
``{"budget": 1024}`` keeps the server's policy with a smaller budget. A combination the config refuses, or one the
server's KV store cannot run (its backend, ``--kv-bits``, ``--max-kv-size``, the model's attention), is a 400
naming ``kv_overflow``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlxkv import rules
from mlxkv.config import KvOverflowConfig
from mlxkv.engine.pool_facts import PoolFacts
from mlxkv.server.errors import APIError

PARAM = "kv_overflow"


class KvOverflowBody(BaseModel):
    """``kv_overflow``: what a sequence of this request does past its KV budget (fields left out: the server's)."""

    model_config = ConfigDict(extra="forbid")
    policy: Optional[Literal[rules.KV_OVERFLOW_POLICIES]] = Field(
        None, description="preempt (no cap), window (sinks + recent), h2o (heavy hitters) or offload (h2o, evicted "
                          "rows to host memory)")
    budget: Optional[int] = Field(None, ge=rules.KV_OVERFLOW_BUDGET.low,
                                  description="tokens kept per sequence and layer")
    sinks: Optional[int] = Field(None, ge=rules.KV_OVERFLOW_SINKS.low, description="first tokens always kept")
    recent: Optional[int] = Field(None, ge=rules.KV_OVERFLOW_RECENT.low,
                                  description="h2o / offload: last tokens always kept")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def overflow_config(body: KvOverflowBody | None, default: KvOverflowConfig | None) -> KvOverflowConfig | None:
    """The request's policy with the server's ``default`` filling what it leaves out; ``None`` when the request
    names none or asks for exactly the default (its sequences then open as any other).

    Raises:
        ValueError: the merged fields are not a valid :class:`KvOverflowConfig` (the message names the fields as
            ``kv_overflow.<field>``).
    """
    if body is None or not body.model_fields_set:
        return None
    default = default or KvOverflowConfig()
    asked = body.model_fields_set
    policy = body.policy if "policy" in asked else default.policy
    if policy == "preempt":
        if "sinks" in asked:
            raise ValueError("kv_overflow.sinks applies to kv_overflow.policy window, h2o or offload")
        budget, sinks, recent = body.budget, 4, body.recent  # a budget or recent asked with preempt is refused
    else:
        inherit = default.enabled
        budget = body.budget if "budget" in asked else (default.budget if inherit else None)
        sinks = body.sinks if "sinks" in asked else default.sinks
        ranked = default.policy in ("h2o", "offload") and policy in ("h2o", "offload")
        recent = body.recent if "recent" in asked else (default.recent if ranked else None)
    try:
        config = KvOverflowConfig(policy=policy, budget=budget, sinks=sinks, recent=recent,
                                  restore_threshold=default.restore_threshold)
    except ValueError as exc:
        raise ValueError(_field_names(str(exc))) from None
    return None if config == default else config


def request_overflow(body: KvOverflowBody | None, facts: PoolFacts) -> KvOverflowConfig | None:
    """:func:`overflow_config` against the pool's default, checked against what the pool can run, both read from
    ``facts`` (captured when the engine was built: the pool itself belongs to the engine thread).

    Raises:
        APIError: 400 naming ``kv_overflow`` for an invalid or unrunnable policy.
    """
    try:
        config = overflow_config(body, facts.default_overflow)
        if config is not None and config.enabled:
            facts.check_overflow(config)
    except ValueError as exc:
        raise APIError(400, _field_names(str(exc)), "invalid_value", PARAM) from None
    return config


def _field_names(message: str) -> str:
    """A config message in the request's field names (``kv_overflow_budget`` -> ``kv_overflow.budget``)."""
    return message.replace("kv_overflow=", "kv_overflow.policy=").replace("kv_overflow_", "kv_overflow.")
