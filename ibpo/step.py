"""One RL step, read top to bottom: `rl_step` and the stages it runs, in data-flow order.

A step (B prompts per process, G completions each, N = B * G sequences, T completion tokens):
  1. prompts: B from this process's shard of the stream;
  2. rollout: G sampled completions per prompt (eval mode, KV cache, no grad), by the policy's
     generate() or a vLLM engine;
  3. rewards [B, G]: each completion graded by the run's reward functions, which evaluation
     and repairs use too (rewards/functions.py), each one's mean logged as rewards/<name>; NaN
     where none applies (no advantage), correct and failed by the set's thresholds;
  4. (IBPO) repairs: each failed completion repaired locally given a sibling, the repairs
     graded -> phi and edit masks; shaped rewards R' = R + lambda * phi (repair.py). With
     dynamic sampling, groups whose shaped rewards are all equal are dropped and refilled;
  5. advantages: group-centred (std-scaled when the objective says so), DAPO's length penalty
     where on, broadcast to tokens [N, T] with the edit masks applied (algo/advantages.py);
  6. old and reference log-probs, detached: old only when a rollout is reused
     (updates_per_rollout > 1), reference only when kl_coef > 0 or the KL is logged (the same
     model, adapter disabled);
  7. micro-batches of whole groups: log-probs with grad -> objective -> backward, each loss
     divided by a normaliser from the whole step and all processes (algo/objectives.py);
  8. clip, then the optimizer and scheduler step, unless a loss or the gradient is not finite;
  9. metrics, gathered over processes (with what the gradings reported: the graders' own
     failures as grader_errors, calls out of time as reward_timeouts, what reward functions
     logged).
Stages hand each other small dataclasses: `Round` (one generation round), `ScoredBatch` (what
the update trains on), `UpdateResult` (what the update did).

Device contract: a rollout's tensors stay on its device and it carries host copies of its
tokens and lengths; rewards, phi, shaped rewards and edit masks are host (CPU) tensors;
`assemble_batch` is the one place they move to the device. Update statistics stay on the device
and are read once per update. No stage between rollout and loss reads a device value
(tests/test_device_contract.py runs them on a stand-in device to hold them to it).

With several processes (Accelerate DDP or FSDP2) each one generates, grades, repairs and
normalises its own groups; every process runs as many forwards and backwards (DDP syncs buffers
and FSDP gathers weights in each), a process with fewer micro-batches repeating its last one
with zero weight. Under FSDP generation runs on gathered weights (distributed.gathered).

Not here: the run around the step (trainer.py: output dir, resume, signals, evaluation,
checkpoints, summary), the math (algo/: objectives, advantages, counterfactual, cancellation,
mismatch), model loading.
"""

from __future__ import annotations

import logging
import math
import random
import resource
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ibpo.algo.advantages import (
    flat_groups,
    group_advantages,
    lifted_blame_fraction,
    overlong_penalty,
    shape_rewards,
    token_advantages,
)
from ibpo.algo.cancellation import cancellation_residual
from ibpo.algo.mismatch import mismatch_stats
from ibpo.algo.objectives import (
    ResolvedObjective,
    aggregate,
    importance_ratio,
    importance_weights,
    step_normaliser,
    token_weights,
)
from ibpo.algo.spending import (
    PROBE,
    SpendingState,
    allowance,
    cost_share,
    decide,
    observe,
    running_success,
)
from ibpo.batching import MicroBatch, micro_batches
from ibpo.config import Config, ConfigError
from ibpo.data import PromptStream, RowStream, render_example
from ibpo.distributed import agreed_count, gather_metrics, gathered, summed
from ibpo.generation import (
    Generator,
    Rollout,
    SamplingStreams,
    concat_rollouts,
    decode_engine,
    hf_generator,
)
from ibpo.generation.multiturn import ToolRollouts, tool_columns
from ibpo.logprobs import completion_logprobs
from ibpo.modeling import (
    dequantized_base,
    offloaded_activations,
    reference_mode,
    use_dequantized_base,
)
from ibpo.repair import run_repairs
from ibpo.rewards.functions import (
    Grades,
    RewardSet,
    grade_completions,
    logged_metrics,
    reward_stats,
    run_reward_set,
)
from ibpo.sizes import CHUNK_TOKENS

