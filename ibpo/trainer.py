"""The run around the step: `run_recipe(cfg)`, from a recipe to a saved adapter and a summary.

In order: launch checks (one process, DDP or FSDP2; DeepSpeed and FSDP1 are refused); the output
folder created; data, the QLoRA policy, optimizer and scheduler, prepared by Accelerate; only then
a fresh start moves an earlier run in the output folder aside to previous-<time>/ (or a resume
from a checkpoint: run/outdir.py, run/checkpoint.py); the held-out accuracy before training;
then the loop, one `step.rl_step` per step, with its metrics and completions table logged
(run/log.py) and the callbacks' hooks called (run/callbacks.py: a callback may stop the run, ask
for a checkpoint or an evaluation), periodic held-out evaluations and checkpoints; at the end
the adapter in PEFT format with the tokenizer, `summary.json`, the held-out accuracy after,
plots and an optional Hub upload.
Checkpoints (every run.save_every steps, at the end, on SIGINT/SIGTERM, and when non-finite
steps stop the run) resume a run exactly; a step whose loss or gradient is not finite is
skipped, and too many in a row stop the run; running out of memory ends it with advice on what
to lower (run/failures.py).

Not here: the step itself (step.py) and the math it runs (objectives, advantages, repair).
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import yaml

from ibpo.algo.objectives import ResolvedObjective
from ibpo.config import Config
from ibpo.data import (
    describe_prompts,
    drop_long_prompts,
    load_splits,
    prompt_fits,
    prompt_template,
    thinking_note,
    training_stream,
)
from ibpo.distributed import (
    check_launch,
    check_shared_output,
    ended_together,
    gather_object,
    launch_kind,
    save_adapter,
)
from ibpo.evaluation.evaluate import evaluate_accuracy
from ibpo.generation import VLLMEngine, set_kv_cache
from ibpo.hub import push as hub_push
from ibpo.modeling import (
    load_policy,
    use_dequantized_base,
)
from ibpo.recipe import resolve_params
from ibpo.rewards import calls as reward_calls
from ibpo.rewards import code as code_grader
from ibpo.rewards.functions import RewardError, RewardSet, run_reward_set
from ibpo.run import checkpoint as ckpt
from ibpo.run import failures, outdir, report
from ibpo.run.alarm import MismatchAlarm
from ibpo.run.callbacks import CallbackError, Callbacks, RunState
from ibpo.run.log import COMPLETIONS, log_completions, log_eval, log_step, trim_completions
from ibpo.run.version import code_version, header
from ibpo.sandbox import policy as sandbox_policy
from ibpo.step import generating, rl_step
from ibpo.step_parts import StepParts
from ibpo.tools import resolve_tools
from ibpo.trl_config import TrainingArgs


def build_optimizer(model, cfg: Config, device: torch.device, fsdp: bool = False):
    """AdamW; `auto` = bitsandbytes' paged 8-bit AdamW on CUDA, except under FSDP (it does not
    take sharded parameters) and on CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    kind = cfg.train.optimizer
    if kind == "auto":
        kind = "adamw_8bit" if device.type == "cuda" and not fsdp else "adamw"
    if kind == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(params, lr=cfg.train.learning_rate, weight_decay=0.0)
    # no weight decay (torch's AdamW would default to 0.01): the adapter starts at zero update
    return torch.optim.AdamW(params, lr=cfg.train.learning_rate, weight_decay=0.0)


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


