"""GPU benchmark: peak memory and speed of each phase of one ibpo step, beside `ibpo plan`.

Each configuration builds a Qwen3 architecture from its config with random weights directly on
the device (no checkpoint is written: ibpo.modeling.quantize_nf4 turns the decoder's linear
layers into NF4 in place, then ibpo.modeling.load_policy adds LoRA as for a loaded model), under
an allocator cap that emulates a consumer card (--cap-gb, default 23.5 GiB: a 24 GB card less
what torch's cap does not see). Completions are forced to full length (random weights do not
stop on EOS reliably); the character tokenizer's filler tokens are one character each, so a
completion decoded into a repair prompt encodes back to the tokens it was sampled as, and the
repair prompts fed are checked to be within 10% of the planner's before they run. Configurations,
in --configs order (the first is the headline row: the run's status is its status):
  recipe          --recipe's own shapes (default recipes/qwen3_8b/math_ibpo_1gpu.yaml): one
                  generation batch (generation_batch_size completions, prompts of
                  data.max_prompt_tokens), repairs at repair.batch_size, the update with the
                  recipe's micro-batch and LoRA rank, one evaluation batch, then the same
                  update again with model.offload_activations=true;
  SIZE:TOKENS     a smaller model (0.6b, 1.7b, 4b, 8b) at TOKENS new tokens, group of 8, no
                  repairs, no evaluation.
Phases: build, load, rollout, repairs, update, evaluation, update_offload. Before each, the
cached blocks go back to the device and the peak counters restart, so each phase's figures are
its own. After every phase the row is rewritten to --out (a run ended by a timeout keeps what it
measured): the phase's seconds beside its planned seconds, tokens/s, torch's peak allocated and
reserved, the device's peak use from torch.cuda.mem_get_info (sampled through the phase: CUDA
context, bitsandbytes' paged state, anything outside torch's cap), and the planner's figure for
the same phase; after the update, the rollout-vs-trainer mismatch (mismatch_kl,
mismatch_abs_max).

Time: --budget-s counts from the start. A row starts only if its required phases (build to
update) fit in what is left by their plan (plan_seconds: the rates an H200 measured, scaled by
the measured / planned ratio of the phases run so far); otherwise it is skipped and says why.
The recipe row first decodes fewer new tokens if the recipe's would not fit: the longest
halving of max_new_tokens that does (not below 128), every other shape the recipe's, recorded
in its `new_tokens_capped` (HF generate decodes about 5 ms per step per layer, so the 8B
recipe's 1024 tokens plan about 450 s of required phases: a call of its own,
`--configs recipe --budget-s 560`). A required phase that no longer fits stops its row before
it starts; an optional phase (evaluation, update_offload) that does not fit is left out, saying
so. Nothing is cut mid-phase by the bench itself.

Status: each row's status is ok, failed (with the error's type, message and phase), skipped or
stopped (with the reason); the JSON has `rows` (one line each), `status` (the headline row's)
and `summary`, the one line printed last. The exit status is 1 when the headline row is not ok.

--quantization none (what scripts/gpu_check.py passes when bitsandbytes' CUDA kernels fail): a
bf16 base without 4-bit and torch AdamW, bitsandbytes never imported; `recipe` then uses the
largest Qwen3 the planner fits under the cap with the recipe's shapes, and a SIZE that does not
fit is skipped, saying so.

--learn: the learning run instead: 20 steps of ibpo with its repairs (the default objective) on a
tiny Qwen3, NF4 + bf16 on a CUDA device, whose training reward must rise (see learning_run).

On a GPU machine (bitsandbytes as a wheel in .whl/):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py --out $OUT/bench_gpu.json
CPU smoke test (tiny Qwen3, recipe shapes scaled down, seconds): python bench/bench_gpu.py --smoke
Without --smoke it refuses to run on a machine without CUDA. Not here: several GPUs, vLLM
(bench/bench_vllm.py), real weights.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import itertools
import json
import math
import random
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

from ibpo import sizes, step, step_metrics, step_parts, trainer  # noqa: E402
from ibpo.data import Example, PromptStream, render_prompt  # noqa: E402
from ibpo.generation import set_kv_cache  # noqa: E402
from ibpo.logprobs import unwrap  # noqa: E402
from ibpo.modeling import compute_dtype, load_policy, quantize_nf4  # noqa: E402
from ibpo.plan import fit as plan  # noqa: E402
from ibpo.plan.phases import offloaded_bytes  # noqa: E402
from ibpo.recipe import load_config, resolve_params  # noqa: E402
from ibpo.rewards import GRADERS  # noqa: E402

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


def filler_tokens(n: int) -> list[str]:
    """`n` one-character tokens outside CHARS and not whitespace: code points from U+4E00 on,
    past the surrogates. One character each, so that a decoded completion encodes back to the
    same ids: a repair prompt holds its attempt and reference at the length they were sampled."""
    out, code = [], 0x4E00
    while len(out) < n:
        if not 0xD800 <= code <= 0xDFFF:
            out.append(chr(code))
        code += 1
    return out


@functools.lru_cache(maxsize=4)
def make_tokenizer(vocab_size: int):
    """A character tokenizer padded with one-character filler tokens to the model's vocabulary,
    so that every sampled id decodes (the real Qwen3 tokenizer would need the Hub) and decode ->
    encode gives back the ids (tests/test_bench_scripts.py checks 1,024 random ones). One per
    vocabulary size (building Qwen3's takes seconds); nothing here changes it after."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + list(CHARS)
    tokens += filler_tokens(vocab_size - len(tokens))
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    # every character its own piece, newlines included ("." alone leaves "\n\n" as one piece)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # " ." stays " .": the text is the tokens
    )
    tok.chat_template = TEMPLATE
    tok.padding_side = "left"  # as modeling.load_tokenizer sets it: prompts end where text starts
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

    def __init__(self, row: dict, device: torch.device, save, deadline: Deadline | None = None):
        self.row, self.device, self.save, self.deadline = row, device, save, deadline
        self.name, self.t0, self.min_free, self._stop = None, 0.0, None, threading.Event()

    def start(self, name: str) -> None:
        if self.device.type == "cuda":
            # each phase's figures its own: the blocks the previous phase left cached go back
            # to the device first (else max_memory_reserved starts at their total), then the
            # peaks restart from what is allocated now
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.name, self.t0 = name, time.perf_counter()
        self.row["phase"] = name
        if self.device.type == "cuda":
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
            peak = step_metrics.memory_metrics(self.device)["peak_memory_gb"]
            rec["peak_rss_gb"] = round(peak, 3)
        rec["plan_gb"] = self.row.get("plan_phases_gb", {}).get(PLAN_PHASE.get(self.name))
        rec["plan_s"] = self.row.get("plan_seconds", {}).get(self.name)
        if self.deadline is not None and rec["plan_s"]:
            self.deadline.record(rec["plan_s"], seconds)
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
            f"reward.functions={BENCH_REWARD}",
            "repair.enabled=true",
            # the plan's repair phase is its worst case: every planned repair, no spending rule
            "repair.cost_share=1",
            "repair.min_success=0",
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
        f"reward.functions={BENCH_REWARD}",
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


