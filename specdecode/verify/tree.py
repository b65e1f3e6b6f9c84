"""Token trees and their lossless verification: pure tensor functions beside ``chain``.

A tree has a root, node 0 (the last committed token, scored with the drafts), and draft
nodes 1..n, node i holding token ``tokens[i-1]`` under parent ``parents[i-1]`` (< i).
The target scores all n+1 nodes in one pass: node i sits at position ``start + depth(i)``
and attends to the cache and to its ancestors (``Tree.mask``). Children of a node chosen
deterministically carry distinct tokens; children drawn from a draft distribution q are
independent draws from it (duplicates allowed), in the order they were drawn.

Verification walks down from the root. Greedy: go to the child whose token is the
target's argmax at the current node, while there is one; the bonus is the argmax at the
node where the walk stops. Sampling (multi-draft speculative sampling, SpecInfer's
multi-round rejection: Miao et al. 2024): at the current node the children are tried in
turn against the target's distribution p there; a child drawn from q is accepted with
probability min(1, p(x)/q(x)) and a rejection replaces p by norm(max(p - q, 0)), which is
exact for independent draws from q (siblings drawn without replacement, or chosen among
draws by their tokens, would need another rule); a child chosen deterministically (top-k
of a drafter) is a point mass: accepted with probability p(x), and a rejection sets p(x)
to 0 and renormalises. When every child is rejected the bonus is drawn from what is left
of p. Either way the emitted tokens follow the target's distribution exactly.

A chain of k drafts is the tree whose node i has parent i-1; on it both functions agree
with ``chain.greedy_verify`` and ``chain.rejection_sample``. ``coupled_tree_verify`` walks
a tree of deterministic nodes as ``chain.coupled_verify`` walks a chain: the target's own
draws, one per depth, pick the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from ..config import SpecDecodeError
from .chain import DRAWN_AT_ZERO
from .sampling import argmax_ids, inverse_cdf, sample


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [n] int64 draft tokens of nodes 1..n
    parents: torch.Tensor  # [n] int64, parents[i-1] < i; 0 is the root

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError(f"a tree needs one parent per token: {n} tokens, {self.parents.numel()} parents")
        if n and not bool((self.parents < torch.arange(1, n + 1)).all() and (self.parents >= 0).all()):
            raise ValueError("every node's parent must come before it (parents[i-1] < i)")

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "Tree":
        return cls(tokens.to(torch.int64), torch.arange(tokens.numel(), dtype=torch.int64))

    def depths(self) -> torch.Tensor:
        """[n+1] depth of every node, root 0."""
        depth = [0]
        for parent in self.parents.tolist():
            depth.append(depth[parent] + 1)
        return torch.tensor(depth, dtype=torch.int64)

    def mask(self) -> torch.Tensor:
        """[n+1, n+1] bool: node i may attend to node j iff j is i or an ancestor of i."""
        return ancestor_mask(tuple(self.parents.tolist()))

    def children(self) -> list[list[int]]:
        """Children of every node 0..n, in node order (the order they are tried in)."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for child, parent in enumerate(self.parents.tolist(), start=1):
            kids[parent].append(child)
        return kids

    def keep(self, nodes: list[int]) -> "Tree":
        """The subtree of ``nodes`` (1-based, closed under parents), renumbered in their
        order here: e.g. the best n nodes of a scored tree."""
        chosen = sorted(nodes)
        number = {0: 0} | {node: i + 1 for i, node in enumerate(chosen)}
        parents = self.parents.tolist()
        missing = [node for node in chosen if parents[node - 1] not in number]
        if missing:
            raise ValueError(f"nodes {missing[:5]} are kept without their parents")
        index = torch.tensor(chosen, dtype=torch.int64) - 1
        return Tree(self.tokens[index], torch.tensor([number[parents[node - 1]] for node in chosen], dtype=torch.int64))

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (empty for the root)."""
        path = []
        while node:
            path.append(node)
            node = int(self.parents[node - 1])
        return path[::-1]


@lru_cache(maxsize=256)
def ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """The attention mask of a tree shape, computed once per shape (static trees reuse it)."""
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool)
    for child, parent in enumerate(parents, start=1):
        mask[child] |= mask[parent]
    return mask


def tree_from_paths(paths: list[list[int]]) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """A static tree given as paths of choice indices (e.g. [[0], [1], [0, 0], [0, 1]]:
    top-1 and top-2 at depth 1, then the top-2 children of the top-1 node), compiled
    once: the parents [n] of its nodes in breadth-first order, and each node's path."""
    nodes = sorted({tuple(p[: d + 1]) for p in paths for d in range(len(p))}, key=lambda p: (len(p), p))
    index = {path: i + 1 for i, path in enumerate(nodes)}
    parents = [index.get(path[:-1], 0) for path in nodes]
    return torch.tensor(parents, dtype=torch.int64), nodes