log = logging.getLogger(__name__)

# --- what the stages hand each other ------------------------------------------------------------


@dataclass
class StepParts:
    """What a step changes besides the run's counters: the policy, optimizer and scheduler
    (prepared by Accelerate), this process's prompt stream, the repair planner's rng and the
    repair spending rule's state (the same on every process). Checkpoints save and restore
    exactly these (run/checkpoint.py)."""

    model: Any
    optimizer: Any
    scheduler: Any
    stream: PromptStream | RowStream
    rng: random.Random
    spending: SpendingState = field(default_factory=SpendingState)


@dataclass
class Round:
    """One generation round: its rollout (on the device) and, on the host, rewards and shaped
    rewards [B, G] and the edit masks [N, T] (None when repairs are off); each reward
    function's values (NaN: did not apply), for its logged mean; the round's gradings
    (rollout, repairs), for what they reported."""

    rollout: Rollout
    rewards: Tensor
    shaped: Tensor
    edited: Tensor | None
    stats: dict[str, float] = field(default_factory=dict)
    per_function: dict[str, list[float]] = field(default_factory=dict)
    table: list[dict] = field(default_factory=list)  # one row per completion (completion_rows)
    gradings: list[Grades] = field(default_factory=list)

    def select(self, groups: list[int], group_size: int) -> Round:
        rows = [b * group_size + i for b in groups for i in range(group_size)]
        edited = None if self.edited is None else self.edited[rows]
        table = [self.table[i] for i in rows] if self.table else []
        return Round(
            self.rollout.select(rows),
            self.rewards[groups],
            self.shaped[groups],
            edited,
            table=table,
        )


@dataclass
class ScoredBatch:
    rollout: Rollout  # N = B' * G sequences (B' <= B with dynamic sampling)
    rewards: Tensor  # [B', G] grader rewards
    seq_adv: Tensor  # [N] sequence advantages (from shaped rewards)
    adv: Tensor  # [N, T] token advantages (edit masks applied)
    stats: dict[str, float] = field(default_factory=dict)
    host_adv: list[float] = field(default_factory=list)  # seq_adv, read from the host copy
    # every sampled completion of the step (the trained ones with their advantage): the run
    # folder's completions table
    table: list[dict] = field(default_factory=list)
    gradings: list[Grades] = field(default_factory=list)  # every grading of the step


@dataclass
class UpdateResult:
    """What one step's update did (update_policy), read from the device once."""

    stats: dict[str, list[float]]  # per micro-batch: loss, entropy, kl, clip/gate fractions...
    cancel: dict[str, float]  # the cancellation diagnostic's sums over micro-batches
    grad_norm: float  # of the last update (before clipping)
    updates: int  # optimizer updates attempted (updates_per_rollout, fewer when one was skipped)
    skipped: bool  # an update was dropped because a loss or the gradient was not finite
    time_frozen: float  # seconds spent on old/reference log-probs


# --- the step ------------------------------------------------------------------------------------


