"""An Anthropic Messages request as the OpenAI chat conversation the chat template renders.

The same conversation sent to ``/v1/messages`` and to ``/v1/chat/completions`` becomes the same prompt: the
``system`` field is a leading system message, a message's text blocks are joined as the OpenAI route joins text
parts, and consecutive turns of one role are one turn (as Anthropic combines them), their texts separated by a
blank line. A final assistant turn is a prefill: the answer continues it.

Tool blocks map onto OpenAI's chat form: an assistant's ``tool_use`` blocks become its ``tool_calls`` (arguments as
a JSON string), a user turn's ``tool_result`` blocks become ``tool`` messages (before the turn's text; a result's
text blocks joined; one with ``is_error: true`` reads ``"Error: "`` + its text, since templates know no error flag),
``tools`` become function tools and ``tool_choice`` auto / any / tool / none becomes auto / required / a named
function / none (``disable_parallel_tool_use``: ``parallel_tool_calls: false``). What the chat route then does with
them (rendering, refusals) is :mod:`mlxkv.server.anthropic.tool_use`'s.

As Anthropic does, a ``tool_result`` must answer a ``tool_use`` of the assistant turn just before it, and a
conversation cannot end with an assistant turn's calls (their results are missing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Union

from mlxkv.server.anthropic.schemas import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
    UnsupportedBlock,
)
from mlxkv.server.errors import APIError

#: Separates the texts of consecutive messages of one role, combined into one turn.
TURN_JOIN = "\n\n"
#: Starts the text of a tool result sent with ``is_error: true``.
TOOL_ERROR_PREFIX = "Error: "


@dataclass(slots=True)
class Conversation:
    """What the chat template renders for one request.

    Attributes:
        messages: OpenAI chat messages (``role``, ``content``; assistant ``tool_calls``; tool ``tool_call_id``).
        prefill: the last message is an assistant turn that the answer continues (rendered without its end).
        tools: OpenAI function tools (``None``: none sent).
        tool_choice: OpenAI's ``tool_choice`` (``None``: not sent).
        parallel_tool_calls: ``False`` when the request disabled parallel tool use.
        anthropic_tool_choice: ``tool_choice`` as the request sent it (for error messages).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    prefill: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    anthropic_tool_choice: dict[str, Any] | None = None

    @property
    def tool_history(self) -> bool:
        """Whether earlier turns hold tool calls or results (the template must render them)."""
        return any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages)


