"""How many draft tokens to offer at each step: fixed, cost-aware adaptive, or threshold.

A policy lives for one request: ``start`` at its beginning, ``choose(context)`` before each
step (0 = plain decoding for that step), ``observe(drafted, accepted)`` after each step
that drafted.

``CostAwareK`` (``--k auto``, the default) estimates acceptance online and picks the k
that maximises expected speedup tau(k) / (v(k) + k c) with the measured cost profile,
k = 0 included. Acceptance is modelled per draft position: ``first``, that position 1 is
accepted, and for each position i >= 2 the rate that it is accepted given position i - 1
was. Drafters accept in runs (an n-gram match that got its first token right is copying,
and its next tokens are right far more often), so one independent alpha per position
would undervalue long drafts; with every rate equal it is Leviathan et al.'s eq. 1. A
step that drafted d tokens and accepted n is one trial of ``first`` (success if n > 0)
and, if n > 0, a success at positions 2..n and a failure at n + 1 (none if n == d).
Counts decay geometrically (each position's when it is tried), so the estimate follows
the request: copying a span of the prompt and writing new text have very different
acceptance. Priors seed the counts: for ``first``, the router's per-task rate if given,
else the drafter's rate calibrated once on this target; for every later position, the
calibrated rate after an accepted draft. A position the request has not reached keeps
its prior: success at position 2 says little about position 8, and where verification
cost jumps with k (fp32 here) crediting it would buy long drafts on evidence from short
ones.
When plain decoding wins, a probe step (one draft token) is spent after
``probe_interval`` plain steps — by default spaced so probes cost about 1% of the time,
v(1) - 1 + c steps each — the interval doubling after each failed probe and dropping to
zero after a fully accepted one, so a request can come back to speculation cheaply.
Positions never drafted keep their prior, so after a step whose d drafts were all
accepted the next offers d + 1 when that would pay even if position d + 1 were always
right (optimism about the one position just beyond the evidence): where an extra draft
costs little (bf16 here) runs of acceptance earn long drafts step by step; where it costs
much (4 tokens after 3 in fp32) the look is not taken on hope alone.

Both adaptive policies also learn c from the steps themselves (``DraftCost``): the cost
profile times a drafter alone, with its weights in cache, while inside a generation the
target's 100 MB of weights have evicted them (an EAGLE head pass: 0.2 ms alone, 0.6 ms in
a generation, on a Zen 4), so a profile's c would buy drafts that lose.

And they read v from the steps too (``StepTimes``, on the shared ``CostModel``): a shared
machine's costs move while a process runs. On one Zen 4, scoring 5 tokens cost 1.33
single-token steps for stretches of seconds to a minute, then 1.76 for the next, back and
forth, the single step itself unchanged (docs/adaptive.md); a profile measured in either
state misprices the other.

``ThresholdK`` (``--k-policy threshold``) is the simple rule from the literature, kept for
comparison: start at 5, +1 when the mean acceptance of the last 10 steps exceeds 0.8, -1
when it is below 0.5, bounded to 2..10, and no speculation once the mean is below 0.3
after 10 observations.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..cost.theory import best_k, tau_conditional, taus_conditional
from ..config import ConfigError

DEFAULT_PRIOR_ALPHA = 0.5


class KPolicy(Protocol):
    name: str
    k_max: int  # the most draft tokens a step may get (sizes the KV cache)

    def start(self, prior_alpha: float | None = None) -> None: ...
    def choose(self, context: int) -> int: ...
    def observe(self, drafted: int, accepted: int) -> None: ...
    def describe(self) -> str: ...


class DraftCost:
    """c, a drafting pass's cost in plain decode steps, learnt from the steps: each drafted
    step's drafting time per pass over the plain-step time its own verification implies
    (its verify time / v(n), n the tokens it scored beyond the first), so the estimate
    follows a machine whose speed drifts as well as drafts that run slower inside a
    generation than alone. Seeded with the cost profile's c; kept across requests. A pass
    measured above 2.5 times the estimate (or 0.02 steps above it, from near 0) counts as
    that much unless the pass before it was high too: one drafting pass stalled by the OS
    must not stop speculation for hundreds of steps (found in review: a 200 ms stall took c
    from 0.05 to 1.39), while a cost that really grew shows on the next pass as well."""

    def __init__(self, prior: float, strength: float = 2.0, decay: float = 0.9):
        self.decay = decay
        self.counts = [prior * strength, strength]
        self.high = False  # the last pass measured above the bound

    @property
    def value(self) -> float:
        return self.counts[0] / self.counts[1]

    def update(self, draft_seconds: float, passes: int, verify_seconds: float, v: float) -> float:
        if passes > 0 and verify_seconds > 0 and v > 0:
            measured = draft_seconds / passes / (verify_seconds / v)
            bound = max(2.5 * self.value, self.value + 0.02)
            if measured <= bound:
                self.high = False
            elif not self.high:  # high once: held to the bound until the next pass says it again
                self.high = True
                measured = bound
            self.counts = [self.counts[0] * self.decay + measured, self.counts[1] * self.decay + 1]
        return self.value


class StepTimes:
    """How a step's cost compares with the cost profile's now, learnt from the steps: each
    step's measured time over the profile's time for its size and context is a ratio q,
    kept as decayed means per size (T tokens scored) and pooled over every size above 1. A
    size's factor is its own mean shrunk toward the pool (``strength`` steps' worth, so a
    size not tried lately is priced like the sizes that were), over the single-token
    steps' mean: v now = v of the profile x q(T) / q(1). Every mean starts at 1 (the
    profile as measured). Ratios are clipped to [0.5, 2.5]: one step stalled by the OS
    must not swing the estimate."""

    def __init__(self, decay: float = 0.95, single_decay: float = 0.98, strength: float = 2.0):
        self.decay, self.single_decay, self.strength = decay, single_decay, strength
        self.single = [strength, strength]  # [decayed sum of q, decayed count] of T = 1
        self.pool = [strength, strength]  # the same over every T > 1
        self.sizes: dict[int, list[float]] = {}  # T > 1 -> [sum, count]

    def update(self, tokens: int, measured_ms: float, predicted_ms: float) -> None:
        if tokens < 1 or measured_ms <= 0 or predicted_ms <= 0:
            return
        q = min(max(measured_ms / predicted_ms, 0.5), 2.5)
        if tokens == 1:
            self.single = [self.single[0] * self.single_decay + q, self.single[1] * self.single_decay + 1]
            return
        decay = self.decay
        for counts in self.sizes.values():
            counts[0] *= decay
            counts[1] *= decay
        counts = self.sizes.setdefault(tokens, [0.0, 0.0])
        counts[0] += q
        counts[1] += 1
        self.pool = [self.pool[0] * decay + q, self.pool[1] * decay + 1]

    @property
    def single_factor(self) -> float:
        """A single-token step's time now over the profile's (1 until such steps are seen)."""
        return self.single[0] / self.single[1]

    def factor(self, tokens: int) -> float:
        """v(T) now over the profile's v(T)."""
        return self.factors(tokens)[-1]

    def factors(self, sizes: int) -> list[float]:
        """factor(T) for T = 1..sizes."""
        prior = self.strength * self.pool[0] / self.pool[1]
        single = self.single[0] / self.single[1]
        out = [1.0]
        for tokens in range(2, sizes + 1):
            total, count = self.sizes.get(tokens, (0.0, 0.0))
            out.append((total + prior) / (count + self.strength) / single)
        return out


