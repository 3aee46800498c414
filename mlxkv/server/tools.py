"""Tool calling, API-neutral: requests' tools and history into what chat templates expect, and the model's output
back into tool calls (OpenAI's shape), with mlx-lm's tool parsers.

The tokenizer (mlx-lm's ``TokenizerWrapper``, see :func:`mlxkv.chat_template.with_chat_template`) knows the
markers around a call (``tool_call_start`` / ``tool_call_end``) and the parser of the text between them
(``tool_parser``). :class:`ToolCallParser` splits streamed text at those markers with mlx-lm's
``TextStateMachine`` (the one ``mlx_lm.server`` uses), so markup is held back until it is known not to start a
call, and never reaches the content.

Errors are :class:`ToolRequestError` (a ``ValueError`` with the offending field), for each API to answer in its
own error shape. Everything here is plain Python over dicts, so the OpenAI and Anthropic routes share it:
``to_template_messages`` (history), ``render_tools`` (definitions), ``tools_in_use`` (``tool_choice``),
``check_template_renders_tools`` and ``ToolCallParser`` (output).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Iterable, Union

from mlx_lm.generate import TextStateMachine  # mlx_lm.server's splitter of text at reasoning / tool markers

log = logging.getLogger(__name__)

#: What a tool-less request renders as, and the tool the template is asked to show, to see if it shows tools.
_PROBE_MESSAGES = [{"role": "user", "content": "hi"}]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "mlxkv_probe_tool", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]


class ToolRequestError(ValueError):
    """A tool-calling request this server cannot honour; ``param`` names the field, ``code`` the reason."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


#: A piece of one choice's output in the order it was generated: content text, or a call (OpenAI's dict).
Part = Union[str, dict]


def new_call_id(prefix: str = "call_") -> str:
    """A fresh tool call id: ``prefix`` (OpenAI's ``call_``, Anthropic's ``toolu_``) and 24 hex digits."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def split_parts(parts: Iterable[Part]) -> tuple[str, list[dict]]:
    """``(content, calls)`` of ordered parts: the texts joined, the calls in order."""
    parts = list(parts)
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, dict)]


def tools_in_use(tools: list[dict] | None, tool_choice: str | dict | None) -> bool:
    """Whether the request's ``tools`` are rendered and its output parsed for calls.

    ``tool_choice`` ``"none"`` means the model must not call: the tools are not shown to it and its output is
    not parsed (text only). ``"auto"`` (the default) lets the model choose. ``"required"`` (Anthropic's ``"any"``)
    and a named function make it call, and ``strict`` functions bind a call's arguments to their schema: both by
    constrained decoding, whose grammar :func:`mlxkv.server.structured_output.output_format` builds.

    Raises:
        ToolRequestError: ``tool_choice`` forces a call without tools, or names a function that is not among them.
    """
    if tool_choice == "none":
        return False
    if tool_choice in ("required", "any") or isinstance(tool_choice, dict):
        if not tools:
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
        names = [(t.get("function") or {}).get("name") for t in tools]
        if name is not None and name not in names:
            raise ToolRequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                                   f"({', '.join(map(str, names))})", "tool_choice")
    return bool(tools)


def render_tools(tools: Iterable[dict]) -> list[dict]:
    """Tool definitions as chat templates read them: OpenAI's ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` (what Hugging Face templates are written for), unset fields left out."""
    out = []
    for tool in tools:
        function = {k: v for k, v in (tool.get("function") or {}).items() if v is not None and k != "strict"}
        out.append({"type": tool.get("type", "function"), "function": function})
    return out


def _text(content: Any) -> str:
    """A message's content as the template reads it: text parts joined, ``None`` as empty."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return str(content)


def _arguments(raw: Any, param: str) -> dict:
    """A call's ``arguments`` (OpenAI sends a JSON string) as the dict templates expect."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ToolRequestError(f"tool call arguments are not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise ToolRequestError("tool call arguments must be a JSON object", param)
    return value


def to_template_messages(messages: Iterable[dict]) -> list[dict]:
    """OpenAI chat messages (dicts) as chat templates read them.

    ``developer`` becomes ``system``; content is text; an assistant's ``tool_calls`` keep ``id`` / ``type`` /
    ``function.name`` with ``function.arguments`` parsed to a dict; a ``tool`` message keeps ``tool_call_id`` and
    gets the called function's ``name`` (from the matching earlier call) when it has none.

    Raises:
        ToolRequestError: arguments that are not a JSON object.
    """
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name
    for i, message in enumerate(messages):
        role = message.get("role")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _text(message.get("content"))}
        if message.get("name"):
            entry["name"] = message["name"]
        calls = message.get("tool_calls") or []
        if calls:
            entry["tool_calls"] = []
            for j, call in enumerate(calls):
                function = call.get("function") or {}
                names[call.get("id", "")] = function.get("name", "")
                entry["tool_calls"].append({"id": call.get("id"), "type": call.get("type", "function"),
                                            "function": {"name": function.get("name"), "arguments": _arguments(
                                                function.get("arguments"),
                                                f"messages.{i}.tool_calls.{j}.function.arguments")}})
        if role == "tool":
            entry["tool_call_id"] = message.get("tool_call_id")
            if "name" not in entry and names.get(entry["tool_call_id"] or ""):
                entry["name"] = names[entry["tool_call_id"]]
        out.append(entry)
    return out


