"""How many draft tokens to offer at each step: fixed, cost-aware adaptive, or threshold.

A policy lives for one request: ``start`` at its beginning, ``choose(context)`` before each
step (0 = plain decoding for that step), ``observe(drafted, accepted)`` after each step
that drafted.

``CostAwareK`` (``--k auto``, the default) estimates acceptance online and picks the k
that maximises expected speedup tau(k) / (v(k) + k c) with the measured cost profile,
k = 0 included. Acceptance is modelled with two rates: ``first``, that draft position 1
is accepted, and ``later``, that a position is accepted given the one before it was.
Drafters accept in runs (an n-gram match that got its first token right is copying, and
its next tokens are right far more often), so one independent alpha per position would
undervalue long drafts; with first = later it is Leviathan et al.'s eq. 1. A step that
drafted d tokens and accepted n is one trial of ``first`` (success if n > 0) and, if
n > 0, n - 1 successes of ``later`` then one failure (none if n == d). Counts decay
geometrically (each rate when it is tried), so the estimate follows the request: copying a span of the prompt and
writing new text have very different acceptance. Priors seed the counts: for
``first``, the router's per-task rate if given, else the drafter's rate calibrated once
on this target; for ``later``, the calibrated rate.
When plain decoding wins, a probe step (one draft token) is spent after
``probe_interval`` plain steps — by default spaced so probes cost about 1% of the time,
v(1) - 1 + c steps each — the interval doubling after each failed probe and dropping to
zero after a fully accepted one, so a request can come back to speculation cheaply.
A step with one draft says nothing about ``later``, so when such a step is accepted the
next offers two drafts even if one looks best: otherwise a low ``later`` prior would
never be corrected.

``ThresholdK`` (``--k-policy threshold``) is the simple rule from the literature, kept for
comparison: start at 5, +1 when the mean acceptance of the last 10 steps exceeds 0.8, -1
when it is below 0.5, bounded to 2..10, and no speculation once the mean is below 0.3
after 10 observations.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from ..analysis.theory import best_k, tau_two_rates
from ..config import ConfigError

DEFAULT_PRIOR_ALPHA = 0.5


class KPolicy(Protocol):
    name: str
    k_max: int  # the most draft tokens a step may get (sizes the KV cache)

    def start(self, prior_alpha: float | None = None) -> None: ...
    def choose(self, context: int) -> int: ...
    def observe(self, drafted: int, accepted: int) -> None: ...
    def describe(self) -> str: ...


class FixedK:
    name = "fixed"

    def __init__(self, k: int):
        if k < 1:
            raise ConfigError(f"k (draft tokens per step) must be >= 1, got {k}")
        self.k = self.k_max = k

    def start(self, prior_alpha: float | None = None) -> None:
        pass

    def choose(self, context: int) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def describe(self) -> str:
        return str(self.k)


@dataclass
class CostModel:
    """The two functions of cost the policy needs, from a CostProfile."""

    profile: object  # CostProfile
    drafter: str

    def v(self, k: int, context: int) -> float:
        return self.profile.v(k, context)

    @property
    def c(self) -> float:
        return self.profile.c(self.drafter)


class CostAwareK:
    name = "auto"

    def __init__(self, costs: CostModel, k_max: int = 10, decay: float = 0.85,
                 prior_strength: float = 4.0, probe_interval: int | None = None, max_probe_interval: int = 128,
                 margin: float = 0.02, default_prior: float | None = None, default_later: float | None = None,
                 probe_budget: float = 0.01):
        if k_max < 1:
            raise ConfigError(f"k_max must be >= 1, got {k_max}")
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"decay must be in (0, 1], got {decay}")
        self.costs, self.k_max, self.decay = costs, k_max, decay
        self.prior_strength, self.margin = prior_strength, margin
        self._c = costs.c
        self._tables: dict[int, list[float]] = {}
        self.default_prior = DEFAULT_PRIOR_ALPHA if default_prior is None else default_prior
        self.default_later = default_later  # None: the same as the first-position prior
        if probe_interval is None:
            # a probe costs v(1) - 1 + c target steps; space probes so that they spend
            # about ``probe_budget`` of the time while speculation is off
            probe_cost = max(self._v_table(256)[1] - 1.0, 0.0) + self._c
            probe_interval = min(max(8, math.ceil(probe_cost / probe_budget)), max_probe_interval)
        self.base_probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.start()

    def start(self, prior_alpha: float | None = None) -> None:
        alpha = self.default_prior if prior_alpha is None else prior_alpha
        later = alpha if self.default_later is None else self.default_later
        alpha, later = (min(max(rate, 0.0), 0.99) for rate in (alpha, later))
        # [successes, trials] of position 1 and of the positions after an accepted one
        self.first_counts = [alpha * self.prior_strength, self.prior_strength]
        self.later_counts = [later * self.prior_strength, self.prior_strength]
        self.plain_steps = 0
        self.probe_interval = self.base_probe_interval
        self.probing = False
        self.explore_later = False
        self.context = 0
        self.chosen: list[int] = []  # k per step, for reports

    @property
    def first(self) -> float:
        return self.first_counts[0] / self.first_counts[1]

    @property
    def later(self) -> float:
        return self.later_counts[0] / self.later_counts[1]

    @property
    def alpha(self) -> float:
        """Acceptance per draft trial, both rates pooled (for reports)."""
        return (self.first_counts[0] + self.later_counts[0]) / (self.first_counts[1] + self.later_counts[1])

    def tau(self, k: int) -> float:
        return tau_two_rates(self.first, self.later, k)

    def _v_table(self, context: int) -> list[float]:
        """v(0..k_max) at this context, rounded to 64 tokens: a step's decision must cost
        microseconds, not a profile interpolation per k."""
        bucket = context // 64 * 64 + 32
        table = self._tables.get(bucket)
        if table is None:
            table = self._tables[bucket] = [self.costs.v(k, bucket) for k in range(self.k_max + 1)]
        return table

    def _best(self, context: int) -> int:
        table = self._v_table(context)
        k, speedup = best_k(self.alpha, table.__getitem__, self._c, self.k_max, tau=self.tau)
        return k if speedup > 1.0 + self.margin else 0

    def choose(self, context: int) -> int:
        self.context = context
        k = self._best(context)
        self.probing = False
        if k == 0:
            self.plain_steps += 1
            if self.plain_steps > self.probe_interval:  # time to look again
                self.plain_steps = 0
                self.probing = True
                k = 1  # the cheapest look; a fully accepted probe is followed at once by another
        elif k == 1 and self.explore_later:
            k = min(2, self.k_max)
        self.explore_later = False
        self.chosen.append(k)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        decay = self.decay
        first, later = self.first_counts, self.later_counts
        first[0] = first[0] * decay + (accepted > 0)
        first[1] = first[1] * decay + 1
        # positions 2.. are tried only after position 1 was accepted
        tried = accepted - 1 + (accepted < drafted) if accepted > 0 else 0
        if tried:
            later[0] = later[0] * decay + accepted - 1
            later[1] = later[1] * decay + tried
        self.explore_later = drafted == 1 and accepted == 1
        if self.probing:
            if accepted == drafted:  # the drafts were right: look again at once
                self.probe_interval = 0
            elif self._best(self.context) == 0:  # still losing: look less often
                self.probe_interval = min(max(self.probe_interval * 2, self.base_probe_interval),
                                          self.max_probe_interval)
            else:
                self.probe_interval = self.base_probe_interval

    def describe(self) -> str:
        return f"auto(<= {self.k_max})"


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
