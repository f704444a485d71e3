r"""Policy-gradient surrogates as pure functions over flat tensors, each objective registered
beside its loss.

Every objective is written per token and then aggregated:

    loss = (1/Z) * sum_i sum_t  m_{i,t} * l_{i,t}          (token_sum, token_mean)
    loss = (1/Z) * sum_i (1/|y_i|) sum_t m_{i,t} * l_{i,t}  (seq_mean)

where Z is taken from the *whole* optimisation step (all micro-batches), so splitting a step into
micro-batches with gradient accumulation does not change the gradient.

The exchangeable surrogate (``ibpo``, ``dfpo``; IBPO.md Part 1) is linear in log pi with a
detached, group-transformed sequence weight w~_i:

    l_{i,t} = - w~_i * A_{i,t} * log pi(a_{i,t} | h_{i,t})
    w_i     = exp(mean_t(logp - old_logp))               (GSPO's sequence ratio, detached)
    Min-Replace:    w~_i = min_j w_j                      (same for every member of the group)
    Adv-Orthogonal: w~   = w - (A.w / ||A||^2) A          (so that A.w~ = 0)

Because every member of a group multiplies a shared token's gradient by the same w~ (or by
weights orthogonal to A), a token emitted at the same context by all members gets exactly
sum_i w~_i A_i = 0 net gradient when advantages are group-centred. Clipped objectives (GRPO, DAPO,
Dr.GRPO) and GSPO's per-sequence ratio do not have this property; they are here as baselines.

Behaviour-policy correction (rollout vs trainer; docs/objectives.md). The ratios above take
old_logp as the behaviour policy: the trainer's log-probs before the update by default, or the
log-probs the generation backend reported (objective.behavior_policy=rollout). Alternatively the
loss is weighted by rho = pi_old / pi_rollout, truncated (TIS: min(rho, C)) or masked (MIS: rho
where rho <= C, else 0), as `importance_weights` makes them: per token for the clipped token
objectives; per sequence (the geometric mean, exp(mean_t log rho)) for GSPO and for the
exchangeable surrogate, where it multiplies w_i *before* the group transform, so every member
of a group still shares one coefficient and cancellation stays exact. With rollout and trainer
log-probs equal, rho = 1 exactly and both corrections reduce to the uncorrected objective.

Each objective is one `register_objective(...)` call beside its surrogate: the six below (ibpo and
dfpo on the exchangeable surrogate; grpo, dr_grpo and dapo on the clipped token ratio; gspo) are
registered exactly as a user's own is (docs/layout.md). An ObjectiveSpec holds the loss function
itself, the level its importance weights take, its defaults for the shared knobs (aggregation,
std scaling, DAPO's overlong penalty), whether repairs and dynamic sampling are on by default,
and its own knobs: each keyword argument of its surrogate declared once as a Param (type,
default, rule), which a recipe sets under objective.params and `ObjectiveSpec.resolve` turns
into the values the surrogate receives. OBJECTIVES is the one table of them. ResolvedObjective
is an objective with a run's parameters: what the step calls.

What this module does not do: read a recipe (ibpo/recipe.py turns the objective section into a
ResolvedObjective through the spec's `resolve` and its shared knobs), compute advantages
(advantages.py) or log-probs (logprobs.py).
Shapes: n sequences in the micro-batch (whole groups, group-major), T completion tokens.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over tokens of each sequence: [n, T] -> [n]."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log of GSPO's length-normalised sequence ratio: mean_t(logp - old_logp) -> [n]."""
    return _seq_mean(logp - old_logp, mask)


# --- aggregation: normaliser from the whole step ----------------------------------------------


