"""Memory planner: will this recipe fit on N GPUs of M GiB, and what to change if it does not.

From the model's config (no weights) and a recipe, the peak of each phase of a step is estimated
by counting the tensors the package's own code path holds:
  * generation (and repair generation, evaluation): 4-bit weights + LoRA + optimizer state + the
    KV cache of one `generate` call at full length + one step's sampling logits, or the prompt
    prefill if that is larger;
  * training: the same persistent state + LoRA grads + one micro-batch under gradient
    checkpointing: every layer's input, then either the log-prob head chunk (logprobs.py) or one
    layer recomputed in backward, whichever is larger.
Weights, LoRA and KV-cache bytes are exact (tests/test_plan.py checks them against bitsandbytes,
PEFT and a transformers cache). Activation terms come from reading what the decoder layer,
PEFT's LoRA forward and logprobs.py keep, and are checked on CPU against live-tensor accounting;
the CUDA kernels and allocator are what scripts/bench_gpu.py measures. Sizes are GiB (2**30
bytes): a "24 GB" card has 24 GiB. Worst case throughout: every prompt at
data.max_prompt_tokens, every completion at full length, paged optimizer state resident.

Several GPUs (`gpus` > 1), two ways (`sharding`):
  * ddp: every GPU holds a full replica of all of the above, plus DDP's gradient buckets (a copy
    of the LoRA grads); evaluation is split across GPUs.
  * fsdp (full shard, as recipes/accelerate/fsdp_qlora_2gpu.yaml sets it up): the packed 4-bit
    weights (stored in the compute dtype, see modeling._quantization_config, so FSDP shards them
    like any parameter), the other base parameters, the LoRA weights, their grads and the
    optimizer state are divided by `gpus`. Not divided: bitsandbytes' quantisation state (absmax
    and codes hang off each weight and are not parameters, so every GPU keeps all of it), and what
    FSDP all-gathers. In training that is the parameters outside the decoder layers (embeddings,
    lm_head, final norm, kept gathered after their forward) and two decoder layers (the one
    computing and the one prefetched in backward). Generation, repairs and evaluation run on a
    whole gathered copy (distributed.gathered: one all-gather per rollout instead of one per token),
    so there a GPU holds its shards plus a full replica; with rollout.fsdp_gather=false generation
    gathers layer by layer as training does, at the cost of an all-gather per layer per token.
    Activations, KV cache and logits are per GPU as under DDP. So by default FSDP lowers the
    training peak, not the generation one; for a small
    model with a large vocabulary it can cost more than DDP, and the estimate shows it. With one
    GPU FSDP does not shard (it falls back to NO_SHARD): equals ddp.

Not modelled: mixture-of-experts layers, CPU offload (fsdp_offload_params), DDP/FSDP
communication buffers beyond the gradient buckets.

The published Qwen3 dense configs are tabulated here (KNOWN_ARCHITECTURES), so that their recipes
plan without Hub access; any other model reads its config.json.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ibpo.config import Config, ConfigError, ModelConfig

GIB = 2**30
F32 = 4  # bytes of fp32: LoRA weights and grads, upcast activations, logits
# bitsandbytes NF4 with double quantisation (modeling.py): 4 bits per weight; one absmax per
# 64 weights, itself quantised to 8 bits with one fp32 scale per 256 absmax values; per tensor
# the nested 8-bit code (256 fp32), the NF4 code (16 fp32) and an fp32 offset.
NF4_BLOCK, NF4_NESTED_BLOCK, NF4_TENSOR_BYTES = 64, 256, (256 + 16 + 1) * F32
# PagedAdamW8bit: two uint8 states per parameter + one fp32 absmax per 256 values of each.
ADAMW8_BYTES = 2 + 2 * F32 / 256
ADAMW32_BYTES = 2 * F32  # torch AdamW on fp32 LoRA weights: exp_avg + exp_avg_sq
# One lm_head chunk in logprobs.py, bytes per [chunk, V] element. The fused head turns one fp32
# [chunk, V] buffer in place into log-prob, entropy and gradient direction (plus per-row-block
# partial sums, F32 / 16) and keeps nothing of that size for backward: 4.25 measured on CPU
# (tests/test_logprobs.py). The saved directions add [completion tokens, hidden] fp32. A trained or
# wrapped head (LoRA on lm_head) falls back to checkpointed chunks: five fp32 copies in backward.
HEAD_CHUNK_BYTES = F32 + F32 / 16
HEAD_CHUNK_BYTES_CHECKPOINTED = 5 * F32 + 1
# The repair prompt wraps question, failed attempt and a reference completion in the repair
# template (config.DEFAULT_REPAIR_TEMPLATE, ~60 words): ~96 tokens besides them.
REPAIR_TEMPLATE_TOKENS = 96
# CUDA context, cuBLAS workspaces and loaded kernels sit outside torch's allocator: ~0.5 GiB for
# a torch + cuBLAS process with lazy module loading, plus bitsandbytes' kernels.
CUDA_CONTEXT_GIB = 0.6
# The caching allocator reserves more than it hands out: a KV cache regrown by torch.cat every
# token and micro-batches of varying width leave free blocks too small for the next request.
FRAGMENTATION = 0.10

# The embedded default (ibpo.embedded) is SmolLM2-135M-Instruct, a fixed Llama architecture:
# planning it needs no download.
SMOLLM2_135M = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
)  # fmt: skip
# The Qwen3 dense models as their Hub config.json files give them (the fields the planner reads),
# so `ibpo plan` works offline for them; scripts/bench_gpu.py builds its random models from these.
_QWEN3 = dict(model_type="qwen3", head_dim=128, num_key_value_heads=8, vocab_size=151936)
KNOWN_ARCHITECTURES: dict[str, dict] = {
    "Qwen/Qwen3-0.6B": _QWEN3 | dict(hidden_size=1024, num_hidden_layers=28,
                                     num_attention_heads=16, intermediate_size=3072,
                                     tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": _QWEN3 | dict(hidden_size=2048, num_hidden_layers=28,
                                     num_attention_heads=16, intermediate_size=6144,
                                     tie_word_embeddings=True),
    "Qwen/Qwen3-4B": _QWEN3 | dict(hidden_size=2560, num_hidden_layers=36,
                                   num_attention_heads=32, intermediate_size=9728,
                                   tie_word_embeddings=True),
    "Qwen/Qwen3-8B": _QWEN3 | dict(hidden_size=4096, num_hidden_layers=36,
                                   num_attention_heads=32, intermediate_size=12288,
                                   tie_word_embeddings=False),
    "Qwen/Qwen3-14B": _QWEN3 | dict(hidden_size=5120, num_hidden_layers=40,
                                    num_attention_heads=40, intermediate_size=17408,
                                    tie_word_embeddings=False),
}  # fmt: skip
SHARDINGS = ("ddp", "fsdp")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a dense decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, d: Mapping) -> ModelShape:
        d = d.get("text_config") or d  # multimodal wrappers keep the decoder here
        if d.get("num_experts") or d.get("n_routed_experts") or d.get("num_local_experts"):
            raise ConfigError("the memory planner models dense decoders only, not MoE models")
        try:
            heads = int(d["num_attention_heads"])
            return cls(
                hidden=int(d["hidden_size"]), layers=int(d["num_hidden_layers"]), heads=heads,
                kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
                intermediate=int(d["intermediate_size"]), vocab=int(d["vocab_size"]),
                tied=bool(d.get("tie_word_embeddings", False)),
                qk_norm=d.get("model_type") == "qwen3",
                attention_bias=bool(d.get("attention_bias")),
            )  # fmt: skip
        except KeyError as e:
            raise ConfigError(f"model config has no {e}: not a decoder LM config") from None

    q_dim = property(lambda self: self.heads * self.head_dim)
    kv_dim = property(lambda self: self.kv_heads * self.head_dim)

    def linears(self) -> dict[str, tuple[int, int]]:
        """Per-layer linear modules: name -> (in_features, out_features)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h),
                    gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))  # fmt: skip

    def bias_params(self) -> int:
        return (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0

    def other_params(self) -> int:
        """Embeddings, lm_head (unless tied), norms, biases: the compute dtype under NF4."""
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * (norms + self.bias_params()) + self.hidden

    def parameter_count(self) -> int:
        linear = sum(a * b for a, b in self.linears().values())
        return self.layers * linear + self.other_params()


def load_model_shape(spec: str | Mapping | ModelShape | None, model: ModelConfig) -> ModelShape:
    """A config dict, a config.json or model folder, a Hub id (config only), or model.name.
    Local files come first, then KNOWN_ARCHITECTURES, then the Hub."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, Mapping):
        return ModelShape.from_dict(spec)
    name = spec or model.name
    from ibpo.embedded import EMBEDDED_NAME

    if name == EMBEDDED_NAME:
        return ModelShape.from_dict(SMOLLM2_135M)
    path = Path(name).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if path.is_file():
        try:
            return ModelShape.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"model config '{path}' is not valid JSON: {e}") from None
    if name in KNOWN_ARCHITECTURES:
        return ModelShape.from_dict(KNOWN_ARCHITECTURES[name])
    if path.suffix == ".json" or name.startswith(("/", ".", "~")):  # a path, not a Hub id
        raise ConfigError(f"model config '{path}' not found: give a config.json, a model "
                          "folder or a Hub id")  # fmt: skip
    from transformers import AutoConfig

    try:
        hub = AutoConfig.from_pretrained(
            name, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"could not read the config of '{name}': {e}\n  Fix: pass --model-config with a local "
            "config.json, or allow Hub access (only config.json is fetched, no weights)."
        ) from None
    return ModelShape.from_dict(hub.to_dict())


# --- exact byte counts ---------------------------------------------------------------------------


def nf4_state_bytes(numel: int) -> int:
    """The quantisation state of one NF4 tensor: 8-bit absmax per block, their fp32 scales, the
    codes. It hangs off the weight (not a parameter): FSDP does not shard it."""
    blocks = math.ceil(numel / NF4_BLOCK)
    return blocks + math.ceil(blocks / NF4_NESTED_BLOCK) * F32 + NF4_TENSOR_BYTES


def nf4_bytes(numel: int) -> int:
    """Bytes of one bitsandbytes NF4 tensor with double quantisation (packed data + state)."""
    return math.ceil(numel / 2) + nf4_state_bytes(numel)


def weight_bytes(shape: ModelShape, quantization: str, dtype_bytes: int) -> int:
    """The frozen base: NF4 decoder linears + everything else in the compute dtype."""
    if quantization != "nf4":
        return shape.parameter_count() * dtype_bytes
    packed = sum(nf4_bytes(a * b) for a, b in shape.linears().values())
    return shape.layers * packed + shape.other_params() * dtype_bytes


def lora_targets(shape: ModelShape, targets: str | list[str]) -> dict[str, tuple[int, int]]:
    """The per-layer modules PEFT wraps: 'all-linear', a list of module names, or a regex
    (PEFT matches it against full names such as model.layers.0.mlp.up_proj)."""
    mods = shape.linears()
    if targets == "all-linear":
        return mods
    if isinstance(targets, str):
        block = lambda n: "mlp" if n in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        return {n: d for n, d in mods.items()
                if re.fullmatch(targets, f"model.layers.0.{block(n)}.{n}")}  # fmt: skip
    return {n: d for n, d in mods.items() if n in targets}


def lora_parameter_count(shape: ModelShape, r: int, targets: str | list[str]) -> int:
    """r * (in + out) for each wrapped module (lora_A [r, in] + lora_B [out, r])."""
    return shape.layers * sum(r * (a + b) for a, b in lora_targets(shape, targets).values())


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Keys + values of every layer for `sequences` x `tokens` positions."""
    return 2 * shape.layers * shape.kv_dim * dtype_bytes * sequences * tokens


# --- activations (bytes per token; b = compute dtype bytes) --------------------------------------


def layer_saved_per_token(shape: ModelShape, targets: dict, r: int, b: int) -> float:
    """What one decoder layer keeps for backward. Each RMSNorm saves its input upcast to fp32
    (two norms, plus q/k norms in Qwen3). PEFT casts a LoRA module's input to the adapter's fp32
    and lora_A keeps that copy, lora_B keeps lora_A's [tokens, r] output; the 4-bit base matmul
    keeps only its weight. sdpa keeps q, k and v after RoPE (k, v repeated to every head: with a
    padding mask sdpa cannot do GQA itself), its output and an fp32 logsumexp per head. The MLP
    keeps gate (for SiLU), silu(gate) and up (for their product)."""
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    norms = 2 * F32 * h + (F32 * (q + kv) if shape.qk_norm else 0)
    lora = sum(F32 * (a + r) for a, _ in targets.values())
    return norms + lora + 4 * b * q + F32 * shape.heads + 3 * b * shape.intermediate


def layer_transient_per_token(shape: ModelShape) -> float:
    """Buffers beside the saved tensors while a layer is recomputed and back-propagated: an fp32
    [tokens, intermediate] LoRA output or gradient, and fp32 hidden-sized gradients."""
    return F32 * shape.intermediate + 2 * F32 * shape.hidden


def prefill_per_token(shape: ModelShape, b: int) -> float:
    """One layer's no-grad forward over prompts, at its widest (the up projection): silu(gate)
    and up's output in b, the LoRA branch's fp32 output and its scaled copy; hidden-sized: the
    fp32 cast of the input and the residual stream, norm and embedding outputs in b."""
    return (2 * b + 2 * F32) * shape.intermediate + 3 * F32 * shape.hidden


def mask_bytes(sequences: int, length: int, b: int) -> tuple[int, int]:
    """(the bool [N, 1, L, L] padding mask shared by all layers, sdpa's float copy in a layer)."""
    return sequences * length * length, sequences * length * length * b


def sampling_bytes(sequences: int, vocab: int, b: int, top_p: float, sample: bool) -> int:
    """One decoding step over [N, V]: the logits (b), their fp32 copy, each logits processor's
    fresh output and the probabilities; top-p adds a sort (fp32 values, int64 indices), a
    cumulative sum and a scatter. Greedy keeps the copy, one processor output and the argmax."""
    per = b + (6 * F32 if sample else 3 * F32) + (24 if sample and top_p < 1 else 0)
    return sequences * vocab * per


# --- phases --------------------------------------------------------------------------------------


def _dtype_bytes(model: ModelConfig) -> int:
    return 4 if model.dtype == "float32" else 2  # auto is bf16 (or fp16) on CUDA


def _dequant_bytes(shape: ModelShape, model: ModelConfig, b: int) -> int:
    """A 4-bit matmul over many rows first dequantises its whole weight to the compute dtype."""
    return max(a * o for a, o in shape.linears().values()) * b if model.quantization == "nf4" else 0


def _persistent(shape: ModelShape, cfg: Config, b: int, shards: int = 1) -> dict[str, int]:
    """Held from load to exit: the frozen base, the LoRA weights and the optimizer state, each
    divided over `shards` GPUs (FSDP) except the 4-bit quantisation state."""
    mc = cfg.model
    n = lora_parameter_count(shape, mc.lora_r, mc.lora_target_modules)
    fp32 = cfg.train.optimizer == "adamw"  # auto = paged 8-bit AdamW on CUDA
    base = weight_bytes(shape, mc.quantization, b)
    state = shape.layers * sum(nf4_state_bytes(a * o) for a, o in shape.linears().values())
    state = state if mc.quantization == "nf4" else 0
    parts = {
        f"base weights ({mc.quantization})": math.ceil((base - state) / shards) + state,
        "LoRA weights (fp32)": math.ceil(F32 * n / shards),
        "optimizer state": math.ceil((ADAMW32_BYTES if fp32 else ADAMW8_BYTES) * n / shards),
    }
    if shards > 1:
        parts["FSDP all-gathered parameters"] = _fsdp_gathered(shape, mc, b)
    return parts


def _fsdp_gathered(shape: ModelShape, model: ModelConfig, b: int) -> int:
    """Full-size copies FSDP holds beside the shards: the root unit (embeddings, lm_head, final
    norm), kept gathered after its forward, and two decoder layers (computing + prefetched)."""
    root = shape.vocab * shape.hidden * (1 if shape.tied else 2) * b + shape.hidden * b
    packed = sum(
        math.ceil(a * o / 2) if model.quantization == "nf4" else a * o * b
        for a, o in shape.linears().values()
    )
    norms = (2 * shape.hidden + (2 * shape.head_dim if shape.qk_norm else 0)) * b
    lora = F32 * lora_parameter_count(shape, model.lora_r, model.lora_target_modules)
    layer = packed + norms + shape.bias_params() * b + lora // shape.layers
    return root + 2 * layer


def _fsdp_whole(shape: ModelShape, model: ModelConfig, b: int) -> int:
    """Every parameter gathered whole beside its shard (the 4-bit codes and the LoRA weights);
    the quantisation state is not a parameter: never sharded, never gathered."""
    base = weight_bytes(shape, model.quantization, b)
    if model.quantization == "nf4":
        base -= shape.layers * sum(nf4_state_bytes(a * o) for a, o in shape.linears().values())
    return base + F32 * lora_parameter_count(shape, model.lora_r, model.lora_target_modules)


def _generation(shape, model, b, batch, prompt, new, sampling, static=False) -> dict[str, int]:
    """One generate() call: the larger of the prefill (short cache, wide working set) and the
    last decoding step (full cache; torch.cat regrows a layer's cache, old and new coexist).
    A static cache (rollout.kv_cache) is allocated at full length before the prefill and never
    regrown."""
    deq = _dequant_bytes(shape, model, b)
    full = kv_cache_bytes(shape, batch, prompt + new, b)
    decode = {"KV cache": full, "KV regrowth (one layer)": full // shape.layers,
              "sampling logits": sampling, "4-bit dequant buffer": deq}  # fmt: skip
    if static:
        del decode["KV regrowth (one layer)"]
    prefill = {
        "KV cache": full if static else kv_cache_bytes(shape, batch, prompt, b),
        "prefill working set": int(batch * prompt * prefill_per_token(shape, b))
        + sum(mask_bytes(batch, prompt, b)),
        "4-bit dequant buffer": deq,
    }
    return decode if sum(decode.values()) >= sum(prefill.values()) else prefill


def _offloaded_bytes(shape: ModelShape, cfg: Config, b: int) -> int:
    """The layer inputs of one micro-batch, all full length: what offloading moves to the host."""
    seqs = min(cfg.train.micro_batch_groups, cfg.train.prompts_per_step) * cfg.rollout.group_size
    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    return shape.layers * seqs * length * shape.hidden * b


def _training(shape: ModelShape, cfg: Config, b: int) -> dict[str, int]:
    """LoRA grads + the activations of one micro-batch of whole groups, all full length."""
    tr, mc, G = cfg.train, cfg.model, cfg.rollout.group_size
    seqs = min(tr.micro_batch_groups, tr.prompts_per_step) * G
    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    S, M = seqs * length, seqs * cfg.rollout.max_new_tokens  # positions, completion tokens
    saved = layer_saved_per_token(shape, lora_targets(shape, mc.lora_target_modules),
                                  mc.lora_r, b)  # fmt: skip
    bool_mask, float_mask = mask_bytes(seqs, length, b)
    shared = bool_mask + 2 * S * shape.head_dim * b  # padding mask, RoPE cos/sin
    transient = S * layer_transient_per_token(shape) + float_mask
    if mc.gradient_checkpointing:  # keep each layer's input, recompute one layer at a time
        kept = shape.layers * S * shape.hidden * b + shared
        layer = S * saved + float_mask + transient
        if mc.offload_activations:  # inputs in host memory; one comes back per layer in backward
            kept, layer = shared, layer + S * shape.hidden * b
    else:
        kept = shape.layers * (S * saved + float_mask) + shared
        layer = transient
    # final norm (fp32 input saved, b output), the completion hidden states, one head chunk
    head = S * (F32 + b) * shape.hidden + M * shape.hidden * b
    targets = mc.lora_target_modules
    fused = not (isinstance(targets, list) and "lm_head" in targets)
    if fused:  # the saved gradient directions, [M, hidden] fp32
        head += M * shape.hidden * F32
    per = HEAD_CHUNK_BYTES if fused else HEAD_CHUNK_BYTES_CHECKPOINTED
    head += int(per * min(tr.logprob_chunk_tokens, M) * shape.vocab)
    top = ("log-prob head chunk", head) if head >= layer else ("one layer in backward", layer)
    return {
        "LoRA grads (fp32)": F32 * lora_parameter_count(shape, mc.lora_r, mc.lora_target_modules),
        "activations: layer inputs" if mc.gradient_checkpointing else "activations": kept,
        f"activations: {top[0]}": top[1],
        "4-bit dequant buffer": _dequant_bytes(shape, mc, b),
        # ids and attention mask (int64), completion mask and advantages (fp32) of the step
        "rollout tensors": tr.prompts_per_step * G * length * 24,
    }


def _repair_settings(cfg: Config) -> tuple[int, int, int] | None:
    """(batch, prompt tokens, new tokens) of the repair generations, None when repairs are off.
    Reads the config's `repair` section (IBPO.md Part 2) where there is one."""
    rep = getattr(cfg, "repair", None)
    enabled = getattr(rep, "enabled", None)
    if rep is not None and enabled is None:
        from ibpo.objectives import resolve_params

        enabled = getattr(resolve_params(cfg.objective), "counterfactual", False)
    if not enabled:
        return None
    ro, G = cfg.rollout, cfg.rollout.group_size
    jobs = cfg.train.prompts_per_step * min(getattr(rep, "max_repairs_per_group", G), G)
    jobs *= getattr(rep, "references", 1)
    batch = getattr(rep, "batch_size", None) or ro.generation_batch_size
    prompt = cfg.data.max_prompt_tokens + 2 * ro.max_new_tokens + REPAIR_TEMPLATE_TOKENS
    return min(batch, jobs), prompt, getattr(rep, "max_new_tokens", None) or ro.max_new_tokens


def phase_bytes(
    shape: ModelShape, cfg: Config, gpus: int = 1, sharding: str = "ddp"
) -> dict[str, dict[str, int]]:
    """Bytes per component at the peak of each phase of a step (torch allocations only)."""
    b, ro, V = _dtype_bytes(cfg.model), cfg.rollout, shape.vocab
    shards = gpus if sharding == "fsdp" else 1  # FSDP on one GPU does not shard (NO_SHARD)
    P = cfg.data.max_prompt_tokens
    n = min(ro.generation_batch_size, cfg.train.prompts_per_step * ro.group_size)
    sampling = sampling_bytes(n, V, b, ro.top_p, sample=True)
    static = ro.kv_cache != "dynamic"
    phases = {
        "generation": _generation(shape, cfg.model, b, n, P, ro.max_new_tokens, sampling, static)
    }
    repair = _repair_settings(cfg)
    if repair:
        n, p, t = repair
        sampling = sampling_bytes(n, V, b, ro.top_p, sample=True)
        phases["repair"] = _generation(shape, cfg.model, b, n, p, t, sampling, static)
    train = phases["training"] = _training(shape, cfg, b)
    train["LoRA grads (fp32)"] = math.ceil(train["LoRA grads (fp32)"] / shards)
    if gpus > 1 and sharding == "ddp":  # DDP copies the gradients into its reduction buckets
        train["DDP grad buckets"] = train["LoRA grads (fp32)"]
    if cfg.data.eval_size > 0:
        n = min(ro.eval_batch_size, math.ceil(cfg.data.eval_size / gpus))
        sampling = sampling_bytes(n, V, b, 1.0, sample=False)
        phases["evaluation"] = _generation(
            shape, cfg.model, b, n, P, ro.eval_max_new_tokens, sampling, static
        )
    base = _persistent(shape, cfg, b, shards)
    out = {name: {**base, **parts} for name, parts in phases.items()}
    if shards > 1 and cfg.rollout.fsdp_gather:  # generation on a gathered copy of everything
        whole = _fsdp_whole(shape, cfg.model, b)
        for name, parts in out.items():
            if name != "training":
                del parts["FSDP all-gathered parameters"]
                parts["FSDP gathered weights (generation)"] = whole
    return out


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
    phases = {name: {k: v / GIB for k, v in parts.items()}
              for name, parts in phase_bytes(shape, cfg, gpus, sharding).items()}  # fmt: skip
    peak = max(phases, key=lambda p: sum(phases[p].values()))
    allocated = sum(phases[peak].values())
    return phases, peak, allocated, allocated * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB


# Knobs that shrink a phase without changing what is learnt, tried in order, with their floors.
_KNOBS = {
    "training": [("train", "micro_batch_groups", 1), ("train", "logprob_chunk_tokens", 128)],
    "generation": [("rollout", "generation_batch_size", 1)],
    "repair": [("repair", "batch_size", 1), ("rollout", "generation_batch_size", 1)],
    "evaluation": [("rollout", "eval_batch_size", 1)],
}


def _effective(cfg: Config, key: str, value: int, gpus: int) -> int:
    """A batch knob above what a step can use changes nothing: clamp it first."""
    caps = {
        "micro_batch_groups": cfg.train.prompts_per_step,
        "generation_batch_size": cfg.train.prompts_per_step * cfg.rollout.group_size,
        "eval_batch_size": math.ceil(max(cfg.data.eval_size, 1) / gpus),
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
            return [f"{s}.{k}={getattr(getattr(trial, s), k)}" for s, k in knobs
                    if getattr(getattr(trial, s, None), k, None)
                    != getattr(getattr(cfg, s, None), k, None)]  # fmt: skip
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
    shape = load_model_shape(model_config, cfg.model)
    phases, peak, allocated, total = _totals(shape, cfg, gpus, sharding)
    notes, suggestions = [], []
    if total > gpu_memory_gb:
        found = suggest(shape, cfg, gpus, gpu_memory_gb, sharding)
        suggestions = found or []
        if found is None:
            notes.append("no batch setting fits: shorten rollout.max_new_tokens or "
                         "data.max_prompt_tokens, or use a larger GPU")  # fmt: skip
    if gpus > 1 and sharding == "ddp":
        notes.append("DDP: every GPU holds all of this (--sharding fsdp for FSDP full shard)")
    if gpus > 1 and sharding == "fsdp":
        notes.append(f"FSDP full shard: weights, LoRA, grads and optimizer state are 1/{gpus} "
                     "per GPU; 4-bit quantisation state, embeddings/lm_head and two decoder "
                     "layers are counted whole (FSDP all-gathers them)")  # fmt: skip
        if cfg.rollout.fsdp_gather:
            notes.append("FSDP: generation runs on a whole gathered copy of the weights; "
                         "rollout.fsdp_gather=false gathers layer by layer instead (less memory, "
                         "an all-gather per layer per token)")  # fmt: skip
    if cfg.model.offload_activations and cfg.model.gradient_checkpointing:
        host = _offloaded_bytes(shape, cfg, _dtype_bytes(cfg.model)) / GIB
        notes.append(f"model.offload_activations: the layer inputs wait in {host:.2f} GiB of "
                     "pinned host memory during the update")  # fmt: skip
    name = model_config.get("_name_or_path", "model config") if isinstance(
        model_config, Mapping) else str(model_config or cfg.model.name)  # fmt: skip
    trainable = lora_parameter_count(shape, cfg.model.lora_r, cfg.model.lora_target_modules)
    return Plan(name, shape.parameter_count(), trainable, gpus, gpu_memory_gb, phases, peak,
                phases[peak], allocated, total, total <= gpu_memory_gb, suggestions,
                notes, sharding)  # fmt: skip


def format_plan(plan: Plan) -> str:
    names = list(plan.phases)
    rows = list(dict.fromkeys(k for parts in plan.phases.values() for k in parts))
    width = max(len(r) for r in rows) + 2
    line = lambda label, cells: label.ljust(width) + "".join(c.rjust(12) for c in cells)
    sums = [sum(plan.phases[n].values()) for n in names]
    out = [f"ibpo plan: {plan.model}: {plan.parameters / 1e9:.2f}B parameters, "
           f"{plan.trainable / 1e6:.1f}M trainable (LoRA)", "", line("GiB", names)]  # fmt: skip
    out += [line(r, [f"{plan.phases[n][r]:.2f}" if r in plan.phases[n] else "-" for n in names])
            for r in rows]  # fmt: skip
    out.append(line("torch allocations", [f"{s:.2f}" for s in sums]))
    over = [f"{s * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB:.2f}" for s in sums]
    out.append(line(f"+ CUDA context, {FRAGMENTATION:.0%} fragmentation", over))
    verdict = "fits" if plan.fits else "does NOT fit"
    how = f" ({plan.sharding.upper()})" if plan.gpus > 1 else ""
    out += ["", f"peak: {plan.peak_phase}, {plan.peak_gb:.1f} GiB per GPU: {verdict} on "
                f"{plan.gpus} x {plan.gpu_memory_gb:g} GiB{how}"]  # fmt: skip
    if plan.suggestions:
        out.append("fits with: " + " ".join(plan.suggestions))
    out += [f"note: {n}" for n in plan.notes]
    out.append("note: worst case: prompts at data.max_prompt_tokens, completions at full length")
    return "\n".join(out)
