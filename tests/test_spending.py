"""The repair spending rule (algo/spending.py) on hand-computed values: when a step spends,
skips or probes, what its repairs may cost, how the state learns, and that a policy that learns
to repair gets its repairs back."""

import math

import pytest

from ibpo.algo.spending import (
    DECAY,
    PROBE,
    SKIP,
    SPEND,
    SpendingState,
    affordable,
    allowance,
    cost_share,
    decide,
    observe,
    repair_cost,
    running_success,
)


def _seen(attempts: float, successes: float, idle: int = 0) -> SpendingState:
    return SpendingState(attempts=attempts, successes=successes, idle=idle)


def test_a_fresh_rule_spends_and_measures():
    fresh = SpendingState()
    assert running_success(fresh) is None
    assert decide(fresh, floor=0.9, probe_every=5) == SPEND


@pytest.mark.parametrize(
    "state, floor, probe_every, mode",
    [
        (_seen(20, 2), 0.1, 5, SPEND),  # r = 0.10: at the floor spends
        (_seen(20, 1), 0.1, 5, SKIP),  # r = 0.05
        (_seen(20, 1, idle=3), 0.1, 5, SKIP),  # 3 skipped: the 5th step is the probe
        (_seen(20, 1, idle=4), 0.1, 5, PROBE),
        (_seen(20, 1, idle=9), 0.1, 5, PROBE),  # a probe that found nothing to repair waits on
        (_seen(20, 0, idle=100), 0.1, 0, SKIP),  # probe_every 0: never probes
        (_seen(20, 0, idle=0), 0.0, 5, SPEND),  # floor 0: never skips
        (_seen(20, 0, idle=0), 0.1, 1, PROBE),  # probe_every 1: every step probes
    ],
)
def test_decide(state, floor, probe_every, mode):
    assert decide(state, floor, probe_every) == mode


def test_allowance_keeps_repairs_within_their_share_of_the_round():
    assert allowance(SKIP, 600.0, 0.5) == 0.0
    assert allowance(SPEND, 600.0, 0.5) == 600.0
    assert allowance(PROBE, 600.0, 0.25) == pytest.approx(200.0)
    assert allowance(SPEND, 600.0, 1.0) == math.inf
    for share in (0.1, 0.3, 0.5, 0.9):  # spent in full, the repairs are exactly that share
        spent = allowance(SPEND, 600.0, share)
        assert cost_share(spent, 600.0) == pytest.approx(share)
    assert cost_share(0.0, 0.0) == 0.0


def test_repair_cost_is_an_upper_bound_first_then_what_repairs_ran():
    assert repair_cost(SpendingState(), 120, 16) == 136.0  # no repair yet: prompt + max decode
    # 10 repairs ran 600 of their 1000 prompt tokens (shared prefixes) and decoded 150
    seen = SpendingState(attempts=10, prompt_tokens=1000, prefill_tokens=600, decode_tokens=150)
    assert repair_cost(seen, 120, 16) == pytest.approx(120 * 0.6 + 15.0)


def test_affordable_takes_repairs_in_order_while_they_fit():
    assert affordable([10.0, 20.0, 30.0], 29.0) == 1
    assert affordable([10.0, 20.0, 30.0], 30.0) == 2
    assert affordable([10.0, 20.0, 30.0], math.inf) == 3
    assert affordable([10.0], 0.0) == 0
    assert affordable([], 100.0) == 0


def test_observe_decays_what_came_before_and_counts_skips():
    s = SpendingState(attempts=8, successes=2, prompt_tokens=800, prefill_tokens=400,
                      decode_tokens=100, idle=3)  # fmt: skip
    after = observe(s, PROBE, 4, 1, 500, 200, 60)
    assert after == SpendingState(
        attempts=DECAY * 8 + 4,
        successes=DECAY * 2 + 1,
        prompt_tokens=DECAY * 800 + 500,
        prefill_tokens=DECAY * 400 + 200,
        decode_tokens=DECAY * 100 + 60,
        idle=0,
    )
    assert observe(s, SKIP, 0, 0, 0, 0, 0) == SpendingState(**{**s.state_dict(), "idle": 4})
    # a spending step with nothing to repair (every member correct) learns nothing
    assert observe(s, SPEND, 0, 0, 0, 0, 0) == s


def test_state_round_trips_through_a_plain_dict():
    s = SpendingState(attempts=3.5, successes=0.25, prompt_tokens=10, idle=2)
    d = s.state_dict()
    assert all(isinstance(v, (int, float)) for v in d.values())
    assert SpendingState.from_state_dict(d) == s


def _run(success_at, steps: int, floor: float = 0.1, probe_every: int = 5, n: int = 16):
    """Drive the rule over `steps` steps, each with n planned repairs of which
    round(n * success_at(step)) succeed when they run; -> the decisions."""
    state, modes = SpendingState(), []
    for t in range(steps):
        mode = decide(state, floor, probe_every)
        modes.append(mode)
        ran = 0 if mode == SKIP else n
        hits = round(ran * success_at(t))
        state = observe(state, mode, ran, hits, ran * 100, ran * 40, ran * 16)
    return modes


def test_a_policy_that_cannot_repair_stops_paying_except_for_probes():
    modes = _run(lambda t: 0.0, 20)
    assert modes[0] == SPEND  # the first repairs measure the rate
    assert modes[1:] == ([SKIP] * 4 + [PROBE]) * 3 + [SKIP] * 4
    assert sum(m != SKIP for m in modes) == 4  # of 20 steps


def test_a_policy_that_learns_to_repair_gets_its_repairs_back():
    # 0% success for 8 steps, then 50%: back to spending at the first probe after that
    modes = _run(lambda t: 0.0 if t < 8 else 0.5, 20)
    assert modes[:6] == [SPEND, SKIP, SKIP, SKIP, SKIP, PROBE]
    first_probe_after = next(t for t in range(8, 20) if modes[t] == PROBE)
    assert first_probe_after <= 8 + 4  # within probe_every steps of the change
    assert all(m == SPEND for m in modes[first_probe_after + 1 :])


def test_a_policy_that_forgets_how_to_repair_stops_within_a_few_steps():
    modes = _run(lambda t: 0.5 if t < 6 else 0.0, 20)
    assert modes[:7] == [SPEND] * 7  # the step after the change still sees r >= floor
    stopped = next(t for t in range(6, 20) if modes[t] == SKIP)
    assert stopped <= 6 + 4  # each repairing step halves the old evidence
