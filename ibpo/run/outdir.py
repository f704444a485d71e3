"""What a run's output_dir holds between runs: a fresh start, a resume with changed settings.

* A fresh start clears what an earlier run left (checkpoints, adapter, summary, plots), so its
  adapter or summary is never taken for the new run's, and is refused when that run did not
  finish (run.overwrite=true allows it): rerunning an interrupted command keeps its checkpoints.
* A run cut short mid-step gets its last checkpoint's adapter as <output_dir>/adapter.
* Resuming applies a changed train.learning_rate or weight_decay on purpose (the restored
  optimizer and scheduler would keep the old ones) and names every other setting that differs
  from the checkpoint's run (its config.json) and changes what a step computes.

Not here: writing or loading checkpoints (checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from ibpo.config import Config, ConfigError, RunConfig, from_dict
from ibpo.run.checkpoint import CHECKPOINTS, latest_checkpoint
from ibpo.step import StepParts

# what a run leaves in its output_dir besides config.yaml and metrics.jsonl (rewritten anyway)
RUN_OUTPUTS = (CHECKPOINTS, "adapter", "summary.json", "plots")


def check_fresh_start(output_dir: Path, overwrite: bool) -> None:
    """Refuse to start afresh over the checkpoints of a run that did not finish (its summary is
    missing or not 'completed'): the same command run again must not delete them."""
    out = Path(output_dir)
    last = latest_checkpoint(out / CHECKPOINTS)
    if overwrite or last is None:
        return
    summary = out / "summary.json"
    status = json.loads(summary.read_text()).get("status") if summary.is_file() else None
    if status != "completed":
        raise ConfigError(
            f"{out} holds checkpoints of a run that did not finish (status: {status or 'none'}; "
            f"last: {last.name}).\n  Fix: add run.resume_from=latest to continue it, or "
            "run.overwrite=true to start afresh and delete them (or another run.output_dir)."
        )


def clear_previous_run(output_dir: Path) -> list[str]:
    """A fresh run in an existing output_dir removes what an earlier run left there (so its
    adapter or summary is never taken for this run's); -> the names removed."""
    removed = []
    for name in RUN_OUTPUTS:
        path = Path(output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


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
    "train": {"steps", "eval_every", "micro_batch_groups", "micro_batch_tokens",
              "logprob_chunk_tokens", "max_nonfinite_steps", "eval_before", "learning_rate",
              "weight_decay"},
    "run": {f.name for f in dataclasses.fields(RunConfig)},
    "rollout": {"generation_batch_size", "eval_batch_size", "kv_cache", "backend",
                "vllm_kv_cache_gb", "vllm_sleep"},
    "model": {"offload_activations", "cpu_dequantize", "attn_implementation"},
    "repair": {"batch_size"},
}  # fmt: skip


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
    config = cfg.to_dict()
    return [
        f"{section}.{key}: {old[section][key]!r} -> {value!r}"
        for section, values in config.items()
        if isinstance(values, dict)
        for key, value in values.items()
        if key in old.get(section, {})
        and old[section][key] != value
        and key not in _RESUMABLE_CHANGES.get(section, set())
    ]


def apply_optimizer_settings(parts: StepParts, lr: float, weight_decay: float) -> list[str]:
    """After loading: the configured learning rate and weight decay replace the checkpoint's
    (its optimizer and scheduler state carry the old ones); -> what changed."""
    sched, changed = getattr(parts.scheduler, "scheduler", parts.scheduler), []  # Accelerate's
    groups = parts.optimizer.param_groups
    if any(base != lr for base in sched.base_lrs):
        changed.append(f"train.learning_rate: {sched.base_lrs[0]!r} -> {lr!r}")
        sched.base_lrs = [lr] * len(groups)
        factors = [f(sched.last_epoch) for f in sched.lr_lambdas]
        for group, factor in zip(groups, factors):
            group["initial_lr"], group["lr"] = lr, lr * factor
        sched._last_lr = [g["lr"] for g in groups]
    if any(g.get("weight_decay") != weight_decay for g in groups):
        changed.append(f"train.weight_decay: {groups[0].get('weight_decay')!r} -> {weight_decay!r}")
        for group in groups:
            group["weight_decay"] = weight_decay
    return changed
