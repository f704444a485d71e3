"""The exchangeability residual on constructed groups, and dynamic sampling's bounds."""

import random

import pytest
import torch

from ibpo.algo.advantages import group_advantages, token_advantages
from ibpo.algo.cancellation import cancellation_residual, prefix_node_ids
from ibpo.algo.objectives import OBJECTIVES, token_weights

G = 4
# one group: members 0-2 share "5 1", member 3 shares only "5"; lengths differ
TOKENS = torch.tensor([[5, 1, 2, 0], [5, 1, 3, 4], [5, 1, 2, 9], [5, 8, 8, 0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float)


def host(tokens, mask) -> list[list[int]]:
    """Each row's completion ids up to its length, as a rollout keeps them on the host."""
    return [row[: int(n)] for row, n in zip(tokens.tolist(), mask.sum(-1).tolist())]


def test_prefix_nodes_identify_same_token_at_same_context():
    ids, n_nodes = prefix_node_ids(host(TOKENS, MASK), 4, G)
    assert n_nodes == len(set(ids.flatten().tolist()) - {-1})
    assert len(set(ids[:, 0].tolist())) == 1  # everyone emits 5 first
    assert ids[0, 1] == ids[1, 1] == ids[2, 1] != ids[3, 1]
    assert ids[0, 2] == ids[2, 2] != ids[1, 2]  # "5 1 2" shared by 0 and 2 only
    assert ids[0, 3] == -1 and ids[3, 3] == -1  # off the mask
    # the same tokens in another group are other nodes (another prompt = another context)
    two, _ = prefix_node_ids(host(TOKENS, MASK) * 2, 4, G)
    assert set(two[:4].flatten().tolist()) & set(two[4:].flatten().tolist()) <= {-1}


def _residual(name, old_shift, rewards=(1.0, 0.0, 1.0, 0.0), **overrides):
    obj = OBJECTIVES[name]
    kwargs = {**obj.resolve({}), **overrides}
    logp = -torch.rand(G, 4, generator=torch.Generator().manual_seed(0)) - 0.1
    old = logp - torch.tensor(old_shift).view(G, 1)
    seq_adv = group_advantages(torch.tensor([rewards]), obj.scale_rewards).flatten()
    adv = token_advantages(seq_adv, MASK)
    _, coef, info = obj.surrogate(logp, old, adv, MASK, seq_adv, G, **kwargs)
    c = coef * token_weights(MASK, obj.aggregation)
    r = {k: float(v) for k, v in cancellation_residual(c, adv, host(TOKENS, MASK), G).items()}
    return r["residual_num"] / r["residual_den"], r, info


SHIFTS = [0.3, -0.25, 0.1, 0.35]  # unequal sequence ratios, large enough to activate clipping


@pytest.mark.parametrize("name", ["ibpo", "dfpo"])
def test_residual_is_exactly_zero_for_min_replace(name):
    res, r, _ = _residual(name, SHIFTS)
    assert res == 0.0 and r["residual_den"] > 0
    assert r["shared_tokens"] == 4 + 3 + 2 and r["tokens"] == MASK.sum()


def test_residual_positive_for_grpo_with_clipping_and_gspo_with_unequal_ratios():
    res, _, info = _residual("grpo", SHIFTS)
    assert info["clip_fraction"] > 0 and res > 0.05
    res, _, _ = _residual("gspo", SHIFTS)
    assert res > 0.05
    # on-policy with equal lengths gspo would cancel; here lengths differ only for grpo's seq_mean
    res, _, _ = _residual("dapo", [0.0] * G)  # token_mean, ratio 1, no clip: exchangeable
    assert res == pytest.approx(0.0, abs=1e-12)


def test_adv_orthogonal_cancels_the_token_shared_by_the_whole_group():
    obj = OBJECTIVES["dfpo"]
    tokens = torch.tensor([[5, 1], [5, 2], [5, 3], [5, 4]])  # only the first token is shared
    mask = torch.ones(G, 2)
    logp = -torch.rand(G, 2, generator=torch.Generator().manual_seed(1))
    old = logp - torch.tensor(SHIFTS).view(G, 1)
    seq_adv = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), True).flatten()
    adv = token_advantages(seq_adv, mask)
    kw = {**obj.resolve({}), "weights": "adv_orthogonal"}
    _, coef, _ = obj.surrogate(logp, old, adv, mask, seq_adv, G, **kw)
    r = {k: float(v) for k, v in cancellation_residual(coef, adv, host(tokens, mask), G).items()}
    assert r["residual_num"] == pytest.approx(0.0, abs=1e-6 * r["residual_den"])
    assert r["shared_tokens"] == 4