def _build(
    cfg: Config,
    accelerator,
    rows=None,
    reward_fns: RewardSet | None = None,
    eval_rows=None,
    peft_config=None,
):
    """Data stream, policy, optimizer and scheduler (prepared by Accelerate), repair rng.
    `rows`, `eval_rows`: the training and held-out rows given in Python (data.load_splits);
    `peft_config`: a LoraConfig given in Python (modeling.load_policy)."""
    need_answer = reward_fns is None or reward_fns.reads_answer
    train_examples, eval_examples = load_splits(
        cfg.data, cfg.train.seed, rows, need_answer, eval_rows
    )
    model, tokenizer = load_policy(cfg.model, accelerator.device, peft_config=peft_config)
    set_kv_cache(model, "dynamic")
    accelerator.print(describe_prompts(tokenizer, cfg.data))
    if note := thinking_note(tokenizer, cfg.data, cfg.rollout.max_new_tokens):
        accelerator.print(note)
    eval_examples, n_eval = drop_long_prompts(eval_examples, tokenizer, cfg.data, "held-out")
    if n_eval:
        accelerator.print(
            f"ibpo: left out {n_eval} held-out problems whose prompt exceeds "
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
        )
    # training prompts are rendered and measured as they are drawn, not all of them now
    stream = training_stream(
        train_examples,
        cfg.train.seed,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        keep=prompt_fits(tokenizer, cfg.data),
    )
    optimizer = build_optimizer(model, cfg, accelerator.device, launch_kind(accelerator) == "FSDP")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    # repair planning (which members, which references): each process its own stream
    rng = random.Random(cfg.train.seed + accelerator.process_index)
    return StepParts(model, optimizer, scheduler, stream, rng), tokenizer, eval_examples


def _prepare_output_dir(out: Path, cfg: Config, resume: Path | None, code: dict) -> None:
    """Main process, once the data and the model have loaded: a fresh start moves an earlier
    run aside (never deletes it), then writes the new config.yaml; a resumed run writes it
    only once its checkpoint has loaded (_write_config), so that a start that fails leaves the
    run's files as they were."""
    if resume is None:
        if line := outdir.set_aside_previous_run(out):
            print(line, file=sys.stderr)
        _write_config(out, cfg, code)


def _write_config(out: Path, cfg: Config, code: dict) -> None:
    """config.yaml, headed by the code version as a comment (the file stays a recipe)."""
    recipe = yaml.safe_dump(cfg.to_dict(recipe=True), sort_keys=False)
    (out / "config.yaml").write_text(header(code) + recipe)


def _start_or_resume(accelerator, parts, resume, metrics: Path, held_out, cfg: Config):
    """The checkpoint's state (RNG, data position, optimizer...: the run goes on as if it had
    never stopped), or a fresh one with the held-out accuracy before training (None without a
    held-out set)."""
    if resume is not None:
        state = ckpt.load_checkpoint(accelerator, resume, parts)
        if accelerator.is_main_process:
            ckpt.restore_metrics(resume, metrics)  # drops steps logged after the checkpoint
            trim_completions(metrics.with_name(COMPLETIONS), state.step)
        accelerator.print(f"resumed from {resume} (step {state.step})")
        applied = outdir.apply_optimizer_settings(parts, cfg.train.learning_rate)
        if applied:
            accelerator.print(f"ibpo: resuming with {'; '.join(applied)}")
        changed = outdir.resume_changes(resume, cfg)
        if changed:
            accelerator.print(
                "ibpo: warning: these settings differ from the checkpoint's run, which continues "
                f"with the new ones: {'; '.join(changed)}"
            )
        return state
    state = ckpt.TrainerState(eval_before=held_out())
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
        print(
            f"ibpo: the final held-out evaluation failed: {type(e).__name__}: {e}\n  The "
            "adapter is saved; evaluate it with scripts/eval_*.py.",
            file=sys.stderr,
        )
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def finish_run(out: Path, cfg: Config, status: str) -> None:
    """Main process, after summary.json: plots, the end-of-run table, the Hub upload.
    None of them may cost a finished run: their failures are reported, not raised."""
    run = cfg.run
    try:
        report.plot_run(out)
        print(report.summary_table(out), file=sys.stderr)
    except Exception as e:  # a figure is never worth a traceback after hours of training
        print(
            f"ibpo: plots or summary not written: {e!r} (`ibpo report {out}` retries)",
            file=sys.stderr,
        )
    if run.hub_repo_id is not None and status == "completed":
        try:
            url = hub_push.push(out, run.hub_repo_id, private=True)
            print(f"ibpo: pushed to {url}", file=sys.stderr)
        except Exception as e:  # the run is saved: a failed upload must not fail it
            detail = str(e) if isinstance(e, hub_push.HubError) else repr(e)
            print(
                f"ibpo: push to the Hub failed: {detail}\n  Retry: ibpo push {out} "
                f"--repo-id {run.hub_repo_id}",
                file=sys.stderr,
            )


