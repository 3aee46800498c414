"""A request's constrained output — its ``response_format`` and its forced or ``strict`` tool calls — as the one
grammar (a :class:`~mlxkv.structured.ResponseFormat`) each of its choices follows in the batch engine.

Shared by the routes: :func:`parse_format` reads ``response_format`` (a 400 naming the field when it is wrong);
:func:`needs_grammar` says, without touching the tokenizer, whether a request is constrained at all;
:func:`output_format` builds its grammar: the ``response_format``'s, or tool calls in the markup of the model's tool
parser (:mod:`mlxkv.structured.tool_calls`), compiled against the tokenizer's grammar vocabulary:

================================  ==============================  ==========================================
``tool_choice``                   no ``response_format``          ``json_object`` / ``json_schema``
================================  ==============================  ==========================================
none, or no tools                 free                            the document
auto                              free (calls bound to their      the document, or calls
                                  schemas if a tool is strict)
required (Anthropic's any)        one or more calls               400: the output cannot be both
a named function                  one call of it                  400
================================  ==============================  ==========================================

:func:`output_format` uses the tokenizer (it encodes the call markers) and, at the server's first constrained
request, builds the vocabulary (about 1.3 s for a 49K vocabulary here, holding the GIL): run it where the app runs
tokenization, off the event loop.
"""

from __future__ import annotations

from typing import Any

from mlxkv.chat_template import tool_parser_name
from mlxkv.server.errors import APIError
from mlxkv.server.tools import ToolRequestError
from mlxkv.structured import ResponseFormat, parse_response_format
from mlxkv.structured.tool_calls import (
    PARSERS_WITH_GRAMMAR,
    CallMarkup,
    ToolGrammarError,
    calls_in_text,
    document_or_calls,
    forced_calls,
)


def parse_format(value: Any) -> ResponseFormat:
    """A request's ``response_format`` checked and compiled (``None``: text).

    Raises:
        APIError: 400 naming ``response_format`` (an unknown type or field, a schema that cannot be enforced).
    """
    try:
        return parse_response_format(value)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value", "response_format") from None


def forces_call(tool_choice: Any) -> bool:
    """Whether ``tool_choice`` makes the model call a tool (``required``, Anthropic's ``any``, a named function)."""
    return tool_choice in ("required", "any") or isinstance(tool_choice, dict)


def strict_tools(tools: list[dict] | None) -> list[int]:
    """Indices of the tools whose function asks for ``strict`` arguments."""
    return [i for i, tool in enumerate(tools or ()) if (tool.get("function") or {}).get("strict")]


def needs_grammar(fmt: ResponseFormat, tools: list[dict] | None, tool_choice: Any) -> bool:
    """Whether the request's output follows a grammar (cheap: no tokenizer, no compilation). ``tools`` are the
    tools in use (``None`` when ``tool_choice`` is none or none were sent)."""
    return fmt.constrained or bool(tools) and (forces_call(tool_choice) or bool(strict_tools(tools)))


def output_format(tokenizer: Any, fmt: ResponseFormat, tools: list[dict] | None, tool_choice: Any, *,
                  parallel: bool = True) -> ResponseFormat | None:
    """The grammar every choice of the request follows (the module's table), compiled against ``tokenizer``'s
    grammar vocabulary; ``None`` when the output is free.

    Args:
        tokenizer: the engine's tokenizer (mlx-lm's ``TokenizerWrapper``).
        fmt: the request's ``response_format`` (:func:`parse_format`).
        tools: the OpenAI function tools in use (``None``: none, or ``tool_choice`` none).
        tool_choice: as sent, OpenAI's form (``"auto"``, ``"required"``, ``{"type": "function", ...}``).
        parallel: ``parallel_tool_calls`` (false: at most one call).

    Raises:
        ToolRequestError: a forced call with a ``response_format``; a tool parser whose format has no grammar
            here; a tool's ``parameters`` that cannot be enforced.
        APIError: 400 when the grammar does not compile against this tokenizer (or the tokenizer cannot have one).
    """
    if not needs_grammar(fmt, tools, tool_choice):
        return None
    vocabulary = _vocabulary(tokenizer)
    if tools:
        forced = forces_call(tool_choice)
        if forced and fmt.constrained:
            raise ToolRequestError("response_format cannot be combined with a tool_choice that forces a call (the "
                                   "output cannot be both): send one of them", "response_format")
        if forced or strict_tools(tools) or fmt.constrained:
            markup = call_markup(tokenizer, vocabulary, tools, tool_choice)
            try:
                if forced:
                    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
                    fmt = forced_calls(tools, markup, names=None if name is None else [name],
                                       parallel=parallel and name is None)
                elif fmt.constrained:
                    fmt = document_or_calls(fmt, tools, markup, parallel=parallel)
                else:
                    fmt = calls_in_text(tools, markup, parallel=parallel)
            except ToolGrammarError as exc:
                raise ToolRequestError(str(exc), exc.param) from None
    try:
        vocabulary.matcher(fmt.grammar)  # compiled once against the vocabulary; the engine copies it per choice
    except ValueError as exc:
        raise APIError(400, f"the output's grammar does not compile for this model's tokenizer: {exc}",
                       "invalid_value", "response_format" if fmt.kind != "tool_calls" else "tools") from None
    return fmt


def call_markup(tokenizer: Any, vocabulary: Any, tools: list[dict], tool_choice: Any) -> CallMarkup:
    """The markers around a call in ``tokenizer``'s tool-call format, each one's token id when it is a single
    special token of the vocabulary.

    Raises:
        ToolRequestError: the model's tool parser writes calls in a format these grammars do not express.
    """
    parser = tool_parser_name(tokenizer)
    if parser not in PARSERS_WITH_GRAMMAR:
        forced = forces_call(tool_choice)
        asked, param = ((f"tool_choice {tool_choice!r}", "tool_choice") if forced else
                        ("strict tools", f"tools.{strict_tools(tools)[0]}.function.strict"))
        raise ToolRequestError(
            f"{asked} needs constrained decoding in the model's tool-call format, which this server can write for "
            f"the {', '.join(PARSERS_WITH_GRAMMAR)} parser only (this model's is {parser}): use tool_choice "
            "\"auto\" without strict", param, "unsupported_value")
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    return CallMarkup(start, end, _special_id(tokenizer, vocabulary, start), _special_id(tokenizer, vocabulary, end))


def _special_id(tokenizer: Any, vocabulary: Any, text: str) -> int | None:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) == 1 and vocabulary.ll_tokenizer.is_special_token(ids[0]):
        return int(ids[0])
    return None


def _vocabulary(tokenizer: Any) -> Any:
    from mlxkv.structured.vocabulary import vocabulary_for

    try:
        return vocabulary_for(tokenizer)
    except Exception as exc:  # noqa: BLE001 - llguidance takes fast Hugging Face tokenizers only
        raise APIError(400, f"constrained decoding is not available for this model's tokenizer: {exc}",
                       "unsupported_value", "response_format") from None
