"""Random JSON schemas and documents valid against them, for structured-output tests and benchmarks.

:func:`random_schema` builds schemas from the features constrained decoding must honour: objects with required
and optional properties, arrays with item bounds, enums, integers and numbers with ranges, strings with
``maxLength``, booleans, nesting. Every string, array and number is bounded (numbers by range and
``multipleOf: 0.25``: an unbounded fraction is a string of digits a sampled model may never end), so a sampled
document always ends within a few hundred tokens. :func:`instance` draws a document valid against such a schema.
"""

from __future__ import annotations

import math
import random
import string
from typing import Any

_WORDS = ("alpha", "beta", "gamma", "delta", "north", "south", "red", "green", "blue", "small", "large", "open",
          "closed", "cat", "dog", "river", "stone", "paper", "light", "sound")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema (the root) with 1-4 properties; nested objects and arrays down to depth 2."""
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 24)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        # Quarters: exact in binary, so jsonschema's float division checks multipleOf exactly.
        low = rng.randint(-400, 400) / 4
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(2, 2000) / 4, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(1, 5))}
    if kind == "object":
        return random_schema(rng, depth)
    return {"type": "array", "items": _value_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 4)}


def instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """A document valid against ``schema`` (the subset :func:`random_schema` and the benchmarks use)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        required = set(schema.get("required", ()))
        return {k: instance(v, rng) for k, v in schema["properties"].items() if k in required or rng.random() < 0.5}
    if kind == "array":
        count = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [instance(schema["items"], rng) for _ in range(count)]
    if kind == "string":
        size = rng.randint(schema.get("minLength", 0), schema.get("maxLength", 12))
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(size))
    if kind == "integer":
        return rng.randint(schema.get("minimum", -10**6), schema.get("maximum", 10**6))
    if kind == "number":
        low, high = schema.get("minimum", -1e3), schema.get("maximum", 1e3)
        step = schema.get("multipleOf", 0.25)
        return rng.randint(math.ceil(low / step), math.floor(high / step)) * step
    if kind == "boolean":
        return rng.random() < 0.5
    raise ValueError(f"instance() does not build type {kind!r}")
