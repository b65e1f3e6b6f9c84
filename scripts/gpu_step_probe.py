"""Where a recorded (CUDA graph) step's time goes on a GPU, T = 1 against T > 1: the
kernels of a few replays under torch.profiler, and which scaled-dot-product-attention
backends take the step's attention shapes. A throwaway probe for a lent GPU (see
scripts/gpu_lease.sh); prints tables only.

    python scripts/gpu_step_probe.py [--context 100] [--capacity 4065]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdecode.factory import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--capacity", type=int, default=4065)
    args = parser.parse_args()
    runtime = load_model("default", torch.bfloat16, device="cuda").runtime
    cfg = runtime.cfg
    runtime.reset(args.capacity)
    generator = torch.Generator().manual_seed(0)
    runtime(torch.randint(0, cfg.vocab_size, (1, args.context), generator=generator))
    for size in (1, 2, 8):
        tokens = torch.randint(0, cfg.vocab_size, (1, size), generator=generator)
        for _ in range(3):  # eager, recorded, replayed
            runtime(tokens)
            runtime.rollback(args.context)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            runtime(tokens)
            runtime.rollback(args.context)
        torch.cuda.synchronize()
        print(f"T={size}: {(time.perf_counter() - started) / 20 * 1e3:.2f} ms a step "
              f"({runtime.graphs.replays if runtime.graphs else 0} replays so far)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runtime(tokens)
                runtime.rollback(args.context)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))
    heads, kv, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for size in (1, 2, 8):
        q = torch.randn(1, heads, size, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv, args.capacity, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(size, args.capacity, dtype=torch.bool, device="cuda")
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH):
            try:
                with sdpa_kernel(backend):
                    for _ in range(3):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    for _ in range(50):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    torch.cuda.synchronize()
                print(f"sdpa T={size} {backend.name}: {(time.perf_counter() - started) / 50 * 1e6:.0f} us eager")
            except RuntimeError as error:
                print(f"sdpa T={size} {backend.name}: refused ({str(error).splitlines()[0][:120]})")


if __name__ == "__main__":
    main()
