"""Bounds on what a GGUF file's header says, checked before anything is allocated from it.

A hostile or broken file must end in one readable line, never a crash in a native reader (``general.alignment
= 0`` divides by zero inside MLX's), a model of a hundred thousand layers built before its weights are found
missing, or a table sized by a four-billion-token context. :func:`check_layout` runs on the header alone, before
MLX reads the file; :func:`check_hyperparameters` on the values the mlx-lm config is built from, before a model
is instantiated.
"""

from __future__ import annotations

import math
import re
from typing import Any

from mlxkv.gguf.header import BLOCK_SIZES, GGUFError, Header

#: ``general.alignment``: a power of two up to this (GGUF's default is 32).
MAX_ALIGNMENT = 1 << 16
#: Tensors and metadata entries in one file (a 400B-parameter model has a few thousand tensors).
MAX_TENSORS = 1 << 16
#: Elements of one tensor.
MAX_ELEMENTS = 1 << 40
#: Layers, attention heads, and the context a model may declare.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_CONTEXT = 1 << 24

_BLOCK = re.compile(r"blk\.(\d+)\.")


def alignment(header: Header) -> int:
    """``general.alignment`` checked (32 when absent).

    Raises:
        GGUFError: not an integer power of two in [1, ``MAX_ALIGNMENT``].
    """
    value = header.metadata.get("general.alignment", 32)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ALIGNMENT \
            or value & (value - 1):
        raise GGUFError(f"general.alignment is {value!r}: a power of two up to {MAX_ALIGNMENT} is needed")
    return value


def check_layout(header: Header, file_size: int) -> None:
    """The tensor table fits the file: every tensor's bytes lie inside it, aligned, of a bounded size.

    Raises:
        GGUFError: naming the first field or tensor out of bounds.
    """
    align = alignment(header)
    if len(header.tensors) > MAX_TENSORS:
        raise GGUFError(f"the file lists {len(header.tensors)} tensors (at most {MAX_TENSORS})")
    data_start = -(-header.table_end // align) * align
    for t in header.tensors:
        where = f"tensor {t.name[:64]}"
        if not t.dims or any(d < 1 for d in t.dims):
            raise GGUFError(f"{where} has dimensions {list(t.dims)}: each must be at least 1")
        elements = math.prod(t.dims)
        if elements > MAX_ELEMENTS:
            raise GGUFError(f"{where} has {elements} elements (at most {MAX_ELEMENTS})")
        per_block, block_bytes = BLOCK_SIZES.get(t.kind, (1, 0))
        if t.dims[0] % per_block:
            raise GGUFError(f"{where} rows of {t.dims[0]} are not whole {t.kind} blocks of {per_block}")
        if t.offset % align:
            raise GGUFError(f"{where} starts at offset {t.offset}, not a multiple of the alignment {align}")
        end = data_start + t.offset + elements // per_block * block_bytes
        if end > file_size:
            raise GGUFError(f"{where} ends at byte {end}, past the end of the {file_size}-byte file")


def check_hyperparameters(arch: str, values: dict[str, Any], dims: dict[str, tuple[int, ...]]) -> None:
    """The model's shape as the metadata gives it (``values``: the mlx-lm config's integer fields), in bounds and
    consistent with the tensors the file holds (``dims``: GGUF order, ``ne0`` first).

    Raises:
        GGUFError: naming the GGUF key whose value is out of bounds or disagrees with the tensors.
    """
    def need(ok: bool, key: str, value: Any, what: str) -> None:
        if not ok:
            raise GGUFError(f"{arch}.{key} is {value!r}: {what}")

    layers, heads, kv_heads = values["num_hidden_layers"], values["num_attention_heads"], values["num_key_value_heads"]
    hidden, head_dim, ffn = values["hidden_size"], values["head_dim"], values["intermediate_size"]
    context = values["max_position_embeddings"]
    need(1 <= heads <= MAX_HEADS, "attention.head_count", heads, f"1 to {MAX_HEADS} heads")
    need(1 <= kv_heads <= heads and heads % kv_heads == 0, "attention.head_count_kv", kv_heads,
         f"a divisor of the {heads} attention heads")
    need(1 <= context <= MAX_CONTEXT, "context_length", context, f"1 to {MAX_CONTEXT} tokens")
    blocks = sorted({int(m.group(1)) for name in dims if (m := _BLOCK.match(name))})
    need(1 <= layers <= MAX_LAYERS and blocks == list(range(layers)), "block_count", layers,
         f"the file holds tensors for {len(blocks)} blocks")
    embedding = dims.get("token_embd.weight", ())
    need(embedding[:1] == (hidden,), "embedding_length", hidden,
         f"the token embedding's rows have {embedding[0] if embedding else 'no'} values")
    for layer in range(layers):  # every block: q and k rows are un-permuted by head before any shape check
        for tensor, rows, key, value in (("attn_q", heads * head_dim, "attention.key_length", head_dim),
                                         ("attn_k", kv_heads * head_dim, "attention.head_count_kv", kv_heads),
                                         ("ffn_up", ffn, "feed_forward_length", ffn)):
            name = f"blk.{layer}.{tensor}.weight"
            if layer and name not in dims:
                continue  # an architecture without it (checked on block 0); the weights load says what is missing
            shape = dims.get(name, ())
            need(shape == (hidden, rows), key, value,
                 f"{name} is {list(shape)}, not [{hidden}, {rows}] as the metadata implies")
