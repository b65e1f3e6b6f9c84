"""How a step's cost moves while a process runs: the default target's T-token passes,
alternated, over one-second windows (median per window and size, and v(T) against T = 1).

    python scripts/step_phases.py [--seconds 45] [--context 200] [--sizes 1,2,4]

On the shared Zen 4 of docs/performance.md ("two states of one machine") the windows fall
into two groups a few seconds long: one where T = 1 is the slower and scoring 4 tokens
costs about 1.2 single steps, and one where T = 1 is faster and 4 tokens cost about 1.65. The k
policies learn v from the steps for that reason (``StepTimes``, docs/adaptive.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.config import EngineConfig
from specdecode.factory import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache before each pass")
    parser.add_argument("--sizes", default="1,2,4", help="comma list of tokens per pass (1 first: v is against it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the windows as JSON")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if sizes[0] != 1:
        parser.error("--sizes must start with 1")
    torch.set_num_threads(args.threads)
    runtime = load_target(EngineConfig(model="default")).runtime
    runtime.reset(args.context + max(sizes) + 1)
    generator = torch.Generator().manual_seed(0)
    runtime(torch.randint(100, 40000, (1, args.context), generator=generator))
    base = runtime.length

    def timed(tokens: int) -> float:
        ids = torch.randint(100, 40000, (1, tokens), generator=generator)
        began = time.perf_counter()
        runtime(ids)
        took = time.perf_counter() - began
        runtime.rollback(base)
        return took * 1e3

    windows, end = [], time.time() + args.seconds
    while time.time() < end:
        times: dict[int, list[float]] = {size: [] for size in sizes}
        stop = time.perf_counter() + 1.0
        while time.perf_counter() < stop:
            for size in sizes:
                times[size].append(timed(size))
        medians = {size: statistics.median(values) for size, values in times.items()}
        windows.append(medians)
        print("  ".join(f"T{size} {ms:5.2f} ms" + (f" v {ms / medians[1]:.2f}" if size > 1 else "")
                        for size, ms in medians.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"context": args.context, "threads": args.threads, "windows": windows}, f, indent=1)


if __name__ == "__main__":
    main()
