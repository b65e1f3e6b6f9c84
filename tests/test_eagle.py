"""The EAGLE drafter: lossless greedy decoding with random heads, proposals that match a
fresh pass of the head over the committed sequence, files and clear errors."""

from __future__ import annotations

import dataclasses
import random

import re

import pytest
import torch

from conftest import save_tiny_model
from specdecode.config import ConfigError, SamplingParams, SpecDecodeError, SpeculativeConfig
from specdecode.engine import SpeculativeEngine
from specdecode.factory import build_proposer, load_model
from specdecode.proposers.eagle import EagleProposer
from specdecode.proposers.eagle_head import EagleConfig, EagleHead

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return [load_model(save_tiny_model(root / f"t{s}", seed=s, num_layers=3), torch.float32, backend=backend)
            for s, backend in ((30, "torch"), (31, "kernels"))]


@pytest.fixture(scope="module")
def peaked_targets(tmp_path_factory):
    """Targets of 6 tokens, on both backends: a random head's drafts are often accepted,
    several deep (with 97 tokens almost none are, and the steps after an acceptance go
    untested: found in a mutation audit)."""
    root = tmp_path_factory.mktemp("eagle-peaked")
    return [load_model(save_tiny_model(root / f"t{backend}", seed=33, vocab_size=6, num_layers=2, init_std=0.3),
                       torch.float32, backend=backend) for backend in ("torch", "kernels")]


def random_head(target, seed: int, draft_vocab: int = 60) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(target.runtime.cfg, draft_vocab))
    for parameter in head.parameters():  # larger weights: peaked draft distributions
        torch.nn.init.normal_(parameter, std=0.3) if parameter.dim() > 1 else None
    head.set_draft_vocab(torch.randperm(target.runtime.vocab_size)[:draft_vocab].sort().values)
    return head


def proposer_for(target, head) -> EagleProposer:
    weights = target.runtime.weights
    return EagleProposer(head, lambda ids: weights.embed_rows(ids).float())


def test_eagle_greedy_equals_plain_with_random_heads(targets, peaked_targets):
    """Chains of 1, 3 and 6: over 97 tokens nearly every draft is rejected; over 6 many are
    accepted, some several deep, so accepting and rolling back are both exercised."""
    rng = random.Random(0)
    checked, drafted, accepted, deep = 0, 0, {97: 0, 6: 0}, 0
    for target in [*targets, *peaked_targets]:
        vocab = target.runtime.vocab_size
        plain = SpeculativeEngine(target.runtime)
        for seed in range(3):
            proposer = proposer_for(target, random_head(target, seed, draft_vocab=min(60, vocab)))
            for k in (1, 3, 6):
                engine = SpeculativeEngine(target.runtime, proposer=proposer, k=k)
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
                result = engine.generate(prompt, GREEDY)
                assert result.token_ids == plain.generate(prompt, GREEDY).token_ids, (seed, k, prompt)
                checked += 1
                drafted += result.stats.draft_tokens
                accepted[vocab] += result.stats.accepted_tokens
                deep += sum(result.stats.accepted_per_position[2:])
    assert checked == 36 and drafted > 0 and accepted[6] > 15 and deep > 3, (accepted, deep)


def fresh_proposal(target, head, committed: list[int], k: int) -> list[int]:
    """What a head with no history drafts after ``committed``: the target's features from
    one prefill over the committed tokens, one pass of the head over all of them."""
    proposer = proposer_for(target, head)
    runtime = target.runtime
    proposer.start(committed, len(committed) + k + 1)
    runtime.reset(len(committed) + 1)
    _, features = runtime(torch.tensor([committed[:-1]]), capture=proposer.capture)
    proposer.observe(0, features[0], committed)
    return proposer.propose(committed, k, GREEDY, None).draft_ids.tolist()


class Recording(EagleProposer):
    """Records every proposal with the committed sequence it followed: a chain's drafts, a
    tree's tokens and parents."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def propose(self, tokens, k, params, generator):
        proposal = super().propose(tokens, k, params, generator)
        self.seen.append((list(tokens), k, proposal.draft_ids.tolist()))
        return proposal

    def propose_tree(self, tokens, budget, params, generator):
        proposal = super().propose_tree(tokens, budget, params, generator)
        self.seen.append((list(tokens), budget, proposal.tree.tokens.tolist(), proposal.tree.parents.tolist()))
        return proposal


@pytest.mark.parametrize("which", ["97 tokens", "6 tokens, torch", "6 tokens, kernels"])
def test_incremental_proposals_equal_a_fresh_pass_over_the_committed_sequence(targets, peaked_targets, which):
    """A stale or misplaced head cache keeps the output lossless but ruins acceptance; this
    checks the drafts themselves, step by step, after accepted and rejected drafts. Over 97
    tokens a random head's drafts are all rejected; over 6 many are accepted, several deep
    (found in a mutation audit: the accepted path's states handed to the head in another
    order passed every test)."""
    target = {"97 tokens": targets[0], "6 tokens, torch": peaked_targets[0],
              "6 tokens, kernels": peaked_targets[1]}[which]
    vocab = target.runtime.vocab_size
    head = random_head(target, 7, draft_vocab=min(60, vocab))
    weights = target.runtime.weights
    proposer = Recording(head, lambda ids: weights.embed_rows(ids).float())
    engine = SpeculativeEngine(target.runtime, proposer=proposer, k=3)
    prompt = [5, 9, 14, 22, 5, 9] if vocab > 22 else [5, 1, 4, 2, 5, 1]
    stats = engine.generate(prompt, GREEDY).stats
    assert len(proposer.seen) > 5
    if vocab < 22:
        assert stats.accepted_tokens > 5 and stats.accepted_per_position[1] > 0, stats.accepted_per_position
    for tokens, k, drafts in proposer.seen[:16]:
        assert drafts == fresh_proposal(target, head, tokens, k), tokens


def test_incremental_trees_equal_a_fresh_pass_over_the_committed_sequence(tmp_path):
    """The tree step hands the head the states of the root and the accepted path, in that
    order: every tree then equals a fresh head's over the committed sequence (a mutation
    audit: the path's states before the root's kept the output lossless, and passed). A
    vocabulary of 6, so that a random head's trees are often partly accepted."""
    target = load_model(save_tiny_model(tmp_path / "t", seed=33, vocab_size=6, num_layers=2, init_std=0.3),
                        torch.float32, backend="torch")
    head = random_head(target, 7, draft_vocab=6)
    embed = lambda ids: target.runtime.weights.embed_rows(ids).float()  # noqa: E731
    proposer = Recording(head, embed, tree_width=2)
    result = SpeculativeEngine(target.runtime, proposer=proposer, k=4).generate([5, 1, 4, 2, 5, 1], GREEDY)
    assert len(proposer.seen) > 5 and result.stats.accepted_tokens > 3
    for tokens, budget, nodes, parents in proposer.seen[:10]:
        fresh = EagleProposer(head, embed, tree_width=2)
        runtime = target.runtime
        fresh.start(tokens, len(tokens) + budget + 1)
        runtime.reset(len(tokens) + 1)
        _, features = runtime(torch.tensor([tokens[:-1]]), capture=fresh.capture)
        fresh.observe(0, features[0], tokens)
        tree = fresh.propose_tree(tokens, budget, GREEDY, None).tree
        assert (tree.tokens.tolist(), tree.parents.tolist()) == (nodes, parents), tokens


def unrolled_log_probs(head, embed, features, committed: list[int], path: list[int]) -> torch.Tensor:
    """The head's draft log-probabilities after ``committed`` and the drafted ``path``, from
    its training-time pass (``unrolled``), which shares no cache or mask code with drafting:
    step j's last row is the node at depth j on ``path``."""
    rows = len(committed) - 1
    embeds = [embed(torch.tensor(committed[1:]))[None]] + [embed(torch.tensor([t] * rows))[None] for t in path]
    outputs = head.unrolled(features[None], embeds, torch.arange(rows))
    return head.logits(outputs[-1][0, -1], fast=False).float().log_softmax(-1)


def reference_tree(head, embed, features, committed: list[int], budget: int, width: int) -> dict:
    """EAGLE-2 by its definition, from ``unrolled``: per depth the ``width`` best frontier
    nodes offer their ``width`` best children; the tree is the ``budget`` best paths by
    cumulative log-probability. Returns {path of target ids: score}."""
    d2t = head.d2t.tolist()
    scores, frontier = {}, []

    def offer(path):
        top = unrolled_log_probs(head, embed, features, committed, list(path)).topk(width)
        for value, index in zip(top.values.tolist(), top.indices.tolist()):
            child = path + (d2t[index],)
            scores[child] = scores.get(path, 0.0) + value
            frontier.append(child)

    offer(())
    for _ in range(1, min(budget, 8)):  # MAX_TREE_DEPTH
        expand = sorted(frontier, key=lambda p: -scores[p])[:width]
        frontier = []
        for path in expand:
            offer(path)
    return dict(sorted(scores.items(), key=lambda item: (-item[1], len(item[0])))[:budget])


