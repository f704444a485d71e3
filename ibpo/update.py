"""Steps 5-8 of a training step, on a scored batch: frozen log-probs, micro-batched backward,
optimizer steps (trainer.py runs the whole step).

  5. old log-probs only when a rollout is reused (updates_per_rollout > 1), reference log-probs
     only when kl_coef > 0 or the KL is logged (same model, adapter disabled);
  6. micro-batches of whole groups sorted by length (batching.py): log-probs with grad ->
     objective -> backward, the loss divided by a normaliser taken from the whole step and all
     processes, so neither accumulation nor the number of processes changes the gradient;
  7. clip, and the optimizer and scheduler step, unless a loss or the gradient is not finite.
With several processes each runs as many forwards and backwards (DDP syncs buffers and FSDP
gathers weights in each one): a process with fewer micro-batches repeats its last with zero weight.
Statistics stay 0-dim tensors on the device until the end of the update, which reads them all at
once: the loop over micro-batches never waits on the GPU for a number (an update reads one flag,
finite or not, before it steps).

Not here: generation, rewards and advantages (scoring.py), the math of objectives (objectives.py).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from ibpo.batching import MicroBatch, micro_batches
from ibpo.diagnostics import cancellation_residual
from ibpo.distributed import agreed_count
from ibpo.logprobs import completion_logprobs
from ibpo.modeling import offloaded_activations, reference_mode
from ibpo.objectives import aggregate, k3_kl, step_normaliser, token_weights
from ibpo.scoring import ScoredBatch


def sequence_logprobs(model, mb: MicroBatch, chunk: int, temperature: float):
    """Log-probs/entropies [n, t] of one micro-batch (already cut to its widths)."""
    return completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.prompt_len,
                               mb.completion_mask, chunk, temperature)  # fmt: skip


@torch.no_grad()
def frozen_logprobs(model, mbs: list[MicroBatch], chunk, temperature, reference: bool, count: int):
    """Detached log-probs per micro-batch: rollout policy (old) or reference (adapter off). Runs
    `count` forwards (>= len(mbs)), repeating the last micro-batch: see `update_policy`."""
    ctx = reference_mode(model) if reference else nullcontext()
    # eval mode: LoRA dropout would make "old" a random perturbation of the rollout policy
    # (two calls would disagree), not the policy that sampled
    was_training = model.training
    model.eval()
    try:
        with ctx:
            out = [sequence_logprobs(model, mb, chunk, temperature)[0] for mb in mbs]
            for _ in range(count - len(mbs)):
                sequence_logprobs(model, mbs[-1], chunk, temperature)
    finally:
        model.train(was_training)
    return out


def update_is_finite(accelerator, losses: list[Tensor], grad_norm: float) -> bool:
    """One verdict for all processes: every micro-batch loss (0-dim tensors on the device) and
    the gradient norm are finite. One read of the device per process."""
    finite = torch.stack([torch.isfinite(x) for x in losses]).all()
    bad = (~finite).float().reshape(1) + float(not math.isfinite(grad_norm))
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad.to(accelerator.device), "sum")
    return bad.item() == 0


def global_normaliser(accelerator, objective, mbs: list[MicroBatch], max_new_tokens: int):
    """The step's Z, such that the gradient averaged by DDP over processes equals one process's
    gradient on all their rows: each process divides by the mean of the processes' Z."""
    lengths = [len(t) for mb in mbs for t in mb.tokens]
    z = step_normaliser(objective.aggregation, lengths, max_new_tokens)
    if accelerator.num_processes > 1:
        z = accelerator.reduce(torch.tensor([z], device=accelerator.device), "mean").item()
    return z


def micro_batch_loss(model, mb: MicroBatch, batch: ScoredBatch, old, ref, norm, cfg, objective):
    """Log-probs with grad, the objective and the loss of one micro-batch (backward is the
    caller's); also its stats and the coefficients the cancellation diagnostic needs."""
    tr, G = cfg.train, cfg.rollout.group_size
    with offloaded_activations(cfg.model.offload_activations):
        logp, ent = sequence_logprobs(model, mb, tr.logprob_chunk_tokens, cfg.rollout.temperature)
    mask, a = mb.completion_mask, mb.take(batch.adv)
    old_logp = logp.detach() if old is None else old
    per_token, coef, info = objective.surrogate(
        logp, old_logp, a, mask, mb.take(batch.seq_adv), G, **objective.kwargs
    )
    if ref is not None:
        kl = k3_kl(logp, ref)
        info["kl"] = ((kl * mask).sum() / mask.sum().clamp_min(1)).detach()
        if objective.kl_coef > 0:
            per_token = per_token + objective.kl_coef * kl
    loss = aggregate(per_token, mask, objective.aggregation, norm)
    info["entropy"] = (ent * mask).sum() / mask.sum().clamp_min(1)
    return loss, info, coef * token_weights(mask, objective.aggregation), a


