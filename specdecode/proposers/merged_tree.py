"""One token tree from two drafters: prompt lookup's chain and the EAGLE head's tree.

Copying tasks (summaries, extraction, code edits) keep prompt lookup's long exact matches;
open text gets the head's guesses. Each step the n-gram continuation (at most ``budget - 1``
tokens while the head is there to fill the rest) goes in first as a chain under the root,
then the head's dynamic tree for the remaining budget is merged in: a head node whose parent
already holds a child with the same token is that child, so a path both drafters agree on
is scored once. Both drafters are deterministic, so the verifier treats every node as a
point mass; the head observes the accepted path like it does alone.

Each node carries a confidence for the tree budget policy: the head's path probability,
and for prompt lookup's chain its hit rates this request (position 1, and a position given
the one before), learnt by comparing each chain with the tokens committed after it.
"""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..verify.tree import Tree
from .base import TreeProposal
from .eagle import EagleProposer
from .ngram import NgramProposer


class MergedTreeProposer:
    name = "tree"
    samples_drafts = True  # its chain fallback is the head's, which samples
    drafts_trees = True  # the engine's tree step, whatever the head's width

    def __init__(self, ngram: NgramProposer, eagle: EagleProposer, prior_first: float = 0.3,
                 prior_later: float = 0.6, decay: float = 0.9):
        self.ngram, self.eagle = ngram, eagle
        self.capture = eagle.capture
        self.priors, self.decay = (prior_first, prior_later), decay
        self._reset_rates()

    @property
    def feature_width(self) -> int:
        return self.eagle.feature_width

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        self.ngram.start(prompt_ids, capacity)
        self.eagle.start(prompt_ids, capacity)
        self._reset_rates()

    def _reset_rates(self) -> None:
        # prompt lookup's hit rates, learnt from its chains against what was committed after them:
        # [successes, trials] at position 1, and at a position given the one before
        self.first_counts = [self.priors[0] * 2, 2.0]
        self.later_counts = [self.priors[1] * 2, 2.0]
        self.chain: list[int] = []
        self.chain_at = 0

    def observe(self, start: int, features: torch.Tensor, tokens: list[int]) -> None:
        self.eagle.observe(start, features, tokens)

    def _learn(self, tokens: list[int]) -> None:
        """Score the last chain against the tokens committed after it (whether or not it
        was verified: the committed tokens are the target's own)."""
        committed = tokens[self.chain_at : self.chain_at + len(self.chain)]
        if not self.chain or not committed:
            return
        matched = next((i for i, (a, b) in enumerate(zip(self.chain, committed)) if a != b), len(committed))
        decay = self.decay
        self.first_counts = [self.first_counts[0] * decay + (matched > 0), self.first_counts[1] * decay + 1]
        for position in range(2, min(matched + 1, len(committed)) + 1):
            self.later_counts = [self.later_counts[0] * decay + (position <= matched), self.later_counts[1] * decay + 1]
        self.chain = []

    def chain_confidence(self, length: int) -> list[float]:
        """Prompt lookup's chance to be right at positions 1..length, by its hit rates."""
        first = self.first_counts[0] / self.first_counts[1]
        later = self.later_counts[0] / self.later_counts[1]
        return [first * later**i for i in range(length)]

    def propose(self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None):
        """A chain (when the engine asks for one): prompt lookup's if it matched, else the head's."""
        proposal = self.ngram.propose(tokens, k, params, generator)
        return proposal if proposal.num_tokens else self.eagle.propose(tokens, k, params, generator)

    def propose_tree(self, tokens: list[int], budget: int, params: SamplingParams,
                     generator: torch.Generator | None) -> TreeProposal:
        """The merged tree; a node's confidence is the larger of the two drafters' (prompt
        lookup's from its hit rates, the head's from its probabilities)."""
        self._learn(tokens)
        chain = self.ngram.propose(tokens, max(budget - 1, 1), params, generator).draft_ids.tolist()
        self.chain, self.chain_at = chain, len(tokens)
        head = self.eagle.propose_tree(tokens, budget - len(chain), params, generator) if budget > len(chain) else None
        merged_tokens, merged_parents = list(chain), list(range(len(chain)))
        confidence = self.chain_confidence(len(chain))
        child = {(parent, token): node + 1 for node, (parent, token) in enumerate(zip(merged_parents, merged_tokens))}
        if head is not None:
            head_confidence = head.confidence.tolist() if head.confidence is not None else [0.0] * head.tree.size
            where = {0: 0}  # head node -> merged node
            for node, (token, parent) in enumerate(zip(head.tree.tokens.tolist(), head.tree.parents.tolist()), start=1):
                key = (where[parent], token)
                if key not in child:
                    merged_tokens.append(token)
                    merged_parents.append(where[parent])
                    confidence.append(head_confidence[node - 1])
                    child[key] = len(merged_tokens)
                else:
                    confidence[child[key] - 1] = max(confidence[child[key] - 1], head_confidence[node - 1])
                where[node] = child[key]
        return TreeProposal(Tree(torch.tensor(merged_tokens, dtype=torch.int64),
                                 torch.tensor(merged_parents, dtype=torch.int64)),
                            confidence=torch.tensor(confidence, dtype=torch.float32),
                            passes=head.passes if head is not None else 0)