def rl_step(
    parts: StepParts,
    tokenizer,
    accelerator,
    cfg: Config,
    objective: ResolvedObjective,
    engine=None,
    *,
    step: int,
    reward_fns: RewardSet | None = None,
    table: list[dict] | None = None,
    tools: dict | None = None,
) -> dict[str, float]:
    """One full RL step; returns its metrics (gathered over processes). `engine`: the vLLM
    engine that generates (rollout.backend=vllm), else the policy does. `step`: the steps done
    before this one, which seeds this step's sampling streams (generation.SamplingStreams).
    `reward_fns`: the run's reward functions (rewards/functions.py; None: reward.functions's);
    the metrics they logged (log_metric) join the step's. `table`: this process's completions
    of the step are appended to it (ScoredBatch.table). `tools`: the run's tools by name
    (tools.resolve_tools; None or empty: rollouts without tool calls)."""
    model, device = parts.model, accelerator.device
    if reward_fns is None:
        reward_fns = run_reward_set(cfg.reward)
    streams = SamplingStreams(device, cfg.train.seed, accelerator.process_index, step)
    t0 = time.perf_counter()
    reset_peak_memory(device)
    # (IBPO) this step's repair spending, from what earlier steps' repairs returned: the same
    # state, hence the same decision, on every process
    rep = cfg.repair
    spending = None
    if repairs_enabled(cfg, objective):
        spending = (decide(parts.spending, rep.min_success, rep.probe_every), parts.spending)
    # 1-5. prompts, rollout, rewards, (IBPO) repairs, token advantages [N, T]: each process
    # scores and normalises the groups it generated
    with generating(model, cfg, device, engine, tools) as generator:
        batch = collect_batch(
            generator,
            tokenizer,
            parts.stream,
            cfg,
            objective,
            reward_fns,
            parts.rng,
            streams,
            spending,
        )
    if spending is not None:
        parts.spending = observe_repairs(accelerator, parts.spending, spending[0], batch.stats)
    t_gen = time.perf_counter()
    lr = parts.scheduler.get_last_lr()[0]  # the rate this step's (first) update uses
    # 6-8. old/reference log-probs, micro-batched backward, clip and optimizer step(s)
    fast = use_dequantized_base(cfg.model, device, model)  # CPU: dequantise the base once
    with dequantized_base(model) if fast else nullcontext():
        upd = update_policy(
            model, parts.optimizer, parts.scheduler, accelerator, batch, cfg, objective
        )
    t_end = time.perf_counter()
    # 9. metrics
    metrics = step_metrics(batch, upd, lr, reward_fns.correct)
    for key, value in logged_metrics(batch.gradings).items():  # ours keep their names
        metrics.setdefault(key, value)
    metrics.update(
        time_rollout=t_gen - t0,
        time_frozen_logprobs=upd.time_frozen,
        time_update=t_end - t_gen - upd.time_frozen,
        step_time=t_end - t0,
        tokens_per_second=sum(batch.rollout.lengths) / (t_end - t0),
        **memory_metrics(device),
    )
    if table is not None:
        table.extend(batch.table)
    return gather_metrics(accelerator, metrics)


# --- 1-5. prompts, rollout, rewards, repairs, advantages ----------------------------------------


@contextmanager
def generating(model, cfg: Config, device: torch.device, engine=None, tools=None):
    """A Generator (generation/rollout.py) for one generation phase: the vLLM engine serving the
    current adapter (rollout.backend=vllm), or the policy's own generate() - under FSDP on
    gathered weights, on CPU with a 4-bit base dequantised once and the adapter folded in -
    decoding with the package's engine where rollout.decode=graph (hf.decode_engine), or with
    `tools` (by name) multi-turn rollouts that call them (generation/multiturn.py)."""
    if engine is not None:
        with engine.serving(model) as generator:
            yield generator
        return
    fast = use_dequantized_base(cfg.model, device, model)
    with gathered(model):
        with dequantized_base(model, merge_lora=True) if fast else nullcontext():
            decoder = decode_engine(model, cfg.rollout.decode)
            try:
                if tools:
                    yield tool_rollouts(model, cfg, tools, decoder)
                else:
                    yield hf_generator(model, engine=decoder)
            finally:
                if decoder is not None:  # its cache is as large as the phase's: free it now
                    decoder.release()


def tool_rollouts(model, cfg: Config, tools: dict, decoder=None) -> ToolRollouts:
    """The multi-turn Generator of a run with tools: its limits from the rollout section,
    decoding each turn with `decoder` (the package's engine) where there is one."""
    ro, data = cfg.rollout, cfg.data
    chat = {} if data.enable_thinking is None else {"enable_thinking": data.enable_thinking}
    limits = (ro.max_tool_calls, ro.tool_workers, ro.tool_timeout)
    return ToolRollouts(model, tools, *limits, chat, engine=decoder)


# DAPO's dynamic sampling: extra rounds of rollouts that refill the groups it dropped
MAX_RESAMPLE_ROUNDS = 3

# what the spending rule learns from a step's repairs (algo/spending.observe), in its order
SPENDING_TOTALS = (
    "repairs",
    "repair_successes",
    "repair_prompt_tokens",
    "repair_prefill_tokens",
    "repair_decode_tokens",
)


