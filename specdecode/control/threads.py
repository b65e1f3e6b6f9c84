"""Kernel threads for a server's decode passes, chosen by measuring the passes.

A server's front end (HTTP, SSE, detokenizing; in ``bench-serve`` the client too) runs
beside the engine thread, and the kernels' threads meet at a barrier in every layer: when
the front end takes a core from one of them, the others wait. Whether the kernels should
leave it a core depends on the machine and on the load. On a Zen 4 (2 vCPUs) one kernel
thread served faster at 1 and at 8 clients; on a Zen 3 (2 vCPUs) two served 8 clients
1.3x faster and one client about as fast (docs/serving.md). A constant tuned on one of
them is wrong on the other, so the engine measures: ``ThreadChoice`` keeps, per kind of
pass (one sequence's single token, one sequence scoring drafts, or a batch), a decayed mean of each thread count's measured
time over the time predicted for that pass's shape, runs the lower, and now and then runs
another to look again (every ``explore_every`` passes of that kind, the interval doubling
while a look measures worse than the preferred count's mean, back to the start when one
measures better). Each count's mean starts from the median of its first passes, so one
stalled pass at the start cannot keep the server on the slower count.

A row's logits are the same bits at any thread count (the kernels' rows are independent
of the team that computes them), so the choice changes timing only, never an output.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from ..config import ConfigError

# What a pass costs without a cost profile: relative units, one decode step = 1. Only the
# ratio between thread counts matters, and both see the same mix of shapes over time.
def rough_cost(rows: int, width: int, context: int) -> float:
    return 1.0 + 0.25 * (rows * width - 1)


WARM_UP = 3  # passes of each count, per kind, whose median starts its mean (one pass can be stalled)
HIGH = 1.5  # a pass above this many times its count's mean is held to it, unless the one before was high too
STALLED = 3.0  # a pass this many times its count's mean: another process has a core (``look_when_stalled``)
LOOK_SHARE = 10  # after a look measured s times slower, the next waits at least LOOK_SHARE * s passes


class ThreadChoice:
    def __init__(self, options: tuple[int, ...], predict: Callable[[int, int, int], float] | None = None,
                 explore_every: int = 16, max_explore_every: int = 512, decay: float = 0.8,
                 log: Callable[[str], None] | None = None, look_when_stalled: bool = False):
        """``look_when_stalled``: run the first option alone, looking at no other, until two
        of its passes in a row (one alone can be the OS's hiccup) take ``STALLED`` times its
        mean or, with ``predict`` given (the cost profile's milliseconds), the prediction: a
        process has taken a core, perhaps from the first pass on. From then on choose as
        above. A single request's engine then pays nothing on a machine it has to itself
        (warming the other counts and the looks cost a 128-token decode on a quiet 2-core
        Zen 3 about 10%), and leaves a stalled count within a few passes."""
        options = tuple(dict.fromkeys(options))
        if not options or any(not isinstance(n, int) or n < 1 for n in options):
            raise ConfigError(f"thread counts must be integers >= 1, got {options}")
        if explore_every < 1 or max_explore_every < explore_every:
            raise ConfigError(f"need 1 <= explore_every <= max_explore_every, got {explore_every}, {max_explore_every}")
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"decay must be in (0, 1), got {decay}")
        self.options = options  # the first is the one tried first
        self.absolute = predict is not None  # predictions in milliseconds, measured here with the cores free
        self.predict = predict or rough_cost
        # predictions by (rows, width, context rounded to 64): a profile's interpolation cost
        # about 3% of a served decode step's time when made for every pass
        self._predicted: dict[tuple[int, int, int], float] = {}
        self.explore_every, self.max_explore_every, self.decay = explore_every, max_explore_every, decay
        self.log = log
        self.warm: dict[tuple[str, int], list[float]] = {}  # the first WARM_UP ratios of each (kind, threads)
        self.ratios: dict[tuple[str, int], float] = {}  # (kind, threads) -> decayed mean of measured / predicted
        self.interval: dict[str, int] = {}
        self.countdown: dict[str, int] = {}
        self.looking: dict[str, tuple[int, int]] = {}  # kind -> (count looked at, the preferred one then)
        self.looks: dict[str, int] = {}  # how many looks each kind has taken (round robin over the others)
        self.preferred: dict[str, int] = {}
        self.counts: dict[tuple[str, int], int] = {}  # passes run per (kind, threads), for reports
        self.high: dict[tuple[str, int], bool] = {}  # whether that count's last pass measured above HIGH x its mean
        self.engaged = not look_when_stalled  # False: the first option only, until passes stall
        self.stalled = False  # whether the last pass stalled (while not engaged)

    @staticmethod
    def kind(rows: int, width: int = 1) -> str:
        """"alone" (one sequence, one token), "drafts" (one sequence scoring its drafts) or
        "batch". A pass of one token reads its weights and little else; one scoring drafts
        multiplies as well, and gains more from a second thread (on a Zen 4 without a front
        end: 1.37x at one token, 1.52-1.65x at 3-6). Priced as one kind, a server whose
        single-token passes ran as fast on one thread moved its speculative passes to one
        thread too."""
        return "batch" if rows > 1 else "alone" if width == 1 else "drafts"

    def best(self, kind: str) -> int:
        """The thread count with the lowest measured ratio for ``kind`` (none measured: the first option)."""
        measured = [n for n in self.options if (kind, n) in self.ratios]
        if not measured:
            return self.options[0]
        return min(measured, key=lambda n: (self.ratios[kind, n], self.options.index(n)))

    def choose(self, rows: int, width: int, context: int) -> int:
        if not self.engaged:
            return self.options[0]
        kind = self.kind(rows, width)
        warming = [n for n in self.options if (kind, n) not in self.ratios]
        if warming:  # each count's first passes, taken in turn
            return min(warming, key=lambda n: (len(self.warm.get((kind, n), ())), self.options.index(n)))
        best = self.best(kind)
        left = self.countdown.get(kind, self.explore_every) - 1
        self.countdown[kind] = left
        if left > 0 or len(self.options) == 1:
            return best
        # a look at another count; the countdown restarts now, whether or not the pass is measured
        self.countdown[kind] = self.interval.get(kind, self.explore_every)
        others = [n for n in self.options if n != best]
        look = self.looks.get(kind, 0)
        self.looks[kind] = look + 1
        other = others[look % len(others)]
        self.looking[kind] = (other, best)
        return other

    def observe(self, threads: int, rows: int, width: int, context: int, ms: float) -> None:
        """A pass of ``rows`` x ``width`` tokens after ``context`` took ``ms`` on ``threads``."""
        kind = self.kind(rows, width)
        look = self.looking.pop(kind, None)
        shape = (rows, width, context // 64)
        predicted = self._predicted.get(shape)
        if predicted is None:
            predicted = self._predicted[shape] = self.predict(rows, width, shape[2] * 64 + 32)
        if threads not in self.options or not ms > 0 or not predicted > 0:
            return
        ratio, key = ms / predicted, (kind, threads)
        self.counts[key] = self.counts.get(key, 0) + 1
        reference = self.ratios.get(key, 1.0 if self.absolute else None)
        stall = not self.engaged and reference is not None and ratio > STALLED * reference
        stalled_before, self.stalled = self.stalled, stall
        if stall and not stalled_before:
            return  # held out of the mean: a second stall in a row decides
        if stall:
            self.engaged = True
            against = "its mean" if key in self.ratios else "the cost profile's time"
            # the stalled count is priced by this pass: warming it twice more cost a 128-token
            # decode on a Zen 3 beside a busy process 3.4 s (1.7 s a pass) of its 8
            self.ratios.setdefault(key, ratio)
            if self.log is not None:
                others = ", ".join(str(n) for n in self.options if n != threads)
                self.log(f"two decode passes in a row took {STALLED:g}x {against} or more on {threads} kernel "
                         f"thread(s), the second {ratio / reference:.1f}x: measuring {others} beside it from now on")
        if key not in self.ratios:
            samples = self.warm.setdefault(key, [])
            samples.append(ratio)
            if len(samples) >= WARM_UP:
                self.ratios[key] = statistics.median(samples)
        else:
            # One pass stalled by the OS must not swing the mean: a pass above HIGH times it
            # counts as HIGH times it unless this count's pass before was high too (a slowdown
            # that is real shows again). Clipped at 4x alone, one 10x stall raised a mean
            # 1.6x, and the faster count then lost to the slower one until the next look, up
            # to 512 passes later (found in review: 27-53% of passes on the slower count with
            # a stall every 1,000-200 passes).
            old = self.ratios[key]
            high = ratio > HIGH * old
            clipped = min(max(ratio, old / 4), old * (4 if self.high.get(key) else HIGH))
            self.high[key] = high
            self.ratios[key] = old * self.decay + clipped * (1 - self.decay)
        if look is not None and look[0] == threads:
            # a look that measured better than the preferred count's mean: look again soon
            preferred = self.ratios.get((kind, look[1]))
            interval = self.interval.get(kind, self.explore_every)
            better = preferred is not None and ratio < preferred
            # a look that stalled (two threads beside a busy process: 100-300x one thread)
            # waits longer, past max_explore_every, so that looks take about 1 / LOOK_SHARE
            # of the passes' time at most
            slower = ratio / preferred if preferred else 1.0
            wait = min(2 * interval, self.max_explore_every)
            if slower > STALLED:
                wait = max(wait, math.ceil(LOOK_SHARE * slower))
            self.interval[kind] = self.explore_every if better else wait
            self.countdown[kind] = self.interval[kind]
        best = self.best(kind)
        if self.preferred.get(kind) != best and all((kind, n) in self.ratios for n in self.options):
            self.preferred[kind] = best
            if self.log is not None:
                means = ", ".join(f"{n}: {self.ratios[kind, n]:.2f}" for n in self.options)
                self.log(f"decode passes ({kind}) now on {best} kernel thread(s); measured / predicted time {means}")
