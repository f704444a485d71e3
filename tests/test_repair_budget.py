"""The repair spending rule as a step applies it (ibpo/repair_budget.py), on hand-computed
values: a step's decision and each round's budget, which planned repairs fit, what the rule's
history learns after the step and what it logs, and the repairs' share of the step's tokens."""

import math
import random

import pytest

from ibpo.algo.spending import DECAY, PROBE, SKIP, SPEND, SpendingState
from ibpo.repair_budget import (
    REPAIR_TOTALS,
    RepairBudget,
    decide_repairs,
    observe_repairs,
    repair_cost_share,
    within_budget,
)


class _OneProcess:
    num_processes = 1


class _CharTok:
    """Tokens = characters."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t) for t in texts]}


def test_a_decision_carries_its_history_and_sets_each_rounds_budget():
    fresh = decide_repairs(SpendingState(), floor=0.1, probe_every=5)
    assert fresh.mode == SPEND and fresh.history == SpendingState()
    # cost_share 0.2: the repairs may cost 0.2 / 0.8 = 1/4 of the rollout's 400 tokens
    budget = fresh.budget(400.0, 0.2)
    assert budget == RepairBudget(100.0, SpendingState())
    assert fresh.budget(400.0, 1.0).tokens == math.inf  # share 1: no budget
    poor = SpendingState(attempts=20, successes=1)  # r = 0.05 < 0.1
    skip = decide_repairs(poor, floor=0.1, probe_every=5)
    assert skip.mode == SKIP and skip.budget(400.0, 0.2).tokens == 0.0
    assert decide_repairs(SpendingState(attempts=20, successes=1, idle=4), 0.1, 5).mode == PROBE


def test_the_repairs_that_fit_a_budget_are_a_random_subset_in_plan_order():
    prompts = ["aaaa", "bb", "cccccc", "d"]  # 4, 2, 6, 1 tokens

    def kept(budget: RepairBudget, seed: int) -> list[int]:
        return within_budget(_CharTok(), prompts, budget, 3, random.Random(seed))

    # nothing ran yet: each costs its prompt + max_new_tokens (3): 7, 5, 9, 4.
    # seed 0 draws the order 3, 1, 0, 2: 4 + 5 = 9 fits 12, + 7 does not
    assert kept(RepairBudget(12.0), 0) == [1, 3]
    # seed 6 draws 0, 1, 2, 3: 7 + 5 = 12, exactly the budget, fits
    assert kept(RepairBudget(12.0), 6) == [0, 1]
    assert kept(RepairBudget(0.0), 0) == []
    # with a history: prompt tokens x 0.5 (a shared prefix) + 2 decode tokens per repair,
    # 4, 3, 5, 2.5; a budget of 2.5 fits "d" when it is drawn first (seed 0), and nothing when
    # a dearer repair is (seed 1 draws 1 first), though "d" comes later
    seen = SpendingState(attempts=4, prompt_tokens=40, prefill_tokens=20, decode_tokens=8)
    assert kept(RepairBudget(2.5, seen), 0) == [3]
    assert kept(RepairBudget(2.5, seen), 1) == []
    assert kept(RepairBudget(14.5, seen), 1) == [0, 1, 2, 3]


def test_observing_a_step_feeds_the_rule_and_logs_what_it_did():
    stats = dict(zip(REPAIR_TOTALS, [4.0, 1.0, 100.0, 60.0, 40.0]))
    history = observe_repairs(_OneProcess(), SpendingState(attempts=2, successes=2), PROBE, stats)
    assert history == SpendingState(
        attempts=DECAY * 2 + 4,
        successes=DECAY * 2 + 1,
        prompt_tokens=100.0,
        prefill_tokens=60.0,
        decode_tokens=40.0,
    )
    assert stats["repair_probe"] == 1.0
    assert stats["repair_running_success"] == pytest.approx((DECAY * 2 + 1) / (DECAY * 2 + 4))
    skipped: dict = {}
    after = observe_repairs(_OneProcess(), SpendingState(), SKIP, skipped)
    assert after.idle == 1 and skipped == {"repair_probe": 0.0}  # no rate before any repair


def test_the_repairs_share_of_the_steps_tokens():
    # rollouts: 300 prompt tokens run, 200 decoded; repairs: 50 run, 150 decoded (counted in
    # generated_tokens): the repairs ran 200 of 700 tokens
    stats = {
        "rollout_prefill_tokens": 300.0,
        "generated_tokens": 350.0,
        "repair_prefill_tokens": 50.0,
        "repair_decode_tokens": 150.0,
    }
    assert repair_cost_share(stats) == pytest.approx(200 / 700)
    assert repair_cost_share({"generated_tokens": 0.0}) == 0.0
