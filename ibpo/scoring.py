"""From prompts to a scored batch: rollout -> rewards -> (IBPO repairs) -> token advantages.

One round samples G completions for each of B prompts, grades them with the training grader and,
when counterfactual repairs are on (IBPO.md Part 2), repairs the incorrect ones to get phi and the
token edit masks. With DAPO's dynamic sampling, groups whose shaped rewards are all equal (they
carry no gradient) are dropped and the batch is refilled from the stream, for at most
`max_resample_rounds` extra rounds; if every group was dropped the last round is kept as is
(its advantages are zero), so a step never fails for lack of signal.

Device contract: the rollout's tensors stay on its device (the GPU); rewards, shaped rewards,
phi and edit masks are host (CPU) tensors, since they come from graders and host token lists.
Nothing here reads a value from the device (counts and lengths come from the rollout's host
copies), and `assemble_batch` is the one place host tensors move to the rollout's device:
tests/test_device_contract.py runs this module on a stand-in device to hold it to that.

Not here: log-probs, the loss, or the optimizer (trainer.py).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ibpo.advantages import (
    flat_groups,
    group_advantages,
    overlong_penalty,
    shape_rewards,
    token_advantages,
)
from ibpo.config import Config
from ibpo.data import PromptStream, render_prompt
from ibpo.objectives import ResolvedObjective
from ibpo.repair import run_repairs
from ibpo.rewards.math import as_graded
from ibpo.rollout import Generator, Rollout, concat_rollouts


@dataclass
class ScoredBatch:
    rollout: Rollout  # N = B' * G sequences (B' <= B with dynamic sampling)
    rewards: Tensor  # [B', G] grader rewards
    seq_adv: Tensor  # [N] sequence advantages (from shaped rewards)
    adv: Tensor  # [N, T] token advantages (edit masks applied)
    stats: dict[str, float] = field(default_factory=dict)


def repairs_enabled(cfg: Config, objective: ResolvedObjective) -> bool:
    return objective.counterfactual if cfg.repair.enabled is None else cfg.repair.enabled


def _score_round(generator: Generator, tokenizer, examples, cfg: Config, repairing: bool,
                 reward_fn, rng):  # fmt: skip
    """One round: returns (rollout, rewards [B, G], shaped [B, G], edited [N, T] | None, stats)."""
    ro, G = cfg.rollout, cfg.rollout.group_size
    t0 = time.perf_counter()
    prompts = [render_prompt(tokenizer, ex.question, cfg.data) for ex in examples]
    rollout = generator(
        tokenizer, prompts, G, ro.max_new_tokens, ro.generation_batch_size,
        temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
    )  # fmt: skip
    t1 = time.perf_counter()
    answers = [ex.answer for ex in examples]
    flat = [reward_fn(as_graded(prompts[n // G], t), answers[n // G])
            for n, t in enumerate(rollout.texts)]  # fmt: skip
    rewards = torch.tensor(flat, dtype=torch.float32, device="cpu").view(len(examples), G)
    stats = {"time_generate": t1 - t0, "generated_tokens": float(sum(rollout.lengths))}
    if not repairing:
        return rollout, rewards, rewards, None, stats
    rep = cfg.repair
    gen = {
        "max_new_tokens": rep.max_new_tokens or ro.max_new_tokens,
        "batch_size": rep.batch_size or ro.generation_batch_size,
        "temperature": rep.temperature or ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,
    }
    out = run_repairs(generator, tokenizer, [ex.question for ex in examples], rollout, rewards,
                      answers, reward_fn, rep, cfg.data, gen, rng)  # fmt: skip
    shaped = shape_rewards(rewards, out.phi, rep.shaping_lambda, rewards >= 1.0)
    stats.update(out.stats)
    stats["time_repair"] = time.perf_counter() - t1
    stats["generated_tokens"] += out.stats["repair_tokens"]
    return rollout, rewards, shaped, out.edited, stats


def _add(total: dict[str, float], part: dict[str, float]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v


def collect_batch(
    generator: Generator, tokenizer, stream: PromptStream, cfg: Config,
    objective: ResolvedObjective, reward_fn, rng: random.Random,
) -> ScoredBatch:  # fmt: skip
    G, B = cfg.rollout.group_size, cfg.train.prompts_per_step
    repairing = repairs_enabled(cfg, objective)
    pad = tokenizer.pad_token_id
    kept: list[tuple[Rollout, Tensor, Tensor, Tensor | None]] = []
    sampled: list[Tensor] = []
    stats: dict[str, float] = {}
    need, dropped, rounds = B, 0, 0
    while True:
        rollout, rewards, shaped, edited, st = _score_round(
            generator, tokenizer, stream.take(need), cfg, repairing, reward_fn, rng
        )
        _add(stats, st)
        sampled.append(rewards)
        live = (~flat_groups(shaped)).tolist()
        groups = [b for b, ok in enumerate(live) if ok] if cfg.rollout.dynamic_sampling else []
        if not cfg.rollout.dynamic_sampling:
            groups = list(range(len(live)))
        dropped += len(live) - len(groups)
        last = (rollout, rewards, shaped, edited)
        if groups:
            rows = [b * G + i for b in groups for i in range(G)]
            sub_edit = None if edited is None else edited[rows]
            kept.append((rollout.select(rows), rewards[groups], shaped[groups], sub_edit))
            need -= len(groups)
        if need == 0 or rounds == cfg.rollout.max_resample_rounds:
            break
        rounds += 1
    no_signal = not kept
    if no_signal:  # nothing had signal: train on the last round as is (zero advantages)
        kept = [last]
    batch = assemble_batch(kept, objective, cfg.rollout.max_new_tokens, cfg.repair.unchanged_weight,
                           pad, no_signal)  # fmt: skip
    all_rewards = torch.cat(sampled)
    stats.update(
        sampled_reward=all_rewards.mean().item(),
        sampled_accuracy=(all_rewards >= 1.0).float().mean().item(),
        sampled_zero_variance_groups=flat_groups(all_rewards).float().mean().item(),
        dropped_groups=float(dropped),
        resample_rounds=float(rounds),
    )
    batch.stats.update(stats)
    return batch


def assemble_batch(
    kept: list[tuple[Rollout, Tensor, Tensor, Tensor | None]], objective: ResolvedObjective,
    max_new_tokens: int, unchanged_weight: float, pad: int, no_signal: bool = False,
) -> ScoredBatch:  # fmt: skip
    """The kept rounds (rollout on its device; rewards, shaped rewards [B', G] and edit masks
    [N', T'] on the host) -> one scored batch whose advantages live on the rollout's device."""
    rollout = concat_rollouts([k[0] for k in kept], pad) if len(kept) > 1 else kept[0][0]
    rewards = torch.cat([k[1] for k in kept])
    shaped = torch.cat([k[2] for k in kept])
    edited = _join_edits([k[3] for k in kept], rollout.completion_mask.shape[1])
    # DAPO's length penalty joins the rewards the advantages see, after dynamic sampling (which
    # judges the task's rewards, as DAPO filters on accuracy) and after repairs (graded on R)
    lengths = torch.tensor(rollout.lengths, device="cpu").view_as(shaped)
    long = overlong_penalty(lengths, max_new_tokens, objective.overlong_buffer,
                            objective.overlong_penalty)  # fmt: skip
    if no_signal:  # dynamic sampling found no task signal: no length-only update either
        long = torch.zeros_like(long)
    # host -> device, here only: the sequence advantages and the edit masks
    device = rollout.input_ids.device
    seq_adv = group_advantages(shaped + long, objective.scale_rewards).flatten().to(device)
    if edited is not None:
        edited = edited.to(device)
    adv = token_advantages(seq_adv, rollout.completion_mask, edited, unchanged_weight)
    stats = {"overlong_penalty": long.mean().item()}
    return ScoredBatch(rollout, rewards, seq_adv, adv, stats)


def _join_edits(parts: list[Tensor | None], width: int) -> Tensor | None:
    """Host edit masks of several rounds, right-padded with True (blame) to one width."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("every round of a step has edit masks, or none has")
    pad = torch.nn.functional.pad
    return torch.cat([pad(p, (0, width - p.shape[1]), value=True) for p in parts])
