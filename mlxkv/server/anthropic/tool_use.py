"""Tool use on the Messages API through the chat route's tool calling (:mod:`mlxkv.server.tools`).

A request's conversation, already in OpenAI's chat form (:mod:`mlxkv.server.anthropic.translate`), goes through the
same functions as a ``/v1/chat/completions`` request: :func:`~mlxkv.server.tools.tools_in_use` decides whether the
tools are shown and the output parsed (``tool_choice`` none: neither; ``any`` / ``tool`` and ``strict`` tools are
enforced by the same grammars as on the chat route, :mod:`mlxkv.server.structured_output`),
:func:`~mlxkv.server.tools.to_template_messages` and :func:`~mlxkv.server.tools.render_tools` make what the template
reads, and a :class:`~mlxkv.server.tool_stream.ToolOutput` parses the answer. So the same conversation renders the
same prompt on both routes.

One refusal is the Messages route's own: a template that cannot render tools refuses tool_use / tool_result
history too (rendering it would drop the calls silently), where the chat route refuses only ``tools``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mlxkv.server.anthropic.translate import Conversation
from mlxkv.server.errors import APIError
from mlxkv.server.tool_stream import ToolOutput
from mlxkv.server.tools import ToolRequestError, render_tools, to_template_messages, tools_in_use

#: Ids of the calls the model writes without one (Anthropic's form).
TOOL_USE_ID_PREFIX = "toolu_"


@dataclass(slots=True)
class ToolPlan:
    """What one request's tool use asks of the template and of the output.

    Attributes:
        messages: the conversation as chat templates read it.
        template_kwargs: ``{"tools": [...]}`` when the tools are shown, else empty.
        tools: the OpenAI-shaped tool definitions whose calls are parsed out of the answer (``None``: no parsing).
        parallel: False keeps only the answer's first call (``disable_parallel_tool_use``).
    """

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    tools: list[dict[str, Any]] | None
    parallel: bool

    def output(self, tokenizer: Any) -> ToolOutput | None:
        """The parser of the answer's calls (``None`` when the request uses no tools)."""
        if self.tools is None:
            return None
        return ToolOutput(tokenizer, self.tools, 1, parallel=self.parallel, id_prefix=TOOL_USE_ID_PREFIX)


def plan_tools(conv: Conversation, no_tools: str | None) -> ToolPlan:
    """The template inputs and output parsing of ``conv``'s tools.

    Args:
        conv: the request's conversation in chat form.
        no_tools: why the served template cannot take tools (:func:`~mlxkv.server.tools.check_template_renders_tools`),
            ``None`` when it can.

    Raises:
        APIError: 400 for what the chat route refuses (forced ``tool_choice``, ``strict`` tools), and for tools or
            tool history sent to a template that cannot render them.
    """
    try:
        use = tools_in_use(conv.tools, conv.tool_choice)
        messages = to_template_messages(conv.messages)
    except ToolRequestError as exc:
        raise anthropic_tool_error(exc, conv) from None
    if no_tools and (use or conv.tool_history):
        raise APIError(400, no_tools, "tools_unsupported", "tools")
    kwargs = {"tools": render_tools(conv.tools)} if use else {}
    return ToolPlan(messages, kwargs, conv.tools if use else None, conv.parallel_tool_calls is not False)


def anthropic_tool_error(exc: ToolRequestError, conv: Conversation,
                         format_field: str = "output_config.format") -> APIError:
    """The chat route's refusal with the Messages API's field names (``tools.0.function.strict`` is
    ``tools.0.strict`` here; a ``tool_choice`` refusal names the choice as it was sent; ``response_format`` is
    ``format_field``, where the request's structured output came from)."""
    param = re.sub(r"^(tools\.\d+)\.function\.", r"\1.", exc.param or "") or None
    message = exc.message
    if param == "response_format":
        param, message = format_field, message.replace("response_format", format_field)
    if param == "tool_choice" and conv.anthropic_tool_choice is not None:
        message = f"tool_choice {json.dumps(conv.anthropic_tool_choice)}: {message}"
    elif param and param.startswith("tools."):
        message = f"{param}: {message}"
    return APIError(400, message, exc.code, param)
