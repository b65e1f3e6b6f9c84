"""Incremental detokenisation with stop strings.

The engine appends tokens one at a time; ``TextTracker`` turns them into text without
decoding the whole output again per token: it keeps a prefix offset and a read offset
into the token ids (as vLLM's detokenizer does) and decodes only the tokens from the
prefix offset on, taking the part past the already-read tokens as new text. A token that
ends inside a multi-byte character (byte-level BPE, or a byte-fallback tokenizer) yields
no text until the character is complete.

The first new tokens are decoded after the last few tokens of the prompt (``context``),
as vLLM does: a SentencePiece decoder (Llama 2, Mistral) strips the leading space of the
first token it decodes, so a completion decoded alone would lose the space before its
first word. (A prompt given as token ids that ends inside a multi-byte character: the bytes
that complete it come out as the rest of that character, not shown, as in vLLM.)

Stop strings are searched in the text around each new piece, so a stop that spans token
boundaries is found on the token that completes it. A stop string that is one special
token of the tokenizer (``<|im_end|>``), which decoding with special tokens skipped never
shows, is matched on the token id as well as in the text. The text is cut before a stop. ``delta`` says how much
text is safe to stream: never a trailing partial character, never a suffix that could
still become a stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 5  # prompt tokens decoded before the first new ones (vLLM's initial offset)


def not_utf8(text: str) -> str | None:
    """Where ``text`` cannot be written as UTF-8, which tokenizers need: a lone surrogate,
    from bytes that were not UTF-8 on a command line (shown as that byte) or a JSON
    ``\\ud800`` escape (shown as its code point), named with its character index; else None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        char = text[error.start]
        try:
            shown = f"byte {char.encode('utf-8', 'surrogateescape')!r}"
        except UnicodeEncodeError:
            shown = f"lone surrogate U+{ord(char):04X}"
        return f"{shown} at character {error.start}"


def decode(tokenizer, ids, skip_special_tokens: bool = True) -> str:
    """``ids`` as text, without the tokenizer's clean-up of spaces (" ." -> "."), which
    Llama 3's tokenizers turn on: text decoded piece by piece must equal the whole decoded
    at once, and the clean-up shortened a longer decode, so the tracker dropped pieces
    (punctuation vanished, and stops holding it never fired; found in review)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


class TextTracker:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), context: list[int] | tuple[int, ...] = ()):
        """``context``: the prompt's token ids (its last ``CONTEXT_TOKENS`` are decoded
        with the first new tokens and never shown)."""
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer = tokenizer
        self.special_stops: dict[int, str] = {}
        if tokenizer is not None:
            specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
            specials.update(t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
                            if getattr(t, "special", False))
            for string in stop:
                if string in specials:
                    self.special_stops[tokenizer.convert_tokens_to_ids(string)] = string
        self.stop = tuple(stop)  # a special token's text spelled by ordinary tokens stops too
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = list(context[-CONTEXT_TOKENS:]) if context else []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the text (vLLM's stop_reason)
        self.prefix_offset = 0  # tokens before it are never decoded again
        self.read_offset = len(self.token_ids)  # tokens before it have produced their text

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    def _texts(self, end: int) -> tuple[str, int]:
        """(the text of the tokens from the prefix offset up to ``end``, where the new text
        starts in it)."""
        ids = self.token_ids
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        full = self._decode(ids[self.prefix_offset:end])
        if prefix.endswith(REPLACEMENT) and not full.startswith(prefix):
            # the prompt ended inside a character and the new tokens completed it: a
            # byte-fallback decoder showed each of its bytes as a replacement character, so
            # the completed character is skipped as one (found in review: the new text
            # lost a character per extra byte, and a stop in them never fired)
            return full, len(prefix.rstrip(REPLACEMENT)) + 1
        return full, len(prefix)

    def _read(self, final: bool = False, end: int | None = None) -> str:
        """Text of the tokens past the read offset (up to ``end``, default all), once it is
        complete (or ``final``)."""
        end = len(self.token_ids) if end is None else end
        full, start = self._texts(end)
        if len(full) <= start or (full.endswith(REPLACEMENT) and not final):
            return ""  # nothing new yet, or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, end
        return full[start:]

    def _complete_stop(self) -> bool:
        """Whether the complete part of text still held back (its last token ends inside a
        character) already completes a stop string; then it is taken, cut before the stop.
        Found in review: a stop ending in a space that shares its token with the first byte
        of an accented character was seen one token late, and that token was kept."""
        full, start = self._texts(len(self.token_ids))
        complete = full.rstrip(REPLACEMENT)[start:]
        search_from = max(0, len(self.text) - self.longest_stop + 1)
        tail = self.text[search_from:] + complete
        return bool(complete) and any(stop in tail for stop in self.stop) and self._append(complete)

    def add(self, token_id: int) -> bool:
        """Append a token; True if a stop string now appears (text is cut before it)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None or self.stopped:
            return self.stopped
        if token_id in self.special_stops:
            # the text before it, as an EOS there would leave it (a character left
            # incomplete shows as a full decode shows it; found in review: it was dropped)
            if not self._append(self._read(final=True, end=len(self.token_ids) - 1)):
                self.stopped, self.stop_reason = True, self.special_stops[token_id]
            return True
        piece = self._read()
        if not piece and self.stop and self.read_offset < len(self.token_ids):
            return self._complete_stop()
        return self._append(piece)

    @property
    def watches_stops(self) -> bool:
        """Whether a token can end the text (stop strings): then tokens are added one at a
        time, so the one that completes a stop is known."""
        return bool(self.stop or self.special_stops)

    def add_many(self, token_ids: list[int]) -> None:
        """Append a step's tokens with one decode (two, as ``add`` does per token: a
        speculative step adds several). Only without stop strings (``watches_stops``)."""
        if self.watches_stops:
            raise ValueError("add_many: a stop string needs the tokens one at a time (add)")
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if self.tokenizer is None or not token_ids:
            return
        piece = self._read()
        if not piece and len(token_ids) > 1:
            # the step ends inside a character (or adds no text): read it a token at a time,
            # so the characters it completes before that show now, as with ``add``
            for end in range(start + 1, len(self.token_ids) + 1):
                self._append(self._read(end=end))
            return
        self._append(piece)

    def _append(self, piece: str) -> bool:
        if not piece:
            return False
        search_from = max(0, len(self.text) - self.longest_stop + 1)
        self.text += piece
        hits = [(i, stop) for stop in self.stop if (i := self.text.find(stop, search_from)) >= 0]
        if hits:
            at, self.stop_reason = min(hits, key=lambda hit: hit[0])  # the earliest; a tie, the first listed
            self.text = self.text[:at]
            self.stopped = True
        return self.stopped

    def finish(self) -> bool:
        """At the end of generation: the text of trailing tokens that never completed a
        character (shown with replacement characters, as a full decode would). True if
        a stop string appears in it."""
        if self.tokenizer is None or self.stopped or self.read_offset >= len(self.token_ids):
            return self.stopped
        return self._append(self._read(final=True))

    def delta(self, final: bool = False) -> str:
        """Text not yet streamed that no later token can change."""
        if final:
            self.finish()
        end = len(self.text)
        if not final:
            while end > self.emitted and self.text[end - 1] == REPLACEMENT:
                end -= 1  # an incomplete multi-byte character
            for stop in self.stop:  # hold back a tail that may be the start of a stop string
                for length in range(min(len(stop) - 1, end - self.emitted), 0, -1):
                    if self.text[end - length : end] == stop[:length]:
                        end -= length
                        break
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece
