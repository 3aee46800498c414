"""Chat prompts to token ids for the server, with the tokens of a long shared head (a system prompt) memoized.

Tokenizing a 4K-token prompt takes ~4-7 ms here, once per request, one request at a time: with a burst of
requests sharing a long system prompt, a request's tokens reach the engine only after the others ahead of it are
tokenized. Fast tokenizers split the text at added special tokens before anything else and encode the pieces
independently, so for a rendered chat ``text = head + tail`` where ``head`` ends with a special token ``S``:

    encode(text) == encode(head) + encode(S + tail)[1:]

(``S + tail`` keeps the tail a non-first piece, as in the whole text, for tokenizers that treat the first piece
differently). :class:`PromptEncoder` takes as head the text up to the last special token within the rendering of
all messages but the last (a system prompt, earlier turns). A head met once costs nothing extra; met again, the
identity is checked against the tokenizer's own ``apply_chat_template`` and its ids remembered; later prompts
with that head encode only their tail. One mismatch turns the memo off for good (with a warning).

Extra template variables (a request's ``chat_template_kwargs``) go to every rendering of a prompt, the head's
included; since the memo is keyed by the rendered head's text, not by the messages, variables that change the
rendering (``enable_thinking``, say) can never serve one rendering's ids for another.

:meth:`PromptEncoder.chat_if_cheap` answers only when the answer costs well under a millisecond (a short prompt,
or a memoized head and a short tail), so the server can tokenize those on its event loop instead of hopping to a
worker thread and back (measured at 8 concurrent clients on a 4K-token system prompt: arrival -> engine 15 -> 8-9
ms median, the hop waiting on the engine thread's hold of the GIL).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

#: Heads shorter than this many characters are not worth a memo entry (their encoding takes microseconds).
MIN_HEAD_CHARS = 2048
#: Heads remembered (least recently used dropped first).
MEMO_ENTRIES = 32
#: :meth:`PromptEncoder.chat_if_cheap` encodes at most this many characters (~0.1-0.3 ms here).
CHEAP_CHARS = 8192
#: ... and renders the chat template over messages of at most this many characters (twice, ~2.5 us per 1K here).
CHEAP_RENDER_CHARS = 262144


class PromptEncoder:
    """Token ids of chat messages through the tokenizer's chat template, a long head's tokens memoized.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (or a transformers tokenizer) with a chat template.
        loop_tokenizer: the tokenizer :meth:`chat_if_cheap` and :meth:`encode_if_cheap` use (a private copy
            for the event loop, see :class:`TokenizerLanes`); ``tokenizer`` itself when not given.

    Attributes:
        memo_on: False once the identity failed for some head (every prompt is then encoded whole).
        hits: prompts whose head came from the memo.
    """

    def __init__(self, tokenizer: Any, *, loop_tokenizer: Any = None, min_head_chars: int = MIN_HEAD_CHARS,
                 entries: int = MEMO_ENTRIES):
        self.tokenizer = tokenizer
        self.loop_tokenizer = tokenizer if loop_tokenizer is None else loop_tokenizer
        self.min_head_chars = min_head_chars
        self.entries = entries
        self.memo_on = True
        self.hits = 0
        # head -> its ids (None: seen once, not checked yet), least recently used first
        self._heads: collections.OrderedDict[str, list[int] | None] = collections.OrderedDict()
        self._lock = threading.Lock()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        specials = set(getattr(hf, "all_special_tokens", None) or ())  # named ones (bos, eos, pad, ...)
        specials |= {t.content for t in (getattr(hf, "added_tokens_decoder", None) or {}).values()
                     if getattr(t, "special", False)}  # and the template's role markers
        self._specials = sorted({s for s in specials if s}, key=len, reverse=True)

    def chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """The ids ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)``
        returns (``template_kwargs``: e.g. ``tools``; they are rendered into the head's text, which is the memo's
        key, so prompts with other tools never share a head).

        Raises:
            Exception: whatever the chat template raises for these messages.
        """
        return self._chat(self.tokenizer, messages, template_kwargs)

    def _chat(self, tok: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        if not self.memo_on or not self._specials or len(messages) < 2:
            return self._whole(tok, messages, template_kwargs)
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
        split = self._split(tok, text, messages, template_kwargs)
        if split is None:
            return self._whole(tok, messages, template_kwargs)
        head, special, tail = text[:split[0]], split[1], text[split[0]:]
        seen, ids = self._look_up(head)
        if ids is not None:
            return self._with_head(tok, ids, special, tail)
        whole = self._whole(tok, messages, template_kwargs)
        if not seen:  # a head met once costs nothing extra; the second time it is checked and remembered
            return whole
        ids = self._encode(tok, head)
        if ids + self._encode(tok, special + tail)[1:] != whole:
            self.memo_on = False
            log.warning("a chat prompt did not tokenize as its pieces: prompts are tokenized whole from now on")
            return whole
        with self._lock:
            if head in self._heads:
                self._heads[head] = ids
        return whole

    def chat_if_cheap(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int] | None:
        """:meth:`chat`'s ids when they cost well under a millisecond — messages of at most ``CHEAP_CHARS``
        characters in all, or a memoized head and a tail of at most ``CHEAP_CHARS`` (messages of at most
        ``CHEAP_RENDER_CHARS``) — else ``None`` (nothing encoded, the memo untouched).

        Raises:
            Exception: whatever the chat template raises for these messages.
        """
        tok = self.loop_tokenizer
        total = _chars(messages, template_kwargs)
        if total <= CHEAP_CHARS:
            return self._chat(tok, messages, template_kwargs)
        if not self.memo_on or not self._specials or len(messages) < 2 or total > CHEAP_RENDER_CHARS:
            return None
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
        split = self._split(tok, text, messages, template_kwargs)
        if split is None or len(text) - split[0] > CHEAP_CHARS:
            return None
        head = text[:split[0]]
        with self._lock:
            ids = self._heads.get(head)
            if ids is not None:
                self._heads.move_to_end(head)  # most recently used
        return None if ids is None else self._with_head(tok, ids, split[1], text[split[0]:])

    def encode_if_cheap(self, text: str) -> list[int] | None:
        """``tokenizer.encode(text)`` (a completion prompt) when ``text`` has at most ``CHEAP_CHARS`` characters,
        else None."""
        return list(self.loop_tokenizer.encode(text)) if len(text) <= CHEAP_CHARS else None

    def _with_head(self, tok: Any, ids: list[int], special: str, tail: str) -> list[int]:
        """A memoized head's ``ids`` and the tail's (encoded after the head's last special token ``special``)."""
        self.hits += 1
        return ids + self._encode(tok, special + tail)[1:]

    def _look_up(self, head: str) -> tuple[bool, list[int] | None]:
        """Whether ``head`` was met before and its ids (None: not checked yet); it becomes the most recently used
        (added, unchecked, if new; the least recently used heads beyond ``entries`` dropped)."""
        with self._lock:
            seen = head in self._heads
            ids = self._heads.get(head)
            self._heads[head] = ids
            self._heads.move_to_end(head)
            while len(self._heads) > self.entries:
                self._heads.popitem(last=False)
        return seen, ids

    def _whole(self, tok: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs))

    def _encode(self, tok: Any, text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def _split(self, tok: Any, text: str, messages: list[dict[str, Any]],
               template_kwargs: dict[str, Any]) -> tuple[int, str] | None:
        """``(end, token)``: the last special token within the rendering of the messages before the last one (when
        the whole text starts with that rendering), if the head up to it is long enough to memoize; else None."""
        try:
            earlier = tok.apply_chat_template(messages[:-1], add_generation_prompt=False, tokenize=False,
                                              **template_kwargs)
        except Exception:  # noqa: BLE001 - a template may refuse a conversation that ends early
            return None
        if len(earlier) < self.min_head_chars or not text.startswith(earlier):
            return None
        best: tuple[int, str] | None = None
        for special in self._specials:
            at = text.rfind(special, 0, len(earlier))  # ends within the earlier messages' rendering
            if at >= 0 and (best is None or at + len(special) > best[0]):
                best = (at + len(special), special)
        if best is None or best[0] < self.min_head_chars:
            return None
        return best


def _chars(messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> int:
    """About how many characters the template renders: the messages' text, their tool calls, the kwargs."""
    total = sum(len(m["content"]) for m in messages)
    total += sum(len(json.dumps(m["tool_calls"], default=str)) for m in messages if m.get("tool_calls"))
    return total + (len(json.dumps(template_kwargs, default=str)) if template_kwargs else 0)
