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

from ..config import SamplingParams, SpecDecodeError
from ..verify.tree import Tree
from ..verify.sampling import logits_to_probs, sample
from .base import Proposal, TreeProposal
from .eagle_head import EagleHead


MAX_TREE_DEPTH = 8  # head passes per tree step at most


class EagleProposer:
    name = "eagle"
    samples_drafts = True  # sampled chains carry their distribution (trees are top-k point masses)

    def __init__(self, head: EagleHead, embed_rows, kernels: bool = True, tree_width: int = 1):
        """``embed_rows(ids [T]) -> [T, H]``: the target's embedding (the head has none), on
        the head's device.
        ``kernels``: draft with Q8_0 projections on the CPU kernels where they load.
        ``tree_width``: 1 drafts chains; K > 1 drafts EAGLE-2 dynamic trees, expanding the
        top-K children of the top-K frontier nodes per depth (``propose_tree``)."""
        if tree_width < 1:
            raise SpecDecodeError(f"tree width must be >= 1, got {tree_width}")
        self.head = head.eval().requires_grad_(False)
        self.device = head.d2t.device  # the head's (the factory puts it on the target's device)
        self.tree_width = tree_width
        self.layer = None  # the decoder layer as one kernel call (KernelHeadLayer), where it loads
        self.kernels = kernels and self.device.type == "cpu" and head.use_kernels()  # packed projections
        if self.kernels:
            from ..models.cpu_runtime import KernelHeadLayer

            try:
                self.layer = KernelHeadLayer(head, head.fast)
            except SpecDecodeError:
                self.layer = None
        self.embed_rows = embed_rows
        self.capture = head.config.capture_layers
        self.k_cache = self.v_cache = None
        self.length = 0  # committed entries in the head's cache
        self.last_logits: torch.Tensor | None = None  # [N] from the last committed entry
        self.last_g: torch.Tensor | None = None  # [H]
        self.pending: list[tuple[torch.Tensor, list[int]]] = []  # observed rows not yet run
        self.pending_start = 0

    @property
    def d2t(self) -> list[int]:
        """Draft -> target ids as a list (indexing the tensor per drafted token cost a device
        round trip each on a GPU, about 40 a step for a tree), the head's current one: a
        copy taken at construction kept mapping through a vocabulary set afterwards."""
        return self.head.d2t_list

    @property
    def drafts_trees(self) -> bool:
        """Tree steps (``propose_tree``) rather than chains: a tree width above 1."""
        return self.tree_width > 1

    @property
    def feature_width(self) -> int:
        """Width of the target features ``observe`` takes (captured layers x hidden size)."""
        return len(self.capture) * self.head.config.hidden_size

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        """``capacity``: the most tokens the sequence may hold. A tree step also writes its
        expanded nodes after the committed entries (``propose_tree``: up to ``tree_width``
        per pass, ``MAX_TREE_DEPTH - 1`` passes), so the head's cache holds those too."""
        c = self.head.config
        if self.drafts_trees:
            capacity += self.tree_width * (MAX_TREE_DEPTH - 1)
        shape = (c.num_kv_heads, capacity, c.head_dim)
        if self.k_cache is None or self.k_cache.shape[1] < capacity:
            self.k_cache = torch.zeros(shape, device=self.device)
            self.v_cache = torch.zeros(shape, device=self.device)
            if self.layer is not None:
                self.layer.bind(self.k_cache, self.v_cache)
        self.length, self.last_logits, self.last_g = 0, None, None
        self.pending, self.pending_start = [], 0

    @torch.inference_mode()
    def _run(self, hidden: torch.Tensor, token_ids: list[int], start: int, positions: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append entries at slots ``start..``: fused features ``hidden`` [T, H] with the
        embeddings of ``token_ids``, at ``positions`` (default: the slots); attend over the
        cache causally, or by ``mask`` [T, start + T]; return the outputs g [T, H]."""
        head, c = self.head, self.head.config
        count = hidden.shape[0]
        embeds = self.embed_rows(torch.tensor(token_ids, device=self.device)).float()
        if self.layer is not None:
            return self.layer(embeds, hidden, start, positions, mask)
        if positions is None:
            positions = torch.arange(start, start + count, device=self.device)
        q, k, v = head.qkv(embeds[None], hidden[None], positions, fast=self.kernels)
        end = start + count
        self.k_cache[:, start:end] = k[0]
        self.v_cache[:, start:end] = v[0]
        if mask is None and count > 1:
            mask = torch.ones(count, end, dtype=torch.bool, device=self.device)
            mask[:, start:] = torch.ones(count, count, dtype=torch.bool, device=self.device).tril()
        attn = F.scaled_dot_product_attention(q, self.k_cache[None, :, :end], self.v_cache[None, :, :end],
                                              attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim),
                                              enable_gqa=c.num_heads != c.num_kv_heads)
        return head.finish(hidden[None], attn, fast=self.kernels)[0]

    def observe(self, start: int, features: torch.Tensor, tokens: list[int]) -> None:
        """The target's captured states [m, 3H] for committed positions ``start..start+m-1``
        of ``tokens`` (the committed sequence, which holds token start+m).

        Lazy: the rows wait until the next proposal, so plain steps (k = 0) cost no head
        pass, and the head runs once over everything observed since."""
        if features.shape[0] == 0:
            return
        pending = sum(f.shape[0] for f, _ in self.pending)
        if self.pending and start != self.pending_start + pending:
            self._flush()
        if not self.pending:
            self.pending_start = start
        # a copy of the rows: the batched engine hands a view of the step's whole capture
        # (every row's draft positions), which a row that drafted nothing for many steps kept
        # alive, step after step (found in review: 34x its own states' bytes)
        self.pending.append((features.clone(), tokens[start + 1 : start + 1 + features.shape[0]]))

    def _flush(self) -> None:
        if not self.pending:
            return
        features = torch.cat([f for f, _ in self.pending])
        token_ids = [t for _, ids in self.pending for t in ids]
        start, self.pending = self.pending_start, []
        self._observe_now(start, features, token_ids)

    @torch.inference_mode()
    def _observe_now(self, start: int, features: torch.Tensor, token_ids: list[int]) -> None:
        if start > self.length:  # a gap (e.g. the engine skipped us): entries would be misplaced
            self.length, self.last_logits, self.last_g = 0, None, None
            return
        hidden = self.head.project("fc", features.to(self.device).float(), fast=self.kernels)
        g = self._run(hidden, token_ids, start)
        self.length = start + features.shape[0]
        self.last_g = g[-1]
        self.last_logits = self._logits(g[-1])

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        self._flush()
        if self.last_logits is None or self.length != len(tokens) - 1 or k < 1:
            return Proposal.empty()
        head, vocab = self.head, self.head.config.target_vocab_size
        logits, g = self.last_logits, self.last_g
        draft_ids, draft_probs = [], []
        for depth in range(k):
            if params.greedy:
                token = self.d2t[int(logits.argmax())]
            else:
                probs = logits_to_probs(logits, params)
                index = int(sample(probs, generator))
                token = self.d2t[index]
                draft_probs.append(torch.zeros(vocab, device=self.device).index_copy_(0, head.d2t, probs))
            draft_ids.append(token)
            if depth < k - 1:
                g = self._run(g[None], [token], self.length + depth)[0]
                logits = self._logits(g)
        return Proposal(
            torch.tensor(draft_ids, dtype=torch.int64),
            torch.stack(draft_probs) if draft_probs else None,
        )

    @torch.inference_mode()
    def propose_tree(self, tokens: list[int], budget: int, params: SamplingParams,
                     generator: torch.Generator | None) -> TreeProposal:
        """An EAGLE-2 dynamic tree of at most ``budget`` nodes. Nodes are scored by their
        path's cumulative draft log-probability; at each depth the ``tree_width`` best
        nodes of the frontier are run through the head (one pass, tree attention over
        their ancestors' entries) and each offers its ``tree_width`` best children; the
        tree is the ``budget`` best-scored nodes (an ancestor scores at least as well as
        its descendants, so the set is closed under parents). Children are top-k choices,
        so the verifier treats them as point masses, greedy or sampling. Each node's
        confidence is its path's draft probability, exp(score)."""
        empty = TreeProposal(Tree(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)))
        passes = int(bool(self.pending))
        self._flush()
        if self.last_logits is None or self.length != len(tokens) - 1 or budget < 1:
            return empty
        width = self.tree_width
        committed = self.length
        # candidate nodes: (score, token, parent candidate index or -1, depth); entry slot once expanded
        scores, tokens_of, parent_of, depth_of, g_of, slot_of = [], [], [], [], {}, {}

        def offer(logits: torch.Tensor, parent: int, base: float, depth: int) -> None:
            log_probs = self._log_probs(logits, params)
            top = log_probs.topk(min(width, log_probs.numel()))
            for value, index in zip(top.values.tolist(), top.indices.tolist()):
                if value == float("-inf"):
                    continue
                scores.append(base + value)
                tokens_of.append(self.d2t[index])
                parent_of.append(parent)
                depth_of.append(depth)

        offer(self.last_logits, -1, 0.0, 1)
        frontier = list(range(len(scores)))
        next_slot = committed
        for depth in range(1, min(budget, MAX_TREE_DEPTH)):
            expand = sorted(frontier, key=lambda i: -scores[i])[:width]
            if not expand:
                break
            if len(scores) >= budget and scores[expand[0]] < sorted(scores, reverse=True)[budget - 1]:
                break  # descendants score no better than the frontier: none could enter the tree
            hidden = torch.stack([self.last_g if parent_of[i] < 0 else g_of[parent_of[i]] for i in expand])
            count = len(expand)
            mask = torch.zeros(count, next_slot + count, dtype=torch.bool, device=self.device)
            mask[:, :committed] = True
            for row, node in enumerate(expand):
                ancestor = parent_of[node]
                while ancestor >= 0:
                    mask[row, slot_of[ancestor]] = True
                    ancestor = parent_of[ancestor]
                mask[row, next_slot + row] = True
            positions = torch.tensor([committed + depth_of[i] - 1 for i in expand], device=self.device)
            g = self._run(hidden, [tokens_of[i] for i in expand], next_slot, positions, mask)
            passes += 1
            logits = self._logits(g)
            frontier = []
            for row, node in enumerate(expand):
                slot_of[node] = next_slot + row
                g_of[node] = g[row]
                before = len(scores)
                offer(logits[row], node, scores[node], depth + 1)
                frontier += range(before, len(scores))
            next_slot += count
        # best first; on a tie the shallower node first, so a parent precedes its children
        best = sorted(range(len(scores)), key=lambda i: (-scores[i], depth_of[i]))[:budget]
        chosen = sorted(best, key=lambda i: (depth_of[i], i))
        number = {candidate: n + 1 for n, candidate in enumerate(chosen)}
        tree = Tree(torch.tensor([tokens_of[i] for i in chosen], dtype=torch.int64),
                    torch.tensor([number[parent_of[i]] if parent_of[i] >= 0 else 0 for i in chosen], dtype=torch.int64))
        return TreeProposal(tree, confidence=torch.tensor([scores[i] for i in chosen]).exp(), passes=passes)

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.layer.logits(g) if self.layer is not None else self.head.logits(g, fast=self.kernels)

    def _log_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Draft log-probabilities over the draft vocabulary for ranking children (the
        sampling temperature applied; greedy ranks by the raw distribution)."""
        if not params.greedy:
            logits = logits / params.temperature
        return logits.float().log_softmax(-1)
