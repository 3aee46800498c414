"""One token's text and UTF-8 bytes, as OpenAI's log-probability objects show them (``token`` and ``bytes``).

A byte-level BPE token may hold part of a multi-byte character, so its bytes are read from the token itself
through mlx-lm's detokenizer tables (byte-level BPE: GPT-2's byte alphabet; SentencePiece: ``<0xNN>`` byte
pieces and ``▁`` for a space), not from decoding it alone. ``token`` is those bytes decoded, a partial character
shown as U+FFFD; concatenating the ``bytes`` of a completion's tokens gives the model's text exactly (the
response's text may lack the space its first token starts with: mlx-lm's detokenizers drop it).
"""

from __future__ import annotations

import threading
from typing import Any


class TokenText:
    """Token id -> ``(text, bytes)``, memoized.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (its streaming detokenizer tells the tokenizer's kind).
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        detok = getattr(tokenizer, "_detokenizer", None)
        kind = type(detok).__name__ if detok is not None else ""
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        decoder = getattr(getattr(hf, "backend_tokenizer", None), "decoder", None)
        self._byte_level = kind == "BPEStreamingDetokenizer" or type(decoder).__name__ == "ByteLevel"
        self._spm_map = detok.tokenmap if kind == "SPMStreamingDetokenizer" else None  # bytes per token
        self._hf = hf
        self._memo: dict[int, tuple[str, bytes]] = {}
        self._lock = threading.Lock()  # the HF tokenizer may be called from several threads

    def __call__(self, token: int) -> tuple[str, bytes]:
        """``(text, utf-8 bytes)`` of ``token``."""
        found = self._memo.get(token)
        if found is None:
            raw = self._bytes(token)
            found = self._memo[token] = (raw.decode("utf-8", "replace"), raw)
        return found

    def _bytes(self, token: int) -> bytes:
        with self._lock:
            if self._spm_map is not None and 0 <= token < len(self._spm_map):
                return self._spm_map[token].replace("\u2581".encode("utf-8"), b" ")
            if self._byte_level:
                from mlx_lm.tokenizer_utils import _byte_decoder

                table, piece = _byte_decoder(), self._hf.convert_ids_to_tokens(token)
                if piece is not None:
                    return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)
            return self._tokenizer.decode([token]).encode("utf-8")
