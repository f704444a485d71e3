"""Counterfactual repairs (IBPO.md Part 2), the arithmetic: which failed members of a group are
repaired against which siblings, the request that asks for the repair, and what the verdicts
give back.

For each failed completion y_i of a group (reward 0; at most `max_per_group` per group), K - 1
sibling references are chosen (correct siblings, reward 1, first by default); the template
asks the policy to repair y_i *locally* given the question and the reference. From the
repairs' verdicts and tokens:

    phi_i = rho * mean over y_i's references of 1[repair correct]      (0 unless R_i = 0)
    edited[i, t] = token t of y_i was changed by its most local successful repair
                   (token-level Levenshtein alignment; all True when no repair succeeded)

A partly correct completion (0 < R < 1, e.g. a fraction of a problem's code tests) is neither
repaired nor a preferred reference: IBPO.md's phi needs R_i = 0, and a bonus on R_i = 0.9 could
lift it above a fully correct sibling. phi and the edit masks are host (CPU) tensors, like the
rewards they come from.

Not here: generating and grading the repairs (repair.py, which the step calls), the reward
shaping and token advantages (advantages.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from rapidfuzz.distance import Levenshtein
from torch import Tensor


@dataclass(frozen=True)
class RepairJob:
    """One repair generation: failed member `member` of group `group`, shown sibling `reference`."""

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
    rewards: Tensor,
    references: int,
    max_per_group: int,
    selection: str,
    rng: random.Random,
    correct_at: float = 1.0,
    failed_at: float = 0.0,
) -> list[RepairJob]:
    """rewards [B, G] (host) -> the repair generations of a step (at most max_per_group x K-1 per
    group): failed members (R <= failed_at) get references, correct ones (R >= correct_at)
    first. Which failed members are repaired when the cap binds is random, not positional. A
    NaN reward (no reward applies) is neither. Ordered by group, then reference: repairs that
    show the same reference are neighbours, so a template that puts the reference before the
    attempt gives them one shared prefix (generation.generate runs it once)."""
    jobs = []
    for b, row in enumerate(rewards.tolist()):
        correct = [r >= correct_at for r in row]
        failed = [i for i, r in enumerate(row) if r <= failed_at]
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


def edited_tokens(attempt: list[int], repair: list[int]) -> list[bool]:
    """For each token of `attempt`: True when the minimal alignment to `repair` changes it.

    Replaced and deleted tokens are edited. An insertion before position j means the policy
    emitted attempt[j] where the repair wrote something else first, so attempt[j] is marked too
    (an insertion at the very end marks the last token: stopping there was the mistake).
    """
    edited = [False] * len(attempt)
    if not attempt:
        return edited
    for op in Levenshtein.editops(attempt, repair):
        edited[min(op.src_pos, len(attempt) - 1)] = True
    return edited
