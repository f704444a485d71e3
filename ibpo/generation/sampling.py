"""How the hf backend samples a token and the log-probability it reports for it.

Behaviour log-probs: a sampled rollout carries, for each completion token, its log-probability
under the distribution it was actually drawn from (`Rollout.logprobs`), so the update can check
that rollouts came from the policy it trains (step.py) and correct for the difference
(objectives.importance_weights). Here the sampling transforms (temperature, then top-k, then
top-p) run as the last logits processor of `generate`, `SampledLogprobs`, which keeps
log_softmax of the very scores transformers samples from (generate's own warpers stay off). They
are the sampler's numbers: its kernels, KV cache, dtype and, on CPU, the dequantised base with the
adapter folded in. Greedy calls (evaluation) report none.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_k_filter(scores: Tensor, k: int) -> Tensor:
    """[n, V] -> [n, V]: scores outside each row's k largest set to -inf (ties at the k-th kept)."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = scores.topk(k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_filter(scores: Tensor, p: float) -> Tensor:
    """[n, V] -> [n, V]: keep each row's smallest set of most likely tokens whose probability
    reaches p (the nucleus; at least one token), the rest set to -inf."""
    if p >= 1.0:
        return scores
    ordered, order = scores.sort(-1, descending=True)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
    drop = before >= p
    drop[..., 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(-1, order, ordered)


def draw(scores: Tensor, lse: Tensor) -> Tensor:
    """One token per row from softmax(scores), [n, V] -> [n, 1], by inverting the cumulative
    distribution at one uniform draw per row. The cumulative sum is in float64, so a token's
    interval is its probability to ~1e-16 (in float32 a token below ~6e-8 would get an interval of
    0 or 6e-8). Only tokens of non-zero probability can come out: the draw u is kept strictly
    below the total, and the first index whose cumulative sum exceeds u has p > 0. Costs one
    uniform per row where torch.multinomial draws an exponential per vocabulary entry."""
    cdf = (scores - lse).double().exp_().cumsum_(-1)  # [n, V]
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)


class SampledLogprobs:
    """The last logits processor of a sampled `generate`: applies temperature, top-k and top-p
    (generate's own are off), draws each row's token itself (`draw`) and records log-probs of the
    drawn tokens under the processed scores.

    It returns 0 at the drawn token and -inf elsewhere, and generate runs greedy, so the token
    taken is the one drawn here from softmax of the processed scores: log_softmax of those at the
    drawn token is exactly the sampling distribution's log-prob. The drawn token is only known at
    the next call (the last column of input_ids), so the previous call's scores and
    log-normaliser are kept until then (one [n, V] tensor); `finish` reads the last token from the
    output."""

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.previous: tuple[Tensor, Tensor] | None = None  # scores [n, V], logsumexp [n, 1]
        self.columns: list[Tensor] = []  # [n] per generated token

    def _record(self, tokens: Tensor) -> None:
        scores, lse = self.previous
        self.columns.append((scores.gather(1, tokens.view(-1, 1)) - lse).squeeze(1))

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.previous is not None:
            self._record(input_ids[:, -1])
        scores = scores / self.temperature if self.temperature != 1.0 else scores
        scores = top_p_filter(top_k_filter(scores, self.top_k), self.top_p)
        lse = scores.logsumexp(-1, keepdim=True)
        self.previous = (scores, lse)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, draw(scores, lse), 0.0)

    def finish(self, completions: Tensor) -> Tensor:
        """completions [n, t] as generate returned them -> their log-probs [n, t] (float32)."""
        if self.previous is not None:
            self._record(completions[:, -1])
            self.previous = None
        if len(self.columns) != completions.shape[1]:
            raise RuntimeError(
                f"recorded {len(self.columns)} log-probs for {completions.shape[1]} generated "
                "tokens: another logits processor ran after ibpo's sampling transforms"
            )
        return torch.stack(self.columns, 1).float()
