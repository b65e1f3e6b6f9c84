"""``--weights auto``: which weight format decodes fastest on this machine, measured once.

Each candidate format is loaded and timed on single-token steps (plain decoding's step)
at 256 tokens of context; the fastest wins. The timings are cached per model, dtype,
machine and thread count in ``<cache>/formats/``, so later loads read the answer.
Machines differ (docs/performance.md): with AMX, bf16 matrix products are nearly free;
on an AVX2-only CPU the 4-bit kernels read a quarter of the bytes and win.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from typing import Callable

import torch

from ..models.loading import cache_dir
from .profile import machine_id

CONTEXT = 256
STEPS = 12
VERSION = 1


def _path(model_key: str, dtype: torch.dtype, candidates: list[str]):
    key = f"{model_key}|{dtype}|{machine_id()}|{torch.get_num_threads()}|{','.join(candidates)}|{VERSION}"
    return cache_dir() / "formats" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def step_ms(runtime, context: int = CONTEXT, steps: int = STEPS) -> float:
    """Median milliseconds of a single-token forward after ``context`` random tokens."""
    generator = torch.Generator().manual_seed(0)
    runtime.reset(context + 2)
    runtime(torch.randint(0, runtime.vocab_size, (1, context), generator=generator), last_only=True)
    token = torch.randint(0, runtime.vocab_size, (1, 1), generator=generator)
    times = []
    for index in range(steps + 2):
        started = time.perf_counter()
        runtime(token)
        if index >= 2:  # the first steps warm caches and allocators
            times.append((time.perf_counter() - started) * 1e3)
        runtime.rollback(context)
    return statistics.median(times)


def fastest_weights(model_key: str, dtype: torch.dtype, candidates: list[str], load: Callable[[str], object]) -> str:
    """The candidate format with the fastest single-token step (measured once, cached)."""
    path = _path(model_key, dtype, candidates)
    if path.is_file():
        try:
            timings = json.loads(path.read_text())["step_ms"]
            return min(timings, key=timings.get)
        except (json.JSONDecodeError, KeyError, ValueError):
            pass  # a corrupt record is measured again
    print(f"specdecode: measuring which weight format decodes fastest here ({', '.join(candidates)}; once, cached)",
          file=sys.stderr, flush=True)
    timings = {}
    for fmt in candidates:
        runtime = load(fmt)
        timings[fmt] = step_ms(runtime)
        del runtime
    best = min(timings, key=timings.get)
    summary = ", ".join(f"{fmt} {ms:.1f} ms" for fmt, ms in timings.items())
    print(f"specdecode: single-token step {summary} -> {best}", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_id(), "threads": torch.get_num_threads(), "context": CONTEXT,
                                "step_ms": timings, "chosen": best}, indent=1))
    return best
