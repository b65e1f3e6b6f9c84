"""Suffix lookup: prompt lookup, then a store of the target's own earlier answers.

Prompt lookup only drafts when the sequence repeats itself. What the target writes also
repeats across requests: its phrasing ("Here is a", "I hope this helps"), the shape of a
list, a JSON object or a code block. A *token store* holds the target's answers to many
prompts; when the sequence's last n tokens (n = 4 down to 2) occur in it, the draft
follows the most frequent continuation there, one token at a time. This is the retrieval
half of REST (He et al. 2023) and of SuffixDecoding (Oliaro et al. 2024), which keep a
datastore or a global suffix tree of earlier outputs next to the request's own text.

Order of the candidates: the request's own n-grams of length >= 2 first (a repeat of the
request's text is the best evidence), then the store, then the request's 1-grams. The
store is an index, not a model: drafting costs a few binary searches and small numpy ops.
Built by ``specdecode train store`` from ``specdecode train data``'s answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from ..config import ConfigError, SamplingParams, is_count
from ..models.loading import shared_mode
from .base import Proposal
from .ngram import NgramProposer, lookup

STORE_FILE = "tokens.safetensors"
MAX_SAMPLE = 1024  # candidate positions a continuation is counted over (evenly spread over the matches)


class TokenStore:
    """Every position of a token corpus, sorted by the (up to ``max_n``) tokens starting
    there, so the positions that follow any n-gram (n <= max_n) form one contiguous range.

    Documents are joined with a separator id that no real token has (the ``2**bits - 1``
    of the packed keys), so no n-gram or continuation crosses from one into the next.
    """

    def __init__(self, documents: list[list[int]] | np.ndarray, vocab_size: int):
        if vocab_size < 1:
            raise ConfigError(f"a token store needs a vocabulary size >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bits = int(vocab_size).bit_length()  # 2**bits - 1 >= vocab_size: free for the separator
        self.separator = (1 << self.bits) - 1
        self.max_n = min(4, 64 // self.bits)
        if isinstance(documents, np.ndarray):
            tokens = documents.astype(np.int64)
        else:
            parts = []
            for document in documents:
                ids = np.asarray(document, dtype=np.int64)
                if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):  # the separator's id too
                    raise ConfigError(f"token store holds ids outside [0, {vocab_size}): "
                                      f"{int(ids.min())}..{int(ids.max())}")
                parts.append(ids)
                parts.append(np.array([self.separator], dtype=np.int64))
            tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        real = tokens[tokens != self.separator]
        if real.size and (real.min() < 0 or real.max() >= vocab_size):
            raise ConfigError(f"token store holds ids outside [0, {vocab_size}): {int(real.min())}..{int(real.max())}")
        self.tokens = tokens
        padded = np.concatenate([tokens, np.full(self.max_n, self.separator, dtype=np.int64)])
        keys = np.zeros(tokens.size, dtype=np.uint64)
        for j in range(self.max_n):
            keys = (keys << np.uint64(self.bits)) | padded[j : j + tokens.size].astype(np.uint64)
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def __len__(self) -> int:
        """Positions, one separator per document included."""
        return int(self.tokens.size)

    @property
    def answer_tokens(self) -> int:
        """The documents' own tokens (found in review: reports counted a separator per answer)."""
        return int((self.tokens != self.separator).sum())

    def _pack(self, pattern, fill: int) -> np.uint64:
        key = 0
        for j in range(self.max_n):
            key = (key << self.bits) | (int(pattern[j]) if j < len(pattern) else fill)
        return np.uint64(key)

    def _range(self, pattern) -> tuple[int, int]:
        """The slice of ``order`` whose keys start with ``pattern``."""
        low = np.searchsorted(self.keys, self._pack(pattern, 0), side="left")
        high = np.searchsorted(self.keys, self._pack(pattern, self.separator), side="right")
        return int(low), int(high)

    def _follow(self, low: int, high: int, n: int, sample: int | None) -> np.ndarray:
        """The positions after the n-grams of ``order[low:high]``; with ``sample``, at most
        that many, evenly spread (picked before any array of all of them is made: a common
        2-gram has 100,000 occurrences)."""
        if sample is not None and high - low > sample:
            return self.order[low + np.linspace(0, high - low - 1, sample).astype(np.int64)] + n
        return self.order[low:high] + n

    def matches(self, pattern, sample: int | None = None) -> np.ndarray:
        """Positions (in the store) right after each occurrence of ``pattern`` (1 <= len <=
        max_n); with ``sample``, at most that many, evenly spread over them."""
        return self._follow(*self._range(pattern), len(pattern), sample)

    def longest_match(self, context: list[int], min_n: int) -> tuple[int, int, int]:
        """(n, low, high): the longest suffix of ``context`` (max_n down to min_n tokens)
        the store holds with a token after it, and its slice of ``order``; n = 0: none. A
        suffix whose every occurrence ends a document continues nothing: a shorter one is
        tried (it was taken, and the step drafted from 1-grams under the store's label)."""
        for n in range(min(self.max_n, len(context)), min_n - 1, -1):
            pattern = context[-n:]
            if all(0 <= t < self.vocab_size for t in pattern):
                low, high = self._range(pattern)
                if high > low:
                    after = self._follow(low, high, n, MAX_SAMPLE)
                    after = after[after < self.tokens.size]
                    if after.size and (self.tokens[after] != self.separator).any():
                        return n, low, high
        return 0, 0, 0

    def longest(self, context: list[int], min_n: int = 2) -> int:
        """The longest suffix of ``context`` (max_n down to min_n tokens) the store holds; 0: none."""
        return self.longest_match(context, min_n)[0]

    def continuation(self, context: list[int], k: int, min_n: int = 2,
                     found: tuple[int, int, int] | None = None) -> list[int]:
        """Up to ``k`` tokens to follow ``context``: the longest suffix of the context
        (max_n down to min_n) found in the store, then at each step the token that most
        often comes next among the occurrences still agreeing with the tokens chosen so far
        (ties: the smaller id). ``found``: that suffix's (n, low, high) from ``longest_match``,
        where the caller has looked it up already."""
        if k < 1:
            return []
        n, low, high = self.longest_match(context, min_n) if found is None else found
        if n == 0:
            return []
        follow = self._follow(low, high, n, MAX_SAMPLE)
        draft = []
        for j in range(k):
            at = follow + j
            at = at[at < self.tokens.size]
            if at.size == 0:
                break
            values = self.tokens[at]
            real = values != self.separator
            if not real.any():
                break
            ids, counts = np.unique(values[real], return_counts=True)
            best = int(np.argmax(counts))
            draft.append(int(ids[best]))
            follow = at[values == ids[best]] - j
        return draft

    def save(self, directory: Path, meta: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if self.separator < 1 << 16 else np.int32
        save_file({"tokens": self.tokens.astype(dtype)}, str(directory / STORE_FILE),
                  metadata={"vocab_size": str(self.vocab_size)})
        shared_mode(directory / STORE_FILE, 0o666)  # safetensors writes 0600
        (directory / "store.json").write_text(json.dumps({"vocab_size": self.vocab_size, "tokens": self.answer_tokens,
                                                           **meta}, indent=1) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "TokenStore":
        path = Path(directory) / STORE_FILE
        if not path.is_file():
            raise ConfigError(f"token store not found: {path} does not exist (build one with `specdecode train store`)")
        # a damaged store ended in a traceback from json or safetensors (found in review)
        info_path = Path(directory) / "store.json"
        if not info_path.is_file():
            raise ConfigError(f"token store incomplete: {info_path} does not exist (rebuild it with `specdecode train store`)")
        try:
            vocab_size = json.loads(info_path.read_text())["vocab_size"]
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"{info_path} is not a token store's description (valid JSON with vocab_size): "
                              f"{error}") from None
        if not is_count(vocab_size):
            raise ConfigError(f"{info_path}: vocab_size must be an integer, got {vocab_size!r}")
        try:
            tokens = load_file(str(path))["tokens"]
        except Exception as error:  # safetensors' own error type: a truncated or corrupt file
            raise ConfigError(f"{path} is not a readable token store ({error})") from None
        return cls(tokens, vocab_size)


class SuffixProposer(NgramProposer):
    """Prompt lookup over the request's n-grams of length >= 2, then the token store
    (``store``; None: prompt lookup alone), then the request's shorter n-grams. Drafts
    chains; the adaptive k policy sizes them from the acceptance it measures."""

    name = "suffix"

    def __init__(self, store: TokenStore | None, ngram_sizes: tuple[int, ...] = (3, 2, 1), min_store_n: int = 2):
        super().__init__(ngram_sizes)
        self.store, self.min_store_n = store, min_store_n
        # the request's n-grams tried before the store, and after it
        self.long_sizes = tuple(n for n in self.ngram_sizes if n >= min_store_n)
        self.short_sizes = tuple(n for n in self.ngram_sizes if n < min_store_n)

    def _plan(self, tokens: list[int]) -> tuple | None:
        """In propose's order, (label, sequence, start) as NgramProposer's: ("prompt", m)
        for the request's own n-grams of 2+ tokens, ("store", n) for the store's longest
        match of the last n tokens (sequence None; in place of the start, that match's
        (n, low, high) in the store), ("prompt", 1) for a 1-gram."""
        self.index.update(tokens)
        found = self.index.match(self.long_sizes)
        if found is None and self.store is not None:
            longest = self.store.longest_match(tokens[-self.store.max_n:], self.min_store_n)
            if longest[0]:  # its range too: propose drafts from it without a second lookup
                return ("store", longest[0]), None, longest
        if found is None:
            found = self.index.match(self.short_sizes)
        return None if found is None else (("prompt", found[1]), tokens, found[0])

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        planned = self.plan(tokens)
        if planned is None or planned[0][0] != "store":  # the request's own n-grams
            return super().propose(tokens, k, params, generator)
        longest = planned[2]
        draft = self.store.continuation(tokens, k, found=longest)
        if draft:
            return Proposal(torch.tensor(draft, dtype=torch.int64))
        # every occurrence of the match ends a document: the request's 1-grams
        found = lookup(np.asarray(tokens, dtype=np.int64), self.short_sizes, k)
        return Proposal.empty() if found is None else Proposal(torch.from_numpy(found.copy()))
