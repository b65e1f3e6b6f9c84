"""Token trees: shapes, masks, and lossless verification (greedy and multi-draft sampling)."""

from __future__ import annotations

import pytest
import torch
from conftest import pooled_chisquare

from specdecode.config import SamplingParams
from specdecode.verify.chain import coupled_verify, greedy_verify
from specdecode.verify.sampling import logits_to_probs, sample
from specdecode.verify.tree import (Tree, coupled_tree_verify, greedy_tree_verify, tree_from_paths,
                                    tree_rejection_sample)


def tree(tokens, parents) -> Tree:
    return Tree(torch.tensor(tokens), torch.tensor(parents))


def test_tree_shape_depths_and_mask():
    t = tree([5, 6, 7, 8], [0, 0, 1, 3])  # root -> 5, 6; 5 -> 7 -> 8
    assert t.depths().tolist() == [0, 1, 1, 2, 3]
    assert t.children() == [[1, 2], [3], [], [4], []]
    assert t.path_to(4) == [1, 3, 4] and t.path_to(0) == []
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(t.mask(), expected)
    with pytest.raises(ValueError, match="parent must come before"):
        tree([1, 2], [0, 2])


def test_subtrees_keep_nodes_with_their_parents_and_the_most_confident_nodes():
    from specdecode.proposers.base import TreeProposal

    t = tree([5, 6, 7, 8, 9], [0, 0, 1, 3, 2])  # root -> 5, 6; 5 -> 7 -> 8; 6 -> 9
    kept = t.keep([1, 3, 2])
    assert kept.tokens.tolist() == [5, 6, 7] and kept.parents.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match=r"nodes \[4\] are kept without their parents"):
        t.keep([1, 4])
    proposal = TreeProposal(t, confidence=torch.tensor([0.9, 0.3, 0.6, 0.6, 0.1]), passes=3)
    best = proposal.best(3)  # 0.9, 0.6, 0.6 (node 3 before its equal child 4)
    assert best.tree.tokens.tolist() == [5, 7, 8] and best.tree.parents.tolist() == [0, 1, 2]
    assert best.confidence.tolist() == pytest.approx([0.9, 0.6, 0.6]) and best.passes == 3
    assert proposal.best(0).tree.size == 0 and proposal.best(9) is proposal


def test_static_tree_from_choice_paths():
    parents, nodes = tree_from_paths([[0, 1], [1], [0, 0]])
    assert nodes == [(0,), (1,), (0, 0), (0, 1)]
    assert parents.tolist() == [0, 0, 1, 1]


def logits_for(argmax_rows: list[int], vocab: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmax_rows), vocab).float() * 5


@pytest.mark.parametrize("tokens, parents, argmax, path, bonus", [
    ([5, 6, 7, 8], [0, 0, 1, 3], [5, 7, 0, 8, 9], [1, 3, 4], 9),  # the deep branch, then a free token
    ([5, 6, 7, 8], [0, 0, 1, 3], [6, 7, 2, 8, 9], [2], 2),  # second child of the root, a leaf
    ([5, 6, 7, 8], [0, 0, 1, 3], [4, 7, 0, 8, 9], [], 4),  # nothing accepted: the root's argmax
    ([5, 6, 7, 8], [0, 0, 1, 3], [5, 1, 0, 8, 9], [1], 1),  # 5 accepted, its child 7 rejected
    ([3, 3, 4], [0, 1, 0], [3, 3, 1, 9], [1, 2], 1),  # a repeated token on a path
])
def test_greedy_tree_verify_table(tokens, parents, argmax, path, bonus):
    assert greedy_tree_verify(tree(tokens, parents), logits_for(argmax)) == (path, bonus)
    asked = []  # logits row by row (LazyLogits): only the walk's nodes are asked for
    assert greedy_tree_verify(tree(tokens, parents), lambda n: asked.append(n) or logits_for(argmax)[n]) == (path, bonus)
    assert asked == [0] + path


