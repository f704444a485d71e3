"""A step's logged metrics, collected: what each stage of step.py logs, summed and averaged
into the figures of one metrics.jsonl row.

What is here: a round's rollout statistics (tokens, tool calls, decode slots) and its rows of
the completions table; `RoundsLog`, which sums what a step's generation rounds logged and
summarises the rewards of every sampled completion (TRL's names among ours); `UpdateLog`, an
update's 0-dim statistics per micro-batch, read from the device in one transfer;
`step_metrics`, the step's figures from its scored batch and its update (per-micro-batch
rates weighted so that they do not depend on how the step was split); timings and memory.

Everything here reads host values, except `read_stats`, the update's one read of the device.
Not here: computing what is logged (the rollout, the gradings, repairs, the objective's
statistics), the repair spending rule's figures (repair_budget.py) beyond the cost share it
defines, or gathering over processes (distributed.gather_metrics).
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ibpo.algo.advantages import flat_groups
from ibpo.generation import Rollout
from ibpo.repair_budget import repair_cost_share
from ibpo.rewards.functions import Grades, logged_metrics, reward_stats

# --- generation rounds ----------------------------------------------------------------------------


def rollout_stats(rollout: Rollout) -> dict[str, float]:
    """A round's rollout, counted on the host: tokens generated; with tools the calls made, the
    calls that failed and the tool turns' tokens; the prompt tokens the model ran; the decode
    slots (where the backend reports them)."""
    stats = {"generated_tokens": float(sum(rollout.lengths))}
    if rollout.tool_traces is not None:  # per step: calls made, calls that failed
        stats["tool_calls"] = float(sum(t.calls for t in rollout.tool_traces))
        stats["tool_errors"] = float(sum(t.errors for t in rollout.tool_traces))
        stats["tool_tokens"] = stats["generated_tokens"] - sum(rollout.host_policy_lengths())
    # the rollout's prompt tokens the model ran (a prompt the backend runs once for its G
    # samples counts once; the prompts' tokens where it does not say): compute, with the decode
    stats["rollout_prefill_tokens"] = float(
        sum(rollout.host_prompt_lengths())
        if rollout.prefill_tokens is None
        else rollout.prefill_tokens
    )
    if rollout.decode_slots:  # the share of decoding spent on rows that had ended
        stats["decode_slot_steps"] = float(rollout.decode_slots)
        # the tokens decoded: a tool turn's are appended, not decoded
        stats["decode_slot_tokens"] = float(sum(rollout.host_policy_lengths()))
    return stats


def completion_rows(examples, texts, grades: Grades) -> list[dict]:
    """The completions table's rows of one round (host values): the prompt as the dataset
    gives it, the completion, its weighted reward and each function's value (NaN: None), and
    the columns the functions logged with log_extra."""
    per, extra = grades.per_function, grades.extra
    rows = []
    for i, (ex, text, total) in enumerate(zip(examples, texts, grades.totals)):
        if ex.messages is not None:
            prompt = [dict(m) for m in ex.messages]
        else:
            prompt = ex.question if ex.given is None else ex.given
        row = {"prompt": prompt, "completion": text, "reward": total}
        row["rewards"] = {name: values[i] for name, values in per.items()}
        if extra:
            row["extra"] = {col: values[i] for col, values in extra.items()}
        rows.append(row)
    return rows


def reward_summary(rewards: Tensor, correct: float) -> tuple[float, float, float]:
    """Host rewards -> (mean, share >= `correct`: accuracy, share that is NaN: no reward
    applied); the first two over the completions a reward applied to (NaN: none did)."""
    scored = ~rewards.isnan()
    n = scored.sum().item()
    if n == 0:
        return math.nan, math.nan, 1.0
    mean = rewards[scored].mean().item()
    return mean, (rewards[scored] >= correct).sum().item() / n, 1.0 - n / rewards.numel()


@dataclass
class RoundsLog:
    """What a step's generation rounds logged (step.Round), over all of them: their statistics
    summed, each reward function's values, the completions table, the gradings and each
    round's rewards [B, G]."""

    stats: dict[str, float] = field(default_factory=dict)
    per_function: dict[str, list[float]] = field(default_factory=dict)
    table: list[dict] = field(default_factory=list)
    gradings: list[Grades] = field(default_factory=list)
    sampled: list[Tensor] = field(default_factory=list)

    def add(self, r) -> None:
        for k, v in r.stats.items():
            self.stats[k] = self.stats.get(k, 0.0) + v
        for name, values in r.per_function.items():
            self.per_function.setdefault(name, []).extend(values)
        self.table.extend(r.table)
        self.gradings.extend(r.gradings)
        self.sampled.append(r.rewards)

    def summary(self, dropped: int, rounds: int, correct: float, repairs: bool) -> dict:
        """The summed statistics and, over every sampled completion, the rewards' mean,
        accuracy and flat groups; dynamic sampling's dropped groups and extra rounds; the
        repairs' share of the step's tokens (`repairs`: the step repairs)."""
        stats = self.stats
        all_rewards = torch.cat(self.sampled)
        reward, accuracy, _ = reward_summary(all_rewards, correct)
        stats.update(
            sampled_reward=reward,
            sampled_accuracy=accuracy,
            sampled_zero_variance_groups=flat_groups(all_rewards).float().mean().item(),
            dropped_groups=float(dropped),
            resample_rounds=float(rounds),
        )
        if repairs:  # the repairs' share of the tokens the step ran (prompt + decode)
            stats["repair_cost_share"] = repair_cost_share(stats)
        # TRL's names, over every sampled completion: rewards/<name>/mean and /std (and ours,
        # rewards/<name>), the weighted rewards' std and the share of completions whose group's
        # rewards are all equal (groups are of one size: the share of such groups)
        stats.update(reward_stats(self.per_function))
        scored = all_rewards[~all_rewards.isnan()]
        stats["reward_std"] = scored.std().item() if scored.numel() > 1 else math.nan
        stats["frac_reward_zero_std"] = stats["sampled_zero_variance_groups"]
        return stats

    def completions(self, kept_tables: list[list[dict]], advantages: list[float], G: int):
        """The step's completions table: every sampled completion with its group, the trained
        ones (`kept_tables`, in batch order) with their sequence advantage."""
        for i, row in enumerate(self.table):
            row["group"] = i // G
        for row, a in zip((row for t in kept_tables for row in t), advantages):
            row["advantage"] = a
        return self.table


