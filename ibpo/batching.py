"""Micro-batches for the update: which rows of a step's rollout share one forward/backward.

A micro-batch is made of whole groups: the group transforms of `ibpo`/`dfpo` (the group minimum of
the sequence ratio) and the cancellation diagnostic need every member of a group in the same
forward. Groups are sorted by their longest completion, longest first, so that groups of similar
length share a micro-batch and little compute goes to padding. A micro-batch holds at most
`train.micro_batch_groups` groups (groups are never split).

Each micro-batch is then cut to its own width: the left-padding columns that none of its prompts
uses and the completion columns past its longest completion. Position ids come from the attention
mask (logprobs.py), so dropping all-padding columns changes no log-prob.

The gradient does not depend on the partition: the loss of every micro-batch is divided by a
normaliser taken from the whole step (objectives.step_normaliser).

Plans and widths come from the rollout's host copies of its lengths: cutting a micro-batch
reads no value from the device.

Not here: the loss itself (algo/objectives.py) or how rows were generated (generation/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ibpo.generation import Rollout


def plan_micro_batches(
    prompt_lengths: list[int],
    completion_lengths: list[int],
    group_size: int,
    max_groups: int,
) -> list[list[int]]:
    """Row indices of each micro-batch: whole groups (rows g*G .. g*G+G-1), sorted by length.

    prompt_lengths/completion_lengths: real (unpadded) lengths of the N = B * G rows.
    Every row appears exactly once; each micro-batch has <= max_groups groups.
    """
    n = len(completion_lengths)
    if n % group_size or len(prompt_lengths) != n:
        raise ValueError(f"{n} rows do not make whole groups of {group_size}")
    if max_groups < 1:
        raise ValueError("max_groups must be >= 1")
    groups = []
    for g in range(n // group_size):
        rows = list(range(g * group_size, (g + 1) * group_size))
        groups.append(
            (max(completion_lengths[i] for i in rows), max(prompt_lengths[i] for i in rows), rows)
        )
    # longest first; ties by prompt length, then by position (a stable, deterministic order)
    groups.sort(key=lambda x: (-x[0], -x[1]))
    rows = [g[2] for g in groups]
    return [sum(rows[k : k + max_groups], []) for k in range(0, len(rows), max_groups)]


@dataclass
class MicroBatch:
    rows: Tensor  # [n] indices into the step's rollout
    input_ids: Tensor  # [n, p + t] cut to this micro-batch's widths
    attention_mask: Tensor  # [n, p + t]
    completion_mask: Tensor  # [n, t]
    prompt_len: int  # p <= the rollout's P
    tokens: list[list[int]]  # host: each row's completion ids (up to its length)
    group_size: int = 1  # rows are whole groups of this many, one prompt each (logprobs packing)

    @property
    def completion_ids(self) -> Tensor:  # [n, t]
        return self.input_ids[:, self.prompt_len :]

    @property
    def width(self) -> int:  # t
        return self.completion_mask.shape[1]

    def take(self, t: Tensor) -> Tensor:
        """This micro-batch's rows of a per-row tensor of the step ([N] or [N, T] -> cut to t)."""
        t = t[self.rows]
        return t[:, : self.width] if t.dim() == 2 else t


def cut(rollout: Rollout, rows: list[int], group_size: int = 1) -> MicroBatch:
    """The rows of a micro-batch, without the columns that are padding in all of them."""
    idx = torch.tensor(rows, dtype=torch.long, device=rollout.input_ids.device)
    P = rollout.prompt_len
    att = rollout.attention_mask[idx]
    cmask = rollout.completion_mask[idx]
    prompts, tokens = rollout.host_prompt_lengths(), rollout.host_tokens()
    p = max(max(int(prompts[i]) for i in rows), 1)  # keep one column for an empty prompt
    t = max(max(len(tokens[i]) for i in rows), 1)
    cols = slice(P - p, P + t)
    return MicroBatch(
        idx,
        rollout.input_ids[idx][:, cols],
        att[:, cols],
        cmask[:, :t],
        p,
        [tokens[i] for i in rows],
        group_size,
    )


def micro_batches(rollout: Rollout, group_size: int, max_groups: int) -> list[MicroBatch]:
    prompt, completion = rollout.host_prompt_lengths(), rollout.lengths
    plan = plan_micro_batches(prompt, completion, group_size, max_groups)
    return [cut(rollout, rows, group_size) for rows in plan]
