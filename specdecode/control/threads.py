"""Kernel threads for a server's decode passes, chosen by measuring the passes.

A server's front end (HTTP, SSE, detokenizing; in ``bench-serve`` the client too) runs
beside the engine thread, and the kernels' threads meet at a barrier in every layer: when
the front end takes a core from one of them, the others wait. Whether the kernels should
leave it a core depends on the machine and on the load. On a Zen 4 (2 vCPUs) one kernel
thread served faster at 1 and at 8 clients; on a Zen 3 (2 vCPUs) two served 8 clients
1.3x faster and one client about as fast (docs/serving.md). A constant tuned on one of
them is wrong on the other, so the engine measures: ``ThreadChoice`` keeps, per kind of
pass (one sequence alone, or a batch), a decayed mean of each thread count's measured
time over the time predicted for that pass's shape, runs the lower, and now and then runs
another to look again (every ``explore_every`` passes of that kind, the interval doubling
while looking finds nothing better, back to the start when it does).

A row's logits are the same bits at any thread count (the kernels' rows are independent
of the team that computes them), so the choice changes timing only, never an output.
"""

from __future__ import annotations

from typing import Callable

from ..config import ConfigError

# What a pass costs without a cost profile: relative units, one decode step = 1. Only the
# ratio between thread counts matters, and both see the same mix of shapes over time.
def rough_cost(rows: int, width: int, context: int) -> float:
    return 1.0 + 0.25 * (rows * width - 1)


class ThreadChoice:
    def __init__(self, options: tuple[int, ...], predict: Callable[[int, int, int], float] | None = None,
                 explore_every: int = 16, max_explore_every: int = 512, decay: float = 0.8,
                 log: Callable[[str], None] | None = None):
        options = tuple(dict.fromkeys(options))
        if not options or any(not isinstance(n, int) or n < 1 for n in options):
            raise ConfigError(f"thread counts must be integers >= 1, got {options}")
        if explore_every < 1 or max_explore_every < explore_every:
            raise ConfigError(f"need 1 <= explore_every <= max_explore_every, got {explore_every}, {max_explore_every}")
        self.options = options  # the first is the one tried first
        self.predict = predict or rough_cost
        self.explore_every, self.max_explore_every, self.decay = explore_every, max_explore_every, decay
        self.log = log
        self.ratios: dict[tuple[str, int], float] = {}  # (kind, threads) -> decayed mean of measured / predicted
        self.interval: dict[str, int] = {}
        self.countdown: dict[str, int] = {}
        self.looks: dict[str, int] = {}  # how many looks each kind has taken (round robin over the others)
        self.preferred: dict[str, int] = {}
        self.counts: dict[tuple[str, int], int] = {}  # passes run per (kind, threads), for reports

    @staticmethod
    def kind(rows: int) -> str:
        return "alone" if rows == 1 else "batch"

    def best(self, kind: str) -> int:
        """The thread count with the lowest measured ratio for ``kind`` (untried: the first option)."""
        tried = [n for n in self.options if (kind, n) in self.ratios]
        if not tried:
            return self.options[0]
        return min(tried, key=lambda n: (self.ratios[kind, n], self.options.index(n)))

    def choose(self, rows: int, width: int, context: int) -> int:
        kind = self.kind(rows)
        untried = [n for n in self.options if (kind, n) not in self.ratios]
        if untried and (kind, self.options[0]) in self.ratios:
            return untried[0]  # measure every option once, after the first
        best = self.best(kind)
        left = self.countdown.get(kind, self.explore_every) - 1
        self.countdown[kind] = left
        if left > 0 or len(self.options) == 1:
            return best
        others = [n for n in self.options if n != best]
        look = self.looks.get(kind, 0)
        self.looks[kind] = look + 1
        return others[look % len(others)]

    def observe(self, threads: int, rows: int, width: int, context: int, ms: float) -> None:
        """A pass of ``rows`` x ``width`` tokens after ``context`` took ``ms`` on ``threads``."""
        predicted = self.predict(rows, width, context)
        if threads not in self.options or ms <= 0 or predicted <= 0:
            return
        kind = self.kind(rows)
        best_before = self.best(kind)
        was_look = self.countdown.get(kind, self.explore_every) <= 0
        ratio = ms / predicted
        old = self.ratios.get((kind, threads))
        if old is not None:  # one pass stalled by the OS must not swing the mean
            ratio = min(max(ratio, old / 4), old * 4)
        self.ratios[kind, threads] = ratio if old is None else old * self.decay + ratio * (1 - self.decay)
        self.counts[kind, threads] = self.counts.get((kind, threads), 0) + 1
        if was_look:
            interval = self.interval.get(kind, self.explore_every)
            found = self.best(kind) != best_before
            self.interval[kind] = self.explore_every if found else min(2 * interval, self.max_explore_every)
            self.countdown[kind] = self.interval[kind]
        best = self.best(kind)
        if self.preferred.get(kind) != best and all((kind, n) in self.ratios for n in self.options):
            self.preferred[kind] = best
            if self.log is not None:
                means = ", ".join(f"{n}: {self.ratios[kind, n]:.2f}" for n in self.options)
                self.log(f"decode passes ({kind}) now on {best} kernel thread(s); measured / predicted time {means}")

    def describe(self) -> dict:
        return {kind: {"preferred": self.best(kind),
                       "ratios": {n: round(self.ratios[kind, n], 3) for n in self.options if (kind, n) in self.ratios},
                       "passes": {n: self.counts.get((kind, n), 0) for n in self.options}}
                for kind in ("alone", "batch") if any((kind, n) in self.ratios for n in self.options)}
