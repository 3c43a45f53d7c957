"""Incremental detokenisation with stop strings: the text of a request's row (request.py),
shared by every decoder.

`TextTracker` turns a growing list of token ids into text, finds stop strings
that span token boundaries, and hands out streaming deltas that never have to be
taken back: text that could still become the start of a stop string, or a
partial UTF-8 character (decoded as U+FFFD), is held until it is settled.

Decoding is incremental (as vLLM's detokeniser): each token decodes a short window
that starts one settled chunk back, so the decoder sees the context it needs (a
SentencePiece word-start space, a split UTF-8 character) and a step costs O(1)
rather than decoding the whole completion again. A `decode` that is not a plain map
of token ids to text (token healing decodes through prompt context) passes
`incremental=False` and is decoded whole.

Each token's text ends where the text stood when it settled (a token that leaves a
partial character settles with the token that completes it); `delta` counts, in
`emitted_tokens`, the tokens whose text it has handed out in full, so a stream can send
each token's log-probs with its text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextTracker:
    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), incremental: bool = True
    ):
        self.decode = decode
        self.incremental = incremental
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.emitted_tokens = 0  # the first tokens whose text `delta` has handed out in full
        self._ends: list[int] = []  # end of each settled token's text
        self.stopped_by: str | None = None
        self._settled = ""  # text of ids[:read]
        self._prefix = 0  # the decode window starts here: one settled chunk of context
        self._read = 0
        self._before = ""  # decode(ids[prefix:read])

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string has appeared (the text is cut before it)."""
        self.ids.append(token)
        previous = len(self.text)
        self.text = self._decode_incrementally()
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

    def _decode_incrementally(self) -> str:
        if not self.incremental:
            text = self.decode(self.ids)
            if not text.endswith("\ufffd"):
                self._settle(len(text))
            return text
        window = self.decode(self.ids[self._prefix :])
        if not window.startswith(self._before):  # a decoder that rewrites context: start over
            self._settled, self._prefix, self._read, self._before = "", 0, 0, ""
            window = self.decode(self.ids)
        text = self._settled + window[len(self._before) :]
        if not window.endswith("\ufffd"):  # a complete character: settle this chunk
            self._settled = text
            self._prefix, self._read = self._read, len(self.ids)
            self._before = self.decode(self.ids[self._prefix : self._read])
            self._settle(len(text))
        return text

    def _settle(self, end: int) -> None:
        """The tokens not yet settled have their text complete: it ends at `end`."""
        self._ends += [end] * (len(self.ids) - len(self._ends))

    def delta(self, final: bool = False) -> str:
        """Text not yet handed out that can no longer change; `final`: all the rest. A token
        counts as handed out with the piece that completes its text (or, `final`, the last one)."""
        end = len(self.text) if final else self._settled_length()
        if final:
            self.emitted_tokens = len(self.ids)
        if end <= self.emitted:
            return ""
        piece = self.text[self.emitted : end]
        self.emitted = end
        while self.emitted_tokens < len(self._ends) and self._ends[self.emitted_tokens] <= end:
            self.emitted_tokens += 1
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
