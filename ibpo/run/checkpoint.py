"""Checkpoints that resume a run exactly, and the guards that keep a run's work when it fails.

A checkpoint `<output_dir>/checkpoints/step-<N>/` holds everything a training step changes:

    adapter/             LoRA weights in PEFT format (usable as is by evaluation and `ibpo push`)
    optimizer.pt         optimizer state (AdamW moments, step counts, learning rates)
    scheduler.pt         learning-rate scheduler state
    process-<rank>.pt    per process: RNG states (python `random`, numpy, torch CPU, the CUDA
                         generator of the process's own GPU, the trainer's repair
                         `random.Random`), the position in its data stream and the repair
                         spending rule's state (algo/spending.py; the same in every process)
    trainer_state.json   step, held-out accuracy before training, non-finite counters, wall time
    metrics.jsonl        the per-step metrics of steps 1..N

With all of it restored, a resumed run takes the same steps, bit for bit on CPU, as one that was
never stopped (tests/test_checkpoint.py compares every LoRA tensor with torch.equal).

Writes are atomic: a checkpoint is written into `.tmp-step-<N>`, every file is fsync'd, and the
folder is renamed; then the `latest` pointer file is replaced (write a temporary file, os.replace).
A crash while saving leaves a stale temporary folder, which loading ignores and the next save
removes, and the previous checkpoint intact; a missing or dangling `latest` falls back to the
newest complete step-<N>. Only the newest KEEP_CHECKPOINTS checkpoints are kept.

Several processes (DDP, FSDP): each writes its own process-<rank>.pt into the temporary folder (one
file system shared by all processes is assumed, as Accelerate does); the main process writes the
rest and renames. Under FSDP the adapter and the optimizer state are gathered whole first
(ibpo/distributed.py). Every process loads. A checkpoint resumes only with the number of processes
that wrote it, since data shards and RNG streams are per process, and with FSDP only if it was
written with FSDP (the optimizer state is keyed by parameter name there). Accelerate's save_state
is not used: it would store the whole model (the frozen base too) and is not atomic.

Each checkpoint also records the run's configuration (config.json), which resuming compares
(outdir.py). A save after resuming from an earlier step removes the later checkpoints of the
abandoned history.

Not here: the training loop (trainer.py); what a failure prints (failures.py); a fresh start or
a resume with changed settings (outdir.py); gathering sharded state (ibpo/distributed.py); uploading
to the Hub.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ibpo.algo.spending import SpendingState
from ibpo.config import ConfigError
from ibpo.distributed import (
    is_fsdp,
    load_adapter,
    load_optimizer_state,
    optimizer_state,
    save_adapter,
)
from ibpo.step_parts import StepParts

CHECKPOINTS = "checkpoints"  # sub-folder of output_dir
KEEP_CHECKPOINTS = 2  # the newest kept: resuming needs one, and one more survives a bad save
LATEST = "latest"  # pointer file: the folder name of the newest checkpoint
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP = ".tmp-"  # prefix of folders being written (or left by a crash)


@dataclass
class TrainerState:
    """The loop's own counters (the rest of a run's state lives in the objects it trains)."""

    step: int = 0
    eval_before: dict | None = None
    nonfinite_total: int = 0  # steps skipped for a non-finite loss or gradient
    nonfinite_streak: int = 0  # ... of them consecutive, up to the current step
    wall_seconds: float = 0.0  # spent by earlier sessions of this run

    def count_step(self, skipped: bool) -> None:
        self.nonfinite_total += int(skipped)
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0


# --- finding checkpoints -------------------------------------------------------------------------


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_checkpoint(path: Path) -> bool:
    path = Path(path)
    return (path / "trainer_state.json").is_file() and (path / "adapter").is_dir()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete step-<N> folders under `root`, oldest first."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).iterdir() if step_of(p) is not None and is_checkpoint(p)]
    return sorted(found, key=step_of)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names; the newest complete one when the pointer is missing or
    dangling (a crash between renaming a checkpoint and updating the pointer)."""
    pointer = Path(root) / LATEST
    if pointer.is_file():
        target = Path(root) / pointer.read_text().strip()
        if step_of(target) is not None and is_checkpoint(target):
            return target
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume_from: str | None, output_dir: Path) -> Path | None:
    """run.resume_from -> the checkpoint folder to load, or None to start afresh."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        return latest_checkpoint(Path(output_dir) / CHECKPOINTS)
    path = Path(resume_from)
    if is_checkpoint(path):
        return path
    for root in (path / CHECKPOINTS, path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ConfigError(
        f"run.resume_from={resume_from!r}: no checkpoint there. Give a "
        "<output_dir>/checkpoints/step-<N> folder, an output_dir that holds checkpoints, "
        "or 'latest' (this run's output_dir)."
    )


# --- saving --------------------------------------------------------------------------------------


def _fsync_tree(path: Path) -> None:
    """Flush every file and folder under `path` (and `path`) to disk."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _own_cuda_device(device: torch.device | None) -> int | None:
    """The index of this process's GPU (None when it computes on none): `device`'s, else the
    current device (Accelerate sets it to the process's GPU). Each process keeps the CUDA RNG of
    that GPU only: its index depends on how many GPUs the process sees (all of them, or one
    through CUDA_VISIBLE_DEVICES), and touching another GPU would create a CUDA context there."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def _process_state(parts: StepParts, device: torch.device | None = None) -> dict:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "repair_rng": parts.rng.getstate(),
        "stream": parts.stream.state_dict(),
        "repair_spending": parts.repair_history.state_dict(),
    }
    gpu = _own_cuda_device(device)
    if gpu is not None:  # keyed by role, not index: the process's GPU is one GPU whatever its index
        state["cuda_own"] = torch.cuda.get_rng_state(gpu)
    return state


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (an abandoned later history of this run) is
    moved aside first and deleted after."""
    old = final.with_name(f"{_TMP}old-{final.name}")
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int, protect: Path) -> None:
    """Keep `protect` (just written) and the newest keep - 1 before it. Later steps belong to a
    history this run abandoned by resuming from an earlier checkpoint: `latest` resolution and
    pruning by step number would otherwise prefer them."""
    found = [p for p in list_checkpoints(root) if p != protect]
    later = [p for p in found if step_of(p) > step_of(protect)]
    earlier = [p for p in found if step_of(p) < step_of(protect)]
    for path in later + earlier[: max(len(earlier) - (keep - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    accelerator,
    root: Path,
    parts: StepParts,
    state: TrainerState,
    metrics: Path | None,
    keep: int,
    config: dict | None = None,
) -> Path:
    """Write checkpoint step-<state.step> under `root` atomically; every process must call it.
    An OSError (a full disk) removes the temporary folder and propagates."""
    root = Path(root)
    try:
        return _save(accelerator, root, parts, state, metrics, keep, config)
    except OSError:  # a full disk: do not leave half a checkpoint
        shutil.rmtree(_step_dirs(root, state.step)[1], ignore_errors=True)
        raise


def _step_dirs(root: Path, step: int) -> tuple[str, Path, Path]:
    """(name, temporary folder, final folder) of checkpoint `step`."""
    name = f"step-{step}"
    return name, root / f"{_TMP}{name}", root / name


def _save(accelerator, root: Path, parts, state, metrics, keep, config) -> Path:
    name, tmp, final = _step_dirs(root, state.step)
    main = accelerator.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP}*"):  # left by a save that crashed
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    state_file = tmp / f"process-{accelerator.process_index}.pt"
    torch.save(_process_state(parts, accelerator.device), state_file)
    save_adapter(accelerator, parts.model, tmp / "adapter")  # under FSDP, these two gather
    optimizer = optimizer_state(parts.model, parts.optimizer)
    if main:
        torch.save(optimizer, tmp / "optimizer.pt")
        torch.save(parts.scheduler.state_dict(), tmp / "scheduler.pt")
        if metrics is not None and Path(metrics).is_file():
            shutil.copyfile(metrics, tmp / "metrics.jsonl")
        meta = {
            **dataclasses.asdict(state),
            "world_size": accelerator.num_processes,
            "fsdp": is_fsdp(parts.model),
        }
        (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2) + "\n")
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    accelerator.wait_for_everyone()  # every process-<rank>.pt is written
    if main:
        _fsync_tree(tmp)
        _replace_dir(tmp, final)
        _atomic_write_text(root / LATEST, name + "\n")
        _prune(root, keep, protect=final)
    accelerator.wait_for_everyone()
    return final


