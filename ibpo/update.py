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

Not here: generation, rewards and advantages (scoring.py), the math of objectives (objectives.py).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch

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


def update_is_finite(accelerator, losses: list[float], grad_norm) -> bool:
    """One verdict for all processes: every micro-batch loss and the gradient norm are finite."""
    bad = float(not all(math.isfinite(x) for x in [*losses, float(grad_norm)]))
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(torch.tensor([bad], device=accelerator.device), "sum").item()
    return bad == 0


def global_normaliser(accelerator, objective, mbs: list[MicroBatch], max_new_tokens: int):
    """The step's Z, such that the gradient averaged by DDP over processes equals one process's
    gradient on all their rows: each process divides by the mean of the processes' Z."""
    z = step_normaliser(objective.aggregation, [mb.completion_mask for mb in mbs], max_new_tokens)
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
        info["kl"] = ((kl * mask).sum() / mask.sum().clamp_min(1)).item()
        if objective.kl_coef > 0:
            per_token = per_token + objective.kl_coef * kl
    loss = aggregate(per_token, mask, objective.aggregation, norm)
    info["entropy"] = ((ent * mask).sum() / mask.sum().clamp_min(1)).item()
    return loss, info, coef * token_weights(mask, objective.aggregation), a


def update_policy(model, optimizer, scheduler, accelerator, batch: ScoredBatch, cfg, objective):
    """Steps 5-8 on a scored batch: frozen log-probs, micro-batched backward, optimizer steps.

    Returns (per-micro-batch stats, cancellation sums, grad norm, updates made, skipped,
    seconds spent on frozen log-probs)."""
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
    stats: dict[str, list[float]] = {}
    cancel: dict[str, float] = {}
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
            for key, v in cancellation_residual(c, a, mb.completion_ids, mb.completion_mask,
                                                G).items():  # fmt: skip
                cancel[key] = cancel.get(key, 0.0) + v
            info["loss"] = loss.item()
            losses.append(info["loss"])
            for key, v in info.items():
                stats.setdefault(key, []).append(v)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), tr.max_grad_norm)
        if not update_is_finite(accelerator, losses, grad_norm):
            # one NaN/inf update would poison the adapter and the optimizer moments for good:
            # drop it (no optimizer or scheduler step); train() counts such steps
            optimizer.zero_grad(set_to_none=True)
            skipped = True
            break
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return stats, cancel, float(grad_norm), updates, skipped, t_frozen
