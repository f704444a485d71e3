"""What a training run writes as it goes and when it ends, on the main process.

Per step: one metrics line (gathered over processes first), the progress bar, trackers; periodic
held-out evaluations as their own lines; at the end the plots and the summary table (report.py)
and the Hub upload (hub.py). None of the end-of-run extras may cost a finished run: their failures
are reported, not raised.

Not here: computing the metrics (trainer.py) or drawing them (report.py).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ibpo.config import Config


def gather_metrics(accelerator, m: dict[str, float]) -> dict[str, float]:
    """One step's metrics over all processes: times and peak memory are the slowest/largest
    process's, tokens/s and token/repair counts add up, everything else (rates, the residual
    ratio) is averaged: every process holds the same number of groups."""
    if accelerator.num_processes == 1:
        return m
    from accelerate.utils import gather_object

    every = gather_object([m])
    out = {}
    for key in m:
        values = [d[key] for d in every if key in d]
        if key.startswith("time_") or key in ("step_time", "peak_memory_gb",
                                              "device_memory_used_gb"):  # fmt: skip
            out[key] = max(values)
        elif key in ("tokens_per_second", "generated_tokens", "repairs", "repair_tokens"):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def log_step(m: dict, step: int, bar, metrics_file, accelerator, log_with) -> None:
    m["step"] = step
    if m["skipped_nonfinite"] and accelerator.is_main_process:
        bar.write(f"ibpo: step {step}: non-finite loss or gradient, update skipped")
    bar.update(1)
    bar.set_postfix(
        reward=f"{m['reward']:.3f}",
        acc=f"{m['accuracy']:.3f}",
        len=f"{m['completion_length']:.0f}",
        s=f"{m['step_time']:.1f}",
    )
    if metrics_file:
        metrics_file.write(json.dumps(_finite(m)) + "\n")
        metrics_file.flush()
    if log_with:
        accelerator.log(m, step=step)


def _finite(m: dict) -> dict:
    """NaN and inf as null: json.dumps would write NaN/Infinity, which strict JSON readers (jq,
    the Hub's viewer) reject."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}


def log_eval(e: dict | None, step: int, bar, metrics_file, accelerator, log_with) -> None:
    """A periodic held-out evaluation: its own metrics line (report.py plots it)."""
    if not e:
        return
    line = {"step": step, "eval_accuracy": e["accuracy"], "eval_n": e["n"]}
    if accelerator.is_main_process:
        bar.write(f"ibpo: step {step}: held-out accuracy {e['accuracy']:.3f} (n={e['n']})")
    if metrics_file:
        metrics_file.write(json.dumps(line) + "\n")
        metrics_file.flush()
    if log_with:
        accelerator.log({"eval_accuracy": e["accuracy"]}, step=step)


def finish_run(out: Path, cfg: Config, status: str) -> None:
    """Main process, after summary.json: plots, the end-of-run table, the Hub upload.
    None of them may cost a finished run: their failures are reported, not raised."""
    tr = cfg.train
    if tr.plots:
        from ibpo import report

        try:
            report.plot_run(out)
            if tr.progress:
                print(report.summary_table(out), file=sys.stderr)
        except Exception as e:  # a figure is never worth a traceback after hours of training
            print(f"ibpo: plots or summary not written: {e!r} (`ibpo report {out}` retries)",
                  file=sys.stderr)  # fmt: skip
    if tr.push_to_hub and status == "completed":
        from ibpo.hub import HubError, push

        try:
            url = push(out, tr.hub_repo_id, private=tr.hub_private)
            print(f"ibpo: pushed to {url}", file=sys.stderr)
        except Exception as e:  # the run is saved: a failed upload must not fail it
            detail = str(e) if isinstance(e, HubError) else repr(e)
            print(f"ibpo: push to the Hub failed: {detail}\n  Retry: ibpo push {out} "
                  f"--repo-id {tr.hub_repo_id}", file=sys.stderr)  # fmt: skip
