"""Running the planned study runs: `--workers N` threads, each taking the next run nobody has
claimed and running it in its own `python -m ibpo.cli train` process (or, in `--smoke`, in this
one), skipping runs that are done; a failed run leaves the others going and is retried by the
next invocation, which resumes it from its last checkpoint.

It does not plan the runs (study_grid) or read their results (study_runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

# The claim of a run folder is compare_objectives' (one pid marker per run, created atomically, a
# dead owner's taken over), so both scripts may share an --out and its claims.
from compare_objectives import claim
from study_grid import Run
from study_runs import is_done


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
    from ibpo.trainer import run_recipe

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_recipe(load_config(None, args))
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
