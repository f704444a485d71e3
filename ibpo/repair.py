"""Counterfactual repairs (IBPO.md Part 2), run: one step's repairs generated and graded.

The plan (which failed members are repaired against which siblings), phi and the edit masks are
the algorithm's (algo/counterfactual.py); this module runs the model for them. All repairs of a
step are generated in one batched call (adapter on, no gradient) and graded by the run's reward
functions (rewards/functions.py), with the original problem's row, as its completions are: a
repair succeeds when its weighted reward reaches reward.correct_threshold (1 by default). A
conversational prompt keeps its earlier turns; the repair request takes the place of its last
user message. A member is failed when its reward is <= reward.failed_threshold (0 by default).

`advantages.shape_rewards` and `advantages.token_advantages` turn phi and the masks into R' and
token advantages. Device contract: phi and the edit masks are host (CPU) tensors, like the
rewards they come from (the grader's verdicts, token alignments of host token lists): this
module reads no value from the device, and step.py moves the masks to the rollout's device in
one place. Repairs are scored, never trained on.

Not here: the repair arithmetic (algo/counterfactual.py), the reward shaping (algo/advantages.py),
the spending rule (algo/spending.py, applied by repair_budget.py) or the loss. How many of the
planned repairs run is the spending rule's: under a finite token budget a random subset that
fits (repair_budget.within_budget), the rest skipped (logged as repairs_skipped).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ibpo.algo.counterfactual import (
    RepairJob,
    edit_masks,
    fill_template,
    phi_from_repairs,
    plan_repairs,
)
from ibpo.config import DataConfig, RepairConfig
from ibpo.data import Example, prompt_messages, render_messages, render_user_message, user_message
from ibpo.generation import Generator, Rollout
from ibpo.repair_budget import RepairBudget, within_budget
from ibpo.rewards.functions import Grades, RewardSet, grade_completions


@dataclass(frozen=True)
class RepairGeneration:
    """What generating a step's repairs needs: the generator (the rollout's, adapter on) and
    tokenizer, how a problem's prompt renders (`data`), and the sampling of the repair
    generations (the rollout's temperature and top_p, repair.batch_size)."""

    generator: Generator
    tokenizer: Any
    data: DataConfig
    max_new_tokens: int
    batch_size: int
    temperature: float
    top_p: float

    def __call__(self, prompts: list[str]) -> Rollout:
        """One repair per prompt, all in one batched call."""
        return self.generator(
            self.tokenizer,
            prompts,
            1,
            self.max_new_tokens,
            self.batch_size,
            temperature=self.temperature,
            top_p=self.top_p,
        )


@dataclass
class RepairOutcome:
    phi: Tensor  # [B, G] host
    edited: Tensor  # [N, T] bool, host
    stats: dict[str, float]
    jobs: list[RepairJob] = field(default_factory=list)  # the repairs that ran
    success: list[bool] = field(default_factory=list)  # ... and which of them succeeded
    grades: Grades | None = None  # the repairs' grading (None: none ran)


def repair_prompt(
    tokenizer, ex: Example, attempt: str, reference: str, rep: RepairConfig, cfg: DataConfig
) -> str:
    """The rendered request to repair `attempt` given `reference`: the template around the
    problem's user message; a conversation keeps the turns before its last user message."""
    if ex.messages is None:
        user = user_message(ex.question, cfg)
        return render_user_message(
            tokenizer, fill_template(rep.template, user, attempt, reference), cfg
        )
    messages = prompt_messages(ex, cfg)
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    filled = fill_template(rep.template, str(messages[last]["content"]), attempt, reference)
    return render_messages(tokenizer, [*messages[:last], {"role": "user", "content": filled}], cfg)


def run_repairs(
    gen: RepairGeneration,
    examples: list[Example],
    rollout: Rollout,
    rewards: Tensor,
    reward_fns: RewardSet,
    rep: RepairConfig,
    rng: random.Random,
    budget: RepairBudget | None = None,
) -> RepairOutcome:
    """Generate and grade the repairs of one step. rewards [B, G] on the host (the weighted
    rewards of `examples`' completions), graded again by `reward_fns` for the repairs.
    `budget`: what the repairs may cost (repair_budget.py; None: no limit): when it is finite,
    a random subset of the planned repairs that fits runs, the others are skipped. A step that
    runs no repair (every member correct, no eligible reference, no budget) gets phi = 0 and
    all-blame masks from the same code as one that does."""
    B, G = rewards.shape
    jobs = plan_repairs(
        rewards,
        rep.references,
        rep.max_repairs_per_group,
        rep.reference_selection,
        rng,
        reward_fns.correct,
        reward_fns.failed,
    )
    texts = rollout.texts
    prompts = [
        repair_prompt(
            gen.tokenizer,
            examples[j.group],
            texts[j.group * G + j.member],
            texts[j.group * G + j.reference],
            rep,
            gen.data,
        )
        for j in jobs
    ]
    planned = len(jobs)
    if budget is not None and math.isfinite(budget.tokens) and jobs:
        keep = within_budget(gen.tokenizer, prompts, budget, gen.max_new_tokens, rng)
        jobs, prompts = [jobs[i] for i in keep], [prompts[i] for i in keep]
    stats = empty_stats(len(jobs), planned)
    width, attempts = rollout.completion_mask.shape[1], rollout.host_tokens()
    if not jobs:
        edited, _ = edit_masks(attempts, width, [], [], [], G)
        return RepairOutcome(phi_from_repairs([], [], (B, G), rep.rho), edited, stats)
    out = gen(prompts)
    grades = grade_completions(
        reward_fns, [examples[j.group] for j in jobs], prompts, out.texts, out.host_tokens()
    )
    success = [t >= reward_fns.correct for t in grades.totals]
    phi = phi_from_repairs(jobs, success, (B, G), rep.rho)
    edited, frac = edit_masks(attempts, width, jobs, out.host_tokens(), success, G)
    n_wrong = int((rewards <= reward_fns.failed).sum().item())
    stats.update(ran_stats(out, jobs, success, n_wrong), edited_token_fraction=frac)
    return RepairOutcome(phi, edited, stats, jobs, success, grades)


def empty_stats(repairs: int, planned: int) -> dict[str, float]:
    """A step's repair statistics before any repair ran (their logged order)."""
    return {
        "repairs": float(repairs),
        "repairs_skipped": float(planned - repairs),
        "repair_successes": 0.0,
        "repair_tokens": 0.0,
        # the repair phase's work: prompt tokens the model ran (a prefix repair prompts share,
        # counted once), the prompts' tokens (what prefill would cost without the sharing) and
        # tokens decoded (= repair_tokens)
        "repair_prefill_tokens": 0.0,
        "repair_prompt_tokens": 0.0,
        "repair_decode_tokens": 0.0,
        "repair_rate": 0.0,
        "repair_success_rate": 0.0,
        "edited_token_fraction": 0.0,
    }


def ran_stats(out: Rollout, jobs: list[RepairJob], success: list[bool], n_wrong: int) -> dict:
    """What the repairs that ran cost and returned; `n_wrong`: the step's failed members."""
    prompt_tokens = sum(out.host_prompt_lengths())
    return {
        "repair_tokens": float(sum(out.lengths)),
        "repair_prefill_tokens": float(
            prompt_tokens if out.prefill_tokens is None else out.prefill_tokens
        ),
        "repair_prompt_tokens": float(prompt_tokens),
        "repair_decode_tokens": float(sum(out.lengths)),
        "repair_successes": float(sum(success)),
        "repair_rate": len({(j.group, j.member) for j in jobs}) / max(n_wrong, 1),
        "repair_success_rate": sum(success) / len(jobs),
    }