@dataclass
class UpdateResult:
    """What one step's update did (update_policy), read from the device once."""

    stats: dict[str, list[float]]  # per micro-batch: loss, entropy, kl, clip/gate fractions...
    cancel: dict[str, float]  # the cancellation diagnostic's sums over micro-batches
    grad_norm: float  # of the last update (before clipping)
    updates: int  # optimizer updates attempted (updates_per_rollout, fewer when one was skipped)
    skipped: bool  # an update was dropped because a loss or the gradient was not finite
    time_frozen: float  # seconds spent on old/reference log-probs


def stack_stats(stats: dict[str, list[Tensor]], cancel: dict[str, Tensor]) -> Tensor:
    """An update's 0-dim statistics as one float64 tensor on their device (float64 holds every
    float32 value exactly, so each reads back as .item() would), in `stats` then `cancel` order."""
    values = [v for vs in stats.values() for v in vs] + list(cancel.values())
    device = next((v.device for v in values if isinstance(v, Tensor)), None)
    return torch.stack(
        [torch.as_tensor(v, dtype=torch.float64, device=device).detach() for v in values]
    )


def read_stats(stats: dict[str, list[Tensor]], cancel: dict[str, Tensor]):
    """All of an update's statistics to Python floats in one transfer."""
    if not any(stats.values()) and not cancel:
        return {k: [] for k in stats}, {}
    flat = stack_stats(stats, cancel).tolist()
    out, pos = {}, 0
    for key, vs in stats.items():
        out[key], pos = flat[pos : pos + len(vs)], pos + len(vs)
    return out, dict(zip(cancel, flat[pos:]))


def update_policy(
    model, optimizer, scheduler, accelerator, batch: ScoredBatch, cfg, objective
) -> UpdateResult:
    """Steps 5-8 on a scored batch: frozen log-probs, micro-batched backward, optimizer steps."""
    t0 = time.perf_counter()
    ro, tr, G = cfg.rollout, cfg.train, cfg.rollout.group_size
    mbs = micro_batches(batch.rollout, G, tr.micro_batch_groups, tr.micro_batch_tokens)
    # Every process runs as many forwards and backwards: DDP syncs buffers in each forward and
    # FSDP gathers weights in each. One with fewer micro-batches (dynamic sampling, token caps)
    # repeats its last one, with zero weight.
    n = agreed_count(accelerator, len(mbs))
    chunk, temp = tr.logprob_chunk_tokens, ro.temperature
    old = None  # 5. frozen log-probs, only when they matter
    if tr.updates_per_rollout > 1:
        old = frozen_logprobs(model, mbs, chunk, temp, reference=False, count=n)
    ref = None
    if objective.kl_coef > 0 or tr.log_reference_kl:
        ref = frozen_logprobs(model, mbs, chunk, temp, reference=True, count=n)
    t_frozen = time.perf_counter() - t0
    norm = global_normaliser(accelerator, objective, mbs, ro.max_new_tokens)
    stats: dict[str, list[Tensor]] = {}
    cancel: dict[str, Tensor] = {}
    model.train()
    skipped, updates, grad_norm = False, 0, 0.0
    for _ in range(tr.updates_per_rollout):  # 6-7. micro-batches, then one optimizer step
        losses, updates = [], updates + 1
        for k in range(n):
            i = min(k, len(mbs) - 1)
            mb = mbs[i]
            frozen = [None if f is None else f[i] for f in (old, ref)]
            with nullcontext() if k == n - 1 else accelerator.no_sync(model):
                loss, info, c, a = micro_batch_loss(model, mb, batch, *frozen, norm, cfg, objective)
                accelerator.backward(loss if k == i else loss * 0.0)
            if k != i:  # a repeat: no stats
                continue
            for key, v in cancellation_residual(c, a, mb.tokens, G).items():
                cancel[key] = cancel[key] + v if key in cancel else v
            info["loss"] = loss.detach()
            losses.append(info["loss"])
            for key, v in info.items():
                stats.setdefault(key, []).append(v)
        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), tr.max_grad_norm))
        if not update_is_finite(accelerator, losses, grad_norm):
            # one NaN/inf update would poison the adapter and the optimizer moments for good:
            # drop it (no optimizer or scheduler step); train() counts such steps
            optimizer.zero_grad(set_to_none=True)
            skipped = True
            break
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    values, sums = read_stats(stats, cancel)
    return UpdateResult(values, sums, grad_norm, updates, skipped, t_frozen)
