"""Theory, cost profile and k policies: hand-computed values and lossless adaptive decoding."""

from __future__ import annotations

import random
import re
from datetime import datetime, timezone

import pytest
import torch

from conftest import save_tiny_model
from specdecode.cost import profile as profile_module
from specdecode.cost.profile import CostProfile, get_profile, load_profile
from specdecode.cost.theory import (
    best_k, break_even_alpha, expected_speedup, expected_tau, tau_conditional, tau_from_positions, tau_two_rates,
    taus_conditional, wall_speedup,
)
from specdecode.config import ConfigError, SamplingParams, SpeculativeConfig
from specdecode.control.policies import CostAwareK, CostModel, StepTimes, ThresholdK, TreeBudget
from specdecode.proposers.base import TreeProposal
from specdecode.verify.tree import Tree
from specdecode.engine import SpeculativeEngine
from specdecode.factory import build_engine, load_model
from specdecode.config import EngineConfig
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NgramProposer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)


# -- theory --------------------------------------------------------------------------
def test_expected_tau_hand_values():
    assert expected_tau(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tau(0.8, 6) == pytest.approx(3.951424)  # (1 - .8^7) / .2
    assert expected_tau(0.0, 5) == 1.0
    assert expected_tau(1.0, 4) == 5.0
    assert expected_tau(0.3, 0) == 1.0
    # per-position prefix acceptance of an i.i.d. alpha = 0.5 drafter gives the same tau
    assert tau_from_positions([0.5, 0.25, 0.125]) == pytest.approx(1.875)
    with pytest.raises(ConfigError, match="alpha must be in"):
        expected_tau(1.5, 2)
    # two rates: 1 + .4 * (1 + .9 + .81) = 2.084; equal rates give eq. 1 back
    assert tau_two_rates(0.4, 0.9, 3) == pytest.approx(2.084)
    assert tau_two_rates(0.5, 0.5, 3) == pytest.approx(expected_tau(0.5, 3))
    assert tau_two_rates(0.3, 1.0, 4) == pytest.approx(2.2)
    with pytest.raises(ConfigError, match="later acceptance rate must be in"):
        tau_two_rates(0.5, -0.1, 2)
    # a rate per position: 1 + .5 * (1 + .9 + .9 * .5) = 2.175; equal rates give the two-rate value
    assert tau_conditional(0.5, [0.9, 0.5, 0.2], 3) == pytest.approx(2.175)
    assert tau_conditional(0.5, [0.9, 0.5, 0.2], 4) == pytest.approx(2.175 + 0.5 * 0.09)
    assert tau_conditional(0.4, [0.9, 0.9], 3) == pytest.approx(tau_two_rates(0.4, 0.9, 3))
    assert tau_conditional(0.7, [], 1) == pytest.approx(1.7) and tau_conditional(0.7, [], 0) == 1.0
    with pytest.raises(ConfigError, match="k must be in 0..3"):
        tau_conditional(0.5, [0.9, 0.5], 4)
    assert taus_conditional(0.5, [0.9, 0.5, 0.2]) == pytest.approx([1.0, 1.5, 1.95, 2.175, 2.22])
    with pytest.raises(ConfigError, match="acceptance rates must be in"):
        taus_conditional(0.5, [1.2])


def test_speedup_and_best_k_hand_values():
    assert expected_speedup(1.875, 1.2, 0.05, 3) == pytest.approx(1.875 / 1.35)
    linear = lambda k: 1 + 0.1 * k  # noqa: E731
    # alpha .8: k=5 3.68928/1.5 = 2.4595, k=6 3.951424/1.6 = 2.4696, k=7 4.16114/1.7 = 2.4477
    k, speedup = best_k(0.8, linear, 0.0, 10)
    assert k == 6 and speedup == pytest.approx(2.46964, abs=1e-5)
    assert best_k(0.8, linear, 0.0, 4)[0] == 4  # bounded by k_max
    # alpha .1 with expensive verification: every k loses, so plain decoding (k = 0)
    assert best_k(0.1, lambda k: 1.2 + 0.1 * k, 0.0, 10) == (0, 1.0)
    # a costly drafter moves the optimum down: c = .3 at alpha .8 -> k=2: 2.44/1.8 = 1.356
    assert best_k(0.8, linear, 0.3, 10)[0] == 2
    assert break_even_alpha(1, 1.1, 0.0) == pytest.approx(0.1, abs=1e-5)
    assert break_even_alpha(2, 3.5, 0.0) is None  # tau <= 3 can never pay 3.5
    assert wall_speedup(100, 20, 2.0, 1.25) == pytest.approx(120 / 82.5)
    # runs of acceptance make long drafts pay where independent acceptance would not:
    # alpha .4 independent: k=1 1.4/1.1 = 1.273, k=2 1.56/1.2 = 1.3, k=3 1.624/1.3 = 1.249;
    # first .4, later .9: k=8 1 + .4 * 5.6953 = 3.2781 / 1.8 = 1.8212, k=9 3.4459 / 1.9 = 1.8160
    assert best_k(0.4, linear, 0.0, 10) == (2, pytest.approx(1.3))
    k, speedup = best_k(0.4, linear, 0.0, 10, tau=lambda k: tau_two_rates(0.4, 0.9, k))
    assert k == 8 and speedup == pytest.approx(1.82118, abs=1e-4)


# -- cost profile --------------------------------------------------------------------
def cli_state_path(model_dir, dtype: str = "fp32"):
    """The router state `generate --route --dtype DTYPE` keeps for ``model_dir`` (other flags
    at their defaults)."""
    from specdecode.config import EngineConfig
    from specdecode.control.router import router_state_path

    return router_state_path(str(model_dir), EngineConfig(model=str(model_dir), dtype=dtype, chat_template=False))


def synthetic_profile(c: float = 0.05) -> CostProfile:
    return CostProfile("m", "fp32", "cpu", 2, contexts=[100, 300], sizes=[1, 2, 4],
                       step_ms=[[10, 12, 16], [20, 22, 30]], drafters={"ngram": c})


def test_profile_interpolates_over_sizes_and_contexts():
    profile = synthetic_profile()
    assert profile.time_ms(3, 100) == pytest.approx(14)
    assert profile.time_ms(3, 200) == pytest.approx(20)  # halfway between 14 and 26
    assert profile.time_ms(1, 50) == 10  # clamped below the first context
    assert profile.time_ms(1, 500) == pytest.approx(30)  # beyond the last: along its slope (was held at 20)
    assert profile.v(2, 200) == pytest.approx(20 / 15)
    assert profile.time_ms(6, 100) == pytest.approx(20)  # last slope (2 ms/token) extended
    with pytest.raises(KeyError, match="no cost for drafter 'draft:x'"):
        profile.c("draft:x")
    # a last cell measured below the one before (noise on a flat profile) is not extended
    # downwards: more tokens never cost less (found in review: v(512) 0.62 on such a profile)
    flat = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 32, 64], step_ms=[[10, 11.7, 11.3]])
    assert flat.time_ms(512, 100) == pytest.approx(11.3) and flat.v(511, 100) >= 1.0


def test_profile_is_measured_once_cached_and_remeasured_on_request(tiny_llama_dir, monkeypatch):
    model = load_model(tiny_llama_dir, torch.float32)
    first = get_profile("tiny", "fp32", model.runtime, {"ngram": NgramProposer()}, progress=False)
    assert first.sizes[0] == 1 and first.sizes[-1] == 64 and all(t > 0 for row in first.step_ms for t in row)
    assert first.drafters["ngram"] >= 0
    assert load_profile("tiny", "fp32").step_ms == first.step_ms
    assert model.runtime.lazy_logits and first.head_ms > 0 and first.head_next_ms > 0  # the head, measured
    assert first.head_sizes[0] == 1 and len(first.head_full_ms) == len(first.head_sizes)
    # it says when it was measured, and a benchmark's summary of it carries that and v(T)
    measured = datetime.fromisoformat(first.measured_at)
    assert abs((datetime.now(timezone.utc) - measured).total_seconds()) < 600
    summary = first.summary(context=100, sizes=(2, 4))
    assert summary["measured_at"] == first.measured_at and set(summary["v"]) == {2, 4}
    assert summary["v"][4] == pytest.approx(first.v(3, 100), abs=1e-3)

    calls = []
    original = profile_module.measure_target
    monkeypatch.setattr(profile_module, "measure_target", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    again = get_profile("tiny", "fp32", model.runtime, {"ngram": NgramProposer()}, progress=False)
    assert calls == [] and again.step_ms == first.step_ms  # reused, not re-measured
    get_profile("tiny", "fp32", model.runtime, progress=False, force=True)
    assert calls == [1]
    # a drafter the profile lacks is measured and added, the target is not re-measured
    draft = DraftModelProposer(model.runtime.layer_skip_view(1))
    added = get_profile("tiny", "fp32", model.runtime, {"draft:self:1": draft}, progress=False)
    assert calls == [1] and added.drafters["draft:self:1"] > 0


# -- policies ------------------------------------------------------------------------
def test_cost_aware_k_rises_with_acceptance_and_falls_to_plain():
    policy = CostAwareK(CostModel(synthetic_profile(), "ngram"), k_max=8)
    policy.start(prior_alpha=0.5)
    first = policy.choose(100)
    assert first >= 1
    for _ in range(50):  # every draft accepted: k climbs one position beyond the evidence at a time
        k = policy.choose(100)
        policy.observe(k, k)
    assert policy.choose(100) == 8 and policy.alpha > 0.95
    policy.start(prior_alpha=0.5)
    chosen = []
    for _ in range(200):  # every draft rejected
        k = policy.choose(300)
        chosen.append(k)
        policy.observe(k, 0)
    assert chosen.count(0) > 150
    probes = [i for i, k in enumerate(chosen) if k > 0 and i > 20]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes grow rarer
    assert max(gaps) <= 64 + 1


def test_cost_aware_k_does_not_keep_offering_a_position_that_always_fails():
    """Found in review: after each fully accepted draft the policy offered one position
    more, optimistic about it even when that position had been rejected every time it was
    tried (k 3, 4, 3, 4, ... for ever, where always 3 is faster)."""
    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 3, 4, 5, 9, 11],
                          step_ms=[[29, 29.6, 30.5, 31.4, 37, 61, 68.4]], drafters={"ngram": 0.02})
    policy = CostAwareK(CostModel(profile, "ngram"), k_max=8, default_prior=0.5, default_later=0.5)
    policy.start()
    for _ in range(200):  # right for exactly the first 3 tokens of every draft
        k = policy.choose(100)
        policy.observe(k, min(k, 3))
    assert policy.chosen[-20:] == [3] * 20, policy.chosen[-20:]


def test_cost_aware_k_looks_again_at_a_position_priced_out_once_drafts_turn_right():
    """Found in review: a position whose rate fell below half its prior was never drafted
    again, so its estimate froze and capped k for good (a label's counts outlive requests):
    k 3 through 600 steps where every draft was accepted. It is looked at again after
    4, 8, 16, ... fully accepted steps, and recovers when it is right."""
    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 3, 4, 5, 9, 11],
                          step_ms=[[29, 29.6, 30.5, 31.4, 37, 61, 68.4]], drafters={"ngram": 0.02})
    policy = CostAwareK(CostModel(profile, "ngram"), k_max=8, default_prior=0.7, default_later=0.7)
    label = ("prompt", 4)
    policy.start()
    for _ in range(20):  # right for exactly the first 3 tokens of every draft
        policy.use_label(label)
        k = policy.choose(100)
        policy.observe(k, min(k, 3))
    assert policy.conditional[2] < 0.35  # position 4: below half its prior
    for _ in range(300):  # then every draft is right
        policy.use_label(label)
        k = policy.choose(100)
        policy.observe(k, k)
    assert max(policy.chosen[-20:]) > 3, policy.chosen[-20:]


def test_a_kind_of_draft_priced_out_is_tried_again_across_short_requests():
    """Found in review: acceptance per kind of draft outlives requests (and a server's
    sequences share it) but the probe countdown restarted at every request, so once a kind
    was priced out, requests shorter than the probe interval never drafted it again."""
    from specdecode.serve.batch import clone_policy

    template = CostAwareK(CostModel(synthetic_profile(), "ngram"), k_max=6, default_prior=0.5, default_later=0.5)
    label = ("prompt", 4)

    def request(accept: bool) -> int:
        policy = clone_policy(template)  # per request, as the server builds them
        policy.start(0.5)
        drafted = 0
        for _ in range(template.base_probe_interval - 1):
            policy.use_label(label)
            k = policy.choose(100)
            drafted += k > 0
            policy.observe(k, k if accept else 0)
        return drafted

    for _ in range(10):  # this kind's drafts are rejected: priced out
        request(False)
    assert template.label_counts[label][0][0] / template.label_counts[label][0][1] < 0.3
    assert sum(request(True) for _ in range(20)) > 20  # they are right now: probed, and drafted again


def test_cost_aware_k_values_runs_of_acceptance():
    """A drafter that is either wrong at once or right for the whole draft (an n-gram
    copying a span) earns long drafts even though fewer than half its steps accept."""
    profile = synthetic_profile(c=0.0)
    policy = CostAwareK(CostModel(profile, "ngram"), k_max=8, margin=0.0, default_later=0.7)
    policy.start(prior_alpha=0.3)
    for step in range(100):
        k = policy.choose(100)
        policy.observe(k, k if step % 5 in (0, 1) else 0)  # 40% of steps right throughout, in pairs
    assert policy.first == pytest.approx(0.4, abs=0.1) and policy.later > 0.9
    assert policy.choose(100) == 8
    # one independent rate with the same pooled acceptance would stop well short of 8
    pooled_k, _ = best_k(policy.alpha, lambda k: profile.v(k, 100), 0.0, 8)
    assert pooled_k < 8


def cliff_profile() -> CostProfile:
    """Like fp32 here: scoring up to 3 tokens is nearly free, 4 and more cost much more."""
    return CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 3, 4, 9, 11],
                       step_ms=[[29, 29.6, 31.4, 46.3, 61, 68.4]], drafters={"ngram": 0.0})


def test_cost_aware_k_does_not_extrapolate_short_runs_across_a_cost_cliff():
    """Full acceptance of 2-token drafts is evidence about position 2 only: with position
    3.. still at their prior, paying 1.6-2.3 steps for long drafts is not worth it."""
    policy = CostAwareK(CostModel(cliff_profile(), "ngram"), k_max=10, default_later=0.8)
    policy.start(prior_alpha=0.5)
    assert policy.choose(100) == 2
    for _ in range(6):  # (one rate for every position after the first jumped to k = 7 after 3)
        policy.observe(2, 2)
        assert policy.choose(100) == 2
    assert policy.conditional[0] > 0.9 and policy.conditional[1:] == pytest.approx([0.8] * 8)
    # once long drafts are seen to be accepted whole, they are worth their cost
    for _ in range(12):
        policy.observe(10, 10)
    assert policy.choose(100) == 10


