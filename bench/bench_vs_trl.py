"""Step time and peak memory of ibpo against TRL's GRPOTrainer, same model, data and budget, CPU.

    HF_HUB_OFFLINE=1 python bench/bench_vs_trl.py                 # SmolLM2-135M, G=8, 64 tokens
    HF_HUB_OFFLINE=1 python bench/bench_vs_trl.py --steps 5 --rounds 3
    HF_HUB_OFFLINE=1 python bench/bench_vs_trl.py train.micro_batch_groups=1   # ibpo knob
    HF_HUB_OFFLINE=1 python bench/bench_vs_trl.py --smoke --model PATH   # tiny check
    HF_HUB_OFFLINE=1 python bench/bench_vs_trl.py --smoke --in-process --model PATH   # CI

Needs TRL (`pip install ibpo[bench]`). Runs alternate trl, ibpo, trl, ibpo, ... (`--rounds` pairs),
each in a fresh process, so every run's peak memory is its own and a drift of the machine's speed
spreads over both (`--in-process` skips the fresh processes, for CI smoke runs only). Each run
does `--warmup` untimed steps, then `--steps` timed ones. Printed: the raw figures of every run,
the medians per framework and the ratios ibpo / trl, then a JSON line.
Trailing `section.key=value` arguments are ibpo config overrides for the ibpo runs only (applied
after the matched settings below, and printed with the results).

Matched on both sides:
* model and load: the same weights, `from_pretrained` with the same BitsAndBytesConfig (NF4,
  double quantisation, fp32 compute and storage dtype: ibpo.modeling's), fp32 compute, sdpa
  attention, no autocast (TRL: bf16=False, fp16=False); LoRA r=16, alpha=32, dropout 0,
  all-linear, only the adapter trainable; no reference model (TRL beta=0, ibpo kl_coef=0 and
  train.log_reference_kl=false, which otherwise adds one no-grad forward per step to ibpo);
  gradient checkpointing on, non-reentrant, for both; the bitsandbytes CPU repack fix
  (ibpo.modeling.disable_cpu_bf16_repack) applied to both.
* data: the same prompts in the same order (built-in arithmetic, ibpo's seeded stream, rendered by
  ibpo.data.render_prompt; TRL gets the rendered strings, shuffle off) and the same reward
  (ibpo.rewards.math_reward wrapped into TRL's reward-function signature).
* one step = B prompts x G completions, sampled (temperature 1, top-p 1, top-k off) in one
  `generate` call, then ONE forward/backward over all B*G sequences and one optimizer step:
  TRL num_generations=G, per_device_train_batch_size=B*G, gradient_accumulation_steps=1,
  steps_per_generation=1 (so generation_batch_size=B*G), num_iterations=1; ibpo
  prompts_per_step=B, micro_batch_groups=B, generation_batch_size=B*G, updates_per_rollout=1.
* length: every completion is exactly `--max-new-tokens` long (min_new_tokens = max_new_tokens on
  both sides: EOS is suppressed until then), so both do the same work whatever the sampled text;
  `--natural-length` lets completions stop at EOS instead (then lengths differ by chance).
* optimizer: torch AdamW (TRL optim=adamw_torch, not its default fused kernel), the same learning
  rate, weight decay 0, constant schedule, gradient clipping at 1.0.
* objective: TRL loss_type="grpo" with scale_rewards="group", epsilon 0.2; ibpo objective "grpo"
  (the same clipped surrogate and sequence-mean aggregation). `--ibpo-objective` picks another
  (objective "ibpo" adds its counterfactual repairs, i.e. extra generation).
* timing: wall time of each optimizer step (TRL: a callback from on_step_begin to on_step_end;
  ibpo: around `rl_step`), both covering prompt preparation, generation, rewards, advantages, the
  update and the optimizer. Peak memory: the resident-set high-water mark, reset after warmup, so
  it covers the timed steps (plus the whole process's peak, loading included, for reference).
* threads: both use torch's default thread count (set OMP_NUM_THREADS to change both).

What differs (each side's own design, left as is): TRL on CPU runs its fused LM head over every
position of the sequence (prompt and padding included; it scores only completion positions where
Triton is available), ibpo only over completion positions; TRL keeps logging buffers and computes
its metrics; the Trainer's dataloader and callbacks; what each imports counts in its resident set
(TRL's imports add about 0.1 GB). One TRL default is undone: for 4-bit models TRL casts the LoRA
weights to bf16 (QLoRA paper practice); here they are cast back to fp32 after the trainer is
built, because a CPU without bf16 units runs bf16 matmuls slowly and the comparison is of
frameworks at fp32, not of dtypes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the workers import bench_step

RESULT = "RESULT "  # prefix of the worker's one JSON line on stdout
TARGETS = {"step_time": 0.5, "peak_memory_gb": 0.5}  # ibpo / trl ratios the project aims for


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="local folder, Hub id or smollm2-135m")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, per run")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs (trl, ibpo)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--quantization", choices=["nf4", "none"], default="nf4")
    p.add_argument("--ibpo-objective", default="grpo")
    p.add_argument("--natural-length", action="store_true", help="stop completions at EOS")
    p.add_argument("--smoke", action="store_true", help="tiny: G=2, 4 tokens, 1 step, 1 round")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="no fresh process per run (peaks are then not per run): for CI smoke only",
    )
    p.add_argument("--worker", choices=["trl", "ibpo"], help=argparse.SUPPRESS)
    p.add_argument("ibpo_set", nargs="*", help="section.key=value for the ibpo runs only")
    ns = p.parse_intermixed_args(argv)
    if ns.smoke:
        ns.group_size, ns.max_new_tokens, ns.steps, ns.rounds = 2, 4, 1, 1
    if ns.steps < 1 or ns.rounds < 1 or ns.warmup < 0 or ns.group_size < 2:
        p.error("need --steps >= 1, --rounds >= 1, --warmup >= 0, --group-size >= 2")
    return ns


def prompts(ns, tokenizer) -> list[tuple[str, str]]:
    """(rendered prompt, gold answer) for every step of a run, in ibpo's stream order."""
    from ibpo.config import DataConfig
    from ibpo.data import PromptStream, load_splits, render_prompt

    data = DataConfig()
    train, _ = load_splits(data, seed=0)
    stream = PromptStream(train, seed=0, shuffle=True)
    taken = stream.take((ns.warmup + ns.steps) * ns.prompts_per_step)
    return [(render_prompt(tokenizer, ex.question, data), ex.answer) for ex in taken]