def run_recipe(
    cfg: Config,
    *,
    rows=None,
    reward_funcs=None,
    callbacks=None,
    eval_rows=None,
    peft_config=None,
    tools=None,
) -> dict:
    """Run a whole recipe; returns the summary (also written to <output_dir>/summary.json).
    `rows`: the training rows given in Python (a datasets.Dataset or a list of dicts) instead
    of data.dataset; `reward_funcs`: reward functions given in Python instead of those
    reward.functions names (rewards/functions.py); `callbacks`: hooks into the run
    (run/callbacks.py); `eval_rows`: held-out rows given in Python; `peft_config`: a
    peft.LoraConfig given in Python; `tools`: the tools rollouts call, given in Python instead
    of those rollout.tools names (ibpo/tools/). The Python API is ibpo.api.train.

    Checkpoints (run/checkpoint.py) are saved every run.save_every steps, at the end, on
    SIGINT/SIGTERM and when non-finite steps stop the run; run.resume_from resumes one exactly.
    Running out of memory ends the run with advice instead of a traceback; Ctrl-C before the
    loop raises failures.StoppedEarly (one line). summary["exit_code"] is `ibpo train`'s.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    start, tr = time.time(), cfg.train
    # a reward's import path that fails, fails here: before anything else
    reward_fns = run_reward_set(cfg.reward, reward_funcs)
    tool_set = resolve_tools(cfg.rollout.tools, tools)  # the same, for a tool's
    # Accelerate would step the scheduler once per process per update (it assumes data loaders
    # that shrink with the number of processes); here a step is a step whatever the processes
    accelerator = Accelerator(
        log_with=cfg.run.log_with,
        project_dir=cfg.run.output_dir,
        step_scheduler_with_optimizer=False,
    )
    check_launch(accelerator, cfg)
    ended_together(accelerator, False)  # until every process reaches this run's end
    set_seed(tr.seed)
    out = Path(cfg.run.output_dir)
    resume = ckpt.resolve_resume(cfg.run.resume_from, out)
    if resume is not None:
        outdir.check_resumed_data(resume, cfg, given_rows=rows is not None)
    # Every test any reward runs during the run is held to this policy, by the sandbox itself;
    # the built-in code reward's is checked before anything is touched
    policy = code_grader.training_policy(cfg.reward.sandbox)
    if any(r.builtin and r.name == "code" for r in reward_fns.functions) or "python" in tool_set:
        code_grader.check_training_sandbox(policy)
    outdir.make_output_dir(out)
    objective: ResolvedObjective = resolve_params(cfg.objective)
    try:  # nothing of an earlier run is touched until the data and the model are ready
        parts, tokenizer, eval_examples = _build(
            cfg, accelerator, rows, reward_fns, eval_rows, peft_config
        )
    except KeyboardInterrupt:  # before the loop's handler: one line, not a traceback
        raise failures.StoppedEarly(failures.stopped_early_message(resume)) from None
    code = code_version() if accelerator.is_main_process else None  # the code this run runs
    if accelerator.is_main_process:
        _prepare_output_dir(out, cfg, resume, code)
    check_shared_output(accelerator, out)
    if accelerator.num_processes > 1:
        # The same seed built the same LoRA init on every process; from here each process has
        # its own random streams (torch, CUDA, numpy, random seeded with seed + process index).
        # What it samples comes from the step's streams, which also hold the process index
        # (generation.SamplingStreams), so ranks never draw correlated groups.
        set_seed(tr.seed, device_specific=True)
    with sandbox_policy.enforced(policy) as sandbox:  # until the run has ended
        engine = None
        try:
            try:  # Ctrl-C here (the engine, the checkpoint, the first evaluation): nothing trained
                if cfg.rollout.backend == "vllm":
                    engine = VLLMEngine.start(cfg, parts.model, tokenizer)
                if cfg.run.log_with:
                    accelerator.init_trackers("ibpo", config=cfg.to_dict())
                run = Run(
                    cfg,
                    accelerator,
                    out,
                    resume,
                    parts,
                    tokenizer,
                    eval_examples,
                    objective,
                    engine=engine,
                    reward_fns=reward_fns,
                    tools=tool_set,
                    callbacks=callbacks,
                    sandbox=sandbox,
                    code=code,
                    start=start,
                )
                try:
                    run.begin()
                    if resume is not None and accelerator.is_main_process:
                        _write_config(out, cfg, code)  # the checkpoint loaded: the run goes on
                except RewardError as e:  # in the first held-out evaluation: its traceback kept
                    where = "the held-out evaluation before training"
                    kept = failures.keep_traceback(out, e, where, accelerator.process_index)
                    raise RewardError(f"{e} ({where}; traceback: {kept})") from e.__cause__
            except KeyboardInterrupt:
                if (
                    resume is None and accelerator.is_main_process
                ):  # no run here: none to move aside
                    (out / "config.yaml").unlink(missing_ok=True)
                raise failures.StoppedEarly(failures.stopped_early_message(resume)) from None
            return run.finish(run.loop())
        finally:  # however the run ends: the engine holds GPU memory and a process-wide state
            if engine is not None:
                engine.close()


@dataclass
class Ending:
    """How the loop ended: its status, the message to print, the newest checkpoint, whether it
    stopped mid-step (then the live adapter is not saved: the checkpoint's stands) and the
    signal that interrupted it (for the exit code)."""

    status: str = "completed"
    message: str | None = None
    last: Path | None = None
    cut_short: bool = False
    signum: int | None = None
    alone: bool = False  # this process ends by itself (the others may be in a collective)


@dataclass
class _Logs:
    """Where a run's steps are logged: the progress bar, and on the main process metrics.jsonl
    and the completions table."""

    bar: Any
    metrics: IO | None
    table: IO | None

    def close(self) -> None:
        self.bar.close()
        if self.metrics:
            self.metrics.close()
        if self.table:
            self.table.close()


class Run:
    """What the loop, its checkpoints and the ending of one training run share. `begin` then
    gives it its state: resumed from the checkpoint, or fresh."""

    def __init__(
        self,
        cfg,
        accelerator,
        out,
        resume,
        parts,
        tokenizer,
        eval_examples,
        objective,
        *,
        engine,
        reward_fns: RewardSet,
        tools: dict,
        callbacks,
        sandbox: sandbox_policy.Record | None,
        code: dict | None,
        start: float,
    ):
        self.cfg, self.accelerator, self.out, self.resume = cfg, accelerator, out, resume
        self.parts, self.tokenizer, self.eval_examples = parts, tokenizer, eval_examples
        self.objective, self.engine = objective, engine
        self.reward_fns = reward_fns  # given in Python, they may not import back from the config
        self.tools = tools  # the same
        self.sandbox = sandbox  # tests this run started, by mode
        self.code = code  # commit and dirty tree (run/version.py), main process
        # what callbacks and reward functions see (trainer_state=)
        self.run_state = RunState(
            max_steps=cfg.train.steps,
            is_world_process_zero=accelerator.is_main_process,
            is_local_process_zero=accelerator.is_local_main_process,
        )
        reward_fns.trainer_state = self.run_state
        objects = {
            "model": parts.model,
            "processing_class": tokenizer,
            "optimizer": parts.optimizer,
            "lr_scheduler": parts.scheduler,
        }
        # what a callback written for TRL reads as `args`: GRPOConfig's names for this run's values
        args = TrainingArgs(cfg, accelerator.num_processes, accelerator.process_index)
        self.callbacks = Callbacks(callbacks, args, self.run_state, objects)
        self.main = accelerator.is_main_process
        self.metrics_path = out / "metrics.jsonl"
        self.state = ckpt.TrainerState()
        self.start = start
        self.prior = 0.0  # wall seconds of earlier sessions of this run
        self.phase = "step"  # what the loop runs now: step | eval | save | callback
        device = accelerator.device
        folded = use_dequantized_base(cfg.model, device, parts.model)
        self.alarm = MismatchAlarm.for_run(cfg, device.type, folded)

    def begin(self) -> None:
        """The run's state: the checkpoint's when resuming (its wall seconds carried on), else a
        fresh one with the held-out accuracy before training."""
        self.state = _start_or_resume(
            self.accelerator, self.parts, self.resume, self.metrics_path, self.held_out, self.cfg
        )
        self.prior = self.state.wall_seconds

    def held_out(self) -> dict | None:
        """Greedy accuracy on the held-out set (None without one), with what its grading
        reported: its own grader errors and logged metrics, never a step's."""
        if not self.eval_examples:
            return None
        cfg = self.cfg
        model, device = self.parts.model, self.accelerator.device
        with generating(model, cfg, device, self.engine, self.tools) as generate:
            return evaluate_accuracy(
                generate,
                self.tokenizer,
                self.eval_examples,
                cfg.data,
                self.reward_fns,
                cfg.rollout.eval_max_new_tokens,
                cfg.rollout.generation_batch_size,
                self.accelerator,
            )

    def wall_seconds(self) -> float:
        return self.prior + time.time() - self.start

    def checkpoint(self) -> Path:
        self.state.wall_seconds = self.wall_seconds()
        return ckpt.save_checkpoint(
            self.accelerator,
            self.out / ckpt.CHECKPOINTS,
            self.parts,
            self.state,
            self.metrics_path,
            ckpt.KEEP_CHECKPOINTS,
            self.cfg.to_dict(recipe=True),
        )

    def loop(self) -> Ending:
        """The steps, with their metrics, periodic evaluations and checkpoints, until the last
        step, a signal, too many non-finite steps, a rollout mismatch over its stop threshold,
        running out of memory or a full disk."""
        cfg, state, acc = self.cfg, self.state, self.accelerator
        end = Ending(last=self.resume)
        logs = self._open_logs()
        self.phase = "step"  # what ran when an error came: its handler below reads it
        try:
            with failures.GracefulStop() as stop:
                self._steps(end, stop, logs)
        except reward_calls.Interrupted:  # a signal while reward calls ran: not waited for
            self._interrupted_in_rewards(end, self.phase, stop.signum)
        except KeyboardInterrupt:  # a second Ctrl-C: this step is lost, the last checkpoint stands
            # the live adapter may be mid-update (and under FSDP saving would gather shards from
            # processes caught at other points): the run's adapter is the last checkpoint's
            end.status, end.cut_short, end.signum = "interrupted", True, signal.SIGINT
            end.message = failures.stopped_at_once_message(state.step + 1, end.last)
        except OSError as e:  # a full disk while saving: the previous checkpoint stands
            if self.phase != "save":
                raise
            end.status, end.cut_short = "failed", True
            end.message = failures.save_failed_message(e, end.last)
        except CallbackError as e:  # the callback is named; the steps before it are kept
            self._callback_failed(end, e)
        except RewardError as e:  # the function is named; the steps before it are kept
            self._reward_failed(end, e, self.phase)
        except Exception as e:
            if not failures.is_oom(e):
                raise
            end.status = "out_of_memory"
            if self.phase == "eval" and acc.num_processes == 1:  # the step itself finished
                end.last = self.checkpoint()
                end.message = failures.oom_message(cfg, state.step, e, end.last, in_eval=True)
            else:
                end.message = failures.oom_message(cfg, state.step + 1, e, end.last)
                end.cut_short = True
        finally:
            logs.close()
        if end.status == "nonfinite":
            end.message = failures.nonfinite_message(state, end.last)
        if end.status == "interrupted" and end.message is None:
            end.message = failures.interrupted_message(state.step, end.last)
        return end

    def _open_logs(self) -> _Logs:
        """The progress bar, and on the main process metrics.jsonl and the completions table
        (appended to when the run resumes)."""
        from tqdm.auto import tqdm

        mode = "a" if self.resume else "w"
        return _Logs(
            tqdm(
                total=self.cfg.train.steps,
                initial=min(self.state.step, self.cfg.train.steps),
                desc="ibpo",
                disable=True if not self.main else None,  # None: shown on a terminal only
            ),
            open(self.metrics_path, mode) if self.main else None,  # noqa: SIM115
            open(self.out / COMPLETIONS, mode) if self.main else None,  # noqa: SIM115
        )

    def _steps(self, end: Ending, stop: failures.GracefulStop, logs: _Logs) -> None:
        """Step after step until the last one or a reason to end (end.status), then the
        checkpoint the last save missed."""
        state, steps = self.state, self.cfg.train.steps
        self.phase = "callback"
        self._observe()
        self.callbacks.call("on_train_begin")
        while state.step < steps:
            m, (wants_stop, wants_save, wants_eval) = self._step(logs)
            if self._ends_after(m, stop, end, wants_stop):
                break
            periodic = self.cfg.train.eval_every and state.step % self.cfg.train.eval_every == 0
            if (periodic or wants_eval) and state.step < steps:
                self.phase = "eval"
                e = self.held_out()
                log_eval(
                    e, state.step, logs.bar, logs.metrics, self.accelerator, self.cfg.run.log_with
                )
                self.phase = "callback"
                self._observe(e)
                self.callbacks.call("on_evaluate", metrics=e)
            save_every = self.cfg.run.save_every
            if (save_every and state.step % save_every == 0) or wants_save:
                self.phase = "save"
                end.last = self.checkpoint()
                self.phase = "callback"
                self.callbacks.call("on_save", checkpoint=end.last)
        self.phase = "save"
        # the end, a signal or a non-finite stop: checkpoint what the last save missed
        if end.last is None or ckpt.step_of(end.last) != state.step:
            end.last = self.checkpoint()

    def _step(self, logs: _Logs) -> tuple[dict, tuple]:
        """One RL step with its callbacks, logged metrics and completions -> (its metrics, what
        the callbacks asked for: stop, save, evaluate)."""
        cfg, state, acc, cbs = self.cfg, self.state, self.accelerator, self.callbacks
        self.phase = "callback"
        self._observe()
        cbs.call("on_step_begin")
        self.phase = "step"
        rows: list[dict] = []
        learning_rate = self.parts.optimizer.param_groups[0]["lr"]  # this step's
        m = rl_step(
            self.parts,
            self.tokenizer,
            acc,
            cfg,
            self.objective,
            self.engine,
            step=state.step,
            reward_fns=self.reward_fns,
            table=rows,
            tools=self.tools,
        )
        state.step += 1
        state.count_step(m["skipped_nonfinite"] > 0)
        m["learning_rate"], m["epoch"] = learning_rate, self._epoch()  # as TRL logs
        log_step(m, state.step, logs.bar, logs.metrics, acc, cfg.run.log_with)
        if acc.num_processes > 1:  # one table: every process's completions
            rows = gather_object(rows)
        if logs.table:
            log_completions(rows, state.step, logs.table)
        self.phase = "callback"
        self._observe(m)
        cbs.call("on_step_end", metrics=m)
        cbs.call("on_log", logs=m)
        return m, (cbs.take(acc) if cbs else (0, 0, 0))

    def _ends_after(
        self, m: dict, stop: failures.GracefulStop, end: Ending, wants_stop: bool
    ) -> bool:
        """Whether the run ends after the step that logged `m` (end.status says why): too many
        non-finite steps, the mismatch alarm, a signal, a callback's stop."""
        state, steps = self.state, self.cfg.train.steps
        if state.nonfinite_streak >= failures.MAX_NONFINITE_STEPS:
            end.status = "nonfinite"
            return True
        # the same verdict on every process: the metrics are gathered ones
        stop_message = self.alarm.check(m, state.step, self.main)
        if stop_message:
            end.status, end.message = "mismatch", stop_message
            return True
        if stop.requested(self.accelerator):
            end.status, end.signum = "interrupted", stop.signum
            return True
        if wants_stop and state.step < steps:
            end.status = "stopped"
            end.message = (
                f"stopped by a callback after step {state.step} of {steps} "
                "(run.resume_from=latest with a later train.steps goes on)"
            )
            return True
        return False

    def _epoch(self) -> float:
        """Passes over this process's training examples so far (TRL's epoch; fractional but
        for a stream, whose length is not known)."""
        return self.parts.stream.progress

    def _observe(self, logged: dict | None = None) -> None:
        """The run state callbacks and rewards see, as of now (and a metrics line logged)."""
        rs = self.run_state
        rs.global_step = self.state.step
        rs.epoch = self._epoch()
        if logged:
            rs.log_history.append({**logged, "step": self.state.step})

    def _reward_failed(self, end: Ending, error: RewardError, phase: str) -> None:
        """A reward function failed in a step (before its update: the policy is as the last
        step left it) or an evaluation: with one process that state is saved; with several
        the others may wait in a collective, so the last checkpoint stands (as out of memory).
        The whole exception goes to the run folder's errors.log."""
        end.status, done = "reward_failed", self.state.step
        where = f"step {done + 1}" if phase == "step" else f"the evaluation after step {done}"
        kept = failures.keep_traceback(self.out, error, where, self.accelerator.process_index)
        saved = self.accelerator.num_processes == 1
        if saved:
            end.last = self.checkpoint()
        else:
            end.cut_short = True
        error = RewardError(f"{error} (traceback: {kept})")
        end.message = failures.reward_failed_message(error, where, done, end.last, saved)

    def _interrupted_in_rewards(self, end: Ending, phase: str, signum: int | None) -> None:
        """A signal while reward calls ran (a step's rollouts or repairs, before its update; or
        an evaluation after a step): with one process the policy as the steps done left it is
        saved; with several the others may wait in a collective, so the last checkpoint
        stands."""
        end.status, end.signum, done = "interrupted", signum or signal.SIGINT, self.state.step
        saved = self.accelerator.num_processes == 1
        if saved and (end.last is None or ckpt.step_of(end.last) != done):
            end.last = self.checkpoint()
        if not saved:
            end.cut_short = end.alone = True
        end.message = failures.interrupted_in_rewards_message(
            done, end.last, saved, in_eval=phase == "eval"
        )

    def isolation(self, alone: bool) -> str | None:
        """The isolation modes the sandbox ran tests in during this session of the run, on every
        process ("bwrap"; None: no test ran), whatever ran them (policy.Record). `alone`: this
        process may join no collective, so it states its own."""
        record = sandbox_policy.Record()
        if self.sandbox is not None:
            record.merge(self.sandbox)
        if self.accelerator.num_processes > 1 and not alone:
            record = sandbox_policy.Record()
            for modes in gather_object([self.sandbox.modes if self.sandbox else {}]):
                record.merge(sandbox_policy.Record(modes=modes))
        return record.isolation()

    def _callback_failed(self, end: Ending, error: CallbackError) -> None:
        """A callback raised between steps: the steps done are whole, and with one process
        they are saved (with several, as for a failed reward, the last checkpoint stands)."""
        end.status, done = "failed", self.state.step
        kept = failures.keep_traceback(
            self.out, error, f"after step {done}", self.accelerator.process_index
        )
        saved = self.accelerator.num_processes == 1
        if saved:
            if end.last is None or ckpt.step_of(end.last) != done:
                end.last = self.checkpoint()
        else:
            end.cut_short = end.alone = True
        error = CallbackError(f"{error} (traceback: {kept})")
        end.message = failures.callback_failed_message(error, done, end.last, saved)

    def finish(self, end: Ending) -> dict:
        """Print how the run ended, keep its adapter, write summary.json (before and after the
        final held-out evaluation), then the plots and the Hub upload."""
        cfg, acc, out, main = self.cfg, self.accelerator, self.out, self.main
        # Out of memory with several processes: the others may be inside a collective of this step
        # that this one will never join, so it joins none from here on and ends (the CLI exits 3);
        # the others' collective then fails and the launcher stops the run, instead of everyone
        # waiting for a collective timeout.
        alone = end.alone or (
            end.status in ("out_of_memory", "reward_failed") and acc.num_processes > 1
        )
        if end.message and (main or alone):
            who = f"process {acc.process_index}: " if alone else ""
            print(f"ibpo: {who}{end.message}", file=sys.stderr)
        if self.parts.stream.left_out and main:
            print(
                f"ibpo: {self.parts.stream.left_out} training problems were left out as drawn "
                "(the first's reason is above)",
                file=sys.stderr,
            )
        summary = self._summary(end, self._keep_adapter(end), self.isolation(alone))
        if main:  # written now too: a run killed in its final evaluation still has a summary
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not alone:
            try:
                self.callbacks.call("on_train_end")
            except CallbackError as e:  # the run is done: reported, never costing it
                kept = failures.keep_traceback(out, e, "on_train_end", acc.process_index)
                print(f"ibpo: {e} (traceback: {kept})", file=sys.stderr)
        if end.status in ("completed", "stopped"):
            summary["eval_after"] = _final_eval(self.held_out, acc)
            summary["wall_seconds"] = round(self.wall_seconds(), 1)
        if not alone:
            acc.wait_for_everyone()
            ended_together(acc, True)  # no collective left: the group may go at exit
        if main:
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            finish_run(out, cfg, end.status)
        if cfg.run.log_with and not alone:
            acc.end_training()
        return summary

    def _keep_adapter(self, end: Ending) -> Path | None:
        """The run's adapter in <output_dir>/adapter: the live one, or after a run cut short
        mid-step the last checkpoint's (the live one may be mid-update); None on the processes
        that keep none."""
        adapter = self.out / "adapter"
        if end.cut_short:
            return outdir.keep_checkpoint_adapter(end.last, adapter) if self.main else None
        save_adapter(self.accelerator, self.parts.model, adapter)
        if self.main:
            self.tokenizer.save_pretrained(adapter)
        return adapter

    def _summary(self, end: Ending, adapter: Path | None, isolation) -> dict:
        """summary.json as the run ended, before its final held-out evaluation."""
        return {
            "eval_before": self.state.eval_before,
            "eval_after": None,
            "steps": self.state.step,
            "objective": self.objective.name,
            "model": self.cfg.model.name,
            "quantization": self.cfg.model.quantization,
            "dataset": self.cfg.data.dataset,
            "code": self.code,  # {"version", "commit", "dirty"}: "unknown" without git
            "prompt_template": prompt_template(self.cfg.data),  # None: the prompts as given
            "isolation": isolation,  # the sandbox modes tests ran in; None: no test ran
            "status": end.status,
            "message": end.message,
            "nonfinite_steps": self.state.nonfinite_total,
            "resumed_from": self.resume and str(self.resume),
            "checkpoint": end.last and str(end.last),
            "wall_seconds": round(self.wall_seconds(), 1),
            "adapter": adapter and str(adapter),
            "exit_code": failures.exit_code(end.status, end.signum),  # of `ibpo train`
        }