@pytest.mark.parametrize("width", [2, 3])
def test_trees_are_the_best_paths_of_the_heads_own_distributions(targets, width):
    """Every tree equals EAGLE-2's definition computed independently from the head's
    training pass: the same paths, each node's confidence its path's probability. A mutation
    audit: feeding every expanded node the root's state, dropping ancestors from the tree
    mask, unshifted RoPE positions, overwriting earlier nodes' cache slots, expanding the
    wrong frontier nodes or stopping early all kept greedy output lossless and every tree
    well formed, and passed (the incremental-tree test compares the proposer with itself)."""
    target = targets[0]
    embed = lambda ids: target.runtime.weights.embed_rows(ids).float()  # noqa: E731
    runtime = target.runtime
    checked = deep = 0
    for seed in (40, 41):
        head = random_head(target, seed)
        proposer = EagleProposer(head, embed, kernels=False, tree_width=width)  # torch: the reference's numerics
        for committed in ([5, 9, 14, 22, 5, 9], [33, 7, 61, 2, 80, 19, 44, 3, 12]):
            runtime.reset(len(committed) + 1)
            _, features = runtime(torch.tensor([committed[:-1]]), capture=proposer.capture)
            for budget in (4, 9, 16):
                proposer.start(committed, len(committed) + budget + 1)
                proposer.observe(0, features[0], committed)
                proposal = proposer.propose_tree(committed, budget, GREEDY, None)
                tree, tokens = proposal.tree, proposal.tree.tokens.tolist()
                paths = []
                for node, parent in enumerate(proposal.tree.parents.tolist()):
                    paths.append((paths[parent - 1] if parent else ()) + (tokens[node],))
                expected = reference_tree(head, embed, features[0], committed, budget, width)
                assert sorted(paths) == sorted(expected), (seed, committed, budget)
                torch.testing.assert_close(proposal.confidence, torch.tensor([expected[p] for p in paths]).exp(),
                                           rtol=1e-4, atol=1e-6)
                # the same tree again from the same cache, one head pass fewer: the observed
                # rows ran with the first (a tree counting no pass for them passed: an audit)
                again = proposer.propose_tree(committed, budget, GREEDY, None)
                assert again.tree.tokens.tolist() == tokens and again.passes == proposal.passes - 1
                checked += 1
                deep += int(tree.depths().max()) >= 3
    assert checked == 12 and deep >= 4


def test_chains_are_the_heads_greedy_path_by_its_training_pass(targets):
    """Each greedy draft is the argmax of the head after the committed tokens and the drafts
    before it, by ``unrolled`` (a mutation audit: deeper drafts fed the first draft's
    embedding, lossless, and passed: the incremental test compares the proposer with itself)."""
    target = targets[0]
    embed = lambda ids: target.runtime.weights.embed_rows(ids).float()  # noqa: E731
    head = random_head(target, 10)  # a head whose chains change token along the way
    proposer = EagleProposer(head, embed, kernels=False)
    d2t = head.d2t.tolist()
    for committed in ([5, 9, 14, 22, 5, 9], [33, 7, 61, 2, 80, 19, 44]):
        target.runtime.reset(len(committed) + 1)
        _, features = target.runtime(torch.tensor([committed[:-1]]), capture=proposer.capture)
        proposer.start(committed, len(committed) + 8)
        proposer.observe(0, features[0], committed)
        drafts = proposer.propose(committed, 5, GREEDY, None).draft_ids.tolist()
        expected = []
        for _ in range(5):
            expected.append(d2t[int(unrolled_log_probs(head, embed, features[0], committed, expected).argmax())])
        assert drafts == expected, committed
        assert len(set(drafts)) > 2


def test_observed_rows_run_once_and_gaps_or_stale_sequences_draft_nothing(targets):
    """States observed in pieces run in one head pass at the next proposal; a gap in the
    observed positions (entries would be misplaced) or a committed sequence the head was not
    told of (its drafts would be stale) drafts nothing. A mutation audit: each passed."""
    target = targets[0]
    proposer = proposer_for(target, random_head(target, 7))
    committed = [5, 9, 14, 22, 5, 9, 30, 31, 40]
    target.runtime.reset(len(committed) + 1)
    _, features = target.runtime(torch.tensor([committed[:-1]]), capture=proposer.capture)
    passes, run = [], proposer._run
    proposer._run = lambda *args, **kwargs: passes.append(1) or run(*args, **kwargs)
    proposer.start(committed, 32)
    proposer.observe(0, features[0, :3], committed)
    proposer.observe(3, features[0, 3:], committed)
    assert proposer.propose(committed, 1, GREEDY, None).num_tokens == 1 and len(passes) == 1
    assert proposer.propose(committed + [7], 1, GREEDY, None).num_tokens == 0  # not observed: stale
    proposer.start(committed, 32)
    proposer.observe(0, features[0, :3], committed)
    proposer.observe(5, features[0, 5:], committed)  # positions 3..4 never observed
    assert proposer.propose(committed, 1, GREEDY, None).num_tokens == 0


@pytest.mark.parametrize("target_index", [0, 1])
def test_a_tree_of_the_deepest_depth_fits_a_cache_sized_for_the_sequence(targets, target_index):
    """A budget no early stop cuts (width 2: never 64 candidates) runs every pass down to
    MAX_TREE_DEPTH, writing width nodes per pass after the committed entries; a cache sized
    for the committed tokens alone holds them (a mutation audit: one pass's room fewer
    passed every test)."""
    from specdecode.proposers.eagle import MAX_TREE_DEPTH

    target = targets[target_index]
    proposer = proposer_for(target, random_head(target, 3))
    proposer.tree_width = 2
    committed = [5, 9, 14, 22, 5, 9]
    target.runtime.reset(len(committed) + 1)
    _, features = target.runtime(torch.tensor([committed[:-1]]), capture=proposer.capture)
    proposer.start(committed, len(committed))
    proposer.observe(0, features[0], committed)
    proposal = proposer.propose_tree(committed, 64, GREEDY, None)
    assert proposal.passes == MAX_TREE_DEPTH and int(proposal.tree.depths().max()) == MAX_TREE_DEPTH


class FixedChain:
    """Prompt lookup's stand-in: always the same continuation."""

    def __init__(self, chain: list[int]):
        self.chain = chain

    def start(self, prompt_ids, capacity) -> None:
        pass

    def propose(self, tokens, k, params, generator):
        from specdecode.proposers.base import Proposal

        return Proposal(torch.tensor(self.chain[:k], dtype=torch.int64))


def tree_paths(tree) -> list[tuple[int, ...]]:
    """Each node's path of tokens from the root."""
    paths, tokens = [], tree.tokens.tolist()
    for node, parent in enumerate(tree.parents.tolist()):
        paths.append((paths[parent - 1] if parent else ()) + (tokens[node],))
    return paths


def test_a_merged_tree_is_the_union_of_the_chain_and_the_heads_paths(targets):
    """Prompt lookup's chain following one of the head's own paths then leaving it: the
    merged tree holds every head path and every chain prefix exactly once, a shared node
    with the larger confidence, and counts the head's passes. A mutation audit: hanging
    every head node under the root, merging nothing, looking up shared nodes by the head's
    numbering, keeping the chain's confidence on shared nodes or counting no passes all
    passed."""
    from specdecode.proposers.merged_tree import MergedTreeProposer

    target = targets[0]
    eagle = proposer_for(target, random_head(target, 21))
    eagle.tree_width = 2
    committed = [5, 9, 14, 22, 5, 9]
    target.runtime.reset(len(committed) + 1)
    _, features = target.runtime(torch.tensor([committed[:-1]]), capture=eagle.capture)
    outside = next(t for t in range(target.runtime.vocab_size) if t not in set(eagle.d2t))  # never a head node
    checked = 0
    for budget in (6, 10):
        eagle.start(committed, len(committed) + budget + 1)
        eagle.observe(0, features[0], committed)
        head = eagle.propose_tree(committed, budget - 3, GREEDY, None)
        head_paths = tree_paths(head.tree)
        head_confidence = dict(zip(head_paths, head.confidence.tolist()))
        for path in (p for p in head_paths if len(p) == 2):
            chain = list(path) + [outside]
            merged = MergedTreeProposer(FixedChain(chain), eagle, prior_first=0.01, prior_later=0.01)
            proposal = merged.propose_tree(committed, budget, GREEDY, None)
            paths = tree_paths(proposal.tree)
            chain_paths = [tuple(chain[: i + 1]) for i in range(3)]
            assert len(paths) == len(set(paths)) == head.tree.size + 1
            assert set(paths) == set(head_paths) | set(chain_paths)
            chain_confidence = dict(zip(chain_paths, merged.chain_confidence(3)))
            expected = [max(head_confidence.get(p, 0.0), chain_confidence.get(p, 0.0)) for p in paths]
            torch.testing.assert_close(proposal.confidence, torch.tensor(expected))
            assert proposal.passes == head.passes - 1  # the observed rows ran with the head's own tree
            checked += 1
    assert checked >= 2


