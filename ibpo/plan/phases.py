"""What each phase of a step holds on a GPU, component by component (bytes), for the planner.

From the model's shape (sizes.py) and a recipe, the peak of each phase of a step is estimated by
counting the tensors the package's own code path holds:
  * generation (and repair generation, evaluation): 4-bit weights + LoRA + optimizer state + the
    KV cache of one `generate` call at full length + one step's sampling logits, or the prompt
    prefill if that is larger (a rollout prefills each group's prompt once,
    generation.prefixes.prefill);
  * training: the same persistent state + LoRA grads + one micro-batch under gradient
    checkpointing: every layer's input, then either the log-prob head chunk (logprobs.py) or one
    layer recomputed in backward, whichever is larger.
Weights, LoRA and KV-cache bytes are exact (tests/test_plan.py checks them against bitsandbytes,
PEFT and a transformers cache). Activation terms come from reading what the decoder layer,
PEFT's LoRA forward and logprobs.py keep, and are checked on CPU against live-tensor accounting;
the CUDA kernels and allocator are what bench/bench_gpu.py measures. Bytes here (fit.py
reports GiB). Worst case throughout: every prompt at data.max_prompt_tokens, every completion at
full length, paged optimizer state resident.

Several GPUs (`gpus` > 1), two ways (`sharding`):
  * ddp: every GPU holds a full replica of all of the above, plus DDP's gradient buckets (a copy
    of the LoRA grads); evaluation is split across GPUs.
  * fsdp (full shard, as recipes/accelerate/fsdp_qlora_2gpu.yaml sets it up): the packed 4-bit
    weights (stored in the compute dtype, see modeling._quantization_config, so FSDP shards them
    like any parameter), the other base parameters, the LoRA weights, their grads and the
    optimizer state are divided by `gpus`. Not divided: bitsandbytes' quantisation state (absmax
    and codes hang off each weight and are not parameters, so every GPU keeps all of it), and
    what FSDP all-gathers. In training that is the parameters outside the decoder layers
    (embeddings, lm_head, final norm, kept gathered after their forward) and two decoder layers
    (the one computing and the one prefetched in backward). Generation, repairs and evaluation
    run on a whole gathered copy (distributed.gathered: one all-gather per rollout instead of
    one per token), so there a GPU holds its shards plus a full replica (and ranks need not
    generate in lock-step: no collective runs while generating). Activations, KV cache and
    logits are per GPU as under DDP. So FSDP lowers the training peak, not the
    generation one; for a small model with a large vocabulary it can cost more than DDP, and the
    estimate shows it. With one GPU FSDP divides nothing (a mesh of one) and its state is
    counted as ddp's.
  * the log-prob head under FSDP (any number of GPUs, one included: Accelerate wraps a
    one-process run the same way) is the checkpointed one, not the fused one: FSDP2's hooks on
    lm_head and its DTensor weight fail logprobs.fused_head_supported (`fused_head`).

Options the estimate follows: model.offload_activations (layer inputs in host memory during the
update).

Not modelled: mixture-of-experts layers, CPU offload (fsdp_offload_params), DDP/FSDP
communication buffers beyond the gradient buckets.

With rollout.backend=vllm the generation phases hold the policy's state plus the engine's own
(generation/vllm.py): its copy of the base, a LoRA slot, its KV budget, a workspace and an estimate
for its CUDA graphs and buffers; while it sleeps, training adds only that estimate.

Not here: whether it fits, suggestions, or printing (fit.py); the byte counts themselves
(sizes.py).
"""

from __future__ import annotations

import math

from ibpo.config import Config, ModelConfig
from ibpo.sizes import (
    ADAMW8_BYTES,
    ADAMW32_BYTES,
    CHUNK_TOKENS,
    F32,
    HEAD_CHUNK_BYTES,
    HEAD_CHUNK_BYTES_CHECKPOINTED,
    VLLM_BATCHED_TOKENS,
    VLLM_OVERHEAD_BYTES,
    ModelShape,
    engine_columns,
    engine_sampling_bytes,
    kv_cache_bytes,
    layer_saved_per_token,
    layer_transient_per_token,
    lora_parameter_count,
    lora_targets,
    mask_bytes,
    nf4_state_bytes,
    prefill_per_token,
    repair_generation,
    sampling_bytes,
    vllm_budget,
    vllm_slot_rank,
    weight_bytes,
)


def dtype_bytes(model: ModelConfig) -> int:
    # auto is bf16 on a GPU with native bf16 (Ampere+), which the planner assumes; on an older GPU
    # auto computes in fp32 (modeling.compute_dtype): plan those with model.dtype=float32
    return 4 if model.dtype == "float32" else 2


def _dequant_bytes(shape: ModelShape, model: ModelConfig, b: int) -> int:
    """A 4-bit matmul over many rows first dequantises its whole weight to the compute dtype."""
    return max(a * o for a, o in shape.linears().values()) * b if model.quantization == "nf4" else 0