def test_greedy_tree_on_a_chain_agrees_with_the_chain_verifier():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(1, 6, (1,), generator=generator))
        drafts = torch.randint(0, 4, (k,), generator=generator)
        logits = torch.randn(k + 1, 4, generator=generator)
        output, accepted = greedy_verify(drafts[None], logits[None])
        path, bonus = greedy_tree_verify(Tree.chain(drafts), logits)
        assert path == list(range(1, int(accepted) + 1)) and bonus == int(output[0, int(accepted)])


def test_coupled_tree_on_a_chain_agrees_with_the_chain_verifier():
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        k = int(torch.randint(1, 6, (1,), generator=generator))
        drafts = torch.randint(0, 3, (k,), generator=generator)
        probs = torch.softmax(torch.randn(k + 1, 3, generator=generator) * 2, -1)
        uniforms = torch.rand(k + 1, generator=generator, dtype=torch.float64)
        output, accepted = coupled_verify(drafts[None], probs[None], uniforms[None])
        path, bonus = coupled_tree_verify(Tree.chain(drafts), probs, uniforms)
        assert path == list(range(1, int(accepted) + 1)) and bonus == int(output[0, int(accepted)])


VOCAB = 5


def three_token_joint_through_trees(verifier, params: SamplingParams, point_masses: bool, runs: int = 8000,
                                  seed: int = 7):
    """Toy Markov target and draft over 5 tokens (tables [V, V], row = previous token).
    Each run builds a tree: 3 children of the root, 2 under each of them, drawn i.i.d.
    from the draft (or its top-k, as point masses); the target's rows follow each node's
    token. The first three emitted tokens (the bonus after a full path included; drawn
    from the target directly where the step ended earlier) must follow
    target(y1|x0) * target(y2|y1) * target(y3|y2)."""
    x0 = 0
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    draft_logits = target_logits + torch.randn(VOCAB, VOCAB, generator=gen)
    target_table = logits_to_probs(target_logits, params)
    draft_table = logits_to_probs(draft_logits, params)

    def children_of(row: int, count: int) -> list[int]:
        if point_masses:
            return draft_table[row].topk(count).indices.tolist()
        return sample(draft_table[row].expand(count, VOCAB), gen).tolist()

    counts = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    depth_reached = [0, 0, 0]
    for _ in range(runs):
        tokens, parents, rows = [], [], [x0]
        for first in children_of(x0, 3):
            tokens.append(first)
            parents.append(0)
            rows.append(first)
            node = len(tokens)
            for second in children_of(first, 2):
                tokens.append(second)
                parents.append(node)
                rows.append(second)
        t = tree(tokens, parents)
        target_probs = target_table[torch.tensor(rows)]
        # node i's token was drawn from the draft's row at its parent's token
        draft_probs = None if point_masses else draft_table[torch.tensor([rows[p] for p in parents])]
        path, bonus = verifier(t, target_probs, draft_probs, gen)
        emitted = [tokens[n - 1] for n in path] + [bonus]
        depth_reached[len(path)] += 1
        while len(emitted) < 3:  # where the step ended early, the target's next draws
            emitted.append(int(sample(target_table[emitted[-1]], gen)))
        y1, y2, y3 = emitted
        counts[(y1 * VOCAB + y2) * VOCAB + y3] += 1
    joint = (target_table[x0].double()[:, None, None] * target_table.double()[:, :, None]
             * target_table.double()[None, :, :])
    expected = (joint / joint.sum()).flatten() * runs
    return counts, expected, depth_reached


TREE_CASES = [
    (SamplingParams(temperature=1.0), True),
    (SamplingParams(temperature=1.0), False),
    (SamplingParams(temperature=0.7, top_k=3), True),
    (SamplingParams(temperature=1.0, top_p=0.8), False),
]


