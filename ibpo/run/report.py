"""End-of-run report of a training run: a summary table for the terminal and PNG plots.

Reads what the trainer leaves in its output_dir: `metrics.jsonl` (one JSON object per step, plus
periodic held-out evaluations as `eval_accuracy`/`eval_n` at some steps) and `summary.json`
(written at the end; absent while a run goes on or after a crash, and then the report says so);
the code the run ran (commit, dirty tree) from summary.json, else from config.yaml's first line.
`ibpo report OUTPUT_DIR` prints `summary_table` and writes `plots/training.png`; the trainer does
the same at the end of every run.

Reading is forgiving because the file may come from a run that was killed or resumed: a torn
last line (killed mid-write) is dropped, and a step logged twice (a resume that replays steps)
keeps its last occurrence. A panel or a table line whose metric was never logged is left out.

Not here: live dashboards (Accelerate's trackers: tensorboard, wandb, trackio), comparisons across
runs (bench/compare_objectives.py), any change to a run's files other than `plots/`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from ibpo.run.version import describe, from_header

METRICS, SUMMARY, PLOTS, OVERVIEW = "metrics.jsonl", "summary.json", "plots", "training.png"
HELDOUT_TITLE = "held-out accuracy"

# Overview panels in display order: (title, [(metric key, legend label), ...]). The held-out
# panel is drawn from evaluations, not from per-step series, and follows the residual.
SERIES_PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("training reward", [("reward", "reward"), ("accuracy", "accuracy")]),
    ("completion length (tokens)", [("completion_length", "length")]),
    ("entropy", [("entropy", "entropy")]),
    ("KL to reference", [("kl", "k3 KL")]),
    ("cancellation residual", [("residual", "residual")]),
    ("repair success rate", [("repair_success_rate", "success rate")]),
    ("step time (s)", [("step_time", "seconds")]),
]
HELDOUT_AFTER = "cancellation residual"


# --- reading -------------------------------------------------------------------------------------


def _is_eval_record(row: dict) -> bool:
    """A line holding only a held-out evaluation (the trainer may also merge one into a step's
    line). It is deduplicated apart from the step's training line, so one never hides the other."""
    return "eval_accuracy" in row and all(k == "step" or k.startswith("eval_") for k in row)


def read_metrics(path: Path | str) -> list[dict]:
    """The rows of a metrics.jsonl, one per step, sorted by step.

    A torn last line is dropped silently (the expected trace of a run killed mid-write); any
    other unreadable line is dropped with a note on stderr. When a step appears more than once
    (a resumed run replays steps), its last training line and its last evaluation line win and
    are merged into one row.
    """
    lines = [x for x in Path(path).read_text().splitlines() if x.strip()]
    latest: dict[tuple[int, bool], dict] = {}
    for i, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines):
                print(f"ibpo: {path}: line {i} is not valid JSON; skipped", file=sys.stderr)
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            print(f"ibpo: {path}: line {i} has no integer 'step'; skipped", file=sys.stderr)
            continue
        latest[(step, _is_eval_record(row))] = row
    merged: dict[int, dict] = {}
    for (step, _), row in sorted(latest.items()):  # training line first, then evaluation
        merged.setdefault(step, {}).update(row)
    return [merged[s] for s in sorted(merged)]


