"""The objective study: does IBPO learn better than the GRPO family?

    python bench/study.py --workers 2                     # the main grid (5 seeds x 13 arms)
    python bench/study.py --seeds 0-15 --arms on-ibpo,on-dfpo --workers 2   # the headline pair
    python bench/study.py --sweep --workers 2             # the learning-rate sweep, 1 seed
    python bench/study.py --report-only                   # rebuild study.json/.md/.png
    python bench/study.py --smoke --model PATH            # tiny 2-step check (CI)

Defaults (each a command-line option, passed to every run as an override): the embedded
SmolLM2-135M-Instruct + LoRA with an fp32 base (model.quantization=none: bitsandbytes' CPU 4-bit
kernels make generation several times slower), `builtin:mixed` (arithmetic and one-step word
problems: builtin:arithmetic holds only 158 held-out problems, under the study's 200), 200
held-out problems answered greedily at step 0, every 5 steps and at the end, 20 steps of 2
prompts x G = 8, 16 new tokens, learning rate 2e-4 (the sweep's choice), seeds 0-4, and the KL to
the reference logged every step. Each run gets OMP_NUM_THREADS = cores / workers.

The grid is data (`grid`): arms of (name, regime, overrides). Regime "on-policy" takes one update
per rollout (ibpo, dfpo, grpo, dr_grpo); "off-policy" takes `--off-updates` (default 2) updates
per rollout, where clipping and ratios act (ibpo, dfpo, grpo, gspo, dapo, whose dynamic sampling
is its default); the ablations of Part 2 are on-policy IBPO with shaping only
(repair.unchanged_weight=1), the mask only (repair.shaping_lambda=0) and K = 3 references
(repair.references=2); the equal-compute arm is on-policy dfpo with `--equal-factor` (default
1.5, IBPO's measured token ratio in the 6-step comparison) times the group size, or the steps
with `--equal-by steps`. The report prints the measured token ratios, so whether the budget
really matched is read from the results, not assumed. `--sweep` runs grpo and dfpo at one seed
over `--lrs` instead.

Every run is its own `python -m ibpo.cli train` process (in `--smoke` they share this one); the
budget is command-line options passed as overrides, and trailing `section.key=value` overrides
apply to every run; `--arms` picks some arms. `--workers N` starts N worker threads, each of
which claims the next unclaimed run (a `.claimed` file with this process's pid; a claim whose
process has died is taken over) and runs it in its own process; several invocations may share
one --out the same way. Each run gets OMP_NUM_THREADS = cores / workers (`--threads`): with
several invocations on one machine, give each `--threads` so that all runs' threads together are
at most the cores (two runs of 2 threads on 2 cores ran several times slower than two of 1). A
run is done when its summary.json holds the final held-out evaluation; a run started again
resumes from its last checkpoint (run.resume_from=latest). Each run's folder
<out>/runs/<arm>-s<seed> (<out>/sweep/... for the sweep) holds study_run.json (arm, regime,
seed, command line), the claim, train.log and train/ (the trainer's output_dir), so the report
is built from the folders alone.

Writes <out>/study.json (every finished run's curves and figures), <out>/study.md (per arm:
mean and 95% t-interval over seeds of the final held-out accuracy and of its gain; paired
per-seed differences with an exact sign test and a bootstrap interval; every comparison again at
equal steps, decode tokens, prompt + decode tokens and step seconds, each pair's held-out
accuracy curves read at the compute both runs reached (`compare_at`); what each run spent;
accuracy against generated tokens; whether IBPO's edit mask acted; the seeds a +-0.05
t-interval and 80% power at 0.05 would need; the sweep; the code each run ran (its commit and
whether the tree was dirty, as the trainer recorded them); the command lines, each run's exact
one in study.json) and accuracy.png, dynamics.png (sweep.png after
a sweep). It does not choose the learning rate (read the sweep and pass --lr), judges a
difference significant only when its paired t 95% interval excludes 0 (`significant`). The t
quantile, the noncentral t of the power and the F-test come from scipy.stats (`pip install
'ibpo[study]'`); the exact sign test and the bootstrap are written here (math, random).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ON, OFF, ABLATION, EQUAL, SWEEP = "on-policy", "off-policy", "ablation", "equal-compute", "sweep"
REGIME_ORDER = (ON, OFF, ABLATION, EQUAL, SWEEP)
# (label, arm a, arm b): paired per-seed differences a - b of the final held-out accuracy.
COMPARISONS = [
    ("on-policy ibpo - dfpo (Part 2: repairs)", "on-ibpo", "on-dfpo"),
    ("on-policy dfpo - grpo (Part 1: the objective)", "on-dfpo", "on-grpo"),
    ("off-policy ibpo - dfpo (Part 2: repairs)", "off-ibpo", "off-dfpo"),
    ("off-policy dfpo - grpo (Part 1: the objective)", "off-dfpo", "off-grpo"),
    ("on-policy ibpo - grpo (both parts)", "on-ibpo", "on-grpo"),
    ("off-policy ibpo - grpo (both parts)", "off-ibpo", "off-grpo"),
    ("ibpo - dfpo at equal tokens", "on-ibpo", "equal-dfpo"),
    ("shaping only - ibpo", "ablation-shaping-only", "on-ibpo"),
    ("mask only - ibpo", "ablation-mask-only", "on-ibpo"),
    ("K=3 references - ibpo", "ablation-k3", "on-ibpo"),
]
SMOKE_ARMS = ("on-ibpo", "off-dfpo", "ablation-mask-only")
# The budget options --smoke sets: seconds per run on the test suite's tiny model.
SMOKE = {
    "dataset": "builtin:arithmetic",
    "eval_size": 4,
    "steps": 2,
    "eval_every": 1,
    "prompts": 2,
    "group_size": 2,
    "max_new_tokens": 4,
    "seeds": "0,1",
}
BOOTSTRAP_SEED, BOOTSTRAP_REPS = 20261201, 10_000


@dataclass(frozen=True)
class Arm:
    name: str  # unique, also the run folders' prefix
    regime: str
    overrides: tuple[str, ...]


@dataclass
class Run:
    arm: Arm
    seed: int
    dir: Path
    args: list[str] = field(default_factory=list)  # the `ibpo train` overrides

    def command(self, threads: int) -> str:
        cli = ["python", "-m", "ibpo.cli", "train", *self.args]
        return f"HF_HUB_OFFLINE=1 OMP_NUM_THREADS={threads} {shlex.join(cli)}"


# --- the grid ------------------------------------------------------------------------------------


def _arm(regime: str, name: str, objective: str, updates: int, *extra: str) -> Arm:
    prefix = {ON: "on", OFF: "off", ABLATION: "ablation", EQUAL: "equal", SWEEP: "sweep"}[regime]
    overrides = (f"objective.name={objective}", f"train.updates_per_rollout={updates}", *extra)
    return Arm(f"{prefix}-{name}", regime, overrides)


def grid(ns: argparse.Namespace) -> list[Arm]:
    """Every arm of the main study, in the order the workers take them within a seed."""
    arms = [_arm(ON, o, o, 1) for o in ("ibpo", "dfpo", "grpo", "dr_grpo")]
    arms += [_arm(OFF, o, o, ns.off_updates) for o in ("ibpo", "dfpo", "grpo", "gspo", "dapo")]
    arms += [
        _arm(ABLATION, "shaping-only", "ibpo", 1, "repair.unchanged_weight=1"),
        _arm(ABLATION, "mask-only", "ibpo", 1, "repair.shaping_lambda=0"),
        _arm(ABLATION, "k3", "ibpo", 1, "repair.references=2"),  # K - 1 references
    ]
    if ns.equal_by == "group":
        equal = f"rollout.group_size={round(ns.group_size * ns.equal_factor)}"
    else:
        equal = f"train.steps={round(ns.steps * ns.equal_factor)}"
    arms.append(_arm(EQUAL, "dfpo", "dfpo", 1, equal))
    return arms


def sweep_arms(ns: argparse.Namespace) -> list[Arm]:
    return [
        _arm(SWEEP, f"{o}-lr{lr}", o, 1, f"train.learning_rate={lr}")
        for lr in _list(ns.lrs, str)
        for o in ("grpo", "dfpo")
    ]


def budget(ns: argparse.Namespace) -> list[str]:
    """The settings every run shares, from the command-line options."""
    shared = [
        f"model.quantization={ns.quantization}",
        f"data.dataset={ns.dataset}",
        f"data.eval_size={ns.eval_size}",
        f"train.steps={ns.steps}",
        f"train.eval_every={ns.eval_every}",
        f"train.prompts_per_step={ns.prompts}",
        f"rollout.group_size={ns.group_size}",
        f"rollout.max_new_tokens={ns.max_new_tokens}",
        f"rollout.eval_max_new_tokens={ns.max_new_tokens}",
        f"train.learning_rate={ns.lr}",
        f"objective.kl_coef={ns.kl_coef}",
        "train.log_reference_kl=true",  # the KL to the reference is a reported figure
        "run.save_every=0",  # a checkpoint at the end and on SIGINT/SIGTERM, for resuming
    ]
    if ns.model:
        shared.append(f"model.name={ns.model}")
    return shared


def plan(ns: argparse.Namespace, out: Path) -> list[Run]:
    """The runs of this invocation, seeds as the outer loop (so that a drift of the machine's
    speed spreads over all arms), each with its full list of overrides."""
    if ns.sweep:
        arms, seeds, folder = sweep_arms(ns), [ns.sweep_seed], out / "sweep"
    else:
        arms, seeds, folder = grid(ns), seed_list(ns.seeds), out / "runs"
    smoke = SMOKE_ARMS if ns.smoke and not ns.sweep else ()
    chosen = _list(ns.arms, str) if ns.arms else smoke
    if chosen:
        unknown = sorted(set(chosen) - {a.name for a in arms})
        if unknown:
            raise SystemExit(f"unknown arms {unknown}; arms: {', '.join(a.name for a in arms)}")
        arms = [a for a in arms if a.name in chosen]
    shared = budget(ns) + list(ns.overrides)
    runs = []
    for seed in seeds:
        for arm in arms:
            run_dir = folder / f"{arm.name}-s{seed}"
            train_dir = run_dir / "train"  # the trainer's own folder: it moves what it finds there
            args = [*shared, *arm.overrides, f"train.seed={seed}", f"run.output_dir={train_dir}"]
            runs.append(Run(arm, seed, run_dir, args + ["run.resume_from=latest"]))
    return runs


def check(runs: list[Run]) -> None:
    """Every run's configuration, before any starts: a bad override fails now, not hours in."""
    from ibpo.config import ConfigError
    from ibpo.recipe import load_config

    for run in runs:
        try:
            load_config(None, run.args)
        except ConfigError as e:
            raise SystemExit(f"{run.dir.name}: {e}") from None


