"""Where the server tokenizes prompts, and the size check that comes before.

Two lanes, so a long prompt never holds up a short one:

- the event loop, for prompts that cost well under a millisecond (:meth:`PromptEncoder.chat_if_cheap`,
  :meth:`PromptEncoder.encode_if_cheap`), through a private copy of the tokenizer that only the loop touches:
  a short prompt is tokenized at once even while a long one is being tokenized;
- one worker thread (capacity 1) for everything else, through the shared tokenizer, one call at a time (a
  tokenizer shared across threads is not safe to call concurrently).

A tokenizer that cannot be copied gets one shared tokenizer: the loop lane then runs only while the worker is
idle, and a short prompt waits its turn otherwise.

Before either lane, :meth:`TokenizerLanes.check_chars`: every token stands for at most as many characters as the
longest vocabulary entry, so a prompt of more than ``context_length`` times that many characters cannot fit the
context whatever it says; it is refused in microseconds instead of after seconds of tokenizing (a 3.9 MB prompt
took 21 s on the toy model's tokenizer, every other request's tokenizing queued behind it).
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any, Callable, TypeVar

import anyio

log = logging.getLogger(__name__)
T = TypeVar("T")


def max_token_chars(tokenizer: Any) -> int | None:
    """Characters of the longest vocabulary entry (an upper bound on the characters one token stands for, since
    byte-level entries spell one byte per character); None when the vocabulary cannot be read."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        vocab = hf.get_vocab()
    except Exception:  # noqa: BLE001 - any tokenizer without a readable vocabulary: no character limit
        return None
    return max((len(t) for t in vocab), default=None) or None


def content_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text content (text parts of list content included): what any chat template
    renders at least."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


class TokenizerLanes:
    """The server's two tokenizing lanes (see the module docstring) and the prompt size check.

    Args:
        tokenizer: the engine's tokenizer (the worker lane's).
        context_length: the model's context in tokens (None: no character limit).
    """

    def __init__(self, tokenizer: Any, context_length: int | None = None):
        self.tokenizer = tokenizer
        try:
            self.loop_tokenizer = copy.deepcopy(tokenizer)
            self._shared = False
        except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot be copied: share it, as said above
            log.info("tokenizer cannot be copied (%s): short prompts wait for a long one's tokenizing", exc)
            self.loop_tokenizer = tokenizer
            self._shared = True
        per_token = max_token_chars(tokenizer)
        self.max_chars = None if context_length is None or per_token is None else context_length * per_token
        self.context_length = context_length
        self._limiter = anyio.CapacityLimiter(1)
        self._lock = threading.Lock()

    def check_chars(self, chars: int) -> str | None:
        """Why a prompt of ``chars`` characters can never fit the context (None: it may)."""
        if self.max_chars is not None and chars > self.max_chars:
            return (f"the prompt has {chars} characters, more than a {self.context_length}-token context can hold "
                    f"(at most {self.max_chars} characters for this tokenizer)")
        return None

    def _locked(self, fn: Callable[[], T]) -> T:
        with self._lock:
            return fn()

    async def on_worker(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the worker lane (it may use :attr:`tokenizer`)."""
        return await anyio.to_thread.run_sync(self._locked, fn, limiter=self._limiter)

    async def tokenize(self, cheap: Callable[[], list[int] | None], full: Callable[[], list[int]]) -> list[int]:
        """``cheap()`` on the loop lane (it may use only :attr:`loop_tokenizer`); when it returns None, ``full()``
        on the worker lane."""
        if not self._shared:
            ids = cheap()
        elif self._lock.acquire(blocking=False):
            try:
                ids = cheap()
            finally:
                self._lock.release()
        else:
            ids = None
        if ids is not None:
            return ids
        return await self.on_worker(full)
