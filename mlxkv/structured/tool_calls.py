"""Tool calls as a grammar: what a forced ``tool_choice``, or ``strict`` tools, let a model write, in the markup its
tool parser reads — pure Python, no MLX.

mlx-lm's ``json_tools`` parser (Hermes and Qwen 2.5 templates, and the tests' template) reads the text between
``tool_call_start`` and ``tool_call_end`` with ``json.loads``: ``<tool_call>\\n{"name": .., "arguments": {..}}\\n
</tool_call>``. The grammars here write exactly that — the markers (a marker that is a single special token of the
vocabulary is that token, see :class:`CallMarkup`), then one JSON object whose ``name`` is an allowed function's
and whose ``arguments`` follow that function's ``parameters`` schema — as llguidance Lark grammars with the JSON
embedded as ``%json`` schemas:

- :func:`forced_calls`: the output is one call (``parallel=False``, or a named function) or several, then EOS;
- :func:`calls_in_text`: free text in which every call that starts (at the start marker) must be a valid call
  (``tool_choice`` auto with ``strict`` tools);
- :func:`document_or_calls`: a ``response_format`` document, or calls (``tool_choice`` auto with a
  ``response_format``: the model may still call a tool instead of answering).

Calls are separated by a newline, as the templates render them, and one newline may follow the last.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxkv.structured.response_format import JSON_OPTIONS, ResponseFormat, json_schema_format

#: mlx-lm tool parsers whose call format these grammars write.
PARSERS_WITH_GRAMMAR = ("json_tools",)
#: The arguments of a function declared without ``parameters``: none (OpenAI reads an omitted ``parameters`` as an
#: empty parameter list), so a call's arguments are ``{}``.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
#: Any JSON object: the arguments of a function whose ``parameters`` is the empty schema ``{}``.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolGrammarError(ValueError):
    """A tool definition that cannot become a grammar; ``param`` names its field (``tools.0.function.parameters``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class CallMarkup:
    """The markers around one call, each as text and, when the vocabulary has it as one special token, its id.

    A special token is matched by id (``<[id]>``): its text spelled out in ordinary tokens is not what the model
    was trained to write (and a detokenizer may drop special tokens' text).
    """

    start: str
    end: str
    start_id: int | None = None
    end_id: int | None = None

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("a call grammar needs both markers (tool_call_start and tool_call_end)")

    @property
    def open(self) -> str:
        """Lark for what comes before the call's JSON: the start marker, a newline."""
        return f'{_lark_marker(self.start, self.start_id)} "\\n"'

    @property
    def close(self) -> str:
        """Lark for what follows the call's JSON: a newline, the end marker."""
        return f'"\\n" {_lark_marker(self.end, self.end_id)}'


def call_schema(tools: Sequence[dict], names: Iterable[str] | None = None) -> dict[str, Any]:
    """The JSON schema of one call ``{"name": .., "arguments": {..}}`` of the OpenAI function ``tools`` named in
    ``names`` (all when ``None``), with the separators of the server's JSON.

    Raises:
        ToolGrammarError: a function's ``parameters`` is not a schema the grammar engine can enforce, or no tool
            is left.
    """
    wanted = None if names is None else set(names)
    options = []
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        if wanted is not None and function.get("name") not in wanted:
            continue
        parameters = function.get("parameters")
        parameters = NO_PARAMETERS if parameters is None else parameters or _ANY_OBJECT
        try:
            json_schema_format(parameters)  # checked alone, so a bad one is named
        except ValueError as exc:
            where = f"tools.{i}.function.parameters"
            raise ToolGrammarError(f"{where}: {exc}", where) from None
        options.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise ToolGrammarError("no tool to call", "tool_choice")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def forced_calls(tools: Sequence[dict], markup: CallMarkup, *, names: Iterable[str] | None = None,
                 parallel: bool = True) -> ResponseFormat:
    """Only calls: one, or with ``parallel`` one or more separated by newlines; then EOS (after at most one
    newline: a model that writes one after a call must not be held to write another call).

    Raises:
        ToolGrammarError: see :func:`call_schema`.
    """
    calls = 'call ("\\n" call)* "\\n"?' if parallel else 'call "\\n"?'
    return _format("\n".join([f"start: {calls}", _call_rule(tools, markup, names)]))


def calls_in_text(tools: Sequence[dict], markup: CallMarkup, *, parallel: bool = True) -> ResponseFormat:
    """Free text in which a call may start at the start marker, and must then be a whole valid call (more text
    may follow it; with ``parallel`` more calls too).

    Raises:
        ToolGrammarError: see :func:`call_schema`.
    """
    schema = json.dumps(call_schema(tools), ensure_ascii=False)
    calls = "called*" if parallel else "called?"
    # A lazy lexeme ends at the first start marker: text up to it is free, a call follows (llguidance's
    # "structural tag" form). The final free text is greedy: it runs to EOS.
    trigger = (f"called: TEXT {_lark_marker(markup.start, markup.start_id)}" if markup.start_id is not None else
               f'trigger[lazy]: TEXT {json.dumps(markup.start)}\ncalled: trigger')
    return _format("\n".join([f"start: {calls} tail", "tail: TEXT", r"TEXT: /(.|\n)*/",
                              f'{trigger} "\\n" %json {schema} {markup.close}']))


def document_or_calls(document: ResponseFormat, tools: Sequence[dict], markup: CallMarkup, *,
                      parallel: bool = True) -> ResponseFormat:
    """A ``document`` of a JSON response format, or only calls (as :func:`forced_calls`).

    Raises:
        ToolGrammarError: see :func:`call_schema`.
    """
    assert document.schema_text is not None, "a JSON response format is needed"
    schema = json.loads(document.schema_text)
    schema["x-guidance"] = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    calls = 'call ("\\n" call)* "\\n"?' if parallel else 'call "\\n"?'
    return _format("\n".join([f"start: %json {json.dumps(schema, ensure_ascii=False)} | {calls}",
                              _call_rule(tools, markup, None)]))


def _call_rule(tools: Sequence[dict], markup: CallMarkup, names: Iterable[str] | None) -> str:
    schema = json.dumps(call_schema(tools, names), ensure_ascii=False)
    return f"call: {markup.open} %json {schema} {markup.close}"


def _format(lark: str) -> ResponseFormat:
    return ResponseFormat("tool_calls", lark=lark)  # compiled (and checked) at the first use of its grammar


def _lark_marker(text: str, token_id: int | None) -> str:
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text, ensure_ascii=False)
