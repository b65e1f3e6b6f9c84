"""Pictures of a bench run: speedup per category and acceptance per draft position."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path


def plot_bench(summary: dict, records: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    # labels are names from the data (categories, methods): a "$" in one was parsed as
    # math, and an invalid expression failed the report after the whole run (found in review)
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    categories = sorted(c for c in summary if c != "overall") + ["overall"]
    methods = [m for m in summary["overall"] if m != "none"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))

    width = 0.8 / max(len(methods), 1)
    for index, method in enumerate(methods):
        # no bar where nothing was timed against plain decoding (None)
        speedups = [summary[c].get(method, {}).get("speedup") for c in categories]
        speedups = [math.nan if value is None else value for value in speedups]
        xs = [i + index * width for i in range(len(categories))]
        left.bar(xs, speedups, width, label=method)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    left.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))], categories, rotation=35, ha="right")
    left.set_ylabel("median speedup vs plain (tokens/s ratio)")
    left.set_title("Speedup per category (plain decoding = 1)")
    left.legend()

    # per draft position: the mean over prompts of each prompt's acceptance rate there
    for method in methods:
        rates = defaultdict(list)
        for record in records:
            if record["method"] == method:
                for position, rate in enumerate(record.get("acceptance_per_position") or []):
                    rates[position].append(rate)
        if rates:
            positions = sorted(rates)
            means = [sum(rates[p]) / len(rates[p]) for p in positions]
            right.plot([p + 1 for p in positions], means, marker="o", label=method)
    deepest = max((int(line.get_xdata()[-1]) for line in right.lines), default=1)
    right.set_xticks(range(1, deepest + 1))  # whole positions, also when only position 1 was drafted
    right.set_xlim(0.5, deepest + 0.5)
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance rate (mean over prompts)")
    right.set_ylim(0, 1)
    right.set_title("Acceptance per draft position")
    if right.lines:
        right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