def test_policies_charge_the_head_only_for_the_rows_greedy_verification_reads():
    """With logits computed on demand (lazy_head), a step costs v(k) less the output head
    of the k + 1 - tau rows past the first rejection: drafting pays at an acceptance where
    it would not with every row's head charged, for chains and for trees."""
    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4], step_ms=[[10, 18, 34]],
                          drafters={"ngram": 0.0}, head_ms=5.0)
    chosen = {}
    for lazy in (False, True):
        costs = CostModel(profile, "ngram", lazy_head=lazy)
        assert costs.head_saving(1, 1.0, 100) == (pytest.approx(0.5) if lazy else 0.0)
        policy = CostAwareK(costs, k_max=3, default_later=0.75)
        policy.start(prior_alpha=0.75)  # k = 1: tau 1.75 against 1.8 steps, or 1.675 lazily
        chosen[lazy] = policy.choose(100)
    assert chosen == {False: 0, True: 1}
    trees = [TreeBudget(CostModel(profile, "ngram", lazy_head=lazy), k_max=3) for lazy in (False, True)]
    full, lazy = (tree._rates(torch.tensor([0.9, 0.5, 0.2]), 1) for tree in trees)
    assert lazy[0] == full[0] and all(a > b for a, b in zip(lazy[1:], full[1:]))


def test_logits_on_demand_only_where_they_cost_less():
    """A head bound by reading its weights costs about as much for one row as for all: each
    row read on demand reads them again. The policies then price a step at the full pass
    and ask for it, unless verification is expected to read a single row."""
    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4], step_ms=[[10, 11, 13]],
                          drafters={"ngram": 0.0}, head_ms=2.0, head_next_ms=2.0, head_sizes=[1, 2, 4],
                          head_full_ms=[2.0, 2.2, 2.6])
    costs = CostModel(profile, "ngram", lazy_head=True)
    assert profile.lazy_head_saving_ms(4, 1.0) == pytest.approx(0.6)
    assert profile.lazy_head_saving_ms(4, 2.5) == pytest.approx(2.6 - 5.0)
    assert costs.step_cost(3, 1.0, 100) == (pytest.approx(1.3 - 0.06), True)
    assert costs.step_cost(3, 2.5, 100) == (pytest.approx(1.3), False)  # never priced above the full pass
    chain = CostAwareK(costs, k_max=3, default_later=0.9)
    for alpha, lazy in ((0.02, True), (0.9, False)):
        chain.start(prior_alpha=alpha)
        chain.choose(100)
        assert chain.lazy(3) == lazy, alpha
    tree = TreeBudget(costs, k_max=3)
    for confidence, lazy in (([0.01, 0.01, 0.01], True), ([0.95, 0.9, 0.85], False)):
        tree.start()
        tree.trim(chain_proposal(confidence, passes=1), 100, 1)
        assert tree.lazy(3) == lazy, confidence


def test_cost_aware_k_learns_each_position():
    policy = CostAwareK(CostModel(synthetic_profile(c=0.0), "ngram"), k_max=6, default_later=0.5)
    policy.start(prior_alpha=0.5)
    for _ in range(40):  # a drafter right for exactly 3 tokens whenever position 1 is right
        policy.observe(6, 3)
    rates = policy.conditional
    assert rates[0] > 0.95 and rates[1] > 0.95  # positions 2 and 3
    assert rates[2] < 0.05  # position 4 always fails after 3
    assert rates[3:] == pytest.approx([0.5, 0.5])  # positions 5, 6 never reached: the prior


def test_cost_aware_k_returns_to_speculation_after_a_good_probe():
    policy = CostAwareK(CostModel(synthetic_profile(), "ngram"), k_max=6, probe_interval=4)
    policy.start(prior_alpha=0.0)
    chosen = [policy.choose(100) for _ in range(5)]
    assert chosen[:4] == [0, 0, 0, 0] and chosen[4] >= 1  # the probe
    for _ in range(6):  # the workload turns copyable: probes and drafts all pass
        policy.observe(policy.chosen[-1], policy.chosen[-1])
        k = policy.choose(100)
    assert k > 1 and policy.chosen[-6:].count(0) <= 1


def test_threshold_policy_follows_the_literature_rule():
    policy = ThresholdK()
    assert policy.choose(0) == 5
    policy.observe(5, 5)  # mean 1.0 > .8: +1
    assert policy.choose(0) == 6
    for _ in range(3):
        policy.observe(6, 0)  # window means .5 (no change), .33, .25: -1 twice
    assert policy.choose(0) == 4
    for _ in range(10):
        policy.observe(3, 0)
    assert policy.k == 2  # bounded below
    assert policy.choose(0) == 0  # mean < .3 after 10 observations: off
    fresh = ThresholdK()
    for _ in range(20):
        fresh.observe(5, 5)
    assert fresh.choose(0) == 10  # bounded above


def chain_proposal(confidence: list[float], passes: int = 2) -> TreeProposal:
    n = len(confidence)
    return TreeProposal(Tree.chain(torch.arange(10, 10 + n)), confidence=torch.tensor(confidence), passes=passes)


def test_tree_budget_keeps_the_nodes_worth_their_cost():
    # v(1) = 1.2, v(2) = 1.4, v(3) = 1.6 at context 100; c = .05 per pass, 2 passes: d = .1
    # r(0) = 1/1.1, r(1) = 1.9/1.3 = 1.46, r(2) = 2.7/1.5 = 1.8, r(3) = 2.8/1.7 = 1.65
    policy = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3)
    assert policy.choose(100) == 3  # the prior (no calibration): speculate, headroom over k_max / 2
    kept = policy.trim(chain_proposal([0.9, 0.8, 0.1]), 100, passes=2)
    assert kept.tree.tokens.tolist() == [10, 11]
    policy.observe(2, 2)
    assert policy.scale == pytest.approx((1 * 0.8 + 2) / (1 * 0.8 + 1.7))  # accepted / predicted, decayed
    # a drafter that is sure and always wrong: s falls, trees shrink to nothing, then plain steps
    for _ in range(12):
        policy.choose(100)
        kept = policy.trim(chain_proposal([0.99, 0.98, 0.97]), 100, passes=2)
        policy.observe(kept.tree.size, 0)
    assert kept.tree.size == 0 and policy.rate < 1.0
    assert policy.choose(100) == 0


def test_policies_learn_what_drafting_costs_from_the_steps():
    """A profile that times the drafter at 0.02 steps a pass, steps that measure 0.6 (its
    weights evicted inside a generation): both policies stop drafting where the drafts
    (the first right every other step) only paid at the profile's price; a drafter as cheap
    as profiled keeps drafting."""
    for cost, drafts in ((0.6, False), (0.02, True)):
        chain = CostAwareK(CostModel(synthetic_profile(c=0.02), "ngram"), k_max=3, default_later=0.5)
        chain.start(prior_alpha=0.5)
        tree = TreeBudget(CostModel(synthetic_profile(c=0.02), "ngram"), k_max=3, prior_rate=1.3)
        for step in range(20):
            accepted = step % 2  # the first draft right every other step, the second never
            k = chain.choose(100)
            if k:  # verification of k + 1 tokens took v(k) steps of 10 ms; drafting `cost` steps a pass
                chain.observe_cost(k * cost * 0.010, k, chain._v_table(100)[k] * 0.010, k)
                chain.observe(k, accepted)
            if tree.choose(100):
                kept = tree.trim(chain_proposal([0.5, 0.25, 0.12]), 100, passes=2)
                tree.observe_cost(2 * cost * 0.010, 2, tree._v_table(100)[kept.tree.size] * 0.010, kept.tree.size)
                tree.observe(kept.tree.size, min(accepted, kept.tree.size))
        for policy in (chain, tree):  # a few steps suffice (they stop drafting at once when it loses)
            assert policy.draft_cost.value > 0.25 if cost > 0.1 else policy.draft_cost.value == pytest.approx(cost)
        assert (chain.choose(100) > 0) == drafts and (tree.choose(100) > 0) == drafts, cost


def test_step_times_follow_what_steps_cost_now():
    """v as the steps measure it: a size's own decayed mean, shrunk toward the pool of
    every size above 1 where it has few steps, over the single-token steps' mean; one
    stalled step is clipped."""
    steps = StepTimes()
    assert [steps.factor(t) for t in (1, 2, 8)] == [1.0, 1.0, 1.0]  # the profile as measured
    for _ in range(60):  # 4 tokens cost 1.5x the profile's time, a single token as profiled
        steps.update(4, 15.0, 10.0)
        steps.update(1, 10.0, 10.0)
    assert steps.factor(4) == pytest.approx(1.5, abs=0.02)
    assert steps.factor(6) == pytest.approx(1.5, abs=0.02)  # never tried: priced like the pool
    assert steps.factor(1) == 1.0
    for _ in range(300):  # the whole machine 20% slower: v itself unchanged
        steps.update(4, 12.0, 10.0)
        steps.update(1, 12.0, 10.0)
    assert steps.factor(4) == pytest.approx(1.0, abs=0.02)
    steps.update(4, 1000.0, 10.0)  # a step stalled by the OS counts as 2.5x, not 100x
    assert steps.factor(4) < 1.1


def test_cost_aware_k_drafts_less_when_steps_measure_dearer_than_profiled(tmp_path):
    """The same acceptance (tau 1.8 / 2.2 / 2.4 for k = 1 / 2 / 3): where scoring costs what
    the profile says (v 1.2 / 1.4 / 1.6) k = 2 pays; where steps of 2 or more tokens measure
    1.6x their profiled time (a shared machine in its slow state) and plain steps as
    profiled, no k pays (a drafted step comes only from probing). The engine reports every
    step's times, plain ones included."""
    def run(dearer: float) -> CostAwareK:
        policy = CostAwareK(CostModel(synthetic_profile(c=0.0), "ngram"), k_max=3, default_later=0.5)
        policy.start(prior_alpha=0.8)
        for step in range(100):
            k = policy.choose(100)
            profiled = policy.costs.profile.time_ms(k + 1, 100) / 1e3
            policy.observe_cost(0.0, k, profiled * (dearer if k else 1.0), k)
            policy.observe(k, min(k, (0, 1, 1, 2, 3)[step % 5]))
        return policy

    cheap, dear = run(1.0), run(1.6)
    assert cheap._best(100) >= 2 and sum(cheap.chosen[-40:]) / 40 > 2.0
    assert dear.costs.steps.factor(3) == pytest.approx(1.6, abs=0.05) and dear._best(100) == 0
    assert sum(dear.chosen[-40:]) < sum(cheap.chosen[-40:])

    scored = []

    class Spy(CostAwareK):
        def observe_cost(self, draft_seconds, passes, verify_seconds, tokens, *args):
            scored.append(tokens)
            assert verify_seconds > 0
            super().observe_cost(draft_seconds, passes, verify_seconds, tokens, *args)

    target = load_model(save_tiny_model(tmp_path / "t", seed=31, num_layers=2), torch.float32)
    policy = Spy(CostModel(synthetic_profile(c=0.02), "ngram"), k_max=4, probe_interval=2)
    engine = SpeculativeEngine(target.runtime, proposer=NgramProposer(), k=policy)
    engine.generate([5, 6, 7, 8] * 6, GREEDY)
    assert 0 in scored and max(scored) > 0 and len(scored) == len(policy.chosen)
    assert policy.costs.steps.single[1] > policy.costs.steps.strength  # plain steps were learnt from


def test_fixed_k_computes_logits_on_demand_only_where_the_profile_says_it_pays():
    from dataclasses import replace

    from specdecode.control.policies import FixedK

    assert FixedK(3).lazy(3)  # no profile: on demand, as before
    # the head bound by reading its weights (Zen 4): every row on demand costs about a pass
    bound = replace(synthetic_profile(), head_ms=0.8, head_next_ms=0.8, head_sizes=[1, 4], head_full_ms=[0.8, 0.9])
    # bound by arithmetic (AVX2 Zen 1): a row costs a fraction of a pass over four
    arith = replace(synthetic_profile(), head_ms=0.5, head_next_ms=0.5, head_sizes=[1, 4], head_full_ms=[0.5, 2.0])
    for profile, lazy in ((bound, False), (arith, True)):
        policy = FixedK(3, CostModel(profile, "ngram", lazy_head=True))
        policy.choose(100)
        assert policy.lazy(3) is lazy


def test_cost_aware_k_keeps_acceptance_per_kind_of_draft_across_requests():
    """Drafts of one kind always right, of another always wrong, interleaved in one
    request: per label, the first earn long drafts and the second none; the labels'
    counts outlive the request, the request's own counts start afresh."""
    policy = CostAwareK(CostModel(synthetic_profile(c=0.0), "ngram"), k_max=6)
    policy.start(prior_alpha=0.5)
    for step in range(80):
        label = ("prompt", 4) if step % 2 else ("store", 2)
        policy.use_label(label)
        k = policy.choose(100)
        policy.observe(k, k if label[0] == "prompt" else 0)
    policy.start(prior_alpha=0.5)
    policy.use_label(("prompt", 4))
    assert policy.first > 0.95 and policy._best(100) >= 3
    policy.use_label(("store", 2))
    assert policy.first < 0.3 and policy._best(100) == 0  # (plain steps observe nothing: probes only)
    policy.use_label(None)  # the request's own counts: the prior
    assert policy.first == pytest.approx(0.5)
    # a fresh label starts from the request's priors
    policy.use_label(("store", 4))
    assert policy.first == pytest.approx(0.5)
    # a request the router retries drafts from its retry prior under every label, so it
    # measures the task again (found in review: a seen label's counts priced it out, and
    # the tree budget ignored the prior)
    from specdecode.control.router import RETRY_PRIOR

    policy.start(prior_alpha=RETRY_PRIOR)
    policy.use_label(("store", 2))
    assert policy.first == pytest.approx(0.9) and policy._best(100) >= 1
    policy.observe(policy.choose(100), 0)
    policy.start(prior_alpha=0.5)  # the next request: the label's counts again
    policy.use_label(("store", 2))
    assert policy.first < 0.3
    tree = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3, prior_rate=0.5)
    tree.start(prior_alpha=0.9)
    assert tree.choose(100) == 0
    tree.start(prior_alpha=RETRY_PRIOR)
    assert tree.choose(100) > 0


def test_tree_budget_probes_and_returns_to_speculation():
    policy = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3, prior_rate=0.5)
    policy.base_probe_interval = policy.clock.interval = 4
    chosen = [policy.choose(100) for _ in range(5)]
    assert chosen == [0, 0, 0, 0, 3]  # the probe is a full tree
    for _ in range(6):  # the workload turns predictable: every node offered is accepted
        kept = policy.trim(chain_proposal([0.95, 0.9, 0.85], passes=1), 100, passes=1)
        policy.observe(kept.tree.size, kept.tree.size)
        policy.choose(100)
    assert policy.chosen[-1] >= 2 and policy.chosen[-5:].count(0) <= 1
    # no confidence: the step is not trimmed, and counts by its realized rate
    untrimmed = TreeProposal(Tree.chain(torch.tensor([1, 2])), passes=1)
    assert policy.trim(untrimmed, 100, passes=1) is untrimmed