def to_conversation(body: CountTokensRequest) -> Conversation:
    """``body``'s conversation in chat form.

    Raises:
        APIError: 400 for what mlxkv cannot honour (images and other non-text blocks, extended thinking,
            containers, diagnostics, citations) or Anthropic refuses (an empty message, a prefill
            that ends with whitespace, a tool_result without its tool_use, a conversation ending in tool calls).
    """
    _refuse_unsupported(body)
    conv = Conversation()
    system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system or ())
    if system:
        conv.messages.append({"role": "system", "content": system})
    turns = _turns(body.messages)
    called: set[str] = set()  # the ids of the previous assistant turn's calls
    for t, (role, messages) in enumerate(turns):
        last = t == len(turns) - 1
        if role == "assistant":
            conv.messages.append(_assistant(messages))
            called = {c["id"] for c in conv.messages[-1].get("tool_calls", ())}
            if last:
                conv.prefill = _check_prefill(conv.messages)
        else:
            conv.messages.extend(_user(messages, called))
            called = set()
    if all(m["role"] == "system" for m in conv.messages):
        raise APIError(400, "messages: the conversation is empty (its only message is an empty assistant turn)",
                       "invalid_value", "messages")
    if body.tools is not None:
        conv.tools = [{"type": "function", "function": _function(t)} for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        conv.anthropic_tool_choice = choice.model_dump(exclude_none=True)
        conv.tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            conv.parallel_tool_calls = False
    return conv


def _function(tool: Tool) -> dict[str, Any]:
    """An Anthropic tool as an OpenAI function (``strict`` kept: the chat route's checks refuse it)."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    if tool.strict is not None:
        function["strict"] = tool.strict
    return function


def _refuse_unsupported(body: CountTokensRequest) -> None:
    if body.thinking is not None and body.thinking.type != "disabled":
        raise APIError(400, "extended thinking is not supported: omit thinking or send {\"type\": \"disabled\"}",
                       "unsupported_parameter", "thinking")
    if isinstance(body, MessagesRequest):
        for name in ("container", "diagnostics"):
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} is not supported", "unsupported_parameter", name)
    for m, message in enumerate(body.messages):
        blocks = message.content if isinstance(message.content, list) else []
        for b, block in enumerate(blocks):
            nested = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else []
            for where, item in [(f"messages.{m}.content.{b}", block)] + \
                    [(f"messages.{m}.content.{b}.content.{i}", x) for i, x in enumerate(nested)]:
                _refuse_block(item, where)
    for b, block in enumerate(body.system if isinstance(body.system, list) else ()):
        _refuse_block(block, f"system.{b}")


def _refuse_block(block: Any, where: str) -> None:
    if isinstance(block, UnsupportedBlock):
        what = "image input is not supported (this model reads text only)" if block.type == "image" else \
            f"content blocks of type '{block.type}' are not supported"
        raise APIError(400, f"{where}: {what}", "unsupported_content", where)
    if isinstance(block, TextBlock) and block.citations:
        raise APIError(400, f"{where}: citations are not supported", "unsupported_content", where)


def _turns(messages: list[Message]) -> list[tuple[str, list[Message]]]:
    """Consecutive messages of one role grouped into turns; every message must have content."""
    turns: list[tuple[str, list[Message]]] = []
    for m, message in enumerate(messages):
        if not message.content and not (message.role == "assistant" and m == len(messages) - 1):
            raise APIError(400, f"messages.{m}: all messages must have non-empty content except for the optional "
                                "final assistant message", "invalid_value", f"messages.{m}.content")
        if turns and turns[-1][0] == message.role:
            turns[-1][1].append(message)
        else:
            turns.append((message.role, [message]))
    return turns


def _texts(message: Message) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def _assistant(messages: list[Message]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant",
                           "content": TURN_JOIN.join(t for t in map(_texts, messages) if t)}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for m in messages if isinstance(m.content, list) for b in m.content if isinstance(b, ToolUseBlock)]
    if calls:
        out["tool_calls"] = calls
    return out


def _user(messages: list[Message], called: set[str]) -> list[dict[str, Any]]:
    """A user turn: its tool results (as ``tool`` messages, answering the previous assistant's calls, whose ids are
    ``called``), then its text (if any)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        for b in m.content if isinstance(m.content, list) else ():
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in called:
                    raise APIError(400, f"messages: tool_result block for tool_use_id {b.tool_use_id!r} has no "
                                        "tool_use block with that id in the assistant turn before it",
                                   "invalid_value", "messages")
                text = b.content if isinstance(b.content, str) else \
                    "".join(x.text for x in b.content if isinstance(x, TextBlock))
                if b.is_error:
                    text = TOOL_ERROR_PREFIX + text
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
    text = TURN_JOIN.join(t for t in map(_texts, messages) if t)
    if text:
        out.append({"role": "user", "content": text})
    return out


def _check_prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether the final assistant message is a prefill (it has text); Anthropic refuses one ending in
    whitespace (the model's next token would have to start mid-word)."""
    last = messages[-1]
    if last.get("tool_calls"):
        raise APIError(400, "messages: the final assistant turn calls tools: send their results as tool_result blocks "
                            "in a user turn after it", "invalid_value", "messages")
    if not last["content"]:
        messages.pop()  # an empty final assistant turn asks for a plain answer
        return False
    if last["content"] != last["content"].rstrip():
        raise APIError(400, "final assistant content cannot end with trailing whitespace", "invalid_value",
                       "messages")
    return True


def response_format(body: CountTokensRequest) -> tuple[dict[str, Any] | None, str]:
    """The request's structured output as the OpenAI routes' ``response_format`` (``None``: free text), and the
    field it came from (for errors): ``output_config.format``, or the beta's ``output_format``.

    Raises:
        APIError: 400 when both are sent and differ.
    """
    config = body.output_config.format if body.output_config is not None else None
    beta = body.output_format
    if config is not None and beta is not None and config.json_schema != beta.json_schema:
        raise APIError(400, "output_format and output_config.format differ: send one of them", "invalid_value",
                       "output_format")
    chosen, where = (config, "output_config.format") if config is not None else (beta, "output_format")
    if chosen is None:
        return None, where
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": chosen.json_schema,
                                                   "strict": True}}, where
