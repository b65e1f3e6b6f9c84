"""The cost profile: what scoring n tokens and drafting one token cost on this machine.

``specdecode profile`` (and the first engine that needs it) times the target's forward
pass for n = 1..64 new tokens at several context lengths, and each drafter's cost per
draft token, all relative to one target decode step (n = 1) at the same context:

    v(k) = time(score k+1 tokens) / time(score 1 token)
    c    = time(one draft token)  / time(score 1 token)

at contexts of 100, 600, 1,500 and 4,000 tokens. It also records the machine's memory read
bandwidth and the bytes a single-token step reads (weights in their storage format, and
keys and values per cached token), so a step can be compared with the time reading them
takes (``bandwidth_limit_ms``).

Profiles are cached as JSON in ``<cache>/profiles/`` keyed by model and runtime (backend,
weight format), dtype, CPU, thread count and the CPU kernels' source, and reused by
adaptive k, the analyzer, ``check`` and the router. ``--remeasure``
(``get_profile(..., force=True)``) replaces a cached profile.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import platform
import random
import statistics
import time
from datetime import datetime, timezone
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..config import SpecDecodeError
from ..kernels import build_digest
from ..models.loading import cache_dir, cache_lock, save_cache

PROFILE_VERSION = 9  # 9: each timed step follows a single-token step
# k + 1 for the k the policies choose (1..11) and the tree sizes to come (up to 64)
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32, 64)
CONTEXTS = (100, 600, 1500, 4000)
# the batched engine's steps: rows (sequences) x width (1 + drafts per row), at one context
BATCH_ROWS = (1, 2, 4, 8)
BATCH_WIDTHS = (1, 2, 4, 6)
BATCH_CONTEXT = 256


def proc_field_bytes(path: str, field: str) -> float | None:
    """A 'Field:  N kB' line of a Linux /proc file, in bytes; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_id() -> str:
    """CPU model name and core count: costs measured on one machine do not carry over."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{name} x{os.cpu_count()}"


def _interp_extended(xs, ys, x: float) -> float:
    """Linear interpolation of the measured points (xs, ys) at x; beyond the last point,
    the last segment's slope extended, never downwards: scoring more tokens (or more rows)
    never costs less (a noisy last cell extended down made 512 tokens cheaper than one on
    a flat GPU profile; found in review)."""
    if x >= xs[-1]:
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (x - xs[-1])
    return float(np.interp(x, xs, ys))


@dataclass
class CostProfile:
    model: str
    dtype: str
    machine: str
    threads: int
    contexts: list[int]
    sizes: list[int]
    step_ms: list[list[float]]  # [context][size]: median ms to score `size` tokens
    drafters: dict[str, float] = field(default_factory=dict)  # drafter -> c
    # drafter -> [first, later] acceptance on a few built-in prompts (greedy): the
    # adaptive-k priors when nothing better is known (factory.calibrate_acceptance)
    acceptance: dict[str, list[float]] = field(default_factory=dict)
    bandwidth_gbs: float = 0.0  # memory read bandwidth measured with these threads
    weight_bytes: int = 0  # bytes of weights one step reads (layers and output head)
    kv_bytes_per_token: int = 0  # bytes of keys and values one step reads per cached token
    runtime: str = ""  # the runtime's description (backend, weight format, KV dtype)
    # batched steps (measure_batches): [rows][width] median ms at BATCH_CONTEXT for each row;
    # empty until a batched engine asks for it
    batch_rows: list[int] = field(default_factory=list)
    batch_widths: list[int] = field(default_factory=list)
    batch_ms: list[list[float]] = field(default_factory=list)
    batch_context: int = BATCH_CONTEXT
    # Where the runtime computes logits row by row on demand (greedy verification stops at
    # the first rejection), what the output head costs after a step's layers, in ms: the
    # first row read (head_ms), each further row (head_next_ms), and the whole head over n
    # rows in one pass (head_full_ms at head_sizes). head_ms 0: not such a runtime. Where
    # the head is compute bound (AVX2 Zen 1) a row on demand saves most of a full row;
    # where it is bound by reading its weights (Zen 4), every row read streams them again
    # and one pass over all rows costs about what one row does.
    head_ms: float = 0.0
    head_next_ms: float = 0.0
    head_sizes: list[int] = field(default_factory=list)
    head_full_ms: list[float] = field(default_factory=list)
    # when the step table was measured (UTC, ISO 8601; "" in profiles older than the field).
    # A shared machine's costs drift: one Zen 4 measured v(4) = 1.22 one hour and 1.57 another
    measured_at: str = ""
    # on a GPU with CUDA graphs (models/cuda_graphs.py): the attention each timed step's
    # recording kept, by measurement, per T ("1": "sdpa", ...); {} elsewhere
    graph_attention: dict[str, str] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def bandwidth_limit_ms(self, context: int, with_cache: bool = False) -> float:
        """The time a single-token step needs to read its weights (and, with_cache, its
        keys and values at ``context``) at the measured bandwidth."""
        read = self.weight_bytes + (self.kv_bytes_per_token * context if with_cache else 0)
        return read / (self.bandwidth_gbs * 1e9) * 1e3 if self.bandwidth_gbs else float("nan")

    # -- lookups --------------------------------------------------------------------
    def _at_context(self, row_values, context: int) -> float:
        """Linear interpolation over context length; below the shortest context measured,
        its value; beyond the longest, extended along the last segment's slope (never
        downwards): a step reads every cached key and value, so it keeps growing with the
        context (found in review: held at the longest measured context, 4,000 of the
        default model's 8,192, plain steps there were priced too cheap)."""
        contexts = self.contexts
        if context <= contexts[0] or len(contexts) == 1:
            return row_values(0)
        if context >= contexts[-1]:
            last, before = row_values(len(contexts) - 1), row_values(len(contexts) - 2)
            slope = max(last - before, 0.0) / (contexts[-1] - contexts[-2])
            return last + slope * (context - contexts[-1])
        right = bisect.bisect_left(contexts, context)
        left = right - 1
        share = (context - contexts[left]) / (contexts[right] - contexts[left])
        return row_values(left) * (1 - share) + row_values(right) * share

    def time_ms(self, num_tokens: int, context: int = 256) -> float:
        """Milliseconds to score ``num_tokens`` tokens after ``context`` cached ones."""
        num_tokens = max(1, num_tokens)
        return self._at_context(lambda index: _interp_extended(self.sizes, self.step_ms[index], num_tokens), context)

    def batch_time_ms(self, rows: int, width: int, context: int = BATCH_CONTEXT) -> float:
        """Milliseconds of one batched pass: ``rows`` sequences scoring ``width`` tokens
        each, after about ``context`` cached tokens each. From the measured batch table
        (interpolated, extended beyond it along its last slope), with each row's attention
        over a longer or shorter context priced by the single-sequence table; without a
        batch table, the single-sequence time of rows x width tokens."""
        if not self.batch_ms:
            return self.time_ms(rows * width, context)
        per_rows = [_interp_extended(self.batch_widths, widths, width) for widths in self.batch_ms]
        base = _interp_extended(self.batch_rows, per_rows, rows)
        return base + rows * (self.time_ms(width, context) - self.time_ms(width, self.batch_context))

    def v(self, k: int, context: int = 256) -> float:
        """Cost of scoring k+1 tokens relative to one decode step, at ``context``."""
        return self.time_ms(k + 1, context) / self.time_ms(1, context)

    def head_pass_ms(self, rows: int) -> float:
        """The output head over ``rows`` rows in one pass, after a step's layers (0 if
        unmeasured). Without a full-pass table (a synthetic profile) a row costs head_ms."""
        if self.head_full_ms:
            return _interp_extended(self.head_sizes, self.head_full_ms, rows)
        return self.head_ms * rows

    def lazy_head_ms(self, read: float, rows: int) -> float:
        """The output head on demand for ``read`` of ``rows`` rows (expected; at least 1)."""
        read = min(max(read, 1.0), float(rows))
        return self.head_ms + (read - 1.0) * (self.head_next_ms if self.head_full_ms else self.head_ms)

    def lazy_head_saving_ms(self, rows: int, read: float) -> float:
        """Milliseconds a step scoring ``rows`` tokens saves by computing logits on demand
        when verification reads ``read`` rows, against one pass of the head over every row;
        negative where on demand costs more. 0 if unmeasured."""
        if not self.head_ms:
            return 0.0
        return self.head_pass_ms(rows) - self.lazy_head_ms(read, rows)

    def summary(self, context: int = 100, sizes: tuple[int, ...] = (2, 4, 8)) -> dict:
        """What a benchmark records of the profile its policies used: when it was measured,
        the runtime, the bandwidth, and v(T) (scoring T tokens over one decode step) at
        ``context``."""
        return {"measured_at": self.measured_at or None, "runtime": self.runtime,
                "bandwidth_gbs": round(self.bandwidth_gbs, 1), "context": context,
                "v": {size: round(self.v(size - 1, context), 3) for size in sizes}}

    def c(self, drafter: str) -> float:
        if drafter not in self.drafters:
            raise KeyError(f"the profile holds no cost for drafter {drafter!r}; run specdecode profile --draft {drafter}")
        return self.drafters[drafter]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostProfile":
        profile = cls(**data)
        profile.check()
        return profile

    def check(self) -> None:
        """ValueError unless every field has the shape and range the policies read: a cached
        file of the current version with a field of another type (an acceptance as text, a
        short step row, an empty context list) used to load, then failed every request deep
        in a policy (found in review); ``load_profile`` measures such a file again."""
        def numbers(values, low: float = 0.0, high: float = math.inf, strict: bool = False) -> bool:
            return isinstance(values, list) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (v > low if strict else v >= low) and v <= high for v in values)

        problems = [
            not (self.contexts and numbers(self.contexts, strict=True) and self.contexts == sorted(set(self.contexts))),
            not (self.sizes and numbers(self.sizes, low=1) and self.sizes == sorted(set(self.sizes)) and self.sizes[0] == 1),
            not (isinstance(self.step_ms, list) and len(self.step_ms) == len(self.contexts)
                 and all(numbers(row, strict=True) and len(row) == len(self.sizes) for row in self.step_ms)),
            not (isinstance(self.drafters, dict) and numbers(list(self.drafters.values()))),
            not (isinstance(self.acceptance, dict) and all(numbers(v, high=1.0) and len(v) == 2
                                                           for v in self.acceptance.values())),
            not numbers([self.bandwidth_gbs, self.weight_bytes, self.kv_bytes_per_token, self.head_ms,
                         self.head_next_ms, self.threads]),
            not (numbers(self.batch_rows, low=1) and numbers(self.batch_widths, low=1) and isinstance(self.batch_ms, list)
                 and len(self.batch_ms) == len(self.batch_rows)
                 and all(numbers(row, strict=True) and len(row) == len(self.batch_widths) for row in self.batch_ms)),
            not (numbers(self.head_sizes, low=1) and numbers(self.head_full_ms) and len(self.head_sizes) == len(self.head_full_ms)),
            not (isinstance(self.graph_attention, dict)
                 and all(isinstance(k, str) and isinstance(v, str) for k, v in self.graph_attention.items())),
        ]
        if any(problems):
            raise ValueError("a cost profile with fields of the wrong shape or range")