# --- the time plan ---------------------------------------------------------------------------

# Seconds per phase, from the rates measured on an H200 (qwen3-8b, NF4 + LoRA r32, bf16; two
# runs, docs/gpu.md), rounded to the slow side. Each phase records its plan beside what it took
# (plan_s), and every check after the first phase scales the plan by the run's measured / planned
# ratio so far (Deadline.scale).
# One decoding step through one layer: HF generate with PEFT over 4-bit weights; 4.2-5.5 ms
# measured at batches of 8 and 32 (bound by kernel launches, nearly independent of the batch).
DECODE_S_PER_LAYER_STEP = 5.5e-3
# The same through the package's decode engine (rollout.decode auto or graph on CUDA): not yet
# measured on a device; its target is 0.45 ms (16 ms a step of the 36-layer 8B), planned at
# about three times that until bench_decode.py has measured it.
ENGINE_DECODE_S_PER_LAYER_STEP = 1.5e-3
MATMUL_FLOPS = 150e12  # the prefill's and the update's matmuls: the update sustained 180e12
BUILD_S_PER_BILLION = 2.0  # random initialisation on the device and NF4 packing: 1.1-1.7 s
LOAD_S = 5.0  # LoRA, the optimizer, Accelerate's prepare: 1.2-1.9 s
HOST_BYTES_PER_S = 10e9  # offloaded activations, to the host and back (not yet separated)
# The recipe row decodes the recipe's max_new_tokens when its required phases fit the time left,
# else the longest halving of it that does, down to this (fit_new_tokens).
MIN_NEW_TOKENS = 128
# A row starts only if these phases fit before --budget-s; an optional phase (evaluation,
# update_offload) starts only if it still fits when its turn comes, else it is left out, saying so.
REQUIRED = ("build", "load", "rollout", "repairs", "update")
OPTIONAL = ("evaluation", "update_offload")


