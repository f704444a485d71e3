"""Rollout-vs-trainer mismatch: the per-step measurement, the alarm, and the behaviour-policy
correction (objective.behavior_policy, objective.importance_sampling)."""

import json
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ibpo.algo.advantages import group_advantages, token_advantages
from ibpo.algo.cancellation import cancellation_residual
from ibpo.algo.mismatch import mismatch_stats
from ibpo.algo.objectives import OBJECTIVES, importance_ratio, importance_weights, token_weights
from ibpo.config import ConfigError
from ibpo.recipe import load_config
from ibpo.rewards import GRADERS
from ibpo.run.alarm import MismatchAlarm
from ibpo.run.failures import exit_code

# the runs train the tiny model in this process: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

G = 4
TOKENS = torch.tensor([[5, 1, 2, 0], [5, 1, 3, 4], [5, 1, 2, 9], [5, 8, 8, 0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float)


def _host(tokens, mask):
    return [row[: int(n)] for row, n in zip(tokens.tolist(), mask.sum(-1).tolist())]


def _group(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(G, 4, generator=g) - 0.1
    old = logp - torch.tensor([0.3, -0.25, 0.1, 0.35]).view(G, 1)
    # behaviour log-probs that differ from the trainer's by a different amount at every token,
    # shared tokens included (the sampler's numerics are not the trainer's)
    behav = old + 0.4 * torch.randn(G, 4, generator=g)
    return logp, old, behav


def test_mismatch_stats_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, -9.0], [-0.5, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    s = {k: float(v) for k, v in mismatch_stats(trainer, rollout, mask).items()}
    d = [0.0, -1.0, 0.0, 1.5]  # the masked tokens only (the -6 is padding)
    k3 = [math.exp(x) - x - 1 for x in d]
    assert s["mismatch_kl"] == pytest.approx(sum(k3) / 4)
    assert s["mismatch_abs_mean"] == pytest.approx(2.5 / 4)
    assert s["mismatch_abs_max"] == pytest.approx(1.5)
    assert s["mismatch_share"] == pytest.approx(2 / 4)  # |d| > ln 2
    assert s["mismatch_worst_sequence"] == pytest.approx(0.75)
    zero = mismatch_stats(trainer, trainer, mask)
    assert all(float(v) == 0.0 for v in zero.values())


def test_importance_weights_truncate_and_mask():
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    behav = torch.tensor([[-2.0, 0.5], [0.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rho = importance_ratio(old, behav, mask, "token")
    torch.testing.assert_close(rho, torch.tensor([[math.e**2, math.exp(-0.5)], [1.0, 1.0]]))
    assert importance_weights(rho, "truncate", 2.0)[0, 0] == 2.0
    assert importance_weights(rho, "mask", 2.0)[0, 0] == 0.0
    assert importance_weights(rho, "mask", 2.0)[0, 1] == pytest.approx(math.exp(-0.5))
    seq = importance_ratio(old, behav, mask, "sequence")  # geometric mean over the masked tokens
    torch.testing.assert_close(seq, torch.tensor([math.exp(0.75), 1.0]))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_correction_with_equal_log_probs_is_the_uncorrected_objective_exactly(name):
    obj = OBJECTIVES[name]
    logp, old, _ = _group()
    logp.requires_grad_(True)
    seq_adv = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), obj.scale_rewards).flatten()
    adv = token_advantages(seq_adv, MASK)
    base_loss, base_coef, _ = obj.surrogate(logp, old, adv, MASK, seq_adv, G, **obj.resolve({}))
    (base_grad,) = torch.autograd.grad(base_loss.sum(), logp)
    behav = old.clone()  # the rollout's log-probs equal the trainer's
    for mode in ("truncate", "mask"):
        rho = importance_weights(importance_ratio(old, behav, MASK, obj.level), mode, 2.0)
        assert (rho == 1).all()
        loss, coef, _ = obj.surrogate(logp, old, adv, MASK, seq_adv, G, rho=rho, **obj.resolve({}))
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.equal(loss, base_loss) and torch.equal(coef, base_coef)
        assert torch.equal(grad, base_grad)
    # behavior_policy=rollout: old_logp is the rollout's, here the same numbers
    loss, coef, _ = obj.surrogate(logp, behav, adv, MASK, seq_adv, G, **obj.resolve({}))
    assert torch.equal(loss, base_loss) and torch.equal(coef, base_coef)


def _residual(name, old_for_ratio, rho=None, **overrides):
    obj = OBJECTIVES[name]
    logp, _, _ = _group()
    seq_adv = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), obj.scale_rewards).flatten()
    adv = token_advantages(seq_adv, MASK)
    kw = {**obj.resolve({}), **overrides}
    _, coef, _ = obj.surrogate(logp, old_for_ratio, adv, MASK, seq_adv, G, rho=rho, **kw)
    c = coef * token_weights(MASK, obj.aggregation)
    r = {k: float(v) for k, v in cancellation_residual(c, adv, _host(TOKENS, MASK), G).items()}
    return r["residual_num"] / max(r["residual_den"], 1e-300), r


@pytest.mark.parametrize("name", ["ibpo", "dfpo"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "rollout"])
def test_exchangeable_objectives_cancel_exactly_under_the_correction(name, mode):
    _, old, behav = _group()
    if mode == "rollout":  # behaviour = the rollout's log-probs in the ratios
        res, r = _residual(name, behav)
    else:
        rho = importance_weights(importance_ratio(old, behav, MASK, "sequence"), mode, 1.3)
        if mode == "mask":  # one member over the cap drops its group (Min-Replace: w~ = 0)
            assert rho.min() == 0
            _, r = _residual(name, old, rho)
            assert r["residual_den"] == 0 and r["residual_num"] == 0
            rho = importance_weights(importance_ratio(old, behav, MASK, "sequence"), mode, 9.0)
        assert len(set(rho.tolist())) == G  # a different weight for every member
        res, r = _residual(name, old, rho)
    assert res == 0.0 and r["residual_den"] > 0 and r["shared_tokens"] == 9


def test_adv_orthogonal_stays_orthogonal_under_the_correction():
    _, old, behav = _group()
    obj = OBJECTIVES["dfpo"]
    logp, _, _ = _group()
    seq_adv = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), True).flatten()
    adv = token_advantages(seq_adv, MASK)
    rho = importance_weights(importance_ratio(old, behav, MASK, "sequence"), "truncate", 2.0)
    kw = {**obj.resolve({}), "weights": "adv_orthogonal"}
    _, coef, _ = obj.surrogate(logp, old, adv, MASK, seq_adv, G, rho=rho, **kw)
    assert float((coef[:, 0] * seq_adv).sum()) == pytest.approx(0.0, abs=1e-6)


