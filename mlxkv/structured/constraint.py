"""The per-sequence constraint: which tokens may come next, applied to logits before sampling.

One :class:`TokenConstraint` follows one sequence. An engine that knows each sampled token calls
``apply(logits)`` then ``advance(token)``; an mlx-lm-style loop uses the object itself as a logits processor,
``(tokens, logits) -> logits``, which advances by ``tokens[-1]`` on every call but the first (the first sees the
prompt). Either way the previous token must be concrete before the next mask exists: a constrained step reads
its sampled token back from the device (one sync per step), and the mask is computed on the CPU while the next
forward runs.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.structured.response_format import ResponseFormat
from mlxkv.structured.vocabulary import GrammarVocabulary, vocabulary_for


#: ``_BIAS[allowed]``: the additive logits mask of a uint8 allowed-mask.
_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)


class ConstraintError(RuntimeError):
    """The grammar engine cannot go on: a token outside the mask was fed, or it hit one of its limits."""


class TokenConstraint:
    """Allowed next tokens of one sequence under a grammar; EOS is allowed exactly when the document is complete.

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` (from :meth:`GrammarVocabulary.matcher`).
        vocabulary: the vocabulary the matcher was compiled against.
    """

    def __init__(self, matcher: Any, vocabulary: GrammarVocabulary):
        self._matcher = matcher
        self.vocabulary = vocabulary
        self.eos_token_ids = vocabulary.eos_token_ids
        self._bits = np.zeros((vocabulary.vocab_size + 31) // 32, dtype=np.int32)  # llguidance's bitmask
        self._called = False  # processor protocol: the first call sees the prompt, later ones a new token
        self._eos_seen = False

    def mask(self, width: int | None = None) -> mx.array:
        """``(width,)`` bool: the tokens allowed next. ``width`` is the logits' width (default: the
        tokenizer's vocabulary); ids past the vocabulary (a model's padded embedding rows) are never allowed.
        Once EOS was consumed, only EOS is allowed.

        Raises:
            ConstraintError: the grammar engine is in an error state.
        """
        return mx.array(self._allowed(width).view(np.bool_))

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` (``(.., width)``) with ``-inf`` on every token the grammar forbids next."""
        # An additive mask built on the host: on MLX's CPU backend ``logits + bias`` costs a fraction of
        # ``mx.where(mask, logits, -inf)`` (scripts/bench_grammar.py measures the whole path).
        bias = mx.array(_BIAS[self._allowed(logits.shape[-1])])  # (width,) 0 or -inf
        return logits + bias.astype(logits.dtype)

    def advance(self, token: int) -> None:
        """Move past the sampled ``token``.

        Raises:
            ConstraintError: ``token`` was not allowed (it was sampled without the mask), or the matcher failed.
        """
        if self._eos_seen:
            if int(token) in self.eos_token_ids:
                return  # the EOS-only mask after EOS was followed
            raise ConstraintError("the constrained document is finished: no token may follow its EOS")
        if not self._matcher.consume_token(int(token)):
            raise ConstraintError(f"token {token} is not allowed by the grammar here: {self._error()}")
        if int(token) in self.eos_token_ids:
            self._eos_seen = True

    def is_complete(self) -> bool:
        """Whether the text so far is a whole valid document (EOS is allowed now)."""
        return self._eos_seen or self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """Whether nothing but EOS can follow: the document is closed, or EOS was consumed."""
        return self._eos_seen or self._matcher.is_stopped()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm's logits-processor protocol: ``tokens`` is the sequence so far (prompt, then generated
        tokens), ``logits`` ``(1, width)``; returns the masked logits. Every call after the first advances by
        ``tokens[-1]``, the token sampled from the previous call's logits (reading it syncs with the device)."""
        if self._called:
            self.advance(tokens[-1].item())
        self._called = True
        return self.apply(logits)

    def _allowed(self, width: int | None) -> np.ndarray:
        """``(width,)`` uint8 numpy mask (1: allowed) from llguidance's bitmask (bit ``i % 32`` of word
        ``i // 32``)."""
        vocab = self.vocabulary.vocab_size
        width = vocab if width is None else width
        allowed = np.zeros(width, dtype=np.uint8)
        if self._eos_seen:  # an engine may run a step past EOS before it stops; its token is dropped
            allowed[[e for e in self.eos_token_ids if e < width]] = 1
            return allowed
        if not self._matcher.is_error():
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise ConstraintError(f"the grammar engine failed: {self._error()}")
        # Bit j of word w is token 32 w + j; on little-endian hosts (x86, Apple silicon) byte order matches.
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")  # (32 * words,)
        n = min(width, vocab)
        allowed[:n] = bits[:n]
        return allowed

    def _error(self) -> str:
        """The matcher's error, first line only (llguidance appends its whole state)."""
        return (self._matcher.get_error() or "rejected").strip().splitlines()[0]


def make_constraint(fmt: ResponseFormat, tokenizer: Any) -> TokenConstraint | None:
    """The constraint of one sequence for ``fmt`` over ``tokenizer`` (mlx-lm's ``TokenizerWrapper``), or
    ``None`` for ``text``. The tokenizer's grammar view is built on first use (seconds for a 49K vocabulary) and
    compiled schemas are cached by their text.

    Raises:
        ValueError: the schema does not compile against this tokenizer.
    """
    if not fmt.constrained:
        return None
    vocabulary = vocabulary_for(tokenizer)
    return TokenConstraint(vocabulary.matcher(fmt.grammar), vocabulary)


def is_complete_document(fmt: ResponseFormat, tokenizer: Any, text: str) -> bool:
    """Whether ``text`` is a whole document of ``fmt`` (for output that may have been cut by a token limit or a
    stop string); always true for ``text`` formats."""
    return not fmt.constrained or vocabulary_for(tokenizer).accepts(fmt.grammar, text)
