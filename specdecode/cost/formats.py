"""``--weights auto``: which weight format decodes fastest on this machine, measured once.

Each candidate format is loaded and timed on single-token steps (plain decoding's step)
at 256 tokens of context, the candidates taking turns; the fastest wins. The timings are cached per model, dtype,
machine and thread count in ``<cache>/formats/``, so later loads read the answer.
Machines differ (docs/performance.md): with AMX, bf16 matrix products are nearly free;
on an AVX2-only CPU the 4-bit kernels read a quarter of the bytes and win.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from typing import Callable

import torch

from ..config import SpecDecodeError
from ..kernels import build_digest
from ..models.loading import cache_dir, save_cache
from .profile import extend_context, machine_id, timed_forward_ms

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


def step_ms(runtimes: dict, context: int = CONTEXT, rounds: int = 6, steps: int = 3) -> dict[str, float]:
    """Median milliseconds of a single-token forward after ``context`` random tokens, for
    each runtime; the runtimes take turns (``rounds`` of ``steps`` each), so a slow spell
    of the machine does not fall on one candidate."""
    generator = torch.Generator().manual_seed(0)
    # a model whose context is shorter than CONTEXT is timed at what it holds (it was refused
    # with "257 tokens exceed the KV cache capacity 256" before it could decode anything)
    context = min(context, *(runtime.max_positions - 2 for runtime in runtimes.values()))
    tokens = {name: _prepare(runtime, context, generator) for name, runtime in runtimes.items()}
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    for round_ in range(rounds + 1):  # round 0 warms every runtime up
        for name, runtime in runtimes.items():
            for _ in range(steps):
                elapsed = timed_forward_ms(runtime, tokens[name], context)
                if round_:
                    times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def fastest_weights(model_key: str, dtype: torch.dtype, candidates: list[str], load: Callable[[str], object]) -> str:
    """The candidate format with the fastest single-token step (measured once, cached)."""
    path = _path(model_key, dtype, candidates)
    if path.is_file():
        try:
            timings = json.loads(path.read_text())["step_ms"]
            return min(timings, key=timings.get)
        except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, not UTF-8, the wrong shape
            pass  # a corrupt record is measured again
    print(f"specdecode: measuring which weight format decodes fastest here ({', '.join(candidates)}; once, cached)",
          file=sys.stderr, flush=True)
    models = {}
    for fmt in candidates:  # a format this file cannot take is left out, not the end of the run
        try:
            models[fmt] = load(fmt)
        except SpecDecodeError as error:  # e.g. a GGUF mixing block types in one fused projection
            print(f"specdecode: {fmt} left out: {error}", file=sys.stderr, flush=True)
    if not models:
        raise SpecDecodeError(f"none of the weight formats {candidates} loads this model")
    timings = step_ms(models)
    best = min(timings, key=timings.get)
    summary = ", ".join(f"{fmt} {ms:.1f} ms" for fmt, ms in timings.items())
    print(f"specdecode: single-token step {summary} -> {best}", file=sys.stderr, flush=True)
    save_cache(path, json.dumps({"machine": machine_id(), "threads": torch.get_num_threads(), "context": CONTEXT,
                                 "step_ms": timings, "chosen": best}, indent=1), "the weight format choice")
    return best