def test_token_level_correction_breaks_cancellation_for_the_clipped_objectives():
    """Per-token weights (GRPO's TIS) differ between members at a shared token: the residual
    the exchangeable objectives avoid by weighting inside the group transform."""
    _, old, behav = _group()
    rho = importance_weights(importance_ratio(old, behav, MASK, "token"), "truncate", 2.0)
    res, _ = _residual("dapo", old, rho)
    assert res > 0.05


def test_config_refuses_both_corrections_at_once():
    with pytest.raises(ConfigError, match="choose one"):
        both = ["objective.behavior_policy=rollout", "objective.importance_sampling=mask"]
        load_config(None, both)
    with pytest.raises(ConfigError, match="importance_sampling"):
        load_config(None, ["objective.importance_sampling=clip"])


def _metrics(kl):
    return {
        "mismatch_kl": kl,
        "mismatch_abs_mean": kl,
        "mismatch_abs_max": 3 * kl,
        "mismatch_share": 0.1,
    }


def test_alarm_warns_once_then_on_doubling_and_stops_above_its_threshold(capsys):
    alarm = MismatchAlarm(warn_kl=0.02, stop_kl=None, backend="rollout.backend=hf (test)")
    assert alarm.check({}, 1) is None  # no behaviour log-probs: nothing to say
    assert alarm.check(_metrics(0.01), 1) is None
    assert capsys.readouterr().err == ""
    for step, kl in enumerate([0.03, 0.04, 0.05, 0.07, 0.2], start=2):
        assert alarm.check(_metrics(kl), step) is None
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 3  # 0.03, then 0.07 (>= 2 x 0.03), then 0.2
    assert "step 2" in warned[0] and "adapter" in warned[0] and "rollout.backend=hf" in warned[0]
    stopper = MismatchAlarm(warn_kl=0.0, stop_kl=0.1, backend="b")
    assert stopper.check(_metrics(0.05), 1) is None
    message = stopper.check(_metrics(0.5), 2)
    assert "stopped at step 2" in message and "rollout.mismatch_stop_kl" in message
    assert capsys.readouterr().err == ""  # warn_kl=0: no warnings
    assert exit_code("mismatch") == 5


