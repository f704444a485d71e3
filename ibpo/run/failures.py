"""How a run ends when something goes wrong: signals, running out of memory, non-finite steps,
a full disk. Each gets a message naming what happened, what was kept and the fix.

* `GracefulStop`: SIGINT / SIGTERM finish the current step, then the run saves and ends; while
  reward calls run (which may never return) they stop it at once instead.
* `is_oom` and the `*_message` helpers: the advice the trainer prints and writes to summary.json.
* `exit_code`: how `ibpo train` exits, by how the run ended (summary.json's status and
  exit_code): completed 0, failed (a full disk) 1, bad input 2 (a ConfigError, ibpo/cli.py), out
  of memory 3, non-finite steps 4, rollout mismatch over rollout.mismatch_stop_kl 5 (run/alarm.py),
  reward function that failed (raised, or returned what is not one number per completion) 6,
  interrupted 130 (SIGINT) or 143 (SIGTERM); resumable. A callback that asked the run to stop
  ends it "stopped" (0); one that raised, "failed" (1).
* `keep_traceback`: a failed reward's or callback's whole exception, into the run folder.
* `StoppedEarly`: Ctrl-C before the loop (loading, the first held-out evaluation): one line.

Not here: saving or loading checkpoints (checkpoint.py), the loop that decides (ibpo/trainer.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from ibpo.config import Config
from ibpo.rewards import calls as reward_calls
from ibpo.run.checkpoint import TrainerState

# Consecutive steps with a non-finite loss or gradient (each skipped, no update) that stop a run
# with a checkpoint: one is an accident, three are a diverging run.
MAX_NONFINITE_STEPS = 3

EXIT_CODES = {
    "completed": 0,
    "stopped": 0,
    "failed": 1,
    "out_of_memory": 3,
    "nonfinite": 4,
    "mismatch": 5,
    "reward_failed": 6,
    "interrupted": 130,
}


def exit_code(status: str, signum: int | None = None) -> int:
    """The exit status of `ibpo train` for a run that ended with `status` (the shell's 128 + the
    signal for an interrupted one: 130 for SIGINT, 143 for SIGTERM)."""
    if status == "interrupted" and signum is not None:
        return 128 + int(signum)
    return EXIT_CODES.get(status, 1)


class StoppedEarly(Exception):
    """Ctrl-C before the loop: nothing trained, so no summary; `str()` is the line to print."""

    exit_code = EXIT_CODES["interrupted"]


def stopped_early_message(resume: Path | None) -> str:
    if resume is not None:
        return (
            f"interrupted before training resumed; the run is as its checkpoint {resume} left "
            "it (the same command continues it)"
        )
    return "interrupted before training started; nothing to resume"


class GracefulStop:
    """SIGINT / SIGTERM -> `requested()` turns true: the loop finishes its step, saves a checkpoint
    and ends as 'interrupted'. While the main thread waits on reward calls (rewards/calls.py)
    the first one raises calls.Interrupted instead: the calls are abandoned, and the step has
    not updated the policy yet. A second Ctrl-C raises KeyboardInterrupt at once. The handlers are
    installed only in the main thread (Python's rule) and restored on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        name = signal.Signals(signum).name
        if reward_calls.waiting():  # a reward call may never return: not waited for
            _say(f"\nibpo: {name}: stopping now (the reward calls in flight are abandoned)\n")
            raise reward_calls.Interrupted
        _say(
            f"\nibpo: {name}: finishing this step, then saving a checkpoint (Ctrl-C again "
            "stops at once)\n"
        )

    def requested(self, accelerator) -> bool:
        """The same answer on every process (a signal may reach only some of them)."""
        flag = float(self.signum is not None)
        if accelerator.num_processes > 1:
            total = accelerator.reduce(torch.tensor([flag], device=accelerator.device), "sum")
            flag = float(total.item())
        return flag > 0


def _say(line: str) -> None:
    try:  # os.write, not print: a handler may run in the middle of another print
        os.write(sys.stderr.fileno(), line.encode())
    except (OSError, ValueError):  # a stderr without a file descriptor (a notebook's)
        sys.stderr.write(line)


def is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def oom_message(
    cfg: Config, step: int, error: BaseException, last: Path | None, in_eval: bool = False
) -> str:
    """Advice naming the settings that lower memory. `in_eval`: it was the held-out evaluation
    after `step`, which had finished (and was saved)."""
    tr, ro, rep = cfg.train, cfg.rollout, cfg.repair
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    resume = (
        f"Then resume from {last} with run.resume_from=latest."
        if last is not None
        else "No checkpoint was saved yet (run.save_every)."
    )
    if in_eval:
        return (
            f"out of memory in the held-out evaluation after step {step} ({first[:200]})\n"
            f"  Fix: lower rollout.generation_batch_size (now {ro.generation_batch_size}) or "
            f"rollout.eval_max_new_tokens (now {ro.eval_max_new_tokens}). Step {step} is "
            f"saved. {resume}"
        )
    return (
        f"out of memory in step {step} ({first[:200]})\n"
        f"  Fix: lower train.micro_batch_groups (now {tr.micro_batch_groups}; whole groups per "
        f"forward/backward), "
        f"rollout.generation_batch_size (now {ro.generation_batch_size}; repair.batch_size, now "
        f"{rep.batch_size}, for repairs) or rollout.max_new_tokens "
        f"(now {ro.max_new_tokens}). "
        "`ibpo plan <recipe> --gpu-memory-gb <GiB>` estimates the peak memory and suggests "
        f"settings that fit.\n  {resume}"
    )


def interrupted_message(step: int, last: Path | None) -> str:
    return (
        f"interrupted after step {step}; checkpoint: {last}.\n  Continue: the same command "
        "with run.resume_from=latest."
    )


def interrupted_in_rewards_message(
    done: int, last: Path | None, saved: bool, in_eval: bool = False
) -> str:
    """A signal while reward calls ran, after `done` steps (`in_eval`: in the held-out
    evaluation after them, else in the next step, before its update): the calls were abandoned;
    `saved`: the checkpoint `last` holds those steps."""
    where = f"the evaluation after step {done}" if in_eval else f"step {done + 1}"
    kept = (
        f"the {done} steps done are saved: {last}"
        if saved
        else (f"the last checkpoint is {last}" if last else "no checkpoint was saved yet")
    )
    return (
        f"interrupted in {where}'s reward calls, which were abandoned; {kept}.\n  Continue: "
        "the same command with run.resume_from=latest (that step's prompts are not trained on)."
    )


def stopped_at_once_message(step: int, last: Path | None) -> str:
    """A second Ctrl-C, in step `step`: that step is lost; the adapter is the last checkpoint's."""
    if last is None:
        return (
            f"interrupted at once in step {step} (a second Ctrl-C); no checkpoint was saved yet, "
            "so the adapter is not saved and there is nothing to resume"
        )
    return (
        f"interrupted at once in step {step} (a second Ctrl-C); the adapter is the last "
        f"checkpoint's: {last}. Continue: the same command with run.resume_from=latest."
    )


def save_failed_message(error: OSError, last: Path | None) -> str:
    where = f"the last complete checkpoint is {last}" if last else "no checkpoint was saved"
    return (
        f"could not write a checkpoint ({error}); {where}.\n  Fix: free disk space (or set "
        "run.output_dir on a larger disk), then resume with run.resume_from=latest."
    )


def reward_failed_message(
    error: Exception, where: str, done: int, last: Path | None, saved: bool
) -> str:
    """A reward function failed `where` (a step, or an evaluation) after `done` steps: the error
    names the function; `saved`: the checkpoint `last` holds those steps."""
    kept = (
        f"The {done} steps done are saved: {last}."
        if saved
        else (f"The last checkpoint is {last}." if last else "No checkpoint was saved yet.")
    )
    return (
        f"{error} ({where})\n  {kept} Fix the function, then resume with "
        "run.resume_from=latest (the failed step's prompts are not trained on)."
    )


def keep_traceback(out: Path, error: BaseException, where: str, process: int = 0) -> Path:
    """Append `error`, the exception it was raised from and their tracebacks to the run
    folder's errors.log (errors-process-<i>.log for process i > 0): what a one-line message
    leaves out. -> the file."""
    import traceback

    name = "errors.log" if process == 0 else f"errors-process-{process}.log"
    path = Path(out) / name
    cause = error.__cause__ or error
    text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"=== {where}: {error}\n{text}\n")
    return path


def callback_failed_message(error: Exception, done: int, last: Path | None, saved: bool) -> str:
    """A callback raised after `done` steps (CallbackError names it and its hook)."""
    kept = (
        f"The {done} steps done are saved: {last}."
        if saved
        else (f"The last checkpoint is {last}." if last else "No checkpoint was saved yet.")
    )
    return f"{error}\n  {kept} Fix the callback, then resume with run.resume_from=latest."


def nonfinite_message(state: TrainerState, last: Path | None) -> str:
    first = state.step - state.nonfinite_streak + 1
    return (
        f"stopped: {state.nonfinite_streak} consecutive steps ({first}-{state.step}) had a "
        "non-finite loss or gradient and were skipped.\n  Likely causes: a learning rate too "
        "high, float16 overflow (use model.dtype=bfloat16 or float32); a NaN or inf reward is "
        f"an error of its own (reward_failed). Checkpoint: {last}. Fix the cause, then resume "
        "with run.resume_from=latest."
    )