# -- storage ------------------------------------------------------------------------
def profile_path(model_key: str, dtype: str) -> Path:
    key = f"{model_key}|{dtype}|{machine_id()}|{torch.get_num_threads()}|kernels {build_digest()}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{dtype}-{digest}.json"


def load_profile(model_key: str, dtype: str) -> CostProfile | None:
    path = profile_path(model_key, dtype)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            return None
        return CostProfile.from_dict(data)
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):  # unreadable, not JSON, not UTF-8, the wrong fields
        return None  # a corrupt profile is re-measured


def save_profile(profile: CostProfile, model_key: str) -> Path:
    path = profile_path(model_key, profile.dtype)
    save_cache(path, json.dumps(profile.to_dict(), indent=1), "the cost profile")
    return path


# -- measurement --------------------------------------------------------------------
def _wait() -> None:
    """Let a GPU finish what was queued, so a timed call is charged its own work (kernels
    return before they run there); nothing on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _elapsed_ms(fn) -> float:
    """Milliseconds of ``fn()``, a GPU's queued work finished before and after it."""
    _wait()
    started = time.perf_counter()
    fn()
    _wait()
    return (time.perf_counter() - started) * 1e3


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate
    return statistics.median(_elapsed_ms(fn) for _ in range(repeats))


def extend_context(runtime, context: int, generator: torch.Generator) -> None:
    """Grow the cache with random tokens to ``context`` (chunked: activations stay small)."""
    while runtime.length < context:
        count = min(256, context - runtime.length)
        runtime(torch.randint(0, runtime.vocab_size, (1, count), generator=generator), last_only=True)


