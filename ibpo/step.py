"""One RL step, read top to bottom: `rl_step` and the stages it runs, in data-flow order.

A step (B prompts per process, G completions each, N = B * G sequences, T completion tokens):
  1. prompts: B from this process's shard of the stream;
  2. rollout: G sampled completions per prompt (eval mode, KV cache, no grad), by the policy's
     generate() or a vLLM engine;
  3. rewards [B, G]: each completion graded by the run's reward functions, which evaluation
     and repairs use too (rewards/functions.py), each one's mean logged as rewards/<name>; NaN
     where none applies (no advantage), correct and failed by the set's thresholds;
  4. (IBPO) repairs: each failed completion repaired locally given a sibling, the repairs
     graded -> phi and edit masks; shaped rewards R' = R + lambda * phi (repair.py), as many
     as the spending rule's decision and budget allow (repair_budget.py). With dynamic
     sampling, groups whose shaped rewards are all equal are dropped and refilled;
  5. advantages: group-centred (std-scaled when the objective says so), DAPO's length penalty
     where on, broadcast to tokens [N, T] with the edit masks applied (algo/advantages.py);
  6. old and reference log-probs, detached: old only when a rollout is reused
     (updates_per_rollout > 1), reference only when kl_coef > 0 or the KL is logged (the same
     model, adapter disabled);
  7. micro-batches of whole groups: log-probs with grad -> objective -> backward, each loss
     divided by a normaliser from the whole step and all processes (algo/objectives.py);
  8. clip, then the optimizer and scheduler step, unless a loss or the gradient is not finite;
  9. metrics (collected by step_metrics.py), gathered over processes (with what the gradings
     reported: the graders' own failures as grader_errors, calls out of time as
     reward_timeouts, what reward functions logged).
Stages hand each other small dataclasses (step_parts.py): `Round` (one generation round),
`ScoredBatch` (what the update trains on), `UpdateResult` (what the update did).

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
mismatch, the spending rule), the metrics' bookkeeping (step_metrics.py), model loading.
"""

from __future__ import annotations

