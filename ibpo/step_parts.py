"""The parts of an RL step: what it changes and what its stages hand each other.

`StepParts` is what a step changes besides the run's counters: the trainer builds them, the
step trains them, checkpoints save and restore exactly them (run/checkpoint.py) and the run
folder adjusts the optimizer's settings on resume (run/outdir.py). The stages of step.py hand
each other small dataclasses: `Round` (one generation round), `ScoredBatch` (what the update
trains on), `UpdateResult` (what the update did), which step_metrics.py reads. This module sits
below all of them, so that each imports these from one place.

Not here: the step itself (step.py), the counters of a run (run/checkpoint.TrainerState).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ibpo.algo.spending import SpendingState
from ibpo.data import PromptStream, RowStream
from ibpo.generation import Rollout
from ibpo.rewards.functions import Grades


@dataclass
class StepParts:
    """The policy, optimizer and scheduler (prepared by Accelerate), this process's prompt
    stream, the repair planner's rng and the repair spending rule's history (what earlier
    steps' repairs returned; the same on every process)."""

    model: Any
    optimizer: Any
    scheduler: Any
    stream: PromptStream | RowStream
    rng: random.Random
    repair_history: SpendingState = field(default_factory=SpendingState)


@dataclass
class Round:
    """One generation round: its rollout (on the device) and, on the host, rewards and shaped
    rewards [B, G] and the edit masks [N, T] (None when repairs are off); each reward
    function's values (NaN: did not apply), for its logged mean; the round's gradings
    (rollout, repairs), for what they reported."""

    rollout: Rollout
    rewards: Tensor
    shaped: Tensor
    edited: Tensor | None
    stats: dict[str, float] = field(default_factory=dict)
    per_function: dict[str, list[float]] = field(default_factory=dict)
    table: list[dict] = field(default_factory=list)  # one row per completion (completion_rows)
    gradings: list[Grades] = field(default_factory=list)

    def select(self, groups: list[int], group_size: int) -> Round:
        rows = [b * group_size + i for b in groups for i in range(group_size)]
        edited = None if self.edited is None else self.edited[rows]
        table = [self.table[i] for i in rows] if self.table else []
        return Round(
            self.rollout.select(rows),
            self.rewards[groups],
            self.shaped[groups],
            edited,
            table=table,
        )


@dataclass
class ScoredBatch:
    rollout: Rollout  # N = B' * G sequences (B' <= B with dynamic sampling)
    rewards: Tensor  # [B', G] grader rewards
    seq_adv: Tensor  # [N] sequence advantages (from shaped rewards)
    adv: Tensor  # [N, T] token advantages (edit masks applied)
    stats: dict[str, float] = field(default_factory=dict)
    host_adv: list[float] = field(default_factory=list)  # seq_adv, read from the host copy
    # every sampled completion of the step (the trained ones with their advantage): the run
    # folder's completions table
    table: list[dict] = field(default_factory=list)
    gradings: list[Grades] = field(default_factory=list)  # every grading of the step


@dataclass
class UpdateResult:
    """What one step's update did (update_policy), read from the device once."""

    stats: dict[str, list[float]]  # per micro-batch: loss, entropy, kl, clip/gate fractions...
    cancel: dict[str, float]  # the cancellation diagnostic's sums over micro-batches
    grad_norm: float  # of the last update (before clipping)
    updates: int  # optimizer updates attempted (updates_per_rollout, fewer when one was skipped)
    skipped: bool  # an update was dropped because a loss or the gradient was not finite
    time_frozen: float  # seconds spent on old/reference log-probs
