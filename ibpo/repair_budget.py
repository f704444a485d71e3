"""The repair spending rule as a step applies it: the step's decision, each round's budget, which
planned repairs fit it, and what the rule learns after the step.

algo/spending.py holds the rule itself (plain numbers in, a decision out); this module is where
it meets a run: the rule's history (`SpendingState`: what earlier steps' repairs returned)
becomes one `RepairDecision` per step, the same on every process; a round's decision and the
tokens its rollout ran become a `RepairBudget`; under a finite budget `within_budget` picks a
random subset of the planned repairs that fits (repair.py runs them); after the step
`observe_repairs` feeds the rule the step's repair totals over all processes (one all-reduce).
It also logs what the rule did (repair_probe, repair_running_success, repair_cost_share).

Not here: the rule's arithmetic (algo/spending.py), planning or running repairs (repair.py,
algo/counterfactual.py), or whether a run repairs at all (step.repairs_enabled).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ibpo.algo.spending import (
    PROBE,
    SpendingState,
    affordable,
    allowance,
    cost_share,
    decide,
    observe,
    repair_cost,
    running_success,
)
from ibpo.distributed import summed

# what the rule learns from a step's repairs (algo/spending.observe), in its order
REPAIR_TOTALS = (
    "repairs",
    "repair_successes",
    "repair_prompt_tokens",
    "repair_prefill_tokens",
    "repair_decode_tokens",
)


@dataclass(frozen=True)
class RepairBudget:
    """What one round's repairs may cost: `tokens` (inf: every planned repair runs) and the
    rule's history, whose running ratios estimate each repair's cost."""

    tokens: float = math.inf
    history: SpendingState = field(default_factory=SpendingState)


@dataclass(frozen=True)
class RepairDecision:
    """A step's repair decision (algo/spending: SPEND, PROBE or SKIP) and the history it was
    taken from; every round of the step follows it."""

    mode: str
    history: SpendingState

    def budget(self, rollout_tokens: float, share: float) -> RepairBudget:
        """A round's budget: by the decision, `share` of the tokens the round runs, given the
        tokens its rollout ran (prompt tokens run + tokens decoded)."""
        return RepairBudget(allowance(self.mode, rollout_tokens, share), self.history)


def decide_repairs(history: SpendingState, floor: float, probe_every: int) -> RepairDecision:
    """This step's decision from what earlier steps' repairs returned: the same history, hence
    the same decision, on every process."""
    return RepairDecision(decide(history, floor, probe_every), history)


def within_budget(
    tokenizer, prompts: list[str], budget: RepairBudget, max_new_tokens: int, rng: random.Random
) -> list[int]:
    """The planned repairs that run under `budget`: in a random order, as many as fit by the
    rule's cost estimates (algo/spending.py), returned in plan order."""
    order = rng.sample(range(len(prompts)), len(prompts))
    if budget.tokens <= 0:
        return []
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    costs = [repair_cost(budget.history, len(ids[i]), max_new_tokens) for i in order]
    return sorted(order[: affordable(costs, budget.tokens)])


def observe_repairs(accelerator, history: SpendingState, mode: str, stats: dict) -> SpendingState:
    """The rule's history after a step: fed the step's repair totals over all processes (one
    all-reduce), so that every process holds the same history. Logs the step's decision and the
    running success rate after it into `stats`."""
    totals = summed(accelerator, [stats.get(key, 0.0) for key in REPAIR_TOTALS])
    history = observe(history, mode, *totals)
    stats["repair_probe"] = float(mode == PROBE)
    rate = running_success(history)
    if rate is not None:
        stats["repair_running_success"] = rate
    return history


def repair_cost_share(stats: dict[str, float]) -> float:
    """The repairs' share of the tokens a step ran through the model (prompt + decode), from
    the step's summed round statistics; the rollout's generated tokens count the repairs' too."""
    repair_decode = stats.get("repair_decode_tokens", 0.0)
    repair = stats.get("repair_prefill_tokens", 0.0) + repair_decode
    rollout = stats.get("rollout_prefill_tokens", 0.0) + stats["generated_tokens"]
    return cost_share(repair, rollout - repair_decode)
