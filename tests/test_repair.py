"""IBPO Part 2: repair planning, phi, reward shaping, token edit masks (IBPO.md properties)."""

import math
import random
import re

import pytest
import torch

from ibpo.algo.advantages import (
    group_advantages,
    lifted_blame_fraction,
    shape_rewards,
    token_advantages,
)
from ibpo.algo.counterfactual import (
    edit_masks,
    edited_tokens,
    fill_template,
    phi_from_repairs,
    plan_repairs,
)
from ibpo.config import DataConfig, RepairConfig
from ibpo.data import Example
from ibpo.generation import Rollout
from ibpo.repair import RepairGeneration, run_repairs
from ibpo.repair_budget import RepairBudget
from tests.conftest import grader_rewards

# --- shaping ----------------------------------------------------------------------------------


def test_shaping_touches_only_incorrect_members_and_phi_is_bounded_by_rho():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    correct = rewards >= 1
    jobs = plan_repairs(
        rewards, references=2, max_per_group=4, selection="correct_first", rng=random.Random(0)
    )
    success = [k % 2 == 0 for k in range(len(jobs))]
    phi = phi_from_repairs(jobs, success, (2, 4), rho=0.5)
    assert ((phi >= 0) & (phi <= 0.5)).all() and phi.max() > 0
    assert (phi[correct] == 0).all()  # correct members are never repaired
    shaped = shape_rewards(rewards, phi, 0.6, correct)
    assert torch.equal(shaped[correct], rewards[correct])
    torch.testing.assert_close(shaped[~correct], rewards[~correct] + 0.6 * phi[~correct])


def test_all_equal_groups_give_zero_advantage():
    ones, zeros = torch.ones(3, 8), torch.zeros(3, 8)
    for scale in (True, False):
        assert (group_advantages(ones, scale) == 0).all()
        assert (group_advantages(zeros, scale) == 0).all()
    # an all-correct group plans no repair at all, so shaping keeps it flat
    assert plan_repairs(ones, 1, 4, "correct_first", random.Random(0)) == []
    # all-wrong with no successful repair: phi = 0, still flat
    jobs = plan_repairs(zeros, 1, 8, "correct_first", random.Random(0))
    phi = phi_from_repairs(jobs, [False] * len(jobs), (3, 8), 0.5)
    assert (group_advantages(shape_rewards(zeros, phi, 0.6, zeros.bool()), True) == 0).all()


@pytest.mark.parametrize("G", [7, 8, 16])
@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1 / 3])
def test_flat_groups_of_partial_credit_give_exactly_zero_advantage(G, value):
    """Equal rewards that are not exact in binary (partial credit, e.g. a fraction of code tests):
    float32 rounding leaves the mean off in its last bits, which std scaling would blow up into
    one equal, non-zero advantage for every member."""
    rewards = torch.tensor([[value] * G, [0.0] * (G - 1) + [1.0]])
    for scale in (True, False):
        adv = group_advantages(rewards, scale)
        assert (adv[0] == 0).all()
        assert adv[1].abs().max() > 0.1  # a group with signal keeps it


def test_partly_correct_members_are_neither_repaired_nor_preferred_references():
    """IBPO.md: phi needs R_i = 0. A bonus on a 0.9 member could lift it above the correct one
    (R' = 0.9 + 0.6 * 0.5 = 1.2 > 1), so only the failed members are repaired."""
    rewards = torch.tensor([[1.0, 0.9, 0.0, 0.0]])
    jobs = plan_repairs(rewards, 1, 4, "correct_only", random.Random(0))
    assert sorted(j.member for j in jobs) == [2, 3]
    assert all(j.reference == 0 for j in jobs)  # the fully correct member, not the 0.9 one
    phi = phi_from_repairs(jobs, [True] * len(jobs), (1, 4), 0.5)
    shaped = shape_rewards(rewards, phi, 0.6, rewards >= 1)
    assert shaped[0, 0] == shaped.max() and shaped[0, 1] == rewards[0, 1]


