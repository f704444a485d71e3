"""Where the time of an RL step goes: per-phase seconds, tokens/s and peak memory of any recipe.

    python bench/bench_step.py recipes/smollm2_135m/arithmetic_ibpo_cpu.yaml --steps 3
    python bench/bench_step.py objective.name=grpo rollout.max_new_tokens=64 --steps 5
    python bench/bench_step.py --smoke --model PATH       # tiny 1-step check (CI)
    (--cpu keeps a CUDA machine's run on the CPU; the device is Accelerate's choice otherwise)

The steps are the package's own: the model, optimizer, scheduler and prompt stream are built as
`ibpo.trainer.run_recipe` builds them and each step is `ibpo.step.rl_step`. No held-out evaluation,
no checkpoint. Phases of a step (seconds, mean over the timed steps):

    generate    sampling the G completions per prompt            (metric time_generate)
    repair      IBPO counterfactual repairs, generated and graded (metric time_repair)
    score       grading and advantages: the rest of the rollout phase
    frozen      old / reference log-probs without grad           (metric time_frozen_logprobs)
    update      micro-batch updates + optimizer                  (metric time_update), split into
      forward   log-probs with grad: `ibpo.step.sequence_logprobs` timed by a wrapper here
      backward  `accelerator.backward`, timed by a wrapper
      optimizer gradient clipping + `optimizer.step`, timed by wrappers
      other     objective math and per-step diagnostics

The wrappers only time the calls the step makes (they are removed afterwards); on CUDA they
synchronise the device first, so the split is exact there too. `--warmup` steps run first and are
left out of every figure, peak memory included: the peak is reset after warmup (CUDA:
max_memory_allocated; CPU: the resident-set high-water mark, reset through /proc/self/clear_refs on
Linux; where that is not allowed the CPU figure is the whole process's ru_maxrss). The whole
process's peak (loading included) is reported too.

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import re
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# A tiny step for CI: two prompts, two completions each, four new tokens, IBPO repairs on.
SMOKE = [
    "rollout.group_size=2",
    "train.prompts_per_step=2",
    "rollout.max_new_tokens=4",
    "repair.cost_share=1",  # 4-token completions leave no budget for a repair prompt
    "repair.min_success=0",  # and the timed step repairs whatever the warm-up one returned
    "repair.reference_selection=correct_first",  # the tiny model is never correct
    "model.quantization=none",
    "train.log_reference_kl=false",
    "objective.kl_coef=0.0",  # no reference forward
]
PHASES = ["generate", "repair", "score", "frozen", "update", "forward", "backward", "optimizer",
          "other"]  # fmt: skip


@dataclass
class Run:
    """Everything `rl_step` needs, built as `ibpo.trainer.run_recipe` builds it."""

    cfg: object
    accelerator: object
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    stream: object
    objective: object
    rng: random.Random

    @property
    def device(self) -> torch.device:
        return self.accelerator.device


def build(cfg, cpu: bool = False) -> Run:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from ibpo.data import PromptStream, load_splits
    from ibpo.generation import set_kv_cache
    from ibpo.modeling import load_policy
    from ibpo.recipe import resolve_params
    from ibpo.trainer import build_optimizer, lr_lambda

    accelerator = Accelerator(cpu=cpu)
    set_seed(cfg.train.seed)
    train_examples, _ = load_splits(cfg.data, cfg.train.seed)
    stream = PromptStream(
        train_examples,
        cfg.train.seed,
        shuffle=True,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
    )
    model, tokenizer = load_policy(cfg.model, accelerator.device)
    set_kv_cache(model, "dynamic")  # as the trainer sets it
    optimizer = build_optimizer(model, cfg, accelerator.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return Run(
        cfg,
        accelerator,
        model,
        tokenizer,
        optimizer,
        scheduler,
        stream,
        resolve_params(cfg.objective),
        random.Random(cfg.train.seed),
    )


# --- memory ----------------------------------------------------------------------------------


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: peak allocated; CPU: resident-set high-water mark (since the last reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 2**20  # kB
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak; False when the OS does not allow it (the peak then covers the process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM (and ru_maxrss)
        return True
    except OSError:
        return False


# --- phase timers ----------------------------------------------------------------------------


def _timed(fn, totals: dict[str, float], key: str, sync):
    def wrapper(*args, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            totals[key] += time.perf_counter() - start

    return wrapper


@contextlib.contextmanager
def phase_timers(run: Run) -> Iterator[dict[str, float]]:
    """Time forward / backward / optimizer inside `rl_step`'s update loop; restores on exit."""
    import ibpo.step as update

    totals: dict[str, float] = defaultdict(float)
    cuda = run.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(run.device)) if cuda else (lambda: None)
    original = update.sequence_logprobs
    timed_logprobs = _timed(original, totals, "forward", sync)

    def logprobs(*args, **kwargs):  # the no-grad calls belong to the `frozen` phase
        return (timed_logprobs if torch.is_grad_enabled() else original)(*args, **kwargs)

    acc, opt = run.accelerator, run.optimizer
    # instance attributes shadow the methods; remember any that already existed
    saved = [
        (o, n, o.__dict__.get(n))
        for o, n in [(acc, "backward"), (acc, "clip_grad_norm_"), (opt, "step")]
    ]
    update.sequence_logprobs = logprobs
    acc.backward = _timed(acc.backward, totals, "backward", sync)
    acc.clip_grad_norm_ = _timed(acc.clip_grad_norm_, totals, "optimizer", sync)
    opt.step = _timed(opt.step, totals, "optimizer", sync)
    try:
        yield totals
    finally:
        update.sequence_logprobs = original
        for obj, name, before in saved:
            if before is None:
                delattr(obj, name)  # the class method shows again
            else:
                setattr(obj, name, before)


