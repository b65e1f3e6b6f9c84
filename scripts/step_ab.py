"""A/B step cost of two (or more) versions of the CPU kernels, in one process.

Timing on our 2-core machines drifts by tens of percent between phases of a few minutes,
so separate runs of scripts/step_table.py cannot show a change of 10%. This builds each
given kernel source, loads the real model once, and alternates the libraries round by
round on the same runtime, weights and cache (the kernels' structs are the same across
the versions compared), printing per (context, T) the minimum over rounds and the median
of the round minima:

    git show 37203b4:specdecode/kernels/cpu.cpp > /tmp/before.cpp
    .venv/bin/python scripts/step_ab.py before=/tmp/before.cpp after=specdecode/kernels/cpu.cpp
"""
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdecode import kernels
from specdecode.models.llama import load_native
from specdecode.models.loading import resolve_model


def _ints(name: str, default: str) -> tuple[int, ...]:
    return tuple(int(value) for value in os.environ.get(name, default).split(","))


# AB_CONTEXTS=100,1500 AB_SIZES=1,2 narrow the table
CONTEXTS, SIZES, ROUNDS = _ints("AB_CONTEXTS", "100,600,1500,4000"), _ints("AB_SIZES", "1,2,4"), 6


def build_libraries(arguments: list[str], functions=("sd_forward_layers", "sd_linear_forward", "sd_rms_norm",
                                                     "sd_embed")) -> dict:
    """``name=source.cpp`` arguments -> {name: the library built from it for this CPU}, with
    the signatures of ``functions`` set as the installed kernels' (scripts/linear_ab.py too)."""
    reference = kernels.load()
    libraries = {}
    build_dir = Path(tempfile.mkdtemp(prefix="step_ab_"))
    for argument in arguments:
        name, source = argument.split("=", 1)
        target = build_dir / f"{name}.so"
        subprocess.run(["g++", *kernels.FLAGS, f"-march={kernels._march()}", source, "-o", str(target)], check=True)
        library = ctypes.CDLL(str(target))
        for function in functions:
            getattr(library, function).argtypes = getattr(reference, function).argtypes
        libraries[name] = library
    return libraries


class WithoutPairs:
    """A loaded library that says it has no Q4_1X16 tiles, so a model loaded under it keeps
    its int4 layers in 8-row groups (scripts/layout_ab.py)."""

    def __init__(self, library):
        self.library = library

    def __getattr__(self, name):
        return (lambda: 0) if name == "sd_pairs16" else getattr(self.library, name)


def load_for(libraries: dict):
    """The default model on the kernels backend in layouts every one of ``libraries`` reads:
    a library built before Q4_1X16 (no ``sd_pairs16``) knows only the 8-row groups, and
    would compute nonsense, without an error, from paired layers (found in review)."""
    paired = all(hasattr(library, "sd_pairs16") and library.sd_pairs16() for library in libraries.values())
    loader = kernels.load
    if not paired:
        kernels.load = lambda: WithoutPairs(loader())
    try:
        return load_native(resolve_model("default").path, torch.bfloat16, weights="q4_1", backend="kernels")
    finally:
        kernels.load = loader


def fastest_step_ms(runtime, ids: torch.Tensor, context: int, repeats: int) -> float:
    """The fastest of ``repeats`` forwards of ``ids`` after ``context`` cached tokens, in ms
    (the cache rolled back to ``context`` after each)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runtime(ids)
        times.append(time.perf_counter() - started)
        runtime.rollback(context)
    return min(times) * 1e3


def main() -> None:
    libraries = build_libraries(sys.argv[1:])
    runtime = load_for(libraries)
    runtime.reset(max(CONTEXTS) + 100)
    generator = torch.Generator().manual_seed(0)
    minima: dict[str, list[float]] = {}
    for context in CONTEXTS:
        while runtime.length < context:
            runtime(torch.randint(0, 49152, (1, min(256, context - runtime.length)), generator=generator), last_only=True)
        for size in SIZES:
            ids = torch.randint(0, 49152, (1, size), generator=generator)
            for _ in range(ROUNDS):
                for name, library in libraries.items():
                    runtime.kernels.lib = library
                    minima.setdefault(f"{context}/{size}/{name}", []).append(
                        fastest_step_ms(runtime, ids, context, 12 if size == 1 else 6))
            print(f"context {context:5d} T {size}: " + "  ".join(
                f"{name} {min(minima[f'{context}/{size}/{name}']):6.2f} ms (median {statistics.median(minima[f'{context}/{size}/{name}']):6.2f})"
                for name in libraries), flush=True)
    print(json.dumps(minima))


if __name__ == "__main__":
    main()
