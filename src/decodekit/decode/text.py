"""Incremental detokenisation with stop strings, shared by every decoder.

`TextTracker` turns a growing list of token ids into text, finds stop strings
that span token boundaries, and hands out streaming deltas that never have to be
taken back: text that could still become the start of a stop string, or a
partial UTF-8 character (decoded as U+FFFD), is held until it is settled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextTracker:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped_by: str | None = None

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string has appeared (the text is cut before it)."""
        self.ids.append(token)
        previous = len(self.text)
        self.text = self.decode(self.ids)
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, min(previous, len(self.text)) - longest + 1)
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, self.stopped_by = min(hits)
        self.text = self.text[:index]
        return True

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out that can no longer change."""
        end = len(self.text) if final else self._settled_length()
        if end <= self.emitted:
            return ""
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    def _settled_length(self) -> int:
        end = len(self.text)
        while end > 0 and self.text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, end), hold, -1):
                if self.text[end - k : end] == s[:k]:
                    hold = k
                    break
        return max(end - hold, self.emitted)
