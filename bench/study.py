"""The objective study: does IBPO learn better than the GRPO family?

    python bench/study.py --workers 2                     # the main grid (5 seeds x 13 arms)
    python bench/study.py --seeds 0-15 --arms on-ibpo,on-dfpo --workers 2   # the headline pair
    python bench/study.py --sweep --workers 2             # the learning-rate sweep, 1 seed
    python bench/study.py --report-only                   # rebuild study.json/.md/.png
    python bench/study.py --pack --out docs/study         # its run folders -> studies/study.tar.xz
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
is built from the folders alone. `--pack` packs a study's run folders into one archive,
<packed>/<last part of --out>.tar.xz (`--packed`, default studies/; study_archive.py), which
every command reads in place of the folders it holds (a folder on disk replaces its packed run):
the report, --against and --seconds-from, and the runner, which skips a packed run that is done.

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
'ibpo[study]'`); the exact sign test and the bootstrap are written in study_stats.py.

This file is the command line; the rest is by topic: study_grid.py (the arms, the comparisons,
the plan), study_workers.py (running the runs), study_runs.py (reading them, on disk or packed:
study_archive.py), study_stats.py (the statistics), study_compare.py (paired comparisons),
study_report.py (study.md and study.json) and study_plots.py (the figures).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from study_archive import archive_of, pack
from study_grid import SMOKE, Run, check, plan
from study_report import report
from study_runs import is_done, study_runs
from study_workers import run_all

from ibpo.run.version import code_version, describe


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
    add("--pack", action="store_true", help="pack --out's run folders into its archive, only")
    add(
        "--packed",
        type=Path,
        default=Path("studies"),
        help="where studies are packed, one <name>.tar.xz per study (default: studies)",
    )
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
    if ns.smoke:
        smoke_defaults(ns, p)
    return ns


def smoke_defaults(ns: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """--smoke's tiny shapes, where an option was left at its default."""
    for key, value in SMOKE.items():
        if getattr(ns, key) == p.get_default(key):
            setattr(ns, key, value)
    # the smoke checks the repairs' accounting, so every planned repair runs: 4-token
    # completions leave no budget for a repair prompt, and the tiny model is never
    # correct, so no sibling is a correct reference
    for key, value in (("cost_share", "1"), ("reference_selection", "correct_first")):
        if not any(o.startswith(f"repair.{key}=") for o in ns.overrides):
            ns.overrides = [*ns.overrides, f"repair.{key}={value}"]


def not_packed(runs: list[Run], out: Path, packed: Path) -> list[Run]:
    """The runs of the plan that are not done in the study's archive: those are skipped."""
    done = {r.path for r in study_runs(out, packed) if r.packed is not None and is_done(r)}
    for run in runs:
        if run.dir in done:
            print(f"[skip] {run.dir.name} is done ({archive_of(out, packed)})", flush=True)
    return [run for run in runs if run.dir not in done]


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    out = Path(ns.out)
    if ns.pack:
        path, folders, total = pack(out, ns.packed)
        parents = " ".join(sorted({str(f.parent) for f in folders}))
        print(
            f"packed {len(folders)} run folders of {out} into {path} ({total} runs in it); "
            f"the report reads them there, so the folders may go: rm -r {parents}"
        )
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if not ns.report_only:
        threads = ns.threads or max(1, (os.cpu_count() or 1) // max(1, ns.workers))
        runs = plan(ns, out)
        check(runs)
        # what the runs will record: `python -m ibpo.cli` takes this directory's ibpo if it
        # has one, else the installed one
        here = Path.cwd() / "ibpo"
        print(f"code: {describe(code_version(here if here.is_dir() else None))}", flush=True)
        outcomes = run_all(not_packed(runs, out, ns.packed), ns.workers, ns.smoke, threads)
        print("runs: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())), flush=True)
    for flag, folder, fix in (
        ("--against", ns.against, "give another study's --out"),
        *(("--seconds-from", f, "give the --out of timed runs") for f in ns.seconds_from),
    ):
        if folder is not None and not study_runs(folder, ns.packed):
            raise SystemExit(
                f"{flag} {folder}: no study runs there, nor packed in "
                f"{archive_of(folder, ns.packed)} ({fix})"
            )
    md = report(out, ns.against, ns.seconds_from, ns.packed)
    print(md)
    if "different thread counts" in md.split("## ", 1)[0]:
        print("study: warning: the runs computed at different thread counts (top of the report)",
              file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