def _list(text: str, kind):
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def seed_list(text: str) -> list[int]:
    """'0,1,2' or '0-15' or '0-4,9': the seeds, in order, each once."""
    seeds: list[int] = []
    for part in _list(text, str):
        low, _, high = part.partition("-")
        try:
            span = range(int(low), int(high or low) + 1)
        except ValueError:
            raise SystemExit(
                f"--seeds {text}: give numbers or ranges, e.g. 0-15 or 0,1,2"
            ) from None
        seeds += [s for s in span if s not in seeds]
    return seeds


# The claim of a run folder is compare_objectives' (one pid marker per run, created atomically, a
# dead owner's taken over), so both scripts may share an --out and its claims.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_objectives import claim  # noqa: E402

from ibpo.run.version import code_version, describe, from_header  # noqa: E402

# --- running -------------------------------------------------------------------------------------


def is_done(run_dir: Path) -> bool:
    """summary.json is written before the final evaluation too: done means it holds that."""
    try:
        summary = json.loads((run_dir / "train" / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(summary.get("eval_after"))


def execute(run: Run, in_process: bool, threads: int) -> str:
    """Run one study run unless it is done or claimed elsewhere; -> what happened."""
    if is_done(run.dir):
        print(f"[skip] {run.dir.name} is done", flush=True)
        return "done"
    if not claim(run.dir):
        print(f"[skip] {run.dir.name} is claimed by another worker", flush=True)
        return "claimed"
    meta = {"arm": run.arm.name, "regime": run.arm.regime, "seed": run.seed}
    meta["command"] = run.command(threads)
    (run.dir / "study_run.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[run] {run.dir.name}", flush=True)
    try:
        if in_process:  # smoke mode: no interpreter start-up per run
            _train_here(run.args, threads)
        else:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
            cmd = [sys.executable, "-m", "ibpo.cli", "train", *run.args]
            log = (run.dir / "train.log").open("a")
            subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    except subprocess.CalledProcessError as e:  # the others go on; a rerun retries this one
        print(f"[fail] {run.dir.name}: {e} (see {run.dir / 'train.log'})", flush=True)
        return "failed"
    finally:
        (run.dir / ".claimed").unlink(missing_ok=True)
    return "ran"


def _train_here(args: list[str], threads: int) -> None:
    """One run in this process, on `threads` threads like a run's own process (restored after:
    oversubscribed threads on a busy machine make tiny matmuls spin)."""
    import torch

    from ibpo.recipe import load_config
    from ibpo.trainer import train

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        train(load_config(None, args))
    finally:
        torch.set_num_threads(before)


def run_all(runs: list[Run], workers: int, in_process: bool, threads: int) -> dict[str, int]:
    """`workers` threads take runs in order, each run in its own process; -> outcome counts."""
    queue, lock, outcomes = list(runs), threading.Lock(), {}

    def work() -> None:
        while True:
            with lock:
                if not queue:
                    return
                run = queue.pop(0)
            what = execute(run, in_process, threads)
            with lock:
                outcomes[what] = outcomes.get(what, 0) + 1

    if in_process or workers == 1:
        work()
    else:
        pool = [threading.Thread(target=work) for _ in range(workers)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    return outcomes


# --- statistics (scipy's distributions: `pip install 'ibpo[study]'`) -----------------------------


def _stats():
    try:
        from scipy import stats
    except ImportError:
        sys.exit("study.py: the report's statistics need scipy. Fix: pip install 'ibpo[study]'")
    return stats


def t_critical(df: int) -> float:
    """Student's t two-sided 95% quantile with df degrees of freedom; NaN below 1."""
    return float(_stats().t.ppf(0.975, df)) if df >= 1 else math.nan


def sd(values: list[float]) -> float:
    """The sample standard deviation; NaN for fewer than two values."""
    return statistics.stdev(values) if len(values) > 1 else math.nan


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean; one value gives an interval of NaN."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t_critical(len(values) - 1) * sd(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def f_test_greater(sd_a: float, n_a: int, sd_b: float, n_b: int) -> float:
    """One-sided p that sample a's variance exceeds sample b's only by chance: P(F > s_a^2/s_b^2)
    with (n_a - 1, n_b - 1) degrees of freedom (normal samples)."""
    return float(_stats().f.sf((sd_a / sd_b) ** 2, n_a - 1, n_b - 1))


def sign_test(diffs: list[float]) -> float:
    """Exact two-sided sign test of median 0; ties (zero differences) are left out."""
    pos, neg = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n = pos + neg
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(pos, neg) + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap_ci(diffs: list[float], reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED):
    """Percentile bootstrap 95% interval of the mean, from a fixed RNG seed (reproducible)."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(statistics.fmean(rng.choices(diffs, k=n)) for _ in range(reps))
    return means[int(0.025 * reps)], means[min(reps - 1, int(0.975 * reps))]


def seeds_for_half_width(spread: float, half: float = 0.05, most: int = 100_000) -> float:
    """The fewest seeds n whose paired t 95% interval, t(0.975, n - 1) x spread / sqrt(n), is
    at most +-half wide at this spread (the sd of the paired differences); NaN without one."""
    if not spread > 0:
        return math.nan
    n = 2
    while t_critical(n - 1) * spread / math.sqrt(n) > half:
        n += 1
        if n > most:
            return math.nan
    return float(n)


def t_power(n: int, spread: float, delta: float) -> float:
    """The power of the two-sided paired t-test at 0.05 with n pairs to find a true mean
    difference `delta` at this spread: P(|T| > t(0.975, n - 1)) for T noncentral t with n - 1
    degrees of freedom and noncentrality delta sqrt(n) / spread."""
    stats, df = _stats(), n - 1
    crit, shift = t_critical(df), delta * math.sqrt(n) / spread
    return float(stats.nct.sf(crit, df, shift) + stats.nct.cdf(-crit, df, shift))


def seeds_for_power(
    spread: float, delta: float = 0.05, power: float = 0.8, most: int = 100_000
) -> float:
    """The fewest seeds for the paired t-test to find a difference of `delta` with this power;
    NaN without one."""
    if not spread > 0:
        return math.nan
    n = 2
    while t_power(n, spread, delta) < power:
        n += 1
        if n > most:
            return math.nan
    return float(n)


def paired_stats(diffs: list[float]) -> dict:
    """The figures of one list of paired differences: mean, paired t and bootstrap 95%
    intervals, seeds higher / lower / tied and the exact sign test."""
    low, high = bootstrap_ci(diffs)
    _, t_low, t_high = mean_ci(diffs)
    return {
        "diffs": diffs,
        "mean": statistics.fmean(diffs),
        "t_ci": [t_low, t_high],
        "bootstrap_ci": [low, high],
        "wins": sum(d > 0 for d in diffs),
        "losses": sum(d < 0 for d in diffs),
        "ties": sum(d == 0 for d in diffs),
        "sign_p": sign_test(diffs),
    }


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """y at x on the piecewise-linear curve through `points` (x ascending, as compute spent
    only grows). Where several points share x (no compute between two evaluations) the last
    wins: the most trained. x outside the curve is an error: compute is never extrapolated."""
    xs = [p[0] for p in points]
    if not points or x < xs[0] or x > xs[-1]:
        raise ValueError(f"compute {x} is outside the curve's {xs[:1]}..{xs[-1:]}")
    at = [y for px, y in points if px == x]
    if at:
        return at[-1]
    i = next(i for i, px in enumerate(xs) if px > x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def at_equal_compute(a: list, b: list, fraction: float = 1.0) -> tuple[float, float, float]:
    """(budget, accuracy of a, accuracy of b) at `fraction` of the largest compute both curves
    reach: the cheaper run is read at its last evaluation (fraction 1), the other between the
    two evaluations around that budget."""
    budget = fraction * min(a[-1][0], b[-1][0])
    return budget, interpolate(a, budget), interpolate(b, budget)


# --- reading finished runs -----------------------------------------------------------------------


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else 0.0


# The compute axes every comparison is also made at: (name in the report, what one step spends).
# decode: tokens generated (rollout completions, repair completions, dynamic sampling's extra
# rounds); tokens: those plus the prompt tokens the model ran in the rollouts and the repairs (a
# prompt run once for its G samples, or a prefix shared by several repair prompts, counts once);
# seconds: step_time (held-out evaluations and model loading left out).
AXES = {
    "steps": ("steps", lambda row: 1.0),
    "decode": ("decode tokens", lambda row: _num(row.get("generated_tokens"))),
    "tokens": (
        "prompt + decode tokens",
        lambda row: sum(
            _num(row.get(k))
            for k in ("generated_tokens", "rollout_prefill_tokens", "repair_prefill_tokens")
        ),
    ),
    "seconds": ("step seconds", lambda row: _num(row.get("step_time"))),
}
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of a pair's common budget: the curves along the way

STEP_KEYS = (
    "reward",
    "entropy",
    "kl",
    "residual",
    "repairs",
    "repair_success_rate",
    "repair_tokens",
    "truncated",
    "loss",
    "lifted_blame_fraction",  # logged by later versions of the step; None where absent
    "edited_token_fraction",
    "repairs_skipped",  # the repair spending rule's (later versions); None where absent
    "repair_cost_share",
    "repair_probe",
    "repair_running_success",  # the rule's running success rate after the step
    "time_repair",  # seconds of the repair phase and of the whole step, measured in one
    "step_time",  # process: their ratio holds on a busy machine where the seconds do not
)


def _rows(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training rows, periodic evaluation rows) of metrics.jsonl, one per step (a resumed run
    may repeat steps: the last line wins)."""
    train, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        is_eval = all(k == "step" or k.startswith("eval_") for k in row)
        (evals if is_eval else train)[row["step"]] = row
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def compute_at(steps: list[dict], axis: str) -> dict[int, float]:
    """{step: the compute spent through that step} on one axis (AXES), step 0 included."""
    spent, total = {0: 0.0}, 0.0
    for row in steps:
        total += AXES[axis][1](row)
        spent[row["step"]] = total
    return spent


def spent_by(spent: dict[int, float], step: int) -> float:
    """The compute spent through `step`: that of the last logged step at or before it."""
    return spent[max(s for s in spent if s <= step)]


def on_axis(steps: list[dict], axis: str, curve: list) -> tuple[list, float]:
    """(the held-out accuracy curve against the compute spent on `axis`, the compute spent
    through the curve's last step) for a run's training rows and its (step, accuracy) curve."""
    spent = compute_at(steps, axis)
    return [(spent_by(spent, st), acc) for st, acc in curve], spent_by(spent, curve[-1][0])


def read_code(run_dir: Path, summary: dict) -> dict | None:
    """The code a run ran (commit, dirty tree): summary.json's, else config.yaml's first line;
    None for a run from before the trainer recorded it."""
    if isinstance(summary.get("code"), dict):
        return summary["code"]
    try:
        return from_header((run_dir / "train" / "config.yaml").read_text())
    except OSError:
        return None


def read_run(run_dir: Path) -> dict:
    """One finished run's figures for study.json."""
    meta = json.loads((run_dir / "study_run.json").read_text())
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    steps, evals = _rows(run_dir / "train")
    before = (summary.get("eval_before") or {}).get("accuracy")
    after = summary["eval_after"]["accuracy"]
    curve = ([(0, before)] if before is not None else []) + [
        (e["step"], e["eval_accuracy"]) for e in evals
    ]
    curve.append((summary["steps"], after))
    cumulative, total = {0: 0.0}, 0.0
    for row in steps:
        total += row.get("generated_tokens") or 0.0
        cumulative[row["step"]] = total
    col = {k: [row.get(k) for row in steps] for k in STEP_KEYS}
    axes = {axis: on_axis(steps, axis, curve) for axis in AXES}
    return {
        **{k: meta[k] for k in ("arm", "regime", "seed", "command")},
        "dir": str(run_dir),
        "n_eval": summary["eval_after"]["n"],
        "before": before,
        "after": after,
        "gain": None if before is None else after - before,
        "curve": curve,
        "token_curve": [(cumulative.get(s, total), acc) for s, acc in curve],
        **col,
        "generated_tokens": total,  # rollouts + repairs (+ dynamic sampling's extra rounds)
        "repair_tokens_total": sum(x or 0.0 for x in col["repair_tokens"]),
        "repair_success": pooled_repair_success(col["repairs"], col["repair_success_rate"]),
        "wall": summary.get("wall_seconds"),
        # held-out accuracy against each compute axis: (compute spent, accuracy) per evaluation
        "compute_curves": {a: axes[a][0] for a in AXES},
        "compute": {a: axes[a][1] for a in AXES},
        "rollout_prefill_tokens": sum(_num(r.get("rollout_prefill_tokens")) for r in steps),
        "repair_prefill_tokens": sum(_num(r.get("repair_prefill_tokens")) for r in steps),
        # the repair prompts' tokens (before shared prefixes; older runs logged only the prefill)
        "repair_prompt_tokens": sum(
            _num(r.get("repair_prompt_tokens", r.get("repair_prefill_tokens"))) for r in steps
        ),
        # older runs did not log the rollouts' prompt tokens: their prompt + decode axis lacks them
        "rollout_prompts_recorded": all("rollout_prefill_tokens" in r for r in steps),
        "repair_prompts_recorded": all(
            "repair_prefill_tokens" in r for r in steps if _num(r.get("repairs")) > 0
        ),
        "code": read_code(run_dir, summary),
        "min_success": repair_floor(run_dir / "train" / "config.yaml"),
    }


def repair_floor(config: Path) -> float | None:
    """The run's `repair.min_success` (the spending rule's floor) from its saved config; None
    for runs of versions without the rule or without a saved config."""
    if not config.is_file():
        return None
    repair = (yaml.safe_load(config.read_text()) or {}).get("repair") or {}
    return repair.get("min_success")


def pooled_repair_success(repairs: list, rates: list) -> float | None:
    """Successful repairs over attempted ones across a run's steps (None without repairs). Not
    the mean of the per-step rates, which weighs a step with 2 attempts like one with 16."""
    attempted = sum(n or 0.0 for n in repairs)
    if not attempted:
        return None
    return sum((n or 0.0) * (r or 0.0) for n, r in zip(repairs, rates)) / attempted


# what a timed run must repeat, step by step, to lend a run its step seconds (take_seconds)
REPRODUCED = ("loss", "reward", "repairs", "repair_tokens")


def take_seconds(record: dict, reruns: list[Path]) -> None:
    """A run's step seconds from a timed run of it (a finished run folder, e.g. a rerun with one
    thread on an idle machine and no periodic evaluations): the first of `reruns` that took the
    same steps, the same number, the same loss, reward, repairs and repair tokens at every
    one (equal floats: the run reproduced). Loss and reward alone are not enough: repairs that
    all fail leave them as they were, so a run with more of them would pass for one with fewer.
    Without one the run has no step seconds (None), and is left out of comparisons on them."""
    record["seconds_from"] = None
    same = False
    for rerun in filter(is_done, reruns):
        steps = _rows(rerun / "train")[0]
        same = all([r.get(k) for r in steps] == record[k] for k in REPRODUCED)
        if same:
            break
    if not same:
        record["compute"]["seconds"] = None
        record["compute_curves"]["seconds"] = None
        record["step_time"] = record["time_repair"] = None
        return
    seconds_curve, seconds = on_axis(steps, "seconds", record["curve"])
    record["compute_curves"]["seconds"], record["compute"]["seconds"] = seconds_curve, seconds
    record["step_time"] = [r.get("step_time") for r in steps]
    record["time_repair"] = [r.get("time_repair") for r in steps]
    record["seconds_from"] = str(rerun)


def collect(out: Path, seconds_from: list[Path] = ()) -> tuple[list[dict], list[str]]:
    """(every finished run under <out>, the folders not finished) from the folders alone; with
    `seconds_from` (study folders), each run's step seconds are those of the first timed run of
    it there that reproduced it (take_seconds)."""
    done, pending = [], []
    for meta in sorted(out.glob("*/*/study_run.json")):
        (done if is_done(meta.parent) else pending).append(meta.parent)
    records = [read_run(d) for d in done]
    if seconds_from:
        for record, d in zip(records, done):
            take_seconds(record, [folder / d.relative_to(out) for folder in seconds_from])
    order = {r: i for i, r in enumerate(REGIME_ORDER)}
    records.sort(key=lambda r: (order.get(r["regime"], 99), r["arm"], r["seed"]))
    return records, [str(d) for d in pending]


def by_arm(records: list[dict]) -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {}
    for r in records:
        arms.setdefault(r["arm"], []).append(r)
    return arms


# --- the report ----------------------------------------------------------------------------------


def _f(x, fmt: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{fmt}}"


def _ci(values: list[float], fmt: str = "+.3f") -> str:
    mean, low, high = mean_ci(values)
    return f"{_f(mean, fmt)} [{_f(low, fmt)}, {_f(high, fmt)}]"


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else math.nan


def arm_table(arms: dict[str, list[dict]]) -> str:
    lines = [
        "| arm | regime | seeds | final held-out acc. [95% CI] | held-out acc. per evaluation "
        "| gain [95% CI] | generated tokens | repair success (runs' range) | final entropy "
        "| mean KL | mean residual | truncated, step 1 -> 20 | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        gains = [r["gain"] for r in runs if r["gain"] is not None]
        after = _ci([r["after"] for r in runs], ".3f")
        lines.append(
            f"| {name} | {runs[0]['regime']} | {len(runs)} | {after} "
            f"| {' -> '.join(f'{y:.3f}' for y in _mean_curve(runs, 'curve')[1])} "
            f"| {_ci(gains) if gains else 'n/a'} "
            f"| {_mean(r['generated_tokens'] for r in runs):,.0f} "
            f"| {_repair_success(runs)} "
            f"| {_f(_mean(r['entropy'][-1] for r in runs if r['entropy']))} "
            f"| {_f(_mean(_mean(r['kl']) for r in runs), '.4f')} "
            f"| {_f(_mean(_mean(r['residual']) for r in runs), '.4f')} "
            f"| {_truncated(runs)} "
            f"| {_f(_mean(r['wall'] for r in runs), '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def _wall_line(runs: list[dict]) -> str:
    """How long the runs took: minutes per run (each its own process) and their sum in hours."""
    walls = sorted(r["wall"] / 60 for r in runs if r.get("wall") is not None)
    if not walls:
        return ""
    return (
        f"Wall time per run: {walls[0]:.1f}-{walls[-1]:.1f} min, median "
        f"{statistics.median(walls):.1f}; {sum(walls) / 60:.1f} hours in all.\n"
    )


def _repair_success(runs: list[dict]) -> str:
    """The mean over seeds of each run's pooled repair success, and the runs' lowest and highest."""
    rates = [r["repair_success"] for r in runs if r.get("repair_success") is not None]
    if not rates:
        return "n/a"
    return f"{_mean(rates):.3f} ({min(rates):.3f}-{max(rates):.3f})"


def _truncated(runs: list[dict]) -> str:
    """Share of training completions cut at the token limit, first step -> last, over seeds."""
    cols = [r["truncated"] for r in runs if r.get("truncated") and None not in r["truncated"]]
    if not cols:
        return "n/a"
    return f"{_mean(c[0] for c in cols):.1%} -> {_mean(c[-1] for c in cols):.1%}"


def compare(arms: dict[str, list[dict]], a: str, b: str) -> dict | None:
    """Paired per-seed differences a - b of the final held-out accuracy (seeds in both)."""
    if a not in arms or b not in arms:
        return None
    left, right = ({r["seed"]: r["after"] for r in arms[x]} for x in (a, b))
    seeds = sorted(set(left) & set(right))
    if not seeds:
        return None
    diffs = [left[s] - right[s] for s in seeds]
    rewards = [({r["seed"]: r["reward"] for r in arms[x]}) for x in (a, b)]
    pairs = [list(zip(rewards[0][s], rewards[1][s])) for s in seeds]
    return {
        "a": a,
        "b": b,
        "seeds": seeds,
        **paired_stats(diffs),
        # how closely the pair's runs tracked each other: their training rewards, step by step
        "reward_gap": _mean(_mean(abs(x - y) for x, y in p[1:]) for p in pairs),
        "equal_reward_steps": [sum(x == y for x, y in p) for p in pairs],
    }


def compare_at(arms: dict[str, list[dict]], a: str, b: str, axis: str) -> dict | str:
    """Paired per-seed differences a - b of the held-out accuracy at equal compute on one axis
    (AXES): per seed, both runs read at the largest budget both reached (at_equal_compute),
    and along the way at FRACTIONS of it. Where they cannot be compared, why (a sentence for
    the report): an arm is missing, no seed has both, a run spent nothing on the axis (it did
    not log it), for prompt + decode tokens a run did not log the prompt tokens of its rollouts
    or its repairs (an axis that counts one arm's repair prompts and neither arm's rollout
    prompts would favour the arm without repairs), or the pair's curves do not both reach
    their common budget (a curve starts at its first evaluation and is never extrapolated)."""
    if a not in arms or b not in arms:
        return "an arm has no finished runs"
    left, right = ({r["seed"]: r for r in arms[x]} for x in (a, b))

    def has(run: dict) -> bool:  # None: step seconds taken from no rerun (take_seconds)
        return (run.get("compute") or {}).get(axis) is not None

    seeds = sorted(s for s in set(left) & set(right) if has(left[s]) and has(right[s]))
    pairs = [(left[s], right[s]) for s in seeds]
    runs = [r for p in pairs for r in p]
    if not runs:
        return f"no seed has both runs' {AXES[axis][0]}" + (
            " (no rerun reproduced the pair)" if axis == "seconds" else ""
        )
    if any(not r.get("compute_curves") or not r["compute"][axis] > 0 for r in runs):
        return f"a run logged no {AXES[axis][0]}"
    if axis == "tokens" and not all(_prompts_recorded(r) for r in runs):
        return (
            "their runs did not log the prompt tokens of their rollouts "
            "(`rollout_prefill_tokens`) or repairs (`repair_prefill_tokens`), and an axis that "
            "counts one arm's repair prompts and neither arm's rollout prompts would favour the "
            "arm without repairs"
        )
    curves = [(x["compute_curves"][axis], y["compute_curves"][axis]) for x, y in pairs]
    along = {}
    for f in FRACTIONS:
        # a curve starts at its first evaluation (compute 0 with the evaluation before training):
        # a budget below it is not read, never extrapolated
        if any(f * min(ca[-1][0], cb[-1][0]) < max(ca[0][0], cb[0][0]) for ca, cb in curves):
            continue
        read = [at_equal_compute(ca, cb, f) for ca, cb in curves]
        along[f] = ([ya - yb for _, ya, yb in read], [budget for budget, _, _ in read])
    if 1.0 not in along:
        return (
            "a pair's held-out curves do not both reach the budget they share (a run evaluated "
            "only at its end has one point, at what it spent)"
        )
    diffs, budgets = along[1.0]
    return {
        "a": a,
        "b": b,
        "axis": axis,
        "seeds": seeds,
        **paired_stats(diffs),
        "budgets": budgets,  # per seed: the compute both runs reached, where they are compared
        "ratios": [x["compute"][axis] / y["compute"][axis] for x, y in pairs],  # a / b spent
        "along": {str(f): {**paired_stats(d), "budgets": bs} for f, (d, bs) in along.items()},
    }


def _prompts_recorded(run: dict) -> bool:
    return run["rollout_prompts_recorded"] and run["repair_prompts_recorded"]


def verdict(c: dict) -> str:
    """'higher', 'lower' (the paired t 95% interval excludes 0) or 'no difference'."""
    if not significant(c):
        return "no difference"
    return "higher" if c["mean"] > 0 else "lower"


def significant(c: dict) -> bool:
    """The verdict: the paired t 95% interval excludes 0 (a two-sided paired t-test at 0.05).
    The sign test cannot go below 0.0625 with 5 seeds, and a percentile bootstrap of 5 values
    is too narrow: it takes the seeds' spread as known, so at n = 5 its interval is about 0.63
    times the t-interval's width (sqrt(4/5) x 1.96 / 2.776). Both are reported beside it;
    neither decides."""
    low, high = c["t_ci"]
    return not (math.isnan(low) or low <= 0 <= high)


def sentence(label: str, c: dict) -> str:
    """One plain sentence: the difference, its intervals and whether it is significant."""
    n, (low, high), (t_low, t_high) = len(c["seeds"]), c["bootstrap_ci"], c["t_ci"]
    floor = min(1.0, 2 / 2**n)  # the sign test's smallest p: every seed on one side
    return (
        f"**{label}**: mean difference {c['mean']:+.3f} over {n} seeds ({c['wins']} higher, "
        f"{c['losses']} lower, {c['ties']} tied); paired t 95% CI [{_f(t_low, '+.3f')}, "
        f"{_f(t_high, '+.3f')}], so it is {'' if significant(c) else 'not '}significant at 0.05; "
        f"sign test p = {c['sign_p']:.3f} (its floor with {n} seeds: {floor:.4f}); bootstrap "
        f"95% CI [{low:+.3f}, {high:+.3f}]."
    )


def comparisons_md(comps: list[tuple[str, dict]]) -> str:
    if not comps:
        return "No comparison has finished runs in both arms yet.\n"
    lines = [
        "| comparison | seeds | mean diff. | paired t 95% CI | bootstrap 95% CI "
        "| higher / lower / tied | sign p | significant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, c in comps:
        lo, hi = c["bootstrap_ci"]
        t_lo, t_hi = c["t_ci"]
        lines.append(
            f"| {label} | {len(c['seeds'])} | {c['mean']:+.3f} "
            f"| [{_f(t_lo, '+.3f')}, {_f(t_hi, '+.3f')}] | [{lo:+.3f}, {hi:+.3f}] "
            f"| {c['wins']} / {c['losses']} / {c['ties']} | {c['sign_p']:.3f} "
            f"| {'yes' if significant(c) else 'no'} |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(f"* {sentence(lb, c)}" for lb, c in comps) + "\n"


def equal_compute_md(
    comps: list[tuple[str, dict[str, dict]]], missing: list[tuple[str, str, str]] = ()
) -> str:
    """Every comparison at equal steps, decode tokens, prompt + decode tokens and step
    seconds: the paired figures at each pair's common budget, why a comparison is missing on
    an axis (`missing`: label, axis, reason), then the mean difference along the way, then the
    comparisons whose verdict depends on the axis."""
    if not comps:
        return "No comparison has finished runs in both arms yet.\n"
    lines = [
        "| comparison | at equal | seeds | a / b compute spent (mean, range) "
        "| compared at (mean per pair) | mean diff. | paired t 95% CI | bootstrap 95% CI "
        "| higher / lower / tied | sign p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, by_axis in comps:
        for axis, c in by_axis.items():
            name = AXES[axis][0]
            (t_lo, t_hi), (lo, hi), r = c["t_ci"], c["bootstrap_ci"], c["ratios"]
            lines.append(
                f"| {label} | {name} | {len(c['seeds'])} "
                f"| {statistics.fmean(r):.2f}x ({min(r):.2f}-{max(r):.2f}) "
                f"| {_budget(statistics.fmean(c['budgets']), axis)} | {c['mean']:+.3f} "
                f"| [{_f(t_lo, '+.3f')}, {_f(t_hi, '+.3f')}] | [{lo:+.3f}, {hi:+.3f}] "
                f"| {c['wins']} / {c['losses']} / {c['ties']} | {c['sign_p']:.3f} "
                f"| {verdict(c)} |"
            )
    lines += [f"\n{label}, not at equal {AXES[axis][0]}: {why}." for label, axis, why in missing]
    head = " | ".join(f"{f:.0%}" for f in FRACTIONS)
    lines += [
        "\nAlong the way: the mean difference [paired t 95% CI] at fractions of each pair's "
        "common budget.\n",
        f"| comparison | at equal | {head} |",
        "|---|---|" + "---|" * len(FRACTIONS),
    ]
    for label, by_axis in comps:
        for axis, c in by_axis.items():
            cells = [
                _ci_of(c["along"][str(f)]) if str(f) in c["along"] else "n/a" for f in FRACTIONS
            ]
            lines.append(f"| {label} | {AXES[axis][0]} | {' | '.join(cells)} |")
    differ = [
        f"* **{label}**: "
        + "; ".join(f"{verdict(c)} at equal {AXES[axis][0]}" for axis, c in by_axis.items())
        for label, by_axis in comps
        if len({verdict(c) for c in by_axis.values()}) > 1
    ]
    lines.append("")
    if differ:
        lines += ["Verdicts that depend on what is held equal:\n", *differ]
    else:
        lines.append("No verdict depends on what is held equal.")
    return "\n".join(lines) + "\n"


def _budget(x: float, axis: str) -> str:
    return f"{x:,.1f} s" if axis == "seconds" else f"{x:,.0f} {AXES[axis][0].split()[-1]}"


def _ci_of(c: dict) -> str:
    t_lo, t_hi = c["t_ci"]
    return f"{c['mean']:+.3f} [{_f(t_lo, '+.3f')}, {_f(t_hi, '+.3f')}]"


def compute_md(arms: dict[str, list[dict]]) -> str:
    """What each arm spent per run: mean over its runs (lowest-highest). Prompt tokens run: those
    the model computed (a prompt run once for its G samples, a shared prefix once); the repair
    prompts' own tokens beside them."""
    lines = [
        "| arm | runs | steps | decode tokens | rollout prompt tokens run | repair prompt tokens "
        "| of which run | prompt + decode tokens run | step seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(values: list, fmt: str = ",.0f") -> str:
        known = [v for v in values if v is not None]  # step seconds from no rerun: None
        if not known:
            return "n/a"
        text = f"{statistics.fmean(known):{fmt}} ({min(known):{fmt}}-{max(known):{fmt}})"
        return text if len(known) == len(values) else f"{text}, {len(known)} runs"

    for name, runs in arms.items():
        if not all(r.get("compute") for r in runs):
            continue
        spent = {a: [r["compute"][a] for r in runs] for a in AXES}
        recorded = all(r["rollout_prompts_recorded"] for r in runs)
        rollout = cell([r["rollout_prefill_tokens"] for r in runs]) if recorded else "not logged"
        repaired = all(r["repair_prompts_recorded"] for r in runs)
        prompts = cell([r["repair_prompt_tokens"] for r in runs]) if repaired else "not logged"
        ran = cell([r["repair_prefill_tokens"] for r in runs]) if repaired else "not logged"
        both = cell(spent["tokens"]) if recorded and repaired else "n/a"
        lines.append(
            f"| {name} | {len(runs)} | {cell(spent['steps'])} | {cell(spent['decode'])} "
            f"| {rollout} | {prompts} | {ran} | {both} "
            f"| {cell(spent['seconds'], ',.1f')} |"
        )
    return "\n".join(lines) + "\n"


def code_md(records: list[dict]) -> str:
    """Which code the runs ran: each commit (and tree state) with its runs."""
    seen: dict[str, list[str]] = {}
    for r in records:
        seen.setdefault(describe(r.get("code")), []).append(f"{r['arm']}-s{r['seed']}")
    lines = ["| code | runs |", "|---|---|"]
    lines += [f"| {code} | {len(runs)}: {' '.join(runs)} |" for code, runs in seen.items()]
    return "\n".join(lines) + "\n"


def tokens_md(arms: dict[str, list[dict]]) -> str:
    """Accuracy against generated tokens: the budget each arm really spent."""
    ref = (
        _mean(r["generated_tokens"] for r in arms.get("on-dfpo", [])) if "on-dfpo" in arms else None
    )
    lines = [
        "| arm | generated tokens per run | x on-dfpo | repair tokens | final acc. | gain "
        "| gain per 100k tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        tokens = _mean(r["generated_tokens"] for r in runs)
        gain = _mean(r["gain"] for r in runs)
        ratio = tokens / ref if ref else math.nan
        lines.append(
            f"| {name} | {tokens:,.0f} | {_f(ratio, '.2f')} "
            f"| {_mean(r['repair_tokens_total'] for r in runs):,.0f} "
            f"| {_f(_mean(r['after'] for r in runs))} | {_f(gain, '+.3f')} "
            f"| {_f(gain / tokens * 1e5 if tokens else math.nan, '+.3f')} |"
        )
    return "\n".join(lines) + "\n"


def first_difference(a: dict, b: dict, keys=("loss", "entropy", "reward")) -> int | None:
    """The first step at which two runs' logged figures differ (None: identical throughout). Runs
    of one seed draw the same samples, so two arms that differ only in a term that never acts
    produce identical logs, digit for digit. The loss shows a difference at the step it happens;
    entropy and reward from the next."""
    keys = [k for k in keys if a.get(k) and b.get(k) and None not in a[k] + b[k]]

    def rows(r: dict) -> list[tuple]:
        return list(zip(*(r[k] for k in keys)))

    for step, (x, y) in enumerate(zip(rows(a), rows(b)), start=1):
        if x != y:
            return step
    return None


def mask_md(arms: dict[str, list[dict]]) -> str:
    """Did Part 2's edit mask act? Per seed: the steps with a successful repair in `on-ibpo`, and
    the first step at which it and shaping only (the same run with the mask off) part."""
    ibpo = {r["seed"]: r for r in arms.get("on-ibpo", [])}
    shaping = {r["seed"]: r for r in arms.get("ablation-shaping-only", [])}
    seeds = sorted(set(ibpo) & set(shaping))
    if not seeds:
        return "Needs finished `on-ibpo` and `ablation-shaping-only` runs of one seed.\n"
    lines = [
        "| seed | steps with a successful repair | first step where ibpo and shaping only differ "
        "| final acc. ibpo | final acc. shaping only |",
        "|---|---|---|---|---|",
    ]
    for seed in seeds:
        a, b = ibpo[seed], shaping[seed]
        ok = sum(1 for x in a.get("repair_success_rate") or [] if x)
        step = first_difference(a, b)
        lines.append(
            f"| {seed} | {ok} of {len(a.get('reward') or [])} "
            f"| {'never: the mask did not act' if step is None else step} "
            f"| {_f(a['after'])} | {_f(b['after'])} |"
        )
    return "\n".join(lines) + "\n"


def repairs_md(arms: dict[str, list[dict]]) -> str:
    """Per run of an arm that repairs: repair success (pooled), locality (the share of an
    attempt's tokens its most local successful repair kept, mean over the steps with a success)
    and the mask's action (steps where it lowered some blame; the share of completion tokens
    whose blame it lowered, mean over steps); what the repairs cost: their share of the step's
    generated tokens (mean over steps) and of its seconds (the run's repair seconds over its
    step seconds)."""
    lines = [
        "| arm | seed | repairs | skipped | success | steps with a success | locality (kept) "
        "| steps the mask acted | lifted blame (mean share) | cost share | seconds share "
        "| final acc. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        for r in runs:
            attempted = sum(x or 0.0 for x in r.get("repairs") or [])
            if not attempted:
                continue
            rates = r.get("repair_success_rate") or []
            edited = r.get("edited_token_fraction") or []
            kept = [1.0 - e for ok, e in zip(rates, edited) if ok and e is not None]
            lifted = [x for x in r.get("lifted_blame_fraction") or [] if x is not None]
            acted = sum(1 for x in lifted if x > 0)
            skipped = [x for x in r.get("repairs_skipped") or [] if x is not None]
            share = [x for x in r.get("repair_cost_share") or [] if x is not None]
            timed = [
                (rep, step)
                for rep, step in zip(r.get("time_repair") or [], r.get("step_time") or [])
                if rep is not None and step
            ]
            seconds = sum(t[0] for t in timed) / sum(t[1] for t in timed) if timed else None
            lines.append(
                f"| {name} | {r['seed']} | {attempted:.0f} "
                f"| {f'{sum(skipped):.0f}' if skipped else 'n/a'} | {_f(r['repair_success'])} "
                f"| {sum(1 for x in rates if x)} of {len(rates)} "
                f"| {_f(statistics.fmean(kept)) if kept else '-'} "
                f"| {acted if lifted else 'n/a'} of {len(lifted) if lifted else len(rates)} "
                f"| {_f(statistics.fmean(lifted), '.4f') if lifted else 'n/a'} "
                f"| {_f(statistics.fmean(share), '.2f') if share else 'n/a'} "
                f"| {'n/a' if seconds is None else _f(seconds, '.2f')} "
                f"| {_f(r['after'])} |"
            )
    if len(lines) == 2:
        return "No finished run repaired.\n"
    return "\n".join(lines) + "\n" + spending_md(arms)


def spending_md(arms: dict[str, list[dict]]) -> str:
    """What the repair spending rule did, per arm that ran it, summed over its runs: repairs
    run and skipped, their success, the steps that repaired; with a floor, how many of those
    were probes and the steps after which the running success rate was under the run's floor
    (without one, only the budget skipped repairs)."""
    lines = []
    for name, runs in arms.items():
        # runs of versions with the rule (they log what it skipped) that planned repairs
        ruled = [
            r
            for r in runs
            if any(x is not None for x in r.get("repairs_skipped") or [])
            and any(_num(x) > 0 for k in ("repairs", "repairs_skipped") for x in r[k] or [])
        ]
        if not ruled:
            continue
        steps = sum(len(r["repairs"]) for r in ruled)
        ran = sum(_num(x) for r in ruled for x in r["repairs"])
        skipped = sum(_num(x) for r in ruled for x in r["repairs_skipped"])
        rate = pooled_repair_success(
            [n for r in ruled for n in r["repairs"]],
            [p for r in ruled for p in r["repair_success_rate"]],
        )
        ok = (rate or 0.0) * ran
        repaired = sum(1 for r in ruled for x in r["repairs"] if _num(x) > 0)
        planned = ran + skipped
        floors = sorted({r.get("min_success") or 0.0 for r in ruled})
        line = (
            f"* {name}, {len(ruled)} runs, {steps} steps (floor {', '.join(map(str, floors))}): "
            f"{ran:.0f} repairs ran and {skipped:.0f} were skipped "
            f"({_f(skipped / planned if planned else None, '.0%')} of those planned); "
            f"{ok:.0f} of the {ran:.0f} succeeded ({_f(ok / ran if ran else None, '.0%')}). "
            f"Repairs ran at {repaired} steps"
        )
        if all(r.get("min_success") for r in ruled):
            probes = sum(1 for r in ruled for x in r.get("repair_probe") or [] if _num(x) > 0)
            under = sum(
                1
                for r in ruled
                for x in r.get("repair_running_success") or []
                if x is not None and x < r["min_success"]
            )
            line += (
                f", {probes} of them probes; the running success rate was under the floor "
                f"after {under} of the {steps} steps."
            )
        elif not any(r.get("min_success") for r in ruled):
            line += "; with no floor, only the budget skipped repairs."
        else:
            line += "; some runs had no floor, so probes and steps under it are not counted."
        lines.append(line)
    if not lines:
        return ""
    return "\nThe repair spending rule, summed over each arm's runs:\n\n" + "\n".join(lines) + "\n"


_THREADS = re.compile(r"(?:^|\s)OMP_NUM_THREADS=(\d+)(?:\s|$)")


def run_threads(record: dict) -> int | None:
    """The OMP_NUM_THREADS a run's process had (its command line), None when not recorded."""
    m = _THREADS.search(record.get("command") or "")
    return int(m.group(1)) if m else None


def mixed_threads(records: list[dict]) -> str:
    """A warning for the top of the report when the runs computed at different thread counts
    (a matmul's summation order follows its threads, so the same run at 1 and 2 threads can
    end elsewhere: their differences are then partly the threads'), naming each count's runs;
    "" when every run had the same."""
    counts: dict[int | None, dict[str, list[int]]] = {}
    for r in records:
        counts.setdefault(run_threads(r), {}).setdefault(r["arm"], []).append(r["seed"])
    if len(counts) < 2:
        return ""
    parts = []
    for n, arms in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        who = "; ".join(f"{arm} seeds {seed_ranges(sorted(seeds))}" for arm, seeds in arms.items())
        parts.append(f"{'unrecorded' if n is None else n} thread{'s' * (n != 1)}: {who}")
    return (
        "**Warning: these runs computed at different thread counts** (OMP_NUM_THREADS), which "
        "changes what a run computes, not only its seconds: rerun them at one count before "
        "reading a difference between arms. " + " | ".join(parts) + "\n"
    )


def commands_md(records: list[dict]) -> str:
    """The command lines, compactly: the part every run shares, then each arm's own overrides;
    study.json keeps every run's exact line."""
    if not records:
        return ""
    split = [shlex.split(r["command"]) for r in records]
    shared = [t for t in split[0] if all(t in other for other in split[1:])]
    per_run = ("train.seed=", "run.output_dir=", "run.resume_from=")
    shared = [t for t in shared if not t.startswith(per_run)]
    lines = ["Every run is one process:\n", "```bash", shlex.join(shared) + " \\"]
    lines.append(
        "    <arm's overrides> train.seed=<seed> "
        "run.output_dir=<out>/<runs|sweep>/<arm>-s<seed>/train run.resume_from=latest"
    )
    lines += ["```\n", "| arm | its overrides |", "|---|---|"]
    by_arm: dict[str, list[tuple[int, list[str]]]] = {}
    for r, tokens in zip(records, split):
        own = [t for t in tokens if t not in shared and not t.startswith(per_run)]
        by_arm.setdefault(r["arm"], []).append((r["seed"], own))
    for arm, runs in by_arm.items():
        common = [t for t in runs[0][1] if all(t in own for _, own in runs[1:])]
        varying: dict[str, list[int]] = {}  # an override some of the arm's runs had
        for seed, own in runs:
            for t in own:
                if t not in common:
                    varying.setdefault(t, []).append(seed)
        cell = f"`{shlex.join(common)}`"
        if varying:
            cell += "; by seed: " + ", ".join(
                f"`{t}` (seeds {seed_ranges(seeds)})" for t, seeds in sorted(varying.items())
            )
        lines.append(f"| {arm} | {cell} |")
    return "\n".join(lines) + "\n"


def seed_ranges(seeds: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    for seed in sorted(set(seeds)):
        if out and seed == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{seed}"
        else:
            out.append(str(seed))
    return ", ".join(out)


def spread_md(arms: dict[str, list[dict]], comps: list[tuple[str, dict]]) -> str:
    """What the design can resolve: the spread over seeds per arm, and per comparison the
    seeds a paired t 95% interval of half-width 0.05 would need at that spread (the fewest n
    with t(0.975, n - 1) sd / sqrt(n) <= 0.05) and those the paired t-test needs to find a true
    difference of 0.05 with 80% power."""
    lines = [
        "| arm or comparison | sd over seeds | seeds for a +-0.05 t-interval "
        "| seeds for 80% power at 0.05 | training reward gap, steps 2+ "
        "| steps with equal training reward, per seed |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        lines.append(f"| {name} (final acc.) | {_f(sd([r['after'] for r in runs]))} | | | | |")
    for label, c in comps:
        spread = sd(c["diffs"])
        equal = " ".join(map(str, c.get("equal_reward_steps", [])))
        lines.append(
            f"| {label} | {_f(spread)} | {_f(seeds_for_half_width(spread), '.0f')} "
            f"| {_f(seeds_for_power(spread), '.0f')} | {_f(c.get('reward_gap'))} | {equal} |"
        )
    return "\n".join(lines) + "\n"


def sweep_md(arms: dict[str, list[dict]]) -> str:
    lines = [
        "| arm | seed | before | after | gain | min held-out acc. | final entropy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        for r in runs:
            lines.append(
                f"| {name} | {r['seed']} | {_f(r['before'])} | {_f(r['after'])} "
                f"| {_f(r['gain'], '+.3f')} | {_f(min(acc for _, acc in r['curve']))} "
                f"| {_f(r['entropy'][-1] if r['entropy'] else None)} |"
            )
    return "\n".join(lines) + "\n"


EQUAL_COMPUTE_NOTE = (
    "Each comparison again, holding steps, decode tokens (rollout and repair completions, "
    "dynamic sampling's extra rounds), prompt + decode tokens (with the prompt tokens the "
    "model ran in rollouts and repairs: a prompt run once for its G samples, or a prefix "
    "shared by several repair prompts, counts once) or step seconds (the sum of step times; "
    "evaluations and loading left out; they depend on what else the machine ran) equal. Per "
    "seed, both runs are read at the largest budget both reached: the run that spent less at "
    "its final evaluation, the other on the straight line between its two evaluations around "
    "that budget (its held-out accuracy curve against compute spent, linearly interpolated; "
    "step 0 is the accuracy before training, at compute 0). The paired differences are then "
    "judged as above. a / b compute spent: per seed, what run a spent over what run b spent "
    "by the end.\n"
)


def _seconds_note(runs: list[dict]) -> str:
    """Where the step seconds come from, when they come from timed runs (take_seconds)."""
    if not any("seconds_from" in r for r in runs):
        return ""
    # the study folder each run's timed run came from (<folder>/runs/<arm>-s<seed>)
    folders = Counter(
        str(Path(r["seconds_from"]).parents[1]) for r in runs if r.get("seconds_from")
    )
    per = ", ".join(f"{n} from {folder}" for folder, n in sorted(folders.items()))
    taken = sum(folders.values())
    return (
        f"\nStep seconds here are those of timed runs ({per or 'none found'}): {taken} of "
        f"{len(runs)} runs have a timed run that took the same steps (the same loss, reward, "
        "repairs and repair tokens at every step), and its step seconds replace the run's own; "
        "the other runs are left out of the comparisons at equal step seconds and of the "
        "seconds figures.\n"
    )


def at_each_axis(
    arms: dict[str, list[dict]],
) -> tuple[list[tuple[str, dict[str, dict]]], list[tuple[str, str, str]]]:
    """Each comparison on every axis it can be made on, and (label, axis, why) for the axes it
    cannot, for comparisons made on at least one."""
    equal, missing = [], []
    for label, a, b in COMPARISONS:
        found = {axis: compare_at(arms, a, b, axis) for axis in AXES}
        made = {axis: c for axis, c in found.items() if isinstance(c, dict)}
        if made:
            equal.append((label, made))
            missing += [(label, axis, why) for axis, why in found.items() if axis not in made]
    return equal, missing


def build_report(records: list[dict], pending: list[str]) -> tuple[dict, str]:
    """(study.json's content, study.md's text) from the finished runs."""
    main_runs = [r for r in records if r["regime"] != SWEEP]
    arms, sweep = by_arm(main_runs), by_arm([r for r in records if r["regime"] == SWEEP])
    comps = [(lb, c) for lb, a, b in COMPARISONS if (c := compare(arms, a, b))]
    equal, missing = at_each_axis(arms)
    before = sorted({r["before"] for r in records if r["before"] is not None})
    n_eval = sorted({r["n_eval"] for r in records})
    md = ["# IBPO study\n"]
    md.append(
        f"Held-out problems per evaluation: {', '.join(map(str, n_eval)) or 'n/a'} (greedy); "
        f"accuracy before training: {', '.join(f'{b:.3f}' for b in before) or 'n/a'}. "
        "Intervals over seeds are 95% t-intervals of the mean; paired differences are of the "
        "final held-out accuracy, seed by seed, judged by their paired t 95% interval (a "
        "difference is significant at 0.05 when it excludes 0), with an exact two-sided sign "
        f"test and a percentile bootstrap ({BOOTSTRAP_REPS:,} resamples, RNG seed "
        f"{BOOTSTRAP_SEED}) beside it.\n"
    )
    if mixed := mixed_threads(main_runs):
        md.append(mixed)
    if pending:
        md.append(
            f"**{len(pending)} runs are not finished** and are left out: "
            + ", ".join(Path(p).name for p in pending)
            + "\n"
        )
    if arms:
        md += [
            "## Per arm\n",
            "Means over seeds. Repair success: successful repairs over attempted ones, pooled over"
            " a run's steps. Entropy: the last step's; KL (to the reference) and the cancellation"
            " residual: means over steps; truncated: the share of training completions cut at the"
            " token limit.\n",
            arm_table(arms),
            _wall_line(main_runs),
        ]
        md += ["## Paired differences\n", comparisons_md(comps)]
        md += ["## At equal compute\n", EQUAL_COMPUTE_NOTE + _seconds_note(main_runs)]
        md += [equal_compute_md(equal, missing)]
        md += ["## Compute per run\n", compute_md(arms)]
        md += ["## Accuracy against generated tokens\n", tokens_md(arms)]
        md += ["## Repairs per run\n", repairs_md(arms)]
        md += ["## Did the edit mask act?\n", mask_md(arms)]
        md += ["## What the design can resolve\n", spread_md(arms, comps)]
        md.append(
            "![held-out accuracy per step and per generated token](accuracy.png)\n\n"
            "![entropy and KL to the reference per step](dynamics.png)\n"
        )
    if sweep:
        md += ["## Learning-rate sweep\n", sweep_md(sweep), "![sweep](sweep.png)\n"]
    md += ["## Code\n", code_md(records)] if records else []
    md += ["## Command lines\n", commands_md(records)]
    data = {"runs": main_runs, "sweep": [r for r in records if r["regime"] == SWEEP]}
    data["comparisons"] = [{"label": lb, **c} for lb, c in comps]
    data["equal_compute"] = [{"label": lb, **c} for lb, by in equal for c in by.values()]
    data["pending"] = pending
    return data, "\n".join(md)


# --- plots ---------------------------------------------------------------------------------------


def _mean_curve(runs: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Mean over seeds at the points every seed has (index-aligned: one schedule per arm)."""
    curves = [r[key] for r in runs]
    n = min(len(c) for c in curves)
    xs = [statistics.fmean(c[i][0] for c in curves) for i in range(n)]
    ys = [statistics.fmean(c[i][1] for c in curves) for i in range(n)]
    return xs, ys


def _step_mean(runs: list[dict], key: str) -> tuple[list[int], list[float]]:
    n = min(len(r[key]) for r in runs)
    ys = [_mean(r[key][i] for r in runs) for i in range(n)]
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
                    pick = _mean_curve if key in ("curve", "token_curve") else _step_mean
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


def against_md(here: list[dict], there: list[dict], name: str) -> str:
    """The spread of each comparison's paired differences here and in another study (`there`,
    its study.json comparisons): were the pairs tighter here? A one-sided F-test of the two
    variances (5 pairs each side can only show a large ratio)."""
    other = {c["label"]: c for c in there}
    lines = [
        f"Paired differences here against {name}.\n",
        "| comparison | mean diff. here | there | sd here | sd there | variance ratio "
        "(there / here) | one-sided F-test p | training reward gap here | there |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in here:
        o = other.get(c["label"])
        if o is None:
            continue
        a, b = sd(c["diffs"]), sd(o["diffs"])
        p = f_test_greater(b, len(o["diffs"]), a, len(c["diffs"]))
        lines.append(
            f"| {c['label']} | {c['mean']:+.3f} | {o['mean']:+.3f} | {_f(a)} | {_f(b)} "
            f"| {_f((b / a) ** 2, '.2f')} | {_f(p, '.2f')} | {_f(c.get('reward_gap'))} "
            f"| {_f(o.get('reward_gap'))} |"
        )
    return "\n".join(lines) + "\n"


def between_md(here: dict, there: dict, name: str) -> str:
    """Each comparison's paired differences here minus there, seed by seed (the seeds both
    studies have): a study that changed arm a and kept arm b's very runs (the same final
    accuracy and training rewards at every seed) measures arm a against its other version."""
    runs = [{(r["arm"], r["seed"]): r for r in d["runs"]} for d in (here, there)]
    other = {c["label"]: c for c in there["comparisons"]}
    lines = [
        f"Seed by seed, each paired difference here minus the same one in {name}.\n",
        "| comparison | seeds | arm b's runs the same | mean | paired t 95% CI "
        "| higher / lower / tied | sign p | significant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in here["comparisons"]:
        o = other.get(c["label"])
        if o is None:
            continue
        d_here, d_there = dict(zip(c["seeds"], c["diffs"])), dict(zip(o["seeds"], o["diffs"]))
        seeds = sorted(set(d_here) & set(d_there))
        if len(seeds) < 2:
            continue
        st = paired_stats([d_here[s] - d_there[s] for s in seeds])
        same = all(
            (x := runs[0].get((c["b"], s))) is not None
            and (y := runs[1].get((c["b"], s))) is not None
            and (x["after"], x["reward"]) == (y["after"], y["reward"])
            for s in seeds
        )
        lo, hi = st["t_ci"]
        lines.append(
            f"| {c['label']} | {len(seeds)} | {'yes' if same else 'no'} | {st['mean']:+.3f} "
            f"| [{_f(lo, '+.3f')}, {_f(hi, '+.3f')}] | {st['wins']} / {st['losses']} / "
            f"{st['ties']} | {st['sign_p']:.3f} | {'yes' if significant(st) else 'no'} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 3 else ""


def report(out: Path, against: Path | None = None, seconds_from: list[Path] = ()) -> str:
    """Rebuild study.json, study.md and the plots from the finished run folders under `out`
    (and, with `against`, a section comparing its paired spreads with that study's; with
    `seconds_from`, the step seconds of timed runs there, take_seconds)."""
    records, pending = collect(out, seconds_from)
    data, md = build_report(records, pending)
    if against is not None:
        other = build_report(*collect(against))[0]
        md += "\n## Against another study\n\n" + against_md(
            data["comparisons"], other["comparisons"], str(against)
        )
        md += "\n" + between_md(data, other, str(against))
    (out / "study.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "study.md").write_text(md)
    main_arms = by_arm(data["runs"])
    if main_arms:
        plot(main_arms, out)
    if data["sweep"]:
        plot_sweep(by_arm(data["sweep"]), out / "sweep.png")
    return md


# --- command line --------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--out", default="outputs/study")
    add("--seeds", default="0,1,2,3,4", help="comma-separated, or ranges: 0-15")
    add("--steps", type=int, default=20)
    add("--eval-every", type=int, default=5, help="held-out evaluation every N steps")
    add("--eval-size", type=int, default=200, help="held-out problems (>= 200 for the study)")
    add(
        "--dataset",
        default="builtin:mixed",
        help="builtin:arithmetic holds only 158 held-out problems; mixed holds 720",
    )
    add("--prompts", type=int, default=2, help="prompts per step")
    add("--group-size", type=int, default=8)
    add("--max-new-tokens", type=int, default=16, help="rollout and held-out answers")
    add("--lr", default="2e-4", help="main-grid learning rate (the sweep's best, docs/study.md)")
    add("--kl-coef", default="0.0", help="objective.kl_coef of every run (0: no KL term)")
    add("--off-updates", type=int, default=2, help="updates per rollout, off-policy regime")
    add(
        "--equal-by",
        choices=("group", "steps"),
        default="group",
        help="how the equal-compute dfpo arm gets IBPO's token budget",
    )
    add("--equal-factor", type=float, default=1.5, help="its group size (or steps) x this")
    add("--quantization", default="none", help="model.quantization (fp32 base: CPU speed)")
    add("--model", default=None, help="model.name (default: the embedded SmolLM2-135M)")
    add("--arms", default=None, help="only these arms (comma-separated names; default all)")
    add("--workers", type=int, default=1, help="runs at once, each in its own process")
    add(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS per run (default cores / workers; with several invocations on "
        "one machine, all runs' threads together at most the cores)",
    )
    add("--sweep", action="store_true", help="the learning-rate sweep instead of the grid")
    add("--lrs", default="1e-4,2e-4,5e-4,1e-3")
    add("--sweep-seed", type=int, default=0)
    add("--report-only", action="store_true", help="rebuild the report from finished runs")
    add("--against", type=Path, help="another study's --out: compare the paired spreads")
    add(
        "--seconds-from",
        type=Path,
        nargs="+",
        default=[],
        help="the --out of timed runs of these runs (e.g. reruns with one thread each, no "
        "periodic evaluation), one or several: each run's step seconds from the first that "
        "reproduced it step for step",
    )
    add(
        "--smoke",
        action="store_true",
        help="tiny: 2 steps, 2 seeds, 3 arms, in this process (CI; pass --model)",
    )
    add("overrides", nargs="*", help="section.key=value applied to every run")
    ns = p.parse_args(argv)
    if ns.smoke:  # the tiny shapes, where an option was left at its default
        for key, value in SMOKE.items():
            if getattr(ns, key) == p.get_default(key):
                setattr(ns, key, value)
        # the smoke checks the repairs' accounting, so every planned repair runs: 4-token
        # completions leave no budget for a repair prompt, and the tiny model is never
        # correct, so no sibling is a correct reference
        for key, value in (("cost_share", "1"), ("reference_selection", "correct_first")):
            if not any(o.startswith(f"repair.{key}=") for o in ns.overrides):
                ns.overrides = [*ns.overrides, f"repair.{key}={value}"]
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if not ns.report_only:
        threads = ns.threads or max(1, (os.cpu_count() or 1) // max(1, ns.workers))
        runs = plan(ns, out)
        check(runs)
        # what the runs will record: `python -m ibpo.cli` takes this directory's ibpo if it
        # has one, else the installed one
        here = Path.cwd() / "ibpo"
        print(f"code: {describe(code_version(here if here.is_dir() else None))}", flush=True)
        outcomes = run_all(runs, ns.workers, ns.smoke, threads)
        print("runs: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())), flush=True)
    for flag, folder, fix in (
        ("--against", ns.against, "give another study's --out"),
        *(("--seconds-from", f, "give the --out of timed runs") for f in ns.seconds_from),
    ):
        if folder is not None and not any(folder.glob("*/*/study_run.json")):
            raise SystemExit(f"{flag} {folder}: no study runs there ({fix})")
    md = report(out, ns.against, ns.seconds_from)
    print(md)
    if "different thread counts" in md.split("## ", 1)[0]:
        print("study: warning: the runs computed at different thread counts (top of the report)",
              file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
