"""One choice's token-to-text stream: streaming detokenizer, stop strings, EOS and the token limit.

Follows ``DirectEngine.generate`` rule for rule, so a choice served by the batch engine ends on the same
token with the same text as the direct engine would give.
"""

from __future__ import annotations

from typing import Any

from mlxkv.engine.stops import StopStringMatcher


class TextStream:
    """Turns a choice's tokens into safe-to-show text and says when the choice is finished.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``None``: tokens only, no text and no EOS).
        stop: stop strings (never emitted, even in part).
        max_tokens: the choice finishes with ``"length"`` at this many tokens.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], max_tokens: int):
        assert max_tokens >= 1, max_tokens
        self._detok = tokenizer.detokenizer if tokenizer is not None else None  # a fresh copy per call
        self._eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        self._stops = StopStringMatcher(stop)
        self.max_tokens = max_tokens
        self.count = 0

    def feed(self, token: int) -> tuple[str, str | None]:
        """Add the next generated token; return (new text, finish reason or ``None`` while running)."""
        self.count += 1
        if self._detok is None:
            return "", ("length" if self.count >= self.max_tokens else None)
        stops, detok = self._stops, self._detok
        if token in self._eos:
            detok.finalize()
            return stops.feed(detok.last_segment) + stops.flush(), "stop"
        detok.add_token(token)
        text = stops.feed(detok.last_segment)
        if stops.stopped:
            return text, "stop"
        if self.count >= self.max_tokens:
            detok.finalize()
            text += stops.feed(detok.last_segment)
            if stops.stopped:
                return text, "stop"
            return text + stops.flush(), "length"
        return text, None