def test_plan_prefers_correct_siblings_respects_cap_and_never_self():
    correct = torch.tensor([[True, False, False, False, True, False]])
    jobs = plan_repairs(
        correct.float(),
        references=2,
        max_per_group=3,
        selection="correct_first",
        rng=random.Random(1),
    )
    members = {j.member for j in jobs}
    assert len(members) == 3 and members <= {1, 2, 3, 5}  # cap, incorrect only
    assert len(jobs) == 3 * 2
    for j in jobs:
        assert j.reference != j.member and correct[0, j.reference]  # two correct siblings exist
    one_correct = torch.tensor([[True, False, False]])
    jobs = plan_repairs(one_correct.float(), 2, 4, "correct_first", random.Random(0))
    for m in (1, 2):  # the correct sibling first, then the other incorrect one
        assert [j.reference for j in jobs if j.member == m][0] == 0
    none_correct = torch.zeros(1, 4)
    assert plan_repairs(none_correct, 1, 4, "correct_only", random.Random(0)) == []
    assert len(plan_repairs(none_correct, 1, 4, "correct_first", random.Random(0))) == 4


@pytest.mark.parametrize("seed", range(5))
def test_correct_only_runs_exactly_the_repairs_of_correct_first_that_show_a_correct_sibling(seed):
    """The default selection leaves out only the repairs that would show a failed sibling: the
    same failed members, references and order otherwise, from the same rng."""
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(6, 8, generator=gen) < 0.3).float()
    rewards[seed] = 0.0  # a group with no correct member
    first = plan_repairs(rewards, 1, 4, "correct_first", random.Random(seed))
    only = plan_repairs(rewards, 1, 4, "correct_only", random.Random(seed))
    assert only == [j for j in first if rewards[j.group, j.reference] >= 1]
    assert not any(j.group == seed for j in only) and any(j.group == seed for j in first)


# --- token edit masks -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "attempt, repair, expected",
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], [False, False, False, False]),  # unchanged
        ([1, 2, 3, 4], [1, 9, 3, 4], [False, True, False, False]),  # substitution
        ([1, 2, 3, 4], [1, 3, 4], [False, True, False, False]),  # deletion
        ([1, 2, 3, 4], [1, 2, 7, 3, 4], [False, False, True, False]),  # insertion before 3
        ([1, 2, 3], [1, 2, 3, 5], [False, False, True]),  # insertion at the end
        ([5, 6, 7], [], [True, True, True]),  # everything deleted
        ([], [1], []),
        ([10, 11, 12, 13, 14], [10, 20, 12, 13], [False, True, False, False, True]),
    ],
)
def test_edited_tokens_alignment(attempt, repair, expected):
    assert edited_tokens(attempt, repair) == expected


def test_edit_mask_never_increases_blame_nor_flips_sign():
    torch.manual_seed(0)
    seq_adv = torch.randn(16)
    mask = (torch.rand(16, 7) > 0.2).float()
    edited = torch.rand(16, 7) > 0.5
    plain = token_advantages(seq_adv, mask)
    for w in (0.0, 0.3, 1.0):
        masked = token_advantages(seq_adv, mask, edited, unchanged_weight=w)
        assert (masked.abs() <= plain.abs()).all()
        assert (masked * plain >= 0).all()  # same sign (or zero)
        pos = seq_adv >= 0
        assert torch.equal(masked[pos], plain[pos])  # non-negative advantages untouched
    assert torch.equal(token_advantages(seq_adv, mask, edited, 1.0), plain)
    with pytest.raises(ValueError):
        token_advantages(seq_adv, mask, edited, 1.5)