def observe_repairs(accelerator, state: SpendingState, mode: str, stats: dict) -> SpendingState:
    """The spending rule's state after a step: fed the step's repair totals over all processes
    (one all-reduce), so that every process holds the same state. Logs the step's decision and
    the running success rate after it into `stats`."""
    totals = summed(accelerator, [stats.get(key, 0.0) for key in SPENDING_TOTALS])
    state = observe(state, mode, *totals)
    stats["repair_probe"] = float(mode == PROBE)
    rate = running_success(state)
    if rate is not None:
        stats["repair_running_success"] = rate
    return state


def repairs_enabled(cfg: Config, objective: ResolvedObjective) -> bool:
    """repair.enabled as recipe.resolve filled it from the objective's registration: read, not
    re-derived, so an unresolved config is refused rather than guessed. Off for rollouts that
    call tools (docs/tools.md: a repair would have to re-run the tools on a rewritten turn),
    said once."""
    if cfg.repair.enabled is None:
        raise ValueError(
            f"repair.enabled is unresolved for objective {objective.name!r}: build the config "
            "with ibpo.recipe.load_config or pass it through ibpo.recipe.resolve"
        )
    if cfg.repair.enabled and cfg.rollout.tools:
        if not _SAID_NO_REPAIRS:
            _SAID_NO_REPAIRS.append(True)
            log.warning(
                "ibpo: repairs are off for rollouts that call tools (rollout.tools); %s trains "
                "on the graded rollouts alone (docs/tools.md)",
                objective.name,
            )
        return False
    return cfg.repair.enabled


_SAID_NO_REPAIRS: list[bool] = []


def collect_batch(
    generator: Generator,
    tokenizer,
    stream: PromptStream | RowStream,
    cfg: Config,
    objective: ResolvedObjective,
    reward_fns: RewardSet,
    rng: random.Random,
    streams: SamplingStreams | None = None,
    spending: tuple[str, SpendingState] | None = None,
) -> ScoredBatch:
    """Rounds of rollout -> rewards -> (IBPO) repairs until B groups are kept, then one scored
    batch. With dynamic sampling, groups whose shaped rewards are all equal (no gradient) are
    dropped and the batch is refilled from the stream, for at most MAX_RESAMPLE_ROUNDS extra
    rounds; if every group was dropped the last round is kept as is (zero advantages), so a step
    never fails for lack of signal. `streams`: the step's sampling streams (None: the process's
    own, for callers that drive this stage alone). `spending`: the step's repair decision and
    the spending rule's state it came from (algo/spending.py; None: every planned repair
    runs)."""
    G, B = cfg.rollout.group_size, cfg.train.prompts_per_step
    repairing = repairs_enabled(cfg, objective)
    kept: list[Round] = []
    sampled: list[Tensor] = []
    stats: dict[str, float] = {}
    per_function: dict[str, list[float]] = {}
    table: list[dict] = []
    gradings: list[Grades] = []
    need, dropped, rounds = B, 0, 0
    while True:
        r = score_round(
            generator,
            tokenizer,
            stream.take(need),
            cfg,
            repairing,
            reward_fns,
            rng,
            streams,
            rounds,
            spending,
        )
        _add(stats, r.stats)
        for name, values in r.per_function.items():
            per_function.setdefault(name, []).extend(values)
        table.extend(r.table)
        gradings.extend(r.gradings)
        sampled.append(r.rewards)
        live = (~flat_groups(r.shaped)).tolist()
        if cfg.rollout.dynamic_sampling:
            groups = [b for b, ok in enumerate(live) if ok]
        else:
            groups = list(range(len(live)))
        dropped += len(live) - len(groups)
        last = r
        if groups:
            kept.append(r.select(groups, G))
            need -= len(groups)
        if need == 0 or rounds == MAX_RESAMPLE_ROUNDS:
            break
        rounds += 1
    no_signal = not kept
    if no_signal:  # nothing had signal: train on the last round as is (zero advantages)
        kept = [last]
    batch = assemble_batch(
        kept,
        objective,
        cfg.rollout.max_new_tokens,
        cfg.repair.unchanged_weight,
        tokenizer.pad_token_id,
        no_signal,
    )
    all_rewards = torch.cat(sampled)
    correct = 1.0 if reward_fns is None else reward_fns.correct  # None: rounds scored elsewhere
    reward, accuracy, _ = reward_summary(all_rewards, correct)
    stats.update(
        sampled_reward=reward,
        sampled_accuracy=accuracy,
        sampled_zero_variance_groups=flat_groups(all_rewards).float().mean().item(),
        dropped_groups=float(dropped),
        resample_rounds=float(rounds),
    )
    if repairing:  # the repairs' share of the tokens the step ran (prompt + decode)
        repair_decode = stats.get("repair_decode_tokens", 0.0)
        repair = stats.get("repair_prefill_tokens", 0.0) + repair_decode
        rollout = stats.get("rollout_prefill_tokens", 0.0) + stats["generated_tokens"]
        stats["repair_cost_share"] = cost_share(repair, rollout - repair_decode)
    # TRL's names, over every sampled completion: rewards/<name>/mean and /std (and ours,
    # rewards/<name>), the weighted rewards' std and the share of completions whose group's
    # rewards are all equal (groups are of one size: the share of such groups)
    stats.update(reward_stats(per_function))
    scored = all_rewards[~all_rewards.isnan()]
    stats["reward_std"] = scored.std().item() if scored.numel() > 1 else math.nan
    stats["frac_reward_zero_std"] = stats["sampled_zero_variance_groups"]
    batch.stats.update(stats)
    for i, row in enumerate(table):
        row["group"] = i // G
    for row, a in zip((row for k in kept for row in k.table), batch.host_adv):
        row["advantage"] = a
    batch.table = table
    batch.gradings = gradings
    return batch