def test_tree_budget_probes_score_a_node_so_a_low_scale_can_recover():
    """Found in review: after a wrong stretch the learnt scale made r(0) the best rate, every
    probe's tree was trimmed to nothing, nothing was learnt from it, and the request stayed
    plain through 2,000 steps of drafts that would all have been accepted."""
    policy = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3, prior_rate=1.3)
    for _ in range(12):  # sure and always wrong: the scale falls, trees shrink to nothing
        policy.choose(100)
        kept = policy.trim(chain_proposal([0.99, 0.98, 0.97]), 100, passes=2)
        policy.observe(kept.tree.size, 0)
    policy.base_probe_interval = policy.clock.interval = 4
    kept_on_probes = []
    for _ in range(400):  # now every draft is right
        if policy.choose(100):
            kept = policy.trim(chain_proposal([0.99, 0.98, 0.97]), 100, passes=2)
            kept_on_probes.append(kept.tree.size) if policy.probing else None
            policy.observe(kept.tree.size, kept.tree.size)
        else:
            policy.observe(0, 0)
    assert kept_on_probes and min(kept_on_probes) >= 1
    assert policy.chosen[-20:].count(0) <= 2 and policy.kept_sizes[-1] >= 2


def test_tree_budget_looks_again_at_once_after_a_probe_that_was_all_right():
    """Found in review: after a probe whose every node was accepted the interval doubled
    while the decayed rate caught up (CostAwareK looks again at once; the tree budget's
    probes are spaced like its), so drafting came back some hundred steps late."""
    policy = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3, prior_rate=1.3)
    for _ in range(12):  # sure and always wrong
        policy.choose(100)
        kept = policy.trim(chain_proposal([0.99, 0.98, 0.97]), 100, passes=2)
        policy.observe(kept.tree.size, 0)
    policy.clock.interval = 64  # probes spaced out by the wrong stretch
    for _ in range(70):
        if policy.choose(100) and policy.probing:
            break
        policy.observe(0, 0)
    assert policy.probing
    kept = policy.trim(chain_proposal([0.99, 0.98, 0.97]), 100, passes=2)
    policy.observe(kept.tree.size, kept.tree.size)  # every node right
    assert policy.clock.interval == 0 and policy.choose(100) > 0
    # a branching tree accepted down to its deepest node counts as all right too (found in
    # review of the fix: kept siblings made it compare the path with the node count)
    policy.clock.interval = 64
    for _ in range(70):
        if policy.choose(100) and policy.probing:
            break
        policy.observe(0, 0)
    branching = TreeProposal(Tree(torch.tensor([10, 11, 12]), torch.tensor([0, 0, 1])), passes=2)
    kept = policy.trim(branching, 100, passes=2)  # no confidence: kept whole, the sibling too
    assert kept.tree.size == 3
    policy.observe(kept.tree.size, 2)  # the path 10 -> 12, two deep: all the depth there was
    assert policy.clock.interval == 0


def test_tree_budget_starts_each_request_from_what_the_last_measured():
    """A request starts from the prior rate moved halfway to the rate the last request
    ended at: after requests whose trees lost, the next one starts plain."""
    policy = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3, prior_rate=1.3)
    policy.start()
    assert policy.choose(100) > 0 and policy.prior_rate == 1.3  # nothing observed: the prior stays
    first_choices = []
    for _ in range(3):  # requests where the drafter is sure and always wrong
        for _ in range(12):
            kept = policy.trim(chain_proposal([0.99, 0.98, 0.97]), 100, passes=2)
            policy.observe(kept.tree.size, 0)
            policy.choose(100)
        prior, ended = policy.prior_rate, policy.rate
        policy.start()
        assert policy.prior_rate == pytest.approx(0.5 * prior + 0.5 * ended) and ended < 1.0
        first_choices.append(policy.choose(100))
    assert first_choices[0] > 0 and first_choices[-1] == 0


# -- lossless with every policy ------------------------------------------------------
def test_adaptive_policies_are_token_identical_to_plain(tmp_path):
    target = load_model(save_tiny_model(tmp_path / "t", seed=30, num_layers=3), torch.float32)
    plain = SpeculativeEngine(target.runtime)
    rng = random.Random(3)
    policies = [ThresholdK(), CostAwareK(CostModel(synthetic_profile(c=0.02), "ngram"), k_max=7, probe_interval=2)]
    chosen = []
    for policy in policies:
        for proposer in (NgramProposer(), DraftModelProposer(target.runtime.layer_skip_view(2))):
            engine = SpeculativeEngine(target.runtime, proposer=proposer, k=policy)
            for _ in range(4):
                base = [rng.randrange(3, 97) for _ in range(rng.randint(2, 6))]
                prompt = (base * 4)[:30]
                assert engine.generate(prompt, GREEDY).token_ids == plain.generate(prompt, GREEDY).token_ids
                chosen += policy.chosen
    assert 0 in chosen and max(chosen) >= 3  # both plain steps and long drafts happened


def test_k_auto_is_the_default_and_builds_a_cost_aware_policy(tiny_llama_dir):
    assert SpeculativeConfig().k == "auto"
    engine = build_engine(EngineConfig(model=str(tiny_llama_dir), dtype="fp32"), SpeculativeConfig(method="ngram"))
    assert isinstance(engine.policy, CostAwareK) and engine.k == 10
    threshold = build_engine(EngineConfig(model=str(tiny_llama_dir), dtype="fp32"),
                             SpeculativeConfig(method="ngram", k_policy="threshold"))
    assert isinstance(threshold.policy, ThresholdK)
    with pytest.raises(ConfigError, match="k_policy must be one of"):
        SpeculativeConfig(k_policy="magic")


