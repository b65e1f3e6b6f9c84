"""Step cost table of a runtime: ms to score T tokens after a context, T x context, min of
several interleaved rounds. Used for the before/after table of docs/performance.md (run
with PYTHONPATH pointing at an older checkout for 'before'):

    .venv/bin/python scripts/step_table.py '{"weights": "bf16", "backend": "kernels"}'
"""
import json
import random
import sys
import time

import torch

from specdecode.models.loading import resolve_model
from specdecode.models.llama import load_native

source = resolve_model("default")
kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
runtime = load_native(source.path, torch.bfloat16, **kwargs)
sizes, contexts = (1, 2, 4, 8, 16, 32, 64), (100, 600, 1500, 4000)
generator = torch.Generator().manual_seed(0)
runtime.reset(4100)
table = {}
for context in contexts:
    while runtime.length < context:
        runtime(torch.randint(0, 49152, (1, min(256, context - runtime.length)), generator=generator), last_only=True)
    inputs = {t: torch.randint(0, 49152, (1, t), generator=generator) for t in sizes}
    times = {t: [] for t in sizes}
    order = list(sizes)
    for round_ in range(4):
        random.Random(round_).shuffle(order)
        for t in order:
            started = time.perf_counter()
            runtime(inputs[t])
            elapsed = (time.perf_counter() - started) * 1e3
            runtime.rollback(context)
            if round_:
                times[t].append(elapsed)
    table[context] = {t: min(v) for t, v in times.items()}
    print(context, " ".join(f"{table[context][t]:8.1f}" for t in sizes), flush=True)
print(json.dumps({"kwargs": kwargs, "ms": table}))