def _generate_s(
    params: int, layers: int, sequences: int, batch: int, prompt: int, new: int, engine: bool
):
    calls = math.ceil(sequences / max(batch, 1))
    rate = ENGINE_DECODE_S_PER_LAYER_STEP if engine else DECODE_S_PER_LAYER_STEP
    return calls * new * layers * rate + 2 * params * sequences * prompt / MATMUL_FLOPS


def repair_jobs(cfg) -> int:
    """The repairs one step of the bench makes: one completion in four fails (one_in_four), at
    most max_repairs_per_group per group, each with repair.references references."""
    rep, G = cfg.repair, cfg.rollout.group_size
    n = G * cfg.train.prompts_per_step
    cap = cfg.train.prompts_per_step * min(rep.max_repairs_per_group, G)
    return min(math.ceil(n / 4), cap) * rep.references


def plan_seconds(arch: dict, cfg) -> dict[str, float]:
    """Planned seconds of each phase a row of `cfg` on `arch` runs (see the constants above)."""
    shape = sizes.ModelShape.from_dict(arch)
    params, layers = shape.parameter_count(), shape.layers
    ro, P = cfg.rollout, cfg.data.max_prompt_tokens
    n = ro.group_size * cfg.train.prompts_per_step
    engine = ro.backend == "hf" and ro.decode != "eager"  # the plan is the device's (CUDA)
    out = {
        "build": BUILD_S_PER_BILLION * params / 1e9,
        "load": LOAD_S,
        "rollout": _generate_s(
            params, layers, n, ro.generation_batch_size, P, ro.max_new_tokens, engine
        ),
    }
    repair = sizes.repair_generation(cfg)
    if repair:
        batch, prompt, new = repair
        out["repairs"] = _generate_s(params, layers, repair_jobs(cfg), batch, prompt, new, engine)
    out["update"] = 6 * params * n * (P + ro.max_new_tokens) / MATMUL_FLOPS  # fwd, recompute, bwd
    if repair:  # the recipe row: one evaluation batch, the update again with offloading
        b = ro.generation_batch_size
        out["evaluation"] = _generate_s(params, layers, b, b, P, ro.eval_max_new_tokens, engine)
        micro = math.ceil(cfg.train.prompts_per_step / cfg.train.micro_batch_groups)
        host = 2 * micro * offloaded_bytes(shape, cfg, 2) / HOST_BYTES_PER_S
        out["update_offload"] = out["update"] + host
    return {k: round(v, 1) for k, v in out.items()}


def fit_new_tokens(arch: dict, cfg, seconds: float, scale: float = 1.0) -> int | None:
    """rollout.max_new_tokens, else the longest halving of it (not below MIN_NEW_TOKENS) whose
    required phases' planned seconds, times `scale`, fit in `seconds`; None when none does.
    Every other shape stays the recipe's (prompts, batch sizes, LoRA rank, micro-batch)."""
    n = full = cfg.rollout.max_new_tokens
    while n >= min(MIN_NEW_TOKENS, full):
        trial = with_new_tokens(cfg, n)
        planned = plan_seconds(arch, trial)
        if scale * sum(v for k, v in planned.items() if k in REQUIRED) <= seconds:
            return n
        n //= 2
    return None


