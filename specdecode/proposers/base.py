"""The Proposer protocol: what every drafter implements, and what it hands the verifier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingParams, SpecDecodeError, VocabularyMismatchError
from ..verify.tree import Tree


def check_drafter(proposer, vocab_size: int, hidden_size: int | None = None) -> None:
    """A drafter with a model or data of its own must fit the target: a draft model's
    ``runtime`` and a token ``store`` its ``vocab_size``, an EAGLE ``head`` and Medusa
    ``heads`` the target they were trained for (its vocabulary and, given ``hidden_size``,
    its hidden size), and a draft model must roll back past rejected drafts.
    build_proposer checks the pair (tokenizers too); an engine handed the proposer directly
    drafted ids the target has not (greedy: silently cut, no token accepted), failed
    mid-request when sampling, on the target's ids in the draft's embedding, on the
    target's states in a head of another width, or at a recurrent draft's first rejection
    (found in review)."""
    for inner in (getattr(proposer, "eagle", None), getattr(proposer, "ngram", None)):  # a merged tree's drafters
        if inner is not None:
            check_drafter(inner, vocab_size, hidden_size)
    for noun, owner in (("the head", "head"), ("the Medusa heads", "heads")):
        config = getattr(getattr(proposer, owner, None), "config", None)
        trained_for = getattr(config, "target_vocab_size", None)
        if trained_for is not None and trained_for != vocab_size:  # an EAGLE head's: failed mid-request
            raise VocabularyMismatchError(f"vocabulary mismatch: the target has {vocab_size} tokens, {noun} "
                                          f"{'were' if owner == 'heads' else 'was'} trained for a target of {trained_for}")
        width = getattr(config, "hidden_size", None)
        if width is not None and hidden_size is not None and width != hidden_size:
            raise SpecDecodeError(f"{noun} {'were' if owner == 'heads' else 'was'} trained for a target of hidden "
                                  f"size {width}; this target's is {hidden_size}")
    store = getattr(getattr(proposer, "store", None), "vocab_size", None)
    if store is not None and store != vocab_size:
        raise VocabularyMismatchError(f"vocabulary mismatch: the target has {vocab_size} tokens, the token store "
                                      f"was built for {store}")
    runtime = getattr(proposer, "runtime", None)
    own = getattr(runtime, "vocab_size", None)
    own = getattr(proposer, "vocab_size", own) if own is not None else None  # a draft model's, fitted to the target's
    if own is not None and own != vocab_size:
        raise VocabularyMismatchError(f"vocabulary mismatch: the target has {vocab_size} tokens, the draft model "
                                      f"{own}; a draft model must share the target's tokenizer")
    if getattr(runtime, "rolls_back", True) is False:
        kind = getattr(getattr(getattr(runtime, "model", None), "config", None), "model_type", None) or "in use"
        raise SpecDecodeError(f"the draft model ({kind}) keeps a recurrent state that cannot be rolled back past "
                              "rejected drafts: it cannot draft (use another draft model or method)")


def check_capture(proposer, target) -> None:
    """A head drafter (EAGLE, Medusa, a merged tree) reads the target's layer states: the
    target must hand them over (the native runtime does; transformers' adapter does not),
    and have the layers the head reads. Checked before any request (found in review: a
    TypeError from the transformers adapter at the first prefill, and a head for a deeper
    target failed mid-request naming no drafter)."""
    import inspect

    layers = tuple(getattr(proposer, "capture", ()) or ())
    if not layers:
        return
    name = getattr(proposer, "name", type(proposer).__name__)
    forward = getattr(target, "forward", None)
    if forward is None or "capture" not in inspect.signature(forward).parameters:
        describe = getattr(target, "describe", None)
        raise SpecDecodeError(f"the {name} drafter reads the target's layer states, which "
                              f"{describe() if describe else type(target).__name__} does not hand over: "
                              "run the target on the native runtime (--runtime native) or use another method")
    depth = getattr(target, "num_layers", None)
    if depth is not None and max(layers) > depth:
        raise SpecDecodeError(f"the {name} drafter reads the target's layer states {list(layers)}, but the target "
                              f"has {depth} layers: it was made for another target")


def hidden_size_of(runtime) -> int | None:
    """The target's hidden size (the native runtime's config, or transformers'), None if unknown."""
    config = getattr(runtime, "cfg", None) or getattr(getattr(runtime, "model", None), "config", None)
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) else None


