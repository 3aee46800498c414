"""Stop strings over streamed text: emit what is safe, hold back what may begin a stop string."""

from __future__ import annotations


class StopStringMatcher:
    """Feeds on streamed text segments and says what may be shown and whether a stop string appeared.

    Text that could be the beginning of a stop string is held back until the next segment settles it,
    so a stop string is never partially printed.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, segment: str) -> str:
        """Add ``segment``; return the text now safe to emit (stops once a stop string is seen)."""
        if self.stopped:
            return ""
        if not self.stops:
            return segment
        text = self._pending + segment
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        hold = self._held_suffix(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of generation: the held-back text (it never completed a stop string)."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