# --- the update ----------------------------------------------------------------------------------


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


@dataclass
class UpdateLog:
    """An update's statistics as they accrue, on the device: per micro-batch (with what each
    averages over: its trained tokens and groups) and the cancellation diagnostic's sums."""

    stats: dict[str, list] = field(default_factory=dict)
    cancel: dict[str, Tensor] = field(default_factory=dict)

    def add(self, info: dict, cancel: dict[str, Tensor], mb, G: int) -> None:
        """One micro-batch's (batching.MicroBatch) statistics and cancellation terms."""
        for key, v in cancel.items():
            self.cancel[key] = self.cancel[key] + v if key in self.cancel else v
        # what each statistic averages over, for the step's weighted means (step_metrics)
        info["trained_tokens"] = float(sum(len(t) for t in mb.tokens))
        info["groups"] = float(len(mb.tokens) // G)
        for key, v in info.items():
            self.stats.setdefault(key, []).append(v)

    def read(self) -> tuple[dict[str, list[float]], dict[str, float]]:
        """Everything to Python floats, in one transfer (read_stats)."""
        return read_stats(self.stats, self.cancel)


# --- the step ------------------------------------------------------------------------------------

# Per-micro-batch statistics that are rates over groups; maxima; the others are rates over
# tokens. The mismatch statistics exist for the first update's micro-batches only, which come
# first in every list (their weights are the first ones).
PER_GROUP = frozenset({"weight_mean"})
PER_MAX = frozenset({"mismatch_abs_max", "mismatch_worst_sequence"})


def step_metrics(batch, upd, lr: float, correct: float = 1.0) -> dict[str, float]:
    """A step's metrics from its scored batch (step.ScoredBatch, host values) and its update's
    statistics (step.UpdateResult, already read from the device): this reads nothing from the
    device itself. A per-micro-batch rate is averaged with its micro-batch's weight (trained
    tokens; groups for PER_GROUP), so the figure does not depend on how the step was split
    into micro-batches. Then what the step's reward functions logged, under their own names."""
    rollout, rewards = batch.rollout, batch.rewards
    n_tokens = sum(rollout.lengths)
    cancel, truncated = upd.cancel, rollout.host_truncated()
    metrics = update_metrics(upd.stats)
    metrics["loss"] = sum(upd.stats["loss"]) / upd.updates  # the step's loss, not a mean
    metrics.update(batch.stats)
    if metrics.get("decode_slot_steps"):
        metrics["decode_idle_share"] = (
            1 - metrics["decode_slot_tokens"] / metrics["decode_slot_steps"]
        )
    reward, accuracy, unscored = reward_summary(rewards, correct)
    metrics.update(
        reward=reward,
        accuracy=accuracy,  # weighted reward >= reward.correct_threshold
        unscored=unscored,  # no reward function applied: no advantage
        zero_variance_groups=flat_groups(rewards).float().mean().item(),
        residual=cancel["residual_num"] / max(cancel["residual_den"], 1e-30),
        shared_token_fraction=cancel["shared_tokens"] / max(cancel["tokens"], 1.0),
        completion_length=n_tokens / rollout.num_sequences,
        trained_tokens=float(sum(rollout.host_policy_lengths())),  # a tool turn's are not
        trained_sequences=float(rollout.num_sequences),
        truncated=sum(truncated) / len(truncated),
        # TRL's names for two of these
        **{
            "completions/mean_length": n_tokens / rollout.num_sequences,
            "completions/clipped_ratio": sum(truncated) / len(truncated),
        },
        grad_norm=upd.grad_norm,
        skipped_nonfinite=float(upd.skipped),
        # what the step's gradings reported: graders' own failures (scored 0), calls out of time
        grader_errors=float(sum(len(g.failures) for g in batch.gradings)),
        reward_timeouts=float(sum(g.timeouts for g in batch.gradings)),
        lr=lr,
    )
    for key, value in logged_metrics(batch.gradings).items():  # ours keep their names
        metrics.setdefault(key, value)
    return metrics


def update_metrics(per_micro_batch: dict[str, list[float]]) -> dict[str, float]:
    """The update's per-micro-batch statistics, each one figure: a maximum (PER_MAX) or a mean
    weighted by the micro-batches' trained tokens (groups for PER_GROUP)."""
    stats = dict(per_micro_batch)
    weights = {"tokens": stats.pop("trained_tokens"), "groups": stats.pop("groups")}
    metrics = {}
    for key, values in stats.items():
        if key in PER_MAX:
            metrics[key] = max(values)
            continue
        w = weights["groups" if key in PER_GROUP else "tokens"][: len(values)]
        metrics[key] = sum(v * x for v, x in zip(values, w)) / max(sum(w), 1.0)
    return metrics


def time_metrics(t0: float, t_gen: float, t_end: float, t_frozen: float, tokens: int) -> dict:
    """Where a step's time went (perf_counter marks: start, generation done, end; `t_frozen`:
    seconds on old/reference log-probs) and its throughput over `tokens` generated."""
    return {
        "time_rollout": t_gen - t0,
        "time_frozen_logprobs": t_frozen,
        "time_update": t_end - t_gen - t_frozen,
        "step_time": t_end - t0,
        "tokens_per_second": tokens / (t_end - t0),
    }


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak-memory window (CUDA); on CPU the process's peak RSS cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """peak_memory_gb: on CUDA torch's allocator peak during this step (since
    reset_peak_memory); device_memory_used_gb: the GPU's memory in use at the step's end as the
    driver reports it, which also counts what torch does not allocate (a vLLM engine's weights
    and KV cache, the CUDA context, other processes). On CPU the process's peak RSS since start."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "device_memory_used_gb": (total - free) / 2**30,
        }
    return {"peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
