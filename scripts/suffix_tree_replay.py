"""Offline replay: suffix lookup's chains against trees built from the same sources, on the
target's own greedy outputs (teacher forcing, no timing). Used for docs/training.md
("Trees from the store").

    .venv/bin/python scripts/suffix_tree_replay.py [--limit N] [--outputs FILE]

A tree holds the request's n-gram chain (n >= 2; node i confidence 0.6 x 0.85^i) and the
store's continuations of the longest match, expanded best first by their share of the
occurrences (SuffixDecoding's score), merged where they agree; the budget keeps the most
confident nodes. Each step walks the tree along the plain output and moves by the accepted
length plus one. Prints tau and nodes per step for chains of k and trees of k nodes, and
tau over the cost profile's v(k + 1) as a rough speedup.
"""

import argparse
import heapq

import numpy as np

from specdecode.config import EngineConfig, SamplingParams
from specdecode.factory import cost_profile, load_store, load_target
from specdecode.proposers.ngram import match
from specdecode.proposers.suffix import MAX_SAMPLE, SuffixProposer

from plain_outputs import plain_outputs  # scripts/plain_outputs.py

parser = argparse.ArgumentParser()
parser.add_argument("--limit", type=int, default=None, help="suite prompts per category (default: all)")
parser.add_argument("--outputs", default=None, help="cache of the plain outputs (JSON), made if missing")
args = parser.parse_args()

config = EngineConfig()
target = load_target(config)
store = load_store(None, target)
proposer = SuffixProposer(store)
params = SamplingParams()
records = plain_outputs(config, target, args.limit, args.outputs)


def chain(tokens, budget):
    proposer._planned = None
    return [(t, i, 1.0) for i, t in enumerate(proposer.propose(tokens, budget, params, None).draft_ids.tolist())]


def store_nodes(tokens, budget, max_children=4):
    n, low, high = store.longest_match(tokens[-store.max_n:], 2)
    if n == 0:
        return []
    follow = store._follow(low, high, n, MAX_SAMPLE)
    total, nodes, heap, order = follow.size, [], [], 0

    def push_children(node, positions):
        nonlocal order
        positions = positions[positions < store.tokens.size]
        values = store.tokens[positions]
        real = values != store.separator
        if not real.any():
            return
        ids, counts = np.unique(values[real], return_counts=True)
        for j in np.argsort(-counts, kind="stable")[:max_children]:
            order += 1
            heapq.heappush(heap, (-counts[j] / total, order, int(ids[j]), node, positions[values == ids[j]] + 1))

    push_children(0, follow)
    while heap and len(nodes) < budget:
        negative, _, token, parent, positions = heapq.heappop(heap)
        nodes.append((token, parent, -negative))
        push_children(len(nodes), positions)
    return nodes


def tree(tokens, budget):
    sequence = np.asarray(tokens, dtype=np.int64)
    found = match(sequence, (3, 2))
    drafts = sequence[found[0]:found[0] + budget].tolist() if found else []
    nodes = [[t, i, 0.6 * 0.85**i] for i, t in enumerate(drafts)]
    child = {(i, t): i + 1 for i, t in enumerate(drafts)}
    where = {0: 0}
    for j, (token, parent, confidence) in enumerate(store_nodes(tokens, budget), start=1):
        key = (where[parent], token)
        if key in child:
            nodes[child[key] - 1][2] = max(nodes[child[key] - 1][2], confidence)
        else:
            nodes.append([token, where[parent], confidence])
            child[key] = len(nodes)
        where[j] = child[key]
    if not nodes:
        found = match(sequence, (1,))
        nodes = [[t, i, 0.3 * 0.7**i] for i, t in enumerate(sequence[found[0]:found[0] + budget].tolist())] if found else []
    keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i][2], i))[:budget])
    remap, out = {0: 0}, []
    for i in keep:  # a kept node's parent is kept (confidence never grows down a path)
        token, parent, confidence = nodes[i]
        out.append((token, remap[parent], confidence))
        remap[i + 1] = len(out)
    return out


def replay(build, budget):
    steps = produced = nodes = 0
    for record in records:
        sequence, start, length = record["prompt_ids"] + record["output"], len(record["prompt_ids"]), len(record["output"])
        i = 0
        while i < length:
            drafted = build(sequence[:start + i], budget)
            children = {}
            for index, (token, parent, _) in enumerate(drafted, start=1):
                children.setdefault(parent, {})[token] = index
            node = depth = 0
            while i + depth < length and (nxt := children.get(node, {}).get(sequence[start + i + depth])) is not None:
                node, depth = nxt, depth + 1
            moved = min(depth + 1, length - i)
            i, produced, steps, nodes = i + moved, produced + moved, steps + 1, nodes + len(drafted)
    return produced / steps, nodes / steps


profile = cost_profile(target, config.dtype)
print(f"{len(records)} outputs; v(k + 1) from the cost profile at 256 tokens of context")
for budget in range(1, 8):
    v = profile.v(budget, 256)
    (tau_chain, n_chain), (tau_tree, n_tree) = replay(chain, budget), replay(tree, budget)
    print(f"k = {budget}: chain tau {tau_chain:.3f} ({n_chain:.2f} drafts/step, {tau_chain / v:.2f}x)   "
          f"tree tau {tau_tree:.3f} ({n_tree:.2f} nodes/step, {tau_tree / v:.2f}x)", flush=True)