# --- loading -------------------------------------------------------------------------------------


def _restore_cuda(state: dict, device: torch.device | None) -> None:
    """The saved state of the process's own GPU onto its own GPU. Checkpoints from before that
    key hold torch.cuda.get_rng_state_all() (every visible GPU, by index): the process's entry is
    known only if as many GPUs are visible now; otherwise the CUDA RNG keeps the run's seed."""
    gpu = _own_cuda_device(device)
    saved = state.get("cuda_own", state.get("cuda"))
    if saved is None:
        return
    if gpu is None:
        _cuda_rng_not_restored("this process computes on no GPU now")
    elif "cuda_own" in state:
        torch.cuda.set_rng_state(saved, gpu)
    elif len(saved) == torch.cuda.device_count():
        torch.cuda.set_rng_state(saved[gpu], gpu)
    else:
        _cuda_rng_not_restored(
            f"it saved the RNG of {len(saved)} visible GPU(s) by position and "
            f"this process sees {torch.cuda.device_count()}"
        )


def _cuda_rng_not_restored(why: str) -> None:
    # a warning (shown once per process): sampling is unaffected (each step seeds its own
    # streams, generation.SamplingStreams); GPU draws outside it (the dropout of an adapter given
    # as peft_config=, when on) differ from an uninterrupted run, everything else resumes exactly
    warnings.warn(
        f"ibpo: the checkpoint's CUDA RNG state is not restored ({why}): sampling resumes "
        "exactly, but random draws on the GPU outside it (the dropout of a peft_config= "
        "adapter, when on) continue from the run's seed instead",
        RuntimeWarning,
        stacklevel=3,
    )