def read_summary(output_dir: Path | str) -> dict | None:
    """summary.json, or None when the run has not finished (or its summary is unreadable)."""
    path = Path(output_dir) / SUMMARY
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; steps where it is missing or not finite are left out."""
    pts = [(r["step"], float(r[key])) for r in rows if _number(r.get(key))]
    return [s for s, _ in pts], [v for _, v in pts]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (shorter at the start, so it spans every step)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def heldout_points(rows: list[dict], summary: dict | None) -> list[tuple[int, float]]:
    """(step, accuracy) of every held-out evaluation: before training at step 0, the periodic
    ones at their steps, after training at the last step."""
    summary = summary or {}
    pts = []
    if _number((summary.get("eval_before") or {}).get("accuracy")):
        pts.append((0, float(summary["eval_before"]["accuracy"])))
    steps, values = series(rows, "eval_accuracy")
    pts += list(zip(steps, values))
    if _number((summary.get("eval_after") or {}).get("accuracy")):
        last = summary.get("steps") or (rows[-1]["step"] if rows else 0)
        pts.append((int(last), float(summary["eval_after"]["accuracy"])))
    return pts


# --- plots ---------------------------------------------------------------------------------------


def _draw_series(ax, curves: list[tuple[str, list[int], list[float]]]) -> None:
    """Raw values, and a moving average over ~10% of the steps when there are enough of them."""
    smoothed = False
    for k, (label, steps, values) in enumerate(curves):
        window = max(3, len(values) // 10)
        smooth = len(values) > window
        marker = "o" if len(values) <= 30 else None
        style = "-" if k == 0 else "--"  # a second curve may coincide (0/1 rewards = accuracy)
        ax.plot(
            steps,
            values,
            color=f"C{k}",
            ls=style,
            lw=0.8,
            marker=marker,
            ms=2.5,
            alpha=0.35 if smooth else 1.0,
            label=None if smooth else label,
        )
        if smooth:
            ax.plot(
                steps,
                moving_average(values, window),
                color=f"C{k}",
                ls=style,
                lw=1.6,
                label=f"{label} ({window}-step mean)",
            )
        smoothed |= smooth
    if len(curves) > 1 or smoothed:
        ax.legend(fontsize=7)


def _draw_heldout(ax, points: list[tuple[int, float]]) -> None:
    steps, values = [s for s, _ in points], [v for _, v in points]
    ax.plot(steps, values, color="C2", marker="o", ms=4, lw=1.2)
    ax.margins(y=0.2)  # room for the value labels
    if len(points) <= 12:  # label each evaluation while the labels still fit
        for s, v in points:
            ax.annotate(
                f"{v:.2f}",
                (s, v),
                textcoords="offset points",
                xytext=(0, 5),
                ha="center",
                fontsize=7,
            )


def _panels(rows: list[dict], summary: dict | None) -> list[tuple[str, Callable]]:
    """(title, draw(ax)) for every panel that has data, in display order."""
    panels = []
    for title, keys in SERIES_PANELS:
        curves = [(label, *series(rows, key)) for key, label in keys]
        curves = [c for c in curves if c[1]]
        if curves:
            panels.append((title, lambda ax, c=curves: _draw_series(ax, c)))
        if title == HELDOUT_AFTER:
            points = heldout_points(rows, summary)
            if points:
                panels.append((HELDOUT_TITLE, lambda ax, p=points: _draw_heldout(ax, p)))
    return panels


def build_figure(rows: list[dict], summary: dict | None = None):
    """The overview figure (a matplotlib Figure; its axes are the panels, titled), or None when
    there is nothing to draw (no steps and no evaluation)."""
    # A bare Figure, not pyplot: no global backend switch, no display, nothing left open.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = _panels(rows, summary)
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 2.9 * nrows), layout="constrained")
    for i, (title, draw) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        draw(ax)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    n = len(rows)
    fig.suptitle(f"{_run_name(summary)}: {n} step{'s' * (n != 1)}", fontsize=11)
    return fig


def plot_run(output_dir: Path | str) -> list[Path]:
    """Write <output_dir>/plots/training.png; returns the files written ([] when there is
    nothing to plot yet)."""
    output_dir = Path(output_dir)
    metrics = output_dir / METRICS
    rows = read_metrics(metrics) if metrics.is_file() else []
    fig = build_figure(rows, read_summary(output_dir))
    if fig is None:
        return []
    (output_dir / PLOTS).mkdir(parents=True, exist_ok=True)
    path = output_dir / PLOTS / OVERVIEW
    fig.savefig(path, dpi=110)
    return [path]


# --- summary table -------------------------------------------------------------------------------


def _run_name(summary: dict | None) -> str:
    s = summary or {}
    if not s.get("objective"):
        return "ibpo run"
    return f"{s['objective']} on {s.get('model')} ({s.get('quantization')}), {s.get('dataset')}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def _heldout_text(rows: list[dict], summary: dict | None) -> str:
    s = summary or {}
    before, after = s.get("eval_before") or {}, s.get("eval_after") or {}
    parts = [f"before {before['accuracy']:.3f}"] if _number(before.get("accuracy")) else []
    periodic = [f"@{st} {v:.3f}" for st, v in zip(*series(rows, "eval_accuracy"))]
    if len(periodic) > 3:  # keep the line short: the first and the last two
        periodic = [periodic[0], "...", *periodic[-2:]]
    parts += periodic
    if _number(after.get("accuracy")):
        parts.append(f"after {after['accuracy']:.3f}")
    if not parts:
        return "n/a (no held-out evaluation)"
    _, ns = series(rows, "eval_n")
    n = after.get("n") or before.get("n") or (int(ns[-1]) if ns else None)
    return " -> ".join(parts) + (f"  (n={n})" if n else "")


def _run_items(rows: list[dict], summary: dict | None) -> list[tuple[str, str]]:
    s = summary or {}
    status = s.get("status") or "no summary.json (running, or stopped without one)"
    if s.get("message"):
        first = str(s["message"]).splitlines()[0]
        status += f": {first[:70]}{'...' if len(first) > 70 else ''}"
    _, times = series(rows, "step_time")
    if _number(s.get("wall_seconds")):
        wall = _duration(s["wall_seconds"])
    else:
        wall = f"{_duration(sum(times))} (sum of step times)" if times else "n/a"
    _, skipped = series(rows, "skipped_nonfinite")
    nonfinite = s.get("nonfinite_steps", int(sum(skipped)))
    items = [
        ("run", _run_name(summary)),
        ("status", status),
        ("steps", str(s.get("steps", rows[-1]["step"] if rows else 0))),
        ("non-finite steps", f"{nonfinite} skipped"),
        ("wall time", wall),
        ("held-out accuracy", _heldout_text(rows, summary)),
    ]
    if s.get("resumed_from"):
        items.insert(3, ("resumed from", str(s["resumed_from"])))
    return items


def _repair_cost(rows: list[dict]) -> str | None:
    """The repair phase per step (means over the steps that logged it): prompt tokens
    prefilled (of the prompts' tokens, where a shared prefix ran once), tokens decoded and
    seconds; None for a run without repairs."""
    _, prefill = series(rows, "repair_prefill_tokens")
    _, prompt = series(rows, "repair_prompt_tokens")
    _, decode = series(rows, "repair_decode_tokens")
    _, seconds = series(rows, "time_repair")
    if not (prefill and decode and seconds):
        return None
    of = f" (of {_mean(prompt):.0f} prompt tokens)" if prompt else ""
    return (
        f"{_mean(prefill):.0f} prefill{of} + {_mean(decode):.0f} decode tokens, "
        f"{_mean(seconds):.2f} s  (mean per step)"
    )


def _repair_spending(rows: list[dict]) -> str | None:
    """What the repair spending rule did (algo/spending.py): repairs run and skipped, the
    pooled success of those run, steps that skipped and probes, the repairs' mean share of the
    tokens a step ran; None for a run that did not log it."""
    _, skipped = series(rows, "repairs_skipped")
    _, ran = series(rows, "repairs")
    _, hits = series(rows, "repair_successes")
    _, share = series(rows, "repair_cost_share")
    if not (skipped and share):
        return None
    _, probes = series(rows, "repair_probe")
    idle = sum(1 for r in rows if _number(r.get("repairs_skipped")) and r["repairs_skipped"] > 0
               and not r.get("repairs"))  # fmt: skip
    success = f"pooled success {sum(hits) / sum(ran):.3f}; " if sum(ran) and hits else ""
    n_probes = round(sum(probes))
    return (
        f"{sum(ran):.0f} run, {sum(skipped):.0f} skipped ({success}"
        f"{idle} step{'s' * (idle != 1)} without repairs, "
        f"{n_probes} probe{'s' * (n_probes != 1)}), "
        f"{_mean(share):.2f} of the tokens  (mean share per step)"
    )


def _metric_items(rows: list[dict]) -> list[tuple[str, str]]:
    items = []
    _, reward = series(rows, "reward")
    if reward:
        k = math.ceil(len(reward) / 10)
        items.append(
            (
                "train reward",
                f"{_mean(reward[:k]):.3f} -> {_mean(reward[-k:]):.3f}  "
                f"(mean of the first -> last {k} of {len(reward)} steps)",
            )
        )
    for key, label, fmt, reduce in [
        ("entropy", "final entropy", ".3f", lambda v: v[-1]),
        ("residual", "mean residual", ".4f", _mean),
        ("kl", "mean KL", ".4f", _mean),
        ("repair_success_rate", "repair success", ".3f", _mean),
    ]:
        # a step that ran no repair (skipped, or nothing failed) has no success rate
        ran = [r for r in rows if key != "repair_success_rate" or r.get("repairs", 1) != 0]
        _, values = series(ran, key)
        if values:
            items.append((label, f"{reduce(values):{fmt}}"))
    repair = _repair_cost(rows)
    if repair:
        items.append(("repair cost", repair))
    spending = _repair_spending(rows)
    if spending:
        items.append(("repair spending", spending))
    # overall rate = all completion tokens / all step time (a plain mean would weigh a fast
    # step like a slow one)
    timed = [
        (r["tokens_per_second"], r["step_time"])
        for r in rows
        if _number(r.get("tokens_per_second")) and _number(r.get("step_time"))
    ]
    if timed and sum(t for _, t in timed) > 0:
        rate = sum(v * t for v, t in timed) / sum(t for _, t in timed)
        items.append(("tokens/s", f"{rate:.1f}  (completion tokens per second of step time)"))
    _, memory = series(rows, "peak_memory_gb")
    if memory:
        items.append(("peak memory", f"{max(memory):.2f} GiB"))
    return items


def code_of(output_dir: Path, summary: dict | None) -> dict | None:
    """The run's code version: summary.json's, else config.yaml's header (a run going on or
    stopped without a summary); None for a run from before either recorded it."""
    if summary and isinstance(summary.get("code"), dict):
        return summary["code"]
    try:
        return from_header((Path(output_dir) / "config.yaml").read_text())
    except OSError:
        return None


def _location_items(output_dir: Path, summary: dict | None) -> list[tuple[str, str]]:
    s = summary or {}
    checkpoint = s.get("checkpoint")
    if not checkpoint:  # no summary: the newest checkpoint folder, if any
        found = sorted(
            (output_dir / "checkpoints").glob("step-*"),
            key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1,
        )
        checkpoint = str(found[-1]) if found else None
    plots = sorted((output_dir / PLOTS).glob("*.png"))
    return [
        ("adapter", s.get("adapter") or "none saved"),
        ("checkpoint", checkpoint or "none saved"),
        ("plots", ", ".join(map(str, plots)) if plots else "none written"),
    ]


def summary_table(output_dir: Path | str) -> str:
    """The end-of-run summary as aligned `label  value` lines for a terminal."""
    output_dir = Path(output_dir)
    metrics = output_dir / METRICS
    rows = read_metrics(metrics) if metrics.is_file() else []
    summary = read_summary(output_dir)
    items = _run_items(rows, summary)
    items.insert(2, ("code", describe(code_of(output_dir, summary))))
    items += _metric_items(rows) + _location_items(output_dir, summary)
    width = max(len(label) for label, _ in items)
    lines = [f"ibpo report: {output_dir}"]
    lines += [f"  {label:<{width}}  {value}" for label, value in items]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`ibpo report OUTPUT_DIR [--no-plots]`: print the summary table and write the plots."""
    p = argparse.ArgumentParser(prog="ibpo report", description=__doc__.splitlines()[0])
    p.add_argument("output_dir", help="a run's output_dir (run.output_dir)")
    p.add_argument("--no-plots", action="store_true", help="print the table only")
    ns = p.parse_args(argv)
    out = Path(ns.output_dir)
    if not (out / METRICS).is_file():
        what = "does not exist" if not out.exists() else f"has no {METRICS}"
        hint = "give a run's output_dir (run.output_dir; the trainer writes metrics.jsonl there)"
        print(f"ibpo: error: {out} {what}: {hint}", file=sys.stderr)
        return 2
    if not ns.no_plots:
        plot_run(out)
    print(summary_table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
