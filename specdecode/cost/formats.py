"""``--weights auto``: which weight format decodes fastest on this machine, measured once.

Each candidate format is loaded and timed on single-token steps (plain decoding's step)
at 256 tokens of context, the candidates taking turns; the fastest wins. The timings are cached per model, dtype,
machine and thread count in ``<cache>/formats/``, so later loads read the answer.
Machines differ (docs/performance.md): with AMX, bf16 matrix products are nearly free;
on an AVX2-only CPU the 4-bit kernels read a quarter of the bytes and win.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import statistics
import sys
from typing import Callable

import torch

from ..config import SpecDecodeError
from ..kernels import build_digest
from ..models.loading import cache_dir, save_cache
from .profile import extend_context, machine_id, proc_field_bytes, timed_forward_ms

CONTEXT = 256
VERSION = 1


def _path(model_key: str, dtype: torch.dtype, candidates: list[str]):
    key = (f"{model_key}|{dtype}|{machine_id()}|{torch.get_num_threads()}|{','.join(candidates)}|{VERSION}"
           f"|kernels {build_digest()}")
    return cache_dir() / "formats" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _prepare(runtime, context: int, generator: torch.Generator) -> torch.Tensor:
    runtime.reset(context + 2)
    extend_context(runtime, context, generator)
    return torch.randint(0, runtime.vocab_size, (1, 1), generator=generator)


def timing_context(runtimes: dict, context: int = CONTEXT) -> int:
    """The context ``step_ms`` times these runtimes at: a model whose context is shorter than
    ``context`` is timed at what it holds (it was refused with "257 tokens exceed the KV
    cache capacity 256" before it could decode anything)."""
    return min(context, *(getattr(runtime, "max_positions", context + 2) - 2 for runtime in runtimes.values()))


def step_ms(runtimes: dict, context: int = CONTEXT, rounds: int = 6, steps: int = 3) -> dict[str, float]:
    """Median milliseconds of a single-token forward after ``context`` random tokens, for
    each runtime; the runtimes take turns (``rounds`` of ``steps`` each), so a slow spell
    of the machine does not fall on one candidate."""
    generator = torch.Generator().manual_seed(0)
    context = timing_context(runtimes, context)
    tokens = {name: _prepare(runtime, context, generator) for name, runtime in runtimes.items()}
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    for round_ in range(rounds + 1):  # round 0 warms every runtime up
        for name, runtime in runtimes.items():
            for _ in range(steps):
                elapsed = timed_forward_ms(runtime, tokens[name], context)
                if round_:
                    times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


FORMAT_BYTES = {"q4_1": 20 / 32, "q8_0": 34 / 32, "bf16": 2.0, "fp32": 4.0}  # per weight, block scales included


def _weight_bytes(runtime) -> int:
    weights = getattr(runtime, "weights", None)
    if weights is None:
        return 0
    if not hasattr(weights, "parameters"):
        return 0
    return sum(t.numel() * t.element_size() for t in itertools.chain(weights.parameters(), weights.buffers()))


def _available_bytes() -> float:
    available = proc_field_bytes("/proc/meminfo", "MemAvailable")
    return available if available is not None else float("inf")


def _fits_beside(models: dict, candidates: list[str]) -> bool:
    """Whether every candidate not loaded yet fits in memory beside those loaded (their
    sizes scaled from a loaded one's by bytes per weight), with half the memory to spare."""
    fmt, runtime = next(iter(models.items()))
    per_weight = _weight_bytes(runtime) / FORMAT_BYTES.get(fmt, 2.0)
    rest = sum(per_weight * FORMAT_BYTES.get(other, 2.0) for other in candidates if other not in models)
    return rest <= 0.5 * _available_bytes()


def fastest_weights(model_key: str, dtype: torch.dtype, candidates: list[str], load: Callable[[str], object]) -> str:
    """The candidate format with the fastest single-token step (measured once, cached)."""
    path = _path(model_key, dtype, candidates)
    if path.is_file():
        try:
            timings = json.loads(path.read_text())["step_ms"]
            # only a choice among this run's candidates, each timed: a record naming another
            # format was trusted for good (found in review: an unknown name failed every run,
            # a known one outside the candidates would have cut an 8-bit model to 4 bits)
            if (isinstance(timings, dict) and timings and set(timings) <= set(candidates)
                    and all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in timings.values())):
                return min(timings, key=timings.get)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # not JSON, not UTF-8, the wrong shape
            pass  # a corrupt record is measured again
    print(f"specdecode: measuring which weight format decodes fastest here ({', '.join(candidates)}; once, cached)",
          file=sys.stderr, flush=True)
    models, timings, together, refusals = {}, {}, True, {}
    contexts = []  # what each group was timed at, for the record

    def time_loaded():
        contexts.append(timing_context(models))
        timings.update(step_ms(models))
        models.clear()

    for fmt in candidates:  # a format this file cannot take is left out, not the end of the run
        if models and together and not _fits_beside(models, candidates):
            # a large model: every candidate at once would not fit in memory (a 7B in bf16,
            # int8 and int4 is 25 GB): those loaded are timed now, the rest one at a time
            together = False
            time_loaded()
        try:
            models[fmt] = load(fmt)
        except SpecDecodeError as error:  # e.g. a GGUF mixing block types in one fused projection
            print(f"specdecode: {fmt} left out: {error}", file=sys.stderr, flush=True)
            refusals[fmt] = error
            continue
        if not together:
            time_loaded()
    if models:
        time_loaded()
    if not timings:
        reasons = {str(error) for error in refusals.values()}
        if len(reasons) == 1:  # the model itself, not a format (found in review: only the stderr lines said why)
            raise next(iter(refusals.values()))
        raise SpecDecodeError(f"none of the weight formats {candidates} loads this model: "
                              + "; ".join(f"{fmt}: {error}" for fmt, error in refusals.items()))
    best = min(timings, key=timings.get)
    summary = ", ".join(f"{fmt} {ms:.1f} ms" for fmt, ms in timings.items())
    print(f"specdecode: single-token step {summary} -> {best}", file=sys.stderr, flush=True)
    save_cache(path, json.dumps({"machine": machine_id(), "threads": torch.get_num_threads(), "context": min(contexts),
                                 "step_ms": timings, "chosen": best}, indent=1), "the weight format choice")
    return best
