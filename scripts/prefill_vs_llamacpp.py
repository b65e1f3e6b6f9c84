"""Prefill tokens/s on long prompts: specdecode's runtime (default settings) against llama.cpp
on the same GGUF, same token ids, same threads. Interleaved, best of 3. Needs `make peers`.

    .venv/bin/python scripts/prefill_vs_llamacpp.py [1000,2000,4000]
"""
import json
import sys
import time

import torch

from specdecode.factory import load_model
from specdecode.bench.peers import LlamaCppPeer

model = load_model("default", torch.bfloat16)
runtime = model.runtime
peer = LlamaCppPeer(model.source.gguf, 8192, model.eos_token_ids)
generator = torch.Generator().manual_seed(0)
rows = []
for length in [int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "1000,2000,4000").split(",")]:
    ids = torch.randint(100, 49000, (1, length), generator=generator)
    ours, theirs = [], []
    for _ in range(3):
        runtime.reset(length + 1)
        started = time.perf_counter()
        runtime(ids, last_only=True)
        ours.append(time.perf_counter() - started)
        peer.llm.reset()
        started = time.perf_counter()
        peer.llm.eval(ids[0].tolist())
        theirs.append(time.perf_counter() - started)
    row = {"prompt_tokens": length, "specdecode_tok_s": length / min(ours), "llamacpp_tok_s": length / min(theirs)}
    rows.append(row)
    print(f"{length:5d} tokens: specdecode {row['specdecode_tok_s']:6.1f} tok/s, llama.cpp {row['llamacpp_tok_s']:6.1f} tok/s, "
          f"ratio {row['specdecode_tok_s'] / row['llamacpp_tok_s']:.2f}", flush=True)
print(json.dumps({"runtime": runtime.describe(), "rows": rows}, indent=1))