def test_prompt_lookups_hit_rates_are_learnt_from_what_was_committed_after_its_chains(targets):
    """Position 1's rate counts a hit when the chain's first token was committed; a later
    position's, each position after a hit up to the first miss; old evidence decays."""
    from specdecode.proposers.merged_tree import MergedTreeProposer

    eagle = proposer_for(targets[0], random_head(targets[0], 1))  # never observed: no head tree
    merged = MergedTreeProposer(FixedChain([7, 8, 9]), eagle, prior_first=0.3, prior_later=0.6, decay=0.9)
    merged.start([1, 2, 3], 64)
    close = lambda got, want: torch.testing.assert_close(got, torch.tensor(want))  # noqa: E731
    close(merged.propose_tree([1, 2, 3], 4, GREEDY, None).confidence, [0.3, 0.3 * 0.6, 0.3 * 0.6**2])
    # [7, 8, 5] committed after the chain: position 1 hit, 2 hit, 3 missed
    first, later = [0.6 * 0.9 + 1, 2 * 0.9 + 1], [1.2 * 0.9 + 1, 2 * 0.9 + 1]
    later = [later[0] * 0.9, later[1] * 0.9 + 1]
    rates = (first[0] / first[1], later[0] / later[1])
    close(merged.propose_tree([1, 2, 3, 7, 8, 5], 4, GREEDY, None).confidence,
          [rates[0], rates[0] * rates[1], rates[0] * rates[1] ** 2])
    # [7, 4, 4]: position 1 hit, 2 missed (3 not tried)
    first, later = [first[0] * 0.9 + 1, first[1] * 0.9 + 1], [later[0] * 0.9, later[1] * 0.9 + 1]
    rates = (first[0] / first[1], later[0] / later[1])
    close(merged.propose_tree([1, 2, 3, 7, 8, 5, 7, 4, 4], 4, GREEDY, None).confidence,
          [rates[0], rates[0] * rates[1], rates[0] * rates[1] ** 2])


def test_trees_stay_closed_under_parents_when_scores_tie(targets):
    """A child of probability 1 ties its parent's score: the tie goes to the shallower node,
    so a cut at the budget never keeps a child without its parent. Log-probabilities rounded
    to even integers here, to make ties common (a mutation audit: deeper-first ties passed)."""
    target = targets[0]
    proposer = proposer_for(target, random_head(target, 11))
    proposer.tree_width = 3
    rounded = proposer._log_probs
    proposer._log_probs = lambda logits, params: rounded(logits, params).div(2).round().mul(2)
    committed = [5, 9, 14, 22, 5, 9]
    target.runtime.reset(len(committed) + 1)
    _, features = target.runtime(torch.tensor([committed[:-1]]), capture=proposer.capture)
    proposer.start(committed, len(committed) + 40)
    proposer.observe(0, features[0], committed)
    for budget in range(1, 16):
        tree = proposer.propose_tree(committed, budget, GREEDY, None).tree
        parents = tree.parents.tolist()
        assert tree.size == budget and all(0 <= parent <= node for node, parent in enumerate(parents)), budget


class Alternating:
    """A k policy that drafts ``k`` and takes a plain step in turn."""

    name = "alternating"

    def __init__(self, k: int):
        self.k_max, self.steps = k, 0

    def start(self, prior_alpha=None) -> None:
        self.steps = 0

    def choose(self, context: int) -> int:
        self.steps += 1
        return self.k_max if self.steps % 2 else 0

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def describe(self) -> str:
        return "alternating"


def test_the_head_is_fed_on_plain_steps_too(targets):
    """Found in review: no test would notice an engine that stopped handing the head the
    target's states on a plain step (k = 0): the head would draft nothing for the rest of
    the request, output still lossless. With k and plain steps in turn, every draft equals
    a fresh head's over the committed sequence."""
    target = targets[0]
    head = random_head(target, 7)
    weights = target.runtime.weights
    proposer = Recording(head, lambda ids: weights.embed_rows(ids).float())
    SpeculativeEngine(target.runtime, proposer=proposer, k=Alternating(3)).generate([5, 9, 14, 22, 5, 9], GREEDY)
    assert len(proposer.seen) >= 10
    for tokens, k, drafts in proposer.seen[:10]:
        assert drafts and drafts == fresh_proposal(target, head, tokens, k), tokens


def test_a_draft_vocabulary_set_after_the_proposer_was_built_maps_its_drafts(targets):
    """Found in review: the proposer copied the head's draft -> target map when it was
    built, so a vocabulary set afterwards was drafted through the old map (lossless, but
    other tokens than the head meant). Ids outside the target's vocabulary are refused."""
    target = targets[0]
    head = random_head(target, 3)
    proposer = proposer_for(target, head)
    committed = [5, 9, 14, 22, 5, 9]
    before = fresh_proposal(target, head, committed, 1)  # the first draft: deeper ones read its embedding
    old = head.d2t.clone()
    shifted = torch.roll(old, 1)  # the same ids, each draft index now names its neighbour's
    head.set_draft_vocab(shifted)
    runtime = target.runtime
    proposer.start(committed, len(committed) + 4)
    runtime.reset(len(committed) + 1)
    _, features = runtime(torch.tensor([committed[:-1]]), capture=proposer.capture)
    proposer.observe(0, features[0], committed)
    after = proposer.propose(committed, 1, GREEDY, None).draft_ids.tolist()
    index = {token: i for i, token in enumerate(old.tolist())}
    assert after == [shifted[index[token]].item() for token in before] and after != before
    with pytest.raises(SpecDecodeError, match="must lie in 0.."):
        head.set_draft_vocab(torch.arange(target.runtime.vocab_size - 59, target.runtime.vocab_size + 1))


def test_the_kernel_layer_drafts_what_the_torch_pass_drafts(targets):
    """The head's decoder layer as one kernel call (KernelHeadLayer) against the same layer
    through torch: the same outputs and cache entries up to rounding, over a history longer
    than one kernel call takes (chunks of 256 rows), and the same chains drafted from it."""
    from specdecode import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    target = targets[1]
    head = random_head(target, 11)
    embed = lambda ids: target.runtime.weights.embed_rows(ids).float()  # noqa: E731
    fast, slow = EagleProposer(head, embed), EagleProposer(head, embed)
    slow.layer = None  # the torch path, with the same Q8_0 projections
    assert fast.layer is not None
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, target.runtime.vocab_size, (300,), generator=generator).tolist()
    features = torch.randn(299, fast.feature_width, generator=generator)
    for proposer in (fast, slow):
        proposer.start(tokens, 320)
        proposer.observe(0, features, tokens)
        proposer._flush()
    assert fast.length == slow.length == 299
    torch.testing.assert_close(fast.last_g, slow.last_g, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast.k_cache[:, :299], slow.k_cache[:, :299], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast.v_cache[:, :299], slow.v_cache[:, :299], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast.last_logits, slow.last_logits, rtol=1e-4, atol=1e-3)
    for k in (1, 4, 8):
        drafts = fast.propose(tokens, k, GREEDY, None).draft_ids.tolist()
        assert len(drafts) == k and drafts == slow.propose(tokens, k, GREEDY, None).draft_ids.tolist()
    for width, budget in ((2, 6), (3, 12), (4, 24)):  # tree passes: rows that see listed slots
        fast.tree_width = slow.tree_width = width
        trees = [p.propose_tree(tokens, budget, GREEDY, None) for p in (fast, slow)]
        assert trees[0].passes == trees[1].passes > 2
        assert trees[0].tree.tokens.tolist() == trees[1].tree.tokens.tolist()
        assert trees[0].tree.parents.tolist() == trees[1].tree.parents.tolist()
        torch.testing.assert_close(trees[0].confidence, trees[1].confidence, rtol=1e-3, atol=1e-5)
    # a masked pass after a short history, where each listed slot weighs: rows at slots 7..9
    # seeing slots 0..3 and their own pick of 4..6 (which an earlier pass wrote)
    short = tokens[:5]
    for proposer in (fast, slow):
        proposer.start(short, 16)
        proposer.observe(0, features[:4], short)
        proposer._flush()
        proposer._run(features[4:7, : fast.head.config.hidden_size], tokens[4:7], 4)  # slots 4..6
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[:, :4] = True
    mask[0, 4], mask[1, 5], mask[2, 4:7] = True, True, True
    mask[torch.arange(3), torch.arange(7, 10)] = True
    hidden = torch.randn(3, fast.head.config.hidden_size, generator=generator)
    positions = torch.tensor([5, 5, 6])
    outputs = [p._run(hidden, tokens[7:10], 7, positions, mask) for p in (fast, slow)]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)
    # a position past the bound cache's RoPE tables is refused (found in review: read beyond
    # the tables, NaN or garbage that changed run to run)
    capacity = fast.k_cache.shape[1]
    for bad in (torch.tensor([5, 5, capacity]), torch.tensor([5, -1, 6])):
        with pytest.raises(SpecDecodeError, match=rf"positions must be 3 values in 0..{capacity - 1}"):
            fast._run(hidden, tokens[7:10], 7, bad, mask)


def test_a_proposer_built_without_the_kernels_drafts_through_torch_whoever_packed_the_head(targets):
    """Found in review: the packed Q8_0 projections live on the head, so a proposer built
    with kernels=False drafted through them once another proposer of the same head (a
    server's row) had packed it (its logits moved by 0.08)."""
    import copy

    from specdecode import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    target = targets[1]
    head = random_head(target, 7)
    pristine = copy.deepcopy(head)  # the same weights, never packed
    tokens = [5, 9, 14, 22, 5, 9, 30, 31]
    target.runtime.reset(len(tokens) + 1)
    _, features = target.runtime(torch.tensor([tokens[:-1]]), capture=head.config.capture_layers)
    embed = lambda ids: target.runtime.weights.embed_rows(ids).float()  # noqa: E731

    def last_logits(proposer: EagleProposer) -> torch.Tensor:
        proposer.start(tokens, 32)
        proposer.observe(0, features[0], tokens)
        proposer._flush()
        return proposer.last_logits

    reference = last_logits(EagleProposer(pristine, embed, kernels=False))
    assert EagleProposer(head, embed, kernels=True).kernels and head.fast is not None
    assert torch.equal(last_logits(EagleProposer(head, embed, kernels=False)), reference)