# --- the trainer ------------------------------------------------------------------------------


@pytest.fixture
def parity_reward():
    """A reward with signal on the tiny random model, so that the adapter moves."""
    GRADERS["parity"] = lambda text, answer: float(len(text) % 2)
    yield "parity"
    del GRADERS["parity"]


def _run(tiny_model_dir, tmp_path, *overrides):
    from ibpo.trainer import run_recipe

    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "model.quantization=none",
            "reward.functions=parity",
            "train.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "train.learning_rate=0.05",
            "data.eval_size=0",
            f"run.output_dir={out}",
            "train.steps=4",
            *overrides,
        ],
    )
    summary = run_recipe(cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if "mismatch_kl" in r]


def test_rollouts_from_the_trained_policy_show_no_mismatch(
    tiny_model_dir, tmp_path, parity_reward, capsys
):
    summary, rows = _run(tiny_model_dir, tmp_path)
    assert summary["status"] == "completed" and len(rows) == 4
    assert max(r["mismatch_kl"] for r in rows) < 1e-8
    assert max(r["mismatch_abs_max"] for r in rows) < 1e-4
    assert "mismatch" not in capsys.readouterr().err


def test_a_generation_path_that_drops_the_adapter_is_caught(
    tiny_model_dir, tmp_path, parity_reward, monkeypatch, capsys
):
    import ibpo.step as step
    from ibpo.modeling import reference_mode

    real = step.generating

    @contextmanager
    def without_adapter(model, cfg, device, engine=None, tools=None):
        with real(model, cfg, device, engine, tools) as generate, reference_mode(model):
            yield generate

    monkeypatch.setattr(step, "generating", without_adapter)
    summary, rows = _run(tiny_model_dir, tmp_path)
    # step 1: LoRA B = 0, the base is the policy; the first update moves the adapter, and the
    # next steps' rollouts (from the bare base) no longer match the trained policy
    assert rows[0]["mismatch_kl"] < 1e-8
    assert min(r["mismatch_kl"] for r in rows[1:]) > 0.005  # the default warning threshold
    err = capsys.readouterr().err
    assert "ibpo: warning: step 2: rollout-vs-trainer mismatch" in err
    assert summary["status"] == "completed"  # warned, not stopped (no stop threshold)
    # with a stop threshold the run saves and ends at the first step over it
    summary, rows = _run(tiny_model_dir, tmp_path / "stop", "rollout.mismatch_stop_kl=0.01")
    assert summary["status"] == "mismatch" and summary["exit_code"] == 5
    assert summary["steps"] == len(rows) == 2
    assert "do not come from the policy being trained" in summary["message"]
    assert Path(summary["checkpoint"]).name == "step-2"  # saved before stopping


def test_the_truncated_importance_sampling_run_reports_its_weights(
    tiny_model_dir, tmp_path, parity_reward
):
    summary, rows = _run(tiny_model_dir, tmp_path, "objective.importance_sampling=truncate")
    assert summary["status"] == "completed"
    # rollouts from the trained policy: rho = 1 up to float rounding, nothing capped
    assert all(abs(r["is_weight_mean"] - 1) < 1e-4 and r["is_capped_fraction"] == 0 for r in rows)