@pytest.mark.parametrize("params, point_masses", TREE_CASES,
                         ids=lambda c: str(c) if isinstance(c, bool) else f"T{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_tree_sampling_reproduces_target_distribution(params, point_masses):
    observed, expected, depth_reached = three_token_joint_through_trees(tree_rejection_sample, params, point_masses)
    support = expected > 0
    assert observed[~support].sum() == 0, "emitted a token the processed target forbids"
    assert all(n > 100 for n in depth_reached), depth_reached  # rejections at the root, at depth 1, and full paths
    p_value = pooled_chisquare(observed, expected)
    assert p_value > 1e-3, p_value


def coupled_tree(t, target_probs, draft_probs, generator):
    """coupled_tree_verify in the harness's signature: a fresh uniform per depth."""
    return coupled_tree_verify(t, target_probs, torch.rand(3, generator=generator, dtype=torch.float64))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.0, top_p=0.8)],
                         ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_coupled_tree_sampling_reproduces_target_distribution(params):
    observed, expected, depth_reached = three_token_joint_through_trees(coupled_tree, params, point_masses=True)
    support = expected > 0
    assert observed[~support].sum() == 0, "emitted a token the processed target forbids"
    assert all(n > 100 for n in depth_reached), depth_reached
    p_value = pooled_chisquare(observed, expected)
    assert p_value > 1e-3, p_value


def one_uniform_for_every_depth(t, target_probs, draft_probs, generator):
    """A plausible mistake: the same uniform at every depth of the walk."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return coupled_tree_verify(t, target_probs, u.expand(3))


def test_tree_reusing_a_uniform_would_be_caught():
    observed, expected, _ = three_token_joint_through_trees(one_uniform_for_every_depth, SamplingParams(temperature=1.0),
                                                            point_masses=True)
    p_value = pooled_chisquare(observed, expected)
    assert p_value < 1e-6, p_value


def test_a_tree_child_its_own_distribution_gives_zero_is_refused():
    """Found in review: as in the chain verifier, a child whose draft distribution gives its
    own token probability 0 was accepted wherever the target allows it."""
    from specdecode.config import SpecDecodeError

    t = tree([0, 1], [0, 0])
    target_probs = torch.tensor([[0.5, 0.5, 0.0]] * 3)
    draft_probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])  # child 1's token 0 "drawn" from [0, 1, 0]
    with pytest.raises(SpecDecodeError, match="probability 0 in the distribution it was said to be drawn from"):
        tree_rejection_sample(t, target_probs, draft_probs, torch.Generator().manual_seed(0))


def forgetful_verifier(t, target_probs, draft_probs, generator):
    """A plausible mistake: after the children of a node are all rejected, draw the bonus
    from the target's distribution there instead of the residual."""
    path, _ = tree_rejection_sample(t, target_probs, draft_probs, generator)
    node = path[-1] if path else 0
    return path, int(sample(target_probs[node], generator))


@pytest.mark.parametrize("point_masses", [True, False])
def test_wrong_tree_verifier_would_be_caught(point_masses):
    observed, expected, _ = three_token_joint_through_trees(forgetful_verifier, SamplingParams(temperature=1.0),
                                                            point_masses)
    p_value = pooled_chisquare(observed, expected)
    assert p_value < 1e-6, p_value


def stale_bonus_tree_verifier(t, target_probs, draft_probs, generator):
    """A plausible mistake: after a full path, the bonus drawn at the last node's parent."""
    path, bonus = tree_rejection_sample(t, target_probs, draft_probs, generator)
    if path and not t.children()[path[-1]]:
        parent = int(t.parents[path[-1] - 1])
        bonus = int(sample(target_probs[parent], generator))
    return path, bonus


def test_wrong_bonus_after_a_full_path_would_be_caught():
    observed, expected, depth_reached = three_token_joint_through_trees(
        stale_bonus_tree_verifier, SamplingParams(temperature=1.0), point_masses=False)
    assert depth_reached[2] > 1000
    assert pooled_chisquare(observed, expected) < 1e-6