def test_sampled_drafts_carry_their_distribution_on_the_full_vocabulary(targets):
    target = targets[0]
    head = random_head(target, 3, draft_vocab=40)
    proposer = proposer_for(target, head)
    prompt = [4, 8, 15, 16, 23, 42]
    runtime = target.runtime
    proposer.start(prompt, 32)
    runtime.reset(32)
    _, features = runtime(torch.tensor([prompt[:-1]]), capture=proposer.capture)
    proposer.observe(0, features[0], prompt)
    params = SamplingParams(temperature=0.9, top_k=10, max_new_tokens=8)
    proposal = proposer.propose(prompt, 4, params, torch.Generator().manual_seed(0))
    probs = proposal.draft_probs
    assert probs.shape == (4, 97)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    outside = torch.ones(97, dtype=torch.bool)
    outside[head.d2t] = False
    assert probs[:, outside].sum() == 0 and ((probs > 0).sum(-1) <= 10).all()
    assert all(probs[i, t] > 0 for i, t in enumerate(proposal.draft_ids.tolist()))


def test_head_files_round_trip_and_bad_heads_are_refused(targets, tmp_path):
    target = targets[0]
    head = random_head(target, 1)
    head.save(tmp_path / "head")
    loaded = EagleHead.load(tmp_path / "head")
    assert torch.equal(loaded.d2t, head.d2t) and loaded.config == head.config
    for name, parameter in head.state_dict().items():  # weights stored in bf16
        if parameter.is_floating_point():
            torch.testing.assert_close(loaded.state_dict()[name], parameter.to(torch.bfloat16).float())
    proposer = build_proposer(SpeculativeConfig(method="eagle", draft=str(tmp_path / "head")), target, None)
    assert proposer.capture == (0, 1, 2)  # under 7 layers: distinct and ascending, as vLLM reads them
    with pytest.raises(ConfigError, match="not a directory"):
        build_proposer(SpeculativeConfig(method="eagle", draft=str(tmp_path / "missing")), target, None)
    other = load_model(save_tiny_model(tmp_path / "wide", seed=2, num_layers=3, vocab_size=120), torch.float32)
    with pytest.raises(Exception, match="trained for a target with 97 tokens"):
        build_proposer(SpeculativeConfig(method="eagle", draft=str(tmp_path / "head")), other, None)
    with pytest.raises(ConfigError, match="needs --head HEAD_DIR"):
        build_proposer(SpeculativeConfig(method="eagle"), target, None)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_heads_export_to_vllm_layouts_and_import_back(targets, tmp_path, fmt):
    """A head written in vLLM's eagle3 (EAGLE-3) or the speculators layout carries their
    names and vocabulary maps (d2t offsets, t2d mask), and loads back to the same head:
    same weights, same vocabulary, the same proposals."""
    import json

    from safetensors.torch import load_file
    from specdecode.proposers.eagle_formats import export_head

    target = targets[0]
    head = random_head(target, 4)
    with torch.no_grad():  # norms other than 1, so a mix-up of their names changes the drafts (found in review)
        for parameter in head.parameters():
            parameter.normal_(mean=1.0, std=0.3) if parameter.dim() == 1 else None
    head.save(tmp_path / "ours")  # bf16, like the export
    ours = EagleHead.load(tmp_path / "ours")
    embed = target.runtime.weights.embed_rows(torch.arange(target.runtime.vocab_size)).float()
    export_head(ours, tmp_path / fmt, fmt, verifier="tiny", max_positions=256, embed=embed,
                verifier_architectures=["MistralForCausalLM"])
    tensors = load_file(str(tmp_path / fmt / "model.safetensors"))
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    layer = "midlayer." if fmt == "eagle3" else "layers.0."
    assert tensors[layer + "self_attn.q_proj.weight"].shape == (head.config.num_heads * head.config.head_dim,
                                                              2 * head.config.hidden_size)
    assert torch.equal(tensors["d2t"] + torch.arange(60), head.d2t)  # offsets: target = draft + d2t[draft]
    # vLLM's names, written out here rather than read from the exporter's table (a mix-up in
    # that table survives a round trip through it): llama_eagle3 norms the embedding with
    # input_layernorm, the fused feature with hidden_norm, the MLP's input with post_attention_layernorm
    theirs = {"input_norm.weight": "input_layernorm.weight", "hidden_norm.weight": "hidden_norm.weight",
              "post_norm.weight": "post_attention_layernorm.weight", "q_proj.weight": "self_attn.q_proj.weight",
              "k_proj.weight": "self_attn.k_proj.weight", "v_proj.weight": "self_attn.v_proj.weight",
              "o_proj.weight": "self_attn.o_proj.weight", "gate_proj.weight": "mlp.gate_proj.weight",
              "up_proj.weight": "mlp.up_proj.weight", "down_proj.weight": "mlp.down_proj.weight"}
    # every layer tensor (found in review: half were listed); the rest: fc, norm, lm_head, d2t
    assert len(theirs) == len(ours.state_dict()) - 4
    for name, their_name in theirs.items():
        assert torch.equal(tensors[layer + their_name].float(), ours.state_dict()[name].float()), name
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 60 and bool(tensors["t2d"][head.d2t].all())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["norm_before_residual"] is False
    if fmt == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 60
        assert "embed_tokens.weight" not in tensors
    else:
        assert config["speculators_config"]["verifier"] == {"name_or_path": "tiny",
                                                            "architectures": ["MistralForCausalLM"]}
        assert config["transformer_layer_config"]["num_hidden_layers"] == 1
        # in the target's own dtype, so vLLM shares the target's (found in review: written as bf16)
        assert tensors["embed_tokens.weight"].dtype == embed.dtype and torch.equal(tensors["embed_tokens.weight"], embed)
        with pytest.raises(SpecDecodeError, match="names its verifier"):
            export_head(ours, tmp_path / "unnamed", fmt, embed=embed)
    back = EagleHead.load(tmp_path / fmt)
    assert back.config == ours.config and torch.equal(back.d2t, ours.d2t)
    for name, parameter in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], parameter), name
    prompt = [5, 9, 14, 3, 7, 22, 9, 14]
    committed = prompt + [3]
    assert fresh_proposal(target, back, committed, 4) == fresh_proposal(target, ours, committed, 4)
    # RoPE in transformers 5's layout (theta inside rope_parameters) is read, scaled RoPE refused
    # (found in review: the top-level rope_theta alone was read, so 500000 loaded as 10000)
    llama = config if fmt == "eagle3" else config["transformer_layer_config"]
    llama.pop("rope_theta")
    llama["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / fmt / "config.json").write_text(json.dumps(config))
    assert EagleHead.load(tmp_path / fmt).config.rope_theta == 500000.0
    llama["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (tmp_path / fmt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="RoPE scaling"):
        EagleHead.load(tmp_path / fmt)
    llama["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    # the layers it reads may sit in eagle_config, where vLLM looks for them too
    layers = config.pop("eagle_aux_hidden_state_layer_ids")
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 1]}
    (tmp_path / fmt / "config.json").write_text(json.dumps(config))
    # in ascending order, as vLLM gathers them whatever the list's order (found in review)
    assert EagleHead.load(tmp_path / fmt, target_layers=3).config.capture_layers == (0, 1, 2)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}
    (tmp_path / fmt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="twice"):
        EagleHead.load(tmp_path / fmt, target_layers=3)
    config["eagle_aux_hidden_state_layer_ids"] = layers
    # a head trained with its own embedding drafts from another model than ours would
    config["embed_requires_grad"] = True
    (tmp_path / fmt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="embed_requires_grad"):
        EagleHead.load(tmp_path / fmt)
    config["embed_requires_grad"] = False
    # a variant this head does not compute is refused by name
    config["norm_before_residual"] = True
    (tmp_path / fmt / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="norm_before_residual = true"):
        EagleHead.load(tmp_path / fmt)
    if fmt == "speculators":  # absent, vLLM reads it as true and speculators as false (found in review: loaded)
        del config["norm_before_residual"]
        (tmp_path / fmt / "config.json").write_text(json.dumps(config))
        with pytest.raises(SpecDecodeError, match="does not say norm_before_residual"):
            EagleHead.load(tmp_path / fmt)
    config["norm_before_residual"] = False
    (tmp_path / fmt / "config.json").write_text(json.dumps(config))
    # a reduced vocabulary without its d2t map: which token each draft id is, unknown (found
    # in review: it loaded as the first 60 ids and drafted other tokens than it learnt)
    from safetensors.torch import save_file
    del tensors["d2t"]
    save_file(tensors, str(tmp_path / fmt / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match="no d2t map"):
        EagleHead.load(tmp_path / fmt)


def test_an_imported_heads_own_embedding_is_what_it_drafts_with(tmp_path):
    """Found in review: a speculators checkpoint's embed_tokens.weight was dropped, so a head
    that stores an embedding other than the target's drafted from the target's, where vLLM
    drafts from the stored one; and `train export` wrote the runtime's quantized copy of
    the target's embedding (Q8_0 under --weights int8), not the checkpoint's."""
    from safetensors.torch import load_file, save_file

    from specdecode.factory import checkpoint_embedding, eagle_proposer
    from specdecode.proposers.eagle_formats import export_head

    path = save_tiny_model(tmp_path / "target", seed=33, num_layers=3)
    target = load_model(path, torch.float32, weights="int8")
    stored = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].float()
    quantized = target.runtime.weights.embed.dequantize().float()
    assert not torch.equal(quantized, stored) and torch.equal(checkpoint_embedding(target), stored)
    head = random_head(target, 5)
    export_head(head, tmp_path / "head", "speculators", verifier="tiny", max_positions=256, embed=stored)
    ids = torch.arange(10)
    proposer = eagle_proposer(str(tmp_path / "head"), target)
    assert torch.equal(proposer.embed_rows(ids), target.runtime.weights.embed_rows(ids).float())  # the target's own
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    other = torch.randn_like(tensors["embed_tokens.weight"].float())
    tensors["embed_tokens.weight"] = other.to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "head" / "model.safetensors"))
    proposer = eagle_proposer(str(tmp_path / "head"), target)
    assert torch.equal(proposer.embed_rows(ids), other.to(torch.bfloat16).float()[ids])
    # exported again, in either layout, it keeps that embedding (found in review: the
    # speculators layout got the target's in its place and eagle3 none)
    for fmt in ("speculators", "eagle3"):
        export_head(EagleHead.load(tmp_path / "head"), tmp_path / f"again-{fmt}", fmt, verifier="tiny",
                    max_positions=256, embed=stored)
        again = eagle_proposer(str(tmp_path / f"again-{fmt}"), target)
        assert torch.equal(again.embed_rows(ids), other.to(torch.bfloat16).float()[ids]), fmt


