"""Stop strings: output text cut before the first of them, as it streams. No I/O here.

Workers stop on token ids only; the HTTP front (``router/openai_http.py``) ends a request whose
text reaches one of the client's stop strings, and sends the text before it. A stop string may
arrive split over several chunks, so the tail of the text that could begin one is held back
until the next chunk settles it::

    stop "END", chunks "abc E" "N" "Dxyz"  ->  sent "abc ", "", ""  (stopped; "xyz" never sent)
    stop "END", chunks "abc E" "Nd"        ->  sent "abc ", "ENd"
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Cuts a stream of text before the first occurrence of any of ``stops``."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string is empty")
        self.stops = tuple(stops)
        self.stopped = False  # a stop string was found: nothing more is sent
        self._held = ""  # a tail that may be the start of a stop string

    def push(self, text: str) -> str:
        """The text that may be sent now: what ``text`` adds, cut before a stop string (then
        ``stopped`` is set), less a tail that may begin one."""
        if self.stopped:
            return ""
        text = self._held + text
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped = True
            self._held = ""
            return text[: min(found)]
        num_held = max(_num_prefix_chars(text, stop) for stop in self.stops)
        self._held = text[len(text) - num_held :] if num_held else ""
        return text[: len(text) - num_held]

    def flush(self) -> str:
        """The text still held back once the stream has ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _num_prefix_chars(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