def test_cli_route_retries_a_task_sent_to_plain_decoding(tiny_text_model_dir, capsys):
    """A task whose measured speedup is below 1 is routed to plain decoding, and retried
    with speculation every retry_every requests, also across CLI invocations (the router
    state, request count included, is saved on every routed request)."""
    import json as json_module

    from specdecode import cli
    from specdecode.control.router import Router, TaskRecord, classify, router_state_path

    prompt = "What is the capital of France?"
    Router(records={f"{classify(prompt)}/ngram": TaskRecord(alpha=0.05, speedup=0.6, weight=5.0)}).save(
        cli_state_path(tiny_text_model_dir))
    methods, drafted = [], []
    for _ in range(Router().retry_every + 1):
        code = cli.main(["generate", prompt, "--route", "--method", "ngram", "--model", str(tiny_text_model_dir),
                         "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "24", "--json"])
        assert code == 0
        record = json_module.loads(capsys.readouterr().out)
        methods.append(record["route"]["method"])
        drafted.append(record["stats"]["draft_tokens"])
    assert methods.count("none") >= Router().retry_every - 1 and "ngram" in methods, methods
    # the retry drafted, so it measured the task again (found in review: it started from the
    # measured acceptance, decoded plainly throughout, and the record never changed)
    retried = methods.index("ngram")
    assert drafted[retried] > 0, drafted
    state = Router().load(cli_state_path(tiny_text_model_dir))
    assert state.records[f"{classify(prompt)}/ngram"].weight > 5.0 * Router().decay


def test_no_route_overrides_a_presets_route(tiny_text_model_dir, capsys):
    """The chat-assistant preset routes; --no-route turns that off, as flags override presets."""
    import json as json_module

    from specdecode import cli

    routed = []
    for flag in ([], ["--no-route"]):
        code = cli.main(["generate", "What is the capital of France?", "--preset", "chat-assistant", *flag, "--model",
                         str(tiny_text_model_dir), "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "3",
                         "--temperature", "0", "--json"])
        assert code == 0
        routed.append(json_module.loads(capsys.readouterr().out)["route"]["routed"])
    assert routed == [True, False]


def test_without_route_a_turned_off_task_still_gets_its_measured_prior(tiny_text_model_dir, capsys):
    """Found in review: without --route, a task the router had turned off (measured < 1x)
    started from no prior instead of the acceptance measured for it, and every 20th run
    from the router's optimistic retry prior, whose count this path never saves."""
    import json as json_module

    from specdecode import cli
    from specdecode.control.router import classify

    prompt = "What is the capital of France?"
    path = cli_state_path(tiny_text_model_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    priors = []
    for requests in (1, 19):  # the 20th request would be a retry when routing
        path.write_text(json_module.dumps({"records": {f"{classify(prompt)}/ngram": {
            "alpha": 0.12, "speedup": 0.5, "weight": 5.0}}, "requests": {classify(prompt): requests}}))
        code = cli.main(["generate", prompt, "--no-route", "--method", "ngram", "--model", str(tiny_text_model_dir),
                         "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "3", "--json"])
        assert code == 0
        priors.append(json_module.loads(capsys.readouterr().out)["route"]["prior_alpha"])
    assert priors == [0.12, 0.12]


@pytest.mark.parametrize("content", ["{bad", '{"records": 5}', '{"records": {"qa/ngram": {"alpha": "x", "nope": 1}}}',
                                     '{"records": {"general/ngram": {"alpha": "x", "speedup": "y", "weight": 5}}}'])
def test_an_unreadable_router_state_never_stops_a_request(tiny_text_model_dir, capsys, content):
    """Found in review: a torn or foreign router-state file made every `generate` end in a
    traceback, with or without --route. It is set aside with one line, and rewritten whole."""
    import json as json_module

    from specdecode import cli
    from specdecode.control.router import router_state_path

    path = cli_state_path(tiny_text_model_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    code = cli.main(["generate", "What is the capital of France?", "--route", "--method", "ngram", "--model",
                     str(tiny_text_model_dir), "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "3",
                     "--json"])
    captured = capsys.readouterr()
    assert code == 0 and "is unreadable" in captured.err and "starting afresh" in captured.err
    assert json_module.loads(path.read_text())["requests"]  # saved again, whole
    assert path.with_name(path.name + ".unreadable").read_text() == content  # set aside, not lost
    # one state per model, whatever the name it is reached by
    assert router_state_path(str(tiny_text_model_dir)) != router_state_path("default")
    assert router_state_path("smollm2") == router_state_path("default") == router_state_path("SmolLM2-135M-Instruct")
    from specdecode.models.loading import default_gguf_path  # and by its GGUF's own path (found in review)

    assert router_state_path(str(default_gguf_path())) == router_state_path("default")
    # and by how it runs: speedups measured in one dtype say nothing of another (found in review)
    assert cli_state_path(tiny_text_model_dir, "bf16") != path != router_state_path(str(tiny_text_model_dir))
    # but not by --exact, which changes no kernel that runs (found in review: each of its three
    # values kept a state of its own, so `analyze --exact` taught `generate --route` nothing)
    from specdecode.config import EngineConfig

    assert len({router_state_path("default", EngineConfig(exact=exact)) for exact in (None, True, False)}) == 1


# -- kernel threads for a server's decode passes (control.threads) --------------------------

def drive_threads(choice, speed, passes, rows_of=lambda i: 1 if i % 2 else 4):
    """Run ``passes`` decode passes through ``choice``; ``speed(kind, threads, i)`` is the
    factor over the predicted time a pass takes. Returns the thread count of each pass."""
    from specdecode.control.threads import ThreadChoice

    chosen = []
    for i in range(passes):
        rows = rows_of(i)
        threads = choice.choose(rows, 1, 100)
        kind = ThreadChoice.kind(rows)
        choice.observe(threads, rows, 1, 100, speed(kind, threads, i) * choice.predict(rows, 1, 100))
        chosen.append((kind, threads))
    return chosen


def test_thread_choice_runs_the_faster_count_per_kind_of_pass_and_looks_rarely():
    """One thread faster alone, two faster for batches (the Zen 3 server): after both are
    measured, each kind runs its faster count, and looking at the other costs few passes."""
    from specdecode.control.threads import ThreadChoice

    logged = []
    choice = ThreadChoice((1, 2), explore_every=8, log=logged.append)
    speed = lambda kind, threads, i: {("alone", 1): 1.0, ("alone", 2): 1.3, ("batch", 1): 1.4, ("batch", 2): 1.0}[kind, threads]
    chosen = drive_threads(choice, speed, 2000)
    late = chosen[200:]
    for kind, fast in (("alone", 1), ("batch", 2)):
        runs = [threads for k, threads in late if k == kind]
        assert choice.best(kind) == fast
        assert sum(t != fast for t in runs) / len(runs) < 0.03, kind  # the looks back off
    assert any("batch) now on 2" in line for line in logged) and any("alone) now on 1" in line for line in logged)
    assert choice.preferred == {"batch": 2, "alone": 1}  # what /metrics reports


def test_thread_choice_prices_a_sequences_drafts_apart_from_its_single_tokens():
    """One thread as fast as two for single-token passes (a server's front end takes the
    second core) but slower for passes that score drafts: each kind finds its own count.
    Priced together, the speculative passes followed the single-token ones to one thread."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2), explore_every=8)
    speed = {("alone", 1): 0.95, ("alone", 2): 1.0, ("drafts", 1): 1.5, ("drafts", 2): 1.0}
    chosen = []
    for i in range(1200):
        width = 1 if i % 3 else 4  # a plain step, then one scoring 3 drafts
        threads = choice.choose(1, width, 100)
        kind = ThreadChoice.kind(1, width)
        choice.observe(threads, 1, width, 100, speed[kind, threads] * choice.predict(1, width, 100))
        chosen.append((kind, threads))
    assert choice.preferred == {"alone": 1, "drafts": 2}
    late = [t for k, t in chosen[300:] if k == "drafts"]
    assert late.count(2) > 0.95 * len(late)


def test_a_choice_that_looks_when_stalled_runs_the_first_count_alone_until_a_pass_stalls():
    """A single request's engine on a machine it has to itself pays nothing for the choice
    (warming and looking at one thread cost a 128-token decode about 10% on a quiet Zen 3):
    every pass runs on the first count, through noise up to STALLED times its mean. Once a
    pass stalls (another process took a core) the counts are measured, and the one that is
    faster now is kept."""
    from specdecode.control.threads import STALLED, ThreadChoice

    logged = []
    choice = ThreadChoice((2, 1), explore_every=4, log=logged.append, look_when_stalled=True)
    predicted = choice.predict(1, 1, 100)
    for i in range(200):  # quiet, with noise short of a stall, and now and then one stall alone (the OS)
        threads = choice.choose(1, 1, 100)
        assert threads == 2, i
        choice.observe(threads, 1, 1, 100, predicted * (0.9 * STALLED if i % 7 == 0 else 5 * STALLED if i % 50 == 3
                                                         else 1.0))
    assert not choice.engaged and not logged
    busy = {2: 40.0, 1: 1.5}  # a process took a core: two threads stall at every barrier
    chosen = []
    for _ in range(60):
        threads = choice.choose(1, 1, 100)
        choice.observe(threads, 1, 1, 100, predicted * busy[threads])
        chosen.append(threads)
    assert choice.engaged and re.search(r"in a row took 3x its mean or more on 2 kernel thread\(s\), the second "
                                        r"\d+\.\dx", logged[0]), logged
    assert chosen[:2] == [2, 2] and chosen[-20:].count(1) >= 18, chosen

    # busy from the first pass: measured against the cost profile's time, not a mean of stalls
    logged.clear()
    choice = ThreadChoice((2, 1), lambda rows, width, context: 4.0, explore_every=4, log=logged.append,
                          look_when_stalled=True)
    chosen = []
    for _ in range(40):
        threads = choice.choose(1, 1, 100)
        choice.observe(threads, 1, 1, 100, 4.0 * busy[threads])
        chosen.append(threads)
    assert "took 3x the cost profile's time or more on 2 kernel thread(s), the second 40.0x" in logged[0], logged
    # the stalled pass prices two threads (no more warming of them); a look at them, 27x
    # slower than one thread, waits 10 x 26.7 = 267 passes for the next
    assert [i for i, n in enumerate(chosen) if n == 2] == [0, 1, 8], chosen  # two stalls, then one look
    for _ in range(300):
        threads = choice.choose(1, 1, 100)
        choice.observe(threads, 1, 1, 100, 4.0 * busy[threads])
        chosen.append(threads)
    assert [i for i, n in enumerate(chosen) if n == 2] == [0, 1, 8, 8 + 267], choice.interval


def test_a_look_one_position_further_counts_what_drafting_it_costs():
    """A mutation audit: the look past a full acceptance priced without its drafting cost
    passed every test. Drafting that costs a whole step a pass never pays a second draft."""
    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 3, 4],
                          step_ms=[[10, 10, 10.1, 10.2]], drafters={"ngram": 1.0})
    policy = CostAwareK(CostModel(profile, "ngram"), k_max=8, default_prior=0.9, default_later=0.9)
    policy.start()
    ks = []
    for _ in range(3 * policy.base_probe_interval):
        k = policy.choose(100)
        ks.append(k)
        policy.observe(k, k)
    assert 1 in ks and max(ks) == 1, ks


def test_what_drafting_cost_is_learnt_carries_into_the_next_request():
    """A mutation audit: each request starting again from the profile's drafting cost passed
    every test."""
    chain = CostAwareK(CostModel(synthetic_profile(c=0.02), "ngram"), k_max=3, default_later=0.5)
    chain.start(prior_alpha=0.5)
    for step in range(20):  # drafting measures 0.6 steps a pass, not the profile's 0.02
        k = chain.choose(100)
        if k:
            chain.observe_cost(k * 0.6 * 0.010, k, chain._v_table(100)[k] * 0.010, k)
            chain.observe(k, step % 2)
    assert chain.draft_cost.value > 0.25
    chain.start(prior_alpha=0.5)  # next request: drafts that pay only at 0.02 a pass are not offered
    assert chain.choose(100) == 0


def test_tree_budget_charges_a_drafter_without_confidence_for_its_head_passes():
    """A mutation audit: a tree's rate left its head passes uncharged and passed every test."""
    policy = TreeBudget(CostModel(synthetic_profile(c=0.5), "ngram"), k_max=3, prior_rate=1.3)
    for _ in range(10):  # 3 head passes at 0.5 steps each; only the first node is right
        if policy.choose(100):
            kept = policy.trim(TreeProposal(Tree.chain(torch.arange(10, 13)), passes=3), 100, passes=3)
            policy.observe(kept.tree.size, 1)
    assert policy.rate < 1.0 and policy.choose(100) == 0  # (1 + 1) / (v(3) + 3 x 0.5) = 0.65


def test_the_draft_cost_reads_a_lazy_steps_time_as_the_profile_prices_it():
    """Found in review: a step whose logits were computed on demand took less than v(k)
    plain steps by the head it skipped, yet the draft cost divided its time by the full
    v(k): the plain step read shorter, and c larger (0.127 and 0.147 for a true 0.10)."""
    from specdecode.cost.profile import CostProfile

    for head_ms in (0.5, 1.0):  # a row of the head costs that much of a 10 ms step
        profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4, 8],
                              step_ms=[[10, 11.8, 14, 19]], drafters={"ngram": 0.10}, head_ms=head_ms)
        policy = CostAwareK(CostModel(profile, "ngram", lazy_head=True), k_max=4)
        policy.start(0.5)
        k, read = 3, 1  # three drafts, the first rejected: one row read
        verify_ms = profile.time_ms(k + 1, 100) - profile.lazy_head_saving_ms(k + 1, read)
        assert verify_ms < profile.time_ms(k + 1, 100)
        for _ in range(60):
            policy.context = 100
            policy.observe_cost(k * 0.10 * 10.0 / 1e3, k, verify_ms / 1e3, k, read=read, lazy=True)
        assert policy._c == pytest.approx(0.10, rel=0.02), head_ms


def test_thread_choice_is_not_moved_by_passes_stalled_now_and_then():
    """Found in review: one pass stalled 10x by the OS raised its count's mean 1.6x (clipped
    at 4x, weight 0.2), and the faster count then lost to the slower one until the next
    look, up to 512 passes later: a stall every 200 passes put half of them on the slower
    count. A lone high pass now counts as 1.5x the mean; a slowdown that lasts still moves
    the choice (the second half: one thread 1.6x slower)."""
    import random

    from specdecode.control.threads import ThreadChoice

    for every in (200, 1000):
        choice = ThreadChoice((1, 2), predict=lambda rows, width, context: 1.0)
        true, rng, slow, passes = {1: 1.0, 2: 1.25}, random.Random(0), 0, 20000
        for i in range(passes):
            threads = choice.choose(1, 1, 100)
            real = true[threads] * (1.6 if i >= passes // 2 and threads == 1 else 1.0)
            stall = 10.0 if i % every == every - 1 else 1.0
            choice.observe(threads, 1, 1, 100, real * stall * rng.uniform(0.97, 1.03))
            slow += (threads == 2) if i < passes // 2 else (threads == 1)
        assert slow / passes < 0.03, (every, slow / passes)


def test_thread_choice_follows_a_machine_whose_speed_changes():
    """Two threads win for the first 600 passes, then lose by 40%: the looks find it and
    the choice moves back to one thread."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2), explore_every=8, max_explore_every=64)
    speed = lambda kind, threads, i: (0.7 if i < 600 else 1.4) if threads == 2 else 1.0
    chosen = drive_threads(choice, speed, 1500, rows_of=lambda i: 4)
    assert [t for _, t in chosen[300:600]].count(2) > 270
    assert [t for _, t in chosen[1000:]].count(1) > 450


def test_thread_choice_is_not_misled_by_a_stalled_first_pass_and_switches_soon():
    """The faster count's first pass stalls 10x (a server just started): the median of its
    first passes starts its mean, so it is preferred within a few dozen passes. Later,
    with the default back-off, the other count turns 30% faster: the looks find it."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2))
    speed = lambda kind, threads, i: (10.0 if i == 1 else 0.75) if threads == 2 else (1.4 if i < 1500 else 0.5)
    chosen = [t for _, t in drive_threads(choice, speed, 3000, rows_of=lambda i: 4)]
    assert chosen[20:1500].count(2) > 0.95 * 1480
    assert chosen[2200:].count(1) > 0.9 * 800


def test_thread_choice_keeps_its_preference_when_passes_go_unmeasured():
    """A pass whose time is never recorded (it raised, or its prediction was 0) must not turn
    every later pass into a look at the other count."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2), predict=lambda rows, width, context: 0.0 if width == 7 else 1.0, explore_every=8)
    for i in range(60):  # measured: 2 threads twice as fast
        threads = choice.choose(4, 1, 100)
        choice.observe(threads, 4, 1, 100, 1.0 if threads == 2 else 2.0)
    for _ in range(5):  # chosen, never measured: no prediction, or no observe at all
        choice.observe(choice.choose(4, 7, 100), 4, 7, 100, 1.0)
        choice.choose(4, 1, 100)
    later = [choice.choose(4, 1, 100) for _ in range(64)]
    assert later.count(2) >= 60


def test_thread_choice_with_one_option_never_looks_and_refuses_bad_counts():
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((2, 2))
    assert {t for _, t in drive_threads(choice, lambda *a: 1.0, 50)} == {2}
    for bad in ((), (0, 1), (1.5,)):
        with pytest.raises(ConfigError, match="thread counts"):
            ThreadChoice(bad)
    with pytest.raises(ConfigError, match="decay"):
        ThreadChoice((1, 2), decay=1.0)


def test_profile_measures_the_bandwidth_of_the_targets_device(tmp_path, monkeypatch):
    """The T = 1 bound reads the weights where they live: the profile asks for the
    bandwidth of the runtime's device (it once measured the host's for a GPU target)."""
    from specdecode.models.llama import load_native

    runtime = load_native(save_tiny_model(tmp_path / "t", seed=3, num_layers=1), torch.float32)
    asked = []
    monkeypatch.setattr(profile_module, "measure_target", lambda runtime, progress, **kw: ([100], [1, 2], [[1.0, 1.5]]))
    monkeypatch.setattr(profile_module, "measure_bandwidth", lambda device="cpu": asked.append(device) or 10.0)
    profile = get_profile("bandwidth-test", "fp32", runtime, progress=False)
    assert asked == [runtime.device] and profile.bandwidth_gbs == 10.0


def test_the_profile_reads_the_bandwidth_between_its_step_rounds(tmp_path, monkeypatch):
    """The T = 1 limit is the step's bytes at the bandwidth read between the step rounds:
    read once after them, minutes apart, the same step measured 1.3x and 1.9x of its limit."""
    from specdecode.models.llama import load_native

    runtime = load_native(save_tiny_model(tmp_path / "t", seed=3, num_layers=1), torch.float32)
    readings, order = iter([10.0, 40.0, 20.0] * 100), []
    monkeypatch.setattr(profile_module, "bandwidth_probe",
                        lambda device="cpu": lambda: order.append("probe") or next(readings))
    timed = profile_module.timed_forward_ms
    monkeypatch.setattr(profile_module, "timed_forward_ms", lambda *a: order.append("step") or timed(*a))
    monkeypatch.setattr(profile_module, "measure_bandwidth", lambda **kw: pytest.fail("read apart from the steps"))
    profile = get_profile("bandwidth-rounds", "fp32", runtime, progress=False)
    probes = [i for i, what in enumerate(order) if what == "probe"]
    assert len(probes) == 6 * len(profile.contexts)  # once after each timed round of each context
    assert probes[0] < order.index("step", probes[0]) < probes[-1]  # steps between the readings
    assert profile.bandwidth_gbs == 20.0  # their median


def _flat_profile(c: float, drafter: str, batch=None) -> CostProfile:
    """A profile where scoring T tokens costs 1 + 0.03 (T - 1) steps of 20 ms (wider at
    longer contexts), and drafting c steps a pass."""
    sizes, contexts = [1, 2, 4, 8, 16], [100, 600, 1500]
    table = [[20 * (1 + 0.05 * i) * (1 + 0.03 * (t - 1)) for t in sizes] for i in range(len(contexts))]
    profile = CostProfile("m", "bf16", "x", 2, contexts, sizes, table, drafters={drafter: c})
    if batch is not None:
        profile.batch_rows, profile.batch_widths, profile.batch_ms = batch
    return profile


@pytest.mark.parametrize("speed", [1.0, 0.85, 0.7])
def test_drafts_never_accepted_fall_back_to_plain_on_a_machine_faster_than_its_profile(speed):
    """Found in review: the steps' times are learnt relative to plain steps, so on a machine
    now faster than when profiled a request that drafted every step priced scoring two
    tokens below one, kept drafting with nothing accepted, and never took the plain step
    that would have corrected it (300 of 300 steps drafted at 0.85 and 0.7)."""
    profile = _flat_profile(0.001, "ngram")
    policy = CostAwareK(CostModel(profile, "ngram"), k_max=10, default_prior=0.5, default_later=0.5)
    policy.start()
    drafted = 0
    for step in range(300):
        context = 300 + step
        k = policy.choose(context)
        ms = profile.time_ms(k + 1, context) * speed
        policy.observe_cost(1e-6 * k, k, ms / 1e3, k)
        policy.observe(k, 0)  # nothing is ever accepted
        drafted += k > 0
    assert drafted < 60 and min(policy.costs.v_table(600, 10)[1:]) >= 1.0


def _batched_rows(c: float, prior: float, count: int):
    """A profile whose batched passes are memory bound (8 rows x 2 tokens cost barely more
    than 8 x 1) for a head drafter costing ``c`` steps a pass, and ``count`` server rows,
    each with its own policy (acceptance prior ``prior``) cloned from one template."""
    from types import SimpleNamespace

    from specdecode.serve.batch import clone_policy

    rows_, widths = [1, 2, 4, 8], [1, 2, 4, 6]
    batch_ms = [[20 * (1 + 0.1 * (r - 1)) * (1 + 0.03 * (w - 1)) for w in widths] for r in rows_]
    profile = _flat_profile(c, "eagle", batch=(rows_, widths, batch_ms))
    template = CostAwareK(CostModel(profile, "eagle"), k_max=6, default_prior=prior, default_later=prior)
    rows = []
    for _ in range(count):
        policy = clone_policy(template)
        policy.start(prior)
        rows.append(SimpleNamespace(policy=policy, tokens=[0] * 300))
    return profile, rows


def test_the_batch_cap_counts_what_the_rows_drafting_costs():
    """Found in review: 8 rows of a head drafter costing 0.3 of a step a pass, half their
    drafts accepted: the pass over 8 x 2 tokens costs barely more than 8 x 1, so the cap kept
    k = 1, which with the drafting runs at 0.61x of plain. With the drafting counted it keeps
    them plain."""
    from types import SimpleNamespace

    from specdecode.serve.batch import BatchEngine

    profile, rows = _batched_rows(c=0.3, prior=0.5, count=8)
    wanted = [row.policy.choose(300) for row in rows]
    assert max(wanted) >= 1  # alone, each row would draft
    engine = SimpleNamespace(batch_cost=profile.batch_time_ms, steps=1, probe_every=64)
    assert BatchEngine._batch_cap(engine, rows, wanted) == [0] * 8
    for row in rows:  # free drafting: the cap lets them draft
        row.policy._c = 0.0
    assert max(BatchEngine._batch_cap(engine, rows, wanted)) >= 1


def test_a_probe_the_batch_cap_holds_back_stays_due_until_it_goes_through():
    """Found in review: a plain row's probe passes the batch cap only on every 64th step; a
    probe capped on another step was spent, so a row whose probe period (30 here) never met
    those steps never looked at its acceptance again while batched."""
    from types import SimpleNamespace

    from specdecode.serve.batch import BatchEngine

    profile, rows = _batched_rows(c=0.2, prior=0.05, count=2)
    rows[0].policy.choose(300)  # admitted a step before the other: another phase
    engine = SimpleNamespace(batch_cost=profile.batch_time_ms, steps=0, probe_every=64)
    through = [0, 0]
    for step in range(1, 4000):
        engine.steps = step
        capped = BatchEngine._batch_cap(engine, rows, [row.policy.choose(300) for row in rows])
        for i, (row, k) in enumerate(zip(rows, capped)):
            through[i] += k > 0
            row.policy.observe(k, 0)  # a probe that went through is rejected: still losing
    assert min(through) >= 10, through


def test_the_transformers_runtime_names_its_device_in_the_profile_key(tiny_llama_dir):
    """Found in review: it said "transformers, float32" on a GPU too, so a profile measured on
    one stood in for the other on the same machine (the native runtime names the GPU)."""
    model = load_model(tiny_llama_dir, torch.float32, runtime="hf")
    on_cpu = model.runtime.describe()
    assert " on " not in on_cpu
    model.runtime.device = torch.device("meta")  # any device but the CPU
    assert model.runtime.describe() != on_cpu and " on meta" in model.runtime.describe()


def test_cli_route_learns_nothing_from_a_request_that_drafted_nothing(tiny_text_model_dir, capsys, monkeypatch):
    """Found in review: a routed request that ran plain taught its task an acceptance of 0."""
    import json as json_module

    from specdecode import cli
    from specdecode.control import router as router_module
    from specdecode.control.router import Router, router_state_path

    monkeypatch.setattr(router_module, "MIN_OBSERVED_TOKENS", 0)  # the guard on drafts alone, not on length
    cli_state_path(tiny_text_model_dir).unlink(missing_ok=True)  # what other tests taught this model

    code = cli.main(["generate", "What is the capital of France?", "--route", "--method", "ngram", "--model",
                     str(tiny_text_model_dir), "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "1",
                     "--json"])
    assert code == 0 and json_module.loads(capsys.readouterr().out)["stats"]["draft_tokens"] == 0
    assert Router().load(cli_state_path(tiny_text_model_dir)).records == {}


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[1, 2]", b"null", b'{"version": 1, "step_ms": [1]}'])
def test_damaged_cost_caches_are_measured_again(tmp_path, monkeypatch, content):
    """Found in review: a profile or weight-format cache holding valid JSON of the wrong shape,
    or bytes that are not UTF-8, ended in a traceback instead of a new measurement."""
    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    path = profile_module.profile_path("m", "fp32")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    assert load_profile("m", "fp32") is None
    cached = formats._path("m", torch.float32, ["q8_0", "bf16"])
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(content)
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {"q8_0": 2.0, "bf16": 3.0})
    assert formats.fastest_weights("m", torch.float32, ["q8_0", "bf16"], lambda fmt: None) == "q8_0"


@pytest.mark.parametrize("damage", [
    {"acceptance": {"ngram": ["0.3", 0.5]}}, {"acceptance": {"ngram": [0.3]}}, {"acceptance": {"ngram": [float("nan"), 0.5]}},
    {"drafters": {"ngram": "0.1"}}, {"contexts": []}, {"step_ms": [[10, 12], [20, 22, 30]]}, {"sizes": [2, 4, 8]},
    {"batch_rows": [1, 2], "batch_widths": [1], "batch_ms": [[3.0]]}, {"head_sizes": [2], "head_full_ms": []}])
def test_a_current_profile_with_fields_of_the_wrong_shape_is_measured_again(tmp_path, monkeypatch, damage):
    """Found in review: a cached profile of the current version with a field of another type
    or length loaded, then failed every request deep in a policy (a TypeError, an
    IndexError, numpy's 'fp and xp are not of the same length')."""
    import json

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    good = synthetic_profile()
    good.acceptance = {"ngram": [0.3, 0.6]}
    path = profile_module.profile_path("m", "fp32")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(good.to_dict()))
    assert load_profile("m", "fp32") == good
    path.write_text(json.dumps({**good.to_dict(), **damage}))
    assert load_profile("m", "fp32") is None


@pytest.mark.parametrize("timings", [{"bogus": 1.0}, {"q4_1": 1.0}, {"q8_0": -1.0}, {}, "[" * 100000])
def test_a_weight_format_record_outside_the_candidates_is_measured_again(tmp_path, monkeypatch, timings):
    """Found in review: a cached choice naming a format outside this run's candidates was
    trusted for good (an unknown name failed every run; q4_1 would have cut an 8-bit model
    to 4 bits), and deeply nested JSON ended in a RecursionError traceback."""
    import json

    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    cached = formats._path("m", torch.float32, ["q8_0", "bf16"])
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(timings if isinstance(timings, str) else json.dumps({"step_ms": timings}))
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {"q8_0": 2.0, "bf16": 3.0})
    assert formats.fastest_weights("m", torch.float32, ["q8_0", "bf16"], lambda fmt: None) == "q8_0"


def test_deeply_nested_router_state_is_set_aside(tmp_path):
    """Found in review: a router-state file of deeply nested JSON raised RecursionError,
    which the loader did not catch: every `generate` ended in a traceback."""
    from specdecode.control.router import Router

    path = tmp_path / "router.json"
    path.write_text("[" * 100000)
    assert Router().load(path).records == {}
    assert not path.exists() and (tmp_path / "router.json.unreadable").exists()


def test_cache_files_are_written_whole_by_concurrent_writers(tmp_path):
    """Found in review: the profile's fixed temporary name raced (one writer renamed the
    other's file away: FileNotFoundError), and the weight-format cache was written in place."""
    import json
    import threading

    from specdecode.models.loading import write_atomic

    path, errors = tmp_path / "p.json", []

    def writer(value: int) -> None:
        try:
            for _ in range(200):
                write_atomic(path, json.dumps({"value": value, "pad": "x" * 4000}))
        except Exception as error:  # noqa: BLE001  (any failure fails the test)
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and json.loads(path.read_text())["value"] in (0, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left


def test_measured_costs_are_keyed_by_the_kernels_build(monkeypatch):
    """Found in review: profiles and the weight-format choice were keyed by the kernels'
    source alone, so costs measured with an AVX2 build stood in for a scalar one, or for a
    build by another compiler."""
    from specdecode.cost import formats

    before = profile_module.profile_path("m", "fp32"), formats._path("m", torch.float32, ["bf16"])
    monkeypatch.setattr(profile_module, "build_digest", lambda: "another-build")
    monkeypatch.setattr(formats, "build_digest", lambda: "another-build")
    assert profile_module.profile_path("m", "fp32") != before[0]
    assert formats._path("m", torch.float32, ["bf16"]) != before[1]


def test_a_draft_model_has_one_key_by_any_path_and_a_new_one_when_retrained(tmp_path, monkeypatch):
    """Found in review: a draft model was keyed by the string given, so `d`, `./d` and its
    absolute path were calibrated three times, and a retrained draft saved over the same
    path reused the old one's acceptance and cost."""
    from safetensors.torch import load_file, save_file

    from specdecode.factory import drafter_key

    draft = save_tiny_model(tmp_path / "d", seed=1)
    monkeypatch.chdir(tmp_path)
    keys = {drafter_key(SpeculativeConfig(method="draft", draft=name)) for name in ("d", "./d", str(tmp_path / "d"))}
    assert len(keys) == 1
    tensors = load_file(draft / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    assert drafter_key(SpeculativeConfig(method="draft", draft="d")) not in keys
    assert drafter_key(SpeculativeConfig(method="draft", draft="self:4")) == "draft:self:4"


def test_drafters_with_other_ngram_sizes_are_calibrated_and_priced_apart():
    """Found in review: the acceptance calibrated for prompt lookup with n-grams (3, 2, 1)
    was reused for --ngram-sizes 1 (which drafts on far more steps, and worse), because the
    drafter's name in the cost profile ignored the sizes. The default keeps its name."""
    from specdecode.control.router import Router
    from specdecode.factory import drafter_key

    assert drafter_key(SpeculativeConfig(method="ngram")) == "ngram"
    assert drafter_key(SpeculativeConfig(method="ngram", ngram_sizes=(1, 2, 3))) == "ngram"
    assert drafter_key(SpeculativeConfig(method="ngram", ngram_sizes=(1,))) == "ngram n=1"
    default_suffix = drafter_key(SpeculativeConfig(method="suffix"))
    assert drafter_key(SpeculativeConfig(method="suffix", ngram_sizes=(4, 2))) == default_suffix + " n=4,2"
    assert drafter_key(SpeculativeConfig(method="tree", ngram_sizes=(2,))).endswith(" n=2")
    # the eagle head alone looks up no n-grams
    assert drafter_key(SpeculativeConfig(method="eagle", ngram_sizes=(2,))) == drafter_key(
        SpeculativeConfig(method="eagle"))
    # the built-in per-task guesses are the default's: another drafter starts from its own
    # calibrated rate (the family's guess overrode it, found in review)
    router = Router()
    assert router.prior("code", "ngram") is not None and router.prior("code", "ngram n=1") is None


def test_logits_on_demand_never_price_a_step_below_a_plain_one():
    """A profile timed while the machine was busy can hold a head pass over 2 rows far
    dearer than on demand: the saving then exceeded v, a step cost less than nothing, and
    choosing k raised "step cost must be positive" mid-request (seen once in a suite run
    beside other work). A head pass timed above the whole step it belongs to saves
    nothing (a floor at one step alone made every k cost the same, and k_max won at any
    acceptance, found in review); and no step is priced below a plain one."""
    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4], step_ms=[[10, 11, 13]],
                          drafters={"ngram": 0.0}, head_ms=2.0, head_next_ms=2.0, head_sizes=[1, 2, 4],
                          head_full_ms=[2.0, 30.0, 40.0])
    costs = CostModel(profile, "ngram", lazy_head=True)
    assert costs.step_cost(1, 1.0, 100) == (pytest.approx(1.1), False)
    policy = CostAwareK(costs, k_max=3, default_later=0.02)
    policy.start(prior_alpha=0.02)
    assert policy.choose(100) == 0  # drafting that is never accepted does not pay
    # a consistent profile whose saving would take a step below one: floored
    cheap = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4], step_ms=[[10, 10.5, 13]],
                        drafters={"ngram": 0.0}, head_ms=0.1, head_next_ms=0.1, head_sizes=[1, 2, 4],
                        head_full_ms=[0.1, 9.0, 12.0])
    assert CostModel(cheap, "ngram", lazy_head=True).step_cost(1, 1.0, 100) == (1.0, True)


def test_the_router_does_not_blame_a_task_type_for_the_callers_method_none():
    """Found in review: `generate --route --method none` said 'speculation disabled for this
    task type', as if the router had chosen it."""
    from specdecode.control.router import Router

    route = Router().route("Write a Python function that adds two numbers.", method="none", drafter="none")
    assert route.method == "none" and "method none was asked for" in route.reason


def test_one_outlying_request_cannot_turn_a_task_off(tmp_path):
    """Found in review: a routed run on a contended machine measured 0.003x and, as its
    task's first observation, sent the task to plain decoding; a 3-token request counted as
    much as a long one; NaN in the state file failed later requests."""
    import json as json_module

    from specdecode.control.router import Router, classify

    prompt = "Write a Python function that reverses a string."
    task = classify(prompt)
    router = Router()
    router.observe(task, "ngram", 0.5, 1.3, tokens=3)  # too short to say anything
    assert f"{task}/ngram" not in router.records
    router.observe(task, "ngram", 0.5, 0.003, tokens=128)
    router.observe(task, "ngram", 0.5, float("nan"), tokens=128)  # not a measurement
    assert router.records[f"{task}/ngram"].speedup == 0.25
    for _ in range(4):
        router.observe(task, "ngram", 0.5, 1.3, tokens=128)
    assert router.route(prompt).method == "ngram"
    path = tmp_path / "state.json"
    # and values no measurement gives: a weight beyond the decayed sum's limit (10) or a
    # speedup outside the clipped range kept a task on plain through any retry, an acceptance
    # of true became a prior (found in review)
    for bad in ({"alpha": float("nan"), "speedup": 1.2, "weight": 4}, {"alpha": 0.5, "speedup": 1.2, "weight": 4,
                                                                       "extra": 1},
                {"alpha": 0.5, "speedup": 0.5, "weight": 1000}, {"alpha": 0.5, "speedup": 0.01, "weight": 4},
                {"alpha": True, "speedup": 1.2, "weight": 4}):
        path.write_text(json_module.dumps({"records": {f"{task}/ngram": bad}}))
        warned = []
        assert Router().load(path, warn=warned.append).records == {} and warned
        assert not path.exists() and path.with_name("state.json.unreadable").exists()
    path.write_text(json_module.dumps({"records": {}, "requests": {task: 1e400}}))
    assert Router().load(path, warn=lambda message: None).requests == {}


def test_a_routed_speedup_prices_plain_steps_as_they_cost_now():
    """Found in review: a request's speedup priced plain decoding at the profile's step
    time, though the k policy had learnt that steps here now cost more (a machine slower
    than its profile): a task gaining 1.1x measured 0.9x and could be turned off."""
    from specdecode.control.router import speedup_from_stats
    from specdecode.metrics import GenerationStats

    profile = synthetic_profile()
    costs = CostModel(profile, "ngram")
    stats = GenerationStats(new_tokens=100)
    plain = 100 * profile.time_ms(1, 10 + 50) / 1e3
    assert speedup_from_stats(stats, profile, 10, decode_seconds=plain / 1.1, costs=costs) == pytest.approx(1.1)
    for _ in range(200):  # plain steps here take 1.25x the profile's
        costs.observe_step(1, 1.25 * profile.time_ms(1, 96), 64)
    assert costs.steps.single_factor == pytest.approx(1.25, rel=0.02)
    slower = plain * 1.25 / 1.1  # the request ran 1.1x faster than plain decoding runs now
    assert speedup_from_stats(stats, profile, 10, decode_seconds=slower, costs=costs) == pytest.approx(1.1, rel=0.02)
    assert speedup_from_stats(stats, profile, 10, decode_seconds=slower) < 0.9  # the profile alone


def test_one_stalled_drafting_pass_does_not_price_drafting_out():
    """Found in review: the drafting cost took each pass's time as measured, so one pass
    stalled for 200 ms (the OS, a page fault) moved c from 0.05 to 1.39 and the policy
    decoded plain for 128 steps. A cost that really grew is still followed."""
    from specdecode.control.policies import DraftCost

    cost = DraftCost(0.05)
    cost.update(0.2, 1, 0.010, 1.0)  # 200 ms of drafting against a 10 ms step
    assert cost.value < 0.15
    for _ in range(3):
        cost.update(0.0005, 1, 0.010, 1.0)  # back to 0.05 of a step
    assert cost.value < 0.1
    grown = DraftCost(0.05)
    for _ in range(10):
        grown.update(0.004, 1, 0.010, 1.0)  # the drafter now costs 0.4 of a step
    assert 0.3 < grown.value <= 0.4


def test_a_presets_k_max_is_no_flag_beside_an_explicit_k(tiny_text_model_dir, capsys):
    """Found in review: a preset that sets k_max made `--preset creative-writing --k 3` refuse
    a --k-max the user never gave; a --k-max given beside a fixed --k is still refused."""
    from specdecode import cli

    base = ["generate", "Write a short poem.", "--model", str(tiny_text_model_dir), "--dtype", "fp32",
            "--no-chat-template", "--max-new-tokens", "2"]
    assert cli.main([*base, "--preset", "creative-writing", "--k", "3"]) == 0
    capsys.readouterr()
    assert cli.main([*base, "--preset", "creative-writing", "--k", "3", "--k-max", "6"]) == 2
    assert "--k-max choose k under --k auto" in capsys.readouterr().err


def test_weights_auto_leaves_out_a_format_the_file_cannot_take(tmp_path, monkeypatch):
    """Found in review: a GGUF that mixes block types in one fused projection (Q8_0 v beside
    Q4_1 q and k) cannot load as int4, and --weights auto failed with it instead of timing
    the formats that load."""
    from specdecode.config import ConfigError
    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))

    def load(fmt):
        if fmt == "q4_1":
            raise ConfigError("only layers of one format can be fused")
        return fmt

    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {name: 2.0 + len(name) for name in runtimes})
    assert formats.fastest_weights("mixed", torch.float32, ["q4_1", "q8_0", "bf16"], load) == "q8_0"
    # every format refused for one reason: that reason is the error (found in review: "none
    # of the weight formats loads this model", the cause on stderr only)
    with pytest.raises(ConfigError, match="^only layers of one format can be fused$"):
        formats.fastest_weights("mixed-2", torch.float32, ["q4_1"], load)

    def refuse(fmt):
        raise ConfigError(f"{fmt} says no")

    with pytest.raises(Exception, match="none of the weight formats .*q4_1: q4_1 says no; q8_0: q8_0 says no"):
        formats.fastest_weights("mixed-3", torch.float32, ["q4_1", "q8_0"], refuse)