def test_heads_whose_layers_vllm_would_read_in_another_order_are_not_exported(targets, tmp_path):
    """vLLM gathers each captured layer once, in ascending order: a head that reads them in
    another order, or one twice, would be fed other features there (found in review: small
    targets got (2, 1, 0) and (2, 2, 1))."""
    from specdecode.models.llama import LlamaConfig
    from specdecode.proposers.eagle_formats import export_head

    cfg = targets[0].runtime.cfg
    assert [EagleConfig.for_target(LlamaConfig(**{**cfg.__dict__, "num_layers": n}), 8).capture_layers
            for n in (2, 3, 4, 6, 7, 30)] == [(0, 1, 1), (0, 1, 2), (0, 2, 3), (0, 3, 5), (2, 3, 4), (2, 15, 27)]
    head = random_head(targets[0], 2)
    head.config.capture_layers = (2, 1, 0)
    with pytest.raises(SpecDecodeError, match="ascending"):
        export_head(head, tmp_path / "out", "eagle3")


def _damaged(source, target, how: str):
    """A copy of the head directory ``source`` with one thing wrong."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    config_path, tensors_path = target / "config.json", target / "model.safetensors"
    config, tensors = json.loads(config_path.read_text()), load_file(str(tensors_path))
    layer = next((p for p in ("midlayer.", "layers.0.") if p + "self_attn.q_proj.weight" in tensors), "")
    if how == "config field missing":
        del config["head_dim"]
    elif how == "config not an object":
        config = [config]
    elif how == "config not UTF-8":  # UTF-16's byte-order mark (PowerShell's >): a UnicodeDecodeError traceback before
        save_file(tensors, str(tensors_path))
        config_path.write_bytes(b"\xff\xfe" + json.dumps(config).encode("utf-16-le"))
        return target
    elif how == "size a string":  # found in review: a TypeError from torch
        config["draft_vocab_size"] = str(config["draft_vocab_size"])
    elif how == "extra tensor":
        tensors[layer + "self_attn.q_proj.bias"] = torch.zeros(8)
    elif how == "wrong shape":
        tensors[layer + "mlp.up_proj.weight" if layer else "up_proj.weight"] = torch.zeros(3, 3)
    elif how == "d2t outside the vocabulary":
        key = "d2t"
        tensors[key] = tensors[key].clone()
        tensors[key][-1] = 10_000 if not layer else 10_000 - 59
    elif how == "d2t twice":
        tensors["d2t"] = tensors["d2t"].clone()
        if layer:  # offsets: make draft id 1 map where draft id 0 does
            tensors["d2t"][1] = tensors["d2t"][0] - 1
        else:
            tensors["d2t"][1] = tensors["d2t"][0]
    elif how == "t2d disagrees":
        tensors["t2d"] = ~tensors["t2d"]
    elif how == "NaN weights":  # found in review: loaded, and `check` called the head compatible
        key = layer + "mlp.up_proj.weight" if layer else "up_proj.weight"
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = float("nan")
    else:  # cut short
        tensors_path.write_bytes(tensors_path.read_bytes()[:100])
        return target
    config_path.write_text(json.dumps(config))
    save_file(tensors, str(tensors_path))
    return target


@pytest.mark.parametrize("fmt, how, problem", [
    ("ours", "config field missing", "config.json lacks head_dim"),
    ("ours", "extra tensor", "tensors do not fit the config"),
    ("ours", "wrong shape", "tensors do not fit the config"),
    ("ours", "d2t outside the vocabulary", "outside \\[0, 97\\)"),
    ("ours", "d2t twice", "names a target id twice"),
    ("ours", "cut short", "not a readable safetensors file"),
    ("ours", "NaN weights", "tensor 'up_proj.weight' holds NaN or infinite values"),
    ("eagle3", "NaN weights", "tensor 'midlayer.mlp.up_proj.weight' holds NaN or infinite values"),
    ("ours", "config not an object", "not a JSON object"),
    ("ours", "config not UTF-8", "config.json is not valid JSON"),
    ("ours", "size a string", "draft_vocab_size must be an integer >= 1, got '60'"),
    ("eagle3", "size a string", "draft_vocab_size must be an integer >= 1, got '60'"),
    ("eagle3", "extra tensor", "q_proj.bias'\\], which this EAGLE head does not compute"),
    ("eagle3", "d2t outside the vocabulary", "outside \\[0, 97\\)"),
    ("eagle3", "d2t twice", "names a target id twice"),
    ("eagle3", "t2d disagrees", "t2d .* disagrees with its d2t"),
    ("speculators", "extra tensor", "which this EAGLE head does not compute"),
])
def test_damaged_heads_are_refused_by_name(targets, tmp_path, fmt, how, problem):
    """Found in review: each of these ended in a traceback (a missing field, a corrupt file),
    failed only when drafting (a d2t outside the vocabulary), or loaded and drafted from a
    different model (an extra tensor of an imported head was dropped)."""
    from specdecode.config import SpecDecodeError
    from specdecode.proposers.eagle_formats import export_head

    head = random_head(targets[0], 4)
    head.save(tmp_path / "ours")
    if fmt != "ours":
        export_head(EagleHead.load(tmp_path / "ours"), tmp_path / fmt, fmt, verifier="tiny")
    broken = _damaged(tmp_path / fmt, tmp_path / "broken", how)
    with pytest.raises(SpecDecodeError, match=problem):
        EagleHead.load(broken)


def test_the_cost_profile_times_real_head_passes(targets):
    """measure_drafter shows a head drafter target features first, so its proposals are
    real drafts (an unfed head would propose nothing and look free)."""
    from specdecode.cost.profile import measure_drafter

    target = targets[0]
    proposer = Recording(random_head(target, 4), lambda ids: target.runtime.weights.embed_rows(ids).float())
    assert measure_drafter(proposer, 24, 97, repeats=2, k=3) > 0
    assert proposer.seen and all(len(drafts) == 3 for _, _, drafts in proposer.seen)
    assert proposer.length == 23


def test_check_understands_heads(targets, tmp_path):
    from specdecode.analysis.compat import check_static

    target = targets[0]
    random_head(target, 1).save(tmp_path / "head")
    target_dir = str(target.source.path)
    result = check_static(target_dir, str(tmp_path / "head"))
    assert result.compatible and any(name == "captured layers" for name, _, _ in result.lines)
    assert check_static(target_dir, f"eagle:{tmp_path / 'head'}").compatible
    other = save_tiny_model(tmp_path / "two-layers", seed=2, num_layers=2)
    bad = check_static(str(other), str(tmp_path / "head"))
    assert not bad.compatible and "reads the inputs of layers [0, 1, 2] of 2" in str(bad.lines)
    assert not check_static(target_dir, f"eagle:{tmp_path / 'nothing'}").compatible
    # a head trained for another model of the same sizes is said to be (it printed OK and that name)
    random_head(target, 1).save(tmp_path / "foreign", {"target": "some-other-model"})
    foreign = check_static(target_dir, str(tmp_path / "foreign"))
    assert ("trained for", "WARN") in [(name, status) for name, status, _ in foreign.lines], foreign.lines
    # a head in vLLM's layouts is read as a head too (found in review: as a draft model)
    from specdecode.proposers.eagle_formats import export_head

    for fmt in ("eagle3", "speculators"):
        export_head(EagleHead.load(tmp_path / "head"), tmp_path / fmt, fmt, verifier="tiny")
        exported = check_static(target_dir, str(tmp_path / fmt))
        assert exported.compatible and any(name == "captured layers" for name, _, _ in exported.lines), fmt


def test_a_head_trained_for_another_checkpoint_warns_at_load(targets, tmp_path, capsys):
    """Found in review: a head trained for another model of the same sizes was taken without
    a word (lossless, acceptance 0). Its recipe's checkpoint digest decides, not the name."""
    from specdecode.factory import load_head
    from specdecode.train.data import checkpoint_identity

    target = targets[0]
    ours = checkpoint_identity(target.source)
    random_head(target, 1).save(tmp_path / "other", {"target": str(target.source.name),
                                                     "recipe": {"target": "llama 0123456789ab|kernels backend"}})
    load_head(str(tmp_path / "other"), target)
    assert f"trained for checkpoint 'llama 0123456789ab', not {ours!r}" in capsys.readouterr().err
    # the same checkpoint under another name (a moved directory) is the same target
    random_head(target, 1).save(tmp_path / "same", {"target": "/old/place", "recipe": {"target": f"{ours}|torch"}})
    load_head(str(tmp_path / "same"), target)
    assert "warning" not in capsys.readouterr().err
    random_head(target, 1).save(tmp_path / "named", {"target": "some-other-model"})  # no recipe: the name decides
    load_head(str(tmp_path / "named"), target)
    assert "trained for some-other-model, not" in capsys.readouterr().err