def reward_summary(rewards: Tensor, correct: float) -> tuple[float, float, float]:
    """Host rewards -> (mean, share >= `correct`: accuracy, share that is NaN: no reward
    applied); the first two over the completions a reward applied to (NaN: none did)."""
    scored = ~rewards.isnan()
    n = scored.sum().item()
    if n == 0:
        return math.nan, math.nan, 1.0
    mean = rewards[scored].mean().item()
    return mean, (rewards[scored] >= correct).sum().item() / n, 1.0 - n / rewards.numel()


def score_round(
    generator: Generator,
    tokenizer,
    examples,
    cfg: Config,
    repairing: bool,
    reward_fns: RewardSet,
    rng: random.Random,
    streams: SamplingStreams | None = None,
    round_: int = 0,
    spending: tuple[str, SpendingState] | None = None,
) -> Round:
    """One round: generate G completions per example, grade them, and (IBPO) repair the failed
    ones, which shapes the rewards and gives the edit masks. The completions and the repairs
    draw from their own streams of the round (`streams`), so repairs never shift what a later
    round or step samples. `spending` (collect_batch) bounds what the repairs may cost: by the
    step's decision, a share of the tokens this round's rollout ran."""
    ro, G = cfg.rollout, cfg.rollout.group_size
    t0 = time.perf_counter()
    if isinstance(generator, ToolRollouts):  # the prompt describes the tools
        prompts = [generator.render(tokenizer, ex, cfg.data) for ex in examples]
    else:
        prompts = [render_example(tokenizer, ex, cfg.data) for ex in examples]
    with _stream(streams, "rollout", round_):
        rollout = generator(
            tokenizer,
            prompts,
            G,
            ro.max_new_tokens,
            ro.generation_batch_size,
            temperature=ro.temperature,
            top_p=ro.top_p,
        )
    t1 = time.perf_counter()
    each = [ex for ex in examples for _ in range(G)]
    grades = grade_completions(
        reward_fns,
        each,
        [p for p in prompts for _ in range(G)],
        rollout.texts,
        rollout.host_tokens(),
        tool_columns(rollout.tool_traces),
    )
    scores = torch.tensor(grades.totals, dtype=torch.float32, device="cpu").view(len(examples), G)
    table = completion_rows(each, rollout.texts, grades)
    stats = {"time_generate": t1 - t0, "generated_tokens": float(sum(rollout.lengths))}
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
    stats["time_rewards"] = time.perf_counter() - t1
    if not repairing:
        return Round(rollout, scores, scores, None, stats, grades.per_function, table, [grades])
    rep = cfg.repair
    gen = {
        "max_new_tokens": ro.max_new_tokens,
        "batch_size": rep.batch_size,
        "temperature": ro.temperature,
        "top_p": ro.top_p,
    }
    budget, state = math.inf, None
    if spending is not None:
        mode, state = spending
        rollout_tokens = stats["rollout_prefill_tokens"] + stats["generated_tokens"]
        budget = allowance(mode, rollout_tokens, rep.cost_share)
    with _stream(streams, "repair", round_):
        out = run_repairs(
            generator,
            tokenizer,
            examples,
            rollout,
            scores,
            reward_fns,
            rep,
            cfg.data,
            gen,
            rng,
            budget,
            state,
        )
    shaped = shape_rewards(scores, out.phi, rep.shaping_lambda, scores >= reward_fns.correct)
    stats.update(out.stats)
    stats["time_repair"] = time.perf_counter() - t1
    stats["generated_tokens"] += out.stats["repair_tokens"]
    for row, r in zip(table, shaped.flatten().tolist()):
        row["shaped_reward"] = r
    gradings = [grades] if out.grades is None else [grades, out.grades]
    return Round(rollout, scores, shaped, out.edited, stats, grades.per_function, table, gradings)


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


