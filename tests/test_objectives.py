"""Properties of the surrogates (IBPO.md, 'Properties the tests must pin down'), by autograd."""

import pytest
import torch

from ibpo.algo.advantages import group_advantages, token_advantages
from ibpo.algo.objectives import (
    OBJECTIVES,
    adv_orthogonal,
    aggregate,
    clipped_token,
    exchangeable,
    gspo_sequence,
    k3_kl,
    min_replace,
    step_normaliser,
)
from ibpo.config import ConfigError, ObjectiveConfig
from ibpo.recipe import resolve_params

G = 4


def seq_lengths(mask) -> list[int]:
    """Completion lengths of a mask's rows: what step_normaliser takes."""
    return [int(n) for n in mask.sum(-1).tolist()]


def shared_token_case(old_shift, lengths=(3, 3, 3, 3), rewards=(1.0, 0.0, 1.0, 0.0)):
    """A group of G sequences; token 0 of every member is the same token at the same context
    (the prompt), so all members share one log-prob parameter `theta_shared`. Other tokens have
    their own parameters. old_logp differs per member via `old_shift` to make ratios != 1."""
    T = max(lengths)
    theta_shared = torch.tensor(-1.0, requires_grad=True)
    own = torch.full((G, T - 1), -0.5, requires_grad=True)
    logp = torch.cat([theta_shared.expand(G, 1), own], 1)
    mask = torch.zeros(G, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    old = logp.detach() - torch.tensor(old_shift).view(G, 1) * mask
    seq_adv = group_advantages(torch.tensor([rewards]), scale=True).flatten()
    adv = token_advantages(seq_adv, mask)
    return theta_shared, logp, old, adv, mask, seq_adv


def shared_grad(surrogate, aggregation, kwargs, **case):
    theta, logp, old, adv, mask, seq_adv = shared_token_case(**case)
    per_tok, _, _ = surrogate(logp, old, adv, mask, seq_adv, G, **kwargs)
    loss = aggregate(per_tok, mask, aggregation, step_normaliser(aggregation, seq_lengths(mask), 3))
    loss.backward()
    return theta.grad.item()


SHIFTS = [0.3, -0.1, 0.05, 0.2]  # per-member log-ratio offsets: unequal sequence ratios


@pytest.mark.parametrize("weights", ["min_replace", "adv_orthogonal"])
@pytest.mark.parametrize("lengths", [(3, 3, 3, 3), (1, 3, 2, 3)])
def test_token_shared_by_all_members_cancels_exactly(weights, lengths):
    kw = {"weights": weights, "gate": "none", "eps_low": 0.2, "eps_high": 0.28}
    g = shared_grad(exchangeable, "token_mean", kw, old_shift=SHIFTS, lengths=lengths)
    assert g == pytest.approx(0.0, abs=1e-7)


def test_grpo_asymmetric_clip_breaks_cancellation():
    # ratios 1.35, 0.9, 1.05, 1.22: member 0 (A > 0) is clipped above 1.2, member 1 (A < 0) is not
    kw = {"eps_low": 0.2, "eps_high": 0.2}
    g = shared_grad(clipped_token, "token_mean", kw, old_shift=SHIFTS)
    assert abs(g) > 1e-3


def test_gspo_unequal_ratios_break_cancellation():
    kw = {"eps_low": 1.0, "eps_high": 1.0}  # wide band: the sequence weighting alone breaks it
    g = shared_grad(gspo_sequence, "seq_mean", kw, old_shift=SHIFTS)
    assert abs(g) > 1e-3
    # ... and GSPO on-policy with equal lengths does cancel (its problem is the weights)
    g0 = shared_grad(gspo_sequence, "seq_mean", kw, old_shift=[0.0] * 4)
    assert g0 == pytest.approx(0.0, abs=1e-7)


def test_grpo_seq_mean_breaks_cancellation_with_unequal_lengths_on_policy():
    kw = {"eps_low": 0.2, "eps_high": 0.2}
    g = shared_grad(clipped_token, "seq_mean", kw, old_shift=[0.0] * 4, lengths=(1, 3, 2, 3))
    assert abs(g) > 1e-3


def test_subset_shared_token_gets_exactly_subset_advantage_under_min_replace():
    # members 0 and 1 share a token (one parameter); coefficient must be w~ * (A_0 + A_1)
    T = 2
    theta = torch.tensor(-1.0, requires_grad=True)
    own = torch.full((G, T), -0.7, requires_grad=True)
    shared_col = torch.stack([theta, theta, own[2, 0], own[3, 0]])
    logp = torch.stack([shared_col, own[:, 1]], 1)
    mask = torch.ones(G, T)
    shifts = torch.tensor([0.2, -0.3, 0.1, 0.4]).view(G, 1)
    old = logp.detach() - shifts
    seq_adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), scale=True).flatten()
    adv = token_advantages(seq_adv, mask)
    per_tok, _, info = exchangeable(logp, old, adv, mask, seq_adv, G, weights="min_replace")
    (per_tok * mask).sum().backward()
    w_min = torch.exp(shifts.flatten()).min()  # w_i = exp(mean_t(logp - old)) = exp(shift_i)
    expected = -(w_min * (seq_adv[0] + seq_adv[1])).item()
    assert theta.grad.item() == pytest.approx(expected, rel=1e-5)
    assert info["weight_mean"].item() == pytest.approx(w_min.item(), rel=1e-5)