@pytest.mark.parametrize("width", [2, 3])
def test_eagle_trees_are_lossless_and_well_formed(targets, width):
    """Greedy output through dynamic trees equals plain decoding (fp32 torch backend and the
    exact kernels backend), and every proposed tree is closed under parents with distinct
    tokens among siblings."""
    rng = random.Random(width)
    trees = []
    for target in targets:
        plain = SpeculativeEngine(target.runtime)
        for seed in range(2):
            proposer = proposer_for(target, random_head(target, 10 + seed))
            proposer.tree_width = width
            original = proposer.propose_tree

            def recording(*args, original=original):
                proposal = original(*args)
                trees.append((args[1], proposal.tree))
                return proposal

            proposer.propose_tree = recording
            for budget in (2, 5, 9):
                engine = SpeculativeEngine(target.runtime, proposer=proposer, k=budget)
                prompt = [rng.randrange(3, 97) for _ in range(rng.randint(2, 10))]
                result = engine.generate(prompt, GREEDY)
                assert result.token_ids == plain.generate(prompt, GREEDY).token_ids, (width, budget, prompt)
    assert trees
    for budget, tree in trees:
        assert 1 <= tree.size <= budget
        children = tree.children()
        tokens = tree.tokens.tolist()
        for kids in children:
            assert len({tokens[c - 1] for c in kids}) == len(kids) <= width
    assert any(int(tree.depths().max()) >= 2 and tree.size > int(tree.depths().max()) for _, tree in trees)


@pytest.mark.parametrize("width", [3, 4])
def test_wide_trees_near_the_end_of_a_request_fit_the_heads_cache(tmp_path, width):
    """A tree step writes its expanded nodes after the committed entries of the head's
    cache (up to ``width`` per pass): near the end of a short request, with a large fixed
    budget, that is more than the sequence's own room. A fresh proposer per request, so no
    earlier, longer request has left a larger cache behind."""
    for backend in ("torch", "kernels"):  # flatter target distributions than the fixture's: deep trees
        target = load_model(save_tiny_model(tmp_path / backend, seed=30, num_layers=2, init_std=0.3), torch.float32,
                            backend=backend)
        plain = SpeculativeEngine(target.runtime)
        for k, new_tokens in ((7, 8), (8, 9), (10, 9), (8, 10)):
            proposer = proposer_for(target, random_head(target, 0))
            proposer.tree_width = width
            engine = SpeculativeEngine(target.runtime, proposer=proposer, k=k)
            params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
            prompt = [5, 9, 14, 22, 5, 9]
            result = engine.generate(prompt, params)
            assert result.token_ids == plain.generate(prompt, params).token_ids, (width, k, new_tokens)


def test_auto_tree_budgets_are_lossless(targets):
    """--k auto for trees (TreeBudget): budgets and trims vary per step, output does not."""
    from specdecode.control.policies import CostModel, TreeBudget
    from specdecode.cost.profile import CostProfile
    from specdecode.proposers.merged_tree import MergedTreeProposer
    from specdecode.proposers.ngram import NgramProposer

    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4, 8, 16],
                          step_ms=[[10, 11, 12, 14, 18]], drafters={"eagle": 0.02})
    rng = random.Random(7)
    sizes = []
    for target in targets:
        plain = SpeculativeEngine(target.runtime)
        for seed in range(2):
            eagle = proposer_for(target, random_head(target, 30 + seed))
            eagle.tree_width = 3
            for proposer in (eagle, MergedTreeProposer(NgramProposer((3, 2, 1)), eagle)):
                policy = TreeBudget(CostModel(profile, "eagle"), k_max=8)
                engine = SpeculativeEngine(target.runtime, proposer=proposer, k=policy)
                base = [rng.randrange(3, 97) for _ in range(4)]
                prompt = base * 3 + [rng.randrange(3, 97) for _ in range(rng.randint(0, 4))]
                result = engine.generate(prompt, GREEDY)
                assert result.token_ids == plain.generate(prompt, GREEDY).token_ids, (seed, proposer.name, prompt)
                sizes += policy.kept_sizes
    assert len(set(sizes)) >= 3 and max(sizes) >= 3  # trimmed to different sizes per step


def test_merged_trees_are_lossless_and_hold_both_drafters(targets):
    """--method tree: prompt lookup's chain and the head's tree in one tree; greedy output
    equals plain decoding, and the n-gram continuation is a path of every merged tree."""
    from specdecode.proposers.merged_tree import MergedTreeProposer
    from specdecode.proposers.ngram import NgramProposer

    rng = random.Random(5)
    for target in targets:
        plain = SpeculativeEngine(target.runtime)
        eagle = proposer_for(target, random_head(target, 21))
        eagle.tree_width = 2
        merged = MergedTreeProposer(NgramProposer((3, 2, 1)), eagle)
        checked_paths = 0
        for budget in (2, 4, 8):
            engine = SpeculativeEngine(target.runtime, proposer=merged, k=budget)
            base = [rng.randrange(3, 97) for _ in range(5)]
            prompt = base * 3 + [rng.randrange(3, 97)]
            result = engine.generate(prompt, GREEDY)
            assert result.token_ids == plain.generate(prompt, GREEDY).token_ids, (budget, prompt)
            # the n-gram chain is inside the merged tree
            tokens = base * 2 + base[:2]  # ends in a repeat: prompt lookup has a continuation
            chain = merged.ngram.propose(tokens, budget - 1, GREEDY, None).draft_ids.tolist()
            eagle.start(tokens, len(tokens) + budget + 1)
            runtime = target.runtime
            runtime.reset(len(tokens) + 1)
            _, features = runtime(torch.tensor([tokens[:-1]]), capture=eagle.capture)
            eagle.observe(0, features[0], tokens)
            tree = merged.propose_tree(tokens, budget, GREEDY, None).tree
            assert 1 <= tree.size <= budget
            kids = tree.children()
            # the head's half: its best first token (a tree of one node) is a child of the root
            # (found in review: a merge that dropped every head node passed this test)
            best = int(eagle.propose_tree(tokens, 1, GREEDY, None).tree.tokens[0])
            assert best in {int(tree.tokens[c - 1]) for c in kids[0]}, (budget, chain)
            if chain:
                node, walked = 0, []
                for token in chain:
                    node = next(c for c in kids[node] if int(tree.tokens[c - 1]) == token)
                    walked.append(token)
                assert walked == chain
                checked_paths += 1
        assert checked_paths > 0


def test_eagle_chains_and_trees_through_the_factory(tmp_path):
    """The check tests/test_cuda.py runs on a GPU, here on the CPU's torch backend."""
    from test_cuda import eagle_on

    eagle_on("cpu", tmp_path)


def test_a_tree_never_outgrows_the_prefill_chunk(tmp_path):
    """A tree is scored in one pass, so its nodes and the root fit one prefill chunk. Found in
    review: --prefill-chunk 8 with an EAGLE tree of k = 10 was refused mid-request ("a token
    tree of 11 nodes exceeds prefill_chunk = 8"); the budget now shrinks to fit, and the
    output stays plain decoding's."""
    path = save_tiny_model(tmp_path / "t", seed=32, num_layers=3)
    target = load_model(path, torch.float32, backend="torch", prefill_chunk=8)
    proposer = EagleProposer(random_head(target, 0), lambda ids: target.runtime.weights.embed_rows(ids).float(),
                             tree_width=3)
    result = SpeculativeEngine(target.runtime, proposer=proposer, k=10).generate([5, 6, 7], GREEDY)
    assert result.token_ids == SpeculativeEngine(target.runtime).generate([5, 6, 7], GREEDY).token_ids
    assert result.stats.draft_tokens > 0 and max(result.stats.steps_by_drafted) == 7


def test_a_tree_larger_than_a_prefill_chunk_is_refused_not_cut(tmp_path):
    """Found in review: a tree of k nodes is scored with the last token in one prefill
    chunk, and a larger k was cut to chunk - 1 without a word (to no drafts at all with
    --prefill-chunk 1, still labelled k = 4); an adaptive budget is capped there."""
    from specdecode.factory import build_policy

    path = save_tiny_model(tmp_path / "t", seed=34, num_layers=3)
    target = load_model(path, torch.float32, prefill_chunk=4)
    proposer = EagleProposer(random_head(target, 6), lambda ids: target.runtime.weights.embed_rows(ids).float(),
                             tree_width=3)
    with pytest.raises(ConfigError, match="k must be below 4, got 4"):
        build_policy(SpeculativeConfig(method="eagle", k=4), target, proposer, "fp32")
    assert build_policy(SpeculativeConfig(method="eagle", k=3), target, proposer, "fp32").k_max == 3
    assert build_policy(SpeculativeConfig(method="eagle", k="auto"), target, proposer, "fp32").k_max == 3


