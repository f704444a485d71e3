"""What a training run writes as it goes, on the main process: per step one metrics line
(gathered over processes first), the progress bar and the trackers; periodic held-out
evaluations as their own lines.

Not here: computing the metrics (step.py), the end-of-run plots and Hub upload (trainer.py
finish_run), drawing (report.py).
"""

from __future__ import annotations

import json
import math


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