# --- dynamic sampling -------------------------------------------------------------------------


class _Stream:
    def __init__(self):
        self.asked = []

    def take(self, n):
        self.asked.append(n)
        return [object()] * n


class _Tok:
    pad_token_id = 0


def _fake_rounds(monkeypatch, reward_rows):
    """Each round returns the next list of group reward rows (one row per requested prompt)."""
    import ibpo.step as step
    from ibpo.step_parts import Round

    rows = iter(reward_rows)

    def fake_round(model, tok, examples, cfg, repairing, reward_fn, rng, *streams):
        r = torch.tensor(next(rows)[: len(examples)], dtype=torch.float32)
        n, g = r.shape
        mask = torch.ones(n * g, 3)
        from ibpo.generation import Rollout

        ro = Rollout(
            input_ids=torch.ones(n * g, 5, dtype=torch.long),
            attention_mask=torch.ones(n * g, 5, dtype=torch.long),
            completion_mask=mask,
            prompt_len=2,
            texts=["x"] * (n * g),
            truncated=torch.zeros(n * g, dtype=torch.bool),
        )
        return Round(ro, r, r, None, {"generated_tokens": float(n * g * 3)})

    monkeypatch.setattr(step, "score_round", fake_round)


def _cfg(monkeypatch, dynamic, rounds, B=3):
    """A config with dynamic sampling on or off, refilling for at most `rounds` extra rounds."""
    import ibpo.step as step_mod
    from ibpo.recipe import load_config

    monkeypatch.setattr(step_mod, "MAX_RESAMPLE_ROUNDS", rounds)
    return load_config(
        None,
        [
            "rollout.group_size=2",
            f"train.prompts_per_step={B}",
            f"rollout.dynamic_sampling={str(dynamic).lower()}",
        ],
    )


def _collect(cfg):
    from ibpo.recipe import resolve_params
    from ibpo.step import collect_batch

    stream = _Stream()
    b = collect_batch(
        None, _Tok(), stream, cfg, resolve_params(cfg.objective), None, random.Random(0)
    )
    return b, stream


FLAT, LIVE = [1, 1], [1, 0]


def test_dynamic_sampling_refills_until_full(monkeypatch):
    _fake_rounds(monkeypatch, [[FLAT, LIVE, FLAT], [LIVE, FLAT], [LIVE]])
    b, stream = _collect(_cfg(monkeypatch, True, 5))
    assert stream.asked == [3, 2, 1]
    assert b.rewards.shape == (3, 2) and (b.rewards.std(1) > 0).all()
    assert b.stats["dropped_groups"] == 3 and b.stats["resample_rounds"] == 2
    assert b.stats["generated_tokens"] == (6 + 4 + 2) * 3
    assert b.adv.shape == (6, 3) and b.adv.abs().sum() > 0


def test_dynamic_sampling_stops_after_max_rounds(monkeypatch):
    _fake_rounds(monkeypatch, [[FLAT, FLAT, LIVE]] + [[FLAT, FLAT]] * 10)
    b, stream = _collect(_cfg(monkeypatch, True, 2))
    assert stream.asked == [3, 2, 2]  # the first round plus at most 2 more
    assert b.rewards.shape == (1, 2) and b.stats["dropped_groups"] == 6


def test_dynamic_sampling_with_no_signal_trains_the_last_round(monkeypatch):
    _fake_rounds(monkeypatch, [[FLAT, FLAT]] * 3)
    b, _ = _collect(_cfg(monkeypatch, True, 1, B=2))
    assert b.rewards.shape == (2, 2) and (b.adv == 0).all()


def test_without_dynamic_sampling_flat_groups_stay(monkeypatch):
    _fake_rounds(monkeypatch, [[FLAT, LIVE, FLAT]])
    b, stream = _collect(_cfg(monkeypatch, False, 3))
    assert stream.asked == [3] and b.rewards.shape == (3, 2) and b.stats["dropped_groups"] == 0


# --- DAPO's soft overlong punishment ----------------------------------------------------------


def test_overlong_penalty_is_zero_before_the_buffer_then_linear_to_the_maximum():
    from ibpo.algo.advantages import overlong_penalty

    lengths = torch.arange(17)
    p = overlong_penalty(lengths, max_len=16, buffer=0.25, penalty=0.5)  # buffer: tokens 13..16
    assert (p[:13] == 0).all()
    torch.testing.assert_close(p[12:], torch.tensor([0.0, -0.125, -0.25, -0.375, -0.5]))
    assert (overlong_penalty(lengths, 16, 0.0, 0.5) == 0).all()
    assert (overlong_penalty(lengths, 16, 0.25, 0.0) == 0).all()