def test_engines_handed_a_head_of_another_vocabulary_refuse_it(targets):
    """Found in review: the engines checked only a draft model's vocabulary, so a head trained
    for a 120-token target, handed to an engine directly, failed in the middle of a request
    (an index error greedy, a size mismatch sampling), and so did a merged tree holding it."""
    from specdecode.config import VocabularyMismatchError
    from specdecode.proposers.merged_tree import MergedTreeProposer
    from specdecode.proposers.ngram import NgramProposer
    from specdecode.serve.batch import BatchEngine

    target = targets[0]
    head = EagleHead(EagleConfig.for_target(target.runtime.cfg, 60))
    head.config.target_vocab_size = target.runtime.vocab_size + 23
    eagle = proposer_for(target, head)
    for proposer in (eagle, MergedTreeProposer(NgramProposer((3, 2, 1)), eagle)):
        with pytest.raises(VocabularyMismatchError, match="trained for a target of"):
            SpeculativeEngine(target.runtime, None, proposer, k=2)
    batch = BatchEngine(target.runtime)
    with pytest.raises(VocabularyMismatchError, match="trained for a target of"):
        batch.add([5, 6, 7], SamplingParams(max_new_tokens=4), proposer=eagle)


def test_engines_handed_heads_or_a_store_that_do_not_fit_the_target_refuse_them(targets):
    """Found in review: the engines' check read only an EAGLE head's vocabulary and a draft
    model's. Medusa heads and a token store of another vocabulary ran, drafting ids the
    target has not (nothing accepted, nothing said); a head of another hidden size failed
    after prefill with torch's shape error."""
    from specdecode.config import VocabularyMismatchError
    from specdecode.proposers.medusa import MedusaConfig, MedusaHeads, MedusaProposer
    from specdecode.proposers.suffix import SuffixProposer, TokenStore
    from specdecode.serve.batch import BatchEngine

    target = targets[0]
    cfg = target.runtime.cfg
    vocab, width = target.runtime.vocab_size, cfg.hidden_size
    medusa = MedusaHeads(MedusaConfig(width, 2, vocab + 23, 40, cfg.rms_norm_eps))
    narrow = MedusaHeads(MedusaConfig(width // 2, 2, vocab, 40, cfg.rms_norm_eps))
    head = EagleHead(dataclasses.replace(EagleConfig.for_target(cfg, 60), hidden_size=width // 2))
    store = SuffixProposer(TokenStore([[5, 6, 7, 8, vocab + 10]], vocab_size=vocab + 50))
    cases = [(MedusaProposer(medusa, target.runtime.num_layers, kernels=False), VocabularyMismatchError,
              "the Medusa heads were trained for a target of"),
             (MedusaProposer(narrow, target.runtime.num_layers, kernels=False), SpecDecodeError,
              f"hidden size {width // 2}; this target's is {width}"),
             (proposer_for(target, head), SpecDecodeError, f"hidden size {width // 2}; this target's is {width}"),
             (store, VocabularyMismatchError, f"the token store was built for {vocab + 50}")]
    batch = BatchEngine(target.runtime)
    for proposer, error, message in cases:
        with pytest.raises(error, match=message):
            SpeculativeEngine(target.runtime, None, proposer, k=2)
        with pytest.raises(error, match=message):
            batch.add([5, 6, 7], SamplingParams(max_new_tokens=4), proposer=proposer)


def _llama_cfg(num_layers: int = 3, **fields):
    from specdecode.models.llama import LlamaConfig

    return LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                                **fields})


def test_a_heads_config_for_a_target_takes_its_sizes_and_refuses_scaled_rope():
    """The draft vocabulary is at most the target's (a larger one would map drafts to ids
    the target lacks), an intermediate size asked for is taken, the target's RoPE theta is
    read, and a target that scales RoPE is refused (the head computes default RoPE only)."""
    config = EagleConfig.for_target(_llama_cfg(32, rope_theta=500000.0), 1000)
    assert (config.draft_vocab_size, config.target_vocab_size, config.intermediate_size) == (97, 97, 128)
    assert config.capture_layers == (2, 16, 29) and config.rope_theta == 500000.0
    assert EagleConfig.for_target(_llama_cfg(), 60, intermediate_size=32).intermediate_size == 32
    scaled = _llama_cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    with pytest.raises(SpecDecodeError, match="EAGLE heads support default RoPE only, the target uses 'llama3'"):
        EagleConfig.for_target(scaled, 60)


def test_the_heads_rope_is_the_targets():
    """The head rotates queries and keys by the target's RoPE tables (a head trained or
    imported for the target reads positions as the target does)."""
    from specdecode.models.llama import rope_tables

    cfg = _llama_cfg(rope_theta=500000.0, max_position_embeddings=256)
    head = EagleHead(EagleConfig.for_target(cfg, 60))
    cos, sin = head.rope(torch.arange(256))
    target_cos, target_sin = rope_tables(cfg, None)
    torch.testing.assert_close(cos, target_cos, rtol=0, atol=1e-4)
    torch.testing.assert_close(sin, target_sin, rtol=0, atol=1e-4)


def test_the_training_pass_reads_no_later_position():
    """``unrolled``'s row p, at every step, depends on the features and embeddings at
    positions <= p only (found by a mutation audit: without the causal mask training read
    the future, and every test passed: they compare the last row only)."""
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(_llama_cfg(), 60))
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 8, 3 * 64, generator=generator)
    embeds = [torch.randn(1, 8, 64, generator=generator) for _ in range(3)]
    later_features, later_embeds = features.clone(), [embed.clone() for embed in embeds]
    later_features[:, 5:] = torch.randn(1, 3, 3 * 64, generator=generator)
    for embed in later_embeds:
        embed[:, 5:] = torch.randn(1, 3, 64, generator=generator)
    with torch.no_grad():
        before = head.unrolled(features, embeds, torch.arange(8))
        after = head.unrolled(later_features, later_embeds, torch.arange(8))
    for step, (old, new) in enumerate(zip(before, after)):
        torch.testing.assert_close(new[:, :5], old[:, :5], rtol=0, atol=1e-5, msg=f"step {step}")
        assert not torch.allclose(new[:, 5:], old[:, 5:])


def test_the_packed_projections_compute_what_the_torch_ones_do():
    """Each fused projection through the kernels (Q8_0) is the torch modules' up to its
    rounding, in the same order (a mutation audit: the torch path's q, v, k order passed,
    training and drafting on torch agreeing with each other)."""
    from specdecode import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(_llama_cfg(), 60))
    assert head.use_kernels()
    x = {"fc": torch.randn(5, 3 * 64), "qkv": torch.randn(5, 2 * 64), "o": torch.randn(5, 64),
         "gate_up": torch.randn(5, 64), "down": torch.randn(5, 128), "lm_head": torch.randn(5, 64)}
    with torch.no_grad():
        for name, rows in x.items():
            exact = head.project(name, rows, fast=False)
            assert (head.project(name, rows) - exact).abs().max() < 0.05 * exact.abs().max(), name


def _exported(tmp_path, fmt: str, draft_vocab: int = 60, **kwargs):
    """A small random head (no target model) exported in ``fmt``: (head, its directory,
    config.json as a dict)."""
    import json

    from specdecode.proposers.eagle_formats import export_head

    torch.manual_seed(7)
    head = EagleHead(EagleConfig.for_target(_llama_cfg(), draft_vocab))
    head.set_draft_vocab(torch.randperm(97)[:draft_vocab].sort().values)
    export_head(head, tmp_path / fmt, fmt, verifier="tiny", **kwargs)
    return head, tmp_path / fmt, json.loads((tmp_path / fmt / "config.json").read_text())


