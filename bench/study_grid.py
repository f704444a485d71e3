"""The study's design: its regimes, its arms (the grid: name, regime, overrides), the
comparisons the report makes between them, the budget every run shares, and the plan of one
invocation (each run's folder and full list of `ibpo train` overrides), checked before any run
starts. bench/study.py's docstring says what each arm is.

It does not run anything (study_workers) or read a finished run (study_runs).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from pathlib import Path

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