def test_weights_auto_measures_again_for_another_checkpoint_at_the_same_path(tmp_path, monkeypatch):
    """Found in review: the measured choice was keyed by the directory's path, so a model
    saved where another had been took its choice, one it could not load (q8_0 for 48-wide
    layers: a ConfigError instead of bf16)."""
    import shutil

    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {name: {"q8_0": 1.0}.get(name, 2.0) for name in runtimes})
    model = tmp_path / "model"
    save_tiny_model(model, seed=1, num_layers=1)
    assert load_model(str(model), torch.bfloat16).runtime.weight_format == "q8_0"
    shutil.rmtree(model)
    save_tiny_model(model, seed=2, num_layers=1, hidden_size=48, num_heads=3, num_kv_heads=1)
    assert load_model(str(model), torch.bfloat16).runtime.weight_format == "bf16"


def test_cost_caches_that_cannot_be_written_leave_the_run_going(tmp_path, monkeypatch, capsys):
    """Found in review: on a read-only cache (a pre-built image) the cost profile and the
    weight-format choice were measured for minutes, then saving them raised OSError."""
    from specdecode.cost import formats
    from specdecode.models import loading

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))

    def read_only(path, text):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(loading, "write_atomic", read_only)
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {"q8_0": 2.0, "bf16": 3.0})
    assert formats.fastest_weights("m", torch.float32, ["q8_0", "bf16"], lambda fmt: None) == "q8_0"
    profile = CostProfile(model="m", machine="m", threads=1, dtype="fp32", contexts=[100], sizes=[1, 2],
                          step_ms=[[1.0, 1.5]])
    profile_module.save_profile(profile, "m")
    err = capsys.readouterr().err
    assert "the weight format choice not saved" in err and "the cost profile not saved" in err
    assert "Read-only file system" in err and load_profile("m", "fp32") is None