def test_lifted_blame_counts_exactly_the_tokens_the_mask_scales():
    seq_adv = torch.tensor([-1.0, -0.5, 0.7, 0.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).float()
    edited = torch.tensor(
        [
            [False, True, False, False],  # negative: 2 kept tokens inside the mask (col 3 is pad)
            [True, True, True, True],  # negative, every token edited: nothing lifted
            [False, False, False, False],  # positive advantage: never lifted
            [False, True, True, True],  # zero advantage: never lifted
        ]
    )
    frac = lifted_blame_fraction(seq_adv, mask, edited)
    assert frac.item() == pytest.approx(2 / 10)
    # the same tokens are the ones token_advantages changes when unchanged_weight < 1
    changed = token_advantages(seq_adv, mask, edited, 0.0) != token_advantages(seq_adv, mask)
    assert changed.sum().item() == 2
    # all blame kept: nothing lifted, and an empty step divides by nothing
    assert lifted_blame_fraction(seq_adv, mask, torch.ones_like(edited)).item() == 0.0
    assert lifted_blame_fraction(seq_adv, torch.zeros_like(mask), edited).item() == 0.0


def test_edit_masks_take_the_most_local_successful_repair():
    from ibpo.algo.counterfactual import RepairJob

    attempts = [[1, 2], [3, 4, 5, 6], [7, 8, 9]]
    jobs = [RepairJob(0, 1, 0), RepairJob(0, 1, 2), RepairJob(0, 2, 0)]
    repairs = [[3, 0, 0, 6], [3, 4, 0, 6], [7, 8, 9]]
    edited, frac = edit_masks(attempts, 5, jobs, repairs, [True, True, False], group_size=3)
    assert edited[0].all()  # never repaired: full blame
    assert edited[1].tolist() == [False, False, True, False, True]  # second repair: 1 edit
    assert edited[2].all()  # its repair failed: full blame
    assert frac == pytest.approx(1 / 4)


def test_template_keeps_latex_braces():
    t = "Q: {question}\nA: {attempt}\nR: {reference}\n\\boxed{x}"
    out = fill_template(t, "What is {a}?", " \\frac{1}{2} ", "0.5")
    assert out == "Q: What is {a}?\nA: \\frac{1}{2}\nR: 0.5\n\\boxed{x}"


# --- run_repairs end to end with a scripted generator ---------------------------------------


def _rollout(rows: list[list[int]], texts: list[str], prompt_len: int = 2) -> Rollout:
    T = max(len(r) for r in rows)
    comp = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for n, r in enumerate(rows):
        comp[n, : len(r)] = torch.tensor(r)
        mask[n, : len(r)] = 1
    ids = torch.cat([torch.ones(len(rows), prompt_len, dtype=torch.long), comp], 1)
    att = torch.cat([torch.ones(len(rows), prompt_len), mask], 1).long()
    return Rollout(
        input_ids=ids,
        attention_mask=att,
        completion_mask=mask,
        prompt_len=prompt_len,
        texts=texts,
        truncated=torch.zeros(len(rows), dtype=torch.bool),
    )


class _Tok:
    chat_template = None


def test_run_repairs_batches_grades_and_masks():
    # group of 4: members 0 and 2 correct ("7"), members 1 and 3 wrong
    rollout = _rollout([[7], [3, 9], [7], [5, 5, 5]], ["7", "39", "7", "555"])
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    calls = []

    def fake_generate(tok, prompts, n, max_new, bs, **kw):
        calls.append(prompts)
        # member 1's repair keeps its first token and fixes the second; member 3's fails
        rows, texts = [], []
        for p in prompts:
            if "39" in p:
                rows.append([3, 7]), texts.append("37")
            else:
                rows.append([5, 5, 6]), texts.append("556")
        return _rollout(rows, texts)

    rep = RepairConfig(references=1)
    gen = RepairGeneration(fake_generate, _Tok(), DataConfig(), 4, 8, 1.0, 1.0)
    out = run_repairs(
        gen,
        [Example("3 + 4", "37")],
        rollout,
        rewards,
        grader_rewards(_reward),
        rep,
        random.Random(0),
    )
    assert len(calls) == 1 and len(calls[0]) == 2  # one batched call, one repair per wrong member
    assert all("3 + 4" in p and "7" in p for p in calls[0])  # question and a correct reference
    assert out.phi.tolist() == [[0.0, 0.5, 0.0, 0.0]]
    assert out.edited[1].tolist() == [False, True, True]  # token 3 kept; 9 edited; pad column
    assert out.edited[3].all() and out.edited[0].all()
    assert out.stats["repairs"] == 2 and out.stats["repair_success_rate"] == 0.5
    assert out.stats["repair_rate"] == 1.0 and out.stats["repair_tokens"] == 5
    # the phase's work: 2 prompts of 2 real tokens prefilled, 2 + 3 tokens decoded
    assert out.stats["repair_prefill_tokens"] == 4 and out.stats["repair_decode_tokens"] == 5
    assert out.stats["repair_prompt_tokens"] == 4  # a backend that reports no sharing


def _reward(text: str, answer: str) -> float:
    return float(text.strip() == answer)


@pytest.mark.parametrize(
    "override, message",
    [
        ("repair.rho=1.5", "repair.rho"),
        ("repair.unchanged_weight=-0.1", "repair.unchanged_weight"),
        ("repair.references=0", "repair.references"),
        ("repair.reference_selection=best", "correct_first"),
        ("repair.template=fix {attempt}", "{question}"),
        ("repair.temperature=0", "repairs use rollout.temperature: set that"),
    ],
)
def test_repair_config_errors_name_the_key(override, message):
    from ibpo.config import ConfigError
    from ibpo.recipe import load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_repairs_default_on_for_ibpo_only():
    from ibpo.recipe import load_config, resolve_params
    from ibpo.step import repairs_enabled

    for name, expected in [("ibpo", True), ("dfpo", False), ("grpo", False)]:
        cfg = load_config(None, [f"objective.name={name}"])
        assert repairs_enabled(cfg, resolve_params(cfg.objective)) is expected
    cfg = load_config(None, ["objective.name=ibpo", "repair.enabled=false"])
    assert repairs_enabled(cfg, resolve_params(cfg.objective)) is False


class _CharTok(_Tok):
    """Tokens = characters: prompts' token counts for the spending rule's cost estimates."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t) for t in texts]}


def _budgeted(budget: float, seed: int):
    # two groups of 4, one correct member each: 6 planned repairs (3 per group)
    rollout = _rollout([[7], [3], [5], [6], [1], [2], [8], [9]], list("73561289"))
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    calls = []

    def fake_generate(tok, prompts, n, max_new, bs, **kw):
        calls.append(list(prompts))
        return _rollout([[7]] * len(prompts), ["7"] * len(prompts))

    data = DataConfig(prompt_template="{question}")
    gen = RepairGeneration(fake_generate, _CharTok(), data, 4, 8, 1.0, 1.0)
    out = run_repairs(
        gen,
        [Example("3 + 4", "7"), Example("1 + 7", "8")],
        rollout,
        rewards,
        grader_rewards(_reward),
        RepairConfig(template="{question}|{attempt}|{reference}"),
        random.Random(seed),
        RepairBudget(budget),
    )
    return out, calls


def test_a_token_budget_runs_a_random_subset_that_fits_and_skips_the_rest():
    everything, calls = _budgeted(math.inf, 0)
    assert everything.stats["repairs"] == 6 and everything.stats["repairs_skipped"] == 0
    planned = calls[0]
    cost = {p: len(p) + 4 for p in planned}  # no repair ran yet: prompt + max_new_tokens
    kept = set()
    for seed in range(8):
        out, calls = _budgeted(2.5 * max(cost.values()), seed)
        ran = calls[0]
        assert len(ran) == 2 and set(ran) <= set(cost)  # two fit, a third does not
        assert out.stats["repairs"] == 2 and out.stats["repairs_skipped"] == 4
        assert ran == [p for p in planned if p in ran]  # in plan order (sharing neighbours)
        assert len(out.jobs) == len(out.success) == 2
        hit = {(j.group, j.member) for j, ok in zip(out.jobs, out.success) if ok}
        assert {(b, i) for b in range(2) for i in range(4) if out.phi[b, i] > 0} == hit
        kept.add(tuple(ran))
    assert len(kept) > 1  # which repairs run is random, not the first ones planned
    none, calls = _budgeted(0.0, 0)  # a skipped step: no generation, Part 1 alone
    assert calls == [] and none.stats["repairs"] == 0 and none.stats["repairs_skipped"] == 6
    assert (none.phi == 0).all() and none.edited.all()


def test_repairs_that_show_the_same_reference_are_neighbours():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    for seed in range(5):
        jobs = plan_repairs(rewards, 1, 4, "correct_first", random.Random(seed))
        refs = [j.reference for j in jobs]
        assert refs == sorted(refs) and len(jobs) == 4