def trimmed_first_tokens(p: torch.Tensor, q: torch.Tensor, runs: int, seed: int) -> torch.Tensor:
    """Counts of the first emitted token when 3 children of the root, drawn i.i.d. from q,
    go through ``TreeProposal.best`` with a count chosen from their confidences (as the tree
    budget chooses it: 2 when the second is likely, else 1) before verification."""
    from specdecode.proposers.base import TreeProposal

    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.numel(), dtype=torch.float64)
    for _ in range(runs):
        kids = torch.multinomial(q, 3, replacement=True, generator=gen)
        confidence = q[kids]
        proposal = TreeProposal(Tree(kids, torch.zeros(3, dtype=torch.int64)), q.expand(3, -1).clone(),
                                confidence=confidence)
        kept = proposal.best(2 if confidence[1] >= 0.3 else 1)
        path, bonus = tree_rejection_sample(kept.tree, p.expand(kept.tree.size + 1, -1), kept.draft_probs, gen)
        counts[int(kept.tree.tokens[path[0] - 1]) if path else bonus] += 1
    return counts


def test_trimming_a_tree_of_drawn_nodes_keeps_it_lossless():
    """Which drawn siblings a smaller budget keeps must not depend on their tokens: keeping
    the most confident ones, or a count chosen from their confidences, pulled the output
    towards the drafter (p-values 0 and 2e-65 before)."""
    p, q = torch.tensor([0.4, 0.3, 0.2, 0.1]), torch.tensor([0.1, 0.2, 0.3, 0.4])
    runs = 20_000
    expected = p.double() / p.double().sum() * runs
    assert pooled_chisquare(trimmed_first_tokens(p, q, runs, seed=1), expected) > 1e-3


def test_drawn_trees_are_never_trimmed():
    from specdecode.proposers.base import TreeProposal

    t = tree([5, 6, 7, 8, 9], [0, 0, 1, 3, 2])
    drawn = TreeProposal(t, torch.rand(5, 10), confidence=torch.tensor([0.1, 0.9, 0.05, 0.04, 0.8]))
    assert drawn.best(3) is drawn and drawn.best(0) is drawn
    chosen = TreeProposal(t, None, confidence=drawn.confidence)  # deterministic nodes: the most confident
    assert chosen.best(2).tree.tokens.tolist() == [6, 9]


def test_tree_steps_count_a_rejection_only_where_the_walk_left_children_untaken():
    """Found in review: a tree step counted as a rejection whenever its path was shorter than
    its node count, so every tree step did, and the later-position acceptance the k policy
    and `check` read was halved (0.5 where every path reached full depth)."""
    from specdecode.metrics import GenerationStats, acceptance_rates

    stats = GenerationStats()
    for _ in range(10):  # 6 nodes, depth 2, the path to a leaf at full depth: nothing rejected
        stats.observe_step(6, 2, depth=2, rejected=False)
    assert stats.rejections == 0 and acceptance_rates([stats]) == (1.0, 1.0)
    stats.observe_step(6, 1, depth=2, rejected=True)  # stopped at a node with children
    assert stats.rejections == 1 and stats.trial_alpha == pytest.approx(21 / 22)
    chain = GenerationStats()
    chain.observe_step(3, 1)  # chains keep their rule: shorter than the drafts is a rejection
    chain.observe_step(3, 3)
    assert chain.rejections == 1


