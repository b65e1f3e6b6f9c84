"""A/B cost of each linear layer alone, for two (or more) versions of the CPU kernels.

Builds each given kernel source, loads the real model once, and calls `sd_linear_forward`
for one layer's qkv, o, gate/up and down and for the output head, at each row count,
alternating the libraries round by round; prints per (rows, layer) the minimum and the
median of the round minima, in µs. The weights are those of one layer, so after the first
call they come from the caches (on our Zen 1 the int4 layers cost the same from memory):

    git show HEAD~1:specdecode/kernels/cpu.cpp > /tmp/before.cpp
    LINEAR_ROWS=1,2,4 .venv/bin/python scripts/linear_ab.py before=/tmp/before.cpp after=specdecode/kernels/cpu.cpp
"""
import ctypes
import os
import statistics
import sys
import time

import torch

from step_ab import build_libraries, load_for

ROWS = tuple(int(value) for value in os.environ.get("LINEAR_ROWS", "1,2,4,8").split(","))
THREADS, ROUNDS, CALLS = int(os.environ.get("LINEAR_THREADS", "2")), 7, 30

libraries = build_libraries(sys.argv[1:], ("sd_linear_forward",))
runtime = load_for(libraries)
runtime.reset(64)  # allocates the scratch buffers
stack = runtime.kernels
layer = stack.layers[runtime.num_layers // 2]
linears = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "head": stack.head}
scratch = [stack.buffers[name].data_ptr() for name in ("xq", "xd", "xs")]
generator = torch.Generator().manual_seed(0)
for rows in ROWS:
    for name, entry in linears.items():
        x, out = torch.randn(rows, entry.cols, generator=generator), torch.empty(rows, entry.rows)
        minima: dict[str, list[float]] = {label: [] for label in libraries}
        for _ in range(ROUNDS):
            for label, library in libraries.items():
                times = []
                for _ in range(CALLS):
                    started = time.perf_counter()
                    library.sd_linear_forward(ctypes.byref(entry), x.data_ptr(), rows, out.data_ptr(), *scratch, THREADS)
                    times.append(time.perf_counter() - started)
                minima[label].append(min(times) * 1e6)
        print(f"rows {rows:>2} {name:8s} " + "  ".join(
            f"{label} {min(values):8.1f} µs (median {statistics.median(values):8.1f})" for label, values in minima.items()),
            flush=True)
