"""GPU benchmark: peak memory and speed of one ibpo step on Qwen3 architectures, beside `ibpo plan`.

Each configuration (model size x forced completion length) builds the Qwen3 architecture from its
config with random weights (no download), saves it once and loads it through the package's own
path (ibpo.modeling.load_policy: 4-bit NF4 + LoRA), caps the CUDA allocator to a consumer card
(--cap-gb, default 24 GiB), and runs ibpo.step.rl_step: G completions of one prompt, sampled
at full length (random weights do not stop on EOS reliably, so EOS is suppressed until the last
token), the reference-KL forward and one update with micro_batch_groups=1. It prints the peak
memory of the rollout and of the update (allocated and reserved), rollout and training tokens/s
and step time, with the planner's estimate beside them; an out-of-memory error is reported for
its configuration and the next one runs. Repairs are off (they would double the generation time).

On a GPU machine with torch, transformers, peft and accelerate (bitsandbytes as a wheel in .whl/):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py --out $OUT/bench_gpu.json
Variants: --set K=V ... applies recipe overrides to every configuration (and to the planner), e.g.
--set model.offload_activations=true, or rollout.kv_cache=static.
CPU smoke test (tiny Qwen3, a few seconds): python bench/bench_gpu.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from ibpo import (  # noqa: E402
    sizes,  # noqa: E402
    step,
    trainer,
)
from ibpo.config import load_config  # noqa: E402
from ibpo.data import Example, PromptStream, render_prompt  # noqa: E402
from ibpo.logprobs import unwrap  # noqa: E402
from ibpo.modeling import load_policy  # noqa: E402
from ibpo.objectives import resolve_params  # noqa: E402
from ibpo.plan import fit as plan  # noqa: E402
from ibpo.rewards import REWARDS  # noqa: E402
from ibpo.rollout import set_kv_cache  # noqa: E402

# The published Qwen3 architectures by size (ibpo.plan.fit's table), and a tiny one for --smoke.
ARCHS = {name.split("-")[-1].lower(): arch for name, arch in sizes.KNOWN_ARCHITECTURES.items()}
ARCHS["tiny"] = ARCHS["8b"] | dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=256, tie_word_embeddings=False,
)  # fmt: skip
CHARS = "0123456789+-*=?:. abcdefghijklmnopqrstuvwxyz\n<>/"
SPECIALS = ["<pad>", "<eos>", "<unk>"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip


def make_tokenizer(vocab_size: int):
    """A character tokenizer padded with filler tokens to the model's vocabulary, so that every
    sampled id decodes (the real Qwen3 tokenizer would need the Hub)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + list(CHARS)
    tokens += [f"<t{i}>" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = TEMPLATE
    return tok


def model_dir(arch: dict, root: Path) -> Path:
    return root / f"qwen3-h{arch['hidden_size']}-l{arch['num_hidden_layers']}"


def build_model_dir(arch: dict, root: Path, device: torch.device) -> Path:
    """Random-weight checkpoint of `arch` in the compute dtype, initialised on the device."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = model_dir(arch, root)
    if (path / "config.json").is_file():
        return path
    config = Qwen3Config(
        **{k: v for k, v in arch.items() if k != "model_type"},
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    make_tokenizer(arch["vocab_size"]).save_pretrained(path)
    del model
    _free()
    return path


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return step.memory_metrics(device)["peak_memory_gb"], 0.0  # CPU: peak RSS
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


def _track_rollout(device: torch.device, record: dict):
    """Wrap the trainer's rollout call: its peak memory is recorded, then the peak counter is
    reset so that what rl_step reports afterwards is the update's peak."""
    name = "collect_batch"
    inner = getattr(step, name)

    def wrapped(*args, **kwargs):
        record["phase"] = "rollout"
        if device.type == "cuda":  # from here on: live state + the rollout's own peak
            torch.cuda.reset_peak_memory_stats()
        out = inner(*args, **kwargs)
        record["rollout_alloc_gb"], record["rollout_reserved_gb"] = _peak(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        record["phase"] = "update"
        return out

    setattr(step, name, wrapped)
    return lambda: setattr(step, name, inner)


def bench_config(arch_name, new_tokens, args, root, device) -> dict:
    arch = ARCHS[arch_name]
    row = {
        "model": f"qwen3-{arch_name}",
        "new_tokens": new_tokens,
        "group_size": args.group_size,
        "overrides": args.set,
    }
    t0 = time.perf_counter()
    path = build_model_dir(arch, root, device)
    row["build_s"] = round(time.perf_counter() - t0, 1)
    tok = make_tokenizer(arch["vocab_size"])
    question = ("what is 12 + 34 * 5 - 6 ? " * 1000)[: args.prompt_chars]
    overrides = [
        f"model.name={path}",
        "model.quantization=nf4",
        f"model.lora_r={args.lora_r}",
        f"model.lora_alpha={2 * args.lora_r}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={new_tokens}",
        f"rollout.generation_batch_size={args.group_size}",
        "train.prompts_per_step=1",
        "train.micro_batch_groups=1",
        "data.eval_size=0",
        "objective.reward=bench_alternating",
        "repair.enabled=false",
        *args.set,
    ]
    cfg = load_config(None, overrides)
    cfg.data.max_prompt_tokens = len(tok(render_prompt(tok, question, cfg.data))["input_ids"])
    p = plan.estimate(arch, cfg, 1, args.cap_gb)
    row.update(
        prompt_tokens=cfg.data.max_prompt_tokens,
        plan_peak_phase=p.peak_phase,
        plan_allocated_gb=round(p.allocated_gb, 4),
        plan_peak_gb=round(p.peak_gb, 4),
        plan_fits=p.fits,
        **{f"plan_{k}_gb": round(sum(v.values()), 4) for k, v in p.phases.items()},
    )
    record: dict = {"phase": "load"}
    restore = _track_rollout(device, record)
    try:
        row.update(_run_steps(cfg, question, args, device, record))
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        row["status"] = f"OOM during {record['phase']}"
    finally:
        restore()
        row.update({k: round(v, 2) for k, v in record.items() if k.endswith("_gb")})
        _free()
    return row


def _run_steps(cfg, question, args, device, record) -> dict:
    from accelerate import Accelerator

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, tok = load_policy(cfg.model, device)
    set_kv_cache(model, cfg.rollout.kv_cache)
    unwrap(model).generation_config.min_new_tokens = cfg.rollout.max_new_tokens  # full length
    optimizer = trainer.build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = Accelerator(cpu=device.type == "cpu")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    load_s = time.perf_counter() - t0
    record["load_alloc_gb"] = _peak(device)[0]
    objective = resolve_params(cfg.objective)
    examples = [Example(question, "0")]
    parts = step.StepParts(
        model, optimizer, scheduler, PromptStream(examples, 0, False), random.Random(0)
    )
    try:
        for i in range(args.steps):  # the last step's numbers are reported
            record["phase"] = "rollout"
            m = step.rl_step(parts, tok, accelerator, cfg, objective, step=i)
    finally:
        accelerator.free_memory()
        del model, optimizer, scheduler, parts
    n, T = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    t_gen = m.get("time_generate", m.get("time_rollout"))
    alloc, reserved = _peak(device)
    return dict(
        load_s=round(load_s, 1),
        completion_length=m["completion_length"],
        rollout_tokens_per_s=round(n * T / t_gen, 1),
        train_tokens_per_s=round(n * (cfg.data.max_prompt_tokens + T) / m["time_update"], 1),
        time_generate_s=round(t_gen, 2),
        time_update_s=round(m["time_update"], 2),
        step_time_s=round(m["step_time"], 2),
        update_alloc_gb=round(alloc, 2),
        update_reserved_gb=round(reserved, 2),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        default="8b:1024,4b:2048,1.7b:4096",
        help="comma-separated SIZE:NEW_TOKENS, sizes: " + ", ".join(ARCHS),
    )
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=256, help="~ prompt tokens")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--cap-gb", type=float, default=24.0, help="CUDA allocator cap (GiB)")
    ap.add_argument("--budget-s", type=float, default=450, help="skip configs started later")
    ap.add_argument("--model-root", default=None, help="where random checkpoints are written")
    ap.add_argument("--out", default=None, help="also write the results JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny Qwen3 on CPU, a few seconds")
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="K=V",
        help="recipe overrides for every configuration, e.g. "
        "model.offload_activations=true rollout.kv_cache=static",
    )
    args = ap.parse_args()
    if args.smoke:
        args.configs, args.group_size, args.prompt_chars = "tiny:8", 4, 24
        torch.set_num_threads(1)  # a tiny model gains nothing from threads that a busy CPU stalls
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    start = time.perf_counter()
    calls = itertools.count()  # alternate rewards 0/1 so every group has a learning signal
    REWARDS["bench_alternating"] = lambda text, answer: float(next(calls) % 2)
    root = Path(args.model_root or tempfile.mkdtemp(prefix="ibpo-bench-"))
    if device.type == "cuda":  # emulate the consumer card (8B's bf16 build fits under 24 GiB)
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb / total))
    results: list[dict] = []
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "cap_gb": args.cap_gb,
        "results": results,
    }
    for item in args.configs.split(","):
        arch_name, new_tokens = item.split(":")
        if time.perf_counter() - start > args.budget_s:
            results.append({"model": f"qwen3-{arch_name}", "status": "skipped (time budget)"})
            continue
        print(f"# {arch_name} x {new_tokens} new tokens ...", file=sys.stderr, flush=True)
        row = bench_config(arch_name, int(new_tokens), args, root, device)
        if not args.model_root:  # a temporary checkpoint: free the disk for the next one
            shutil.rmtree(model_dir(ARCHS[arch_name], root), ignore_errors=True)
        row["elapsed_s"] = round(time.perf_counter() - start, 1)
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after every configuration: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
