"""OpenAI's ``response_format`` read, checked and compiled to a grammar — pure Python, no MLX (the server uses it).

Accepted shapes (anything else is a ``ValueError`` naming the field, which the server answers with a 400):

- ``{"type": "text"}`` — unconstrained;
- ``{"type": "json_object"}`` — any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": .., "schema": {..}, "strict": true, "description": ..}}``
  — a JSON document valid against ``schema``. ``strict: false`` is enforced as strictly as ``true`` (a
  constrained output that validates is what a client asking for best effort wants too).

The grammar engine is llguidance, chosen by ``scripts/bench_grammar.py`` (docs/structured-output.md has the
figures): of the three candidates it alone let no invalid document through on tricky schemas and refuses what it
cannot enforce by name; it compiles a schema in milliseconds (outlines-core: seconds to a minute) and needs no
PyTorch (xgrammar does). Its masks over a 49K vocabulary cost 0.02-0.16 ms per row-step, most inside strings
bounded by ``maxLength`` (xgrammar's precomputed ones under 0.015 ms): under 1% of a decode step here. Output JSON is compact with ``", "`` and ``": "``
separators and no other whitespace, so a sampled model cannot wander into endless blank space.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

#: Separators of the JSON the grammar admits (as ``json.dumps`` writes by default); no other whitespace.
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "
#: llguidance's JSON options for those separators (a schema's own ``x-guidance`` may override them).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}
#: OpenAI's rule for ``json_schema.name``.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
#: What ``json_object`` means: any JSON object (llguidance allows any properties when none are listed).
_ANY_OBJECT = {"type": "object"}
#: Bounds on a schema, checked before the grammar engine sees it (its compile and mask costs grow with them).
MAX_SCHEMA_BRANCHES = 256  # the branches of one anyOf / oneOf / allOf
MAX_SCHEMA_NODES = 10_000  # objects, arrays and values in the whole schema
MAX_SCHEMA_DEPTH = 64
_COMBINATORS = ("anyOf", "oneOf", "allOf")


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A checked ``response_format``.

    Attributes:
        kind: ``"text"``, ``"json_object"``, ``"json_schema"``, or ``"tool_calls"`` (a grammar over tool-call
            markup, :mod:`mlxkv.structured.tool_calls`).
        schema_text: the JSON schema as compact JSON text (keys in their order: properties are generated in
            the order the schema lists them), the cache key of its grammar; ``None`` for ``text``.
        name: ``json_schema.name`` (``None`` otherwise).
        lark: a Lark grammar (llguidance's dialect, JSON schemas embedded as ``%json``) used instead of
            ``schema_text``'s grammar; ``None`` for the JSON kinds.
    """

    kind: str
    schema_text: str | None = None
    name: str | None = None
    lark: str | None = None

    @property
    def constrained(self) -> bool:
        """Whether decoding must follow a grammar (every kind but ``text``)."""
        return self.schema_text is not None or self.lark is not None

    @property
    def schema(self) -> dict | None:
        """The JSON schema the output must validate against (``None`` for ``text``)."""
        return json.loads(self.schema_text) if self.schema_text is not None else None

    @property
    def grammar(self) -> str:
        """The llguidance grammar of this format (compiled once per schema or Lark text)."""
        if self.lark is not None:
            return lark_grammar_for(self.lark)
        assert self.schema_text is not None, "a text response format has no grammar"
        return grammar_for(self.schema_text)


