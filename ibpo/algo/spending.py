"""How much of a step IBPO's repairs may spend, decided from what earlier repairs returned.

Repairs cost generation (each prompt holds the question, an attempt and a reference) and return
something only when they succeed: a failed completion whose repair is correct gets phi > 0 and
an edit mask. The rule, per step (every round of a step follows the step's decision):

    r = S / A            the running success rate: successes S over attempts A, summed over the
                         steps that ran repairs, each such step halving the weight of the ones
                         before it (DECAY), so r follows what the policy repairs now
    spend                while no repair has run yet (the first ones measure r), or r >= floor
    skip                 r < floor: no repair runs; the step trains on Part 1 alone (phi = 0,
                         every token keeps its blame), as `dfpo` does
    probe                r < floor, but probe_every - 1 steps in a row have skipped: this step
                         repairs as a spending one does, so that a policy that has learnt to
                         repair gets its repairs back

A round that repairs (spend or probe) may cost at most share / (1 - share) x the tokens its
rollout ran (prompt tokens run + tokens decoded), so that the repairs are at most `share` of the
tokens the round runs through the model. A repair is estimated at its prompt's tokens x the
running ratio of prompt tokens run to prompt tokens (shared prefixes make it < 1) plus the
running decode tokens per repair; before any repair has run, at its prompt's tokens plus the
repair's max_new_tokens (an upper bound). Which planned repairs run when the budget binds is
the caller's (a random subset, in repair.py).

Plain values in, decision out: no model, no config, no tensors. `SpendingState` is the rule's
whole state (plain numbers, `state_dict` / `from_state_dict` for checkpoints); under several
processes the caller feeds `observe` the totals of all processes, so that every process holds
the same state and takes the same decision.

Not here: planning repairs (repair.py), generating them, or summing over processes (step.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

# Each step that ran repairs halves the weight of what came before: r is about the last two or
# three such steps' repairs, recent enough to follow a policy that learns, pooled over enough
# attempts (two default steps: 32) that one lucky success does not decide alone.
DECAY = 0.5

SPEND, PROBE, SKIP = "spend", "probe", "skip"


@dataclass(frozen=True)
class SpendingState:
    """What the rule knows: decayed sums over the steps that ran repairs, and the steps skipped
    since repairs last ran."""

    attempts: float = 0.0  # repairs generated
    successes: float = 0.0  # ... of them correct
    prompt_tokens: float = 0.0  # their prompts' tokens
    prefill_tokens: float = 0.0  # prompt tokens the model ran (a shared prefix once)
    decode_tokens: float = 0.0  # tokens the repairs generated
    idle: int = 0  # steps in a row that skipped (for probes)

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> SpendingState:
        return cls(**state)


def running_success(state: SpendingState) -> float | None:
    """r = S / A; None before any repair has run."""
    return state.successes / state.attempts if state.attempts > 0 else None


def decide(state: SpendingState, floor: float, probe_every: int) -> str:
    """SPEND, PROBE or SKIP for the next step. floor 0 never skips; probe_every 0 never probes."""
    r = running_success(state)
    if r is None or r >= floor:
        return SPEND
    if probe_every > 0 and state.idle + 1 >= probe_every:
        return PROBE
    return SKIP


def allowance(mode: str, rollout_tokens: float, share: float) -> float:
    """The tokens a round's repairs may cost: 0 when skipping, share / (1 - share) x the tokens
    its rollout ran otherwise (inf for share 1: no budget)."""
    if mode == SKIP:
        return 0.0
    if share >= 1.0:
        return math.inf
    return share / (1.0 - share) * rollout_tokens


def repair_cost(state: SpendingState, prompt_tokens: int, max_new_tokens: int) -> float:
    """The estimated tokens one repair with a prompt of `prompt_tokens` tokens will run."""
    if state.attempts <= 0 or state.prompt_tokens <= 0:
        return float(prompt_tokens + max_new_tokens)
    ratio = state.prefill_tokens / state.prompt_tokens
    return prompt_tokens * ratio + state.decode_tokens / state.attempts


def affordable(costs: list[float], budget: float) -> int:
    """How many of the repairs, taken in order, fit in `budget` tokens (the first n whose costs
    add up to at most the budget)."""
    total, n = 0.0, 0
    for cost in costs:
        total += cost
        if total > budget:
            break
        n += 1
    return n


def observe(
    state: SpendingState,
    mode: str,
    attempts: float,
    successes: float,
    prompt_tokens: float,
    prefill_tokens: float,
    decode_tokens: float,
) -> SpendingState:
    """The state after a step decided `mode` and ran `attempts` repairs (totals over all
    processes). A step that repaired nothing (nothing failed, or nothing fit) leaves the sums
    as they were; a skipped step counts towards the next probe, and a step that repaired
    resets that count."""
    if attempts > 0:
        return SpendingState(
            attempts=DECAY * state.attempts + attempts,
            successes=DECAY * state.successes + successes,
            prompt_tokens=DECAY * state.prompt_tokens + prompt_tokens,
            prefill_tokens=DECAY * state.prefill_tokens + prefill_tokens,
            decode_tokens=DECAY * state.decode_tokens + decode_tokens,
            idle=0,
        )
    if mode == SKIP:
        return replace(state, idle=state.idle + 1)
    return state


def cost_share(repair_tokens: float, rollout_tokens: float) -> float:
    """The repairs' share of the tokens a step ran (0 when it ran none)."""
    total = repair_tokens + rollout_tokens
    return repair_tokens / total if total > 0 else 0.0