def with_new_tokens(cfg, n: int):
    """`cfg` decoding at most `n` new tokens (the rollout, its repairs and the evaluation)."""
    out = copy.deepcopy(cfg)
    out.rollout.max_new_tokens = n
    out.rollout.eval_max_new_tokens = min(cfg.rollout.eval_max_new_tokens, n)
    return out


class OutOfTime(Exception):
    """A required phase that no longer fits before the deadline: the row stops before it."""


class Deadline:
    """--budget-s from the bench's start (`clock`: a dry run passes a simulated one): what is
    left, and the measured / planned ratio of the phases so far, which scales later plans."""

    def __init__(self, budget_s: float, clock=time.perf_counter):
        self.budget_s, self.clock, self.t0 = budget_s, clock, clock()
        self.measured = self.planned = 0.0

    def left(self) -> float:
        return self.budget_s - (self.clock() - self.t0)

    @property
    def scale(self) -> float:
        # never below half the plan: one quick phase must not let every later one look cheap
        return max(self.measured / self.planned, 0.5) if self.planned > 0 else 1.0

    def record(self, planned: float, measured: float) -> None:
        self.planned, self.measured = self.planned + planned, self.measured + measured

    def check(self, what: str, planned: float) -> str | None:
        """None when `planned` seconds (scaled) fit in what is left, else why not."""
        need, left = planned * self.scale, self.left()
        if need <= left:
            return None
        return (
            f"{what} planned {need:.0f} s (plan x {self.scale:.2f}), {max(left, 0):.0f} s left "
            f"of --budget-s {self.budget_s:g}"
        )


def planned_schedule(rows: list[dict], budget_s: float) -> None:
    """What a run under `budget_s` would start if every phase took its plan (a dry run): each
    row's `schedule`, by the rules the run itself follows (bench_config)."""
    now = [0.0]
    deadline = Deadline(budget_s, clock=lambda: now[0])
    for row in rows:
        plan = row.get("plan_seconds")
        if not plan:
            row["schedule"] = row.get("status") or "not planned"
            continue
        required = sum(v for k, v in plan.items() if k in REQUIRED)
        why = deadline.check(f"row {row['config']}", required)
        if why:
            row["schedule"] = f"skipped: {why}"
            continue
        now[0] += required
        left_out = []
        for name in (p for p in OPTIONAL if p in plan):
            if deadline.check(name, plan[name]):
                left_out.append(name)
            else:
                now[0] += plan[name]
        capped = row.get("new_tokens_capped")
        runs = f"runs at {capped['measured']} new tokens" if capped else "runs"
        row["schedule"] = runs + (f", without {', '.join(left_out)}" if left_out else "")
    return None


