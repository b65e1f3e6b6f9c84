"""A draft model: a smaller causal LM with the target's vocabulary, drafting autoregressively.

Its KV cache follows the committed sequence. Each step it feeds whatever the cache lacks —
normally the bonus token, and after a fully accepted step also the last draft token,
which it proposed but never ran — then drafts k tokens, k-1 of them through the cache.
Rejected drafts leave its cache by a pointer rollback, as in the target.
"""

from __future__ import annotations

import logging

import torch

from ..config import SamplingParams
from ..verify.sampling import NonFiniteLogitsError, argmax_ids, logits_to_probs, sample
from .base import Proposal

logger = logging.getLogger("specdecode")


class DraftModelProposer:
    name = "draft"
    samples_drafts = True  # when sampling, drafts are drawn and carry their distribution (base.Proposer)

    def __init__(self, runtime, vocab_size: int | None = None):
        """``vocab_size``: the target's, where the two models share a tokenizer but pad
        their embeddings to different sizes (Qwen2.5: 151,936 rows up to 7B, 152,064 from
        14B). The draft's logits are cut or padded with -inf to it, so every draft is a
        target id and its probabilities are those it was drawn from."""
        self.runtime = runtime
        self.vocab_size = runtime.vocab_size if vocab_size is None else vocab_size
        self.cached: list[int] = []  # tokens whose keys and values are in the draft cache
        self.committed = 0  # length of the committed sequence at the previous step
        self.readable = 0  # how much of the sequence holds only ids the draft's embedding has

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        self.runtime.reset(capacity)
        self.cached, self.committed, self.readable = [], 0, 0

    def _sync(self, tokens: list[int]) -> torch.Tensor:
        """Roll the cache back to its longest prefix shared with ``tokens`` (keeping at
        least the last token to feed), feed the rest, return logits after the last."""
        limit = min(len(self.cached), len(tokens) - 1)
        common = min(self.committed, limit)  # committed tokens never change
        while common < limit and self.cached[common] == tokens[common]:
            common += 1
        self.runtime.rollback(common)
        self.cached, self.committed = list(tokens), len(tokens)
        return self._fit(self.runtime(torch.tensor([tokens[common:]]), last_only=True)[0, -1])

    def _can_read(self, tokens: list[int]) -> bool:
        """Whether every id of ``tokens`` has a row in the draft's embedding. A target padded
        past the draft may emit a padding id (a random one does); the draft then drafts no
        more in this request (found in review: an IndexError)."""
        if self.readable >= 0:
            rows = self.runtime.vocab_size
            if any(not 0 <= token < rows for token in tokens[self.readable:]):
                self.readable = -1
            else:
                self.readable = len(tokens)
        return self.readable >= 0

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (padding rows past the shorter)."""
        if logits.shape[-1] > self.vocab_size:
            return logits[..., :self.vocab_size]
        if logits.shape[-1] < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        return logits

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        # a draft model with a shorter context than the target's drafts what fits its cache
        # (the sequence and k - 1 drafts), then nothing (it had failed the whole request)
        k = min(k, self.runtime.max_positions - len(tokens) + 1)
        if k <= 0 or not self._can_read(tokens):
            return Proposal.empty()
        logits = self._sync(tokens)  # [V]
        draft_ids, draft_probs = [], []
        for position in range(k):
            try:
                if params.greedy:
                    token = int(argmax_ids(logits))
                else:
                    probs = logits_to_probs(logits, params)
                    token = int(sample(probs, generator))
            except NonFiniteLogitsError:
                # the draft overflowed: it drafts no more in this request, which goes on as the
                # target decodes it (found in review: greedy drafted the NaN's index, and a
                # sampled request failed, blaming the model, over a proposal)
                logger.warning("the draft model's logits hold a NaN or an infinity; it drafts no more in this "
                               "request (try --dtype fp32 for the draft)")
                self.readable = -1
                break
            if not params.greedy:
                draft_probs.append(probs)
            draft_ids.append(token)
            if position < k - 1:
                logits = self._fit(self.runtime(torch.tensor([[token]]))[0, -1])
                self.cached.append(token)
        if not draft_ids:
            return Proposal.empty()
        return Proposal(
            torch.tensor(draft_ids, dtype=torch.int64),
            torch.stack(draft_probs) if draft_probs else None,
        )