class MeasuresDraftCost:
    """For the adaptive policies: ``_c`` (per draft token of a chain, per head pass of a
    tree) follows ``draft_cost``, fed by every drafted step; every step, drafted or
    plain, also teaches the cost model's ``StepTimes`` what scoring costs now."""

    def observe_cost(self, draft_seconds: float, passes: int, verify_seconds: float, scored: int,
                     read: int | None = None, lazy: bool = False) -> None:
        """A step's measured times, ``scored`` tokens beyond the first, ``read`` rows of
        logits read by verification where they were computed on demand (``lazy``); before
        ``observe``."""
        self.costs.observe_step(scored + 1, verify_seconds * 1e3, self.context, read if lazy else None)
        if passes > 0:
            v = self._v_table(self.context)[min(scored, self.k_max)]
            if lazy and read is not None:  # the step paid the head for its rows read only, as observe_step prices it
                v = max(v - self.costs.lazy_saving_steps(scored + 1, read, self.context), 1.0)
            self._c = self.draft_cost.update(draft_seconds, passes, verify_seconds, v)


class FixedK:
    """k drafts every step. With a cost model (the cached profile), a greedy step computes
    its logits on demand only where the profile says that costs less than one pass of the
    head over all k + 1 rows, half the drafts expected read; without one, always (the head
    on demand was measured cheaper where it is bound by arithmetic, AVX2 Zen 1; on a Zen 4,
    where it is bound by reading its weights, each row read costs about a whole pass)."""

    name = "fixed"

    def __init__(self, k: int, costs: "CostModel | None" = None):
        if k < 1:
            raise ConfigError(f"k (draft tokens per step) must be >= 1, got {k}")
        self.k = self.k_max = k
        self.costs = costs
        self.context = 0

    def start(self, prior_alpha: float | None = None) -> None:
        pass

    def choose(self, context: int) -> int:
        self.context = context
        return self.k

    def lazy(self, drafted: int) -> bool:
        if self.costs is None:
            return True
        return self.costs.step_cost(drafted, 1.0 + drafted / 2, self.context)[1]

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def describe(self) -> str:
        return str(self.k)