def test_processes_starting_together_measure_the_cost_profile_once(tmp_path, monkeypatch):
    """Found in review: Ray replicas on one host started together each measured the same
    profile at once on the same cores (each timing inflated by the others) and saved over
    each other. One measures under a lock; the others wait and read what it saved."""
    import threading
    import time as time_module

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    calls = []

    def measure_target(runtime, progress=True, **kw):
        calls.append(1)
        time_module.sleep(0.3)
        return [100], [1, 2], [[1.0, 1.5]]

    monkeypatch.setattr(profile_module, "measure_target", measure_target)
    monkeypatch.setattr(profile_module, "step_bytes", lambda runtime: (0, 0))
    monkeypatch.setattr(profile_module, "measure_bandwidth", lambda device="cpu": 10.0)
    monkeypatch.setattr(profile_module, "measure_head", lambda runtime: {})
    runtime = type("Runtime", (), {"max_positions": 256, "vocab_size": 97})()
    results = []
    threads = [threading.Thread(target=lambda: results.append(get_profile("m", "fp32", runtime, progress=False)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 3 and all(r.step_ms == [[1.0, 1.5]] for r in results)


def test_a_short_prefill_chunk_has_a_cost_profile_of_its_own(tiny_llama_dir):
    """Found in review: a profile measured with 256-token chunks (v of 32 and 64 tokens in one
    pass) served a run with --prefill-chunk 16, whose passes of 32 and 64 are split in 2 and 4."""
    from specdecode.factory import model_key

    default, short = load_model(tiny_llama_dir, torch.float32), load_model(tiny_llama_dir, torch.float32, prefill_chunk=16)
    assert model_key(default) == model_key(load_model(tiny_llama_dir, torch.float32, prefill_chunk=64))
    assert model_key(short) != model_key(default) and model_key(short).endswith("|chunk 16")


def test_weights_auto_times_a_large_model_one_format_at_a_time(tmp_path, monkeypatch):
    """Found in review: --weights auto loaded every candidate format at once to time them,
    so a model whose three formats do not fit in memory together (a 7B: 25 GB) ran out of
    it. Where they would not fit, each is timed alone and let go before the next loads."""
    import gc
    import weakref

    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    alive, most = weakref.WeakSet(), []

    class Runtime:
        def __init__(self, fmt):
            self.fmt = fmt

    def load(fmt):
        gc.collect()
        runtime = Runtime(fmt)
        alive.add(runtime)
        most.append(len(alive))
        return runtime

    monkeypatch.setattr(formats, "_weight_bytes", lambda runtime: 10**9)
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {name: {"q4_1": 3.0, "q8_0": 2.0, "bf16": 4.0}[name]
                                                              for name in runtimes})
    monkeypatch.setattr(formats, "_available_bytes", lambda: 4e9)  # 1.7 + 3.2 GB more would not fit beside
    assert formats.fastest_weights("big", torch.bfloat16, ["q4_1", "q8_0", "bf16"], load) == "q8_0"
    assert max(most) == 1
    monkeypatch.setattr(formats, "_available_bytes", lambda: 64e9)  # a small model: all at once, taking turns
    most.clear()
    assert formats.fastest_weights("small", torch.bfloat16, ["q4_1", "q8_0", "bf16"], load) == "q8_0"
    assert max(most) == 3


def test_a_drafters_cost_is_priced_against_a_step_where_it_was_measured(tmp_path, monkeypatch):
    """Found in review: a model of short context had its drafter timed at half its positions
    but divided by a step at the profile's middle context."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(profile_module, "measure_target", lambda runtime, progress=True, **kw: (
        [100, 600], [1, 2], [[1.0, 1.5], [3.0, 4.0]]))
    monkeypatch.setattr(profile_module, "step_bytes", lambda runtime: (0, 0))
    monkeypatch.setattr(profile_module, "measure_bandwidth", lambda device="cpu": 10.0)
    monkeypatch.setattr(profile_module, "measure_head", lambda runtime: {})
    contexts = []
    monkeypatch.setattr(profile_module, "measure_drafter",
                        lambda proposer, context, vocab_size: contexts.append(context) or 0.5)
    runtime = type("Runtime", (), {"max_positions": 256, "vocab_size": 97})()
    profile = get_profile("short", "fp32", runtime, {"ngram": object()}, progress=False)
    assert contexts == [128] and profile.drafters["ngram"] == pytest.approx(0.5 / profile.time_ms(1, 128))
    assert profile.time_ms(1, 128) != profile.time_ms(1, 600)
    # a draft model of a shorter context than the target's is timed where it can draft
    # (found in review: timed at 1,500 tokens, it drafted nothing and c read 0.017)
    long_target = type("Runtime", (), {"max_positions": 8192, "vocab_size": 97})()
    short_draft = type("Draft", (), {"runtime": type("DraftRuntime", (), {"max_positions": 256})()})()
    contexts.clear()
    get_profile("long", "fp32", long_target, {"draft": short_draft}, progress=False)
    assert contexts == [128]


def test_a_drafter_that_drafts_nothing_is_not_timed_as_free():
    """Found in review: a call that drafted nothing was divided by one draft: c about 0."""
    from specdecode.config import SpecDecodeError
    from specdecode.proposers.base import Proposal

    class Silent:  # a model drafter (a runtime of its own)
        runtime = object()

        def start(self, tokens, capacity):
            pass

        def propose(self, tokens, k, params, generator):
            return Proposal.empty()

    with pytest.raises(SpecDecodeError, match="drafted nothing at a context of 50 tokens"):
        profile_module.measure_drafter(Silent(), 50, 97)

    # a draft model with fewer rows than the target reads only ids it has (found in review of
    # the check above: a context holding a larger id drafted nothing, and the profile failed)
    class Small(Silent):
        runtime = type("DraftRuntime", (), {"vocab_size": 10})()

        def propose(self, tokens, k, params, generator):
            assert max(tokens) < 10
            return Proposal(torch.tensor([1]))

    assert profile_module.measure_drafter(Small(), 50, 97) >= 0


def test_cli_route_keeps_what_another_process_learnt_meanwhile(tiny_text_model_dir, capsys, monkeypatch):
    """Found in review: each `generate --route` loaded the router state before its request
    and saved that copy after it, so a lesson another process saved meanwhile was lost."""
    import dataclasses

    from specdecode import cli
    from specdecode.control import router as router_module
    from specdecode.control.router import Router
    from specdecode.engine import SpeculativeEngine

    monkeypatch.setattr(router_module, "MIN_OBSERVED_TOKENS", 0)
    path = cli_state_path(tiny_text_model_dir)
    path.unlink(missing_ok=True)
    generate = SpeculativeEngine.generate

    def generate_beside_another_process(self, *args, **kwargs):
        result = generate(self, *args, **kwargs)
        other = Router().load(path)  # another process finishes a request meanwhile and saves
        other.observe("elsewhere", "ngram", 0.5, 1.2, 100)
        other.save(path)
        # as if this request drafted (the tiny model's few tokens rarely give prompt lookup a match)
        stats = dataclasses.replace(result.stats, draft_tokens=4, accepted_tokens=2, draft_passes=2)
        return dataclasses.replace(result, stats=stats)

    monkeypatch.setattr(SpeculativeEngine, "generate", generate_beside_another_process)
    code = cli.main(["generate", "What is the capital of France?", "--route", "--method", "ngram", "--model",
                     str(tiny_text_model_dir), "--dtype", "fp32", "--no-chat-template", "--max-new-tokens", "4",
                     "--json"])
    capsys.readouterr()
    assert code == 0
    records = Router().load(path).records
    assert "elsewhere/ngram" in records and len(records) == 2, records


def test_tree_budget_probes_across_short_requests():
    """Found in review: the probe countdown restarted with every request, and the prior rate
    moves only after a request observed a step, so once it said "plain" no request shorter
    than the probe interval ever drafted again. The count now runs across requests, and a
    probe whose tree came back empty stays due."""
    policy = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3, prior_rate=1.0)
    policy.base_probe_interval = policy.clock.interval = 20
    probes = 0
    for _ in range(5):  # requests of 8 steps each, shorter than the interval
        policy.start()
        for _ in range(8):
            if policy.choose(100):
                probes += 1
                kept = policy.trim(chain_proposal([0.95, 0.9, 0.85], passes=1), 100, passes=1)
                policy.observe(kept.tree.size, kept.tree.size)
            else:
                policy.observe(0, 0)
    assert probes >= 1 and policy.prior_rate > 1.0
    empty = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3, prior_rate=0.5)
    empty.base_probe_interval = empty.clock.interval = 2
    assert [empty.choose(100) for _ in range(3)] == [0, 0, 3]
    empty.trim(TreeProposal(Tree.chain(torch.tensor([], dtype=torch.int64)), confidence=torch.tensor([])), 100, 1)
    empty.observe(0, 0)
    assert empty.choose(100) == 3  # the probe that drafted nothing is tried again at once


def test_the_target_loads_with_the_threads_asked_for(monkeypatch):
    """Found in review: `generate --threads 1` (and bench, analyze, check) loaded the target
    before applying --threads, so `--weights auto` timed the formats, and cached its choice,
    at the default thread count."""
    from specdecode import factory
    from specdecode.config import EngineConfig

    seen, before = [], torch.get_num_threads()
    monkeypatch.setattr(factory, "load_model", lambda *args, **kwargs: seen.append(torch.get_num_threads()))
    try:
        torch.set_num_threads(2)
        factory.load_target(EngineConfig(model="x", num_threads=1))
        assert seen == [1]
    finally:
        torch.set_num_threads(before)


def test_another_checkpoint_at_the_same_path_has_costs_of_its_own(tmp_path):
    """Found in review: the cost profile (v(k), drafter costs, calibrated acceptance) was
    keyed by the checkpoint's path alone, so a model saved where another had been took its
    costs."""
    import shutil

    from specdecode.factory import model_key

    path = tmp_path / "model"
    save_tiny_model(path, seed=1, num_layers=2)
    first = model_key(load_model(path, torch.float32))
    assert model_key(load_model(path, torch.float32)) == first
    shutil.rmtree(path)
    save_tiny_model(path, seed=2, num_layers=1)
    assert model_key(load_model(path, torch.float32)) != first


def test_a_calibration_that_drafted_nothing_gives_no_prior(monkeypatch):
    """Found in review: calibration runs in which the drafter drafted nothing read as
    acceptance (0, 0), cached for good as the drafter's prior: 'never accepted' where there
    was no evidence at all."""
    from specdecode import factory
    from specdecode.metrics import GenerationStats

    nothing = GenerationStats()
    nothing.observe_step(0, 0)
    monkeypatch.setattr(factory, "calibration_runs", lambda target, proposer: [nothing, nothing])
    assert factory.calibrate_acceptance(None, None) is None
    drafted = GenerationStats()
    drafted.observe_step(2, 1)
    monkeypatch.setattr(factory, "calibration_runs", lambda target, proposer: [nothing, drafted])
    assert factory.calibrate_acceptance(None, None) == (1.0, 0.0)


def test_cost_aware_k_boundaries_are_the_documented_ones():
    """Each rule of CostAwareK at its boundary (a mutation audit found each could change
    unseen): a position is worth a look while its successes reach half its prior's share;
    refused, it is looked at after 4, then 8 refusals; a probe drafts one token; after a
    partial rejection nothing is explored; a prior of 1 is held to 0.99; and a first
    measured drafting cost above a zero prior still counts."""
    from specdecode.control.policies import DraftCost

    policy = CostAwareK(CostModel(synthetic_profile(), "ngram"), k_max=6, default_prior=0.6, default_later=0.6)
    policy.position_counts[1] = [4.0, 10.0]  # 4 >= 0.5 * 0.6 * 10
    assert policy._may_look(3)
    policy.position_counts[1] = [0.0, 10.0]
    assert [policy._may_look(3) for _ in range(12)] == [False] * 3 + [True] + [False] * 7 + [True]

    policy = CostAwareK(CostModel(synthetic_profile(), "ngram"), k_max=6, probe_interval=4)
    for _ in range(200):
        policy.observe(policy.choose(100), 0)
    assert {k for k in policy.chosen[20:] if k} == {1}

    def after(accepted):  # k 2 drafted, then ``accepted`` of them right
        policy = CostAwareK(CostModel(synthetic_profile(c=0.0), "ngram"), k_max=6, default_prior=0.6,
                            default_later=0.6)
        assert policy.choose(100) == 2
        policy.observe(2, accepted)
        return policy, policy.choose(100)

    assert after(2)[1] == 3  # all right: position 3 is looked at
    policy, k = after(1)
    assert k == policy._best(100) == 2  # one rejected: nothing beyond the best is explored

    policy.start(prior_alpha=1.0)
    assert policy.first == pytest.approx(0.99)

    cost = DraftCost(0.0)
    cost.update(0.01, 1, 1.0, 1.0)
    assert cost.value > 0


def test_the_tree_budget_never_credits_more_accepted_nodes_than_it_keeps():
    """r(n) counts at most n accepted nodes, however large the learnt scale (a mutation
    audit: without the cap a scale of 8 promised 7 accepted nodes of one)."""
    policy = TreeBudget(CostModel(synthetic_profile(), "ngram"), k_max=3)
    policy.context = 100
    policy.scale_counts = [8.0, 1.0]
    rates = policy._rates(torch.tensor([0.9] * 4), passes=2)
    table, d = policy._v_table(100), 2 * policy._c
    for n in range(1, 4):
        assert rates[n] <= (1 + n) / (table[n] + d) + 1e-9


def test_the_threshold_policy_at_its_boundaries():
    """Off after exactly ``window`` observations below stop_below; a mean of exactly
    raise_above does not raise k (the rule is "above 0.8")."""
    policy = ThresholdK()
    for _ in range(10):
        policy.observe(5, 0)
    assert policy.choose(0) == 0
    policy = ThresholdK()
    policy.observe(5, 4)
    assert policy.choose(0) == 5


def test_a_request_with_no_new_tokens_measures_no_speedup():
    from specdecode.control.router import speedup_from_stats
    from specdecode.metrics import GenerationStats

    stats = GenerationStats(new_tokens=0, wall_seconds=1.0, prefill_seconds=0.2)
    assert speedup_from_stats(stats, synthetic_profile(), 10) == 1.0


def test_best_k_prefers_plain_and_shorter_drafts_on_a_tie():
    # every k only breaks even (tau 1 for a step costing 1): plain decoding, not drafting for nothing
    assert best_k(0.0, lambda k: 1.0, 0.0, 4) == (0, 1.0)
    # alpha 1 with v(k) = k + 1: every k is exactly 1.0x as well
    assert best_k(1.0, lambda k: k + 1.0, 0.0, 4) == (0, 1.0)
    # alpha 1 pays exactly k + 1 at every k: the break-even acceptance is 1, not "never"
    assert break_even_alpha(2, 3.0, 0.0) == pytest.approx(1.0, abs=1e-5)


def test_a_zero_step_cost_is_a_config_error_and_no_drafter_teaches_the_router_nothing():
    from specdecode.control.router import Router

    with pytest.raises(ConfigError):
        expected_speedup(1.0, 0.0, 0.0, 0)
    router = Router()
    router.observe("code", None, alpha=0.5, speedup=1.2)  # plain decoding drafted nothing
    assert router.records == {}


def test_theory_refuses_impossible_rates_and_a_zero_tau_measures_no_speedup():
    """An acceptance rate outside [0, 1] is a ConfigError naming the rates (1.5 gave tau 3.5
    silently), and a request with tau 0 (nothing measured) is 1.0x, not a ZeroDivisionError.
    Found by a mutation audit: no test failed without either check."""
    assert tau_from_positions([1.0, 0.0]) == 2.0
    for rates in ([1.5], [0.5, -0.1]):
        with pytest.raises(ConfigError, match="acceptance rates must be in"):
            tau_from_positions(rates)
    assert wall_speedup(100, 10.0, 0.0, 1.2) == 1.0
    assert wall_speedup(100, 10.0, 2.0, 1.0) == pytest.approx(110 / 60)


# -- the cost profile's figures and measurements, held by a mutation audit ----------------
def test_profile_interpolates_over_contexts_by_distance_and_extends_the_last_segment_upwards_only():
    """Between two measured contexts each is weighted by nearness (150 lies a quarter of the
    way from 100 to 300); beyond the last, the last segment's slope continues, and a last
    context measured cheaper than the one before (noise) is held, not extended down.
    Found by a mutation audit: a halfway point and two contexts hid all three."""
    rising = CostProfile("m", "fp32", "cpu", 2, contexts=[100, 300, 1300], sizes=[1, 2],
                         step_ms=[[10, 12], [20, 24], [40, 44]])
    assert rising.time_ms(1, 150) == pytest.approx(12.5)  # 10 * 0.75 + 20 * 0.25
    assert rising.time_ms(2, 800) == pytest.approx(34)  # halfway between 24 and 44
    assert rising.time_ms(1, 2300) == pytest.approx(60)  # 20 ms per 1,000 tokens, the last segment's
    falling = CostProfile("m", "fp32", "cpu", 2, contexts=[100, 300, 1300], sizes=[1, 2],
                          step_ms=[[10, 12], [20, 24], [15, 17]])
    assert falling.time_ms(1, 2300) == pytest.approx(15)  # never cheaper at a longer context


def test_the_bandwidth_limit_is_the_steps_bytes_at_the_measured_bandwidth_in_ms():
    """400 MB of weights at 20 GB/s take 20 ms; with the cache, 100 kB per token over 1,000
    tokens more (25 ms); unmeasured bandwidth gives no limit. Found by a mutation audit:
    seconds for ms, or the cache counted without being asked, failed no test."""
    import math

    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2], step_ms=[[10, 12]],
                          bandwidth_gbs=20.0, weight_bytes=400_000_000, kv_bytes_per_token=100_000)
    assert profile.bandwidth_limit_ms(1000) == pytest.approx(20.0)
    assert profile.bandwidth_limit_ms(1000, with_cache=True) == pytest.approx(25.0)
    profile.bandwidth_gbs = 0.0
    assert math.isnan(profile.bandwidth_limit_ms(1000))


def test_logits_on_demand_charge_further_rows_at_their_own_cost_and_never_past_the_rows_scored():
    """With a measured head table, rows after the first cost head_next_ms each (a synthetic
    profile without one charges head_ms a row), and the rows read are counted between 1 and
    the rows scored. Found by a mutation audit: the profiles tested had head_ms equal to
    head_next_ms, and none read more rows than it scored."""
    measured = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4], step_ms=[[10, 11, 13]],
                           head_ms=2.0, head_next_ms=0.5, head_sizes=[1, 2, 4], head_full_ms=[2.0, 2.2, 2.6])
    assert measured.lazy_head_ms(3.0, 4) == pytest.approx(3.0)  # 2 + 2 x 0.5
    assert measured.lazy_head_ms(10.0, 4) == pytest.approx(3.5)  # 4 rows at most
    assert measured.lazy_head_ms(0.2, 4) == pytest.approx(2.0)  # the first row at least
    synthetic = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4], step_ms=[[10, 11, 13]],
                            head_ms=2.0, head_next_ms=0.5)
    assert synthetic.lazy_head_ms(3.0, 4) == pytest.approx(6.0)


def test_a_profiles_summary_carries_the_bandwidth_runtime_and_v():
    """What a benchmark records of its profile: the bandwidth (one decimal), the runtime,
    when it was measured (None when unknown) and v(T) at the context. Found by a mutation
    audit: the bandwidth could be left out of it unnoticed."""
    profile = CostProfile("m", "fp32", "cpu", 2, contexts=[100], sizes=[1, 2, 4], step_ms=[[10, 12, 16]],
                          bandwidth_gbs=31.26, runtime="native, fp32")
    assert profile.summary(context=100, sizes=(2, 4)) == {
        "measured_at": None, "runtime": "native, fp32", "bandwidth_gbs": 31.3, "context": 100,
        "v": {2: 1.2, 4: 1.6}}


@pytest.mark.parametrize("damage", [
    {"acceptance": {"ngram": [0.3, 1.5]}}, {"step_ms": [[0, 12, 16], [20, 22, 30]]}, {"contexts": [300, 100]},
    {"sizes": [1, 4, 2]}, {"bandwidth_gbs": -1.0}, {"threads": "2"}, {"graph_attention": {"1": 5}},
    {"version": profile_module.PROFILE_VERSION - 1}, "[" * 100000])
def test_a_profile_out_of_range_of_another_version_or_too_deep_is_measured_again(tmp_path, monkeypatch, damage):
    """Each check load_profile makes holds: an acceptance above 1, a step of 0 ms, contexts or
    sizes out of order, a negative bandwidth, a thread count as text, a graph attention not
    named, a profile of the version before, JSON nested too deep. Found by a mutation audit:
    dropping any one of these checks failed no test."""
    import json

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    good = synthetic_profile()
    path = profile_module.profile_path("m", "fp32")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(good.to_dict()))
    assert load_profile("m", "fp32") == good
    path.write_text(damage if isinstance(damage, str) else json.dumps({**good.to_dict(), **damage}))
    assert load_profile("m", "fp32") is None


def test_cost_caches_are_keyed_by_thread_count_and_the_format_choice_by_dtype(monkeypatch):
    """Costs measured with 2 threads do not stand in for 8, and a format chosen for bf16 not
    for fp32. Found by a mutation audit: the thread count could leave the profile's key."""
    from specdecode.cost import formats

    before = profile_module.profile_path("m", "fp32"), formats._path("m", torch.float32, ["bf16"])
    assert formats._path("m", torch.bfloat16, ["bf16"]) != before[1]
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert profile_module.profile_path("m", "fp32") != before[0]
    assert formats._path("m", torch.float32, ["bf16"]) != before[1]


def test_proc_fields_are_read_in_kibibytes(tmp_path):
    """/proc/meminfo counts in kB of 1,024 bytes; a missing field or file reads None."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4096 kB\nMemAvailable:   2048 kB\n")
    assert profile_module.proc_field_bytes(str(meminfo), "MemAvailable") == 2048 * 1024
    assert profile_module.proc_field_bytes(str(meminfo), "SwapFree") is None
    assert profile_module.proc_field_bytes(str(tmp_path / "none"), "MemAvailable") is None


class _CountingRuntime:
    """A runtime that only keeps its length: what extend_context and the timers need."""

    vocab_size = 97

    def __init__(self, max_positions: int = 1024):
        self.max_positions, self.length = max_positions, 0

    def reset(self, capacity, batch=1):
        self.length = 0

    def rollback(self, length):
        self.length = length

    def __call__(self, tokens, last_only=False, lazy_logits=False):
        self.length += tokens.shape[1]


def test_measure_target_times_each_size_after_a_single_token_step_and_not_its_warm_up(monkeypatch):
    """The step table is each size's time over the single-token time (times the latter), at
    each context the model holds; every timed step follows a single-token step, and the
    warm-up round (first calls: slow) is not counted. Found by a mutation audit: the ratio
    inverted, the warm-up counted or the single-token step dropped failed no test."""
    calls, seen = [], set()

    def timed(runtime, tokens, context):
        size = tokens.shape[1]
        calls.append(size)
        cold = (context, size) not in seen
        seen.add((context, size))
        runtime.rollback(context)
        return size * (1 + context / 100) + (100.0 if cold else 0.0)

    monkeypatch.setattr(profile_module, "timed_forward_ms", timed)
    contexts, sizes, table = profile_module.measure_target(_CountingRuntime(1024), contexts=(100, 600, 1500),
                                                           sizes=(1, 2, 4), repeats=1, progress=False)
    assert contexts == [100, 600] and sizes == [1, 2, 4]  # 1,500 does not fit in 1,024 positions
    assert table == [pytest.approx([2, 4, 8]), pytest.approx([7, 14, 28])]
    assert set(calls[0::2]) == {1} and sorted(set(calls[1::2])) == [1, 2, 4]


def test_measure_head_charges_the_head_as_differences_of_the_passes(monkeypatch):
    """head_ms: the first row over the layers alone; head_next_ms: a second row over the
    first; head_full_ms: the whole head over n rows, never less for more rows (a dip is
    noise). Found by a mutation audit: the next row measured from the layers, or the
    dip kept, failed no test."""
    full_head = {2: 4.0, 4: 5.0, 8: 4.5}  # 8 rows measured cheaper than 4

    class Logits:
        def __init__(self):
            self.reads = 0

        def row(self, index, position):
            self.reads += 1

    class Runtime(_CountingRuntime):
        lazy_logits, prefill_chunk = True, 256

        def __call__(self, tokens, last_only=False, lazy_logits=False):
            super().__call__(tokens)
            self.last = (tokens.shape[1], Logits() if lazy_logits else None)
            return self.last[1]

    runtime = Runtime(256)

    def elapsed(fn):
        fn()
        size, logits = runtime.last
        if logits is None:
            return 10.0 + full_head[size]
        return 10.0 + (3.0 + 0.5 * (logits.reads - 1) if logits.reads else 0.0)

    monkeypatch.setattr(profile_module, "_elapsed_ms", elapsed)
    head = profile_module.measure_head(runtime, sizes=(2, 4, 8), repeats=2)
    assert head["head_ms"] == pytest.approx(3.0) and head["head_next_ms"] == pytest.approx(0.5)
    assert head["head_sizes"] == [1, 2, 4, 8] and head["head_full_ms"] == pytest.approx([3.0, 4.0, 5.0, 5.0])


def test_the_batch_table_is_rows_by_widths_measured_at_the_context_recorded(tmp_path, monkeypatch):
    """measure_batches returns [rows][width]; with_batches records the context it measured
    at (a short model's, not BATCH_CONTEXT) and does not take the batch table saved with
    another measurement of the steps. Found by a mutation audit: none of it was tested."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))

    class Runtime(_CountingRuntime):
        def forward_rows(self, tokens, rows, starts):
            self.last = (tokens.shape[0], tokens.shape[1], starts)

    runtime = Runtime(128)

    def elapsed(fn):
        fn()
        rows, width, starts = runtime.last
        assert starts == [100] * rows
        return 10.0 * rows + width

    monkeypatch.setattr(profile_module, "_elapsed_ms", elapsed)
    assert profile_module.measure_batches(runtime, rows=(1, 2), widths=(1, 4), context=100, repeats=1,
                                          progress=False) == [[11.0, 14.0], [21.0, 24.0]]
    stale = synthetic_profile()
    stale.step_ms = [[9, 12, 16], [20, 22, 30]]
    stale.batch_rows, stale.batch_widths, stale.batch_ms = [1], [1], [[99.0]]
    profile_module.save_profile(stale, "m")
    contexts = []
    table = [[float(r * w) for w in profile_module.BATCH_WIDTHS] for r in profile_module.BATCH_ROWS]
    monkeypatch.setattr(profile_module, "measure_batches",
                        lambda runtime, context, progress: contexts.append(context) or table)
    profile = profile_module.with_batches(synthetic_profile(), "m", runtime, progress=False)
    assert contexts == [128 - max(profile_module.BATCH_WIDTHS) - 1] and profile.batch_ms == table
    assert profile.batch_context == contexts[0] and load_profile("m", "fp32").batch_context == contexts[0]
    # the same measurement's table, saved meanwhile, is taken as it is
    again = profile_module.with_batches(synthetic_profile(), "m", runtime, progress=False)
    assert len(contexts) == 1 and again.batch_ms == table and again.batch_context == contexts[0]


def test_the_bandwidth_is_bytes_read_per_second_and_the_median_of_its_reads(monkeypatch):
    """1 MiB read in 2 ms is 0.524 GB/s; measure_bandwidth is the median of its reads, not
    the fastest. Found by a mutation audit: ms taken as seconds, or max for the median."""
    durations = iter([2.0, 1.0, 2.0, 4.0, 8.0, 16.0])
    monkeypatch.setattr(profile_module, "_elapsed_ms", lambda fn: next(durations))
    assert profile_module.bandwidth_probe(megabytes=1)() == pytest.approx(2**20 / 2e-3 / 1e9)
    assert profile_module.measure_bandwidth(megabytes=1, repeats=5) == pytest.approx(2**20 / 4e-3 / 1e9)


def test_the_profiles_bandwidth_is_the_median_of_the_readings_between_rounds(tmp_path, monkeypatch):
    """Found by a mutation audit: the reading test's median was also its last reading."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    readings = iter([20.0, 10.0, 40.0])

    def measure_target(runtime, progress=True, between_rounds=None):
        for _ in range(3):
            between_rounds()
        return [100], [1, 2], [[1.0, 1.5]]

    monkeypatch.setattr(profile_module, "bandwidth_probe", lambda device="cpu": lambda: next(readings))
    monkeypatch.setattr(profile_module, "measure_target", measure_target)
    monkeypatch.setattr(profile_module, "step_bytes", lambda runtime: (1000, 10))
    monkeypatch.setattr(profile_module, "measure_head", lambda runtime: {})
    runtime = type("Runtime", (), {"max_positions": 256, "vocab_size": 97})()
    profile = get_profile("median-bandwidth", "fp32", runtime, progress=False)
    assert profile.bandwidth_gbs == 20.0 and (profile.weight_bytes, profile.kv_bytes_per_token) == (1000, 10)


def test_a_step_reads_the_weights_of_its_layers_and_head_and_keys_and_values_per_token(tiny_llama_dir):
    """The tiny model (2 layers, hidden 64, MLP 128, 4 query and 2 KV heads of 16, vocab 97,
    fp32): per layer qkv 128x64, o 64x64, gate_up 256x64, down 64x128; head 97x64; keys and
    values 2 x 2 heads x 16 per layer. A layer-skip view reads its own layers only. Found
    by a mutation audit: the head, the values or the view's layers could go uncounted."""
    from specdecode.models.llama import load_native

    runtime = load_native(tiny_llama_dir, torch.float32)
    layer = 128 * 64 + 64 * 64 + 256 * 64 + 64 * 128
    assert profile_module.step_bytes(runtime) == (4 * (2 * layer + 97 * 64), 2 * 2 * 2 * 16 * 4)
    assert profile_module.step_bytes(runtime.layer_skip_view(1)) == (4 * (layer + 97 * 64), 2 * 1 * 2 * 16 * 4)


def test_a_drafters_cost_is_per_token_it_drafted(monkeypatch):
    """A lookup drafter offering 3 of the 4 tokens asked for costs a third of its call a
    token. Found by a mutation audit: dividing by the 4 asked for failed no test."""
    from specdecode.proposers.base import Proposal

    class Lookup:
        def start(self, tokens, capacity):
            pass

        def propose(self, tokens, k, params, generator):
            return Proposal(torch.tensor([1, 2, 3]))

    monkeypatch.setattr(profile_module, "_median_ms", lambda fn, repeats: 12.0)
    assert profile_module.measure_drafter(Lookup(), 50, 97, k=4) == pytest.approx(4.0)


def test_costs_saved_meanwhile_are_merged_only_for_the_same_measurement_and_never_over_our_own():
    """Found by a mutation audit: the saved figures winning over the profile's own, or
    merged from another measurement of the steps, failed no test."""
    ours, saved = synthetic_profile(c=0.05), synthetic_profile(c=0.5)
    saved.drafters["draft:x"], saved.acceptance = 0.2, {"ngram": [0.1, 0.1], "draft:x": [0.4, 0.6]}
    ours.acceptance = {"ngram": [0.3, 0.6]}
    merged = profile_module._merged(ours, saved)
    assert merged.drafters == {"ngram": 0.05, "draft:x": 0.2}
    assert merged.acceptance == {"ngram": [0.3, 0.6], "draft:x": [0.4, 0.6]}
    other = synthetic_profile(c=0.5)
    other.step_ms, other.drafters["draft:x"] = [[9, 12, 16], [20, 22, 30]], 0.2
    assert profile_module._merged(synthetic_profile(), other).drafters == {"ngram": 0.05}


def test_recorded_acceptance_is_saved_with_the_profile(tmp_path, monkeypatch):
    """Both rates (first, later) are saved; without a profile nothing is written."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    profile_module.record_acceptance("none-yet", "fp32", "ngram", [0.3, 0.7])
    assert load_profile("none-yet", "fp32") is None
    profile_module.save_profile(synthetic_profile(), "m")
    profile_module.record_acceptance("m", "fp32", "ngram", [0.3, 0.7])
    assert load_profile("m", "fp32").acceptance == {"ngram": [0.3, 0.7]}


def test_weight_formats_are_timed_by_the_median_of_turns_after_a_warm_up(monkeypatch):
    """The warm-up round is not counted, and one slow step among three does not decide.
    Found by a mutation audit: counting the warm-up or taking the slowest failed no test."""
    from specdecode.cost import formats

    times = {"a": iter([100.0, 2.0, 2.0, 9.0]), "b": iter([100.0, 3.0, 3.0, 3.0])}
    runtimes = {"a": _CountingRuntime(256), "b": _CountingRuntime(256)}
    names = {id(runtime): name for name, runtime in runtimes.items()}
    monkeypatch.setattr(formats, "timed_forward_ms", lambda runtime, tokens, context: next(times[names[id(runtime)]]))
    assert formats.step_ms(runtimes, context=8, rounds=3, steps=1) == {"a": 2.0, "b": 3.0}


def test_formats_fit_beside_the_loaded_one_by_bytes_per_weight_with_half_the_memory_to_spare(monkeypatch):
    """A q8_0 model of 1e9 weights (1.0625 GB) needs 2 GB more in bf16 and 0.625 GB in q4_1:
    2.625 GB, which fits in half of 5.25 GB and not of 5.2. Found by a mutation audit: no
    test sat at the boundary, so the half, the scaling and the loaded ones' exclusion could go."""
    from specdecode.cost import formats

    monkeypatch.setattr(formats, "_weight_bytes", lambda runtime: 1.0625e9)
    for available, fits in ((5.25e9, True), (5.2e9, False)):
        monkeypatch.setattr(formats, "_available_bytes", lambda: available)
        assert formats._fits_beside({"q8_0": object()}, ["q8_0", "bf16", "q4_1"]) is fits


def test_the_weight_format_choice_is_read_back_and_a_zero_timing_is_measured_again(tmp_path, monkeypatch):
    """The second call reads the saved choice (the fastest) without measuring; a record
    timing a format at 0 ms is measured again. Found by a mutation audit."""
    import json

    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {"q8_0": 2.0, "bf16": 3.0})
    assert formats.fastest_weights("m", torch.float32, ["q8_0", "bf16"], lambda fmt: None) == "q8_0"
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: pytest.fail("measured again"))
    assert formats.fastest_weights("m", torch.float32, ["q8_0", "bf16"], lambda fmt: None) == "q8_0"
    formats._path("m", torch.float32, ["q8_0", "bf16"]).write_text(json.dumps({"step_ms": {"q8_0": 0.0, "bf16": 3.0}}))
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {"q8_0": 3.0, "bf16": 2.0})
    assert formats.fastest_weights("m", torch.float32, ["q8_0", "bf16"], lambda fmt: None) == "bf16"


