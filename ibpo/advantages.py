"""Group advantages and the token-level credit seam of IBPO (IBPO.md Part 2).

* `group_advantages`: A_i = R_i - mean_G(R) (optionally / (std_G(R) + eps)); a group whose rewards
  are all equal gets exactly zero advantage.
* `shape_rewards`: R'_i = R_i + lambda * phi_i, phi only on incorrect members (the counterfactual
  repair bonus; phi itself comes from repair generations, which this module does not run).
* `edited_tokens`: which tokens of an attempt its repair changed, from a token-level Levenshtein
  alignment (rapidfuzz's C implementation over token ids).
* `token_advantages`: broadcast A_i over tokens, and where an edit mask is given, reduce the blame
  on tokens a successful repair left unchanged (negative A only; never increases |A|, never flips
  its sign; unchanged_weight = 1 is a no-op).

No model calls here: everything is arithmetic on [B, G] rewards and [N, T] masks (N = B * G).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, scale: bool, eps: float = 1e-6) -> Tensor:
    """rewards [B, G] -> advantages [B, G] centred within each group."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    # unbiased=False keeps G=2 groups finite and matches the population std of the group
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def shape_rewards(rewards: Tensor, phi: Tensor, lam: float, correct: Tensor) -> Tensor:
    """R' = R + lambda * phi on incorrect members only; correct members keep R exactly."""
    return torch.where(correct, rewards, rewards + lam * phi)


def edited_tokens(attempt: list[int], repair: list[int]) -> list[bool]:
    """For each token of `attempt`: True when the minimal alignment to `repair` changes it.

    Replaced and deleted tokens are edited. An insertion before position j means the policy
    emitted attempt[j] where the repair wrote something else first, so attempt[j] is marked too
    (an insertion at the very end marks the last token: stopping there was the mistake).
    """
    from rapidfuzz.distance import Levenshtein

    edited = [False] * len(attempt)
    if not attempt:
        return edited
    for op in Levenshtein.editops(attempt, repair):
        edited[min(op.src_pos, len(attempt) - 1)] = True
    return edited


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