def step_normaliser(aggregation: str, lengths: list[int], max_new_tokens: int) -> float:
    """Z for the whole step, given the completion lengths of all its sequences."""
    n_seq = len(lengths)
    if aggregation == "token_mean":
        return max(float(sum(lengths)), 1.0)
    if aggregation == "token_sum":
        return float(n_seq * max_new_tokens)
    if aggregation == "seq_mean":
        return float(max(n_seq, 1))
    raise ValueError(f"unknown aggregation {aggregation!r}")


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str, normaliser: float) -> Tensor:
    """Reduce a micro-batch's per-token loss with the step-wide normaliser."""
    if aggregation == "seq_mean":
        return _seq_mean(per_token, mask).sum() / normaliser
    return (per_token * mask).sum() / normaliser


def token_weights(mask: Tensor, aggregation: str) -> Tensor:
    """The per-token factor `aggregate` applies before dividing by Z: [n, T].

    1/|y_i| under seq_mean (one reason GRPO's coefficients differ between members), else 1.
    """
    if aggregation == "seq_mean":
        return mask / mask.sum(-1, keepdim=True).clamp_min(1)
    return mask


AGGREGATIONS = ("token_mean", "token_sum", "seq_mean")


# --- the registry: one call per objective ------------------------------------------------------

Surrogate = Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]]
# The arguments every surrogate is called with, by position, and `rho` by name (step.py).
_POSITIONAL = ("logp", "old_logp", "adv", "mask", "seq_adv", "group_size")
# What importance weights weigh (importance_ratio): each token, or each sequence.
LEVELS = ("token", "sequence")


class ParamError(ValueError):
    """A value of objective.params the objective's declaration refuses (ibpo.recipe reports
    it as a configuration error)."""


@dataclass(frozen=True)
class Param:
    """One knob of an objective: a keyword argument of its surrogate, with its type, its
    default and what a value must satisfy (`choices`, or `check(value) -> bool` with `rule`
    saying it in words: "must lie in [0, 1)"). A recipe sets it as objective.params.<name>."""

    type: type
    default: Any
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    choices: tuple[str, ...] | None = None

    def take(self, name: str, value: Any) -> Any:
        """`value` as this knob's type (an int for a float, "1e-4" read as a number), or a
        ParamError naming objective.params.<name> and its rule."""
        key = f"objective.params.{name}"
        if value is None:
            return self.default
        value = _as_type(value, self.type, key)
        if self.choices is not None and value not in self.choices:
            raise ParamError(f"{key}={value!r}; choose one of: {', '.join(self.choices)}")
        if self.check is not None and not self.check(value):
            raise ParamError(f"{key}={value!r} {self.rule or 'is refused by its check'}")
        return value


def _as_type(value: Any, tp: type, key: str) -> Any:
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is float and numeric:
        return float(value)
    if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
        return value
    raise ParamError(f"{key}: expected {tp.__name__}, got {value!r}")


def eps_low(default: float) -> Param:
    """The lower clip (or gate) of a ratio, 1 - eps_low."""
    return Param(float, default, lambda x: 0.0 <= x < 1.0, "must lie in [0, 1)")


def eps_high(default: float) -> Param:
    """The upper clip (or gate) of a ratio, 1 + eps_high (DAPO's clip-higher)."""
    return Param(float, default, lambda x: x >= 0.0, "must be >= 0")


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective as registered: its loss function, the level its importance weights take,
    its defaults for the objective section's shared knobs (what its None fields become),
    whether repairs and dynamic sampling are on by default, and `params`: its surrogate's own
    keyword arguments, each declared (Param); an objective takes no other."""

    name: str
    surrogate: Surrogate
    level: str
    aggregation: str
    params: dict[str, Param] = field(default_factory=dict)
    scale_rewards: bool = True  # A = (R - mean) / std  (True)  or  R - mean  (False)
    # DAPO's soft overlong punishment (advantages.overlong_penalty); 0 = off
    overlong_buffer: float = 0.0
    overlong_penalty: float = 0.0
    repairs: bool = False  # IBPO.md Part 2: counterfactual repairs, shaped rewards, edit masks
    dynamic_sampling: bool = False  # DAPO's: flat groups dropped and refilled

    def resolve(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """objective.params as a recipe sets them -> every knob's value (what is not given,
        or given as None, takes its default), each of its type and within its rule; a knob
        the objective does not declare is a ParamError naming the ones it does."""
        unknown = [k for k in given if k not in self.params]
        if unknown:
            takes = ", ".join(self.params) or "no parameters"
            raise ParamError(
                f"objective.params.{unknown[0]} is not a parameter of objective "
                f"{self.name!r} (it takes: {takes}); remove it from objective.params"
            )
        return {k: p.take(k, given.get(k)) for k, p in self.params.items()}


# name -> spec, in registration order: every objective a recipe may name.
OBJECTIVES: dict[str, ObjectiveSpec] = {}
# The objectives this module registers (set at its end): a user's cannot replace or remove them.
SHIPPED: tuple[str, ...] = ()


def register_objective(
    name: str,
    surrogate: Surrogate | None = None,
    *,
    level: str,
    aggregation: str,
    params: Mapping[str, Param | Any] | None = None,
    scale_rewards: bool = True,
    repairs: bool = False,
    dynamic_sampling: bool = False,
    overlong_buffer: float = 0.0,
    overlong_penalty: float = 0.0,
    replace: bool = False,
    **knobs: Any,
) -> Any:
    """Register objective `name`, then selectable as objective.name=<name>: its surrogate (a
    function with the signature of the ones below), the level its importance weights take, its
    `params` (name -> Param, or a plain default whose type is the knob's: {"tau": 0.5}), its
    defaults for the shared knobs (aggregation, scale_rewards, overlong_*), and whether repairs
    and dynamic sampling are on by default. Without `surrogate` it is a decorator. -> the
    surrogate.

    A bad call (a shipped or taken name, an unknown level or aggregation, a function that does
    not take the step's arguments and its params, a default its own Param refuses, a knob
    passed as a keyword rather than in `params`) raises ValueError before anything is
    registered; the shared defaults are checked against the
    recipe's field rules when a recipe names the objective (ibpo/recipe.py)."""
    if knobs:  # the form of earlier versions: a surrogate's keyword arguments as keywords
        raise ValueError(
            f"objective {name!r}: {', '.join(knobs)} is not an argument of register_objective; "
            f"declare the surrogate's knobs as params={{{', '.join(f'{k!r}: ...' for k in knobs)}}}"
        )
    if surrogate is None:
        return lambda fn: register_objective(
            name, fn, level=level, aggregation=aggregation, params=params,
            scale_rewards=scale_rewards, repairs=repairs, dynamic_sampling=dynamic_sampling,
            overlong_buffer=overlong_buffer, overlong_penalty=overlong_penalty, replace=replace,
        )  # fmt: skip
    where = f"objective {name!r}"
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"{where}: a name is lower-case letters, digits and '_' (e.g. my_pg)")
    if name in SHIPPED:
        raise ValueError(f"{where} ships with ibpo; register yours under another name")
    if name in OBJECTIVES and not replace:
        raise ValueError(f"{where} is already registered; pick another name or pass replace=True")
    if level not in LEVELS:
        raise ValueError(f"{where}: level={level!r}; choose one of: {', '.join(LEVELS)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"{where}: aggregation={aggregation!r}; choose one of: {', '.join(AGGREGATIONS)}"
        )
    declared = _declare(where, params or {})
    _check_signature(name, surrogate, declared)
    OBJECTIVES[name] = ObjectiveSpec(
        name, surrogate, level, aggregation, declared, scale_rewards, overlong_buffer,
        overlong_penalty, repairs, dynamic_sampling,
    )  # fmt: skip
    return surrogate


def _declare(where: str, params: Mapping[str, Any]) -> dict[str, Param]:
    """A registration's params as Params, each default passing its own rule."""
    declared = {}
    for key, p in params.items():
        if not isinstance(key, str) or not key.isidentifier() or key in (*_POSITIONAL, "rho"):
            raise ValueError(
                f"{where}: parameter {key!r} must be a keyword name other than the step's "
                f"arguments ({', '.join(_POSITIONAL)}, rho)"
            )
        if not isinstance(p, Param):  # a plain default: its type is the knob's
            p = Param(type(p), p)
        if p.default is not None:
            try:
                p.take(key, p.default)
            except ParamError as e:
                raise ValueError(f"{where}: the default of {e}") from None
        declared[key] = p
    return declared