@dataclass
class CostModel:
    """The functions of cost the policies need, from a CostProfile."""

    profile: object  # CostProfile
    drafter: str
    _tables: dict = field(default_factory=dict, repr=False, compare=False)  # v_table's, by (bucket, k_max)
    # True while the engine verifies greedily on a runtime that can compute logits row by
    # row (it sets this per request): a step may then pay the output head only for the rows
    # read, where that costs less than one pass over all (step_cost says which)
    lazy_head: bool = False
    steps: StepTimes = field(default_factory=StepTimes, repr=False, compare=False)

    def v(self, k: int, context: int) -> float:
        return self.profile.v(k, context)

    def observe_step(self, tokens: int, measured_ms: float, context: int, read: int | None = None) -> None:
        """A step that scored ``tokens`` tokens after ``context`` took ``measured_ms``
        (its logits computed on demand for ``read`` rows, or one head pass if None)."""
        bucket = context // 64 * 64 + 32  # as v_table's: a lookup, not an interpolation, per step
        predicted = self._tables.get(("ms", bucket, tokens))
        if predicted is None:
            predicted = self._tables[("ms", bucket, tokens)] = self.profile.time_ms(tokens, bucket)
        if read is not None:
            predicted -= self.profile.lazy_head_saving_ms(tokens, read)
        self.steps.update(tokens, measured_ms, predicted)

    def lazy_saving_steps(self, tokens: int, read: int, context: int) -> float:
        """Decode steps a step scoring ``tokens`` saved by computing the logits of ``read``
        rows on demand rather than one head pass over all (what ``observe_step`` takes off
        the profile's time for it). Found in review: the draft cost divided a lazy step's
        time by the full v, which read the plain step as shorter and c as up to 1.5x larger."""
        single = self._single_ms(context)
        return self.profile.lazy_head_saving_ms(tokens, read) / single if single > 0 else 0.0

    def _single_ms(self, context: int) -> float:
        """The profile's single-token step at ``context`` rounded to 64 tokens, looked up
        once (a step's decision must cost microseconds)."""
        bucket = context // 64 * 64 + 32
        single = self._tables.get(("single", bucket))
        if single is None:
            single = self._tables[("single", bucket)] = self.profile.time_ms(1, bucket)
        return single

    def head_saving(self, k: int, read: float, context: int) -> float:
        """Decode steps a step scoring k + 1 tokens saves when its logits are computed on
        demand and verification reads ``read`` rows (expected), against one pass of the
        head over all k + 1: from the profile's measured head costs; negative where on
        demand costs more (a head bound by reading its weights). 0 unless lazy_head."""
        if not self.lazy_head or k < 1:
            return 0.0
        bucket = context // 64 * 64 + 32
        single = self._single_ms(context)
        full = self._tables.get(("head pass", k))
        if full is None:
            full = self._tables[("head pass", k)] = self.profile.head_pass_ms(k + 1)
        step = self._tables.get(("ms", bucket, k + 1))
        if step is None:
            step = self._tables[("ms", bucket, k + 1)] = self.profile.time_ms(k + 1, bucket)
        if full >= step:  # a head pass dearer than the whole step it is part of: timed at a stall
            return 0.0
        return (full - self.profile.lazy_head_ms(read, k + 1)) / single

    def step_cost(self, k: int, read: float, context: int, table: list[float] | None = None) -> tuple[float, bool]:
        """(cost in decode steps, whether to compute logits on demand) of a step scoring
        k + 1 tokens of which verification is expected to read ``read``: v(k), less what
        logits on demand save where they save anything."""
        v = (table or self.v_table(context, k))[k]
        saving = self.head_saving(k, read, context)
        # never below one step: scoring k + 1 rows and reading at least one row's logits
        # costs what a plain step does at least (a last guard: a profile measured while the
        # machine was busy gave a negative cost, and the policy stopped the request with an
        # error; head_saving now also refuses a head pass timed above its whole step)
        return (max(v - saving, 1.0), True) if saving > 0 else (v, False)

    @property
    def c(self) -> float:
        return self.profile.c(self.drafter)

    def v_table(self, context: int, k_max: int) -> list[float]:
        """v(0..k_max) at this context, rounded to 64 tokens (a step's decision must cost
        microseconds, not a profile interpolation per k), as the steps measure it now."""
        bucket = context // 64 * 64 + 32
        table = self._tables.get((bucket, k_max))
        if table is None:
            table = self._tables[(bucket, k_max)] = [self.v(k, bucket) for k in range(k_max + 1)]
        # never below one step: the factors are relative to the last plain steps' times, and a
        # request that drafts every step learns nothing new about those, so a machine that got
        # faster since would price scoring several tokens below one token, and drafting that
        # is never accepted would look free (found in review)
        return [max(v * factor, 1.0) if k else v * factor
                for k, (v, factor) in enumerate(zip(table, self.steps.factors(k_max + 1)))]