# --- the ibpo side ---------------------------------------------------------------------------


def ibpo_overrides(ns) -> list[str]:
    B, G = ns.prompts_per_step, ns.group_size
    return [
        f"model.name={ns.model}",
        f"model.quantization={ns.quantization}",
        "model.dtype=float32",
        "model.lora_r=16",
        "model.lora_alpha=32",
        "model.lora_target_modules=all-linear",
        "model.gradient_checkpointing=true",
        "data.dataset=builtin:arithmetic",
        f"rollout.group_size={G}",
        f"rollout.max_new_tokens={ns.max_new_tokens}",
        f"rollout.generation_batch_size={B * G}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        f"objective.name={ns.ibpo_objective}",
        "objective.kl_coef=0.0",
        f"train.prompts_per_step={B}",
        f"train.micro_batch_groups={B}",
        "train.updates_per_rollout=1",
        f"train.learning_rate={ns.learning_rate}",
        "train.lr_scheduler=constant",
        "train.warmup_steps=0",
        "train.max_grad_norm=1.0",
        "train.optimizer=adamw",
        "train.log_reference_kl=false",
        "train.seed=0",
        *ns.ibpo_set,
    ]


def run_ibpo(ns) -> dict:
    import bench_step  # the ibpo side is bench_step's build and timed-step loop

    from ibpo.logprobs import unwrap
    from ibpo.recipe import load_config

    cfg = load_config(None, ibpo_overrides(ns))
    run = bench_step.build(cfg, cpu=True)
    if not ns.natural_length:  # generate() merges these defaults with its own arguments
        unwrap(run.model).generation_config.min_new_tokens = ns.max_new_tokens
    out = bench_step.run_steps(run, ns.steps, ns.warmup)
    per_step = out["per_step"]
    return {
        "step_times": [s["wall"] for s in per_step],
        "completion_length": statistics.fmean(s["completion_length"] for s in per_step),
        "peak_memory_gb": out["peak_memory_gb"],
        "peak_memory_scope": out["peak_memory_scope"],
        "process_peak_memory_gb": out["process_peak_memory_gb"],
    }


# --- the TRL side ----------------------------------------------------------------------------


