"""Offline: how fast could suffix lookup's drafts run here with the best choice of k?
Replays the suite's plain greedy outputs (teacher forcing, no timing of its own): at every
position, the drafter's label (what the draft rests on) and how many of its 8 drafts the
target would accept. Each step is then priced by the cached cost profile: v(k) at the
position's context plus ``--draft-ms`` (drafting and choosing k in Python, per drafted
step) over the profile's single step. Prints the decode-only speedup over plain (prefill
left out) for
- a fixed k, 1..8;
- the best k per label, chosen on these same outputs (a ceiling for a policy that keeps
  acceptance per label, as ``--k auto`` does; not a setting to ship);
- an oracle that drafts exactly the tokens that will be accepted (nothing where none is).
Used for docs/adaptive.md ("How far the k policy is from its ceiling").

    .venv/bin/python scripts/suffix_k_ceiling.py [--limit N] [--outputs FILE] [--draft-ms MS]
"""

import argparse
from collections import Counter

from specdecode.config import EngineConfig, SamplingParams
from specdecode.factory import cost_profile, load_store, load_target
from specdecode.proposers.suffix import SuffixProposer

from plain_outputs import plain_outputs  # scripts/plain_outputs.py

K_MAX = 8
parser = argparse.ArgumentParser()
parser.add_argument("--limit", type=int, default=None, help="suite prompts per category (default: all)")
parser.add_argument("--outputs", default=None, help="cache of the plain outputs (JSON), made if missing")
parser.add_argument("--draft-ms", type=float, default=0.3,
                    help="Python time a drafted step adds over a plain one, ms (0.29 measured in-process on the Zen 4)")
args = parser.parse_args()

config = EngineConfig()
target = load_target(config)
proposer = SuffixProposer(load_store(None, target))
profile = cost_profile(target, config.dtype)
records = plain_outputs(config, target, args.limit, args.outputs)

# per output, per position: (label, accepted of K_MAX drafts, drafts offered, context)
positions = []
for record in records:
    sequence, start = record["prompt_ids"] + record["output"], len(record["prompt_ids"])
    proposer.start(sequence[:start], len(sequence) + K_MAX)
    rows = []
    for i in range(len(record["output"])):
        tokens = sequence[:start + i]
        label = proposer.draft_label(tokens)
        drafts = proposer.propose(tokens, K_MAX, SamplingParams(), None).draft_ids.tolist()
        accepted = 0
        while accepted < len(drafts) and start + i + accepted < len(sequence) and drafts[accepted] == sequence[start + i + accepted]:
            accepted += 1
        rows.append((str(label), accepted, len(drafts), start + i))
    positions.append(rows)

costs: dict = {}


def step_cost(k: int, context: int) -> float:
    """A step scoring k drafts, in plain steps at its context (64-token buckets)."""
    bucket = context // 64 * 64 + 32
    if (k, bucket) not in costs:
        costs[k, bucket] = profile.v(k, bucket) + (args.draft_ms / profile.time_ms(1, bucket) if k else 0.0)
    return costs[k, bucket]


def speedup(choose) -> tuple[float, float]:
    """(decode-only speedup over plain, tokens per step) when ``choose(label, accepted)``
    gives each step's k."""
    tokens = time = steps = 0.0
    for rows in positions:
        i = 0
        while i < len(rows):
            label, accepted, offered, context = rows[i]
            k = max(min(choose(label, accepted), offered, len(rows) - i - 1), 0)
            moved = min(accepted, k) + 1
            tokens, time, steps, i = tokens + moved, time + step_cost(k, context), steps + 1, i + moved
    return tokens / time, tokens / steps


print(f"{len(records)} outputs, {sum(map(len, positions))} positions; drafted steps cost v(k) + {args.draft_ms} ms")
print("labels:", dict(Counter(label for rows in positions for label, *_ in rows).most_common()))
for k in range(1, K_MAX + 1):
    rate, tau = speedup(lambda label, accepted, k=k: k)
    print(f"fixed k = {k}: {rate:.3f}x (tau {tau:.2f})")
labels = sorted({label for rows in positions for label, *_ in rows})
best = dict.fromkeys(labels, 2)
for _ in range(2):  # coordinate ascent, one label at a time
    for label in labels:
        best[label] = max(range(K_MAX + 1), key=lambda k: speedup(
            lambda lab, accepted: k if lab == label else best[lab])[0])
rate, tau = speedup(lambda label, accepted: best[label])
print(f"best k per label (in-sample): {rate:.3f}x (tau {tau:.2f})  {best}")
rate, tau = speedup(lambda label, accepted: accepted)
print(f"oracle (k = what will be accepted): {rate:.3f}x (tau {tau:.2f})")
