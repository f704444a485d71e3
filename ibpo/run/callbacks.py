"""Callbacks: hooks into a run from Python (`ibpo.train(callbacks=[...])`), as TRL's trainers
call theirs, and the run state they and the reward functions (`trainer_state=`) see.

A callback is any object with some of these methods; a `transformers.TrainerCallback` has all
of them, so one written for TRL's GRPOTrainer works unchanged. Each is called as
`hook(args, state, control, **kwargs)`:

    on_train_begin   once the run is ready (after the held-out evaluation before training)
    on_step_begin    before each step
    on_step_end      after each step, kwargs["metrics"] its metrics (those of metrics.jsonl)
    on_log           after each step too, kwargs["logs"] the same metrics (a TRL habit)
    on_evaluate      after a periodic held-out evaluation, kwargs["metrics"] its results
    on_save          after a checkpoint, kwargs["checkpoint"] its folder
    on_train_end     when the loop has ended, before the final held-out evaluation

`args` is what TrainingArguments would hold for the run: GRPOConfig's names with the run's
values (output_dir, logging_steps, max_steps, num_generations, learning_rate...;
trl_config.TrainingArgs), and the Config's sections (args.train.steps); `state` a RunState
(TRL's TrainerState names: global_step, max_steps, epoch, log_history); `control` a
RunControl whose flags the run reads after each step's hooks: should_training_stop ends the
run there (status "stopped": a checkpoint, the adapter and the final held-out evaluation, as
at the last step), should_save saves a checkpoint now, should_evaluate runs the held-out
evaluation now. A hook may also return a control, as transformers' do. kwargs also hold
model, processing_class (the tokenizer), optimizer and lr_scheduler. With several processes
every process calls its callbacks and their flags are joined (one process asking to stop
stops them all).

A hook that raises is a CallbackError naming the callback and the hook; the run ends with
status "failed" and a checkpoint, the exception's traceback kept in the run folder.

Not here: the loop that calls them (trainer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ibpo.config import ConfigError

HOOKS = (
    "on_train_begin",
    "on_step_begin",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_train_end",
)


class CallbackError(ConfigError):
    """A callback raised; the message names it and the hook."""


@dataclass
class RunState:
    """What callbacks and reward functions see of a run, under TRL's TrainerState names."""

    global_step: int = 0  # steps done (during a step's rewards: the steps before it)
    max_steps: int = 0  # train.steps
    epoch: float = 0.0  # passes over this process's training examples, fractional
    log_history: list[dict] = field(default_factory=list)  # every metrics line so far
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True


@dataclass
class RunControl:
    """What callbacks ask of the run (TRL's TrainerControl names); should_log is accepted and
    changes nothing (every step is logged)."""

    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class Callbacks:
    """The run's callbacks, called in order; `control` collects what they asked."""

    def __init__(
        self,
        callbacks: Sequence[Any] | None,
        args: Any,
        state: RunState,
        objects: dict[str, Any] | None = None,
    ):
        # a class is instantiated, as transformers' Trainer does
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks or []]
        for cb in self.callbacks:
            if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
                raise ConfigError(
                    f"callback {_name(cb)} has none of the hooks {', '.join(HOOKS)}. Fix: pass "
                    "an object with such methods (a transformers.TrainerCallback, for one)"
                )
        self.args, self.state, self.control = args, state, RunControl()
        # passed to every hook: model, processing_class, optimizer, lr_scheduler
        self.objects: dict[str, Any] = dict(objects or {})

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, **kwargs) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if not callable(method):
                continue
            try:
                out = method(self.args, self.state, self.control, **self.objects, **kwargs)
            except Exception as e:
                raise CallbackError(
                    f"callback {_name(cb)}.{hook} raised: {type(e).__name__}: {e}"
                ) from e
            if isinstance(out, RunControl) or hasattr(out, "should_training_stop"):
                for flag in ("should_training_stop", "should_save", "should_evaluate"):
                    if getattr(out, flag, False):
                        setattr(self.control, flag, True)

    def take(self, accelerator) -> tuple[bool, bool, bool]:
        """(stop, save, evaluate) as asked since the last take, the same on every process (a
        checkpoint and an evaluation are collective); save and evaluate are reset."""
        c = self.control
        flags = [float(c.should_training_stop), float(c.should_save), float(c.should_evaluate)]
        if accelerator.num_processes > 1:
            total = torch.tensor(flags, device=accelerator.device)
            flags = accelerator.reduce(total, "sum").tolist()
        c.should_save = c.should_evaluate = False
        stop, save, evaluate = (f > 0 for f in flags)
        return stop, save, evaluate


def _name(cb) -> str:
    return type(cb).__name__