def test_on_policy_exchangeable_equals_reinforce_with_group_baseline():
    torch.manual_seed(0)
    logp = torch.randn(8, 5, requires_grad=True)
    mask = (torch.rand(8, 5) > 0.2).float()
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    seq_adv = group_advantages(rewards, scale=False).flatten()
    adv = token_advantages(seq_adv, mask)
    for weights in ("min_replace", "adv_orthogonal"):
        per_tok, _, _ = exchangeable(logp, logp.detach(), adv, mask, seq_adv, G, weights=weights)
        (g,) = torch.autograd.grad((per_tok * mask).sum(), logp)
        reinforce = -(seq_adv.view(-1, 1) * mask)  # d/dlogp of -sum A (R - mean) logp
        if weights == "min_replace":
            torch.testing.assert_close(g, reinforce)
        else:  # w = 1 projected: w~ = 1 - (A.1/|A|^2) A = 1 because sum A = 0
            torch.testing.assert_close(g, reinforce, atol=1e-6, rtol=1e-6)


def test_weight_transforms():
    w = torch.tensor([[1.1, 0.9, 1.3, 0.95], [1.0, 1.0, 1.2, 0.7]])
    a = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]), True)
    wo = adv_orthogonal(w, a)
    torch.testing.assert_close((a * wo).sum(1), torch.zeros(2), atol=1e-6, rtol=0)
    wm = min_replace(w, a)
    assert torch.equal(wm, torch.tensor([[0.9] * 4, [0.7] * 4]))
    # an all-zero advantage group is left alone by the projection
    assert torch.equal(adv_orthogonal(w, torch.zeros_like(w)), w)


@pytest.mark.parametrize("rewards", [(1.0, 0.0, 1.0, 0.0), (0.0, 1.0, 0.0, 1.0)])
def test_group_gate_drops_whole_group_whatever_the_sign(rewards):
    """IBPO.md: the group is dropped when its group-constant weight (Min-Replace: the minimum
    ratio) leaves [1 - eps_low, 1 + eps_high], whatever the sign of the out-of-band member's
    advantage; Adv-Orthogonal has no group-constant weight, so any member's ratio decides."""

    def gated(weights, shift):
        _, logp, old, adv, mask, seq_adv = shared_token_case(old_shift=shift, rewards=rewards)
        per_tok, _, info = exchangeable(
            logp,
            old,
            adv,
            mask,
            seq_adv,
            G,
            weights=weights,
            gate="group",
            eps_low=0.2,
            eps_high=0.28,
        )
        assert info["gate_fraction"] in (0.0, 1.0)  # all or nothing
        assert (torch.count_nonzero(per_tok.detach()) == 0) == (info["gate_fraction"] == 1.0)
        return info["gate_fraction"] == 1.0

    low, high = [0.0, 0.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.5]  # one member's ratio 0.61 or 1.65
    assert gated("min_replace", low)  # w~ = 0.61 < 0.8
    assert not gated("min_replace", high)  # w~ = min = 1: the weight applied is inside
    assert gated("adv_orthogonal", low) and gated("adv_orthogonal", high)
    assert not gated("min_replace", [0.0, 0.1, -0.1, 0.2])
    assert not gated("adv_orthogonal", [0.0, 0.1, -0.1, 0.2])


def test_clip_fraction_reported_and_k3_nonnegative():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    old = torch.log(torch.tensor([[0.3, 0.2]]))
    adv = torch.ones(1, 2)
    _, _, info = clipped_token(logp, old, adv, torch.ones(1, 2), torch.ones(1), 1)
    assert info["clip_fraction"] == 0.5
    x = torch.randn(100)
    assert (k3_kl(x, x + torch.randn(100)) >= 0).all()
    assert torch.equal(k3_kl(x, x), torch.zeros(100))