def _persistent(
    shape: ModelShape, cfg: Config, b: int, shards: int = 1, fsdp: bool = False
) -> dict[str, int]:
    """Held from load to exit: the frozen base, the LoRA weights and the optimizer state, each
    divided over `shards` GPUs (FSDP) except the 4-bit quantisation state."""
    mc = cfg.model
    n = lora_parameter_count(shape, mc.lora_r, mc.lora_target_modules)
    # auto = paged 8-bit AdamW on CUDA, torch AdamW under FSDP on any number of GPUs
    # (trainer.build_optimizer)
    fp32 = cfg.train.optimizer == "adamw" or (cfg.train.optimizer == "auto" and fsdp)
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


def _generation(
    shape, model, b, batch, prompt, new, sampling, groups=None, engine=False
) -> dict[str, int]:
    """One generate() call: the larger of the prefill (short cache, wide working set) and the
    last decoding step. `groups`: the call's distinct prompts when its rows are groups of one
    prompt each: the rollout runs each prompt once and repeats its cache to the group's rows
    (generation.prefixes.prefill), so the prefill holds the cache and working set of `groups`
    rows; the repeated cache is the decoding steps' (counted there at full length).

    Decoding with HF generate (`engine` False), torch.cat regrows a layer's cache, old and new
    coexist. With the decode engine (generation/decode.py) the cache is static, allocated at
    whole buckets (sizes.engine_columns) and filled from the prompt's cache, each layer of which
    is freed once copied, before the first step; then its captured graphs keep the step's
    temporaries (the sampling logits). The larger of the two is counted beside the static
    cache."""
    deq = _dequant_bytes(shape, model, b)
    rows = batch if groups is None else groups
    full = kv_cache_bytes(shape, batch, prompt + new, b)
    decode = {
        "KV cache": full,
        "KV regrowth (one layer)": full // shape.layers,
        "sampling logits": sampling,
        "4-bit dequant buffer": deq,
    }
    if engine:  # the prompt's cache is freed before the first step samples
        decode = {
            "KV cache (static, whole buckets)": kv_cache_bytes(
                shape, batch, engine_columns(prompt + new), b
            ),
            "4-bit dequant buffer": deq,
        }
        layer = kv_cache_bytes(shape, batch, prompt, b) // shape.layers
        if layer > sampling:
            decode["prompt cache, one layer (copied in)"] = layer
        else:
            decode["sampling logits (graph pool)"] = sampling
    prefill = {
        "KV cache": kv_cache_bytes(shape, rows, prompt, b),
        "prefill working set": int(rows * prompt * prefill_per_token(shape, b))
        + sum(mask_bytes(rows, prompt, b)),
        "4-bit dequant buffer": deq,
    }
    return decode if sum(decode.values()) >= sum(prefill.values()) else prefill


def _vllm_engine(shape: ModelShape, cfg: Config, b: int) -> dict[str, int]:
    """What the vLLM engine (generation/vllm.py) holds while it generates: its own copy of the base,
    quantised as the policy's; one LoRA slot at vLLM's rank (every linear, compute dtype); its
    fixed KV budget; a prefill chunk's activations and the sampler's logits (as HF's); and, outside
    torch, its CUDA graphs and buffers (an estimate, sizes.VLLM_OVERHEAD_BYTES)."""
    q, slot = cfg.model.quantization, vllm_slot_rank(cfg.model.lora_r)
    seqs = min(cfg.rollout.generation_batch_size, VLLM_BATCHED_TOKENS)
    return {
        f"vLLM base weights ({q})": weight_bytes(shape, q, b),
        "vLLM LoRA slot": lora_parameter_count(shape, slot, "all-linear") * b,
        "vLLM KV cache": vllm_budget(shape, cfg, b)[1],
        "vLLM workspace (prefill chunk, sampler)": int(
            VLLM_BATCHED_TOKENS * prefill_per_token(shape, b)
            + sampling_bytes(seqs, shape.vocab, b, cfg.rollout.top_p, sample=True)
        ),
        "vLLM CUDA graphs, buffers (estimate)": VLLM_OVERHEAD_BYTES,
    }


def offloaded_bytes(shape: ModelShape, cfg: Config, b: int) -> int:
    """The layer inputs of one micro-batch, all full length: what offloading moves to the host."""
    seqs = min(cfg.train.micro_batch_groups, cfg.train.prompts_per_step) * cfg.rollout.group_size
    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    return shape.layers * seqs * length * shape.hidden * b


def fused_head(model: ModelConfig, sharding: str = "ddp") -> bool:
    """Whether the update's log-prob head takes the fused path (logprobs.head_logprobs): not
    when lm_head is trained (LoRA on it), and not under FSDP, whose hooks on lm_head (Accelerate
    wraps final norm + lm_head as one unit) and DTensor weight send it to the checkpointed path,
    on one GPU as on several (tests/test_plan.py checks it against a live FSDP2 model)."""
    targets = model.lora_target_modules
    return sharding != "fsdp" and not (isinstance(targets, list) and "lm_head" in targets)