def walk_tree(tree: Tree, choose: Callable[[int], int]) -> tuple[list[int], int]:
    """Down from the root to the child holding the target's token ``choose(node)`` while
    there is one -> (accepted nodes root-down, the token chosen where the walk stops)."""
    tokens, children = tree.tokens.tolist(), tree.children()
    node, path = 0, []
    while True:
        wanted = choose(node)
        following = next((c for c in children[node] if tokens[c - 1] == wanted), None)
        if following is None:
            return path, wanted
        path.append(following)
        node = following


def greedy_tree_verify(tree: Tree, target_logits: "torch.Tensor | Callable[[int], torch.Tensor]") -> tuple[list[int], int]:
    """``target_logits`` [n+1, V] for nodes 0..n, or a function node -> logits [V] (asked
    only for the nodes on the walk: ``LazyLogits`` rows) -> (accepted nodes root-down,
    bonus token)."""
    if callable(target_logits):
        return walk_tree(tree, lambda node: int(argmax_ids(target_logits(node))))
    return walk_tree(tree, argmax_ids(target_logits).tolist().__getitem__)


def coupled_tree_verify(tree: Tree, target_probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[list[int], int]:
    """``chain.coupled_verify`` on a tree of deterministic nodes: at each node of the walk
    the target draws its token from ``target_probs`` [n+1, V] with the uniform of the
    node's depth (``uniforms`` [depth + 1]: the positions after the root's), and the walk
    goes to the child holding it. Only one node per depth is on the walk, so each draw
    uses a uniform of its own and the tokens are what plain sampling draws with them."""
    depths = tree.depths().tolist()
    return walk_tree(tree, lambda node: int(inverse_cdf(target_probs[node], uniforms[depths[node]])))


def tree_rejection_sample(
    tree: Tree,
    target_probs: torch.Tensor,  # [n+1, V] processed target distributions at nodes 0..n
    draft_probs: torch.Tensor | None,  # [n, V] the distribution node i's token was drawn from; None: point masses
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-draft speculative sampling down the tree -> (accepted nodes, bonus token)."""
    tokens, children = tree.tokens.tolist(), tree.children()
    node, path = 0, []
    while True:
        residual = target_probs[node].clone()
        accepted = None
        for child in children[node]:
            token = tokens[child - 1]
            u = float(torch.rand((), generator=generator, dtype=torch.float64, device=residual.device))  # as rejection_sample's
            if draft_probs is None:  # a point mass at the token
                if u < float(residual[token]):
                    accepted = child
                    break
                residual[token] = 0.0
            else:
                q = draft_probs[child - 1]
                if float(q[token]) <= 0.0:
                    raise SpecDecodeError(DRAWN_AT_ZERO)
                if u * float(q[token]) < float(residual[token]):
                    accepted = child
                    break
                residual = (residual - q).clamp_(min=0.0)
            mass = residual.sum()
            if float(mass) <= 0.0:  # nothing left: p was covered by the rejected drafts (probability 0)
                residual = target_probs[node].clone()
                break
            residual = residual / mass
        if accepted is None:
            return path, int(sample(residual, generator))
        path.append(accepted)
        node = accepted