import logging
import math
import random
import time
from contextlib import contextmanager, nullcontext

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
from ibpo.batching import MicroBatch, micro_batches
from ibpo.config import Config, ConfigError, RepairConfig
from ibpo.data import PromptStream, RowStream, render_example
from ibpo.distributed import agreed_count, gather_metrics, gathered
from ibpo.generation import (
    Generator,
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
from ibpo.repair import RepairGeneration, run_repairs
from ibpo.repair_budget import RepairDecision, decide_repairs, observe_repairs
from ibpo.rewards.functions import RewardSet, grade_completions, run_reward_set
from ibpo.sizes import CHUNK_TOKENS
from ibpo.step_metrics import (
    RoundsLog,
    UpdateLog,
    completion_rows,
    memory_metrics,
    reset_peak_memory,
    rollout_stats,
    step_metrics,
    time_metrics,
)
from ibpo.step_parts import Round, ScoredBatch, StepParts, UpdateResult

log = logging.getLogger(__name__)

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
    # (IBPO) this step's repair decision, from what earlier steps' repairs returned: the same
    # history, hence the same decision, on every process
    decision = None
    if repairs_enabled(cfg, objective):
        rep = cfg.repair
        decision = decide_repairs(parts.repair_history, rep.min_success, rep.probe_every)
    # 1-5. prompts, rollout, rewards, (IBPO) repairs, token advantages [N, T]: each process
    # scores and normalises the groups it generated
    with generating(model, cfg, device, engine, tools) as generator:
        batch = collect_batch(
            generator, tokenizer, parts.stream, cfg, objective, reward_fns, parts.rng, streams,
            decision,
        )  # fmt: skip
    if decision is not None:  # the rule learns from this step's repairs, on every process
        history = observe_repairs(accelerator, parts.repair_history, decision.mode, batch.stats)
        parts.repair_history = history
    t_gen = time.perf_counter()
    lr = parts.scheduler.get_last_lr()[0]  # the rate this step's (first) update uses
    # 6-8. old/reference log-probs, micro-batched backward, clip and optimizer step(s)
    fast = use_dequantized_base(cfg.model, device, model)  # CPU: dequantise the base once
    with dequantized_base(model) if fast else nullcontext():
        upd = update_policy(
            model, parts.optimizer, parts.scheduler, accelerator, batch, cfg, objective
        )
    t_end = time.perf_counter()
    # 9. metrics: the step's, what the reward functions logged, timings and memory
    metrics = step_metrics(batch, upd, lr, reward_fns.correct)
    metrics.update(time_metrics(t0, t_gen, t_end, upd.time_frozen, sum(batch.rollout.lengths)))
    metrics.update(memory_metrics(device))
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
    decision: RepairDecision | None = None,
) -> ScoredBatch:
    """Rounds of rollout -> rewards -> (IBPO) repairs until B groups are kept, then one scored
    batch. With dynamic sampling, groups whose shaped rewards are all equal (no gradient) are
    dropped and the batch is refilled from the stream, for at most MAX_RESAMPLE_ROUNDS extra
    rounds; if every group was dropped the last round is kept as is (zero advantages), so a step
    never fails for lack of signal. `streams`: the step's sampling streams (None: the process's
    own, for callers that drive this stage alone). `decision`: the step's repair decision
    (repair_budget.py; None: every planned repair runs)."""
    G, B = cfg.rollout.group_size, cfg.train.prompts_per_step
    repairing = repairs_enabled(cfg, objective)
    kept: list[Round] = []
    log = RoundsLog()  # what every round logged, kept or not
    need, dropped, rounds = B, 0, 0
    while True:
        r = score_round(
            generator, tokenizer, stream.take(need), cfg, repairing, reward_fns, rng, streams,
            rounds, decision,
        )  # fmt: skip
        log.add(r)
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
    correct = 1.0 if reward_fns is None else reward_fns.correct  # None: rounds scored elsewhere
    batch.stats.update(log.summary(dropped, rounds, correct, repairing))
    batch.table = log.completions([k.table for k in kept], batch.host_adv, G)
    batch.gradings = log.gradings
    return batch


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
    decision: RepairDecision | None = None,
) -> Round:
    """One round: generate G completions per example, grade them, and (IBPO) repair the failed
    ones, which shapes the rewards and gives the edit masks. The completions and the repairs
    draw from their own streams of the round (`streams`), so repairs never shift what a later
    round or step samples. `decision` (collect_batch) bounds what the repairs may cost: by the
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
    stats = {"time_generate": t1 - t0, **rollout_stats(rollout)}
    stats["time_rewards"] = time.perf_counter() - t1
    graded = Round(rollout, scores, scores, None, stats, grades.per_function, table, [grades])
    if not repairing:
        return graded
    gen = RepairGeneration(
        generator, tokenizer, cfg.data, ro.max_new_tokens, cfg.repair.batch_size, ro.temperature,
        ro.top_p,
    )  # fmt: skip
    with _stream(streams, "repair", round_):
        return repair_round(graded, gen, examples, cfg.repair, reward_fns, rng, decision, t1)


def repair_round(
    graded: Round,
    gen: RepairGeneration,
    examples,
    rep: RepairConfig,
    reward_fns: RewardSet,
    rng: random.Random,
    decision: RepairDecision | None,
    graded_at: float,
) -> Round:
    """(IBPO) A graded round with its failed completions repaired (repair.py): its rewards
    shaped by phi, its edit masks, the repairs' statistics and grading. Under a `decision` the
    repairs may cost at most the share repair.cost_share of the tokens the round runs.
    `graded_at`: when the round's grading began; time_repair counts from there (grading and
    repairs together)."""
    stats = graded.stats
    budget = None
    if decision is not None:
        rollout_tokens = stats["rollout_prefill_tokens"] + stats["generated_tokens"]
        budget = decision.budget(rollout_tokens, rep.cost_share)
    scores = graded.rewards
    out = run_repairs(gen, examples, graded.rollout, scores, reward_fns, rep, rng, budget)
    shaped = shape_rewards(scores, out.phi, rep.shaping_lambda, scores >= reward_fns.correct)
    stats.update(out.stats)
    stats["time_repair"] = time.perf_counter() - graded_at
    stats["generated_tokens"] += out.stats["repair_tokens"]
    for row, r in zip(graded.table, shaped.flatten().tolist()):
        row["shaped_reward"] = r
    graded.shaped, graded.edited = shaped, out.edited
    if out.grades is not None:
        graded.gradings.append(out.grades)
    return graded


def _stream(streams: SamplingStreams | None, phase: str, round_: int):
    return nullcontext() if streams is None else streams(phase, round_)


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
    tr, G = cfg.train, cfg.rollout.group_size
    mbs = micro_batches(batch.rollout, G, tr.micro_batch_groups)
    # Every process runs as many forwards and backwards: DDP syncs buffers in each forward and
    # FSDP gathers weights in each. One with fewer micro-batches (dynamic sampling)
    # repeats its last one, with zero weight.
    n = agreed_count(accelerator, len(mbs))
    # 6. old and reference log-probs (detached), each only when it matters
    old, ref = old_and_reference(model, mbs, n, cfg, objective)
    t_frozen = time.perf_counter() - t0
    lengths = batch.rollout.host_policy_lengths()
    norm = global_normaliser(accelerator, objective, lengths, cfg.rollout.max_new_tokens)
    log = UpdateLog()
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
            info["loss"] = loss.detach()
            losses.append(info["loss"])
            log.add(info, cancellation_residual(c, a, mb.tokens, G, mb.completion_mask), mb, G)
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
    values, sums = log.read()
    return UpdateResult(values, sums, grad_norm, updates, skipped, t_frozen)


def old_and_reference(model, mbs: list[MicroBatch], count: int, cfg, objective):
    """Stage 6: per micro-batch the old log-probs, only when a rollout is reused
    (updates_per_rollout > 1), and the reference ones, only when kl_coef > 0 or the KL is
    logged; None where not computed. Each runs `count` forwards (see `frozen_logprobs`)."""
    chunk, temp, tr = CHUNK_TOKENS, cfg.rollout.temperature, cfg.train
    old = None
    if tr.updates_per_rollout > 1:
        old = frozen_logprobs(model, mbs, chunk, temp, reference=False, count=count)
    ref = None
    if objective.kl_coef > 0 or tr.log_reference_kl:
        ref = frozen_logprobs(model, mbs, chunk, temp, reference=True, count=count)
    return old, ref


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
