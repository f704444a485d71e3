"""What a model holds, in bytes: architecture shapes and exact or per-token sizes.

The arithmetic under the memory planner (plan/phases.py, plan/fit.py): a dense decoder's dimensions
(ModelShape, from a config.json, a Hub id's config or the tabulated Qwen3 models in
KNOWN_ARCHITECTURES), exact byte counts of the NF4 weights and their quantisation state, LoRA
parameters and the KV cache (tests/test_plan.py checks them against bitsandbytes, PEFT and a
transformers cache), and the activation terms per token that the decoder layer, PEFT's LoRA
forward and logprobs.py keep (checked on CPU against live-tensor accounting).

Also the request sizes a run's generation calls imply (repair_generation, vllm_budget: the vLLM
engine's KV budget and longest request). Not here: which of these a phase of a step holds at
once (plan/phases.py), or whether it fits (plan/fit.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ibpo.config import VLLM_BATCHED_TOKENS as VLLM_BATCHED_TOKENS  # re-exported
from ibpo.config import ConfigError, ModelConfig
from ibpo.embedded import EMBEDDED_NAME

GIB = 2**30
# Completion tokens per lm_head chunk of training's log-probs (step.py; the planner counts one
# fp32 [chunk, V] block).
CHUNK_TOKENS = 1024
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
# wrapped head (LoRA on lm_head; FSDP's hooks and DTensor weight) falls back to checkpointed chunks:
# five fp32 copies in backward.
HEAD_CHUNK_BYTES = F32 + F32 / 16
HEAD_CHUNK_BYTES_CHECKPOINTED = 5 * F32 + 1
# The repair prompt wraps question, failed attempt and a reference completion in repair.template
# (repair_template_tokens below counts what it adds besides them).
REPAIR_PLACEHOLDERS = ("{question}", "{attempt}", "{reference}")
# The vLLM rollout engine (generation/vllm.py). LoRA ranks it has adapter slots for, in every
# release the vllm extra admits (an adapter is served by the next one up):
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
# The most prompt tokens it runs per step, VLLM_BATCHED_TOKENS (config.py, which checks the batch
# against it), is imported above.
VLLM_KV_ROUND = 256  # tokens: a multiple of vLLM's KV block sizes (16 by default)
# Outside torch's allocator, awake or asleep: CUDA graphs, NCCL/cuBLAS workspaces, sampler buffers
# (an estimate: no GPU measurement yet)
VLLM_OVERHEAD_BYTES = int(1.5 * GIB)

# The embedded default (ibpo.embedded) is SmolLM2-135M-Instruct, a fixed Llama architecture:
# planning it needs no download.
SMOLLM2_135M = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
)  # fmt: skip
# The Qwen3 dense models as their Hub config.json files give them (the fields the planner reads),
# so `ibpo plan` works offline for them; bench/bench_gpu.py builds its random models from these.
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
                hidden=int(d["hidden_size"]),
                layers=int(d["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
                intermediate=int(d["intermediate_size"]),
                vocab=int(d["vocab_size"]),
                tied=bool(d.get("tie_word_embeddings", False)),
                qk_norm=d.get("model_type") == "qwen3",
                attention_bias=bool(d.get("attention_bias")),
            )
        except KeyError as e:
            raise ConfigError(f"model config has no {e}: not a decoder LM config") from None

    q_dim = property(lambda self: self.heads * self.head_dim)
    kv_dim = property(lambda self: self.kv_heads * self.head_dim)

    def linears(self) -> dict[str, tuple[int, int]]:
        """Per-layer linear modules: name -> (in_features, out_features)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return dict(
            q_proj=(h, q),
            k_proj=(h, kv),
            v_proj=(h, kv),
            o_proj=(q, h),
            gate_proj=(h, i),
            up_proj=(h, i),
            down_proj=(i, h),
        )

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
        raise ConfigError(
            f"model config '{path}' not found: give a config.json, a model folder or a Hub id"
        )
    from transformers import AutoConfig

    try:
        hub = AutoConfig.from_pretrained(name, revision=model.revision)
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
        return {
            n: d for n, d in mods.items() if re.fullmatch(targets, f"model.layers.0.{block(n)}.{n}")
        }
    return {n: d for n, d in mods.items() if n in targets}


