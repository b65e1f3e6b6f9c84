"""Incremental detokenisation with stop strings.

The engine appends tokens one at a time; ``TextTracker`` says when a stop string has
appeared (the text is cut before it) and how much text is safe to stream: never a
trailing partial UTF-8 character, never a suffix that could still become a stop string.
"""

from __future__ import annotations


class TextTracker:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append a token; True if a stop string now appears (text is cut before it)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        self.text = text[: min(hits)] if hits else text
        self.stopped = bool(hits)
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """Text not yet streamed that no later token can change."""
        end = len(self.text)
        if not final:
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1  # an incomplete multi-byte character
            for stop in self.stop:  # hold back a tail that may be the start of a stop string
                for length in range(min(len(stop) - 1, end - self.emitted), 0, -1):
                    if self.text[end - length : end] == stop[:length]:
                        end -= length
                        break
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece
