"""Group advantages and the token-level credit seam of IBPO (IBPO.md Part 2).

* `group_advantages`: A_i = R_i - mean_G(R) (optionally / (std_G(R) + eps)); a group whose rewards
  are all equal gets exactly zero advantage, and a NaN reward (no reward applies) none.
* `shape_rewards`: R'_i = R_i + lambda * phi_i, phi only on failed members (the counterfactual
  repair bonus; phi itself comes from repair generations, which this module does not run).
* `overlong_penalty`: DAPO's soft length penalty, a reward term added before centring.
* `token_advantages`: broadcast A_i over tokens, and where an edit mask is given
  (counterfactual.edit_masks), reduce the blame on tokens a successful repair left unchanged
  (negative A only; never increases |A|, never flips its sign; unchanged_weight = 1 is a no-op).
* `lifted_blame_fraction`: the share of a step's completion tokens whose blame the edit mask
  lowers (how often Part 2's mask acts at all, as opposed to its shaping term).

No model calls here: everything is arithmetic on [B, G] rewards and [N, T] masks (N = B * G).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, scale: bool, eps: float = 1e-6) -> Tensor:
    """rewards [B, G] -> advantages [B, G] centred within each group. A NaN reward (a
    completion no reward function applies to) is left out of its group's mean and std, and its
    advantage is 0 (TRL's rule: it carries no signal, and 0 in its place would be a failure)."""
    scored = ~rewards.isnan()
    n = scored.sum(dim=1, keepdim=True).clamp_min(1)
    mean = torch.where(scored, rewards, 0.0).sum(dim=1, keepdim=True) / n
    centred = torch.where(scored, rewards - mean, 0.0)
    # A flat group is zero by definition, not by rounding: the float32 mean of equal rewards such
    # as 0.3 can be off in its last bits, which std scaling would blow up into one equal, non-zero
    # advantage for every member (tests/test_repair.py).
    centred = torch.where(flat_groups(rewards).unsqueeze(1), 0.0, centred)
    if not scale:
        return centred
    # The population std (divide by G): the group is the whole set being compared, not a sample
    # of a larger one. TRL divides by G - 1 (Bessel), which makes its advantages
    # sqrt(G / (G - 1)) smaller (1.069x at G = 8). Adam's update barely depends on that scale;
    # what it moves is the weight of the policy term against objective.kl_coef.
    std = (centred.square().sum(dim=1, keepdim=True) / n).sqrt()
    return centred / (std + eps)


def flat_groups(rewards: Tensor) -> Tensor:
    """rewards [B, G] -> [B] bool: every member of the group has the same reward (no signal).
    NaN rewards (no reward applies) are left out: a group with at most one other is flat."""
    scored = ~rewards.isnan()
    high = torch.where(scored, rewards, -torch.inf).amax(dim=1)
    low = torch.where(scored, rewards, torch.inf).amin(dim=1)
    return (high == low) | (scored.sum(dim=1) <= 1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: float, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment: lengths (completion tokens) -> a reward term <= 0.

    0 up to (1 - buffer) x max_len tokens, then falling linearly to -penalty at max_len (where
    generation stops, truncated): long answers are discouraged before they are cut off, without
    the cliff that scoring a truncated completion as plain wrong would be.
    """
    cache = buffer * max_len
    if cache <= 0 or penalty == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - cache)).clamp(0, cache)
    return -penalty * over / cache


def shape_rewards(rewards: Tensor, phi: Tensor, lam: float, correct: Tensor) -> Tensor:
    """R' = R + lambda * phi on incorrect members only; correct members keep R exactly."""
    return torch.where(correct, rewards, rewards + lam * phi)


def token_advantages(
    seq_adv: Tensor,
    mask: Tensor,
    edited: Tensor | None = None,
    unchanged_weight: float = 0.0,
) -> Tensor:
    """seq_adv [N], mask [N, T] (, edited [N, T] bool) -> token advantages [N, T].

    Without `edited` every completion token carries its sequence's advantage. With it, tokens of a
    negatively-rewarded trajectory that its successful repair kept get A * unchanged_weight.
    """
    adv = seq_adv.unsqueeze(-1).expand_as(mask).to(mask.dtype)
    if edited is None:
        return adv * mask
    if not 0.0 <= unchanged_weight <= 1.0:
        raise ValueError("unchanged_weight must lie in [0, 1] (the mask may only reduce blame)")
    negative = (seq_adv < 0).unsqueeze(-1)
    factor = torch.where(negative & ~edited, unchanged_weight, 1.0).to(mask.dtype)
    return adv * factor * mask


def lifted_blame_fraction(seq_adv: Tensor, mask: Tensor, edited: Tensor) -> Tensor:
    """seq_adv [N], mask [N, T], edited [N, T] bool -> 0-dim share of the completion tokens that
    `token_advantages` scales by unchanged_weight: kept by a successful repair, in a trajectory
    whose advantage is still negative after shaping. 0 when no repair succeeded, or when every
    repaired trajectory ended at or above its group's mean (then Part 2 acted through shaping
    alone). Counted whatever unchanged_weight is, so a shaping-only run reports how often the
    mask would have acted."""
    kept = (seq_adv < 0).unsqueeze(-1) & ~edited & mask.bool()
    return kept.sum() / mask.sum().clamp(min=1)
