"""What speculation costs the server's batched engine when the shared cap keeps it plain:
8 requests decoded together in-process (the server's engine, drafters and cost profile;
no HTTP), alternating rounds of plain, speculation (suffix, k auto, the batch cap) and
speculation without skipping the capped rows' k choice (recheck_every out of reach).
Used for docs/serving.md; prints tok/s per round and each round's ratio to plain.

    .venv/bin/python scripts/batch_spec_overhead.py [rounds]
"""
import statistics
import sys
import time

import torch

from specdecode.config import EngineConfig, SamplingParams
from specdecode.prompts import load_prompts
from specdecode.serve.server import build_state

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
torch.set_num_threads(2)
state = build_state(EngineConfig(num_threads=2), None, max_num_seqs=8)
engine, tokenizer = state.engine, state.tokenizer
make_proposer, make_policy, _ = state.speculation.drafters["suffix"]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                       tokenize=False) for p in load_prompts(None, limit=1)]
prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts][:8]
params = SamplingParams(max_new_tokens=96, ignore_eos=True)


def tokens_per_second(speculate: bool) -> float:
    sequences = [engine.add(p, params, speculate=speculate, proposer=make_proposer() if speculate else None,
                            policy=make_policy(None) if speculate else None) for p in prompts]
    started = time.perf_counter()
    engine.run()
    return sum(len(s.generated) for s in sequences) / (time.perf_counter() - started)


results = {"plain": [], "spec": [], "spec, no skipping": []}
for _ in range(rounds):
    for mode in results:
        engine.recheck_every = 10**9 if mode == "spec, no skipping" else 8
        results[mode].append(tokens_per_second(mode != "plain"))
for mode, values in results.items():
    ratios = [a / b for a, b in zip(values, results["plain"])]
    print(f"{mode:18s} tok/s {' '.join(f'{v:6.1f}' for v in values)}   vs plain {' '.join(f'{r:.3f}' for r in ratios)}"
          f"   median {statistics.median(ratios):.3f}")