def _check_signature(name: str, fn: Any, params: Mapping[str, Param]) -> None:
    """A surrogate must take the step's arguments and the keyword arguments it declares."""
    if not callable(fn):
        raise ValueError(f"objective {name!r}: the surrogate must be a function, got {fn!r}")
    signature = inspect.signature(fn).parameters
    wanted = [*_POSITIONAL, "rho", *params]
    missing = [p for p in wanted if p not in signature]
    if missing and not any(p.kind is p.VAR_KEYWORD for p in signature.values()):
        raise ValueError(
            f"objective {name!r}: {getattr(fn, '__name__', fn)} does not take "
            f"{', '.join(missing)}; a surrogate is f({', '.join(_POSITIONAL)}, *, rho=None, "
            "<its params>) -> (per-token loss, coefficient, stats)"
        )


def unregister_objective(name: str) -> None:
    """Remove a registered objective; the shipped ones stay."""
    if name in SHIPPED:
        raise ValueError(f"objective {name!r} ships with ibpo and cannot be removed")
    OBJECTIVES.pop(name, None)


# --- group weight transforms (IBPO.md Part 1, v1 Eq. 17/18) -----------------------------------


def min_replace(w: Tensor, seq_adv: Tensor) -> Tensor:
    """[g, G] -> [g, G]: every member takes the group minimum."""
    return w.min(dim=1, keepdim=True).values.expand_as(w)


def adv_orthogonal(w: Tensor, seq_adv: Tensor) -> Tensor:
    """[g, G] -> [g, G]: remove the component of w along A, so A . w~ = 0 in each group."""
    a = seq_adv.to(w.dtype)
    norm2 = (a * a).sum(1, keepdim=True)
    proj = torch.where(norm2 > 0, (a * w).sum(1, keepdim=True) / norm2.clamp_min(1e-30), 0.0)
    return w - proj * a


WEIGHT_TRANSFORMS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "min_replace": min_replace,
    "adv_orthogonal": adv_orthogonal,
}

GATES = ("none", "group", "token")


# --- behaviour-policy correction (rollout vs trainer) ---------------------------------------