def _step_clock(warmup: int, record: dict):
    import bench_step
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall time per optimizer step; the memory peak restarts after the warmup steps."""

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            record["all_steps"].append(time.perf_counter() - self.start)
            if len(record["all_steps"]) == warmup:
                cpu = torch.device("cpu")
                record["setup_peak"] = bench_step.peak_memory_gb(cpu)
                record["steps_only"] = bench_step.reset_peak_memory(cpu)

    return StepClock()


def _math_reward_for_trl(lengths: list[int]):
    from ibpo.rewards import math_reward

    def math_answer(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        lengths.extend(len(ids) for ids in completion_ids)
        return [math_reward(c, a) for c, a in zip(completions, answer)]

    return math_answer


def run_trl(ns) -> dict:
    import bench_step
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from ibpo.modeling import (
        _quantization_config,
        disable_cpu_bf16_repack,
        load_tokenizer,
        resolve_model_path,
    )

    torch.manual_seed(0)
    cpu, dtype, path = torch.device("cpu"), torch.float32, resolve_model_path(ns.model)
    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    if ns.quantization == "nf4":
        kwargs.update(quantization_config=_quantization_config(dtype), device_map={"": cpu})
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = load_tokenizer(path)
    rows = prompts(ns, tokenizer)
    dataset = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})
    B, G = ns.prompts_per_step, ns.group_size
    record: dict = {"all_steps": [], "setup_peak": None, "steps_only": False}
    lengths: list[int] = []
    out_dir = tempfile.mkdtemp(prefix="bench-trl-")  # the Trainer wants one; nothing is saved
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        max_steps=ns.warmup + ns.steps,
        learning_rate=ns.learning_rate,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        num_generations=G,
        per_device_train_batch_size=B * G,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=ns.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        use_vllm=False,
        shuffle_dataset=False,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        generation_kwargs=None if ns.natural_length else {"min_new_tokens": ns.max_new_tokens},
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_pin_memory=False,
    )
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[_math_reward_for_trl(lengths)],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[_step_clock(ns.warmup, record)],
    )
    for p in trainer.model.parameters():  # undo TRL's bf16 adapters for 4-bit models (docstring)
        if p.requires_grad:
            p.data = p.data.float()
    disable_cpu_bf16_repack(trainer.model)
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    timed = record["all_steps"][ns.warmup :]
    peak = bench_step.peak_memory_gb(cpu)
    return {
        "step_times": timed,
        "completion_length": statistics.fmean(lengths[ns.warmup * B * G :]),
        "peak_memory_gb": peak,
        "peak_memory_scope": "timed steps" if record["steps_only"] else "process",
        "process_peak_memory_gb": max(peak, record["setup_peak"] or 0.0),
    }


# --- the driver ------------------------------------------------------------------------------


def measure(ns, framework: str) -> dict:
    import torch

    result = (run_trl if framework == "trl" else run_ibpo)(ns)
    result.update(framework=framework, threads=torch.get_num_threads())
    if framework == "trl":
        import trl

        result["trl_version"] = trl.__version__
    return result


def launch(framework: str, argv: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", framework]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise RuntimeError(f"the {framework} run failed (exit {proc.returncode}); output above")
    return json.loads(lines[-1][len(RESULT) :])


def summarize(runs: list[dict]) -> dict:
    def med(fw: str, key: str) -> float:
        return statistics.median(
            statistics.fmean(r[key]) if key == "step_times" else r[key]
            for r in runs
            if r["framework"] == fw
        )

    keys = ["step_times", "peak_memory_gb", "process_peak_memory_gb", "completion_length"]
    out = {fw: {k: med(fw, k) for k in keys} for fw in ("trl", "ibpo")}
    out["ratio"] = {k: out["ibpo"][k] / out["trl"][k] for k in keys[:3]}
    return out


def report(ns, runs: list[dict], summary: dict) -> str:
    lines = [
        f"model {ns.model} ({ns.quantization}), B={ns.prompts_per_step} G={ns.group_size} "
        f"max_new_tokens={ns.max_new_tokens} ({'natural' if ns.natural_length else 'forced'} "
        f"length), {ns.steps} timed steps after {ns.warmup} warmup, {runs[0]['threads']} threads, "
        f"TRL {next(r['trl_version'] for r in runs if 'trl_version' in r)}, "
        f"ibpo objective {ns.ibpo_objective}"
        + (f", ibpo overrides: {' '.join(ns.ibpo_set)}" if ns.ibpo_set else ""),
        "",
        "| run | framework | step s (mean) | steps s | peak GB (timed steps) | peak GB (process) "
        "| completion length |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for i, r in enumerate(runs, 1):
        steps = " ".join(f"{t:.2f}" for t in r["step_times"])
        lines.append(
            f"| {i} | {r['framework']} | {statistics.fmean(r['step_times']):.3f} | {steps} "
            f"| {r['peak_memory_gb']:.3f} | {r['process_peak_memory_gb']:.3f} "
            f"| {r['completion_length']:.1f} |"
        )
    t, b, q = summary["trl"], summary["ibpo"], summary["ratio"]
    lines += [
        "",
        "| median over runs | trl | ibpo | ibpo / trl | target |",
        "|---|---:|---:|---:|---:|",
        f"| step time s | {t['step_times']:.3f} | {b['step_times']:.3f} | {q['step_times']:.2f} "
        f"| <= {TARGETS['step_time']} |",
        f"| peak RSS GB, timed steps | {t['peak_memory_gb']:.3f} | {b['peak_memory_gb']:.3f} "
        f"| {q['peak_memory_gb']:.2f} | <= {TARGETS['peak_memory_gb']} |",
        f"| peak RSS GB, whole process | {t['process_peak_memory_gb']:.3f} "
        f"| {b['process_peak_memory_gb']:.3f} | {q['process_peak_memory_gb']:.2f} | |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse(argv)
    if ns.worker:
        print(RESULT + json.dumps(measure(ns, ns.worker)), flush=True)
        return 0
    runs = []
    for r in range(ns.rounds):
        for framework in ("trl", "ibpo"):
            print(f"[run] round {r + 1}/{ns.rounds}: {framework}", flush=True)
            runs.append(measure(ns, framework) if ns.in_process else launch(framework, argv))
    summary = summarize(runs)
    print(report(ns, runs, summary))
    print(json.dumps({"settings": vars(ns), "runs": runs, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
