"""What a training run writes as it goes, on the main process: per step one metrics line
(gathered over processes first), the progress bar and the trackers; periodic held-out
evaluations as their own lines; the completions table (completions.jsonl: one line per sampled
completion of every step, gathered over processes, with its prompt, rewards, advantage and the
columns reward functions logged with log_extra), cut back to a checkpoint's step on resume.

Not here: computing the metrics (step.py), the end-of-run plots and Hub upload (trainer.py
finish_run), drawing (report.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

COMPLETIONS = "completions.jsonl"


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


def _json_safe(value):
    """A table cell for strict JSON: NaN/inf as null at any depth, anything else JSON cannot
    hold (a tensor, a custom object a reward logged) as its repr."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _json_safe(value.item())  # a 0-dim tensor or a numpy scalar
    return repr(value)


def log_completions(rows: list[dict], step: int, table_file) -> None:
    """One step's completions table rows, each with its step."""
    for row in rows:
        table_file.write(json.dumps(_json_safe({"step": step, **row})) + "\n")
    table_file.flush()


def trim_completions(path: Path, step: int) -> None:
    """Keep the rows of steps <= `step` (a resumed run goes on from its checkpoint's step)."""
    path = Path(path)
    if not path.is_file():
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
        for line in src:
            try:
                keep = json.loads(line).get("step", 0) <= step
            except ValueError:  # a line cut short by a kill
                keep = False
            if keep:
                dst.write(line)
    os.replace(tmp, path)


def log_eval(e: dict | None, step: int, bar, metrics_file, accelerator, log_with) -> None:
    """A periodic held-out evaluation: its own metrics line (report.py plots it)."""
    if not e:
        return
    line = {"step": step, "eval_accuracy": e["accuracy"], "eval_n": e["n"]}
    # the evaluation's own grader failures (scored 0), apart from the steps' grader_errors
    line["eval_grader_errors"] = float(e.get("grader_errors", 0))
    # what reward functions logged (log_metric) while grading it, as TRL names eval metrics
    line.update({f"eval_{k}": v for k, v in e.get("metrics", {}).items()})
    if accelerator.is_main_process:
        bar.write(f"ibpo: step {step}: held-out accuracy {e['accuracy']:.3f} (n={e['n']})")
    if metrics_file:
        metrics_file.write(json.dumps(_finite(line)) + "\n")
        metrics_file.flush()
    if log_with:
        accelerator.log({k: v for k, v in line.items() if k != "step"}, step=step)
