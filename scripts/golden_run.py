"""Behaviour unchanged, checked: the same short training run on two versions of the package.

Runs `ibpo train` for a few steps with a fixed seed, one thread and fp32 compute, once with the
package of a git revision (checked out into a temporary worktree) and once with this checkout,
each in its own process on this machine, and compares the per-step loss, reward, accuracy,
gradient norm and completion length of metrics.jsonl exactly (float equality, printed as repr);
the logged KL, entropy and step time are printed beside them. Floats differ across
CPUs, so the comparison is only meaningful between two runs on the same machine: nothing here
is a stored figure.

    python scripts/golden_run.py --rev 946c124                 # the default cases
    python scripts/golden_run.py --rev HEAD~3 --case ibpo      # one case

Cases: `ibpo` (the embedded demo's objective: repairs and edit masks on), `grpo_off_policy`
(two updates per rollout, dynamic sampling, reference KL in the loss). Exit status 0 when every
case is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# keys every version since the run section reads alike (no held-out set: nothing evaluated)
COMMON = ["train.steps=2", "data.eval_size=0", "model.dtype=float32", "train.seed=3",
          "run.save_every=0"]  # fmt: skip
CASES = {
    "ibpo": ["objective.name=ibpo"],
    "grpo_off_policy": [
        "objective.name=grpo",
        "train.updates_per_rollout=2",
        "rollout.dynamic_sampling=true",
        "objective.kl_coef=0.05",
        "train.prompts_per_step=3",
        "train.micro_batch_groups=2",
    ],  # fmt: skip
}
# compared exactly: what the step computes
KEYS = ("loss", "reward", "accuracy", "grad_norm", "completion_length")
# printed beside them, not compared: logged means whose averaging may legitimately change
INFO = ("kl", "entropy", "step_time")


def for_version(source: Path, overrides: list[str]) -> list[str]:
    """The overrides as the package at `source` spells them: before the run section existed
    (ibpo.config.RunConfig) its keys were train.*."""
    config = source / "ibpo" / "config.py"
    if config.is_file() and "class RunConfig" in config.read_text():
        return overrides
    return [f"train.{o.removeprefix('run.')}" if o.startswith("run.") else o for o in overrides]


def run(source: Path, overrides: list[str], out: Path) -> list[dict]:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=str(source),
        TOKENIZERS_PARALLELISM="false",
    )
    code = "import sys, torch; torch.set_num_threads(1); from ibpo.cli import main; main()"
    overrides = for_version(source, [*overrides, f"run.output_dir={out}"])
    cmd = [sys.executable, "-c", code, "train", *overrides]
    done = subprocess.run(cmd, env=env, cwd=source, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run from {source} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="git revision to compare this checkout with")
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="default: all")
    args = ap.parse_args(argv)
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.rev],
            check=True,
            capture_output=True,
        )
        try:
            for case in args.case or sorted(CASES):
                overrides = COMMON + CASES[case]
                old = run(base, overrides, Path(tmp) / f"{case}-old")
                new = run(ROOT, overrides, Path(tmp) / f"{case}-new")
                print(f"case {case}: {len(old)} steps at {args.rev}, {len(new)} here")
                for step, (a, b) in enumerate(zip(old, new), 1):
                    for key in KEYS + INFO:
                        if key not in a and key not in b:
                            continue
                        ok = a.get(key) == b.get(key)
                        if key in KEYS:
                            same &= ok
                        mark = "same" if ok else "DIFFERENT" if key in KEYS else "differs (info)"
                        old_v, new_v = repr(a.get(key)), repr(b.get(key))
                        print(f"  step {step} {key:18s} {old_v:>24} {new_v:>24} {mark}")
                same &= len(old) == len(new)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                capture_output=True,
            )
    print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