def test_normaliser_makes_loss_invariant_to_micro_batching():
    torch.manual_seed(1)
    logp = torch.randn(8, 6, requires_grad=True)
    mask = (torch.rand(8, 6) > 0.3).float()
    seq_adv = group_advantages(torch.randint(0, 2, (2, 4)).float(), True).flatten()
    adv = token_advantages(seq_adv, mask)
    for name, obj in OBJECTIVES.items():
        agg = obj.aggregation
        full, _, _ = obj.surrogate(logp, logp.detach(), adv, mask, seq_adv, G, **obj.resolve({}))
        (g_full,) = torch.autograd.grad(
            aggregate(full, mask, agg, step_normaliser(agg, seq_lengths(mask), 6)), logp
        )
        norm = step_normaliser(agg, seq_lengths(mask[:4]) + seq_lengths(mask[4:]), 6)
        total = 0
        for sl in (slice(0, 4), slice(4, 8)):
            part, _, _ = obj.surrogate(
                logp[sl], logp[sl].detach(), adv[sl], mask[sl], seq_adv[sl], G, **obj.resolve({})
            )
            total = total + aggregate(part, mask[sl], agg, norm)
        (g_split,) = torch.autograd.grad(total, logp)
        torch.testing.assert_close(g_split, g_full, msg=name)


def test_resolve_params_defaults_and_errors():
    r = resolve_params(ObjectiveConfig(name="dapo"))
    assert r.kwargs == {"eps_low": 0.2, "eps_high": 0.28} and r.aggregation == "token_mean"
    assert resolve_params(ObjectiveConfig(name="dr_grpo")).scale_rewards is False
    r = resolve_params(
        ObjectiveConfig(name="ibpo", params={"weights": "adv_orthogonal", "gate": "token"})
    )
    assert r.kwargs == {"weights": "adv_orthogonal", "gate": "token", "eps_low": 0.2,
                        "eps_high": 0.28} and r.counterfactual  # fmt: skip
    with pytest.raises(ConfigError, match="objective.params.weights is not a parameter of "):
        resolve_params(ObjectiveConfig(name="grpo", params={"weights": "min_replace"}))
    with pytest.raises(ConfigError, match="min_replace"):
        resolve_params(ObjectiveConfig(name="dfpo", params={"weights": "nope"}))
    with pytest.raises(ConfigError, match="token_mean"):
        resolve_params(ObjectiveConfig(name="dfpo", aggregation="sum"))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_reported_coefficient_is_the_applied_one(name):
    """coef * adv * token_weights equals -Z * dloss/dlogp: the diagnostic reads what ran."""
    from ibpo.algo.objectives import token_weights

    obj = OBJECTIVES[name]
    torch.manual_seed(0)
    n, T = 2 * G, 5
    mask = torch.ones(n, T)
    mask[1, 3:] = 0
    mask[6, 1:] = 0
    logp = (-torch.rand(n, T) * 2).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(n, T)  # large shifts: clipping active
    seq_adv = group_advantages(torch.tensor([[1.0, 0, 0, 1], [0, 1, 0, 0]]), True).flatten()
    adv = token_advantages(seq_adv, mask)
    per_tok, coef, _ = obj.surrogate(logp, old, adv, mask, seq_adv, G, **obj.resolve({}))
    Z = step_normaliser(obj.aggregation, seq_lengths(mask), T)
    aggregate(per_tok, mask, obj.aggregation, Z).backward()
    expected = coef * adv * token_weights(mask, obj.aggregation)
    torch.testing.assert_close(-logp.grad * Z, expected, atol=1e-6, rtol=1e-5)


def test_kl_estimators_agree_in_value_and_differ_in_gradient_on_policy():
    """On-policy both estimators read k3; k3's gradient is (1 - ref/pi) per token, while the
    ratio-weighted one's is (logp - ref): the score-function gradient of KL(pi || ref), what
    TRL's use_bias_correction_kl computes."""
    from ibpo.algo.objectives import KL_ESTIMATORS

    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(3, 5, generator=g) - 0.1
    values, grads = {}, {}
    for name, kl in KL_ESTIMATORS.items():
        logp = (
            -torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) - 0.1
        ).requires_grad_()
        out = kl(logp, ref, logp.detach())
        (grads[name],) = torch.autograd.grad(out.sum(), logp)
        values[name] = out.detach()
        lp = logp.detach()
    torch.testing.assert_close(values["k3"], values["k3_ratio"])
    torch.testing.assert_close(grads["k3"], 1 - (ref - lp).exp())
    torch.testing.assert_close(grads["k3_ratio"], lp - ref)
    assert resolve_params(ObjectiveConfig(kl_estimator="k3_ratio")).kl is KL_ESTIMATORS["k3_ratio"]
    assert resolve_params(ObjectiveConfig()).kl is KL_ESTIMATORS["k3"]  # the default
