"""Head-to-head of the objectives on one model, data, seed set and budget: a quick look.
The study with regimes, ablations, equal compute and statistics is bench/study.py.

    python bench/compare_objectives.py                      # 6 steps, 3 seeds, all objectives
    python bench/compare_objectives.py --seeds 0,1,2 --objectives ibpo,grpo train.steps=20
    python bench/compare_objectives.py --smoke --model PATH  # tiny 2-step check (CI)

Every run gets identical settings except `objective.name` (same prompts per step, steps, group
size, lengths, learning rate; the seed fixes data order and sampling). Each run is a separate
`ibpo train` process (in smoke mode they share one), so memory and wall time are per run;
finished runs (with a summary.json) are skipped, so an interrupted comparison resumes. Seeds
are the outer loop so that any drift of the machine's speed spreads over all objectives.

Writes <out>/comparison.md (table), comparison.json (per-run figures) and comparison.png
(training reward, entropy and cancellation residual per step, mean over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

OBJECTIVES = ["ibpo", "dfpo", "grpo", "dr_grpo", "dapo", "gspo"]

# The README's comparison: the embedded SmolLM2-135M-Instruct + LoRA on built-in arithmetic, where
# it starts far from perfect. Sized for 2 CPU cores: the base stays in fp32 (bitsandbytes' CPU
# 4-bit kernels dequantise on every call, which makes generation several times slower on CPU;
# the objectives, not the quantisation, are what is compared here).
BUDGET = [
    "model.quantization=none",
    "train.steps=6",
    "train.prompts_per_step=2",
    "rollout.group_size=8",
    "rollout.max_new_tokens=16",
    "rollout.eval_max_new_tokens=16",
    "data.eval_size=60",
    "train.learning_rate=1e-3",
    "train.log_reference_kl=false",
    "objective.kl_coef=0.0",  # as when it ran: no reference model
]

SMOKE = [
    "train.steps=2",
    "train.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "rollout.eval_max_new_tokens=4",
    "data.eval_size=4",
    "model.quantization=none",
]


def claim(run_dir: Path) -> bool:
    """Several workers may share one --out (e.g. one per core): each run is claimed once, by
    writing the worker's pid; a claim whose process has died (an interrupted run) is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = run_dir / ".claimed"
    for _ in range(2):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(marker.read_text() or "0"), 0)
                return False  # its owner is alive
            except (ProcessLookupError, ValueError):
                marker.unlink(missing_ok=True)
                continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def run_one(objective: str, seed: int, out: Path, overrides: list[str], in_process: bool) -> Path:
    run_dir = out / f"{objective}-s{seed}"
    if (run_dir / "summary.json").is_file():
        print(f"[skip] {run_dir} is done", flush=True)
        return run_dir
    if not claim(run_dir):
        print(f"[skip] {run_dir} is claimed by another worker", flush=True)
        return run_dir
    args = [
        *overrides,
        f"objective.name={objective}",
        f"train.seed={seed}",
        f"run.output_dir={run_dir}",
    ]
    print(f"[run] {objective} seed {seed}", flush=True)
    if in_process:  # smoke mode: no interpreter start-up per run
        from ibpo.recipe import load_config
        from ibpo.trainer import run_recipe

        run_recipe(load_config(None, args))
    else:
        subprocess.run([sys.executable, "-m", "ibpo.cli", "train", *args], check=True)
    return run_dir


def run_figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    col = lambda key: [s.get(key, float("nan")) for s in steps]
    return {
        "before": (summary["eval_before"] or {}).get("accuracy"),
        "after": summary["eval_after"]["accuracy"],
        "n_eval": summary["eval_after"]["n"],
        "reward": col("reward"),
        "entropy": col("entropy"),
        "residual": col("residual"),
        "reward_auc": statistics.fmean(col("reward")),
        "final_entropy": steps[-1]["entropy"],
        "mean_residual": statistics.fmean(col("residual")),
        "tokens": sum(col("generated_tokens")),
        "wall": summary["wall_seconds"],
    }


def _pm(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:{fmt}} ± {sd:{fmt}}"


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| objective | held-out acc. after | train reward AUC | final entropy | mean residual "
        "| generated tokens | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        get = lambda k, runs=runs: [r[k] for r in runs]
        lines.append(
            f"| {name} | {_pm(get('after'), '.3f')} | {_pm(get('reward_auc'), '.3f')} "
            f"| {_pm(get('final_entropy'), '.3f')} | {_pm(get('mean_residual'), '.4f')} "
            f"| {statistics.fmean(get('tokens')):,.0f} | {statistics.fmean(get('wall')):.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("reward", "training reward"), ("entropy", "entropy"), ("residual", "residual")]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6))
    for ax, (key, title) in zip(axes, keys):
        for name, runs in results.items():
            curves = [r[key] for r in runs]
            steps = range(1, min(len(c) for c in curves) + 1)
            mean = [statistics.fmean(c[s - 1] for c in curves) for s in steps]
            ax.plot(list(steps), mean, label=name, lw=2 if name == "ibpo" else 1.2)
        ax.set_title(f"{title} (mean over {len(curves)} seeds)")
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="outputs/compare")
    p.add_argument("--model", default=None, help="model.name for every run (default: embedded)")
    p.add_argument("--smoke", action="store_true", help="2 tiny steps per run, in-process (CI)")
    p.add_argument("overrides", nargs="*", help="section.key=value applied to every run")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = list(SMOKE if ns.smoke else BUDGET)
    if ns.model:
        overrides.append(f"model.name={ns.model}")
    overrides += ns.overrides
    objectives = [o.strip() for o in ns.objectives.split(",") if o.strip()]
    seeds = [int(s) for s in ns.seeds.split(",") if s.strip()]
    dirs = {o: [] for o in objectives}
    for seed in seeds:
        for objective in objectives:
            dirs[objective].append(run_one(objective, seed, out, overrides, ns.smoke))
    pending = [d for ds in dirs.values() for d in ds if not (d / "summary.json").is_file()]
    if pending:
        print(f"{len(pending)} runs are still running elsewhere; rerun to write the table")
        return 0
    results = {o: [run_figures(d) for d in ds] for o, ds in dirs.items()}
    md = table(results)
    before = [r["before"] for rs in results.values() for r in rs if r["before"] is not None]
    if before:
        md = f"Held-out accuracy before training: {before[0]:.3f}\n\n" + md
    cmd = "python bench/compare_objectives.py " + " ".join(argv or sys.argv[1:])
    header = f"Command: `{cmd.strip()}`  \nSettings: `{' '.join(overrides)}`\n\n"
    (out / "comparison.md").write_text(header + md)
    (out / "comparison.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "comparison.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