def test_exported_configs_carry_the_fields_vllm_and_speculators_read(tmp_path):
    """Found by a mutation audit: the context length, the speculators proposal's token
    count and the target hidden size could be left out of an exported config (or the first
    two ignored), or the tensors written in fp32 under a bf16 config, with every test
    passing."""
    from safetensors.torch import load_file

    for fmt in ("eagle3", "speculators"):
        head, directory, config = _exported(tmp_path, fmt, max_positions=256, speculative_tokens=5)
        llama = config if fmt == "eagle3" else config["transformer_layer_config"]
        assert llama["max_position_embeddings"] == 256, fmt
        assert (llama["hidden_size"], llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"],
                llama["intermediate_size"], llama["vocab_size"]) == (64, 4, 2, 16, 128, 97), fmt
        assert config["target_hidden_size"] == 64 and config["draft_vocab_size"] == 60, fmt
        tensors = load_file(str(directory / "model.safetensors"))
        expected = torch.zeros(97, dtype=torch.bool)
        expected[head.d2t] = True
        assert torch.equal(tensors["t2d"], expected), fmt
        assert {tensors[name].dtype for name in tensors if name not in ("d2t", "t2d")} == {torch.bfloat16}, fmt
    # stated, not left to defaults: vLLM reads a speculators config without norm_before_residual as true
    assert [config[flag] for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")] == [False] * 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5


def test_heads_vllm_would_feed_other_features_or_embeddings_are_not_exported(tmp_path):
    """Found by a mutation audit: a head reading a layer twice (a 2-layer target's (0, 1, 1))
    was exported, where vLLM gathers each layer once; and a target embedding of another
    shape than the head's was written into the speculators layout."""
    from specdecode.proposers.eagle_formats import export_head

    head = EagleHead(EagleConfig.for_target(_llama_cfg(), 60))
    head.config.capture_layers = (0, 1, 1)
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(SpecDecodeError, match="once, in ascending order"):
            export_head(head, tmp_path / fmt, fmt, verifier="tiny")
    head.config.capture_layers = (0, 1, 2)
    with pytest.raises(SpecDecodeError, match=r"target embedding \(96, 64\) does not fit the head \(97 x 64\)"):
        export_head(head, tmp_path / "narrow", "speculators", verifier="tiny", embed=torch.zeros(96, 64))
    assert not (tmp_path / "narrow").exists()


def test_imported_configs_are_read_where_vllm_reads_them_and_refused_where_the_head_differs(tmp_path):
    """Found by a mutation audit, each loading without an error (or with another's): the
    layers named in a speculators transformer_layer_config, or in no place (the EAGLE-3
    default for the target's layer count); a head_dim left out (hidden / heads);
    rope_parameters' theta beside a top-level rope_theta; a variant flag set in
    transformer_layer_config; two decoder layers; a target hidden size other than the
    head's; a speculators checkpoint of another algorithm; a size of 0; a d2t mapping to
    a target id of -1 or one past the vocabulary; an EAGLE-3 config known by its
    architectures alone (no draft_vocab_size: a full-vocabulary head)."""
    import json

    from safetensors.torch import load_file, save_file

    head, directory, config = _exported(tmp_path, "speculators")
    original = json.dumps(config)

    def load_with(change, **kwargs):
        config = json.loads(original)
        change(config, config["transformer_layer_config"])
        (directory / "config.json").write_text(json.dumps(config))
        return EagleHead.load(directory, **kwargs)

    def nested_layers(config, llama):
        llama["eagle_aux_hidden_state_layer_ids"] = config.pop("eagle_aux_hidden_state_layer_ids")

    assert load_with(nested_layers).config.capture_layers == (0, 1, 2)
    no_layers = lambda config, llama: config.pop("eagle_aux_hidden_state_layer_ids")  # noqa: E731
    assert load_with(no_layers, target_layers=8).config.capture_layers == (2, 4, 5)
    with pytest.raises(SpecDecodeError, match="does not name the target layers it reads"):
        load_with(no_layers)
    back = load_with(lambda config, llama: llama.pop("head_dim"))
    assert back.config.head_dim == 16 and torch.equal(back.d2t, head.d2t)
    # rope_parameters' own theta over the top-level one, as the target's loader reads them
    both = lambda config, llama: llama.update(rope_theta=10000.0,  # noqa: E731
                                              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert load_with(both).config.rope_theta == 500000.0

    def nested_flag(config, llama):
        del config["fc_norm"]
        llama["fc_norm"] = True

    refused = [(nested_flag, "fc_norm = true"),
               (lambda config, llama: llama.update(num_hidden_layers=2), "2 decoder layers"),
               (lambda config, llama: config.update(target_hidden_size=128), "target hidden size 128 differs"),
               (lambda config, llama: config.update(speculators_model_type="independent"), "not an EAGLE-3 head"),
               (lambda config, llama: llama.update(intermediate_size=0), "intermediate_size must be an integer >= 1")]
    for change, problem in refused:
        with pytest.raises(SpecDecodeError, match=problem):
            load_with(change)
    (directory / "config.json").write_text(original)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["t2d"]
    offsets = tensors["d2t"].clone()
    for draft_id, offset in ((59, 97 - 59), (0, -1)):  # draft id 59 -> target id 97, draft id 0 -> -1
        tensors["d2t"] = offsets.clone()
        tensors["d2t"][draft_id] = offset
        save_file(tensors, str(directory / "model.safetensors"))
        with pytest.raises(SpecDecodeError, match=r"outside \[0, 97\)"):
            EagleHead.load(directory)
    # an EAGLE-3 config is known by its architecture where a full-vocabulary head has no draft_vocab_size
    _, directory, config = _exported(tmp_path / "full", "eagle3", draft_vocab=97)
    del config["draft_vocab_size"]
    (directory / "config.json").write_text(json.dumps(config))
    assert torch.equal(EagleHead.load(directory).d2t, torch.arange(97))


def test_an_imported_head_reads_rope_and_its_maps_as_the_target_loader_does(tmp_path):
    """Found by a mutation audit, and fixed: a linear rope_scaling beside a default
    rope_parameters loaded as default RoPE (the target's loader reads rope_scaling first,
    as linear); a d2t map of the wrong length ended in torch's broadcasting RuntimeError;
    a draft_vocab_size of 0 was read as absent, the full vocabulary, and failed the same way."""
    import json

    from safetensors.torch import load_file, save_file

    _, directory, config = _exported(tmp_path, "eagle3")
    original = json.dumps(config)
    config.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="RoPE scaling .*linear.* is not supported"):
        EagleHead.load(directory)
    # a malformed RoPE entry names the head's config.json, not a bare one (read as the target's)
    (directory / "config.json").write_text(json.dumps({**json.loads(original), "rope_scaling": [1, 2]}))
    with pytest.raises(SpecDecodeError, match=f"^{re.escape(str(directory))}/config.json: rope_scaling must be an object"):
        EagleHead.load(directory)
    (directory / "config.json").write_text(json.dumps({**json.loads(original), "draft_vocab_size": 0}))
    with pytest.raises(SpecDecodeError, match="draft_vocab_size must be an integer >= 1"):
        EagleHead.load(directory)
    (directory / "config.json").write_text(original)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["t2d"]
    tensors["d2t"] = tensors["d2t"][:59].clone()
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match=r"d2t map has shape \(59,\), expected \(60,\)"):
        EagleHead.load(directory)


def test_a_heads_stored_embedding_is_the_targets_up_to_rounding_only():
    """Which embedding an imported head drafts with: its stored copy is the target's when it
    differs by rounding alone (bf16 here), and its own otherwise (another embedding, or
    another shape), which the head then drafts with, as vLLM does."""
    from specdecode.factory import same_embedding

    embedding = torch.randn(97, 64, generator=torch.Generator().manual_seed(0))
    assert same_embedding(embedding.to(torch.bfloat16), embedding)
    assert same_embedding(embedding.clone(), embedding)
    other = torch.randn(97, 64, generator=torch.Generator().manual_seed(1))
    assert not same_embedding(other, embedding)
    assert not same_embedding(embedding[:96], embedding)
    assert not same_embedding(embedding * 1.05, embedding)  # 5% off: beyond rounding


def test_a_head_for_another_hidden_size_or_a_deeper_target_is_refused_when_built(targets, tmp_path):
    """build_proposer refuses a saved head trained on states of another width, and one that
    reads a layer the target does not have, before any request runs."""
    from specdecode.config import EngineConfig, VocabularyMismatchError

    target = targets[0]
    cfg = target.runtime.cfg
    narrow = EagleHead(dataclasses.replace(EagleConfig.for_target(cfg, 60), hidden_size=cfg.hidden_size // 2))
    narrow.save(tmp_path / "narrow")
    with pytest.raises(VocabularyMismatchError, match="trained for a target with 97 tokens and hidden size 32"):
        build_proposer(SpeculativeConfig(method="eagle", draft=str(tmp_path / "narrow")), target,
                       EngineConfig(dtype="fp32"))
    deep = EagleHead(dataclasses.replace(EagleConfig.for_target(cfg, 60), capture_layers=(0, 1, 3)))
    deep.save(tmp_path / "deep")
    with pytest.raises(ConfigError, match="reads layer 3; the target has 3"):
        build_proposer(SpeculativeConfig(method="eagle", draft=str(tmp_path / "deep")), target,
                       EngineConfig(dtype="fp32"))


def test_build_proposer_gives_eagle_and_tree_drafters_the_configs_width_and_ngram_sizes(targets, tmp_path):
    """--tree-width reaches the head's drafter (eagle and tree) and --ngram-sizes the merged
    tree's prompt lookup."""
    from specdecode.config import EngineConfig

    target = targets[0]
    random_head(target, 2).save(tmp_path / "head")
    engine, draft = EngineConfig(dtype="fp32"), str(tmp_path / "head")
    assert build_proposer(SpeculativeConfig(method="eagle", draft=draft, tree_width=2), target, engine).tree_width == 2
    assert build_proposer(SpeculativeConfig(method="eagle", draft=draft), target, engine).tree_width == 3
    merged = build_proposer(SpeculativeConfig(method="tree", draft=draft, ngram_sizes=(4, 2), tree_width=2), target,
                            engine)
    assert merged.ngram.ngram_sizes == (4, 2) and merged.eagle.tree_width == 2


def test_train_export_cli_writes_both_layouts_with_k_and_the_targets_name(targets, tmp_path, capsys):
    """`specdecode train export`: the eagle3 layout's vLLM command line carries --k as
    num_speculative_tokens; the speculators config names the --target given as its verifier
    (the default model's Hugging Face name only for 'default') and proposes --k tokens."""
    import json

    from specdecode.cli import main

    target = targets[0]
    random_head(target, 4).save(tmp_path / "head")
    common = ["train", "export", "--head", str(tmp_path / "head"), "--model", str(target.source.path), "--k", "4",
              "--dtype", "fp32", "--weights", "fp32", "--backend", "torch"]
    assert main([*common, "--out", str(tmp_path / "e3")]) == 0
    out = capsys.readouterr().out
    assert f'"model": "{tmp_path / "e3"}", "num_speculative_tokens": 4' in out, out
    assert (tmp_path / "e3" / "model.safetensors").is_file()
    assert main([*common, "--out", str(tmp_path / "sp"), "--format", "speculators"]) == 0
    assert f"the speculators config names the verifier {target.source.path}" in capsys.readouterr().out
    config = json.loads((tmp_path / "sp" / "config.json").read_text())["speculators_config"]
    assert config["verifier"]["name_or_path"] == str(target.source.path)
    assert config["proposal_methods"][0]["speculative_tokens"] == 4