def _training(shape: ModelShape, cfg: Config, b: int, sharding: str = "ddp") -> dict[str, int]:
    """LoRA grads + the activations of one micro-batch of whole groups, all full length."""
    tr, mc, G = cfg.train, cfg.model, cfg.rollout.group_size
    seqs = min(tr.micro_batch_groups, tr.prompts_per_step) * G
    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    S, M = seqs * length, seqs * cfg.rollout.max_new_tokens  # positions, completion tokens
    saved = layer_saved_per_token(shape, lora_targets(shape, mc.lora_target_modules), mc.lora_r, b)
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
    fused = fused_head(mc, sharding)
    if fused:  # the saved gradient directions, [M, hidden] fp32
        head += M * shape.hidden * F32
    per = HEAD_CHUNK_BYTES if fused else HEAD_CHUNK_BYTES_CHECKPOINTED
    head += int(per * min(CHUNK_TOKENS, M) * shape.vocab)
    top = ("log-prob head chunk", head) if head >= layer else ("one layer in backward", layer)
    return {
        "LoRA grads (fp32)": F32 * lora_parameter_count(shape, mc.lora_r, mc.lora_target_modules),
        "activations: layer inputs" if mc.gradient_checkpointing else "activations": kept,
        f"activations: {top[0]}": top[1],
        "4-bit dequant buffer": _dequant_bytes(shape, mc, b),
        # ids and attention mask (int64), completion mask and advantages (fp32) of the step
        "rollout tensors": tr.prompts_per_step * G * length * 24,
    }


def phase_bytes(
    shape: ModelShape, cfg: Config, gpus: int = 1, sharding: str = "ddp"
) -> dict[str, dict[str, int]]:
    """Bytes per component at the peak of each phase of a step (torch allocations only)."""
    b, ro, V = dtype_bytes(cfg.model), cfg.rollout, shape.vocab
    shards = gpus if sharding == "fsdp" else 1  # FSDP2 on one GPU: a mesh of one divides nothing
    P = cfg.data.max_prompt_tokens
    n = min(ro.generation_batch_size, cfg.train.prompts_per_step * ro.group_size)
    G = ro.group_size  # a generate() call of whole groups prefills each group's prompt once
    # the decode engine on CUDA (rollout.decode auto or graph; FSDP decodes with HF generate)
    engine = ro.backend == "hf" and ro.decode != "eager" and sharding != "fsdp"
    picking = engine_sampling_bytes if engine else sampling_bytes
    sampling = picking(n, V, b, ro.top_p, sample=True)
    groups = n // G if n % G == 0 else None
    phases = {
        "generation": _generation(
            shape, cfg.model, b, n, P, ro.max_new_tokens, sampling, groups, engine
        )
    }
    if ro.tools:  # a later tool round re-runs each row's whole context, no prompt shared
        context = P + ro.max_new_tokens - 1
        later = _generation(shape, cfg.model, b, n, context, 1, sampling, None, engine)
        if sum(later.values()) > sum(phases["generation"].values()):
            phases["generation"] = later
    repair = repair_generation(cfg)
    if repair:
        n, p, t = repair
        sampling = picking(n, V, b, ro.top_p, sample=True)
        phases["repair"] = _generation(shape, cfg.model, b, n, p, t, sampling, engine=engine)
    train = phases["training"] = _training(shape, cfg, b, sharding)
    train["LoRA grads (fp32)"] = math.ceil(train["LoRA grads (fp32)"] / shards)
    if gpus > 1 and sharding == "ddp":  # DDP copies the gradients into its reduction buckets
        train["DDP grad buckets"] = train["LoRA grads (fp32)"]
    if cfg.data.eval_size > 0:
        n = min(ro.generation_batch_size, math.ceil(cfg.data.eval_size / gpus))
        sampling = picking(n, V, b, 1.0, sample=False)
        phases["evaluation"] = _generation(
            shape, cfg.model, b, n, P, ro.eval_max_new_tokens, sampling, engine=engine
        )
    base = _persistent(shape, cfg, b, shards, fsdp=sharding == "fsdp")
    out = {name: {**base, **parts} for name, parts in phases.items()}
    if ro.backend == "vllm":  # the engine generates; the policy only holds its state meanwhile
        engine = _vllm_engine(shape, cfg, b)
        for name in out:
            if name != "training":
                out[name] = {**base, **engine}
            else:  # asleep: weights in host memory, KV cache released
                out[name]["vLLM CUDA graphs, buffers (estimate)"] = VLLM_OVERHEAD_BYTES
    if shards > 1:  # generation on a gathered copy of everything (distributed.gathered)
        whole = _fsdp_whole(shape, cfg.model, b)
        for name, parts in out.items():
            if name != "training":
                del parts["FSDP all-gathered parameters"]
                parts["FSDP gathered weights (generation)"] = whole
    return out
