"""N-gram prompt lookup (Saxena 2023): copy what followed the last n tokens earlier on.

Summaries, extraction, code edits and templates repeat spans of the prompt or of their
own output; a match of the sequence's last n tokens earlier in the same sequence (prompt
and generated text alike) proposes the tokens that followed it. Longer n-grams are tried
first; the most recent match wins. Costs no model call.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import SamplingParams
from .base import Proposal


class NgramProposer:
    name = "ngram"

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 2, 1)):
        self.ngram_sizes = tuple(sorted(set(ngram_sizes), reverse=True))
        self._planned: tuple | None = None  # (key, plan) of the last sequence looked at
        self.index = NgramIndex(self.ngram_sizes)

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        self._planned = None
        self.index = NgramIndex(self.ngram_sizes)

    def _plan(self, tokens: list[int]) -> tuple | None:
        """(label, sequence, where the draft starts in it) for the next draft; None: none."""
        self.index.update(tokens)
        found = self.index.match(self.ngram_sizes)
        return None if found is None else (("prompt", found[1]), tokens, found[0])

    def plan(self, tokens: list[int]) -> tuple | None:
        """``_plan``, remembered for the sequence last looked at: the engine asks for the
        label before choosing k, then for the draft (one lookup instead of two; a step's
        drafting cost 80 + 110 µs on the default model before)."""
        key = (len(tokens), tuple(tokens[-16:]))
        if self._planned is None or self._planned[0] != key:
            self._planned = (key, self._plan(tokens))
        return self._planned[1]

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        planned = self.plan(tokens)
        if planned is None:
            return Proposal.empty()
        _, sequence, start = planned
        return Proposal(torch.tensor(sequence[start : start + k], dtype=torch.int64))

    def draft_label(self, tokens: list[int]) -> tuple | None:
        """What the next draft would rest on, for a k policy that keeps acceptance per kind
        of draft: ("prompt", m), m the length of the match (1..4, 4 = four or more tokens
        agree); None when there is no draft."""
        planned = self.plan(tokens)
        return None if planned is None else planned[0]


MATCH_LABEL_CAP = 4  # match lengths draft_label tells apart (a longer match counts as this)


class NgramIndex:
    """A request's n-grams (n in ``sizes``), each at the last position where it ended with a
    token after it, kept up to date as the sequence grows: ``match`` answers what the
    function of that name finds by scanning the whole sequence, which cost about 50 µs a
    step (with the list's conversion to an array) at a few hundred tokens; a lookup here
    costs a few. A sequence that does not extend the one indexed is indexed afresh."""

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = tuple(sizes)
        self.tokens: list[int] = []
        self.last: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}

    def update(self, tokens: list[int]) -> None:
        known = len(self.tokens)
        if len(tokens) < known or tokens[:known] != self.tokens:  # another sequence
            self.tokens, self.last, known = [], {n: {} for n in self.sizes}, 0
        # the n-grams ending at e = known - 1 .. len - 2 now have a token after them
        for end in range(max(known - 1, 0), len(tokens) - 1):
            for n in self.sizes:
                if end >= n - 1:
                    self.last[n][tuple(tokens[end - n + 1 : end + 1])] = end
        self.tokens.extend(tokens[known:])

    def match(self, sizes: tuple[int, ...], cap: int = MATCH_LABEL_CAP) -> tuple[int, int] | None:
        """``match(sequence, sizes, cap)`` for the sequence last indexed (``sizes`` among
        the index's)."""
        sequence = self.tokens
        length = len(sequence)
        if length < 2:
            return None
        for n in sizes:
            if length <= n:
                continue
            end = self.last[n].get(tuple(sequence[-n:]))
            if end is not None:
                agree = n
                while agree < cap and end - agree >= 0 and sequence[end - agree] == sequence[-1 - agree]:
                    agree += 1
                return end + 1, agree
        return None


def match(sequence: np.ndarray, ngram_sizes: tuple[int, ...], cap: int = MATCH_LABEL_CAP) -> tuple[int, int] | None:
    """(where the continuation starts, how many tokens match there, up to ``cap`` or the
    n matched if larger) for the latest earlier occurrence of the sequence's last n
    tokens, for the first n of ``ngram_sizes`` that has one; None: no match."""
    length = len(sequence)
    if length < 2:
        return None
    # where an earlier n-gram can end (at least one token after it): the positions holding
    # the last token, narrowed one token further back at a time (a handful of candidates
    # instead of comparing every window: 117 -> ~20 µs a call at 300 tokens)
    ends = np.flatnonzero(sequence[:-1] == sequence[-1])
    for n in ngram_sizes:
        if length <= n:
            continue
        candidates = ends[ends >= n - 1]
        for back in range(1, n):
            if candidates.size == 0:
                break
            candidates = candidates[sequence[candidates - back] == sequence[-1 - back]]
        if candidates.size:
            end = int(candidates[-1])
            agree = n
            while agree < cap and end - agree >= 0 and sequence[end - agree] == sequence[-1 - agree]:
                agree += 1
            return end + 1, agree
    return None


def lookup(sequence: np.ndarray, ngram_sizes: tuple[int, ...], k: int) -> np.ndarray | None:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, for the first n of ``ngram_sizes`` that has one; None: no match."""
    found = match(sequence, ngram_sizes)
    return None if found is None else sequence[found[0] : found[0] + k]
