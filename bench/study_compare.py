"""The study's comparisons: paired per-seed differences of two arms' final held-out accuracy
(`compare`), the same at equal compute on each axis (`compare_at`: both runs of a seed read at
the largest budget both reached), the verdict (`significant`: the paired t 95% interval excludes
0), and the first step at which two runs' logs part (did a term act at all?).

It takes the records study_runs reads; it writes no text (study_report does).
"""

from __future__ import annotations

import math

from study_grid import COMPARISONS
from study_runs import AXES
from study_stats import at_equal_compute, mean_known, paired_stats

FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of a pair's common budget: the curves along the way


def compare(arms: dict[str, list[dict]], a: str, b: str) -> dict | None:
    """Paired per-seed differences a - b of the final held-out accuracy (seeds in both)."""
    if a not in arms or b not in arms:
        return None
    left, right = ({r["seed"]: r["after"] for r in arms[x]} for x in (a, b))
    seeds = sorted(set(left) & set(right))
    if not seeds:
        return None
    diffs = [left[s] - right[s] for s in seeds]
    rewards = [({r["seed"]: r["reward"] for r in arms[x]}) for x in (a, b)]
    pairs = [list(zip(rewards[0][s], rewards[1][s])) for s in seeds]
    return {
        "a": a,
        "b": b,
        "seeds": seeds,
        **paired_stats(diffs),
        # how closely the pair's runs tracked each other: their training rewards, step by step
        "reward_gap": mean_known(mean_known(abs(x - y) for x, y in p[1:]) for p in pairs),
        "equal_reward_steps": [sum(x == y for x, y in p) for p in pairs],
    }


def compare_at(arms: dict[str, list[dict]], a: str, b: str, axis: str) -> dict | str:
    """Paired per-seed differences a - b of the held-out accuracy at equal compute on one axis
    (AXES): per seed, both runs read at the largest budget both reached (at_equal_compute),
    and along the way at FRACTIONS of it. Where they cannot be compared, why (a sentence for
    the report): an arm is missing, no seed has both, a run spent nothing on the axis (it did
    not log it), for prompt + decode tokens a run did not log the prompt tokens of its rollouts
    or its repairs (an axis that counts one arm's repair prompts and neither arm's rollout
    prompts would favour the arm without repairs), or the pair's curves do not both reach
    their common budget (a curve starts at its first evaluation and is never extrapolated)."""
    if a not in arms or b not in arms:
        return "an arm has no finished runs"
    left, right = ({r["seed"]: r for r in arms[x]} for x in (a, b))

    def has(run: dict) -> bool:  # None: step seconds taken from no rerun (take_seconds)
        return (run.get("compute") or {}).get(axis) is not None

    seeds = sorted(s for s in set(left) & set(right) if has(left[s]) and has(right[s]))
    pairs = [(left[s], right[s]) for s in seeds]
    runs = [r for p in pairs for r in p]
    if not runs:
        return f"no seed has both runs' {AXES[axis][0]}" + (
            " (no rerun reproduced the pair)" if axis == "seconds" else ""
        )
    if any(not r.get("compute_curves") or not r["compute"][axis] > 0 for r in runs):
        return f"a run logged no {AXES[axis][0]}"
    if axis == "tokens" and not all(_prompts_recorded(r) for r in runs):
        return (
            "their runs did not log the prompt tokens of their rollouts "
            "(`rollout_prefill_tokens`) or repairs (`repair_prefill_tokens`), and an axis that "
            "counts one arm's repair prompts and neither arm's rollout prompts would favour the "
            "arm without repairs"
        )
    curves = [(x["compute_curves"][axis], y["compute_curves"][axis]) for x, y in pairs]
    along = {}
    for f in FRACTIONS:
        # a curve starts at its first evaluation (compute 0 with the evaluation before training):
        # a budget below it is not read, never extrapolated
        if any(f * min(ca[-1][0], cb[-1][0]) < max(ca[0][0], cb[0][0]) for ca, cb in curves):
            continue
        read = [at_equal_compute(ca, cb, f) for ca, cb in curves]
        along[f] = ([ya - yb for _, ya, yb in read], [budget for budget, _, _ in read])
    if 1.0 not in along:
        return (
            "a pair's held-out curves do not both reach the budget they share (a run evaluated "
            "only at its end has one point, at what it spent)"
        )
    diffs, budgets = along[1.0]
    return {
        "a": a,
        "b": b,
        "axis": axis,
        "seeds": seeds,
        **paired_stats(diffs),
        "budgets": budgets,  # per seed: the compute both runs reached, where they are compared
        "ratios": [x["compute"][axis] / y["compute"][axis] for x, y in pairs],  # a / b spent
        "along": {str(f): {**paired_stats(d), "budgets": bs} for f, (d, bs) in along.items()},
    }


def _prompts_recorded(run: dict) -> bool:
    return run["rollout_prompts_recorded"] and run["repair_prompts_recorded"]


def verdict(c: dict) -> str:
    """'higher', 'lower' (the paired t 95% interval excludes 0) or 'no difference'."""
    if not significant(c):
        return "no difference"
    return "higher" if c["mean"] > 0 else "lower"


def significant(c: dict) -> bool:
    """The verdict: the paired t 95% interval excludes 0 (a two-sided paired t-test at 0.05).
    The sign test cannot go below 0.0625 with 5 seeds, and a percentile bootstrap of 5 values
    is too narrow: it takes the seeds' spread as known, so at n = 5 its interval is about 0.63
    times the t-interval's width (sqrt(4/5) x 1.96 / 2.776). Both are reported beside it;
    neither decides."""
    low, high = c["t_ci"]
    return not (math.isnan(low) or low <= 0 <= high)


def first_difference(a: dict, b: dict, keys=("loss", "entropy", "reward")) -> int | None:
    """The first step at which two runs' logged figures differ (None: identical throughout). Runs
    of one seed draw the same samples, so two arms that differ only in a term that never acts
    produce identical logs, digit for digit. The loss shows a difference at the step it happens;
    entropy and reward from the next."""
    keys = [k for k in keys if a.get(k) and b.get(k) and None not in a[k] + b[k]]

    def rows(r: dict) -> list[tuple]:
        return list(zip(*(r[k] for k in keys)))

    for step, (x, y) in enumerate(zip(rows(a), rows(b)), start=1):
        if x != y:
            return step
    return None


def at_each_axis(
    arms: dict[str, list[dict]],
) -> tuple[list[tuple[str, dict[str, dict]]], list[tuple[str, str, str]]]:
    """Each comparison on every axis it can be made on, and (label, axis, why) for the axes it
    cannot, for comparisons made on at least one."""
    equal, missing = [], []
    for label, a, b in COMPARISONS:
        found = {axis: compare_at(arms, a, b, axis) for axis in AXES}
        made = {axis: c for axis, c in found.items() if isinstance(c, dict)}
        if made:
            equal.append((label, made))
            missing += [(label, axis, why) for axis, why in found.items() if axis not in made]
    return equal, missing