def _lengths_round(monkeypatch, rewards, lengths, width=16):
    """One round of `collect_batch` whose completions have the given lengths (tokens)."""
    import ibpo.step as step
    from ibpo.generation import Rollout
    from ibpo.step_parts import Round

    def fake_round(model, tok, examples, cfg, repairing, reward_fn, rng, *streams):
        r = torch.tensor(rewards[: len(examples)], dtype=torch.float32)
        n = r.numel()
        mask = (torch.arange(width) < torch.tensor(lengths).view(n, 1)).float()
        ids = torch.ones(n, 5 + width, dtype=torch.long)
        none = torch.zeros(n, dtype=torch.bool)
        ro = Rollout(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            completion_mask=mask,
            prompt_len=5,
            texts=["x"] * n,
            truncated=none,
        )
        return Round(ro, r, r, None, {"generated_tokens": float(mask.sum())})

    monkeypatch.setattr(step, "score_round", fake_round)


@pytest.mark.parametrize("objective", ["dapo", "dfpo"])
def test_dapo_penalises_the_longer_of_two_equally_correct_completions(monkeypatch, objective):
    """An all-correct group (no task signal) whose members are 4 and 16 tokens long, with
    max_new_tokens 16: DAPO's default (20% buffer) gives the short one the positive advantage;
    objectives without the penalty, or dapo with it off, leave the group at zero."""
    import ibpo.step as step_mod
    from ibpo.recipe import load_config

    def collect(extra):
        _lengths_round(monkeypatch, [[1.0, 1.0]], [4, 16])
        cfg = load_config(
            None,
            [
                "rollout.group_size=2",
                "train.prompts_per_step=1",
                "rollout.max_new_tokens=16",
                f"objective.name={objective}",
                *extra,
            ],
        )
        return _collect(cfg)[0]

    b = collect(["rollout.dynamic_sampling=false"])
    if objective == "dapo":
        assert b.seq_adv[0] > 0 > b.seq_adv[1]
        assert b.stats["overlong_penalty"] == pytest.approx(-0.25)  # (0 - 0.5) / 2
        # by default dapo samples dynamically, as DAPO does: the flat group is dropped
        monkeypatch.setattr(step_mod, "MAX_RESAMPLE_ROUNDS", 0)
        b = collect([])
        assert b.stats["dropped_groups"] == 1 and (b.seq_adv == 0).all()
    else:
        assert (b.seq_adv == 0).all() and b.stats["overlong_penalty"] == 0
    assert (collect(["objective.overlong_buffer=0"]).seq_adv == 0).all()
    on = ["objective.overlong_buffer=0.5", "objective.overlong_penalty=1.0"]
    b = collect([*on, "rollout.dynamic_sampling=false"])  # any objective can use it
    assert b.seq_adv[0] > 0 > b.seq_adv[1]
    # dynamic sampling judges task rewards: an all-correct group is flat, and dropped
    monkeypatch.setattr(step_mod, "MAX_RESAMPLE_ROUNDS", 0)
    dynamic = [*on, "rollout.dynamic_sampling=true"]
    b = collect(dynamic)
    assert b.stats["dropped_groups"] == 1 and (b.seq_adv == 0).all()  # nothing had task signal
    _lengths_round(monkeypatch, [[1.0, 1.0], [1.0, 0.0]], [4, 16, 16, 16])
    cfg = load_config(
        None,
        [
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            "rollout.max_new_tokens=16",
            f"objective.name={objective}",
            *dynamic,
        ],
    )
    b = _collect(cfg)[0]
    assert b.stats["dropped_groups"] == 1 and b.rewards.tolist() == [[1.0, 0.0]]
    assert b.seq_adv[0] > 0 > b.seq_adv[1]  # the live group is trained, penalty included


@pytest.mark.parametrize(
    "bad",
    [
        "objective.overlong_buffer=1.0",
        "objective.overlong_buffer=-0.1",
        "objective.overlong_penalty=-1",
    ],
)
def test_overlong_settings_are_checked(bad):
    from ibpo.config import ConfigError
    from ibpo.recipe import load_config

    with pytest.raises(ConfigError, match="overlong"):
        load_config(None, [bad])