def _stream(streams: SamplingStreams | None, phase: str, round_: int):
    return nullcontext() if streams is None else streams(phase, round_)


def _add(total: dict[str, float], part: dict[str, float]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v


def assemble_batch(
    kept: list[Round],
    objective: ResolvedObjective,
    max_new_tokens: int,
    unchanged_weight: float,
    pad: int,
    no_signal: bool = False,
) -> ScoredBatch:
    """The kept rounds (rollout on its device; rewards, shaped rewards [B', G] and edit masks
    [N', T'] on the host) -> one scored batch whose advantages live on the rollout's device."""
    rollout = concat_rollouts([k.rollout for k in kept], pad) if len(kept) > 1 else kept[0].rollout
    rewards = torch.cat([k.rewards for k in kept])
    shaped = torch.cat([k.shaped for k in kept])
    edited = _join_edits([k.edited for k in kept], rollout.completion_mask.shape[1])
    # DAPO's length penalty joins the rewards the advantages see, after dynamic sampling (which
    # judges the task's rewards, as DAPO filters on accuracy) and after repairs (graded on R)
    lengths = torch.tensor(rollout.lengths, device="cpu").view_as(shaped)
    long = overlong_penalty(
        lengths, max_new_tokens, objective.overlong_buffer, objective.overlong_penalty
    )
    if no_signal:  # dynamic sampling found no task signal: no length-only update either
        long = torch.zeros_like(long)
    # host -> device, here only: the sequence advantages and the edit masks
    device = rollout.input_ids.device
    host_adv = group_advantages(shaped + long, objective.scale_rewards).flatten()
    stats = {"overlong_penalty": long.mean().item()}
    if edited is not None:  # how often the edit mask acts, from host copies (no device read)
        lengths = torch.tensor(rollout.lengths, device="cpu").unsqueeze(-1)
        host_mask = torch.arange(edited.shape[1], device="cpu") < lengths
        stats["lifted_blame_fraction"] = lifted_blame_fraction(host_adv, host_mask, edited).item()
        edited = edited.to(device)
    seq_adv = host_adv.to(device)
    adv = token_advantages(seq_adv, rollout.completion_mask, edited, unchanged_weight)
    return ScoredBatch(rollout, rewards, seq_adv, adv, stats, host_adv.tolist())


def _join_edits(parts: list[Tensor | None], width: int) -> Tensor | None:
    """Host edit masks of several rounds, right-padded with True (blame) to one width."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("every round of a step has edit masks, or none has")
    pad = torch.nn.functional.pad
    return torch.cat([pad(p, (0, width - p.shape[1]), value=True) for p in parts])


# --- 6-8. old/reference log-probs, micro-batched backward, clip and optimizer step -------------


def update_policy(
    model, optimizer, scheduler, accelerator, batch: ScoredBatch, cfg, objective
) -> UpdateResult:
    """Stages 6-8 on a scored batch: old/reference log-probs, micro-batched backward, clip and
    optimizer steps."""
    t0 = time.perf_counter()
    ro, tr, G = cfg.rollout, cfg.train, cfg.rollout.group_size
    mbs = micro_batches(batch.rollout, G, tr.micro_batch_groups)
    # Every process runs as many forwards and backwards: DDP syncs buffers in each forward and
    # FSDP gathers weights in each. One with fewer micro-batches (dynamic sampling)
    # repeats its last one, with zero weight.
    n = agreed_count(accelerator, len(mbs))
    chunk, temp = CHUNK_TOKENS, ro.temperature
    # 6. old and reference log-probs (detached), each only when it matters
    old = None
    if tr.updates_per_rollout > 1:
        old = frozen_logprobs(model, mbs, chunk, temp, reference=False, count=n)
    ref = None
    if objective.kl_coef > 0 or tr.log_reference_kl:
        ref = frozen_logprobs(model, mbs, chunk, temp, reference=True, count=n)
    t_frozen = time.perf_counter() - t0
    norm = global_normaliser(
        accelerator, objective, batch.rollout.host_policy_lengths(), ro.max_new_tokens
    )
    stats: dict[str, list[Tensor]] = {}
    cancel: dict[str, Tensor] = {}
    model.train()
    skipped, updates, grad_norm = False, 0, 0.0
    for u in range(tr.updates_per_rollout):  # 7-8. micro-batches, then clip and one step
        losses, updates = [], updates + 1
        for k in range(n):
            i = min(k, len(mbs) - 1)
            mb = mbs[i]
            with nullcontext() if k == n - 1 else accelerator.no_sync(model):
                loss, info, c, a = micro_batch_loss(
                    model,
                    mb,
                    batch,
                    old=None if old is None else old[i],
                    ref=None if ref is None else ref[i],
                    norm=norm,
                    cfg=cfg,
                    objective=objective,
                    first=u == 0,
                )
                accelerator.backward(loss if k == i else loss * 0.0)
            if k != i:  # a repeat: no stats
                continue
            for key, v in cancellation_residual(c, a, mb.tokens, G, mb.completion_mask).items():
                cancel[key] = cancel[key] + v if key in cancel else v
            info["loss"] = loss.detach()
            losses.append(info["loss"])
            # what each statistic averages over, for the step's weighted means (step_metrics)
            info["trained_tokens"] = float(sum(len(t) for t in mb.tokens))
            info["groups"] = float(len(mb.tokens) // G)
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


def sequence_logprobs(model, mb: MicroBatch, chunk: int, temperature: float):
    """Log-probs/entropies [n, t] of one micro-batch (already cut to its widths)."""
    return completion_logprobs(
        model,
        mb.input_ids,
        mb.attention_mask,
        mb.prompt_len,
        mb.completion_mask,
        chunk,
        temperature,
        mb.group_size,
    )


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


def global_normaliser(accelerator, objective, lengths: list[int], max_new_tokens: int):
    """The step's Z, such that the gradient averaged by DDP over processes equals one process's
    gradient on all their rows: each process divides by the mean of the processes' Z.
    `lengths`: each row's tokens the policy wrote (a tool turn's are not trained)."""
    z = step_normaliser(objective.aggregation, lengths, max_new_tokens)
    if accelerator.num_processes > 1:
        z = accelerator.reduce(torch.tensor([z], device=accelerator.device), "mean").item()
    return z


def micro_batch_loss(
    model, mb: MicroBatch, batch: ScoredBatch, *, old, ref, norm, cfg, objective, first=True
):
    """Log-probs with grad, the objective and the loss of one micro-batch (backward is the
    caller's); also its stats and the coefficients the cancellation diagnostic needs. `old`,
    `ref`: the micro-batch's old and reference log-probs [n, t] (None: not computed). On the
    first update after the rollout (`first`) the trainer's log-probs are compared with the
    rollout's behaviour log-probs (algo/mismatch.py): the frozen old ones when they were computed,
    else this forward's, so the check costs no forward of its own."""
    G = cfg.rollout.group_size
    with offloaded_activations(cfg.model.offload_activations):
        logp, ent = sequence_logprobs(model, mb, CHUNK_TOKENS, cfg.rollout.temperature)
    mask, a = mb.completion_mask, mb.take(batch.adv)
    trainer_logp = logp.detach() if old is None else old  # the policy before this step's update
    behaviour = None if batch.rollout.logprobs is None else mb.take(batch.rollout.logprobs)
    old_logp, rho, info = behaviour_policy(trainer_logp, behaviour, mask, objective)
    if first and behaviour is not None:
        info.update(mismatch_stats(trainer_logp, behaviour, mask))
    per_token, coef, stats = objective.surrogate(
        logp, old_logp, a, mask, mb.take(batch.seq_adv), G, rho=rho, **objective.kwargs
    )
    info.update(stats)
    if ref is not None:
        kl = objective.kl(logp, ref, old_logp)
        info["kl"] = ((kl * mask).sum() / mask.sum().clamp_min(1)).detach()
        if objective.kl_coef > 0:
            per_token = per_token + objective.kl_coef * kl
    loss = aggregate(per_token, mask, objective.aggregation, norm)
    info["entropy"] = (ent * mask).sum() / mask.sum().clamp_min(1)
    return loss, info, coef * token_weights(mask, objective.aggregation), a


def behaviour_policy(trainer_logp, behaviour, mask, objective):
    """(old_logp for the ratios, importance weights or None, their stats) under
    objective.behavior_policy and objective.importance_sampling (algo/objectives.py's doc)."""
    correcting = objective.behavior_policy == "rollout" or objective.importance_sampling != "none"
    if not correcting:
        return trainer_logp, None, {}
    if behaviour is None:
        raise ConfigError(
            "objective.behavior_policy=rollout and objective.importance_sampling need the "
            "rollout's log-probs, which this generation backend did not report: set "
            "objective.behavior_policy=trainer and objective.importance_sampling=none"
        )
    if objective.behavior_policy == "rollout":
        return behaviour, None, {}
    raw = importance_ratio(trainer_logp, behaviour, mask, objective.is_level)
    rho = importance_weights(raw, objective.importance_sampling, objective.is_cap)
    per_token, capped = (
        (x.unsqueeze(-1).expand_as(mask) if x.dim() == 1 else x).to(mask.dtype)
        for x in (rho, raw > objective.is_cap)
    )
    n = mask.sum().clamp_min(1)
    stats = {
        "is_weight_mean": ((per_token * mask).sum() / n).detach(),
        "is_capped_fraction": ((capped * mask).sum() / n).detach(),
    }
    return trainer_logp, rho, stats


def update_is_finite(accelerator, losses: list[Tensor], grad_norm: float) -> bool:
    """One verdict for all processes: every micro-batch loss (0-dim tensors on the device) and
    the gradient norm are finite. One read of the device per process."""
    finite = torch.stack([torch.isfinite(x) for x in losses]).all()
    bad = (~finite).float().reshape(1) + float(not math.isfinite(grad_norm))
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad.to(accelerator.device), "sum")
    return bad.item() == 0


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


