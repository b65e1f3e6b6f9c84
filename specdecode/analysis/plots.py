"""The analyzer's pictures: acceptance by position, speedup by category (measured and
predicted), the distribution of alpha over prompts, alpha against temperature, and
adaptive k against the best fixed k per category (when the run swept k)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ..bench.runner import is_fixed_k, sweep_policies


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    # labels are names from the data (categories, methods): a "$" in one was parsed as
    # math, and an invalid expression failed the report after the whole run (found in review)
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def _grid(plt, panels: int, width: float = 6.0, height: float = 4.2, columns: int = 3):
    """One panel per method, wrapped into rows of ``columns``."""
    columns = max(1, min(columns, panels))
    rows = math.ceil(panels / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    flat = list(axes.flat)
    for axis in flat[panels:]:
        axis.set_visible(False)
    return figure, flat[:panels]


def _ratio_bars(axis, xs: list[float], ratios: list[float], width: float, label: str, also: list[float] = ()):
    """Bars of a speedup ratio drawn from 1.0 (plain decoding): up wins, down loses; the
    y range fits the data (and ``also``, e.g. predicted markers) rather than starting at 0,
    so a 3% loss is visible."""
    ratios = [math.nan if r is None else r for r in ratios]  # no ratio (nothing timed): no bar
    axis.bar(xs, [r - 1.0 for r in ratios], width, bottom=1.0, label=label)
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    low, high = axis.get_ylim()
    values = [r for r in [*ratios, *also] if r is not None and math.isfinite(r) and r] + [1.0]
    axis.set_ylim(min(low, min(values) - 0.05), max(high, max(values) + 0.05))


def plot_analysis(result: dict, out_dir: Path) -> list[Path]:
    plt = _pyplot()
    cats = result["categories"]
    methods = [m for m in result["config"]["methods"] if m != "none"]
    temperatures = result["config"]["temperatures"]
    first = temperatures[0]
    categories = sorted({r["category"] for r in cats if r["category"] != "overall"}) + ["overall"]
    by_key = {(r["temperature"], r["method"], r["category"]): r for r in cats}
    paths = []

    # 1. acceptance by draft position, one line per category
    figure, axes = _grid(plt, len(methods))
    for axis, method in zip(axes, methods):
        longest, plotted = 1, False
        for category in categories:
            row = by_key.get((first, method, category))
            if row and row["acceptance_per_position"]:
                rates = row["acceptance_per_position"]
                longest, plotted = max(longest, len(rates)), True
                style = dict(color="black", linewidth=2.5) if category == "overall" else {}
                axis.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=category, **style)
        # with a policy choosing k, position i is seen only in steps that drafted >= i, which
        # the policy chose after good steps: the curve need not fall
        note = "" if is_fixed_k(method, result["config"].get("k", "auto")) else "\n(position i: steps that drafted at least i)"
        axis.set(title=f"{method}, T={first:g}{note}", xlabel="draft position", ylabel="acceptance (mean over prompts)",
                 ylim=(0, 1), xlim=(0.5, longest + 0.5))
        axis.set_xticks(range(1, longest + 1, math.ceil(longest / 12)))  # whole positions, even for k = 1
        if plotted:
            axis.legend(fontsize=7)
        else:  # a method that never drafted (plain decoding, or a policy that kept k at 0)
            axis.text(0.5, 0.5, "no drafted tokens", ha="center", va="center", transform=axis.transAxes)
    paths.append(_save(plt, figure, out_dir / "acceptance_by_position.png"))

    # 2. speedup by category: measured bars per temperature, predicted as markers
    figure, axes = _grid(plt, len(methods), width=7.0)
    width = 0.8 / len(temperatures)
    for axis, method in zip(axes, methods):
        for t_index, temperature in enumerate(temperatures):
            xs = [i + t_index * width for i in range(len(categories))]
            rows = [by_key.get((temperature, method, c)) for c in categories]
            predicted = [r["predicted_speedup"] if r and r["predicted_speedup"] is not None else math.nan for r in rows]
            _ratio_bars(axis, xs, [r["measured_speedup"] if r else None for r in rows], width, f"measured T={temperature:g}",
                        also=predicted)
            axis.scatter(xs, predicted, color="black", marker="_", s=120, zorder=3,
                         label="predicted" if t_index == 0 else None)
        axis.set_xticks([i + width * (len(temperatures) - 1) / 2 for i in range(len(categories))], categories,
                        rotation=35, ha="right")
        axis.set(title=f"{method}: speedup vs plain", ylabel="median tokens/s ratio")
        axis.legend(fontsize=7)
    paths.append(_save(plt, figure, out_dir / "speedup_by_category.png"))

    # 3. distribution of per-prompt alpha per category
    figure, axes = _grid(plt, len(methods))
    for axis, method in zip(axes, methods):
        alphas = defaultdict(list)
        for r in result["records"]:
            if r["method"] == method and r["temperature"] == first and r.get("draft_tokens"):
                alphas[r["category"]].append(r["alpha"])
        names = [c for c in categories if alphas.get(c)]
        if names:
            axis.boxplot([alphas[c] for c in names], showmeans=True)
            axis.set_xticks(range(1, len(names) + 1), names, rotation=35, ha="right")
        axis.set(title=f"{method}, T={first:g}: alpha per prompt", ylabel="alpha", ylim=(0, 1))
    paths.append(_save(plt, figure, out_dir / "alpha_distribution.png"))

    # 4. alpha against temperature
    figure, axes = _grid(plt, len(methods))
    for axis, method in zip(axes, methods):
        plotted = False
        for category in categories:
            values = [by_key[(t, method, category)]["alpha_mean"] for t in temperatures if (t, method, category) in by_key]
            values = [float("nan") if v is None else v for v in values]  # nothing drafted: no point
            if len(values) == len(temperatures):
                style = dict(color="black", linewidth=2.5) if category == "overall" else {}
                axis.plot(temperatures, values, marker="o", label=category, **style)
                plotted = True
        axis.set(title=f"{method}: alpha against temperature", xlabel="temperature", ylabel="mean alpha", ylim=(0, 1))
        if plotted:
            axis.legend(fontsize=7)
        else:  # found in review: legend() over no lines, and matplotlib's warning in the output
            axis.text(0.5, 0.5, "no category measured at every temperature", ha="center", va="center",
                      transform=axis.transAxes)
    paths.append(_save(plt, figure, out_dir / "alpha_vs_temperature.png"))

    # 5. adaptive k against the best fixed k, per drafter, at the first temperature
    sweep = result.get("k_sweep", {}).get(str(first), {})
    if sweep:
        figure, axes = _grid(plt, len(sweep), width=8.0, columns=2)
        for axis, (drafter, rows) in zip(axes, sweep.items()):
            names = [c for c in categories if c in rows]
            policies = sorted({key for c in names for key in sweep_policies(rows[c])})
            bars = [("best fixed k", [rows[c]["best_fixed_speedup"] for c in names])]
            # an untimed policy has no bar (a 0.0 drew it as a full loss)
            bars += [(policy, [rows[c].get(policy, {}).get("speedup") for c in names]) for policy in policies]
            width = 0.8 / len(bars)
            for index, (label, values) in enumerate(bars):
                _ratio_bars(axis, [i + index * width for i in range(len(names))], values, width, label)
            for i, c in enumerate(names):  # which fixed k was best
                axis.annotate(rows[c]["best_fixed"].split("@")[-1], (i, rows[c]["best_fixed_speedup"]),
                              ha="center", va="bottom", fontsize=7)
            axis.set_xticks([i + width * (len(bars) - 1) / 2 for i in range(len(names))], names, rotation=35, ha="right")
            axis.set(title=f"{drafter}, T={first:g}: adaptive k against the best fixed k (label: that k)",
                     ylabel="median tokens/s ratio to plain")
            axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        paths.append(_save(plt, figure, out_dir / "k_sweep.png"))
    return paths


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