def importance_ratio(old_logp: Tensor, behav_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """Detached rho = pi_old / pi_behav: [n, T] per token (level="token") or [n] per sequence
    (level="sequence": exp of the mean log-ratio over the sequence's tokens)."""
    with torch.no_grad():
        log_rho = torch.where(mask > 0, old_logp - behav_logp, 0.0)
        if level == "sequence":
            log_rho = _seq_mean(log_rho, mask)
        return log_rho.exp()


def importance_weights(rho: Tensor, mode: str, cap: float) -> Tensor:
    """The weights the loss takes from ratios rho: truncate (TIS: min(rho, cap)) or mask (MIS:
    rho where rho <= cap, else 0)."""
    if mode == "truncate":
        return rho.clamp(max=cap)
    if mode == "mask":
        return torch.where(rho <= cap, rho, 0.0)
    raise ValueError(f"unknown importance_sampling mode {mode!r}")


def _per_token(rho: Tensor | None, like: Tensor) -> Tensor | None:
    """A sequence-level [n] or token-level [n, T] weight as a [n, T]-broadcastable tensor."""
    if rho is None:
        return None
    return rho.unsqueeze(-1) if rho.dim() == 1 else rho


# --- surrogates -------------------------------------------------------------------------------
# Each returns (per-token loss l [n, T], coef [n, T], stats). `coef` is the detached coefficient
# the surrogate actually applies, dl/dlogp = -coef * adv: what the cancellation diagnostic reads
# (IBPO.md Part 1), so the diagnostic measures the objective that ran, not a re-derivation of it.


def exchangeable(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    seq_adv: Tensor,
    group_size: int,
    *,
    weights: str = "min_replace",
    gate: str = "none",
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    rho: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """IBPO/DFPO: linear surrogate with detached, group-exchangeable sequence weights. `rho`
    [n]: sequence importance weights, applied to w before the group transform."""
    n, _ = logp.shape
    with torch.no_grad():
        ratio = sequence_log_ratio(logp, old_logp, mask).exp().view(n // group_size, group_size)
        w = ratio if rho is None else ratio * rho.view_as(ratio)
        w_t = WEIGHT_TRANSFORMS[weights](w, seq_adv.view_as(w))
        keep = torch.ones_like(mask)
        if gate == "group":
            # Drop the whole group when its group-constant ratio (Min-Replace's w~ without
            # importance weights) leaves the band: one decision for every member, so it cannot
            # break exchangeability, and blind to sign(A). Adv-Orthogonal's w~ differs per
            # member: there every member's ratio must lie inside.
            g = ratio.min(1, keepdim=True).values if weights == "min_replace" else ratio
            inside = ((g >= 1 - eps_low) & (g <= 1 + eps_high)).all(1, keepdim=True)
            keep = keep * inside.expand_as(w).reshape(n, 1).to(mask.dtype)
        elif gate == "token":
            # A token's ratio depends only on its context and the token: identical contexts are
            # gated together whatever their advantage.
            r = (logp - old_logp).exp()
            keep = keep * ((r >= 1 - eps_low) & (r <= 1 + eps_high)).to(mask.dtype)
        coef = w_t.reshape(n, 1) * keep
    loss = -coef * adv * logp
    gated = 1.0 - _share(keep, mask)
    return loss, coef.expand_as(logp), {"gate_fraction": gated, "weight_mean": w_t.mean()}


# IBPO's shaped rewards need its repairs; DFPO is the same surrogate without them (Part 1 alone).
_EXCHANGEABLE = {
    "weights": Param(str, "min_replace", choices=tuple(WEIGHT_TRANSFORMS)),  # the group transform
    "gate": Param(str, "none", choices=GATES),  # the trust region (eps_low, eps_high its band)
    "eps_low": eps_low(0.2),
    "eps_high": eps_high(0.28),
}
register_objective(
    "ibpo", exchangeable, level="sequence", aggregation="token_mean", repairs=True,
    params=_EXCHANGEABLE,
)  # fmt: skip
register_objective(
    "dfpo", exchangeable, level="sequence", aggregation="token_mean", params=_EXCHANGEABLE
)


def clipped_token(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    seq_adv: Tensor,
    group_size: int,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    rho: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO-style clipped token ratio (GRPO, Dr.GRPO, DAPO); the clip depends on sign(A).
    `rho` [n, T]: token importance weights on the loss."""
    ratio = (logp - old_logp).exp()
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    with torch.no_grad():
        active = ((ratio * adv) > (clipped * adv)).to(mask.dtype)  # min picked the clipped branch
        frac = _share(active, mask)
        coef = ratio.detach() * (1 - active)  # d(-min)/d logp = -r A unclipped, 0 clipped
    if rho is not None:
        loss, coef = loss * rho, coef * rho
    return loss, coef, {"clip_fraction": frac}


_CLIP = {"eps_low": eps_low(0.2), "eps_high": eps_high(0.2)}
register_objective("grpo", clipped_token, level="token", aggregation="seq_mean", params=_CLIP)
register_objective(
    "dr_grpo", clipped_token, level="token", aggregation="token_sum", scale_rewards=False,
    params=_CLIP,
)  # fmt: skip
# DAPO's overlong buffer is 4,096 of 20,480 tokens; its -1 on a +-1 reward scale is -0.5 on 0..1.
# DAPO is DAPO only with dynamic sampling.
register_objective(
    "dapo",
    clipped_token,
    level="token",
    aggregation="token_mean",
    dynamic_sampling=True,
    overlong_buffer=0.2,
    overlong_penalty=0.5,
    params={"eps_low": eps_low(0.2), "eps_high": eps_high(0.28)},
)


def gspo_sequence(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    seq_adv: Tensor,
    group_size: int,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    rho: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """GSPO: clipped sequence ratio s_i = exp(mean_t(logp - old_logp)), shared by its tokens.

    Written per token as s_{i,t} = sg[s_i] * pi/sg[pi], whose gradient is s_i * grad logp_t;
    with seq_mean aggregation this is exactly GSPO's sequence-level objective. `rho` [n]:
    sequence importance weights on the loss.
    """
    log_s = sequence_log_ratio(logp, old_logp, mask).detach().unsqueeze(-1)
    s = (log_s + logp - logp.detach()).exp()
    clipped = s.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(s * adv, clipped * adv)
    with torch.no_grad():
        active = ((s * adv) > (clipped * adv)).to(mask.dtype)
        frac = _share(active, mask)
        coef = s.detach() * (1 - active)
    weight = _per_token(rho, loss)
    if weight is not None:
        loss, coef = loss * weight, coef * weight
    return loss, coef, {"clip_fraction": frac}


register_objective(
    "gspo", gspo_sequence, level="sequence", aggregation="seq_mean",
    params={"eps_low": eps_low(3e-4), "eps_high": eps_high(4e-4)},
)  # fmt: skip


def _share(flags: Tensor, mask: Tensor) -> Tensor:
    """The masked share of flagged tokens, a 0-dim float64 tensor on their device: no host read
    per micro-batch (the step reads all its statistics at once)."""
    return (flags * mask).sum().double() / mask.sum().double().clamp_min(1.0)


def k3_kl(logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None = None) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0.

    As a loss term its gradient is (1 - ref/pi) grad logp, whose expectation under pi is the
    gradient of KL(pi || ref) only to first order (`k3_ratio_kl` is unbiased)."""
    d = ref_logp - logp
    return d.exp() - d - 1


def k3_ratio_kl(logp: Tensor, ref_logp: Tensor, old_logp: Tensor) -> Tensor:
    """k3 times r = pi/pi_old (r differentiable, old detached). Its value is k3's on-policy
    (r = 1), and its gradient there, (k3 + 1 - ref/pi) grad logp = (logp - ref) grad logp, is
    the score-function form of grad KL(pi || ref): unbiased for samples from pi_old."""
    return k3_kl(logp, ref_logp) * (logp - old_logp.detach()).exp()


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "k3": k3_kl,
    "k3_ratio": k3_ratio_kl,
}


@dataclass(frozen=True)
class ResolvedObjective:
    """An objective with a run's parameters: what the step calls, built once per run from
    the objective section and its spec (ibpo.recipe.resolve_params); plain values only."""

    name: str
    surrogate: Surrogate
    kwargs: dict[str, Any]  # the surrogate's keyword arguments: its params, resolved
    aggregation: str
    scale_rewards: bool  # A = (R - mean) / std  (True)  or  R - mean  (False)
    counterfactual: bool  # declared with repairs (IBPO.md Part 2 shaped rewards) by default
    kl_coef: float
    # DAPO's soft overlong punishment (advantages.overlong_penalty): the buffer as a share of
    # rollout.max_new_tokens and the penalty at full length; 0 = off
    overlong_buffer: float = 0.0
    overlong_penalty: float = 0.0
    kl: Callable[[Tensor, Tensor, Tensor], Tensor] = k3_kl  # (logp, ref_logp, old_logp) -> [n, T]
    behavior_policy: str = "trainer"  # whose log-probs are old_logp: trainer | rollout
    importance_sampling: str = "none"  # none | truncate | mask (importance_weights)
    is_cap: float = 2.0
    # what `importance_weights` weighs: each token, or each sequence (sequence-level surrogates)
    is_level: str = "token"


SHIPPED = tuple(OBJECTIVES)