def prompt_for(tok, cfg, prompt_chars: int | None) -> str:
    """A question whose rendered prompt is data.max_prompt_tokens long (one token per
    character), or `prompt_chars` long, with max_prompt_tokens set to what it renders to."""
    overhead = len(tok(render_prompt(tok, "", cfg.data))["input_ids"])
    n = prompt_chars if prompt_chars else max(cfg.data.max_prompt_tokens - overhead, 1)
    question = ("what is 12 + 34 * 5 - 6 ? " * (n // 20 + 1))[:n]
    cfg.data.max_prompt_tokens = len(tok(render_prompt(tok, question, cfg.data))["input_ids"])
    return question


# --- one configuration -----------------------------------------------------------------------


class PlanMismatch(RuntimeError):
    """What the bench is about to feed is not what the plan it measures against counts."""


def check_repair_prompts(lengths: list[int], planned: int, tolerance: float = 0.10) -> dict:
    """The longest repair prompt fed, within `tolerance` of the planner's repair prompt (else
    the repair phase would measure something other than the plan: PlanMismatch)."""
    longest = max(lengths)
    rec = {"prompt_tokens_max": longest, "prompt_tokens_planned": planned}
    if abs(longest - planned) > tolerance * planned:
        raise PlanMismatch(
            f"repair prompts of up to {longest} tokens against the plan's {planned} (more than "
            f"{tolerance:.0%} apart): the bench's tokenizer or the planner's repair prompt count "
            "is off, and the repair phase would not measure the plan"
        )
    return rec


def bench_config(
    item: str, args, device: torch.device, row: dict, save, deadline: Deadline | None = None
) -> None:
    """Fill `row` phase by phase (saved after each); an exception is recorded, not raised. With a
    `deadline`, the row starts only if its required phases fit, and each phase only if it fits
    when its turn comes (a required one that does not stops the row; an optional one is left
    out, saying so)."""
    meter = Meter(row, device, save, deadline)
    try:
        seconds = (deadline.left(), deadline.scale) if deadline is not None else None
        cfg, arch_name, question = _setup(item, args, row, seconds)
        if cfg is None:
            return
        if deadline is not None:
            plan_s = row["plan_seconds"]
            why = deadline.check(f"row {item}", sum(v for k, v in plan_s.items() if k in REQUIRED))
            if why:
                row["status"] = f"skipped: time: {why}"
                return
        dtype = compute_dtype(cfg.model.dtype, device)
        meter.start("build")
        base = build_base(ARCHS[arch_name], cfg.model.quantization, dtype, device)
        meter.end(params=sum(p.numel() for p in base[0].parameters()))
        _measure_step(cfg, base, question, args, device, meter)
        row["status"] = "ok"
    except OutOfTime as e:
        row["status"] = f"stopped: time: {e}"
        print(f"# {item}: stopped: {e}", file=sys.stderr)
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


def _setup(item: str, args, row: dict, seconds: tuple[float, float] | None = None):
    """(config, size, question) for `item`, with the planner's figures (memory and seconds) in
    the row; (None, ..) when nothing fits (the row says so). `seconds`: (time left, the
    measured / planned ratio so far); the recipe row then decodes fewer new tokens when the
    recipe's do not fit (fit_new_tokens), saying so in `new_tokens_capped`."""
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
    if item == "recipe" and seconds is not None and not args.smoke:
        left, scale = seconds
        n, full = fit_new_tokens(ARCHS[arch_name], cfg, left, scale), cfg.rollout.max_new_tokens
        if n is not None and n < full:
            required = sum(
                v for k, v in plan_seconds(ARCHS[arch_name], cfg).items() if k in REQUIRED
            )
            row["new_tokens_capped"] = {
                "recipe": full,
                "measured": n,
                "why": f"the recipe's {full} new tokens plan {required * scale:.0f} s of "
                f"required phases, {left:.0f} s left",
            }
            cfg = with_new_tokens(cfg, n)
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
    row["plan_seconds"] = plan_seconds(ARCHS[arch_name], cfg)
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
    set_kv_cache(model, "dynamic")  # as the trainer sets it
    unwrap(model).generation_config.min_new_tokens = cfg.rollout.max_new_tokens  # full length
    optimizer = trainer.build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = Accelerator(cpu=device.type == "cpu")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    meter.end(optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__)
    objective = resolve_params(cfg.objective)
    examples = [Example(question, "0")] * cfg.train.prompts_per_step
    parts = step_parts.StepParts(
        model, optimizer, scheduler, PromptStream(examples, 0, False), random.Random(0)
    )
    captured: dict = {}
    restore = _phase_hooks(meter, cfg, captured)
    try:
        _start(meter, "rollout")
        m = step.rl_step(parts, tok, accelerator, cfg, objective, step=0)
    finally:
        restore()
    row = meter.row
    row["mismatch"] = {k: m.get(k) for k in ("mismatch_kl", "mismatch_abs_max", "mismatch_share")}
    row["step_time_s"] = round(m["step_time"], 2)
    row["completion_length"] = m["completion_length"]
    if cfg.repair.enabled:  # the recipe row: one evaluation batch, the offloaded update
        if _optional(meter, "evaluation"):
            _evaluation_batch(model, tok, question, cfg, device, meter)
        offload = not cfg.model.offload_activations and "update" in captured
        if offload and _optional(meter, "update_offload"):
            _offload_update(cfg, captured, meter)
    accelerator.free_memory()


def _start(meter: Meter, name: str) -> None:
    """Start a required phase, or stop the row before it when it no longer fits the deadline."""
    if meter.deadline is not None:
        why = meter.deadline.check(name, meter.row["plan_seconds"].get(name, 0.0))
        if why:
            raise OutOfTime(f"before {why}")
    meter.start(name)


def _optional(meter: Meter, name: str) -> bool:
    """Whether an optional phase fits the deadline; one that does not is recorded as left out."""
    why = meter.deadline and meter.deadline.check(name, meter.row["plan_seconds"].get(name, 0))
    if why:
        meter.row.setdefault("left_out", {})[name] = why
        meter.save()
    return not why


def _phase_hooks(meter: Meter, cfg, captured: dict):
    """Wrap the step's repairs and update so that each is its own phase (the rollout is what
    runs before them); the repair prompts are checked against the plan before they are fed;
    the update's arguments are kept for the offloaded rerun."""
    repairs, update = step.run_repairs, step.update_policy
    completions = cfg.rollout.group_size * cfg.train.prompts_per_step
    planned_prompt = (sizes.repair_generation(cfg) or (None, 0))[1]

    def checked(generate):
        def feed(tokenizer, prompts, *a, **k):
            ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
            meter.row["repair_prompts"] = check_repair_prompts(list(map(len, ids)), planned_prompt)
            meter.save()
            return generate(tokenizer, prompts, *a, **k)

        return feed

    def measured_repairs(gen, *a, **k):
        meter.end(tokens=completions * cfg.rollout.max_new_tokens)
        _start(meter, "repairs")
        out = repairs(dataclasses.replace(gen, generator=checked(gen.generator)), *a, **k)
        meter.end(tokens=int(out.stats.get("repair_tokens", 0)), repairs=out.stats.get("repairs"))
        meter.start("scoring")
        return out

    def measured_update(*a, **k):
        if meter.name == "rollout":  # no repairs ran
            meter.end(tokens=completions * cfg.rollout.max_new_tokens)
        _start(meter, "update")
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
    prompts = [render_prompt(tok, question, cfg.data)] * ro.generation_batch_size
    meter.start("evaluation")
    with step.generating(model, cfg, device) as generate:
        generate(tok, prompts, 1, ro.eval_max_new_tokens, len(prompts), do_sample=False)
    meter.end(tokens=len(prompts) * ro.eval_max_new_tokens)


# --- a learning signal ------------------------------------------------------------------------

# the tiny Qwen3 with larger initial weights: logits far enough from uniform that LoRA moves them
LEARN_ARCH = ARCHS["tiny"] | {"initializer_range": 0.2}
LEARN_REWARD = "bench_characters"


def share_of_characters(text: str) -> float:
    """The share of a completion's characters that are CHARS rather than the bench tokenizer's
    filler tokens (one character each): about a fifth for random weights."""
    return sum(c in CHARS for c in text) / max(len(text), 1)


def mostly_characters(text: str, answer: str, threshold: float = 0.4) -> float:
    """The learning run's reward, which its model can learn from scratch: 1 when at least
    `threshold` of the completion is CHARS, else 0. Binary, as IBPO's repairs need: a failed
    completion (0) is repaired, and a repair succeeds when it reaches the threshold."""
    return float(share_of_characters(text) >= threshold)


def characters_reward(threshold: float):
    def reward(text: str, answer: str) -> float:
        return mostly_characters(text, answer, threshold)

    return reward


# The learning run's threshold: what about one in seven of the untrained model's completions
# reaches, so that its first steps score about 0.15 whatever the random weights on the device
# favour (the same seed draws other weights on CUDA than on CPU), within these bounds.
LEARN_QUANTILE, LEARN_THRESHOLD_RANGE = 0.85, (0.2, 0.9)


def calibrate_threshold(model, tok, cfg, device: torch.device) -> tuple[float, float]:
    """(threshold, the untrained completions' mean share of characters), from one generation
    batch of the untrained policy sampled as the run samples."""
    ro = cfg.rollout
    prompts = [render_prompt(tok, "write", cfg.data)] * ro.generation_batch_size
    with step.generating(model, cfg, device) as generate:
        out = generate(
            tok, prompts, 1, ro.max_new_tokens, len(prompts),
            temperature=ro.temperature, top_p=ro.top_p,
        )  # fmt: skip
    shares = sorted(share_of_characters(t) for t in out.texts)
    low, high = LEARN_THRESHOLD_RANGE
    threshold = min(max(shares[int(LEARN_QUANTILE * len(shares))], low), high)
    return round(threshold, 4), sum(shares) / len(shares)


def learning_run(args, device: torch.device) -> dict:
    """`args.learn_steps` steps of the default objective, ibpo with its repairs, of the tiny
    Qwen3 (from its config, random weights; NF4 unless --quantization none, the compute dtype
    model.dtype=auto picks: bf16 on a CUDA device with native bf16) on mostly_characters at the
    threshold calibrate_threshold finds; the training reward must rise: the mean of the last five
    steps above the first five's by `args.learn_margin`, with repairs made.
    -> {threshold, rewards, repairs, first, last, learned, repaired, ...}."""
    from accelerate import Accelerator

    cfg = load_config(None, [
        "model.name=random-qwen3-tiny", f"model.quantization={args.quantization}",
        *(["train.optimizer=adamw"] if args.quantization == "none" else []),
        "model.lora_r=16", "model.lora_alpha=32", "rollout.group_size=8",
        "rollout.max_new_tokens=16", "rollout.generation_batch_size=32",
        "train.prompts_per_step=4", f"train.learning_rate={args.learn_lr:g}", "objective.kl_coef=0",
        "objective.name=ibpo",
        f"reward.functions={LEARN_REWARD}", "data.eval_size=0",
        "repair.cost_share=1", "repair.min_success=0",  # every planned repair, every step
    ])  # fmt: skip
    assert cfg.repair.enabled, "ibpo repairs by default"
    dtype = compute_dtype(cfg.model.dtype, device)
    model, tok = load_policy(
        cfg.model, device, base=build_base(LEARN_ARCH, cfg.model.quantization, dtype, device)
    )
    optimizer = trainer.build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = Accelerator(cpu=device.type == "cpu")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    threshold, initial_share = calibrate_threshold(model, tok, cfg, device)
    GRADERS[LEARN_REWARD] = characters_reward(threshold)
    examples = [Example("write", "")] * cfg.train.prompts_per_step
    parts = step_parts.StepParts(
        model, optimizer, scheduler, PromptStream(examples, 0, True), random.Random(0)
    )
    objective = resolve_params(cfg.objective)
    rewards, repairs, successes, mismatch = [], [], [], []
    for i in range(args.learn_steps):
        m = step.rl_step(parts, tok, accelerator, cfg, objective, step=i)
        rewards.append(round(m["reward"], 4))
        repairs.append(int(m.get("repairs", 0)))
        successes.append(round(m.get("repair_success_rate", 0.0), 4))
        mismatch.append(m.get("mismatch_kl"))
        print(
            f"# learning step {i}: reward {rewards[-1]:.3f}, {repairs[-1]} repairs",
            file=sys.stderr,
            flush=True,
        )
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    return {
        "objective": objective.name,
        "quantization": cfg.model.quantization,
        "dtype": str(dtype).removeprefix("torch."),
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "threshold": threshold,
        "initial_share": round(initial_share, 4),
        "rewards": rewards,
        "repairs": repairs,
        "repair_success_rate": successes,
        "mismatch_kl": mismatch,
        "first": first,
        "last": last,
        "margin": args.learn_margin,
        "learned": last > first + args.learn_margin,
        "repaired": sum(repairs) > 0,
    }


GRADERS[BENCH_REWARD], GRADERS[LEARN_REWARD] = one_in_four, mostly_characters

# --- command line ----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        default=None,
        help="comma-separated: recipe, or SIZE:NEW_TOKENS with sizes "
        + ", ".join(ARCHS)
        + " (default: recipe; with --smoke, recipe,tiny:8)",
    )
    ap.add_argument("--recipe", default=str(RECIPE), help="the recipe `recipe` measures")
    ap.add_argument("--quantization", choices=("nf4", "none"), default="nf4")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=256, help="~ prompt tokens (SIZE items)")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (SIZE items)")
    ap.add_argument("--cap-gb", type=float, default=23.5, help="CUDA allocator cap (GiB)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450,
        help="seconds from the start: a configuration or phase starts only if its planned "
        "seconds fit in what is left",
    )
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
        help="recipe overrides for every configuration, e.g. train.micro_batch_groups=1",
    )
    args = ap.parse_args(argv)
    if args.configs is None:
        args.configs = "recipe,tiny:8" if args.smoke else "recipe"
    for item in args.configs.split(","):
        if item != "recipe" and (item.count(":") != 1 or item.split(":")[0] not in ARCHS):
            ap.error(f"--configs: {item!r} is neither recipe nor SIZE:TOKENS ({', '.join(ARCHS)})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.learn:
        return learn_main(args)
    if args.smoke:
        args.group_size, args.prompt_chars = 4, 24
        torch.set_num_threads(1)  # a tiny model gains nothing from threads that a busy CPU stalls
    elif not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA device: it measures a GPU (--smoke runs a tiny model on CPU)")
    device = torch.device("cuda" if not args.smoke else "cpu")
    deadline = Deadline(args.budget_s)
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
        "budget_s": args.budget_s,
        "headline": args.configs.split(",")[0],
        "results": results,
    }

    def save() -> None:
        summarise(summary)
        if args.out:  # after every phase: a run cut short keeps what it measured
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            tmp.replace(args.out)

    for item in args.configs.split(","):
        row = {"config": item, "status": "running", "phases": {}}
        results.append(row)
        print(f"# {item} ...", file=sys.stderr, flush=True)
        bench_config(item, args, device, row, save, deadline)
        row["elapsed_s"] = round(deadline.clock() - deadline.t0, 1)
        save()
        print(json.dumps(row), flush=True)
    summary["time_scale"] = round(deadline.scale, 3)  # measured / planned seconds
    save()
    print(json.dumps(summary), flush=True)
    print(summary["summary"], flush=True)
    return summary