def test_the_engines_tree_steps_count_rejections_and_depths_as_the_walk_went(tiny_llama_dir):
    """Found in review: the test above feeds GenerationStats by hand, so undoing the engine's
    part of that fix (``observe_step(tree.size, len(path))``) passed every test. Through
    the engine: a path that ends at a leaf above the tree's depth rejects nothing; one that
    stops at a node whose child was wrong rejects once."""
    from specdecode.control.policies import FixedK
    from specdecode.engine import SpeculativeEngine
    from specdecode.factory import load_model
    from specdecode.proposers.base import TreeProposal

    runtime = load_model(tiny_llama_dir, torch.float32).runtime
    prompt = [5, 9, 14, 3, 7, 22]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    g1, g2 = SpeculativeEngine(runtime).generate(prompt, params).token_ids[:2]
    wrong = lambda *right: next(t for t in range(3, 90) if t not in right)  # noqa: E731

    class OneTree:  # the given tree at the first step, nothing after
        name, drafts_trees = "stub", True

        def __init__(self, tokens, parents):
            self.tree, self.calls = tree(tokens, parents), 0

        def start(self, prompt_ids, capacity):
            self.calls = 0

        def propose_tree(self, tokens, budget, params, generator):
            self.calls += 1
            return TreeProposal(self.tree if self.calls == 1 else tree([], []))

    x = wrong(g1)
    cases = {"leaf": ([x, g1, wrong(g2)], [0, 0, 1], 0, [1, 0]),  # root -> {x -> y, g1}: g1 taken, a leaf
             "stopped": ([g1, x, wrong(g2)], [0, 0, 1], 1, [1, 0])}  # root -> {g1 -> wrong, x}: stops at g1
    for name, (tokens, parents, rejections, accepted) in cases.items():
        engine = SpeculativeEngine(runtime, proposer=OneTree(tokens, parents), k=FixedK(3))
        result = engine.generate(prompt, params)
        assert result.token_ids == SpeculativeEngine(runtime).generate(prompt, params).token_ids
        stats = result.stats
        assert (stats.rejections, stats.drafted_per_position, stats.accepted_per_position) == (
            rejections, [1, 1], accepted), name


def test_a_tree_rejection_with_nothing_left_in_the_residual_draws_from_the_target(monkeypatch):
    """As the chain's test: a drawn child rejected where max(p - q, 0) has no mass; the bonus
    must come from the target's distribution, not from all zeros (token 0)."""
    from test_verify import NEAR_TIE_DRAFT, NEAR_TIE_TARGET, forced_rejection

    from specdecode.verify import tree as tree_module

    forced_rejection(monkeypatch, tree_module)
    path, bonus = tree_rejection_sample(Tree(torch.tensor([1]), torch.tensor([0])),
                                        torch.tensor([NEAR_TIE_TARGET, [0.0, 0.5, 0.5]]),
                                        torch.tensor([NEAR_TIE_DRAFT]), torch.Generator().manual_seed(0))
    assert path == [] and bonus in (1, 2)


def test_a_second_sibling_the_target_wants_is_accepted():
    """Where the first child is rejected, the next sibling is tried against the residual:
    the target wants only the second child's token, so that child is accepted on every
    draw (a mutation audit: trying the first child alone stayed lossless, the bonus then
    drawing the same token, and passed every distribution test)."""
    tree = Tree(torch.tensor([0, 1]), torch.tensor([0, 0]))
    target_probs = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    for seed in range(20):
        path, bonus = tree_rejection_sample(tree, target_probs, None, torch.Generator().manual_seed(seed))
        assert (path, bonus) == ([2], 2)


def test_later_acceptance_falls_back_to_the_first_and_decode_speed_excludes_the_prefill():
    from specdecode.metrics import GenerationStats, acceptance_rates

    stats = GenerationStats(new_tokens=100, wall_seconds=2.0, prefill_seconds=1.0)
    stats.observe_step(1, 1)  # one draft a step: no later position is ever tried
    stats.observe_step(1, 0)
    assert acceptance_rates([stats]) == (0.5, 0.5) and stats.later_alpha == 0.5  # independent acceptance
    assert stats.decode_tokens_per_s == pytest.approx(100.0) and stats.tokens_per_s == pytest.approx(50.0)
