"""OpenAI's ``reasoning_effort`` as the chat template's thinking switch.

A local model's thinking is switched by its chat template, not tuned by a budget, so the levels map onto the
switch (the mapping vLLM and mlx_lm.server users expect):

- a template that reads a ``reasoning_effort`` variable (gpt-oss style) gets the level itself;
- a template with an ``enable_thinking`` switch (Qwen3 style) gets ``false`` for ``"none"`` and ``"minimal"``
  (OpenAI's "few or no reasoning tokens": a switched-on think block is not few) and ``true`` for ``"low"`` and
  above (all "thinking on": there is no budget to scale);
- a template with neither: the request is honoured only when it asks for what the model does anyway — ``"none"``
  or ``"minimal"`` from a model without think markers; ``"low"`` or above from a model with them (it thinks
  whenever it likes). The other way round is a 400 naming ``reasoning_effort``, since nothing could honour it.

The request's own ``chat_template_kwargs`` may set the same variable; when it disagrees with the effort the request
is refused (400), never resolved silently.
"""

from __future__ import annotations

import re
from typing import Any

from mlxkv.server.errors import APIError

#: The template variables read as a thinking switch, in order of preference.
EFFORT_VARIABLE = "reasoning_effort"
SWITCH_VARIABLE = "enable_thinking"
#: The levels that mean thinking off.
OFF_LEVELS = ("none", "minimal")


def template_source(tokenizer: Any) -> str:
    """The chat template's Jinja text (all of a named set joined), empty when there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _reads(source: str, variable: str) -> bool:
    return re.search(rf"\b{re.escape(variable)}\b", source) is not None


def apply_reasoning_effort(tokenizer: Any, effort: str | None, kwargs: dict[str, Any],
                           requested: dict[str, Any] | None) -> None:
    """Set ``effort`` as ``kwargs``' thinking switch (the chat template's variables), in place.

    Args:
        tokenizer: the engine's tokenizer (its chat template and think markers).
        effort: the request's ``reasoning_effort`` (``None``: not sent, nothing changes).
        kwargs: the template variables the request renders with (the server's defaults and the request's own).
        requested: the request's own ``chat_template_kwargs`` (a conflict with them is refused).

    Raises:
        APIError: 400 naming ``reasoning_effort`` when nothing can honour it or the request's own template
            variables say otherwise.
    """
    if effort is None:
        return
    source = template_source(tokenizer)
    if _reads(source, EFFORT_VARIABLE):
        variable, value = EFFORT_VARIABLE, effort
    elif _reads(source, SWITCH_VARIABLE):
        variable, value = SWITCH_VARIABLE, effort not in OFF_LEVELS
    else:
        thinks = bool(getattr(tokenizer, "has_thinking", False))
        if thinks == (effort not in OFF_LEVELS):
            return
        why = ("this model does not reason (no think markers, and its chat template has no thinking switch): send "
               '"none" or "minimal", or omit reasoning_effort') if not thinks else \
            ("this model's chat template has no thinking switch to turn its reasoning off: send \"low\" or above, "
             "or omit reasoning_effort")
        raise APIError(400, f"reasoning_effort {effort!r}: {why}", "unsupported_value", "reasoning_effort")
    if requested and variable in requested and requested[variable] != value:
        raise APIError(400, f"reasoning_effort {effort!r} sets the chat template's {variable} to {value!r}, but "
                            f"chat_template_kwargs sets it to {requested[variable]!r}: send one of them",
                       "invalid_value", "reasoning_effort")
    kwargs[variable] = value