def row_status(row: dict) -> str:
    """One row in a few words: ok, skipped/stopped with the reason, or failed with the error."""
    status = row.get("status", "?")
    if status == "failed":
        e = row.get("error") or {}
        return f"failed ({e.get('type')} during {e.get('phase')})"
    left_out = row.get("left_out")
    return status + (f" (left out: {', '.join(left_out)})" if status == "ok" and left_out else "")


def summarise(summary: dict) -> None:
    """Each row's status, and the run's: ok only if the headline row (the first, the recipe by
    default) measured every required phase; the exit status follows it."""
    rows = summary["results"]
    summary["rows"] = {r["config"]: row_status(r) for r in rows}
    head = next((r for r in rows if r["config"] == summary["headline"]), None)
    summary["status"] = "ok" if head is not None and head.get("status") == "ok" else "failed"
    summary["summary"] = f"bench_gpu {summary['status']}: " + "; ".join(
        f"{k} {v}" for k, v in summary["rows"].items()
    )


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
    if not result["repaired"]:
        sys.exit("no repair was made: the learning run did not exercise ibpo's repairs")
    return result


if __name__ == "__main__":
    summary = main()
    # a failed headline row fails the run (the learning run exits on its own)
    sys.exit(0 if summary.get("status", "ok") == "ok" else 1)