# --- 9. metrics ----------------------------------------------------------------------------------


# Per-micro-batch statistics that are rates over groups; maxima; the others are rates over
# tokens. The mismatch statistics exist for the first update's micro-batches only, which come
# first in every list (their weights are the first ones).
PER_GROUP = frozenset({"weight_mean"})
PER_MAX = frozenset({"mismatch_abs_max", "mismatch_worst_sequence"})


def step_metrics(batch, upd, lr: float, correct: float = 1.0) -> dict[str, float]:
    """A step's metrics from its scored batch (host values) and its update's statistics (already
    read from the device): this reads nothing from the device itself. A per-micro-batch rate is
    averaged with its micro-batch's weight (trained tokens; groups for PER_GROUP), so the figure
    does not depend on how the step was split into micro-batches."""
    rollout, rewards = batch.rollout, batch.rewards
    n_tokens = sum(rollout.lengths)
    cancel, truncated = upd.cancel, rollout.host_truncated()
    stats = dict(upd.stats)
    weights = {"tokens": stats.pop("trained_tokens"), "groups": stats.pop("groups")}
    metrics = {}
    for key, values in stats.items():
        if key in PER_MAX:
            metrics[key] = max(values)
            continue
        w = weights["groups" if key in PER_GROUP else "tokens"][: len(values)]
        metrics[key] = sum(v * x for v, x in zip(values, w)) / max(sum(w), 1.0)
    metrics["loss"] = sum(stats["loss"]) / upd.updates  # the step's loss, not a mean
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
    return metrics


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