class DraftVocabulary:
    """A trained drafter's draft vocabulary: the buffer ``d2t`` (draft id -> target id) of
    a module whose ``config`` has ``draft_vocab_size`` and ``target_vocab_size``; shared by
    the EAGLE head and the Medusa heads."""

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        if d2t.numel() != self.config.draft_vocab_size or d2t.unique().numel() != d2t.numel():
            raise SpecDecodeError(f"draft vocabulary needs {self.config.draft_vocab_size} distinct target ids")
        if int(d2t.min()) < 0 or int(d2t.max()) >= self.config.target_vocab_size:
            raise SpecDecodeError(f"draft vocabulary ids must lie in 0..{self.config.target_vocab_size - 1}")
        self.d2t.copy_(d2t.to(torch.int64))
        self._d2t_list = None

    @property
    def d2t_list(self) -> list[int]:
        """``d2t`` as a list, made once per draft vocabulary (proposers map every drafted
        token through it, read afresh each step: a copy taken when a proposer was built
        outlived a later ``set_draft_vocab``; a server builds a proposer per request)."""
        if getattr(self, "_d2t_list", None) is None or len(self._d2t_list) != self.d2t.numel():
            self._d2t_list = self.d2t.tolist()
        return self._d2t_list


@dataclass
class Proposal:
    """Draft tokens for one step of one sequence."""

    # [k'] int64, 0 <= k' <= k: a drafter may offer fewer tokens than asked, or none
    draft_ids: torch.Tensor
    # [k', V] float32: the distribution each draft token was drawn from, when sampling
    # with a stochastic drafter; None means the drafts are deterministic (one-hot).
    draft_probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.draft_ids.numel()

    @classmethod
    def empty(cls) -> "Proposal":
        return cls(torch.empty(0, dtype=torch.int64))


def drafts_in_vocab(draft_ids: torch.Tensor, vocab_size: int) -> int:
    """How many of ``draft_ids`` (1-D) come before the first id outside 0..vocab_size-1.
    Such a draft (a third-party proposer's) could never be accepted, and scoring it failed
    deep in the model (found in review; the server then failed every running request)."""
    count = draft_ids.numel()
    if count:
        low, high = draft_ids.aminmax()
        if int(low) < 0 or int(high) >= vocab_size:
            return int(((draft_ids < 0) | (draft_ids >= vocab_size)).nonzero()[0])
    return count


@dataclass
class TreeProposal:
    """Draft nodes 1..n under the last committed token (``verify.tree.Tree``)."""

    tree: "Tree"
    # [n, V] float32: the distribution each node's token was drawn from; None: the
    # nodes were chosen deterministically (top-k), point masses to the verifier. Drawn
    # nodes: the children of a node are independent draws from its distribution
    # (duplicates allowed), numbered in the order they were drawn (verify.tree).
    draft_probs: torch.Tensor | None = None
    # [n] float32: the drafter's estimate of each node's chance to be accepted (the
    # product of its path's draft probabilities), never above its parent's; None: no
    # estimate. The tree budget policy keeps the nodes worth their cost by it.
    confidence: torch.Tensor | None = None
    passes: int = 0  # drafter passes this tree took (each costs the profile's c)

    @property
    def num_tokens(self) -> int:
        return self.tree.size

    def first(self, count: int) -> "TreeProposal":
        """Nodes 1..``count`` (a subtree: a node's parent comes before it), chosen by
        position only, so a tree of drawn nodes stays unbiased."""
        if count >= self.tree.size:
            return self
        return TreeProposal(Tree(self.tree.tokens[:count], self.tree.parents[:count]),
                            None if self.draft_probs is None else self.draft_probs[:count],
                            None if self.confidence is None else self.confidence[:count], self.passes)

    def best(self, count: int) -> "TreeProposal":
        """The ``count`` most confident nodes (ties: the earlier node), a subtree since a
        node is never more confident than its parent. A tree of drawn nodes
        (``draft_probs``) is kept whole: its siblings must stay independent draws, so
        which of them are kept may not depend on the tokens drawn, and both keeping the
        likeliest and a count chosen from their confidences (the tree budget's) would
        (either biased the sampled output towards the drafter). Such a drafter sizes its
        tree before it draws."""
        if count >= self.tree.size or self.confidence is None or self.draft_probs is not None:
            return self
        kept = sorted(sorted(range(self.tree.size), key=lambda i: (-float(self.confidence[i]), i))[:count])
        index = torch.tensor(kept, dtype=torch.int64)
        return TreeProposal(self.tree.keep([i + 1 for i in kept]), None, self.confidence[index], self.passes)


class Proposer(Protocol):
    """A drafter. The engine calls ``start`` once per request, then ``propose`` each step."""

    name: str
    # True where, when sampling, drafts are drawn from a distribution handed to the verifier
    # (``draft_probs``: rejection sampling); absent or False: drafts are chosen
    # deterministically and the target's own draws verify them (``chain.coupled_verify``),
    # so a seeded request's tokens are plain sampling's (the server's audit relies on it)
    samples_drafts: bool = False

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        """Prepare for a new request whose sequence may grow to ``capacity`` tokens."""

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Offer up to ``k`` tokens to follow ``tokens`` (the committed sequence)."""
