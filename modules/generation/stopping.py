"""Stop strings with hold-back of partial matches, and incremental UTF-8 decoding of token bytes."""

from __future__ import annotations

import codecs


class Utf8Stream:
    """Decode token bytes as they come; a character split across tokens is held until it is complete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        """Text made complete by ``piece``."""
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """Whatever is left; an incomplete character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Find stop strings in streamed text, holding back any tail that could still become one.

    ``feed`` returns ``(text safe to show, stopped)``. Once stopped, the text before the stop string has
    been returned and the stop string itself never is.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return what can be released now and whether a stop string was found."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self._pending + text
        # The stop string completed first wins (ties: the one starting first), as if the text came char by
        # char, so the result never depends on how the text was cut into tokens.
        first: tuple[int, int, str] | None = None
        for stop in self.stops:
            pos = buffer.find(stop)
            if pos != -1 and (first is None or (pos + len(stop), pos) < first[:2]):
                first = (pos + len(stop), pos, stop)
        if first is not None:
            self.stopped, self.matched, self._pending = True, first[2], ""
            return buffer[: first[1]], True
        hold = self._partial_suffix(buffer)
        self._pending = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """Release held-back text at the end of generation (it never became a stop string)."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def finish(self, text: str = "") -> str:
        """Feed the last ``text`` (e.g. a flushed UTF-8 remainder) and release everything still held back."""
        shown, stopped = self.feed(text)
        return shown if stopped else shown + self.flush()

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
