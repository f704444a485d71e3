"""The training loop on Accelerate, readable top to bottom.

One step (B prompts, G completions each, N = B * G sequences):
  1. take B prompts from the stream;
  2. rollout: G sampled completions per prompt (eval mode, KV cache, no grad);
  3. rewards: grade each completion with the same grader evaluation uses -> [B, G];
  4. advantages: group-centred (the objective decides std scaling) -> token advantages [N, T];
     (IBPO.md Part 2's counterfactual shaping plugs in here through advantages.py);
  5-7. the update (update.py): frozen log-probs where they matter, micro-batches of whole
     groups -> objective -> backward with a normaliser from the whole step and all processes,
     then clip, optimizer step, scheduler;
  8. log (metrics gathered over processes).
With several processes (Accelerate DDP or FSDP2; DeepSpeed is refused) each one takes its own
shard of prompts, generates, grades and normalises its own groups; DDP averages the gradients (FSDP
reduce-scatters them). Under FSDP generation runs on gathered weights (distributed.gathered).
Before the first and after the last step the held-out set is evaluated greedily; the adapter is
saved in PEFT format with the tokenizer, and `summary.json` records before/after accuracy.
Checkpoints (every train.save_every steps, at the end, on SIGINT/SIGTERM) resume a run exactly
(checkpoint.py); a step whose loss or gradient is not finite is skipped, and too many in a row
stop the run; running out of memory ends it with advice on what to lower.

Not here: the math of objectives/advantages, model loading, data sources (their own modules).
"""

from __future__ import annotations

import json
import math
import random
import resource
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import yaml

from ibpo import checkpoint as ckpt
from ibpo import failures, rundir
from ibpo.advantages import flat_groups
from ibpo.config import Config
from ibpo.data import PromptStream, drop_long_prompts, load_splits, thinking_note
from ibpo.distributed import (
    check_launch,
    check_shared_output,
    gathered,
    is_fsdp,
    launch_kind,
    save_adapter,
)
from ibpo.evaluation import evaluate_accuracy
from ibpo.modeling import (
    dequantized_base,
    load_policy,
    use_dequantized_base,
)
from ibpo.objectives import (
    ResolvedObjective,
    resolve_params,
)
from ibpo.rewards import REWARDS
from ibpo.rollout import hf_generator, set_kv_cache
from ibpo.runlog import finish_run, gather_metrics, log_eval, log_step
from ibpo.scoring import collect_batch
from ibpo.update import update_policy