class RetryPrior(float):
    """The prior of a request the router retries on a task it had turned off (the value
    is the acceptance to start from). A policy drafts from it with the request's own counts
    and an optimistic tree rate, not with what it learnt per kind of draft before (found
    in review: a long-lived process's label counts kept pricing the retry's drafts out, and
    the tree budget ignored the prior, so the retry measured about plain decoding and the
    task stayed off). A float, so it passes through every caller unchanged."""


class ProbeClock:
    """When an adaptive policy that decodes plainly looks at speculation again: the plain
    steps since its last probe and the interval now. Kept across requests, and shared by a
    server's sequences (``serve.batch.clone_policy``): restarted at every request, requests
    shorter than the interval never probed, so a task or a kind of draft once priced out
    stayed out for good (found in review)."""

    def __init__(self, interval: int):
        self.plain_steps, self.interval = 0, interval


FIRST_LOOK_WAIT, MAX_LOOK_WAIT = 4, 256  # CostAwareK._may_look


class CostAwareK(MeasuresDraftCost):
    name = "auto"

    def __init__(self, costs: CostModel, k_max: int = 10, decay: float = 0.85, first_decay: float = 0.95,
                 prior_strength: float = 4.0, probe_interval: int | None = None, max_probe_interval: int = 128,
                 margin: float = 0.02, default_prior: float | None = None, default_later: float | None = None,
                 probe_budget: float = 0.01):
        if k_max < 1:
            raise ConfigError(f"k_max must be >= 1, got {k_max}")
        for name, value in (("decay", decay), ("first_decay", first_decay)):
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")
        self.costs, self.k_max, self.decay, self.first_decay = costs, k_max, decay, first_decay
        self.prior_strength, self.margin = prior_strength, margin
        self._c = costs.c
        self.draft_cost = DraftCost(self._c)
        self.default_prior = DEFAULT_PRIOR_ALPHA if default_prior is None else default_prior
        self.default_later = default_later  # None: the same as the first-position prior
        if probe_interval is None:
            # a probe costs v(1) - 1 + c target steps; space probes so that they spend
            # about ``probe_budget`` of the time while speculation is off
            probe_cost = max(self._v_table(256)[1] - 1.0, 0.0) + self._c
            probe_interval = min(max(8, math.ceil(probe_cost / probe_budget)), max_probe_interval)
        self.base_probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.clock = ProbeClock(probe_interval)
        self.label_counts: dict = {}  # use_label's: label -> (first, positions) counts
        self.label_waits: dict = {}  # label -> {position: [looks refused, refusals before the next look]}
        self.start()

    def start(self, prior_alpha: float | None = None) -> None:
        alpha = self.default_prior if prior_alpha is None else prior_alpha
        later = alpha if self.default_later is None else self.default_later
        self.priors = tuple(min(max(rate, 0.0), 0.99) for rate in (alpha, later))
        self._c = self.draft_cost.value  # what drafting cost so far (a server's requests share it)
        # [successes, trials] of position 1, and of each position 2..k_max given the one before
        self.request_counts = self._fresh_counts()
        self.first_counts, self.position_counts = self.request_counts
        self.request_waits: dict = {}  # as label_waits, for the request's own counts
        self.waits = self.request_waits
        self.retrying = isinstance(prior_alpha, RetryPrior)  # its own counts for every kind of draft
        self.probing = False
        self.explore_from = 0  # drafts of the last step, when all were accepted
        self.context = 0
        self.chosen: list[int] = []  # k per step, for reports

    def _fresh_counts(self) -> tuple[list[float], list[list[float]]]:
        alpha, later = self.priors
        return ([alpha * self.prior_strength, self.prior_strength],
                [[later * self.prior_strength, self.prior_strength] for _ in range(self.k_max - 1)])

    def use_label(self, label) -> None:
        """Price the next step's draft by the acceptance of drafts of its kind (the
        proposer's ``draft_label``: a prompt match of m tokens, the store's match of n):
        each label keeps counts of its own, across requests, started from this request's
        priors; None: the request's own counts. Prompt lookup's drafts after a match of 4+
        tokens were accepted 4.5 tokens deep on average on the suite, the store's after a
        2-token match 0.5: one rate for both buys drafts too short for the one and too
        long for the other."""
        if label is None or self.retrying:
            self.first_counts, self.position_counts = self.request_counts
            self.waits = self.request_waits
            return
        counts = self.label_counts.get(label)
        if counts is None:
            counts = self.label_counts[label] = self._fresh_counts()
        self.first_counts, self.position_counts = counts
        self.waits = self.label_waits.setdefault(label, {})

    @property
    def first(self) -> float:
        return self.first_counts[0] / self.first_counts[1]

    @property
    def conditional(self) -> list[float]:
        """Acceptance at positions 2..k_max, each given the one before (prior included)."""
        return [successes / trials for successes, trials in self.position_counts]

    @property
    def later(self) -> float:
        """Acceptance after an accepted draft, positions 2.. pooled (for reports)."""
        return sum(c[0] for c in self.position_counts) / sum(c[1] for c in self.position_counts) if self.position_counts else 0.0

    @property
    def alpha(self) -> float:
        """Acceptance per draft trial, every position pooled (for reports)."""
        counts = [self.first_counts, *self.position_counts]
        return sum(c[0] for c in counts) / sum(c[1] for c in counts)

    def tau(self, k: int) -> float:
        return tau_conditional(self.first, self.conditional, k)

    def _v_table(self, context: int) -> list[float]:
        return self.costs.v_table(context, self.k_max)

    def _best(self, context: int, explore: bool = False) -> int:
        table = self._v_table(context)
        taus = taus_conditional(self.first, self.conditional)
        if self.costs.lazy_head:  # the rows past the first rejection may skip the output head
            table = [self.costs.step_cost(k, taus[k], context, table)[0] for k in range(len(table))]
        k, speedup = best_k(self.alpha, table.__getitem__, self._c, self.k_max, tau=taus.__getitem__)
        depth = self.explore_from if explore else 0
        # not where position depth + 1's own evidence is clearly against it (its rate fell
        # below half its prior, three straight rejections from the prior): found in review, a
        # position learnt to fail every time was still offered after each fully accepted
        # draft (k 3, 4, 3, 4, ... for ever where 3 is best). A position merely unlucky
        # so far is still looked at, or its estimate, untried, would never recover.
        if 0 < depth < self.k_max and k <= depth and self._may_look(depth + 1):
            # the last step's drafts were all accepted: would one more pay if that position
            # were always right? Then look at it, since a position never drafted keeps its
            # prior. Always right after position depth, it adds what position depth added.
            hopeful = (2 * taus[depth] - taus[depth - 1]) / (table[depth + 1] + (depth + 1) * self._c)
            if hopeful > max(speedup, 1.0 + self.margin):
                return depth + 1
        return k if speedup > 1.0 + self.margin else 0

    def _worth_a_look(self, position: int) -> bool:
        successes, trials = self.position_counts[position - 2]
        return successes >= 0.5 * self.priors[1] * trials

    def _may_look(self, position: int) -> bool:
        """Whether to look at ``position`` after a fully accepted draft: where its evidence is
        not clearly against it, or, where it is, once in a while, the wait doubling after
        every look (4, 8, 16, ... refusals, at most ``MAX_LOOK_WAIT``). A position counts
        only when drafted, so refused for good its estimate froze, and k stayed capped below
        it for the life of the label even when every later draft was right (found in review:
        k 3 through 600 fully accepted steps)."""
        if self._worth_a_look(position):
            self.waits.pop(position, None)
            return True
        wait = self.waits.setdefault(position, [0, FIRST_LOOK_WAIT])
        wait[0] += 1
        if wait[0] < wait[1]:
            return False
        wait[0], wait[1] = 0, min(2 * wait[1], MAX_LOOK_WAIT)
        return True

    def choose(self, context: int) -> int:
        self.context = context
        k = self._best(context, explore=True)
        self.probing = False
        if k == 0:
            self.clock.plain_steps += 1
            if self.clock.plain_steps > self.clock.interval:  # time to look again
                self.clock.plain_steps = 0
                self.probing = True
                k = 1  # the cheapest look; a fully accepted probe is followed at once by another
        self.explore_from = 0
        self.chosen.append(k)
        return k

    def lazy(self, drafted: int) -> bool:
        """Whether this step, with ``drafted`` drafts, should compute logits on demand."""
        taus = taus_conditional(self.first, self.conditional)
        return self.costs.step_cost(drafted, taus[min(drafted, len(taus) - 1)], self.context)[1]

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            if self.probing:  # the probe drafted nothing (no draft, or a batch's cap): it stays due
                self.clock.plain_steps = self.clock.interval + 1
            return
        decay = self.decay
        first = self.first_counts
        first[0] = first[0] * self.first_decay + (accepted > 0)
        first[1] = first[1] * self.first_decay + 1
        # position i >= 2 is tried only if position i - 1 was accepted
        for position in range(2, min(accepted + 1, drafted, self.k_max) + 1):
            counts = self.position_counts[position - 2]
            counts[0] = counts[0] * decay + (position <= accepted)
            counts[1] = counts[1] * decay + 1
        self.explore_from = drafted if accepted == drafted else 0
        if self.probing:
            if accepted == drafted:  # the drafts were right: look again at once
                self.clock.interval = 0
            elif self._best(self.context) == 0:  # still losing: look less often
                self.clock.interval = min(max(self.clock.interval * 2, self.base_probe_interval),
                                          self.max_probe_interval)
            else:
                self.clock.interval = self.base_probe_interval

    def describe(self) -> str:
        return f"auto(<= {self.k_max})"


