r"""Rollout-vs-trainer mismatch: how far the log-probs the generation backend sampled with are from
the trainer's log-probs for the same tokens.

For completion tokens a ~ q (the rollout backend's sampling distribution) with trainer log-probs
log p, d = log p(a) - log q(a) per token, and over the trained tokens:

    kl          mean of k3 = exp(d) - d - 1 >= 0 (unbiased for KL(q || p) from samples of q)
    abs_mean    mean |d|           abs_max   max |d|
    share       the share of tokens with |d| > ln 2 (probabilities off by more than a factor of 2)
    worst_sequence  the largest per-sequence mean |d|

Zero when the backend samples from exactly the distribution the trainer computes. Numerics alone
(another kernel, bf16, a KV cache, a dequantised or folded base) leave it small; a dropped
adapter or stale weights make it grow with how far the policy has moved; top-p or top-k
sampling shows as a steady gap (the trainer's log-probs are over the full distribution).

Not here: the thresholds and the warning (run/alarm.py), the correction (objectives.py).
Shapes: n sequences, T completion tokens; everything stays on the tensors' device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FAR = math.log(2.0)  # |d| beyond which a token counts in `share`


def mismatch_stats(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """[n, T] detached log-probs and the completion mask -> 0-dim tensors (no host read): the
    means over the masked tokens and the maxima of the module doc, prefixed `mismatch_`."""
    with torch.no_grad():
        on = mask > 0
        d = torch.where(on, trainer_logp.double() - rollout_logp.double(), 0.0)
        n = mask.double().sum().clamp_min(1.0)
        k3 = torch.where(on, d.exp() - d - 1.0, 0.0)
        a = d.abs()
        per_seq = a.sum(-1) / mask.double().sum(-1).clamp_min(1.0)
        return {
            "mismatch_kl": k3.sum() / n,
            "mismatch_abs_mean": a.sum() / n,
            "mismatch_abs_max": a.max() if a.numel() else a.sum(),
            "mismatch_share": (a > FAR).double().sum() / n,
            "mismatch_worst_sequence": per_seq.max() if per_seq.numel() else per_seq.sum(),
        }