def test_weights_auto_refused_by_every_format_for_one_reason_raises_that_reason(tmp_path, monkeypatch):
    """Two formats refused with the same message: the model's problem, raised as it is.
    Found by a mutation audit: only one format refused for one reason was tested."""
    from specdecode.config import ConfigError
    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))

    def refuse(fmt):
        raise ConfigError("the model says no")

    with pytest.raises(ConfigError, match="^the model says no$"):
        formats.fastest_weights("m", torch.float32, ["q4_1", "q8_0"], refuse)


def test_the_weight_format_record_names_the_context_the_steps_were_timed_at(tmp_path, monkeypatch):
    """A model of 100 positions is timed at 98 tokens, not at the usual 256, and its record
    says so (it said 256 whatever the model held)."""
    import json

    from specdecode.cost import formats

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(formats, "step_ms", lambda runtimes: {fmt: {"q8_0": 3.0, "bf16": 2.0}[fmt] for fmt in runtimes})
    for name, positions, context in (("short", 100, 98), ("long", 4096, formats.CONTEXT)):
        runtime = _CountingRuntime(positions)
        assert formats.timing_context({"q8_0": runtime}) == context
        assert formats.fastest_weights(name, torch.float32, ["q8_0", "bf16"], lambda fmt: runtime) == "bf16"
        record = json.loads(formats._path(name, torch.float32, ["q8_0", "bf16"]).read_text())
        assert record["context"] == context and record["chosen"] == "bf16"