class TreeBudget(MeasuresDraftCost):
    """``--k auto`` for tree drafters: a node budget per step, 0 = a plain step.

    A tree drafter ranks its nodes by confidence p_i, its estimate that node i will be
    accepted (the product of the draft probabilities along the node's path; a node is never
    more confident than its parent). Were those calibrated, a tree of the n most confident
    nodes would accept P(n) = p_1 + .. + p_n nodes on average. A small head is not calibrated
    (and less so off its training domain), so the policy learns a factor s = accepted /
    predicted over recent steps (decayed counts) and, once the drafter has built its tree,
    keeps the n nodes (``trim``) that maximise the expected rate

        r(n) = (1 + s P(n)) / (v(n) + d)

    v(n): the profile's cost of scoring n + 1 tokens at this context, less the output head
    of the n - s P(n) nodes greedy verification is expected never to read where logits are
    computed on demand, where that is cheaper (``CostModel.step_cost``); d = c x the head
    passes the tree took (already spent, but spent whether n is 0 or not). n = 0 is a plain
    step. Whether to draft at all is decided before drafting, from the decayed mean of the
    best rate recent trees offered (seeded by the chain rate the calibrated acceptance
    predicts): below 1 + margin the policy decodes plainly and probes with a full tree now
    and then, spaced like ``CostAwareK``'s probes (counted across requests, so a run of
    short requests still probes). The budget handed to the drafter (which
    bounds its tree's depth, hence its passes) is the last step's best n plus headroom, so a
    run of confident drafts grows the tree step by step. Each request starts from the prior
    rate moved halfway to the rate the last request ended at, so a workload where trees
    lose starts its next requests plain instead of spending their first steps learning it
    again (18 suite prompts on Zen 4: EAGLE trees 0.85x -> 0.96x plain, the merged tree
    0.87x -> 0.97x). A drafter that gives no confidence
    is not trimmed, and its steps count by their realized rate (accepted + 1) / (v(n) + d).
    """

    name = "auto"

    def __init__(self, costs: CostModel, k_max: int = 16, decay: float = 0.8, margin: float = 0.02,
                 prior_rate: float | None = None, prior_strength: float = 3.0, probe_budget: float = 0.01,
                 max_probe_interval: int = 128):
        if k_max < 1:
            raise ConfigError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"decay must be in (0, 1], got {decay}")
        self.costs, self.k_max, self.decay, self.margin = costs, k_max, decay, margin
        self._c = costs.c
        self.draft_cost = DraftCost(self._c)
        self.prior_rate = 1.0 + 2 * margin if prior_rate is None else prior_rate
        self.prior_strength = prior_strength
        # a probe is a full tree: about v(k_max) - 1 + (depth) c steps beyond a plain one
        probe_cost = max(self._v_table(256)[k_max] - 1.0, 0.0) + min(k_max, 8) * self._c
        self.base_probe_interval = min(max(8, math.ceil(probe_cost / probe_budget)), max_probe_interval)
        self.max_probe_interval = max_probe_interval
        # the probe countdown runs across requests (ProbeClock): reset at each, requests
        # shorter than the interval never probed, so once the prior rate said "plain"
        # nothing could move it again (found in review)
        self.clock = ProbeClock(self.base_probe_interval)
        self.observed = 0  # steps the current request has observed
        self.start()

    def start(self, prior_alpha: float | None = None) -> None:
        if self.observed:  # the workload so far: half the prior, half the last request
            self.prior_rate = 0.5 * self.prior_rate + 0.5 * self.rate
        self.observed = 0
        self.scale_counts = [1.0, 1.0]  # [accepted, predicted]: s starts at 1, weakly
        # a retried task's request starts from a rate that drafts (its prior_alpha is not a rate)
        rate = max(self.prior_rate, 1.0 + 2 * self.margin) if isinstance(prior_alpha, RetryPrior) else self.prior_rate
        self.rate_counts = [rate * self.prior_strength, self.prior_strength]
        self.last_best = max(2, self.k_max // 2)
        self.probing = False
        self.context = 0
        # the last trim: (every node's confidence, P(n) of the nodes kept, head passes)
        self.last_step: tuple[torch.Tensor | None, float | None, int] = (None, None, 0)
        self.kept_depth: int | None = None  # the last trim's deepest kept node (None: no trim this step)
        self.chosen: list[int] = []  # budget per step (0 = plain), for reports
        self.kept_sizes: list[int] = []  # nodes kept per drafted step

    @property
    def scale(self) -> float:
        return self.scale_counts[0] / self.scale_counts[1]

    @property
    def rate(self) -> float:
        """Expected tokens per unit of plain-step time when speculating (decayed)."""
        return self.rate_counts[0] / self.rate_counts[1]

    def _v_table(self, context: int) -> list[float]:
        return self.costs.v_table(context, self.k_max)

    def choose(self, context: int) -> int:
        self.context = context
        self.probing = False
        if self.rate > 1.0 + self.margin:
            budget = min(self.k_max, max(2, self.last_best + max(2, self.last_best // 2)))
        else:
            budget = 0
            self.clock.plain_steps += 1
            if self.clock.plain_steps > self.clock.interval:
                self.clock.plain_steps, self.probing, budget = 0, True, self.k_max
        self.chosen.append(budget)
        return budget

    def _rates(self, confidence: torch.Tensor, passes: int) -> list[float]:
        """r(n) for n = 0..len(confidence), nodes most confident first."""
        table, d, s = self._v_table(self.context), passes * self._c, self.scale
        ordered = sorted(confidence.tolist(), reverse=True)[: self.k_max]
        rates, predicted = [1.0 / (1.0 + d)], 0.0
        for n, p in enumerate(ordered, start=1):
            predicted += p
            accepted = min(s * predicted, n)  # the nodes off the accepted path may skip the output head
            rates.append((1.0 + accepted) / (self.costs.step_cost(n, 1.0 + accepted, self.context, table)[0] + d))
        return rates

    def trim(self, proposal, context: int, passes: int):
        """The nodes of ``proposal`` (a TreeProposal, built in ``passes`` head passes)
        worth their cost; may be none. ``observe`` then learns from the step."""
        self.context = context
        if proposal.confidence is None or proposal.num_tokens == 0:
            self.last_step = (None, None, passes)
            self.kept_depth = int(proposal.tree.depths().max()) if proposal.num_tokens else 0
            return proposal
        rates = self._rates(proposal.confidence, passes)
        best = max(range(len(rates)), key=rates.__getitem__)
        if self.probing and best == 0:
            # a probe scores at least the most confident node: trimmed to nothing, it taught
            # the scale nothing (observe learns only from kept nodes), so once the scale was
            # low every later probe was trimmed too and the request never drafted again
            # (found in review: perfect drafts after a wrong stretch, 0 nodes kept for good)
            best = 1
        kept = proposal.best(best)
        self.kept_depth = int(kept.tree.depths().max()) if best else 0  # a path accepted to it: all right
        self.last_step = (proposal.confidence, float(kept.confidence.sum()) if best else 0.0, passes)
        self.last_best = best
        return kept

    def lazy(self, nodes: int) -> bool:
        """Whether this step, a tree of ``nodes`` kept nodes, should compute logits on demand:
        the accepted count expected from the last trim's confidences (half the nodes for a
        drafter that gives none)."""
        _, predicted, _ = self.last_step
        accepted = min(self.scale * predicted, nodes) if predicted is not None else nodes / 2
        return self.costs.step_cost(nodes, 1.0 + accepted, self.context)[1]

    def observe(self, drafted: int, accepted: int) -> None:
        """After a tree step that kept ``drafted`` nodes and accepted ``accepted``."""
        confidence, predicted, passes = self.last_step
        self.last_step = (None, None, 0)
        depth, self.kept_depth = (drafted if self.kept_depth is None else self.kept_depth), None  # a chain's: its length
        if drafted <= 0 and confidence is None:
            if self.probing:  # the probe drafted nothing: it stays due (as CostAwareK's)
                self.clock.plain_steps = self.clock.interval + 1
            return
        self.observed += 1
        self.kept_sizes.append(drafted)
        if predicted:
            counts = self.scale_counts
            counts[0] = counts[0] * self.decay + accepted
            counts[1] = counts[1] * self.decay + predicted
        if confidence is not None:  # the best rate this tree offered, by what was learnt from it
            offered = max(self._rates(confidence, passes))
        else:
            table, kept = self._v_table(self.context), min(drafted, self.k_max)
            cost = self.costs.step_cost(kept, 1.0 + min(accepted, kept), self.context, table)[0]
            offered = (accepted + 1) / (cost + passes * self._c)
        counts = self.rate_counts
        counts[0] = counts[0] * self.decay + offered
        counts[1] = counts[1] * self.decay + 1
        if self.probing:
            if accepted >= depth > 0:  # accepted down to its deepest node: look again at once, as CostAwareK
                self.clock.interval = 0  # (found in review: doubled while the decayed rate caught up)
            elif self.rate > 1.0 + self.margin:
                self.clock.interval = self.base_probe_interval
            else:
                self.clock.interval = min(max(self.clock.interval * 2, self.base_probe_interval), self.max_probe_interval)

    def describe(self) -> str:
        return f"auto tree(<= {self.k_max} nodes)"


class ThresholdK:
    name = "threshold"

    def __init__(self, start_k: int = 5, k_min: int = 2, k_max: int = 10, window: int = 10,
                 raise_above: float = 0.8, lower_below: float = 0.5, stop_below: float = 0.3):
        self.start_k, self.k_min, self.k_max, self.window = start_k, k_min, k_max, window
        self.raise_above, self.lower_below, self.stop_below = raise_above, lower_below, stop_below
        self.start()

    def start(self, prior_alpha: float | None = None) -> None:
        self.k = self.start_k
        self.recent: deque[float] = deque(maxlen=self.window)
        self.observations = 0
        self.off = False
        self.chosen: list[int] = []

    def choose(self, context: int) -> int:
        k = 0 if self.off else self.k
        self.chosen.append(k)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.recent.append(accepted / drafted)
        self.observations += 1
        mean = sum(self.recent) / len(self.recent)
        if self.observations >= self.window and mean < self.stop_below:
            self.off = True
        elif mean > self.raise_above:
            self.k = min(self.k + 1, self.k_max)
        elif mean < self.lower_below:
            self.k = max(self.k - 1, self.k_min)

    def describe(self) -> str:
        return "threshold"
