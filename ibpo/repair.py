"""Counterfactual repairs (IBPO.md Part 2): the group's own members as counterfactuals.

For each failed completion y_i of a group (reward 0; at most `max_repairs_per_group` per group),
K - 1 sibling references are chosen (correct siblings, reward 1, first by default) and the policy
is asked, through
a documented template, to repair y_i *locally* given the question and the reference. All repairs of
a step are generated in one batched call (adapter on, no gradient) and graded by the run's
reward functions (rewards/functions.py), with the original problem's row, as its completions
are: a repair succeeds when its weighted reward is >= 1. A conversational prompt keeps its
earlier turns; the repair request takes the place of its last user message. From them:

    phi_i = rho * mean over y_i's references of 1[repair correct]      (0 unless R_i = 0)
    edited[i, t] = token t of y_i was changed by its most local successful repair
                   (token-level Levenshtein alignment; all True when no repair succeeded)

`advantages.shape_rewards` and `advantages.token_advantages` turn these into R' and token
advantages. Device contract: phi and the edit masks are host (CPU) tensors, like the rewards they
come from (the grader's verdicts, token alignments of host token lists): this module reads no
value from the device, and step.py moves the masks to the rollout's device in one place.
Repairs are scored, never trained on. A partly correct completion (0 < R < 1, e.g. a
fraction of a problem's code tests) is neither repaired nor a preferred reference: IBPO.md's phi
needs R_i = 0, and a bonus on R_i = 0.9 could lift it above a fully correct sibling.

How many of the planned repairs run is the spending rule's (repair_spending.py): under a
finite token budget a random subset that fits, the rest skipped (logged as repairs_skipped).

Not here: the reward shaping arithmetic (advantages.py), the spending rule itself, or the loss.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ibpo.advantages import edited_tokens
from ibpo.config import DataConfig, RepairConfig
from ibpo.data import Example, prompt_messages, render_messages, render_user_message, user_message
from ibpo.repair_spending import SpendingState, affordable, repair_cost
from ibpo.rewards.functions import RewardSet, grade
from ibpo.rollout import Generator, Rollout


@dataclass(frozen=True)
class RepairJob:
    group: int  # b in [0, B)
    member: int  # i in [0, G): the failed attempt (reward 0)
    reference: int  # j in [0, G): the sibling shown as a reference


def choose_references(
    correct: list[bool], member: int, k: int, selection: str, rng: random.Random
) -> list[int]:
    """Up to k sibling indices for `member` of one group (never the member itself)."""
    siblings = [j for j in range(len(correct)) if j != member]
    rng.shuffle(siblings)
    if selection == "random":
        return siblings[:k]
    good = [j for j in siblings if correct[j]]
    if selection == "correct_only":
        return good[:k]
    return (good + [j for j in siblings if not correct[j]])[:k]


def plan_repairs(
    rewards: Tensor, references: int, max_per_group: int, selection: str, rng: random.Random
) -> list[RepairJob]:
    """rewards [B, G] (host) -> the repair generations of a step (at most max_per_group x K-1 per
    group): failed members (R = 0) get references, correct ones (R >= 1) first. Which failed
    members are repaired when the cap binds is random, not positional. Ordered by group, then
    reference: repairs that show the same reference are neighbours, so a template that puts
    the reference before the attempt gives them one shared prefix (rollout.share_prefixes)."""
    jobs = []
    for b, row in enumerate(rewards.tolist()):
        correct = [r >= 1.0 for r in row]
        failed = [i for i, r in enumerate(row) if r <= 0.0]
        rng.shuffle(failed)
        for i in failed[:max_per_group]:
            for j in choose_references(correct, i, references, selection, rng):
                jobs.append(RepairJob(b, i, j))
    return sorted(jobs, key=lambda job: (job.group, job.reference, job.member))


def phi_from_repairs(
    jobs: list[RepairJob], success: list[bool], shape: tuple[int, int], rho: float
) -> Tensor:
    """phi [B, G] = rho * (share of a member's repairs that succeeded); 0 where none ran."""
    hits, runs = torch.zeros(shape, device="cpu"), torch.zeros(shape, device="cpu")
    for job, ok in zip(jobs, success):
        runs[job.group, job.member] += 1
        hits[job.group, job.member] += float(ok)
    return rho * hits / runs.clamp_min(1)


def fill_template(template: str, question: str, attempt: str, reference: str) -> str:
    # str.replace, not str.format: templates and answers may contain LaTeX braces
    return (
        template.replace("{question}", question)
        .replace("{attempt}", attempt.strip())
        .replace("{reference}", reference.strip())
    )


def edit_masks(
    attempts: list[list[int]],
    width: int,
    jobs: list[RepairJob],
    repairs: list[list[int]],
    success: list[bool],
    group_size: int,
) -> tuple[Tensor, float]:
    """edited [N, width] bool on the host (True = carries blame) and the edited share of repaired
    attempts. An attempt with several successful repairs takes the most local one (fewest edited
    tokens); with no jobs every token carries blame (the mask is then a no-op).
    """
    edited = torch.ones(len(attempts), width, dtype=torch.bool, device="cpu")
    best: dict[int, list[bool]] = {}
    for job, rep, ok in zip(jobs, repairs, success):
        if not ok:
            continue
        n = job.group * group_size + job.member
        marks = edited_tokens(attempts[n], rep)
        if n not in best or sum(marks) < sum(best[n]):
            best[n] = marks
    n_edit = n_tok = 0
    for n, marks in best.items():
        edited[n, : len(marks)] = torch.tensor(marks, dtype=torch.bool, device="cpu")
        n_edit, n_tok = n_edit + sum(marks), n_tok + len(marks)
    return edited, (n_edit / n_tok if n_tok else 0.0)


@dataclass
class RepairOutcome:
    phi: Tensor  # [B, G] host
    edited: Tensor  # [N, T] bool, host
    stats: dict[str, float]
    jobs: list[RepairJob] = field(default_factory=list)  # the repairs that ran
    success: list[bool] = field(default_factory=list)  # ... and which of them succeeded


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
    generator: Generator,
    tokenizer,
    examples: list[Example],
    rollout: Rollout,
    rewards: Tensor,
    reward_set: RewardSet,
    rep: RepairConfig,
    data_cfg: DataConfig,
    gen: dict,
    rng: random.Random,
    budget: float = math.inf,
    spending: SpendingState | None = None,
) -> RepairOutcome:
    """Generate and grade the repairs of one step. rewards [B, G] on the host (the weighted
    rewards of `examples`' completions), graded again by `reward_set` for the repairs; `gen`:
    max_new_tokens, batch_size, temperature, top_p, top_k for the repair generations (already
    resolved). `budget`: the tokens the repairs may run (repair_spending.py; `spending` holds
    the cost estimates): when it is finite, a random subset of the planned repairs that fits
    runs, the others are skipped. A step that runs no repair (every member correct, no eligible
    reference, no budget) gets phi = 0 and all-blame masks from the same code as one that does."""
    B, G = rewards.shape
    jobs = plan_repairs(
        rewards, rep.references, rep.max_repairs_per_group, rep.reference_selection, rng
    )
    width = rollout.completion_mask.shape[1]
    n_wrong = int((rewards <= 0.0).sum().item())
    texts = rollout.texts
    prompts = [
        repair_prompt(
            tokenizer,
            examples[j.group],
            texts[j.group * G + j.member],
            texts[j.group * G + j.reference],
            rep,
            data_cfg,
        )
        for j in jobs
    ]
    planned = len(jobs)
    if math.isfinite(budget) and jobs:
        keep = within_budget(tokenizer, prompts, budget, spending, gen["max_new_tokens"], rng)
        jobs, prompts = [jobs[i] for i in keep], [prompts[i] for i in keep]
    stats = {
        "repairs": float(len(jobs)),
        "repairs_skipped": float(planned - len(jobs)),
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
    attempts = rollout.host_tokens()
    if not jobs:
        edited, _ = edit_masks(attempts, width, [], [], [], G)
        return RepairOutcome(phi_from_repairs([], [], (B, G), rep.rho), edited, stats)
    out = generator(
        tokenizer,
        prompts,
        1,
        gen["max_new_tokens"],
        gen["batch_size"],
        temperature=gen["temperature"],
        top_p=gen["top_p"],
        top_k=gen["top_k"],
    )
    totals, _ = grade(
        reward_set, [examples[j.group] for j in jobs], prompts, out.texts, out.host_tokens()
    )
    success = [t >= 1.0 for t in totals]
    prompt_tokens = sum(out.host_prompt_lengths())
    phi = phi_from_repairs(jobs, success, (B, G), rep.rho)
    edited, frac = edit_masks(attempts, width, jobs, out.host_tokens(), success, G)
    stats.update(
        repair_tokens=float(sum(out.lengths)),
        repair_prefill_tokens=float(
            prompt_tokens if out.prefill_tokens is None else out.prefill_tokens
        ),
        repair_prompt_tokens=float(prompt_tokens),
        repair_decode_tokens=float(sum(out.lengths)),
        repair_successes=float(sum(success)),
        repair_rate=len({(j.group, j.member) for j in jobs}) / max(n_wrong, 1),
        repair_success_rate=sum(success) / len(jobs),
        edited_token_fraction=frac,
    )
    return RepairOutcome(phi, edited, stats, jobs, success)


def within_budget(
    tokenizer,
    prompts: list[str],
    budget: float,
    spending: SpendingState | None,
    max_new_tokens: int,
    rng: random.Random,
) -> list[int]:
    """The planned repairs that run under a budget of `budget` tokens: in a random order, as
    many as fit by repair_spending's cost estimates, returned in plan order."""
    order = rng.sample(range(len(prompts)), len(prompts))
    if budget <= 0:
        return []
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    state = spending or SpendingState()
    costs = [repair_cost(state, len(ids[i]), max_new_tokens) for i in order]
    return sorted(order[: affordable(costs, budget)])
