"""A model's tokenizer as the grammar engine sees it, built once per tokenizer, with its compiled matchers.

Building llguidance's view of a 49K-token vocabulary takes seconds (it precomputes each token's bytes and a
token trie with slices for fast masks), so it is made once per tokenizer object and kept while the tokenizer
lives. Compiled schemas are cached on it: a fresh matcher for a sequence is a cheap copy of a pristine one.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

#: Compiled matchers kept per vocabulary (least recently used dropped first).
MATCHER_CACHE_SIZE = 64

_vocabularies: weakref.WeakKeyDictionary[Any, GrammarVocabulary] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class GrammarVocabulary:
    """llguidance's tokenizer for one mlx-lm ``TokenizerWrapper`` and the matchers compiled against it.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (or a ``transformers`` fast tokenizer). Its EOS ids
            (``eos_token_ids``, else ``eos_token_id``) are the tokens a grammar allows once the document is
            complete.
    """

    def __init__(self, tokenizer: Any):
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # the transformers tokenizer inside mlx-lm's wrapper
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.eos_token_ids: tuple[int, ...] = tuple(int(e) for e in eos)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=list(self.eos_token_ids))
        self.vocab_size: int = self.ll_tokenizer.vocab_size  # width of the masks the matchers compute
        self._matchers: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str) -> Any:
        """A fresh ``llguidance.LLMatcher`` for ``grammar`` at its start state.

        Raises:
            ValueError: the grammar does not compile against this vocabulary (the message is llguidance's).
        """
        from llguidance import LLMatcher

        with self._lock:
            pristine = self._matchers.get(grammar)
            if pristine is not None:
                self._matchers.move_to_end(grammar)
                return pristine.deep_copy()
        pristine = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if not pristine.is_error():
            first = pristine.deep_copy()
            first.compute_bitmask()  # a grammar that admits no first token (a $ref cycle) fails here, not mid-decode
            if first.is_error():
                raise ValueError(f"the schema admits no output: {first.get_error().strip().splitlines()[0]}")
        if pristine.is_error():
            from mlxkv.structured.response_format import schema_problem

            raise ValueError(schema_problem(pristine.get_error()))
        with self._lock:
            self._matchers[grammar] = pristine
            while len(self._matchers) > MATCHER_CACHE_SIZE:
                self._matchers.popitem(last=False)
        return pristine.deep_copy()

    def accepts(self, grammar: str, text: str) -> bool:
        """Whether ``text`` is a complete document of ``grammar`` (checked byte by byte, whatever tokens made it)."""
        matcher = self.matcher(grammar)
        return matcher.consume_tokens(self.ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


def vocabulary_for(tokenizer: Any) -> GrammarVocabulary:
    """The :class:`GrammarVocabulary` of ``tokenizer``, built on first use and kept while the tokenizer lives."""
    with _lock:
        found = _vocabularies.get(tokenizer)
        if found is None:
            found = _vocabularies[tokenizer] = GrammarVocabulary(tokenizer)
        return found
