"""What a run's output_dir holds between runs: a fresh start, a resume with changed settings.

* run.output_dir is created first; a path that cannot be is a configuration error.
* A fresh start moves what an earlier run left (finished or not: checkpoints, adapter, summary,
  metrics, config, plots, evaluations) to <output_dir>/previous-<UTC time>/, once its own data
  and model have loaded: its adapter or summary is never taken for the new run's, a start that
  fails leaves it in place, and nothing is ever deleted (removing it is the user's to do).
* A run cut short mid-step gets its last checkpoint's adapter as <output_dir>/adapter.
* A run trained on rows given in Python resumes only with them given again: said before
  anything loads (check_resumed_data).
* Resuming applies a changed train.learning_rate on purpose (the restored optimizer and
  scheduler would keep the old one) and names every other setting that differs
  from the checkpoint's run (its config.json) and changes what a step computes.

Not here: writing or loading checkpoints (checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import shutil
from pathlib import Path

from ibpo.config import Config, ConfigError, RunConfig
from ibpo.data.splits import IN_MEMORY
from ibpo.recipe import from_dict
from ibpo.run.checkpoint import CHECKPOINTS, latest_checkpoint
from ibpo.step_parts import StepParts

PREVIOUS = "previous-"  # <output_dir>/previous-<UTC time>/: an earlier run, moved aside


def make_output_dir(output_dir: Path) -> None:
    """Create run.output_dir (before anything is loaded, nothing of an earlier run touched):
    a path that cannot be created or written is a configuration error, not a traceback."""
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"run.output_dir={out}: cannot create it ({type(e).__name__}: "
            f"{e.strerror or e}). Fix: choose a folder you can write."
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run.output_dir={out}: cannot write there (PermissionError: not writable). "
            "Fix: choose a folder you can write."
        )


def previous_run(output_dir: Path) -> list[Path]:
    """What an earlier run left in output_dir: every entry except the previous-* folders of
    runs already moved aside (an empty list: nothing there)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if not p.name.startswith(PREVIOUS))


def _status(output_dir: Path) -> str:
    summary = Path(output_dir) / "summary.json"
    try:
        return json.loads(summary.read_text()).get("status") or "no status"
    except (OSError, ValueError, AttributeError):
        return "no summary"


def set_aside_previous_run(output_dir: Path) -> str | None:
    """A fresh start, once its data and model have loaded: the earlier run in output_dir (its
    checkpoints, adapter, summary, metrics, config, plots, evaluations: every entry but the
    previous-* folders) moves to <output_dir>/previous-<UTC time>/, so that nothing of it is
    taken for the new run's and nothing is lost; -> the line saying what happened (None:
    nothing was there)."""
    out = Path(output_dir)
    entries = previous_run(out)
    if not entries:
        return None
    status, last = _status(out), latest_checkpoint(out / CHECKPOINTS)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    prev = out / f"{PREVIOUS}{stamp}"
    for n in itertools.count(2):
        try:
            prev.mkdir()
            break
        except FileExistsError:
            prev = out / f"{PREVIOUS}{stamp}-{n}"
    for path in entries:
        path.rename(prev / path.name)
    line = f"ibpo: starting afresh: moved the earlier run ({status}) to {prev}"
    if last is not None and status != "completed":
        line += (
            f" (last checkpoint: {last.name}; run.resume_from={prev} continues it, and "
            "run.resume_from=latest continues a run instead of starting afresh)"
        )
    return line


def keep_checkpoint_adapter(last: Path | None, adapter: Path) -> Path | None:
    """A run cut short mid-step: <output_dir>/adapter becomes a copy of the last checkpoint's
    (what `ibpo push` and evaluation pick up), or is removed when there is none; -> where the
    run's adapter now is."""
    shutil.rmtree(adapter, ignore_errors=True)
    if last is None:
        return None
    try:
        shutil.copytree(Path(last) / "adapter", adapter)
    except OSError:  # a full disk: point at the checkpoint's own copy
        shutil.rmtree(adapter, ignore_errors=True)
        return Path(last) / "adapter"
    return adapter


# settings that change memory, speed, logging or the run's length, not what a step computes;
# the whole run section (where and how the job runs) is among them
_RESUMABLE_CHANGES = {
    "train": {"steps", "eval_every", "micro_batch_groups", "learning_rate"},
    "run": {f.name for f in dataclasses.fields(RunConfig)},
    "rollout": {"generation_batch_size", "backend", "decode"},
    "model": {"offload_activations"},
    "repair": {"batch_size"},
}  # fmt: skip


def check_resumed_data(checkpoint: Path, cfg: Config, given_rows: bool) -> None:
    """Before anything loads: a run trained on rows given in Python (ibpo.train(dataset=...))
    resumes only with those rows given again, said as such (its checkpoint's data stream
    would not fit another training set)."""
    saved = Path(checkpoint) / "config.json"
    if given_rows or not saved.is_file():
        return
    data = json.loads(saved.read_text()).get("data", {})
    if data.get("dataset") == IN_MEMORY and cfg.data.dataset != IN_MEMORY:
        raise ConfigError(
            f"this run ({checkpoint.parent.parent}) was trained on rows passed as dataset=, "
            "and they were not passed again. Fix: pass the same rows, "
            "ibpo.train(..., dataset=rows, overrides={'run.resume_from': 'latest', ...})"
        )


def resume_changes(checkpoint: Path, cfg: Config) -> list[str]:
    """'section.key: old -> new' for settings that differ from the checkpoint's run and change
    what a step computes, both resolved (a checkpoint keeps its recipe's nulls, which inherit;
    checkpoints written before config.json existed: none known)."""
    saved = Path(checkpoint) / "config.json"
    if not saved.is_file():
        return []
    old = json.loads(saved.read_text())
    try:  # resolved as the run resolved it (an older version's settings may no longer load)
        old = from_dict(old, str(saved)).to_dict()
    except ConfigError:
        pass
    before, now = _settings(old), _settings(cfg.to_dict())
    return [
        f"{key}: {before[key]!r} -> {value!r}"
        for key, value in now.items()
        if key in before
        and before[key] != value
        and key.split(".")[1] not in _RESUMABLE_CHANGES.get(key.split(".")[0], set())
    ]


def _settings(tree: dict) -> dict:
    """A config's tree as "section.key" -> value, a mapping's items as "section.key.item" (one
    changed knob of objective.params is named alone)."""
    flat = {}
    for section, values in tree.items():
        for key, value in values.items() if isinstance(values, dict) else ():
            if isinstance(value, dict):
                flat.update({f"{section}.{key}.{k}": v for k, v in value.items()})
            else:
                flat[f"{section}.{key}"] = value
    return flat


def apply_optimizer_settings(parts: StepParts, lr: float) -> list[str]:
    """After loading: the configured learning rate replaces the checkpoint's (its optimizer and
    scheduler state carry the old one); -> what changed."""
    sched, changed = getattr(parts.scheduler, "scheduler", parts.scheduler), []  # Accelerate's
    groups = parts.optimizer.param_groups
    if any(base != lr for base in sched.base_lrs):
        changed.append(f"train.learning_rate: {sched.base_lrs[0]!r} -> {lr!r}")
        sched.base_lrs = [lr] * len(groups)
        factors = [f(sched.last_epoch) for f in sched.lr_lambdas]
        for group, factor in zip(groups, factors):
            group["initial_lr"], group["lr"] = lr, lr * factor
        sched._last_lr = [g["lr"] for g in groups]
    return changed