def _restore_process(state: dict, parts: StepParts, device: torch.device | None = None) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    _restore_cuda(state, device)
    parts.rng.setstate(state["repair_rng"])
    parts.stream.load_state_dict(state["stream"])
    if "repair_spending" in state:  # checkpoints from before the spending rule start it afresh
        parts.repair_history = SpendingState.from_state_dict(state["repair_spending"])


def load_checkpoint(accelerator, path: Path, parts: StepParts) -> TrainerState:
    """Restore everything `save_checkpoint` wrote (RNG last); every process must call it."""
    path = Path(path)
    meta = json.loads((path / "trainer_state.json").read_text())
    world = meta.pop("world_size")
    if world != accelerator.num_processes:
        raise ConfigError(
            f"checkpoint '{path}' was written by {world} process(es), this run has "
            f"{accelerator.num_processes}: data shards and RNG streams are per process, so resume "
            "with the same number (its adapter/ folder can still start a new run or be evaluated)"
        )
    written_fsdp = meta.pop("fsdp", False)
    if written_fsdp != is_fsdp(parts.model):
        raise ConfigError(
            f"checkpoint '{path}' was written {'with' if written_fsdp else 'without'} FSDP and "
            "this run is the other way round: its optimizer state is laid out differently, so "
            "resume with the Accelerate config the run started with (its adapter/ folder can "
            "still start a new run or be evaluated)"
        )
    load_adapter(accelerator.unwrap_model(parts.model), path / "adapter")
    optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    load_optimizer_state(parts.model, parts.optimizer, optimizer)
    parts.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    process = torch.load(path / f"process-{accelerator.process_index}.pt", weights_only=True)
    _restore_process(process, parts, accelerator.device)
    return TrainerState(**meta)


def restore_metrics(checkpoint: Path, metrics: Path) -> None:
    """Make `metrics` hold exactly the checkpoint's steps (drops lines of steps after it)."""
    saved = Path(checkpoint) / "metrics.jsonl"
    _atomic_write_text(Path(metrics), saved.read_text() if saved.is_file() else "")