def parse_response_format(value: Any) -> ResponseFormat:
    """Check an OpenAI ``response_format`` value (``None`` means text) and compile its grammar.

    Raises:
        ValueError: an unknown type or field, a missing name or schema, or a schema the grammar engine cannot
            enforce (the message names the feature, e.g. ``uniqueItems``).
    """
    if value is None:
        return ResponseFormat("text")
    if not isinstance(value, Mapping):
        raise ValueError("response_format must be an object such as {\"type\": \"json_object\"}")
    kind = value.get("type")
    expected = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in expected:
        raise ValueError(f"response_format.type must be one of text, json_object, json_schema; got {kind!r}")
    _no_extra_keys(value, expected[kind], "response_format")
    if kind == "text":
        return ResponseFormat("text")
    if kind == "json_object":
        return json_object_format()
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ValueError("response_format.json_schema must be an object with a name and a schema")
    _no_extra_keys(spec, _SCHEMA_KEYS, "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError("response_format.json_schema.strict must be true, false or null")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise ValueError("response_format.json_schema.description must be a string")
    if "schema" not in spec:
        raise ValueError("response_format.json_schema.schema is required (the JSON schema of the output)")
    return json_schema_format(spec["schema"], name=name)


def json_object_format() -> ResponseFormat:
    """The ``json_object`` format: any JSON object."""
    fmt = ResponseFormat("json_object", _canonical(_ANY_OBJECT))
    grammar_for(fmt.schema_text)
    return fmt


def json_schema_format(schema: Any, *, name: str | None = None) -> ResponseFormat:
    """The ``json_schema`` format for ``schema`` (a dict), its grammar compiled and checked.

    Raises:
        ValueError: ``schema`` is not an object, or uses a feature the grammar engine cannot enforce.
    """
    if not isinstance(schema, Mapping):
        raise ValueError(f"the JSON schema must be an object, got {type(schema).__name__}")
    _check_size(schema)
    fmt = ResponseFormat("json_schema", _canonical(schema), name)
    grammar_for(fmt.schema_text)
    return fmt


def schema_file_format(path: str | os.PathLike) -> ResponseFormat:
    """The ``json_schema`` format of the JSON schema in the file ``path`` (named after the file).

    Raises:
        ValueError: the file cannot be read, is not JSON, or holds a schema that cannot be enforced.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the JSON schema file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema file {str(path)!r} is not JSON: {exc}") from None
    name = re.sub(r"[^A-Za-z0-9_-]", "_", file.stem)[:64] or "schema"
    return json_schema_format(schema, name=name)


@lru_cache(maxsize=256)
def grammar_for(schema_text: str) -> str:
    """The llguidance grammar (its JSON text) enforcing the schema ``schema_text``, checked; cached by text.

    Raises:
        ValueError: the schema uses a feature llguidance does not implement, or is invalid or unsatisfiable.
    """
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(schema_text, defaults=JSON_OPTIONS)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(schema_problem(messages[0]))
    return grammar


@lru_cache(maxsize=256)
def lark_grammar_for(lark: str) -> str:
    """The llguidance grammar of the Lark grammar ``lark``, checked; cached by text.

    Raises:
        ValueError: the grammar (or a JSON schema embedded in it) is invalid or uses what llguidance lacks.
    """
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(schema_problem(messages[0]))
    return grammar


def schema_problem(message: str) -> str:
    """llguidance's complaint about a schema as one line for a user."""
    first = message.strip().splitlines()[0] if message.strip() else "invalid schema"
    unimplemented = re.match(r"Unimplemented keys: \[(.*)\]", first)
    if unimplemented:
        keys = ", ".join(k.strip().strip('"') for k in unimplemented.group(1).split(","))
        return f"JSON schema feature not supported for constrained decoding: {keys}"
    return f"invalid JSON schema: {' '.join(message.split())}"


def _check_size(schema: Mapping) -> None:
    """Refuse a schema over the ``MAX_SCHEMA_*`` bounds (iterative: a deep schema cannot exhaust the stack).

    Raises:
        ValueError: naming the bound and where the schema passes it.
    """
    nodes = 0
    stack: list[tuple[Any, int, str]] = [(schema, 1, "schema")]
    while stack:
        node, depth, where = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"the JSON schema is too large: over {MAX_SCHEMA_NODES} values")
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at {where[:200]})")
        if isinstance(node, Mapping):
            for key in _COMBINATORS:
                branches = node.get(key)
                if isinstance(branches, list) and len(branches) > MAX_SCHEMA_BRANCHES:
                    raise ValueError(f"{where}.{key} has {len(branches)} branches: at most {MAX_SCHEMA_BRANCHES}")
            stack.extend((v, depth + 1, f"{where}.{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{where}.{i}") for i, v in enumerate(node))


def _canonical(schema: Mapping) -> str:
    try:
        # Key order is kept: llguidance emits properties in the order the schema lists them.
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the JSON schema is not plain JSON: {exc}") from None


def _no_extra_keys(value: Mapping, allowed: set[str], where: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise ValueError(f"{where} has unsupported field(s) {', '.join(extra)} (allowed: {', '.join(sorted(allowed))})")
