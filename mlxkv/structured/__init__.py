"""Structured output by constrained decoding: OpenAI ``response_format`` (``json_object``, ``json_schema``)
compiled by llguidance into a per-sequence mask over the next token.

This package's top level has no MLX import (the server checks ``response_format`` with it);
:mod:`mlxkv.structured.constraint` holds the MLX side (:class:`~mlxkv.structured.constraint.TokenConstraint`,
:func:`~mlxkv.structured.constraint.make_constraint`).
"""

from mlxkv.structured.response_format import (
    ResponseFormat,
    json_object_format,
    json_schema_format,
    parse_response_format,
    schema_file_format,
)

__all__ = ["ResponseFormat", "json_object_format", "json_schema_format", "parse_response_format",
           "schema_file_format"]
