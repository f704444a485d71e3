"""The study's figures: accuracy.png (held-out accuracy against steps and generated tokens) and
dynamics.png (entropy and KL to the reference per step), means over each arm's seeds, one row of
panels per regime; sweep.png (final accuracy against the learning rate) after a sweep.

matplotlib is imported when a figure is drawn (the report's text needs none of it).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from study_grid import ABLATION, EQUAL, OFF, ON
from study_stats import mean_known


def mean_curve(runs: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Mean over seeds at the points every seed has (index-aligned: one schedule per arm)."""
    curves = [r[key] for r in runs]
    n = min(len(c) for c in curves)
    xs = [statistics.fmean(c[i][0] for c in curves) for i in range(n)]
    ys = [statistics.fmean(c[i][1] for c in curves) for i in range(n)]
    return xs, ys


def _step_mean(runs: list[dict], key: str) -> tuple[list[int], list[float]]:
    n = min(len(r[key]) for r in runs)
    ys = [mean_known(r[key][i] for r in runs) for i in range(n)]
    return list(range(1, n + 1)), ys


def _panels(arms: dict[str, list[dict]]) -> list[tuple[str, dict[str, list[dict]]]]:
    """On-policy with its ablations and equal-compute arm; off-policy on its own."""
    on = {k: v for k, v in arms.items() if v[0]["regime"] in (ON, ABLATION, EQUAL)}
    off = {k: v for k, v in arms.items() if v[0]["regime"] == OFF}
    return [(t, p) for t, p in (("on-policy", on), ("off-policy", off)) if p]


def plot(arms: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(arms)
    specs = {
        "accuracy.png": [
            ("curve", "held-out accuracy", "step"),
            ("token_curve", "held-out accuracy", "generated tokens"),
        ],
        "dynamics.png": [("entropy", "entropy", "step"), ("kl", "KL to the reference", "step")],
    }
    for name, cols in specs.items():
        fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.8 * len(panels)), squeeze=False)
        for row, (title, group) in zip(axes, panels):
            for ax, (key, ylabel, xlabel) in zip(row, cols):
                for arm, runs in group.items():
                    pick = mean_curve if key in ("curve", "token_curve") else _step_mean
                    xs, ys = pick(runs, key)
                    style = "-" if arm.endswith("ibpo") else "--"
                    ax.plot(xs, ys, style, marker=".", label=f"{arm} ({len(runs)})")
                ax.set_title(f"{title}: {ylabel} (mean over seeds)", fontsize=10)
                ax.set_xlabel(xlabel)
            row[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def plot_sweep(sweep: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for objective in ("grpo", "dfpo"):
        points = sorted(
            (float(name.split("-lr", 1)[1]), r["after"])
            for name, runs in sweep.items()
            if name.startswith(f"sweep-{objective}-lr")
            for r in runs
        )
        if points:
            ax.plot(*zip(*points), marker="o", label=objective)
    before = [r["before"] for runs in sweep.values() for r in runs if r["before"] is not None]
    if before:
        ax.axhline(before[0], color="grey", lw=0.8, label="before training")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final held-out accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