def timed_forward_ms(runtime, tokens: torch.Tensor, context: int) -> float:
    """Milliseconds of one forward over ``tokens`` after ``context`` cached ones; the
    cache is rolled back to ``context`` after it."""
    elapsed = _elapsed_ms(lambda: runtime(tokens))
    runtime.rollback(context)
    return elapsed


def measure_target(runtime, contexts=CONTEXTS, sizes=SIZES, repeats: int = 6, progress: bool = True,
                   between_rounds=None) -> tuple[list[int], list[int], list[list[float]]]:
    """Forward time for each (context, size) the model's context allows: the median of the
    single-token times, times the median of each size's ratio to them round by round.

    Sizes are timed in interleaved rounds (each round visits every size once, in a
    shuffled order) rather than one size at a time, so that a transient slowdown of the
    machine spreads over many cells as one outlier each instead of owning one cell. The
    cache grows from one context to the next, so each prompt token is run once.
    ``between_rounds``: called after each timed round (the profile reads the memory
    bandwidth there, so that the steps and their bandwidth limit see the same machine).
    """
    limit = runtime.max_positions
    sizes = [s for s in sizes if s < limit // 2]
    contexts = [c for c in contexts if c + max(sizes) <= limit] or [max(0, limit - max(sizes) - 1)]
    generator = torch.Generator().manual_seed(0)
    order = random.Random(0)
    table = []
    # round 0 warms up every shape; on a GPU, rounds before it too until each shape's CUDA
    # graph is recorded (models/cuda_graphs.py)
    graphs = getattr(runtime, "graphs", None)
    warm = 1 + (graphs.record_after if graphs is not None else 0)
    bar = tqdm(total=len(contexts) * (repeats + warm), desc="profile target", unit="round", disable=not progress)
    runtime.reset(max(contexts) + max(sizes) + 1)
    for context in contexts:
        extend_context(runtime, context, generator)
        inputs = {size: torch.randint(0, runtime.vocab_size, (1, size), generator=generator) for size in sizes}
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for round_ in range(1 - warm, repeats + 1):  # rounds up to 0 warm up
            shuffled = list(sizes)
            order.shuffle(shuffled)
            for size in shuffled:
                # a decode step follows a decode step: one single-token step first, so the
                # timed one does not inherit the caches a 64-token step left (a single step
                # timed after one of 64 took 3.31 ms, after one of 1 2.99; v(4) read 1.21
                # against 1.32 measured this way, on a Zen 4)
                timed_forward_ms(runtime, inputs[sizes[0]], context)
                elapsed = timed_forward_ms(runtime, inputs[size], context)
                if round_ > 0:
                    times[size].append(elapsed)
            if round_ > 0 and between_rounds is not None:
                between_rounds()
            bar.update()
        # v(T) is what the policies read: each size's time over the same round's T = 1 time,
        # medians of those ratios, so a drift of the whole machine between rounds (±15% over
        # minutes here) cancels instead of landing in one size's median
        single = statistics.median(times[sizes[0]])
        table.append([single * statistics.median(t / one for t, one in zip(times[size], times[sizes[0]]))
                      for size in sizes])
    bar.close()
    return list(contexts), list(sizes), table


def measure_head(runtime, sizes=(2, 4, 8), context: int = 100, repeats: int = 15) -> dict:
    """What the output head costs after a step's layers on a runtime that computes logits
    on demand (``lazy_logits``), as CostProfile's head_* fields; {} on any other. Each
    repetition times, back to back on the same tokens, the layers alone (no row read), then
    with the first row read, with two rows read, and the plain pass (the head over every
    row); the costs are medians of the differences, so the head is charged cold, as a
    step's last read."""
    if not getattr(runtime, "lazy_logits", False):
        return {}
    # logits come on demand only for a pass of one prefill chunk (found in review: with
    # --prefill-chunk below 8 the pass of 8 returned plain logits, and this failed on them)
    sizes = tuple(size for size in sizes if size <= getattr(runtime, "prefill_chunk", size))
    if not sizes:
        return {}
    context = max(0, min(context, runtime.max_positions - max(sizes) - 1))
    generator = torch.Generator().manual_seed(0)
    runtime.reset(context + max(sizes) + 1)
    extend_context(runtime, context, generator)

    def timed(tokens, read: int | None) -> float:
        def step() -> None:
            if read is None:
                runtime(tokens)
            else:
                logits = runtime(tokens, lazy_logits=True)
                for position in range(read):
                    logits.row(0, position)

        elapsed = _elapsed_ms(step)
        runtime.rollback(context)
        return elapsed

    first, further, full = [], [], {size: [] for size in sizes}
    for size in sizes:
        tokens = torch.randint(0, runtime.vocab_size, (1, size), generator=generator)
        for round_ in range(repeats + 1):  # round 0 warms up
            layers, one, two, every = (timed(tokens, read) for read in (0, 1, 2, None))
            if round_:
                first.append(one - layers)
                further.append(two - one)
                full[size].append(every - layers)
    positive = lambda values: max(statistics.median(values), 1e-3)  # noqa: E731 (a difference of noisy times)
    passes = [positive(first)]
    for size in sizes:  # more rows never cost less: a dip is noise
        passes.append(max(positive(full[size]), passes[-1]))
    return {"head_ms": passes[0], "head_next_ms": positive(further), "head_sizes": [1, *sizes], "head_full_ms": passes}


def measure_batches(runtime, rows=BATCH_ROWS, widths=BATCH_WIDTHS, context: int = BATCH_CONTEXT, repeats: int = 3,
                    progress: bool = True) -> list[list[float]]:
    """Median ms of ``forward_rows`` for each (rows, width), every row at ``context``
    cached tokens, in interleaved shuffled rounds (as measure_target). The cache's contents
    do not change the time, so it is not filled. Leaves the runtime's cache reset."""
    generator = torch.Generator().manual_seed(2)
    order = random.Random(1)
    runtime.reset(context + max(widths) + 1, batch=max(rows))
    cells = [(r, w) for r in rows for w in widths]
    inputs = {cell: torch.randint(0, runtime.vocab_size, cell, generator=generator) for cell in cells}
    times: dict[tuple, list[float]] = {cell: [] for cell in cells}
    for round_ in tqdm(range(repeats + 1), desc="profile batches", unit="round", disable=not progress):
        order.shuffle(cells)
        for r, w in cells:
            elapsed = _elapsed_ms(lambda: runtime.forward_rows(inputs[(r, w)], list(range(r)), [context] * r))
            if round_:  # round 0 warms up every shape
                times[(r, w)].append(elapsed)
    return [[statistics.median(times[(r, w)]) for w in widths] for r in rows]


def with_batches(profile: CostProfile, model_key: str, runtime, progress: bool = True) -> CostProfile:
    """The profile with its batch table, measured (once, then cached) if it lacks one."""
    if profile.batch_ms or not hasattr(runtime, "forward_rows"):
        return profile
    with cache_lock(profile_path(model_key, profile.dtype)):
        saved = load_profile(model_key, profile.dtype)  # another process may have measured it meanwhile
        if saved is not None and saved.batch_ms and saved.step_ms == profile.step_ms:
            profile.batch_ms, profile.batch_rows = saved.batch_ms, saved.batch_rows
            profile.batch_widths, profile.batch_context = saved.batch_widths, saved.batch_context
            return profile
        context = max(min(BATCH_CONTEXT, runtime.max_positions - max(BATCH_WIDTHS) - 1), 0)
        profile.batch_ms = measure_batches(runtime, context=context, progress=progress)
        profile.batch_rows, profile.batch_widths, profile.batch_context = list(BATCH_ROWS), list(BATCH_WIDTHS), context
        save_profile(_merged(profile, saved), model_key)
    return profile


def bandwidth_probe(megabytes: int = 256, device: torch.device | str = "cpu"):
    """A function that reads a buffer far larger than the caches once and returns the
    memory read bandwidth of ``device`` (the target's: its weights are read there) in
    GB/s, with torch's threads on the CPU (the kernels use the same)."""
    buffer = torch.ones(megabytes * 2**20 // 4, device=device)
    buffer.sum()
    return lambda: buffer.numel() * 4 / (_elapsed_ms(buffer.sum) / 1e3) / 1e9


def measure_bandwidth(megabytes: int = 256, repeats: int = 7, device: torch.device | str = "cpu") -> float:
    """Memory read bandwidth in GB/s of ``device``, median of ``repeats`` reads."""
    probe = bandwidth_probe(megabytes, device)
    return statistics.median(probe() for _ in range(repeats))


def step_bytes(runtime) -> tuple[int, int]:
    """(weight bytes, KV bytes per cached token) that one single-token step reads."""
    weights = getattr(runtime, "weights", None)
    if weights is None or not hasattr(weights, "layers"):
        return 0, 0
    layers = list(weights.layers)[: getattr(runtime, "num_layers", len(weights.layers))]
    total = sum(getattr(layer, name).nbytes for layer in layers for name in ("qkv", "o", "gate_up", "down"))
    total += weights.lm_head.nbytes
    cfg = weights.cfg
    kv = 2 * len(layers) * cfg.num_kv_heads * cfg.head_dim * torch.empty(0, dtype=runtime.dtype).element_size()
    return total, kv


def measure_drafter(proposer, context: int, vocab_size: int, repeats: int = 5, k: int = 4) -> float:
    """Milliseconds per draft token: ``propose(k)`` on a random context, divided by k.

    The proposer's cache is re-synced each time to the same sequence, so each call runs
    one sync forward plus k-1 draft forwards (k model calls), as in a decoding step. A
    head drafter (one with ``capture``) is first shown random target features for the
    context, then each call observes one committed token and drafts k: also k passes.
    """
    from ..config import SamplingParams

    generator = torch.Generator().manual_seed(1)
    # ids the drafter reads too: a draft model may have fewer rows than the target (Qwen2.5's
    # small models), and a context holding an id past them drafts nothing (found in review)
    own = getattr(getattr(proposer, "runtime", None), "vocab_size", vocab_size)
    tokens = torch.randint(0, min(vocab_size, own), (context,), generator=generator).tolist()
    proposer.start(tokens, context + k + 2)
    params = SamplingParams()
    width = getattr(proposer, "feature_width", 0)
    features = torch.randn(context - 1, width, generator=generator) if width else None
    if width:
        proposer.observe(0, features, tokens)
    k = min(k, getattr(proposer, "max_drafts", k))  # Medusa heads draft one token each at most
    made = proposer.propose(tokens, k, params, None).num_tokens  # prefill its cache once
    # a model drafter that drafted nothing was timed as one draft's cost, c about 0 (found in
    # review); a lookup drafter finds nothing in random tokens, and its cost is the lookup timed
    if made == 0 and (width or getattr(proposer, "runtime", None) is not None):
        raise SpecDecodeError(f"the drafter drafted nothing at a context of {context} tokens; its cost cannot be "
                              "measured there")

    def draft():
        if width:
            proposer.observe(context - 2, features[-1:], tokens)
        proposer.propose(tokens, k, params, None)

    return _median_ms(draft, repeats) / max(made, 1)


def record_acceptance(model_key: str, dtype: str, drafter: str, rates: list[float]) -> None:
    with cache_lock(profile_path(model_key, dtype)):  # read, change and save as one step
        profile = load_profile(model_key, dtype)
        if profile is not None:
            profile.acceptance[drafter] = rates
            save_profile(profile, model_key)


def _merged(profile: CostProfile, saved: CostProfile | None) -> CostProfile:
    """``profile`` with the drafter costs and acceptances another process saved for the
    same measurement of the target meanwhile (its own figures win)."""
    if saved is not None and saved.step_ms == profile.step_ms:
        profile.drafters = {**saved.drafters, **profile.drafters}
        profile.acceptance = {**saved.acceptance, **profile.acceptance}
    return profile


def get_profile(model_key: str, dtype: str, runtime, drafters: dict | None = None,
                force: bool = False, progress: bool = True) -> CostProfile:
    """The cached profile for (model, dtype, machine, threads), measured if missing or
    ``force``; drafters it lacks are measured and added. ``drafters``: name -> proposer."""
    # one process measures at a time (Ray replicas on one host start together): the others
    # wait, then read what it saved instead of measuring beside it
    with cache_lock(profile_path(model_key, dtype)):
        return _get_profile(model_key, dtype, runtime, drafters, force, progress)


def _get_profile(model_key: str, dtype: str, runtime, drafters: dict | None, force: bool,
                 progress: bool) -> CostProfile:
    profile = None if force else load_profile(model_key, dtype)
    changed = False
    if profile is None:
        # the bandwidth is read between the step rounds, not after them: this machine's
        # bandwidth moved between 26 and 52 GB/s within an hour, and a limit read minutes
        # away from the steps put the same 3.7 ms step at 1.3x or at 1.9x of it
        device = getattr(runtime, "device", "cpu")
        probe, samples = bandwidth_probe(device=device), []
        contexts, sizes, table = measure_target(runtime, progress=progress,
                                                between_rounds=lambda: samples.append(probe()))
        probe = None  # its buffer (256 MB)
        weight_bytes, kv_bytes = step_bytes(runtime)
        describe = getattr(runtime, "describe", None)
        graphs = getattr(runtime, "graphs", None)
        bandwidth = statistics.median(samples) if samples else measure_bandwidth(device=device)
        profile = CostProfile(model_key, dtype, machine_id(), torch.get_num_threads(), contexts, sizes, table,
                              bandwidth_gbs=bandwidth, weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes,
                              runtime=describe() if describe else "", **measure_head(runtime),
                              graph_attention=graphs.attention_by_size() if graphs is not None else {},
                              measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        changed = True
    for name, proposer in (drafters or {}).items():
        if name in profile.drafters and not force:
            continue
        # a context the drafter can draft at too: a draft model's own may be shorter than the
        # target's (found in review: timed at 1,500 tokens, a 256-position draft drafted nothing)
        own = getattr(getattr(proposer, "runtime", None), "max_positions", runtime.max_positions)
        context = min(profile.contexts[len(profile.contexts) // 2], runtime.max_positions // 2, own // 2)
        per_token = measure_drafter(proposer, context, runtime.vocab_size)
        profile.drafters[name] = per_token / profile.time_ms(1, context)  # a step at the context it drafted at
        changed = True
    if changed:
        save_profile(profile, model_key)
    return profile