def test_thread_choice_refuses_bad_look_intervals_and_decays_and_ignores_unmeasurable_passes():
    """A look interval below 1 (a look every pass) or above its cap, and a decay of 0 (no
    memory), are refused; a pass timed at 0 ms or NaN is not counted (a mutation audit:
    each was taken)."""
    from specdecode.control.threads import ThreadChoice

    for kwargs in ({"explore_every": 0}, {"explore_every": 8, "max_explore_every": 4}):
        with pytest.raises(ConfigError, match="explore_every"):
            ThreadChoice((1, 2), **kwargs)
    with pytest.raises(ConfigError, match="decay"):
        ThreadChoice((1, 2), decay=0.0)
    choice = ThreadChoice((1, 2))
    for ms in (0.0, float("nan"), -1.0):
        choice.observe(1, 1, 1, 100, ms)
    assert choice.counts == {} and choice.warm == {} and choice.ratios == {}


def test_thread_choice_kinds_a_pass_of_two_rows_as_a_batch():
    """Two rows are a batch, whatever their width; one row is alone at one token and
    scores drafts at more (a mutation audit: "batch" from three rows passed)."""
    from specdecode.control.threads import ThreadChoice

    assert [ThreadChoice.kind(rows, width) for rows, width in [(1, 1), (1, 4), (2, 1), (2, 4), (8, 1)]] == [
        "alone", "drafts", "batch", "batch", "batch"]


def test_thread_choice_warms_counts_in_turn_and_looks_at_each_other_count_on_schedule():
    """Three counts: their first passes are taken in turn; then the first look comes on the
    ``explore_every``-th pass, each look goes to the next other count in turn, and while the
    looks measure worse the interval doubles up to ``max_explore_every`` (a mutation audit:
    a look a pass late, every look at the same count, no cap and the warm-up one count
    after another all passed)."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2, 4), predict=lambda rows, width, context: 1.0, explore_every=4, max_explore_every=16)
    speed = {1: 1.0, 2: 2.0, 4: 3.0}
    chosen = []
    for _ in range(9 + 80):
        threads = choice.choose(1, 1, 100)
        choice.observe(threads, 1, 1, 100, speed[threads])
        chosen.append(threads)
    assert chosen[:9] == [1, 2, 4] * 3
    looks = [(i, t) for i, t in enumerate(chosen[9:]) if t != 1]
    assert looks == [(3, 2), (11, 4), (27, 2), (43, 4), (59, 2), (75, 4)]


def test_thread_choice_follows_a_machine_whose_speed_changes_back_again():
    """Two threads win, then lose, then win again: after moving to one thread the looks go
    on, and find two threads faster again (a mutation audit: a look left pending after its
    pass made every later pass on the new count reset the countdown, and no look came)."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2), explore_every=8, max_explore_every=64)
    speed = lambda kind, threads, i: (1.4 if 600 <= i < 1200 else 0.7) if threads == 2 else 1.0
    chosen = [t for _, t in drive_threads(choice, speed, 2000, rows_of=lambda i: 4)]
    assert chosen[1000:1200].count(1) > 180
    assert chosen[1600:].count(2) > 360


def test_thread_choice_prices_each_pass_by_its_shape():
    """Without a cost profile a pass is priced by its tokens (rows x width): a count that
    ran large batches, or wide draft passes, is compared per token with one that ran small
    ones, and the faster per token wins (a mutation audit: a flat price, and predictions
    cached without the width, both passed and chose the slower count)."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2))
    for _ in range(3):  # priced 2.75 and 1.25: one thread is 20% faster per token
        choice.observe(1, 8, 1, 100, 0.8 * 2.75)
        choice.observe(2, 2, 1, 130, 1.25)
        choice.observe(1, 1, 8, 100, 0.8 * 2.75)
        choice.observe(2, 1, 2, 100, 1.25)
    assert choice.best("batch") == 1 and choice.best("drafts") == 1
    assert choice.ratios["batch", 1] == pytest.approx(0.8) and choice.ratios["drafts", 2] == pytest.approx(1.0)


def test_thread_choice_is_not_moved_by_one_implausibly_short_pass():
    """A pass measured at almost nothing (a timer glitch) counts as a quarter of its count's
    mean at least: it cannot make a count 20% slower the preferred one (a mutation audit:
    unclipped below, it did)."""
    from specdecode.control.threads import ThreadChoice

    choice = ThreadChoice((1, 2), predict=lambda rows, width, context: 1.0)
    for _ in range(3):
        choice.observe(1, 1, 1, 100, 1.0)
        choice.observe(2, 1, 1, 100, 1.2)
    choice.observe(2, 1, 1, 100, 1e-6)
    assert choice.best("alone") == 1 and choice.ratios["alone", 2] == pytest.approx(0.8 * 1.2 + 0.2 * 0.3)


def test_calibration_runs_fit_a_small_context(tmp_path):
    """On a model of 32 positions the calibration's budget shrinks to half of what is left
    after k (13 new tokens, 13 prompt tokens), so every built-in prompt still calibrates
    rather than none (a 32-token budget leaves no room for a prompt)."""
    import json

    from conftest import save_char_tokenizer
    from specdecode.factory import CALIBRATION_PROMPTS, calibration_runs

    path = save_tiny_model(tmp_path / "short", seed=3, num_layers=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    save_char_tokenizer(path)
    target = load_model(str(path), torch.float32, backend="torch")
    runs = calibration_runs(target, NgramProposer(), k=4)
    assert len(runs) == len(CALIBRATION_PROMPTS)
    assert all(1 <= stats.new_tokens <= 13 for stats in runs)
