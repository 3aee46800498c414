"""The per-sequence constraint: which tokens may come next, applied to logits before sampling.

One :class:`TokenConstraint` follows one sequence. An engine that knows each sampled token calls
``apply(logits)`` then ``advance(token)``; an mlx-lm-style loop uses the object itself as a logits processor,
``(tokens, logits) -> logits``, which advances by ``tokens[-1]`` on every call but the first (the first sees the
prompt). Either way the previous token must be concrete before the next mask exists: a constrained step reads
its sampled token back from the device (one sync per step), and the mask is computed on the CPU while the next
forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxkv.structured.response_format import ResponseFormat
from mlxkv.structured.vocabulary import GrammarVocabulary, vocabulary_for


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
        self._words = np.zeros(-(-vocabulary.vocab_size // 32), dtype=np.uint32)  # llguidance's bitmask
        self._called = False  # processor protocol: the first call sees the prompt, later ones a new token
        self._eos_seen = False

    def mask(self, width: int | None = None) -> mx.array:
        """``(width,)`` bool: the tokens allowed next. ``width`` is the logits' width (default: the
        tokenizer's vocabulary); ids past the vocabulary (a model's padded embedding rows) are never allowed.
        Once EOS was consumed, only EOS is allowed.

        Raises:
            ConstraintError: the grammar engine is in an error state.
        """
        width = self.vocabulary.vocab_size if width is None else width
        # Bit j of word w is token 32 w + j; on little-endian hosts (x86, Apple silicon) byte order matches.
        bits = np.unpackbits(self.words(width).view(np.uint8), bitorder="little")  # (32 * words,)
        return mx.array(bits[:width].view(np.bool_))

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` (``(.., width)``) with ``-inf`` on every token the grammar forbids next."""
        width = logits.shape[-1]
        words = mx.array(self.words(width)[None])  # (1, ceil(width / 32))
        return apply_words(logits.reshape(-1, width), words).reshape(logits.shape)

    def words(self, width: int) -> np.ndarray:
        """The allowed-next mask as ``ceil(width / 32)`` uint32 words (bit ``t % 32`` of word ``t // 32`` for
        token ``t``; 0 past the vocabulary): what :func:`apply_words` takes, 1/32 of the mask's size.

        Raises:
            ConstraintError: the grammar engine is in an error state.
        """
        if self._eos_seen:  # an engine may run a step past EOS before it stops; its token is dropped
            self._words[:] = 0
            for e in self.eos_token_ids:
                self._words[e // 32] |= np.uint32(1 << (e % 32))
        else:
            if not self._matcher.is_error():
                self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            if self._matcher.is_error():
                raise ConstraintError(f"the grammar engine failed: {self._error()}")
        n = -(-width // 32)
        if n <= len(self._words):
            return self._words[:n].copy()
        return np.concatenate([self._words, np.zeros(n - len(self._words), dtype=np.uint32)])

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

    def allowed_prefix(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` (proposed continuations) the grammar allows in a row from here,
        stopping before an EOS (nothing follows it); the state is left as it is."""
        if self._eos_seen or self._matcher.is_error():
            return 0
        n = self._matcher.validate_tokens([int(t) for t in draft])
        return next((i for i, t in enumerate(draft[:n]) if int(t) in self.eos_token_ids), n)

    def draft_words(self, draft: Sequence[int], width: int) -> np.ndarray:
        """The allowed-next masks at each position of a verification row, ``(k + 1, ceil(width / 32))`` uint32
        words: row 0 is :meth:`words` now, row ``i`` the mask after ``draft[:i]``. The draft tokens are consumed
        on the matcher for the masks, then rolled back: the state is left as it was.

        Raises:
            ConstraintError: a draft token is not allowed (cut drafts with :meth:`allowed_prefix`), or the matcher
                failed.
        """
        rows = [self.words(width)]
        allowed = self.allowed_prefix(draft)  # checked first: a refused token would leave the matcher in error
        if allowed < len(draft):
            raise ConstraintError(f"draft token {draft[allowed]} is not allowed by the grammar here")
        consumed = 0
        try:
            for token in draft:
                if not self._matcher.consume_token(int(token)):
                    raise ConstraintError(f"draft token {token} is not allowed by the grammar here: {self._error()}")
                consumed += 1
                rows.append(self.words(width))
        finally:
            if consumed and not self._matcher.rollback(consumed):
                raise ConstraintError(f"the grammar engine could not roll back a draft: {self._error()}")
        return np.stack(rows)  # (k + 1, ceil(width / 32))

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

    def _error(self) -> str:
        """The matcher's error, first line only (llguidance appends its whole state)."""
        return (self._matcher.get_error() or "rejected").strip().splitlines()[0]


@mx.compile
def apply_words(logits: mx.array, words: mx.array) -> mx.array:
    """``logits`` (B, width) with ``-inf`` where the bit of ``words`` (B, ceil(width / 32)) uint32 is 0.

    The masks travel as bits and are unpacked inside one compiled kernel with the select: on MLX's CPU backend
    that costs a fraction of building a (B, width) mask on the host and copying it over.
    """
    # The shifts are made here, not once at import: an array built lazily on one thread's stream cannot be
    # evaluated on another's (the batch engine samples on its own thread).
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1  # (B, words, 32)
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[-1]]  # (B, width)
    return mx.where(allowed.astype(mx.bool_), logits, -mx.inf)


def apply_constraints(logits: mx.array, constraints: Sequence[TokenConstraint | None]) -> mx.array:
    """``logits`` (B, width) of a batch masked row by row, in one MLX operation: row ``i`` by
    ``constraints[i]``'s next-token mask, left as it is where that is ``None`` (an unconstrained row).

    Raises:
        ConstraintError: a constraint's grammar engine is in an error state.
    """
    width = logits.shape[-1]
    all_ones = np.full(-(-width // 32), 0xFFFFFFFF, dtype=np.uint32)
    words = np.stack([all_ones if c is None else c.words(width) for c in constraints])  # (B, ceil(width / 32))
    return apply_words(logits, mx.array(words))


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
