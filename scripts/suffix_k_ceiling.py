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
With ``--confidence``, also the best k per label and per bucket of the target's own
probability of the last committed token (known when k is chosen: the pass that committed
it computed it), chosen on half the outputs and scored on the other half, against the
same split for labels alone.
Used for docs/adaptive.md ("How far the k policy is from its ceiling").

    .venv/bin/python scripts/suffix_k_ceiling.py [--limit N] [--outputs FILE] [--draft-ms MS] [--confidence]
"""

import argparse
from collections import Counter

import torch

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
parser.add_argument("--confidence", action="store_true",
                    help="also split the labels by the target's probability of the last committed token")
args = parser.parse_args()
BUCKETS = (0.5, 0.8, 0.95)  # the target's probability of the last committed token: below 0.5, 0.8, 0.95, above

config = EngineConfig()
target = load_target(config)
proposer = SuffixProposer(load_store(None, target))
profile = cost_profile(target, config.dtype)
records = plain_outputs(config, target, args.limit, args.outputs)



def committed_confidence(record: dict) -> list[int]:
    """Per output position i, the bucket of the target's probability of output token i - 1
    (-1 at i = 0: prefill computes the prompt's last row only)."""
    sequence, start = record["prompt_ids"] + record["output"], len(record["prompt_ids"])
    target.runtime.reset(len(sequence))
    with torch.no_grad():
        logits = target.runtime(torch.tensor([sequence[:-1]]))
    chosen = torch.softmax(logits[0, start - 1:].float(), -1).gather(-1, torch.tensor(record["output"])[:, None])
    return [-1] + [sum(p > edge for edge in BUCKETS) for p in chosen[:-1, 0].tolist()]


# per output, per position: (label, accepted of K_MAX drafts, drafts offered, context)
positions = []
for record in records:
    confidence = committed_confidence(record) if args.confidence else None
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
        rows.append((str(label) if confidence is None else (str(label), confidence[i]), accepted, len(drafts), start + i))
    positions.append(rows)

costs: dict = {}


def step_cost(k: int, context: int) -> float:
    """A step scoring k drafts, in plain steps at its context (64-token buckets)."""
    bucket = context // 64 * 64 + 32
    if (k, bucket) not in costs:
        costs[k, bucket] = profile.v(k, bucket) + (args.draft_ms / profile.time_ms(1, bucket) if k else 0.0)
    return costs[k, bucket]


def speedup(choose, outputs=None) -> tuple[float, float]:
    """(decode-only speedup over plain, tokens per step) when ``choose(label, accepted)``
    gives each step's k, over ``outputs`` (indices; default all)."""
    tokens = time = steps = 0.0
    for rows in (positions if outputs is None else [positions[j] for j in outputs]):
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


def best_k(key, outputs=None) -> dict:
    """The best k per ``key(label)``, by coordinate ascent (twice over the keys) on ``outputs``."""
    keys = sorted({key(label) for j, rows in enumerate(positions) if outputs is None or j in outputs
                   for label, *_ in rows}, key=str)
    best = dict.fromkeys(keys, 2)
    for _ in range(2):
        for one in keys:
            best[one] = max(range(K_MAX + 1), key=lambda k: speedup(
                lambda lab, accepted: k if key(lab) == one else best.get(key(lab), 2), outputs)[0])
    return best


def by_label(label):
    return label[0] if args.confidence else label


best = best_k(by_label)
rate, tau = speedup(lambda label, accepted: best[by_label(label)])
print(f"best k per label (in-sample): {rate:.3f}x (tau {tau:.2f})  {best}")
rate, tau = speedup(lambda label, accepted: accepted)
print(f"oracle (k = what will be accepted): {rate:.3f}x (tau {tau:.2f})")
if args.confidence:
    first = Counter(), Counter()
    for rows in positions:
        for (_, bucket), accepted, offered, _ in rows:
            if offered:
                first[0][bucket] += accepted > 0
                first[1][bucket] += 1
    print("first draft right, by confidence bucket (-1: first token; edges", BUCKETS, "):",
          {bucket: f"{first[0][bucket] / first[1][bucket]:.3f} of {first[1][bucket]}" for bucket in sorted(first[1])})
    halves = set(range(0, len(positions), 2)), set(range(1, len(positions), 2))
    for name, key in (("label", by_label), ("label and confidence", lambda label: label)):
        scored = []
        for fit, held in (halves, halves[::-1]):
            chosen = best_k(key, fit)
            scored.append(speedup(lambda label, accepted: chosen.get(key(label), 2), held)[0])
        print(f"best k per {name}, chosen on one half, scored on the other: {scored[0]:.3f}x / {scored[1]:.3f}x")