# --- the benchmark ---------------------------------------------------------------------------


def step_phases(m: dict, totals: dict[str, float], wall: float) -> dict[str, float]:
    gen, rep = m.get("time_generate", 0.0), m.get("time_repair", 0.0)
    update = m["time_update"]
    inner = totals["forward"] + totals["backward"] + totals["optimizer"]
    repair_tokens = m.get("repair_tokens", 0.0)
    return {
        "generate": gen,
        "repair": rep,
        "score": max(m["time_rollout"] - gen - rep, 0.0),
        "frozen": m["time_frozen_logprobs"],
        "update": update,
        "forward": totals["forward"],
        "backward": totals["backward"],
        "optimizer": totals["optimizer"],
        "other": max(update - inner, 0.0),
        "step": m["step_time"],
        "wall": wall,
        "completion_tokens": m["tokens_per_second"] * m["step_time"],
        "completion_length": m["completion_length"],
        "rollout_tokens": m["generated_tokens"] - repair_tokens,
        "repair_tokens": repair_tokens,
    }


def run_steps(run: Run, steps: int, warmup: int) -> dict:
    """Warmup steps, then `steps` timed steps; returns the per-step figures and their means."""
    from ibpo.step import rl_step
    from ibpo.step_parts import StepParts

    parts = StepParts(run.model, run.optimizer, run.scheduler, run.stream, run.rng)

    done = itertools.count()  # steps done so far: each step samples from its own streams

    def one_step() -> dict:
        return rl_step(
            parts, run.tokenizer, run.accelerator, run.cfg, run.objective, step=next(done)
        )

    for _ in range(warmup):
        one_step()
    setup_peak = peak_memory_gb(run.device)  # loading + warmup, read before the reset
    steps_only = reset_peak_memory(run.device)
    per_step = []
    with phase_timers(run) as totals:
        for _ in range(steps):
            totals.clear()
            start = time.perf_counter()
            m = one_step()
            per_step.append(step_phases(m, totals, time.perf_counter() - start))
    mean = {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
    peak = peak_memory_gb(run.device)
    return {
        "mean": mean,
        "per_step": per_step,
        "tokens_per_second": mean["completion_tokens"] / mean["step"],
        "generate_tokens_per_second": mean["rollout_tokens"] / max(mean["generate"], 1e-9),
        "peak_memory_gb": peak,
        "peak_memory_scope": "timed steps" if steps_only else "process",
        "process_peak_memory_gb": max(peak, setup_peak),
    }


def table(result: dict) -> str:
    mean, step = result["mean"], result["mean"]["step"]
    lines = ["| phase | s / step | % of step |", "|---|---:|---:|"]
    for name in PHASES:
        indent = "&nbsp;&nbsp;" if name in ("forward", "backward", "optimizer", "other") else ""
        lines.append(f"| {indent}{name} | {mean[name]:.3f} | {100 * mean[name] / step:.1f} |")
    lines.append(f"| **step** | **{step:.3f}** | 100.0 |")
    mem = "GB allocated" if result["device"] == "cuda" else "GB RSS"
    lines += [
        "",
        f"completion tokens / step: {mean['completion_tokens']:.0f} "
        f"(mean length {mean['completion_length']:.1f})",
        f"tokens/s (completion tokens / step time): {result['tokens_per_second']:.1f}",
        f"generate tokens/s: {result['generate_tokens_per_second']:.1f}",
        f"peak memory ({result['peak_memory_scope']}): {result['peak_memory_gb']:.3f} {mem}; "
        f"whole process incl. loading: {result['process_peak_memory_gb']:.3f} {mem}",
    ]
    return "\n".join(lines)


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("args", nargs="*", help="[RECIPE.yaml] [section.key=value ...]")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 3; smoke 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--model", default=None, help="model.name (a local folder or Hub id)")
    p.add_argument("--smoke", action="store_true", help="a tiny step (needs --model), for CI")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is there")
    ns = p.parse_intermixed_args(argv)
    if ns.smoke and not ns.model:
        p.error("--smoke needs --model (a small local model folder)")
    recipe = ns.args[0] if ns.args and "=" not in ns.args[0] else None
    overrides = ns.args[1:] if recipe else list(ns.args)
    overrides = (SMOKE if ns.smoke else []) + overrides
    if ns.model:
        overrides.append(f"model.name={ns.model}")
    steps = ns.steps if ns.steps is not None else (1 if ns.smoke else 3)
    if steps < 1 or ns.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return recipe, overrides, steps, ns.warmup, ns.cpu


def main(argv: list[str] | None = None) -> int:
    from ibpo.config import ConfigError
    from ibpo.recipe import load_config

    recipe, overrides, steps, warmup, cpu = parse(argv)
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run = build(cfg, cpu=cpu)
    result = run_steps(run, steps, warmup)
    result.update(
        recipe=recipe,
        overrides=overrides,
        steps=steps,
        warmup=warmup,
        device=run.device.type,
        objective=cfg.objective.name,
        model=cfg.model.name,
        quantization=cfg.model.quantization,
        group_size=cfg.rollout.group_size,
        prompts_per_step=cfg.train.prompts_per_step,
        max_new_tokens=cfg.rollout.max_new_tokens,
        threads=torch.get_num_threads(),
    )
    print(
        f"{cfg.objective.name} on {cfg.model.name} ({cfg.model.quantization}, {run.device.type},"
        f" {torch.get_num_threads()} threads): B={cfg.train.prompts_per_step} "
        f"G={cfg.rollout.group_size} max_new_tokens={cfg.rollout.max_new_tokens}, "
        f"{steps} timed steps after {warmup} warmup"
    )
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
