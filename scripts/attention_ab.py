"""A/B of the attention kernel alone, in one process: builds each given kernel source (as
scripts/step_ab.py does), fills the real model's KV cache to each context, then times
``sd_attention`` over all 30 layers per (context, T), the builds taking turns round by
round. "cold": layer after layer, as a step reads them (the cache far larger than L3 at
long contexts); "warm": layer 0 thirty times (its keys and values stay in L2/L3). Prints
the minimum over rounds:

    git show HEAD~1:specdecode/kernels/cpu.cpp > /tmp/before.cpp
    .venv/bin/python scripts/attention_ab.py before=/tmp/before.cpp after=specdecode/kernels/cpu.cpp
"""
import ctypes
import sys
import time

import numpy as np
import torch

from step_ab import CONTEXTS, SIZES, build_libraries
from specdecode.cost.profile import extend_context
from specdecode.models.llama import load_native
from specdecode.models.loading import resolve_model

ROUNDS, REPEATS = 7, 20


def main() -> None:
    libraries = build_libraries(sys.argv[1:], functions=("sd_attention",))
    runtime = load_native(resolve_model("default").path, torch.bfloat16, weights="q4_1", backend="kernels")
    runtime.reset(max(CONTEXTS) + 100)
    model, layers = runtime.kernels.model, runtime.num_layers
    generator = torch.Generator().manual_seed(0)
    cfg = runtime.cfg
    qkv = torch.randn(max(SIZES), (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, generator=generator)
    out = torch.empty(max(SIZES), cfg.num_heads * cfg.head_dim)
    rows = np.zeros(1, np.int32)
    for context in CONTEXTS:
        extend_context(runtime, context, generator)
        starts = np.array([context], np.int32)
        kv_mb = layers * 2 * cfg.num_kv_heads * cfg.head_dim * context * 2 / 1e6
        for size in SIZES:
            best: dict[tuple[str, str], float] = {}
            for _ in range(ROUNDS):
                for name, library in libraries.items():
                    for mode in ("cold", "warm"):
                        begin = time.perf_counter()
                        for _ in range(REPEATS):
                            for layer in range(layers):
                                library.sd_attention(ctypes.byref(model), layer if mode == "cold" else 0, qkv.data_ptr(),
                                                     1, size, starts.ctypes.data, rows.ctypes.data, None, out.data_ptr())
                        elapsed = (time.perf_counter() - begin) / REPEATS * 1e3
                        best[name, mode] = min(best.get((name, mode), elapsed), elapsed)
            print(f"context {context:5d} T {size}: " + "  ".join(
                f"{name} cold {best[name, 'cold']:6.3f} ms ({kv_mb / best[name, 'cold']:4.1f} GB/s) "
                f"warm {best[name, 'warm']:6.3f}" for name in libraries), flush=True)


if __name__ == "__main__":
    main()
