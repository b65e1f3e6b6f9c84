"""The EAGLE drafter: a trained head (``eagle_head``) drafting from the target's features.

The engine tells the drafter, after prefill and after every step, the target's captured
states for the tokens it has just committed (``observe``). For committed position p the
head keeps one cache entry made of the target's feature at p and the embedding of token
p+1, so with n committed tokens it holds entries 0..n-2 and the last one's output already
predicts token n: the first draft costs no head pass at ``propose`` time. Deeper drafts
feed the head's own output g in place of the target's feature; those entries are dropped
again (the cache rolls back to the committed entries) before the next ``observe``.

A target token outside the head's draft vocabulary is never drafted; sampled drafts carry
their distribution mapped onto the full vocabulary, so rejection sampling stays exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import SamplingParams
from ..verify.sampling import logits_to_probs, sample
from .base import Proposal
from .eagle_head import EagleHead


class EagleProposer:
    name = "eagle"

    def __init__(self, head: EagleHead, embed_rows, kernels: bool = True):
        """``embed_rows(ids [T]) -> [T, H]``: the target's embedding (the head has none).
        ``kernels``: draft with Q8_0 projections on the CPU kernels where they load."""
        self.head = head.eval().requires_grad_(False)
        if kernels:
            head.use_kernels()
        self.embed_rows = embed_rows
        self.capture = head.config.capture_layers
        self.k_cache = self.v_cache = None
        self.length = 0  # committed entries in the head's cache
        self.last_logits: torch.Tensor | None = None  # [N] from the last committed entry
        self.last_g: torch.Tensor | None = None  # [H]

    @property
    def feature_width(self) -> int:
        """Width of the target features ``observe`` takes (captured layers x hidden size)."""
        return len(self.capture) * self.head.config.hidden_size

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        c = self.head.config
        shape = (c.num_kv_heads, capacity, c.head_dim)
        if self.k_cache is None or self.k_cache.shape[1] < capacity:
            self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)
        self.length, self.last_logits, self.last_g = 0, None, None

    @torch.inference_mode()
    def _run(self, hidden: torch.Tensor, token_ids: list[int], start: int) -> torch.Tensor:
        """Append entries at ``start..``: fused features ``hidden`` [T, H] with the embeddings
        of ``token_ids``; attend causally over the cache; return the outputs g [T, H]."""
        head, c = self.head, self.head.config
        count = hidden.shape[0]
        embeds = self.embed_rows(torch.tensor(token_ids)).float()
        positions = torch.arange(start, start + count)
        q, k, v = head.qkv(embeds[None], hidden[None], positions)
        end = start + count
        self.k_cache[:, start:end] = k[0]
        self.v_cache[:, start:end] = v[0]
        mask = None
        if count > 1:
            mask = torch.ones(count, end, dtype=torch.bool)
            mask[:, start:] = torch.ones(count, count, dtype=torch.bool).tril()
        attn = F.scaled_dot_product_attention(q, self.k_cache[None, :, :end], self.v_cache[None, :, :end],
                                              attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim),
                                              enable_gqa=c.num_heads != c.num_kv_heads)
        return head.finish(hidden[None], attn)[0]

    @torch.inference_mode()
    def observe(self, start: int, features: torch.Tensor, tokens: list[int]) -> None:
        """The target's captured states [m, 3H] for committed positions ``start..start+m-1``
        of ``tokens`` (the committed sequence, which holds token start+m)."""
        if features.shape[0] == 0:
            return
        if start > self.length:  # a gap (e.g. the engine skipped us): entries would be misplaced
            self.length, self.last_logits, self.last_g = 0, None, None
            return
        hidden = self.head.project("fc", features.float())
        g = self._run(hidden, tokens[start + 1 : start + 1 + features.shape[0]], start)
        self.length = start + features.shape[0]
        self.last_g = g[-1]
        self.last_logits = self.head.logits(g[-1])

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        if self.last_logits is None or self.length != len(tokens) - 1 or k < 1:
            return Proposal.empty()
        head, vocab = self.head, self.head.config.target_vocab_size
        logits, g = self.last_logits, self.last_g
        draft_ids, draft_probs = [], []
        for depth in range(k):
            if params.greedy:
                token = int(head.d2t[logits.argmax()])
            else:
                probs = logits_to_probs(logits, params)
                index = int(sample(probs, generator))
                token = int(head.d2t[index])
                draft_probs.append(torch.zeros(vocab).index_copy_(0, head.d2t, probs))
            draft_ids.append(token)
            if depth < k - 1:
                g = self._run(g[None], [token], self.length + depth)[0]
                logits = head.logits(g)
        return Proposal(
            torch.tensor(draft_ids, dtype=torch.int64),
            torch.stack(draft_probs) if draft_probs else None,
        )