def check_template_renders_tools(tokenizer: Any) -> str | None:
    """Why this tokenizer cannot take tools (no tool parser, or a template that ignores ``tools``), or None.

    Renders a one-message chat with and without a probe tool: a template that shows tools renders them.
    """
    if not getattr(tokenizer, "has_tool_calling", False):
        return ("this model's chat template has no tool-call format mlx-lm knows: serve it with --chat-template "
                "FILE (a template that renders tools) and, if needed, --tool-parser NAME")
    try:
        plain = tokenizer.apply_chat_template(_PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
        with_tools = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=_PROBE_TOOLS, add_generation_prompt=True,
                                                   tokenize=False)
    except Exception as exc:  # noqa: BLE001 - templates raise anything
        return f"this model's chat template fails to render tools: {exc}"
    if plain == with_tools or "mlxkv_probe_tool" not in with_tools:
        return "this model's chat template ignores tools: serve it with --chat-template FILE (one that renders them)"
    return None


class ToolCallParser:
    """Splits one choice's streamed text into content and tool calls.

    ``feed(text)`` returns ``(content, calls)``: the content now known to be outside any call (text that may be
    the start of a call marker is held back) and the calls completed by this text. ``finish()`` returns what is
    left at the end. :meth:`feed_parts` / :meth:`finish_parts` give the same content and calls in the order they
    were generated (an API whose answer is a sequence of blocks needs it). Calls are OpenAI's ``{"id", "type":
    "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON object, serialized. A call whose text
    the parser cannot read once its end marker came (malformed, or arguments that are not a JSON object) comes back
    as content, markers included, so no generated text is lost; :attr:`calls` counts the good ones. A call cut off
    by ``max_tokens`` (``finish_parts(cut=True)``) is never content: it is a call if its text reads whole, else it
    is dropped (:attr:`dropped` says so), and so is the start of a start marker the cut left; a client gets no
    markup to show.

    Trailing whitespace is held until more content follows (dropped when a call follows it, and at the end when
    calls were made), so the blank lines models write around calls do not become content.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` with a tool parser (``has_tool_calling``).
        tools: the request's tool definitions, passed to parsers that read argument types from them.
        id_prefix: the prefix of the ids given to calls the model wrote without one.

    Raises:
        ValueError: the tokenizer has no tool parser.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, *, id_prefix: str = "call_"):
        if not getattr(tokenizer, "has_tool_calling", False):
            raise ValueError("the tokenizer has no tool parser")
        self._parse = tokenizer.tool_parser
        self._start, self._end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
        self._tools = tools
        self._id_prefix = id_prefix
        edges = {"normal": [(self._start, "tool")], "tool": [(self._end, "normal")] if self._end else []}
        self._sm = TextStateMachine(edges)
        self._state = self._sm.make_state("normal")
        self._call_text = ""  # the current call's text so far
        self._held = ""  # trailing whitespace of the content, not given out yet
        self.calls = 0
        self.dropped = False  # a call cut off by max_tokens was dropped (it did not read)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Content and completed calls of the next piece of generated text."""
        return split_parts(self.feed_parts(text))

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """What is left when generation ends (``cut``: by ``max_tokens``): held-back text, and a call still open
        (read if it parses)."""
        return split_parts(self.finish_parts(cut))

    def feed_parts(self, text: str) -> list[Part]:
        """:meth:`feed`'s content and calls in generated order (no empty texts)."""
        self._state, segments = TextStateMachine.split(self._state, text)
        parts: list[Part] = []
        previous = None
        for state, piece in segments:
            if previous == "tool" and state == "normal":  # a call just ended
                self._close(parts)
            if state == "tool":
                self._call_text += piece
            else:
                _append(parts, self._release(piece))
            previous = state
        return parts

    def finish_parts(self, cut: bool = False) -> list[Part]:
        """:meth:`finish`'s content and calls in generated order."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        parts: list[Part] = []
        if state == "tool":
            self._call_text += rest
            self._close(parts, ended=False, cut=cut)
        elif cut and rest:  # held back as the start of a start marker: a call the cut stopped at its first token
            self.dropped = True
        else:
            _append(parts, self._release(rest))
        if self._held and not self.calls and not self.dropped:
            _append(parts, self._held)
        self._held = ""
        return parts

    def _close(self, parts: list[Part], ended: bool = True, cut: bool = False) -> None:
        """The current call's text is complete (``ended``: its end marker seen) or not: its calls are appended to
        ``parts``; one that does not read is content (appended, markers included), unless ``cut`` by
        ``max_tokens`` (dropped)."""
        text, self._call_text = self._call_text, ""
        parsed = self._read(text, quiet=cut)  # a cut call whose text reads whole is a call (as mlx_lm.server)
        if parsed is None and cut:
            self.dropped = True
            return
        if parsed is None:
            _append(parts, self._release(self._start + text + (self._end if ended else "")))
            return
        parts.extend(parsed)
        self.calls += len(parsed)
        self._held = ""  # the blank lines before a call separate it: not content

    def _read(self, text: str, quiet: bool = False) -> list[dict] | None:
        try:
            parsed = self._parse(text, self._tools)
        except Exception as exc:  # noqa: BLE001 - mlx-lm's parsers raise ValueError, JSON and regex errors
            if quiet:
                return None
            log.warning("a tool call did not parse (%s: %s); returned as content", type(exc).__name__, exc)
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                log.warning("a tool call has no function name; returned as content")
                return None
            arguments = _object_json(item.get("arguments"))
            if arguments is None:  # clients (and this server, in history) take only a JSON object
                log.warning("a tool call's arguments are not a JSON object; returned as content")
                return None
            calls.append({"id": item.get("id") or new_call_id(self._id_prefix), "type": "function",
                          "function": {"name": item["name"], "arguments": arguments}})
        return calls

    def _release(self, content: str) -> str:
        """``content`` to give out now: trailing whitespace is held until more content follows it."""
        if not content:
            return ""
        text = self._held + content
        out = text.rstrip()
        self._held = text[len(out):]
        return out


def _append(parts: list[Part], text: str) -> None:
    """Add ``text`` to ordered parts (nothing if empty; joined to a text just before it)."""
    if not text:
        return
    if parts and isinstance(parts[-1], str):
        parts[-1] += text
    else:
        parts.append(text)


def _object_json(arguments: Any) -> str | None:
    """A call's arguments as parsers return them (a dict, a JSON string, nothing) as a serialized JSON object, or
    ``None`` when they are not one."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        return None
    if not arguments.strip():
        return "{}"
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return arguments if isinstance(value, dict) else None
