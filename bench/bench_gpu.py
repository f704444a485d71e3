"""GPU benchmark: peak memory and speed of each phase of one ibpo step, beside `ibpo plan`.

Each configuration builds a Qwen3 architecture from its config with random weights directly on
the device (no checkpoint is written: ibpo.modeling.quantize_nf4 turns the decoder's linear
layers into NF4 in place, then ibpo.modeling.load_policy adds LoRA as for a loaded model), under
an allocator cap that emulates a consumer card (--cap-gb, default 23.5 GiB: a 24 GB card less
what torch's cap does not see). Completions are forced to full length (random weights do not
stop on EOS reliably). Configurations, in --configs order:
  recipe          --recipe's own shapes (default recipes/qwen3_8b/math_ibpo_1gpu.yaml): one
                  generation batch (generation_batch_size completions, prompts of
                  data.max_prompt_tokens), repairs at repair.batch_size, the update with the
                  recipe's micro-batch and LoRA rank, one evaluation batch, then the same
                  update again with model.offload_activations=true;
  SIZE:TOKENS     a smaller model (0.6b, 1.7b, 4b, 8b) at TOKENS new tokens, group of 8, no
                  repairs, no evaluation.
Phases: build, load, rollout, repairs, update, evaluation, update_offload. After every phase the
row is rewritten to --out (a run ended by a timeout keeps what it measured): the phase's seconds,
tokens/s, torch's peak allocated and reserved, the device's peak use from torch.cuda.mem_get_info
(sampled through the phase: CUDA context, bitsandbytes' paged state, anything outside torch's
cap), and the planner's figure for the same phase; after the update, the rollout-vs-trainer
mismatch (mismatch_kl, mismatch_abs_max). Any exception in a configuration is recorded (type,
message, phase) and the next configuration runs.

--quantization none (what scripts/gpu_check.py passes when bitsandbytes' CUDA kernels fail): a
bf16 base without 4-bit and torch AdamW; `recipe` then uses the largest Qwen3 the planner fits
under the cap with the recipe's shapes, and a SIZE that does not fit is skipped, saying so.

On a GPU machine (bitsandbytes as a wheel in .whl/):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py --out $OUT/bench_gpu.json
CPU smoke test (tiny Qwen3, recipe shapes scaled down, seconds): python bench/bench_gpu.py --smoke
Not here: several GPUs, vLLM (bench/bench_vllm.py), real weights.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import random
import re
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from ibpo import sizes, step, trainer  # noqa: E402
from ibpo.data import Example, PromptStream, render_prompt  # noqa: E402
from ibpo.logprobs import unwrap  # noqa: E402
from ibpo.modeling import compute_dtype, load_policy, quantize_nf4  # noqa: E402
from ibpo.plan import fit as plan  # noqa: E402
from ibpo.recipe import load_config, resolve_params  # noqa: E402
from ibpo.rewards import REWARDS  # noqa: E402
from ibpo.rollout import set_kv_cache  # noqa: E402

# The published Qwen3 architectures by size (ibpo.plan.fit's table), and a tiny one for --smoke.
ARCHS = {name.split("-")[-1].lower(): arch for name, arch in sizes.KNOWN_ARCHITECTURES.items()}
ARCHS["tiny"] = ARCHS["8b"] | dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=256, tie_word_embeddings=False,
)  # fmt: skip
RECIPE = ROOT / "recipes" / "qwen3_8b" / "math_ibpo_1gpu.yaml"
# evaluation before update_offload: if the stage's timeout ends the row, the planner's phases
# are measured first
PHASES = ("build", "load", "rollout", "repairs", "update", "evaluation", "update_offload")
PLAN_PHASE = {"rollout": "generation", "repairs": "repair", "update": "training",
              "update_offload": "training", "evaluation": "evaluation"}  # fmt: skip
BENCH_REWARD = "bench_one_in_four"
CHARS = "0123456789+-*=?:. abcdefghijklmnopqrstuvwxyz\n<>/"
SPECIALS = ["<pad>", "<eos>", "<unk>"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip


_CALLS = itertools.count()


def one_in_four(text: str, answer: str) -> float:
    """The bench's reward: one completion in four fails, so every group of 8 has signal and
    repairs have work (a quarter of the generation batch: the recipe's repair batch)."""
    return float(next(_CALLS) % 4 != 0)


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


def build_base(arch: dict, quantization: str, dtype: torch.dtype, device: torch.device):
    """(random-weight Qwen3 of `arch` on `device`, tokenizer): initialised on the device itself
    in `dtype`, NF4-quantised in place when asked; nothing goes through the disk."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        **{k: v for k, v in arch.items() if k != "model_type"},
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if quantization == "nf4":
        quantize_nf4(model, dtype)
    _free()
    return model, make_tokenizer(arch["vocab_size"])


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Meter:
    """One phase at a time: seconds, torch's peaks and the device's peak use (mem_get_info
    sampled every 20 ms by a thread), written into the row's `phases` as each one ends."""

    def __init__(self, row: dict, device: torch.device, save):
        self.row, self.device, self.save = row, device, save
        self.name, self.t0, self.min_free, self._stop = None, 0.0, None, threading.Event()

    def start(self, name: str) -> None:
        self.name, self.t0 = name, time.perf_counter()
        self.row["phase"] = name
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.min_free = torch.cuda.mem_get_info()[0]
            self.stop()  # a phase left unended (scoring) stops polling here
            self._stop = threading.Event()
            threading.Thread(target=self._poll, args=(self._stop,), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _poll(self, stop: threading.Event) -> None:
        while not stop.wait(0.02):
            try:
                self.min_free = min(self.min_free, torch.cuda.mem_get_info()[0])
            except RuntimeError:  # the context is going away: the phase is ending anyway
                return

    def end(self, tokens: int | None = None, **extra) -> dict:
        seconds = time.perf_counter() - self.t0
        rec = {"seconds": round(seconds, 2), **extra}
        if tokens is not None:
            rec.update(tokens=tokens, tokens_per_s=round(tokens / max(seconds, 1e-9), 1))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.stop()
            free, total = torch.cuda.mem_get_info()
            self.min_free = min(self.min_free, free)
            rec.update(
                alloc_gb=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                reserved_gb=round(torch.cuda.max_memory_reserved() / 2**30, 3),
                device_used_gb=round((total - self.min_free) / 2**30, 3),
            )
        else:
            rec["peak_rss_gb"] = round(step.memory_metrics(self.device)["peak_memory_gb"], 3)
        rec["plan_gb"] = self.row.get("plan_phases_gb", {}).get(PLAN_PHASE.get(self.name))
        self.row["phases"][self.name] = rec
        self.row["phase"] = None
        self.save()
        return rec


# --- configurations --------------------------------------------------------------------------


def recipe_config(args, arch_name: str):
    """The recipe with the bench's model and reward: one generation batch per step (the recipe's
    peaks, half its rollout time), repairs on, its micro-batch, LoRA rank and evaluation batch."""
    recipe = load_config(args.recipe, [])
    groups = max(recipe.rollout.generation_batch_size // recipe.rollout.group_size, 1)
    return load_config(
        args.recipe,
        [
            f"model.name=random-qwen3-{arch_name}",
            f"model.quantization={args.quantization}",
            *(["train.optimizer=adamw"] if args.quantization == "none" else []),
            f"train.prompts_per_step={groups}",  # data.eval_size stays: the plan's evaluation
            f"objective.reward={BENCH_REWARD}",
            "repair.enabled=true",
            *args.set,
        ],
    )


def size_config(args, arch_name: str, new_tokens: int):
    overrides = [
        f"model.name=random-qwen3-{arch_name}",
        f"model.quantization={args.quantization}",
        *(["train.optimizer=adamw"] if args.quantization == "none" else []),
        f"model.lora_r={args.lora_r}",
        f"model.lora_alpha={2 * args.lora_r}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={new_tokens}",
        f"rollout.generation_batch_size={args.group_size}",
        "train.prompts_per_step=1",
        "train.micro_batch_groups=1",
        "data.eval_size=0",
        f"objective.reward={BENCH_REWARD}",
        "repair.enabled=false",
        *args.set,
    ]
    return load_config(None, overrides)


def fitting_size(cfg, cap_gb: float, first: str) -> str | None:
    """`first` or the largest smaller Qwen3 whose planned peak fits under the cap."""
    order = [s for s in ("14b", "8b", "4b", "1.7b", "0.6b") if s in ARCHS]
    for name in order[order.index(first) :] if first in order else [first]:
        if plan.estimate(ARCHS[name], cfg, 1, cap_gb).fits:
            return name
    return None


def plan_row(row: dict, arch: dict, cfg, cap_gb: float) -> None:
    p = plan.estimate(arch, cfg, 1, cap_gb)
    row.update(
        plan_peak_phase=p.peak_phase,
        plan_peak_gb=round(p.peak_gb, 3),
        plan_fits=p.fits,
        plan_phases_gb={k: round(sum(v.values()), 3) for k, v in p.phases.items()},
    )


def prompt_for(tok, cfg, prompt_chars: int | None) -> str:
    """A question whose rendered prompt is data.max_prompt_tokens long (one token per
    character), or `prompt_chars` long, with max_prompt_tokens set to what it renders to."""
    overhead = len(tok(render_prompt(tok, "", cfg.data))["input_ids"])
    n = prompt_chars if prompt_chars else max(cfg.data.max_prompt_tokens - overhead, 1)
    question = ("what is 12 + 34 * 5 - 6 ? " * (n // 20 + 1))[:n]
    cfg.data.max_prompt_tokens = len(tok(render_prompt(tok, question, cfg.data))["input_ids"])
    return question


# --- one configuration -----------------------------------------------------------------------


def bench_config(item: str, args, device: torch.device, row: dict, save) -> None:
    """Fill `row` phase by phase (saved after each); an exception is recorded, not raised."""
    meter = Meter(row, device, save)
    try:
        cfg, arch_name, question = _setup(item, args, row)
        if cfg is None:
            return
        dtype = compute_dtype(cfg.model.dtype, device)
        meter.start("build")
        base = build_base(ARCHS[arch_name], cfg.model.quantization, dtype, device)
        meter.end(params=sum(p.numel() for p in base[0].parameters()))
        _measure_step(cfg, base, question, args, device, meter)
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded per configuration, then the next one runs
        row["status"] = "failed"
        row["error"] = {
            "type": type(e).__name__,
            "message": str(e)[:2000],
            "phase": row.get("phase"),
            "traceback": traceback.format_exc()[-3000:],
        }
        print(f"# {item}: {type(e).__name__} during {row.get('phase')}: {e}", file=sys.stderr)
    finally:
        meter.stop()
        row["phase"] = None
        _free()
        save()


def _setup(item: str, args, row: dict):
    """(config, size, question) for `item`, with the planner's figures in the row; (None, ..)
    when nothing fits (the row says so)."""
    if item == "recipe":
        arch_name = "tiny" if args.smoke else "8b"
        cfg = recipe_config(args, arch_name)
        if args.smoke:  # the recipe's structure at a size a CPU runs in seconds
            cfg.rollout.max_new_tokens = cfg.rollout.eval_max_new_tokens = 8
            cfg.data.max_prompt_tokens = 32
        fits = arch_name if args.smoke else fitting_size(cfg, args.cap_gb, arch_name)
        if fits != arch_name:
            row["fallback"] = f"qwen3-{arch_name} does not fit the plan under {args.cap_gb:g} GiB"
            if fits is None:
                row["status"] = "skipped: no Qwen3 size fits the plan under the cap"
                return None, None, None
            arch_name, cfg = fits, recipe_config(args, fits)
        question_chars = None
    else:
        arch_name, new_tokens = item.split(":")
        cfg = size_config(args, arch_name, int(new_tokens))
        question_chars = args.prompt_chars
    tok = make_tokenizer(ARCHS[arch_name]["vocab_size"])
    question = prompt_for(tok, cfg, question_chars)
    row.update(
        model=f"qwen3-{arch_name}",
        quantization=cfg.model.quantization,
        optimizer=cfg.train.optimizer,
        lora_r=cfg.model.lora_r,
        group_size=cfg.rollout.group_size,
        generation_batch_size=cfg.rollout.generation_batch_size,
        completions=cfg.rollout.group_size * cfg.train.prompts_per_step,
        prompt_tokens=cfg.data.max_prompt_tokens,
        new_tokens=cfg.rollout.max_new_tokens,
        repair_batch_size=cfg.repair.batch_size if cfg.repair.enabled else None,
        micro_batch_groups=cfg.train.micro_batch_groups,
    )
    plan_row(row, ARCHS[arch_name], cfg, args.cap_gb)
    if not plan.estimate(ARCHS[arch_name], cfg, 1, args.cap_gb).fits and not args.smoke:
        if cfg.model.quantization == "none":  # the fallback measures only what fits
            row["status"] = f"skipped: the plan does not fit {args.cap_gb:g} GiB without 4-bit"
            return None, None, None
    return cfg, arch_name, question


def _measure_step(cfg, base, question, args, device, meter: Meter) -> None:
    from accelerate import Accelerator

    meter.start("load")
    model, tok = load_policy(cfg.model, device, base=base)
    del base
    set_kv_cache(model, cfg.rollout.kv_cache)
    unwrap(model).generation_config.min_new_tokens = cfg.rollout.max_new_tokens  # full length
    optimizer = trainer.build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = Accelerator(cpu=device.type == "cpu")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    meter.end(optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__)
    objective = resolve_params(cfg.objective)
    examples = [Example(question, "0")] * cfg.train.prompts_per_step
    parts = step.StepParts(
        model, optimizer, scheduler, PromptStream(examples, 0, False), random.Random(0)
    )
    captured: dict = {}
    restore = _phase_hooks(meter, cfg, captured)
    try:
        meter.start("rollout")
        m = step.rl_step(parts, tok, accelerator, cfg, objective, step=0)
    finally:
        restore()
    row = meter.row
    row["mismatch"] = {k: m.get(k) for k in ("mismatch_kl", "mismatch_abs_max", "mismatch_share")}
    row["step_time_s"] = round(m["step_time"], 2)
    row["completion_length"] = m["completion_length"]
    if cfg.repair.enabled:  # the recipe row: one evaluation batch, the offloaded update
        _evaluation_batch(model, tok, question, cfg, device, meter)
        if not cfg.model.offload_activations and "update" in captured:
            _offload_update(cfg, captured, meter)
    accelerator.free_memory()


def _phase_hooks(meter: Meter, cfg, captured: dict):
    """Wrap the step's repairs and update so that each is its own phase (the rollout is what
    runs before them); the update's arguments are kept for the offloaded rerun."""
    repairs, update = step.run_repairs, step.update_policy
    completions = cfg.rollout.group_size * cfg.train.prompts_per_step

    def measured_repairs(*a, **k):
        meter.end(tokens=completions * cfg.rollout.max_new_tokens)
        meter.start("repairs")
        out = repairs(*a, **k)
        meter.end(tokens=int(out.stats.get("repair_tokens", 0)), repairs=out.stats.get("repairs"))
        meter.start("scoring")
        return out

    def measured_update(*a, **k):
        if meter.name == "rollout":  # no repairs ran
            meter.end(tokens=completions * cfg.rollout.max_new_tokens)
        meter.start("update")
        captured["update"] = a
        out = update(*a, **k)
        meter.end(tokens=completions * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens))
        return out

    step.run_repairs, step.update_policy = measured_repairs, measured_update

    def restore():
        step.run_repairs, step.update_policy = repairs, update

    return restore


def _offload_update(cfg, captured: dict, meter: Meter) -> None:
    """The same update again with activations offloaded: does it lower the training peak?"""
    model, optimizer, scheduler, accelerator, batch, _, objective = captured.pop("update")
    offloaded = copy.deepcopy(cfg)
    offloaded.model.offload_activations = True
    tokens = meter.row["completions"] * (cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    meter.start("update_offload")
    try:
        step.update_policy(model, optimizer, scheduler, accelerator, batch, offloaded, objective)
        meter.end(tokens=tokens)
    except Exception as e:  # noqa: BLE001 - the plain update was measured: keep going
        meter.end(error=f"{type(e).__name__}: {e}"[:1000])


def _evaluation_batch(model, tok, question, cfg, device, meter: Meter) -> None:
    ro = cfg.rollout
    unwrap(model).generation_config.min_new_tokens = ro.eval_max_new_tokens
    prompts = [render_prompt(tok, question, cfg.data)] * ro.eval_batch_size
    meter.start("evaluation")
    with step.generating(model, cfg, device) as generate:
        generate(tok, prompts, 1, ro.eval_max_new_tokens, ro.eval_batch_size, do_sample=False)
    meter.end(tokens=ro.eval_batch_size * ro.eval_max_new_tokens)


# --- a learning signal ------------------------------------------------------------------------

# the tiny Qwen3 with larger initial weights: logits far enough from uniform that LoRA moves them
LEARN_ARCH = ARCHS["tiny"] | {"initializer_range": 0.2}
FILLER = re.compile(r"<t\d+>")


def share_of_characters(text: str, answer: str) -> float:
    """The reward the learning run's model can learn from scratch: the share of the completion's
    tokens that are characters rather than the bench tokenizer's filler tokens (<tN>), about a
    fifth for random weights."""
    fillers = len(FILLER.findall(text))
    chars = len(FILLER.sub("", text))
    return chars / max(chars + fillers, 1)


def learning_run(args, device: torch.device) -> dict:
    """`args.learn_steps` IBPO steps of the tiny Qwen3 (from its config, random weights) on
    share_of_characters; the training reward must rise: the mean of the last five steps above the
    first five's by `args.learn_margin`. -> {rewards, first, last, learned}."""
    from accelerate import Accelerator

    cfg = load_config(None, [
        "model.name=random-qwen3-tiny", f"model.quantization={args.quantization}",
        *(["train.optimizer=adamw"] if args.quantization == "none" else []),
        "model.lora_r=16", "model.lora_alpha=32", "rollout.group_size=8",
        "rollout.max_new_tokens=16", "rollout.generation_batch_size=32",
        "train.prompts_per_step=4", f"train.learning_rate={args.learn_lr:g}", "objective.kl_coef=0",
        "objective.name=grpo", "model.lora_dropout=0",
        "objective.reward=bench_characters", "repair.enabled=false", "data.eval_size=0",
    ])  # fmt: skip
    dtype = compute_dtype(cfg.model.dtype, device)
    model, tok = load_policy(
        cfg.model, device, base=build_base(LEARN_ARCH, cfg.model.quantization, dtype, device)
    )
    optimizer = trainer.build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = Accelerator(cpu=device.type == "cpu")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    examples = [Example("write", "")] * cfg.train.prompts_per_step
    parts = step.StepParts(
        model, optimizer, scheduler, PromptStream(examples, 0, True), random.Random(0)
    )
    objective = resolve_params(cfg.objective)
    rewards = []
    for i in range(args.learn_steps):
        m = step.rl_step(parts, tok, accelerator, cfg, objective, step=i)
        rewards.append(round(m["reward"], 4))
        print(f"# learning step {i}: reward {rewards[-1]:.3f}", file=sys.stderr, flush=True)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    return {
        "rewards": rewards,
        "first": first,
        "last": last,
        "margin": args.learn_margin,
        "learned": last > first + args.learn_margin,
    }


REWARDS[BENCH_REWARD], REWARDS["bench_characters"] = one_in_four, share_of_characters

# --- command line ----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        default="recipe,4b:2048,1.7b:4096",
        help="comma-separated: recipe, or SIZE:NEW_TOKENS with sizes " + ", ".join(ARCHS),
    )
    ap.add_argument("--recipe", default=str(RECIPE), help="the recipe `recipe` measures")
    ap.add_argument("--quantization", choices=("nf4", "none"), default="nf4")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=256, help="~ prompt tokens (SIZE items)")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (SIZE items)")
    ap.add_argument("--cap-gb", type=float, default=23.5, help="CUDA allocator cap (GiB)")
    ap.add_argument("--budget-s", type=float, default=450, help="start no config after this")
    ap.add_argument("--out", default=None, help="the results JSON, rewritten after every phase")
    ap.add_argument("--smoke", action="store_true", help="tiny Qwen3 on CPU, seconds")
    ap.add_argument("--learn", action="store_true", help="the learning run instead (tiny Qwen3)")
    ap.add_argument("--learn-steps", type=int, default=20)
    ap.add_argument("--learn-margin", type=float, default=0.2)
    ap.add_argument("--learn-lr", type=float, default=2e-2)
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="K=V",
        help="recipe overrides for every configuration, e.g. rollout.kv_cache=static",
    )
    args = ap.parse_args(argv)
    for item in args.configs.split(","):
        if item != "recipe" and (item.count(":") != 1 or item.split(":")[0] not in ARCHS):
            ap.error(f"--configs: {item!r} is neither recipe nor SIZE:TOKENS ({', '.join(ARCHS)})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.learn:
        return learn_main(args)
    if args.smoke:
        args.configs = "recipe,tiny:8" if args.configs == parse_args([]).configs else args.configs
        args.group_size, args.prompt_chars = 4, 24
        torch.set_num_threads(1)  # a tiny model gains nothing from threads that a busy CPU stalls
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    start = time.perf_counter()
    global _CALLS
    _CALLS = itertools.count()
    if device.type == "cuda":  # emulate the consumer card, before anything is allocated
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb / total))
    results: list[dict] = []
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "cap_gb": args.cap_gb,
        "quantization": args.quantization,
        "results": results,
    }

    def save() -> None:
        if args.out:  # after every phase: a run cut short keeps what it measured
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            tmp.replace(args.out)

    for item in args.configs.split(","):
        row = {"config": item, "status": "running", "phases": {}}
        results.append(row)
        if time.perf_counter() - start > args.budget_s:
            row["status"] = "skipped (time budget)"
            save()
            continue
        print(f"# {item} ...", file=sys.stderr, flush=True)
        bench_config(item, args, device, row, save)
        row["elapsed_s"] = round(time.perf_counter() - start, 1)
        save()
        print(json.dumps(row), flush=True)
    print(json.dumps(summary), flush=True)
    return summary


def learn_main(args) -> dict:
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": str(device), **learning_run(args, device)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)
    if not result["learned"]:
        sys.exit(
            f"the training reward did not rise: first five {result['first']:.3f}, last five "
            f"{result['last']:.3f} (margin {result['margin']:g})"
        )
    return result


if __name__ == "__main__":
    main()
