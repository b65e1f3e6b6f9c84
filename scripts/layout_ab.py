"""A/B of the int4 layers' two layouts, in one process, with one kernel library: the real
model loaded twice, once with its Q4_1 layers paired (Q4_1X16, where the library has the
512-bit VNNI tiles for them) and once in 8-row groups (Q4_1X8, the library told it has no
pair tiles). Checks that both give the same logits, then times whole steps per (context,
T), the two runtimes taking turns round by round, and prints the minimum and the median of
the round minima:

    AB_CONTEXTS=100,300,600 AB_SIZES=1,2,3,4,6,8 .venv/bin/python scripts/layout_ab.py
"""
import statistics

import torch

from step_ab import CONTEXTS, SIZES, WithoutPairs, fastest_step_ms
from specdecode import kernels
from specdecode.models.llama import load_native
from specdecode.models.loading import resolve_model

ROUNDS = int(__import__("os").environ.get("AB_ROUNDS", "8"))


def main() -> None:
    path = resolve_model("default").path
    library = kernels.load()
    if not library.sd_pairs16():
        raise SystemExit("this machine's kernels have no 512-bit VNNI pair tiles: nothing to compare")
    paired = load_native(path, torch.bfloat16, weights="q4_1", backend="kernels")
    loader = kernels.load
    kernels.load = lambda: WithoutPairs(library)
    try:
        grouped = load_native(path, torch.bfloat16, weights="q4_1", backend="kernels")
    finally:
        kernels.load = loader
    grouped.kernels.lib = library
    runtimes = {"x8": grouped, "x16": paired}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, grouped.vocab_size, (1, max(CONTEXTS)), generator=generator)
    for runtime in runtimes.values():
        runtime.reset(max(CONTEXTS) + max(SIZES) + 1)
    for context in CONTEXTS:
        for runtime in runtimes.values():
            runtime.rollback(0)
            runtime(prompt[:, :context], last_only=True)
        probe = torch.randint(0, grouped.vocab_size, (1, 4), generator=generator)
        logits = []
        for runtime in runtimes.values():
            logits.append(runtime(probe))
            runtime.rollback(context)
        if not torch.equal(*logits):
            raise SystemExit(f"the two layouts' logits differ at {context} tokens of context")
        for size in SIZES:
            ids = torch.randint(0, grouped.vocab_size, (1, size), generator=generator)
            minima: dict[str, list[float]] = {name: [] for name in runtimes}
            for _ in range(ROUNDS):
                for name, runtime in runtimes.items():
                    minima[name].append(fastest_step_ms(runtime, ids, context, 10 if size == 1 else 6))
            medians = {name: statistics.median(values) for name, values in minima.items()}
            print(f"context {context:5d} T {size:2d}: " + "  ".join(
                f"{name} {min(values):6.2f} ms (median {medians[name]:6.2f})" for name, values in minima.items())
                + f"  x16/x8 {medians['x16'] / medians['x8']:.3f}", flush=True)


if __name__ == "__main__":
    main()