def lora_parameter_count(shape: ModelShape, r: int, targets: str | list[str]) -> int:
    """r * (in + out) for each wrapped module (lora_A [r, in] + lora_B [out, r])."""
    return shape.layers * sum(r * (a + b) for a, b in lora_targets(shape, targets).values())


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Keys + values of every layer for `sequences` x `tokens` positions."""
    return 2 * shape.layers * shape.kv_dim * dtype_bytes * sequences * tokens


# Cache columns per bucket of the decode engine on CUDA (generation/decode.py): its static cache
# holds a call's prompt + new tokens rounded up to whole buckets, and attention reads whole
# buckets; each bucket is one captured CUDA graph per row count.
DECODE_BUCKET = 256


def engine_columns(tokens: int) -> int:
    """The decode engine's cache columns for a call of `tokens` prompt + new tokens."""
    return -(-tokens // DECODE_BUCKET) * DECODE_BUCKET


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


def engine_sampling_bytes(sequences: int, vocab: int, b: int, top_p: float, sample: bool) -> int:
    """The decode engine's step over [N, V] (generation/decode.py): its fp32 logits buffer, and
    the larger of the head's output (b) with its fp32 copy and, when sampling, draw()'s fp32
    shifted scores and float64 cumulative sum; top-p adds a sort (fp32 values, int64 indices),
    the probabilities, their cumulative sum and the filtered copy."""
    pick = (3 * F32 + (5 * F32 + 9 if top_p < 1 else 0)) if sample else 0
    return sequences * vocab * (F32 + max(b + F32, pick))


# --- generation requests -------------------------------------------------------------------------


def repair_template_tokens(template: str) -> int:
    """Tokens repair.template adds to a repair prompt besides the question, attempt and reference
    it holds. The planner has no tokenizer, so it counts the template's UTF-8 bytes: exact for a
    character tokenizer on ASCII text (bench/bench_gpu.py's), an upper bound for byte-level BPE
    tokenizers, whose merges only shorten (the default template is 256 bytes; SmolLM2-135M's
    tokenizer makes 59 tokens of it)."""
    for placeholder in REPAIR_PLACEHOLDERS:
        template = template.replace(placeholder, "")
    return len(template.encode())


def repair_generation(cfg) -> tuple[int, int, int] | None:
    """(batch, prompt tokens, new tokens) of a resolved config's repair generations (IBPO.md
    Part 2), None when repairs are off (as they are for rollouts that call tools: step.py)."""
    rep, ro = cfg.repair, cfg.rollout
    if not rep.enabled or ro.tools:
        return None
    jobs = cfg.train.prompts_per_step * min(rep.max_repairs_per_group, ro.group_size)
    jobs *= rep.references
    # the prompt as repair.repair_prompt renders it: the problem's rendered prompt (chat template
    # and data.prompt_template included), the template's own text, the attempt and the reference
    prompt = (
        cfg.data.max_prompt_tokens + 2 * ro.max_new_tokens + repair_template_tokens(rep.template)
    )
    return min(rep.batch_size, jobs), prompt, ro.max_new_tokens


def vllm_slot_rank(r: int) -> int:
    for slot in VLLM_LORA_RANKS:
        if slot >= r:
            return slot
    raise ConfigError(f"model.lora_r={r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def vllm_budget(
    shape: ModelShape, cfg, b: int, max_positions: int | None = None
) -> tuple[int, int]:
    """(max_model_len, KV-cache bytes) of the vLLM rollout engine (generation/vllm.py). The KV
    budget holds one generation_batch_size batch at full length; vLLM schedules within it. It
    is raised, if need be, to hold the longest request this run makes (a repair prompt carries
    two completions) and rounded up to whole KV blocks. max_model_len is the most a single
    request may use: all of that budget, capped by the model's positions. b: bytes per KV element
    (the compute dtype)."""
    ro, P = cfg.rollout, cfg.data.max_prompt_tokens
    longest = P + max(ro.max_new_tokens, ro.eval_max_new_tokens)
    repair = repair_generation(cfg)
    if repair:
        longest = max(longest, repair[1] + repair[2])
    batch = min(ro.generation_batch_size, cfg.train.prompts_per_step * ro.group_size)
    kv = kv_cache_bytes(shape, batch, P + ro.max_new_tokens, b)
    per_token = kv_cache_bytes(shape, 1, 1, b)
    length = max(kv // per_token, longest)
    # whole KV blocks: vLLM wants room for a max_model_len request rounded up to its block size
    kv = per_token * -(-length // VLLM_KV_ROUND) * VLLM_KV_ROUND
    return (min(length, max_positions) if max_positions else length), kv
