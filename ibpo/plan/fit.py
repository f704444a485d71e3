"""Memory planner: will this recipe fit on N GPUs of M GiB, and what to change if it does not.

From the model's config (no weights) and a recipe, phases.py counts what each phase of a step
(generation, repair, training, evaluation) holds per GPU, component by component; this module
adds the CUDA context and an allocator margin, finds the peak phase, says whether it fits
`gpus` x `gpu_memory_gb`, and suggests the overrides that would (smaller micro-batches, log-prob
chunks, generation batches), then prints the table. Sizes are GiB (2**30 bytes): a "24 GB" card
has 24 GiB.

The sizes themselves (architecture shapes, byte counts, per-token activation terms) are in
sizes.py, which also tabulates the published Qwen3 dense configs (KNOWN_ARCHITECTURES) so that
their recipes plan without Hub access; any other model reads its config.json.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ibpo.config import Config, ConfigError
from ibpo.plan.phases import dtype_bytes, offloaded_bytes, phase_bytes
from ibpo.sizes import GIB, ModelShape, load_model_shape, lora_parameter_count

# CUDA context, cuBLAS workspaces and loaded kernels sit outside torch's allocator: ~0.5 GiB for
# a torch + cuBLAS process with lazy module loading, plus bitsandbytes' kernels.
CUDA_CONTEXT_GIB = 0.6
# The caching allocator reserves more than it hands out: a KV cache regrown by torch.cat every
# token and micro-batches of varying width leave free blocks too small for the next request.
FRAGMENTATION = 0.10
SHARDINGS = ("ddp", "fsdp")


# --- the plan ------------------------------------------------------------------------------------


@dataclass
class Plan:
    model: str
    parameters: int
    trainable: int
    gpus: int
    gpu_memory_gb: float
    phases: dict[str, dict[str, float]]  # GiB per component at each phase's peak
    peak_phase: str
    components: dict[str, float]  # the peak phase's components (GiB)
    allocated_gb: float  # torch.cuda.max_memory_allocated() expected at the peak
    peak_gb: float  # + CUDA context and fragmentation: what each card must hold
    fits: bool
    suggestions: list[str] = field(default_factory=list)  # section.key=value overrides that fit
    notes: list[str] = field(default_factory=list)
    sharding: str = "ddp"  # ddp | fsdp (how `gpus` > 1 share the model)


def _totals(
    shape: ModelShape, cfg: Config, gpus: int, sharding: str = "ddp"
) -> tuple[dict, str, float, float]:
    """(GiB per phase and component, peak phase, its allocations, with overheads)."""
    phases = {
        name: {k: v / GIB for k, v in parts.items()}
        for name, parts in phase_bytes(shape, cfg, gpus, sharding).items()
    }
    peak = max(phases, key=lambda p: sum(phases[p].values()))
    allocated = sum(phases[peak].values())
    return phases, peak, allocated, allocated * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB


# Knobs that shrink a phase without changing what is learnt, tried in order, with their floors.
_KNOBS = {
    "training": [("train", "micro_batch_groups", 1)],
    "generation": [("rollout", "generation_batch_size", 1)],
    "repair": [("repair", "batch_size", 1)],
    "evaluation": [("rollout", "generation_batch_size", 1)],
}


def _effective(cfg: Config, key: str, value: int, gpus: int) -> int:
    """A batch knob above what a step can use changes nothing: clamp it first (the generation
    batch serves the rollouts and the held-out answers)."""
    held_out = math.ceil(cfg.data.eval_size / gpus)
    caps = {
        "micro_batch_groups": cfg.train.prompts_per_step,
        "generation_batch_size": max(cfg.train.prompts_per_step * cfg.rollout.group_size, held_out),
    }
    return min(value, caps.get(key, value))


def _shrink(cfg: Config, phase: str, gpus: int) -> bool:
    """Lower the first knob of `phase` above its floor (groups by one, the rest by half)."""
    for section, key, floor in _KNOBS[phase]:
        obj = getattr(cfg, section, None)
        value = getattr(obj, key, None)
        if value is None:
            continue
        value = _effective(cfg, key, value, gpus)
        if value > floor:
            setattr(obj, key, value - 1 if key == "micro_batch_groups" else max(floor, value // 2))
            return True
    return False


def suggest(
    shape: ModelShape, cfg: Config, gpus: int, budget_gb: float, sharding: str = "ddp"
) -> list[str] | None:
    """Overrides (the largest batches that do) under which the step fits; None if none does."""
    trial = copy.deepcopy(cfg)
    for _ in range(1000):
        _, phase, _, total = _totals(shape, trial, gpus, sharding)
        if total <= budget_gb:
            knobs = dict.fromkeys((s, k) for ks in _KNOBS.values() for s, k, _ in ks)
            return [
                f"{s}.{k}={getattr(getattr(trial, s), k)}"
                for s, k in knobs
                if getattr(getattr(trial, s, None), k, None)
                != getattr(getattr(cfg, s, None), k, None)
            ]
        if not _shrink(trial, phase, gpus):
            return None
    return None


def estimate(
    model_config: str | Mapping | ModelShape | None,
    cfg: Config,
    gpus: int = 1,
    gpu_memory_gb: float = 24.0,
    sharding: str = "ddp",
) -> Plan:
    """Peak GPU memory per GPU of a training run of `cfg` on `gpus` GPUs of this size, shared by
    DDP (full replicas) or FSDP (full shard). `model_config`: a config dict, config.json / model
    folder, Hub id, or None (model.name)."""
    if gpus < 1 or gpu_memory_gb <= 0:
        raise ConfigError("--gpus must be >= 1 and --gpu-memory-gb > 0")
    if sharding not in SHARDINGS:
        raise ConfigError(f"--sharding {sharding!r}; choose one of: {', '.join(SHARDINGS)}")
    if gpus > 1 and cfg.rollout.backend == "vllm":  # as distributed.check_launch refuses it
        raise ConfigError(
            "rollout.backend=vllm runs one process: plan it with --gpus 1, or "
            "set rollout.backend=hf for several GPUs"
        )
    shape = load_model_shape(model_config, cfg.model)
    phases, peak, allocated, total = _totals(shape, cfg, gpus, sharding)
    notes, suggestions = [], []
    if total > gpu_memory_gb:
        found = suggest(shape, cfg, gpus, gpu_memory_gb, sharding)
        suggestions = found or []
        if found is None:
            notes.append(
                "no batch setting fits: shorten rollout.max_new_tokens or "
                "data.max_prompt_tokens, or use a larger GPU"
            )
    notes += _notes(shape, cfg, gpus, sharding)
    name = (
        model_config.get("_name_or_path", "model config")
        if isinstance(model_config, Mapping)
        else str(model_config or cfg.model.name)
    )
    trainable = lora_parameter_count(shape, cfg.model.lora_r, cfg.model.lora_target_modules)
    return Plan(
        name,
        shape.parameter_count(),
        trainable,
        gpus,
        gpu_memory_gb,
        phases,
        peak,
        phases[peak],
        allocated,
        total,
        total <= gpu_memory_gb,
        suggestions,
        notes,
        sharding,
    )


def _notes(shape: ModelShape, cfg: Config, gpus: int, sharding: str) -> list[str]:
    """What a plan says beside its numbers: how the GPUs share the run, the vLLM engine's
    estimate, activations offloaded to host memory."""
    notes = []
    if gpus > 1 and sharding == "ddp":
        notes.append("DDP: every GPU holds all of this (--sharding fsdp for FSDP full shard)")
    if gpus > 1 and sharding == "fsdp":
        notes.append(
            f"FSDP full shard: weights, LoRA, grads and optimizer state are 1/{gpus} "
            "per GPU; 4-bit quantisation state, embeddings/lm_head and two decoder "
            "layers are counted whole (FSDP all-gathers them)"
        )
        notes.append("FSDP: generation runs on a whole gathered copy of the weights")
    if cfg.rollout.backend == "vllm":
        notes.append(
            "rollout.backend=vllm: the engine's CUDA graphs and buffers are an estimate, "
            "not measured; it sleeps during training (weights in host memory)"
        )
    if cfg.model.offload_activations and cfg.model.gradient_checkpointing:
        host = offloaded_bytes(shape, cfg, dtype_bytes(cfg.model)) / GIB
        notes.append(
            f"model.offload_activations: the layer inputs wait in {host:.2f} GiB of "
            "pinned host memory during the update"
        )
    return notes


def format_plan(plan: Plan) -> str:
    names = list(plan.phases)
    rows = list(dict.fromkeys(k for parts in plan.phases.values() for k in parts))
    width = max(len(r) for r in rows) + 2
    line = lambda label, cells: label.ljust(width) + "".join(c.rjust(12) for c in cells)
    sums = [sum(plan.phases[n].values()) for n in names]
    out = [
        f"ibpo plan: {plan.model}: {plan.parameters / 1e9:.2f}B parameters, "
        f"{plan.trainable / 1e6:.1f}M trainable (LoRA)",
        "",
        line("GiB", names),
    ]
    out += [
        line(r, [f"{plan.phases[n][r]:.2f}" if r in plan.phases[n] else "-" for n in names])
        for r in rows
    ]
    out.append(line("torch allocations", [f"{s:.2f}" for s in sums]))
    over = [f"{s * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB:.2f}" for s in sums]
    out.append(line(f"+ CUDA context, {FRAGMENTATION:.0%} fragmentation", over))
    verdict = "fits" if plan.fits else "does NOT fit"
    how = f" ({plan.sharding.upper()})" if plan.gpus > 1 else ""
    out += [
        "",
        f"peak: {plan.peak_phase}, {plan.peak_gb:.1f} GiB per GPU: {verdict} on "
        f"{plan.gpus} x {plan.gpu_memory_gb:g} GiB{how}",
    ]
    if plan.suggestions:
        out.append("fits with: " + " ".join(plan.suggestions))
    out += [f"note: {n}" for n in plan.notes]
    out.append("note: worst case: prompts at data.max_prompt_tokens, completions at full length")
    return "\n".join(out)