def build_optimizer(model, cfg: Config, device: torch.device, fsdp: bool = False):
    """AdamW; `auto` = bitsandbytes' paged 8-bit AdamW on CUDA, except under FSDP (it does not
    take sharded parameters) and on CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    kind = cfg.train.optimizer
    if kind == "auto":
        kind = "adamw_8bit" if device.type == "cuda" and not fsdp else "adamw"
    if kind == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(
            params, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay
        )
    return torch.optim.AdamW(
        params, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay
    )


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
        return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "device_memory_used_gb": (total - free) / 2**30}  # fmt: skip
    return {"peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


@contextmanager
def generating(model, cfg: Config, device: torch.device, engine=None):
    """A Generator (rollout.py) for one generation phase: the vLLM engine serving the current
    adapter (rollout.backend=vllm), or the policy's own generate() - under FSDP on gathered
    weights, on CPU with a 4-bit base dequantised once and the adapter folded in."""
    if engine is not None:
        with engine.serving(model) as generator:
            yield generator
        return
    fast = use_dequantized_base(cfg.model, device, model)
    with gathered(model):
        with dequantized_base(model, merge_lora=True) if fast else nullcontext():
            yield hf_generator(model)


def rl_step(model, tokenizer, optimizer, scheduler, accelerator, stream, cfg, objective, rng,
            engine=None):  # fmt: skip
    """One full RL step; returns a dict of metrics (gathered over processes). `engine`: the
    vLLM engine that generates (rollout.backend=vllm), else the policy does."""
    t0 = time.perf_counter()
    reset_peak_memory(accelerator.device)
    # 1-4. rollout, rewards, (IBPO) repairs, token advantages [N, T]; each process scores and
    # normalises the groups it generated
    with generating(model, cfg, accelerator.device, engine) as generator:
        batch = collect_batch(generator, tokenizer, stream, cfg, objective,
                              REWARDS[cfg.objective.reward], rng)  # fmt: skip
    t_gen = time.perf_counter()
    lr = scheduler.get_last_lr()[0]  # the rate this step's (first) update uses
    fast = use_dequantized_base(cfg.model, accelerator.device, model)  # CPU: dequantise once
    with dequantized_base(model) if fast else nullcontext():
        upd = update_policy(model, optimizer, scheduler, accelerator, batch, cfg, objective)
    t_end = time.perf_counter()
    metrics = step_metrics(batch, upd, lr)
    metrics.update(
        time_rollout=t_gen - t0,
        time_frozen_logprobs=upd.time_frozen,
        time_update=t_end - t_gen - upd.time_frozen,
        step_time=t_end - t0,
        tokens_per_second=sum(batch.rollout.lengths) / (t_end - t0),
        **memory_metrics(accelerator.device),
    )
    return gather_metrics(accelerator, metrics)


def step_metrics(batch, upd, lr: float) -> dict[str, float]:
    """A step's metrics from its scored batch (host values) and its update's statistics (already
    read from the device): this reads nothing from the device itself."""
    rollout, rewards = batch.rollout, batch.rewards
    n_tokens = sum(rollout.lengths)
    cancel, truncated = upd.cancel, rollout.host_truncated()
    metrics = {k: sum(v) / len(v) for k, v in upd.stats.items()}
    metrics["loss"] = sum(upd.stats["loss"]) / upd.updates  # the step's loss, not a mean
    metrics.update(batch.stats)
    metrics.update(
        reward=rewards.mean().item(),
        accuracy=(rewards >= 1.0).float().mean().item(),
        zero_variance_groups=flat_groups(rewards).float().mean().item(),
        residual=cancel["residual_num"] / max(cancel["residual_den"], 1e-30),
        shared_token_fraction=cancel["shared_tokens"] / max(cancel["tokens"], 1.0),
        completion_length=n_tokens / rollout.num_sequences,
        truncated=sum(truncated) / len(truncated),
        grad_norm=upd.grad_norm,
        skipped_nonfinite=float(upd.skipped),
        lr=lr,
    )
    return metrics


def lr_lambda(cfg: Config):
    """Learning-rate factor per scheduler step. The scheduler steps once per update, and
    updates_per_rollout updates make one training step (the unit of warmup_steps and steps)."""
    warm, total, kind = cfg.train.warmup_steps, max(cfg.train.steps, 1), cfg.train.lr_scheduler
    per_step = cfg.train.updates_per_rollout

    def f(update: int) -> float:
        step = update // per_step
        if step < warm:
            return (step + 1) / warm
        frac = (step - warm) / max(total - warm, 1)
        if kind == "linear":
            return max(1.0 - frac, 0.0)
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0

    return f


def _build(cfg: Config, accelerator) -> tuple[ckpt.Resumable, object, list]:
    """Data stream, policy, optimizer and scheduler (prepared by Accelerate), repair rng."""
    train_examples, eval_examples = load_splits(cfg.data, cfg.train.seed)
    model, tokenizer = load_policy(cfg.model, accelerator.device)
    set_kv_cache(model, cfg.rollout.kv_cache)
    if note := thinking_note(tokenizer, cfg.data, cfg.rollout.max_new_tokens):
        accelerator.print(note)
    train_examples, n_train = drop_long_prompts(train_examples, tokenizer, cfg.data, "training")
    eval_examples, n_eval = drop_long_prompts(eval_examples, tokenizer, cfg.data, "held-out")
    if n_train or n_eval:
        limit = cfg.data.max_prompt_tokens
        accelerator.print(f"ibpo: left out {n_train} training and {n_eval} held-out problems "
                          f"whose prompt exceeds data.max_prompt_tokens={limit}")  # fmt: skip
    stream = PromptStream(
        train_examples, cfg.train.seed, cfg.data.shuffle,
        accelerator.process_index, accelerator.num_processes,
    )  # fmt: skip
    optimizer = build_optimizer(model, cfg, accelerator.device, launch_kind(accelerator) == "FSDP")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    rng = random.Random(cfg.train.seed)  # repair planning (which members, which references)
    return ckpt.Resumable(model, optimizer, scheduler, stream, rng), tokenizer, eval_examples


def _prepare_output_dir(out: Path, cfg: Config, resume: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    removed = rundir.clear_previous_run(out) if resume is None else []
    if removed:
        print(f"ibpo: starting afresh: removed an earlier run's {', '.join(removed)} in {out} "
              "(train.resume_from=latest continues a run instead)", file=sys.stderr)  # fmt: skip


def _start_or_resume(accelerator, parts, resume, metrics: Path, held_out, cfg: Config):
    """The checkpoint's state (RNG, data position, optimizer...: the run goes on as if it had
    never stopped), or a fresh one with the held-out accuracy before training."""
    if resume is not None:
        state = ckpt.load_checkpoint(accelerator, resume, parts)
        if accelerator.is_main_process:
            ckpt.restore_metrics(resume, metrics)  # drops steps logged after the checkpoint
        accelerator.print(f"resumed from {resume} (step {state.step})")
        applied = rundir.apply_optimizer_settings(parts, cfg.train.learning_rate,
                                                cfg.train.weight_decay)  # fmt: skip
        if applied:
            accelerator.print(f"ibpo: resuming with {'; '.join(applied)}")
        changed = rundir.resume_changes(resume, cfg.to_dict())
        if changed:
            accelerator.print(
                "ibpo: warning: these settings differ from the checkpoint's run, which continues "
                f"with the new ones: {'; '.join(changed)}"
            )
        return state
    state = ckpt.TrainerState(eval_before=held_out() if cfg.train.eval_before else None)
    if state.eval_before:
        e = state.eval_before
        accelerator.print(f"held-out accuracy before: {e['accuracy']:.3f} (n={e['n']})")
    return state


def _final_eval(held_out, accelerator) -> dict | None:
    """The held-out evaluation after training; with one process a failure (out of memory...)
    is recorded instead of losing the summary. With several it propagates: the others wait in
    its collective, and only ending the process lets the launcher stop them."""
    try:
        return held_out()
    except Exception as e:
        if accelerator.num_processes > 1:
            raise
        print(f"ibpo: the final held-out evaluation failed: {type(e).__name__}: {e}\n  The "
              "adapter is saved; evaluate it with scripts/eval_*.py.", file=sys.stderr)  # fmt: skip
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def train(cfg: Config) -> dict:
    """Run a whole recipe; returns the summary (also written to <output_dir>/summary.json).

    Checkpoints (checkpoint.py) are saved every train.save_every steps, at the end, on
    SIGINT/SIGTERM and when non-finite steps stop the run; train.resume_from resumes one exactly.
    Running out of memory ends the run with advice instead of a traceback.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    start, tr = time.time(), cfg.train
    # Accelerate would step the scheduler once per process per update (it assumes data loaders
    # that shrink with the number of processes); here a step is a step whatever the processes
    accelerator = Accelerator(log_with=tr.log_with, project_dir=tr.output_dir,
                              step_scheduler_with_optimizer=False)  # fmt: skip
    check_launch(accelerator, cfg)
    set_seed(tr.seed)
    out, main = Path(tr.output_dir), accelerator.is_main_process
    resume = ckpt.resolve_resume(tr.resume_from, out)
    if resume is None:
        rundir.check_fresh_start(out, tr.overwrite)
    if main:
        _prepare_output_dir(out, cfg, resume)
    check_shared_output(accelerator, out)
    objective: ResolvedObjective = resolve_params(cfg.objective)
    parts, tokenizer, eval_examples = _build(cfg, accelerator)
    engine = None
    if cfg.rollout.backend == "vllm":
        from ibpo.vllm_rollout import VLLMEngine

        engine = VLLMEngine.start(cfg, parts.model, tokenizer)
    try:
        if tr.log_with:
            accelerator.init_trackers("ibpo", config=cfg.to_dict())
        reward_fn = REWARDS[cfg.objective.reward]

        def held_out() -> dict | None:
            if not eval_examples:
                return None
            with generating(parts.model, cfg, accelerator.device, engine) as generator:
                return evaluate_accuracy(
                    generator, tokenizer, eval_examples, cfg.data, reward_fn,
                    cfg.rollout.eval_max_new_tokens, cfg.rollout.eval_batch_size, accelerator,
                )  # fmt: skip

        metrics_path = out / "metrics.jsonl"
        state = _start_or_resume(accelerator, parts, resume, metrics_path, held_out, cfg)
        prior = state.wall_seconds

        def checkpoint() -> Path:
            state.wall_seconds = prior + time.time() - start
            root = out / ckpt.CHECKPOINTS
            return ckpt.save_checkpoint(accelerator, root, parts, state, metrics_path,
                                        tr.keep_checkpoints, cfg.to_dict())  # fmt: skip

        metrics_file = open(metrics_path, "a" if resume else "w") if main else None  # noqa: SIM115
        bar = tqdm(total=tr.steps, initial=min(state.step, tr.steps), desc="ibpo",
                   disable=not (main and tr.progress))  # fmt: skip
        status, message, last = "completed", None, resume  # last: the newest checkpoint
        cut_short = False  # stopped mid-step: the live adapter is not saved
        phase = "step"  # what ran when an error came: step | eval | save
        try:
            with failures.GracefulStop() as stop:
                while state.step < tr.steps:
                    phase = "step"
                    m = rl_step(parts.model, tokenizer, parts.optimizer, parts.scheduler,
                                accelerator, parts.stream, cfg, objective, parts.rng,
                                engine)  # fmt: skip
                    state.step += 1
                    state.count_step(m["skipped_nonfinite"] > 0)
                    log_step(m, state.step, bar, metrics_file, accelerator, tr.log_with)
                    if 0 < tr.max_nonfinite_steps <= state.nonfinite_streak:
                        status = "nonfinite"
                        break
                    if stop.requested(accelerator):
                        status = "interrupted"
                        break
                    if tr.eval_every and state.step % tr.eval_every == 0 and state.step < tr.steps:
                        phase = "eval"
                        log_eval(
                            held_out(), state.step, bar, metrics_file, accelerator, tr.log_with
                        )
                    if tr.save_every and state.step % tr.save_every == 0:
                        phase = "save"
                        last = checkpoint()
                phase = "save"
                if last is None or ckpt.step_of(last) != state.step:  # end, signal, non-finite stop
                    last = checkpoint()
        except KeyboardInterrupt:  # a second Ctrl-C: this step is lost, the last checkpoint stands
            # under FSDP saving would gather shards from processes caught at other points: no saving
            status, cut_short = "interrupted", is_fsdp(parts.model)
        except OSError as e:  # a full disk while saving: the previous checkpoint stands
            if phase != "save":
                raise
            status, message, cut_short = "failed", failures.save_failed_message(e, last), True
        except Exception as e:
            if not failures.is_oom(e):
                raise
            status = "out_of_memory"
            if phase == "eval" and accelerator.num_processes == 1:  # the step itself finished
                last = checkpoint()
                message = failures.oom_message(cfg, state.step, e, last, in_eval=True)
            else:
                message = failures.oom_message(cfg, state.step + 1, e, last)
                cut_short = True
        finally:
            bar.close()
            if metrics_file:
                metrics_file.close()
        if status == "nonfinite":
            message = failures.nonfinite_message(state, last)
        if status == "interrupted":
            message = failures.interrupted_message(state.step, last)
        # Out of memory with several processes: the others may be inside a collective of this step
        # that this one will never join, so it joins none from here on and ends (the CLI exits 1);
        # the others' collective then fails and the launcher stops the run, instead of everyone
        # waiting for a collective timeout.
        alone = status == "out_of_memory" and accelerator.num_processes > 1
        if message and (main or alone):
            who = f"process {accelerator.process_index}: " if alone else ""
            print(f"ibpo: {who}{message}", file=sys.stderr)
        adapter = out / "adapter"
        if cut_short:  # the checkpoint's adapter, not the live one (maybe mid-update)
            adapter = rundir.keep_checkpoint_adapter(last, adapter) if main else None
        else:
            save_adapter(accelerator, parts.model, adapter)
            if main:
                tokenizer.save_pretrained(adapter)
        summary = {
            "eval_before": state.eval_before, "eval_after": None, "steps": state.step,
            "objective": objective.name, "model": cfg.model.name,
            "quantization": cfg.model.quantization, "dataset": cfg.data.dataset,
            "status": status, "message": message, "nonfinite_steps": state.nonfinite_total,
            "resumed_from": resume and str(resume), "checkpoint": last and str(last),
            "wall_seconds": round(prior + time.time() - start, 1),
            "adapter": adapter and str(adapter),
        }  # fmt: skip
        if main:  # written now too: a run killed in its final evaluation still has a summary
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if status == "completed":
            summary["eval_after"] = _final_eval(held_out, accelerator)
            summary["wall_seconds"] = round(prior + time.time() - start, 1)
        if not alone:
            accelerator.wait_for_everyone()
        if main:
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            finish_run(out, cfg, status)
        if tr.log_with and not alone:
            accelerator.end_training()
        return summary
    finally:  # however the run ends: the engine holds GPU memory and a process-wide state
        if engine is not None:
            engine.close()
