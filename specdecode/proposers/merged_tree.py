"""One token tree from two drafters: prompt lookup's chain and the EAGLE head's tree.

Copying tasks (summaries, extraction, code edits) keep prompt lookup's long exact matches;
open text gets the head's guesses. Each step the n-gram continuation (at most ``budget - 1``
tokens while the head is there to fill the rest) goes in first as a chain under the root,
then the head's dynamic tree for the remaining budget is merged in: a head node whose parent
already holds a child with the same token is that child, so a path both drafters agree on
is scored once. Both drafters are deterministic, so the verifier treats every node as a
point mass; the head observes the accepted path like it does alone.
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
    drafts_trees = True  # the engine's tree step, whatever the head's width

    def __init__(self, ngram: NgramProposer, eagle: EagleProposer):
        self.ngram, self.eagle = ngram, eagle
        self.capture = eagle.capture

    @property
    def feature_width(self) -> int:
        return self.eagle.feature_width

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        self.ngram.start(prompt_ids, capacity)
        self.eagle.start(prompt_ids, capacity)

    def observe(self, start: int, features: torch.Tensor, tokens: list[int]) -> None:
        self.eagle.observe(start, features, tokens)

    def propose(self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None):
        """A chain (when the engine asks for one): prompt lookup's if it matched, else the head's."""
        proposal = self.ngram.propose(tokens, k, params, generator)
        return proposal if proposal.num_tokens else self.eagle.propose(tokens, k, params, generator)

    def propose_tree(self, tokens: list[int], budget: int, params: SamplingParams,
                     generator: torch.Generator | None) -> TreeProposal:
        chain = self.ngram.propose(tokens, max(budget - 1, 1), params, generator).draft_ids.tolist()
        head = self.eagle.propose_tree(tokens, budget - len(chain), params, generator).tree if budget > len(chain) else None
        merged_tokens, merged_parents = list(chain), list(range(len(chain)))
        child = {(parent, token): node + 1 for node, (parent, token) in enumerate(zip(merged_parents, merged_tokens))}
        if head is not None:
            where = {0: 0}  # head node -> merged node
            for node, (token, parent) in enumerate(zip(head.tokens.tolist(), head.parents.tolist()), start=1):
                key = (where[parent], token)
                if key not in child:
                    merged_tokens.append(token)
                    merged_parents.append(where[parent])
                    child[key] = len(merged_tokens)
                where[node] = child[key]
        return TreeProposal(Tree(torch.tensor(merged_tokens, dtype=torch.int64),
                                 torch.tensor(merged_parents, dtype=torch.int64)))
