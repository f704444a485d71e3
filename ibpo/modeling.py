"""Load the policy: a (4-bit NF4) base with LoRA adapters, gradient checkpointing, one copy only.

* `quantization: nf4` -> QLoRA: bitsandbytes NF4 with double quantisation, compute in the chosen
  dtype; `none` -> the base in that dtype. Either way LoRA adapters (PEFT) are the only trainable
  parameters, and the base is frozen.
* The reference model is the same object with the adapter switched off (`reference_mode`), so
  reference log-probs cost no extra memory for a second copy of the base.
* CPU fix for bitsandbytes 0.49/0.50: a Linear4bit that runs in eval/no-grad mode on a CPU with
  AVX512-BF16 repacks its weight and later training forwards take a kernel without autograd; we turn
  that repacking off on CPU so gradients after `generate` stay correct.

Not here: the training loop, optimizers, or device placement beyond the initial load (Accelerate).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from ibpo.config import ConfigError, ModelConfig
from ibpo.distributed import is_fsdp
from ibpo.embedded import EMBEDDED_NAME, embedded_model_path
from ibpo.quiet import quiet_loading_bars

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def native_bf16(device: torch.device) -> bool:
    """Whether CUDA `device` computes bf16 in hardware: compute capability 8.0+ (Ampere), or ROCm.
    Not torch.cuda.is_bf16_supported(): by default it also counts bf16 emulated on older GPUs
    (much slower), and it asks about the current device rather than `device`."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_capability(device)[0] >= 8


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on a CUDA GPU with native bf16 (Ampere and later), else fp32.

    Not fp16 on older GPUs: training in fp16 needs loss scaling, which ibpo does not do
    (load_policy refuses model.dtype=float16). fp32 there doubles the activations and a
    non-quantised base; a 4-bit base stays packed (its compute dtype is what changes).
    fp32 on CPU is deliberate too: without native bf16 units, bf16 generation ran 3.4x slower
    (bench/bench_cpu_dtype.py).
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" and native_bf16(device):
        return torch.bfloat16
    return torch.float32


def attention(name: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """`auto`: flash_attention_2 where it runs, else sdpa. It runs on CUDA with flash-attn
    installed (extra `gpu`), on compute capability 8.0+ (flash-attn 2 refuses older GPUs) and in
    bf16/fp16 (it has no fp32 kernels). `dtype`: the model's compute dtype (None: the auto one)."""
    if name != "auto":
        return name
    import importlib.util

    if device.type != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return "sdpa"
    if dtype is None:
        dtype = compute_dtype("auto", device)
    ampere = torch.cuda.get_device_capability(device)[0] >= 8
    return "flash_attention_2" if ampere and dtype in (torch.bfloat16, torch.float16) else "sdpa"


def check_training_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse fp16 training: without loss scaling (which ibpo does not do) small gradients
    underflow to zero in fp16 and the adapter silently stops learning. The fix named is the
    dtype this device computes well: bf16 where it is native, else fp32."""
    if dtype != torch.float16:
        return
    if device.type == "cuda" and native_bf16(device):
        fix = "use model.dtype=bfloat16 (or auto)"
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        fix = (
            f"use model.dtype=float32 (or auto) on this GPU (compute capability "
            f"{major}.{minor} has no native bf16)"
        )
    else:
        fix = "use model.dtype=float32 (or auto)"
    raise ConfigError(
        f"model.dtype=float16 training needs loss scaling, which ibpo does not do. Fix: {fix}."
    )


def resolve_model_path(name: str) -> str:
    return str(embedded_model_path()) if name == EMBEDDED_NAME else name


def load_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        path, revision=revision, trust_remote_code=trust_remote_code
    )
    tok.padding_side = "left"  # rollouts: prompts end where completions start
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _quantization_config(dtype: torch.dtype):
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            "model.quantization=nf4 needs bitsandbytes (pip install bitsandbytes), "
            "or use model.quantization=none"
        ) from e
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,  # lets FSDP shard the packed weights like other params
    )


def disable_cpu_bf16_repack(model: nn.Module) -> int:
    """Work around the bitsandbytes CPU repack bug; returns how many 4-bit layers were touched."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def load_policy(cfg: ModelConfig, device: torch.device, base=None, peft_config=None):
    """-> (PEFT model with LoRA adapters, tokenizer). Only LoRA parameters require grad.
    A ConfigError for model.dtype=float16 (see check_training_dtype), before anything loads.
    `base`: an already built (model, tokenizer), already on `device` and quantised as
    cfg.quantization says (bench/bench_gpu.py builds random weights on the GPU that way,
    without writing a checkpoint); it gets the same checkpointing and LoRA as a loaded one.
    `peft_config`: a peft.LoraConfig given in Python (ibpo.train), used as it is instead of
    the model.lora_* keys (rsLoRA, DoRA, modules_to_save...)."""
    dtype = compute_dtype(cfg.dtype, device)
    check_training_dtype(dtype, device)  # before any weight is read
    model, tokenizer = base if base is not None else _load_base(cfg, device, dtype)
    return _with_lora(model, cfg, device, peft_config), tokenizer


def _load_base(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.name)
    kwargs = dict(
        dtype=dtype,
        attn_implementation=attention("auto", device, dtype),
        revision=cfg.revision,
    )
    if cfg.quantization == "nf4":
        kwargs["quantization_config"] = _quantization_config(dtype)
        kwargs["device_map"] = {"": device}
    quiet_loading_bars()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = load_tokenizer(path, cfg.revision)
    except OSError as e:
        raise ConfigError(
            f"could not load model '{cfg.name}': {e}\n  Fix: give a local folder, or a Hub id with "
            "network access (HF_HUB_OFFLINE=1 allows only models already in the Hub cache)."
        ) from None
    if cfg.quantization != "nf4":
        model.to(device)
    return model, tokenizer


def _with_lora(model, cfg: ModelConfig, device: torch.device, peft_config=None):
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    if cfg.gradient_checkpointing:
        # non-reentrant: it saves each layer's inputs as saved tensors, which is also what lets
        # offloaded_activations move them to the host
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the old name warns: gone in v6
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.enable_input_require_grads()
    if peft_config is not None:  # a copy: get_peft_model fills fields in
        lora = copy.deepcopy(peft_config)
        lora.task_type = lora.task_type or "CAUSAL_LM"
    else:
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=0.0,  # dropout would make the update's log-probs differ from the rollout's
            target_modules=cfg.lora_target_modules,
            task_type="CAUSAL_LM",
        )
    model = get_peft_model(model, lora)
    if device.type == "cpu":
        disable_cpu_bf16_repack(model)
    return model


def quantize_nf4(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace the decoder's nn.Linear layers (not lm_head) of a model already on its device by
    NF4 Linear4bit layers, as model.quantization=nf4 loads them (double quantisation, compute and
    storage in `dtype`), one layer at a time so that only one layer's 16-bit copy is extra;
    returns how many were replaced. For weights built in memory, which from_pretrained cannot
    quantise without a checkpoint on disk."""
    _quantization_config(dtype)  # first: without bitsandbytes, the message naming the fix
    import bitsandbytes as bnb

    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        new = bnb.nn.Linear4bit(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            compute_dtype=dtype,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=dtype,
            device="meta",
        )
        new.weight = bnb.nn.Params4bit(
            old.weight.data.to(dtype),
            requires_grad=False,
            compress_statistics=True,
            quant_type="nf4",
            quant_storage=dtype,
        ).to(old.weight.device)  # Params4bit quantises when it is moved to a device
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        del old
    return len(names)


def _dequantize(layer: nn.Module) -> torch.Tensor:
    """The [out, in] weight of a bitsandbytes Linear4bit in its compute dtype."""
    import bitsandbytes as bnb

    w = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    return w.to(layer.compute_dtype or torch.float32)


def _linear_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)

    return forward


def _merged_forward(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None):
    merged = _linear_forward(weight, bias)

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if layer.disable_adapters:  # reference mode inside the context: the folded copy is wrong
            return type(layer).forward(layer, x, *args, **kwargs)
        return merged(x)

    return forward


class _QLoraLinear(torch.autograd.Function):
    """y = x W^T + b [+ s (x A^T) B^T] for a frozen 4-bit W, dequantised in forward and again in
    backward, as one node of the autograd graph (A, B = None: the bare base layer).

    PEFT computes the LoRA sum as base(x) + lora_B(lora_A(x)) * s: four [tokens, out] tensors per
    layer and call (base output, B's output, the scaled copy, the sum), each freshly allocated,
    again in the recomputation under gradient checkpointing and again in backward. Here the update
    is accumulated into the base output in place (addmm_), backward forms dx the same way, and
    only x and the rank-r product x A^T are saved: no dense W is kept between forward and
    backward (dequantising costs ~0.1 ms per layer on CPU, against a copy of every weight).
    Gradients: dx = dy W + s (dy B) A, dA = s (dy B)^T x, dB = s dy^T (x A^T); none for W or b.
    """

    @staticmethod
    def forward(ctx, x, base, lora_a, lora_b, scaling: float):
        weight, bias = _dequantize(base), base.bias
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, in]
        out = x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())
        if lora_a is not None:
            xa = x2 @ lora_a.t()  # [M, r]
            out.addmm_(xa, lora_b.t(), alpha=scaling)
            ctx.save_for_backward(x2, xa, lora_a, lora_b)
        ctx.base, ctx.scaling, ctx.shape = base, scaling, shape
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dy2 = dy.reshape(-1, dy.shape[-1])  # [M, out]
        dx = d_a = d_b = None
        if ctx.needs_input_grad[0]:
            dx = dy2 @ _dequantize(ctx.base)
        saved = ctx.saved_tensors  # read once: checkpointing unpacks each only once
        if saved:
            x2, xa, lora_a, lora_b = saved
            s = ctx.scaling
            g = dy2 @ lora_b  # [M, r]
            if dx is not None:
                dx.addmm_(g, lora_a, alpha=s)
            if ctx.needs_input_grad[2]:
                d_a = (g.t() @ x2).mul_(s)
            if ctx.needs_input_grad[3]:
                d_b = (dy2.t() @ xa).mul_(s)
        return None if dx is None else dx.view(ctx.shape), None, d_a, d_b, None


def _base_forward(base: nn.Module):
    """A bare 4-bit layer through `_QLoraLinear` (reference mode, PEFT's fallbacks)."""
    dtype = base.compute_dtype or torch.float32

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return _QLoraLinear.apply(x.to(dtype), base, None, None, 1.0).to(x.dtype)

    return forward


def _fusable(layer: nn.Module) -> bool:
    """A PEFT LoRA layer whose forward is exactly base(x) + s B A x: one active plain adapter,
    no dropout, no bias on B, not merged (anything else keeps PEFT's own forward)."""
    names = [n for n in layer.active_adapters if n in layer.lora_A]
    if len(names) != 1 or layer.merged or getattr(layer, "lora_variant", None):
        return False
    name = names[0]
    if getattr(layer, "use_dora", {}).get(name):
        return False
    drop = layer.lora_dropout[name]
    no_dropout = isinstance(drop, nn.Identity) or getattr(drop, "p", 1.0) == 0.0
    return no_dropout and layer.lora_B[name].bias is None


def _fused_lora_forward(layer: nn.Module, base: nn.Module):
    name = next(n for n in layer.active_adapters if n in layer.lora_A)
    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    scaling = float(layer.scaling[name])
    dtype = base.compute_dtype or torch.float32

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        same = x.dtype == dtype == lora_a.dtype == lora_b.dtype
        if layer.disable_adapters or args or kwargs or not same or layer.merged:
            return type(layer).forward(layer, x, *args, **kwargs)  # PEFT's own path
        return _QLoraLinear.apply(x, base, lora_a, lora_b, scaling)

    return forward


@contextlib.contextmanager
def dequantized_base(model: nn.Module, merge_lora: bool = False) -> Iterator[int]:
    """CPU speed: the 4-bit linear layers without bitsandbytes' per-call CPU path.

    With `merge_lora` (no-grad generation: hundreds of calls per layer) each layer computes with a
    weight dequantised once, on entry, with the active adapter's LoRA update B A * scaling folded
    in, so a layer is one matmul; use it only where the adapter cannot change and no gradient is
    taken. Memory: a compute-dtype copy of every quantised weight while inside, freed on exit. In
    bf16 the folded update is rounded to bf16 (CPU computes in fp32 by default).

    Without it (training: three calls per layer and micro-batch under gradient checkpointing)
    every 4-bit layer dequantises its weight on each call and drops it (`_QLoraLinear`), and a
    plain LoRA layer computes base and update as one fused autograd node; no dense copy is kept,
    and the adapter's gradients are those of PEFT's forward. Under gradient checkpointing the
    backward pass recomputes layers, so it must run inside the context too. The planner's GPU
    paths never use this. Yields the number of 4-bit layers switched.
    """
    import bitsandbytes as bnb

    patched, inside = [], set()  # inside: 4-bit layers already handled with their LoRA layer
    fused = []  # LoRA layers computing base + update as one node (training)
    try:
        for mod in model.modules():  # parents come before their children
            base = getattr(mod, "base_layer", None)
            if merge_lora and isinstance(base, bnb.nn.Linear4bit) and hasattr(mod, "lora_A"):
                inside.add(id(base))
                w = _dequantize(base)
                if getattr(mod, "lora_variant", None):  # DoRA & co. are not a plain B A update
                    raise NotImplementedError(
                        "dequantized_base(merge_lora=True) folds plain LoRA only; "
                        "it is used without DoRA adapters only"
                    )
                if not mod.disable_adapters and not mod.merged:
                    for name in mod.active_adapters:
                        if name in mod.lora_A:  # in place: w is this phase's own copy
                            w.add_(mod.get_delta_weight(name).to(w.dtype))
                mod.forward = _merged_forward(mod, w, base.bias)
                patched.append(mod)
            elif not merge_lora and isinstance(base, bnb.nn.Linear4bit) and hasattr(mod, "lora_A"):
                inside.add(id(base))
                base.forward = _base_forward(base)
                patched.append(base)
                if _fusable(mod):
                    mod.forward = _fused_lora_forward(mod, base)
                    fused.append(mod)
            elif isinstance(mod, bnb.nn.Linear4bit) and id(mod) not in inside:
                mod.forward = (
                    _linear_forward(_dequantize(mod), mod.bias)
                    if merge_lora
                    else _base_forward(mod)
                )
                patched.append(mod)
        yield len(patched)
    finally:
        for mod in patched + fused:
            del mod.forward  # the class's forward shows again; any copy is freed


# The dequantised copy of a 4-bit base on CPU is used only while it stays this small (fp32: ~1B
# weights).
AUTO_DEQUANTIZE_MAX_BYTES = 4 * 2**30


def dequantized_bytes(model: nn.Module) -> int:
    """Bytes of a compute-dtype copy of every 4-bit weight of `model`."""
    import bitsandbytes as bnb

    total = 0
    for mod in model.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            size = (mod.compute_dtype or torch.float32).itemsize
            total += mod.in_features * mod.out_features * size
    return total


def use_dequantized_base(cfg: ModelConfig, device: torch.device, model: nn.Module) -> bool:
    """Whether phases compute with a dequantised copy of the base (dequantized_base): for a 4-bit
    base on CPU whose copy stays under AUTO_DEQUANTIZE_MAX_BYTES and whose adapter is plain LoRA
    (DoRA & co. are not a B A update to fold in); never on CUDA, never on FSDP shards."""
    if cfg.quantization != "nf4" or device.type != "cpu" or is_fsdp(model):
        return False
    if any(getattr(mod, "lora_variant", None) for mod in model.modules()):
        return False
    return dequantized_bytes(model) <= AUTO_DEQUANTIZE_MAX_BYTES


def _is_parameter_view(t: torch.Tensor) -> bool:
    """Whether `t` is a parameter or a view of one (autograd's `_base` is the tensor a view was
    taken from, through any chain of views): its storage is the parameter's, alive anyway."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _unexpanded(t: torch.Tensor) -> torch.Tensor:
    """`t` with every broadcast (stride-0) dimension narrowed to size 1: the elements it really
    holds, which `.expand(t.shape)` turns back into `t`."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(dim, 0, 1)
    return t


@contextlib.contextmanager
def offloaded_activations(enabled: bool, cpu_copies: bool = False) -> Iterator[None]:
    """Within the block (a forward with grad), tensors autograd saves for backward go to pinned
    CPU memory and come back to their device when backward needs them. Under gradient
    checkpointing those are essentially each layer's input (torch's non-reentrant checkpoint saves
    them this way; what a layer saves inside is recomputed, never stored). Left where they are:
    parameters and views of them, which are alive anyway (under DDP/FSDP lm_head runs inside the
    model and autograd saves its weight as an expanded [N, H, V] view; FSDP2 frees and refills
    that storage itself), and CPU tensors unless `cpu_copies` (which the tests use to run the
    copies on a CPU machine). An expanded (stride-0) tensor travels at the size of the elements it
    holds and is expanded again on the way back, so no copy is larger than what it views."""
    if not enabled:
        yield
        return

    def pack(t: torch.Tensor):
        if _is_parameter_view(t) or (t.device.type == "cpu" and not cpu_copies):
            return t
        held = _unexpanded(t)
        # the host buffer: pinned when the tensor is on a GPU, so both copies can be asynchronous
        host = torch.empty(
            held.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda"
        )
        host.copy_(held, non_blocking=True)
        return t.device, host, t.shape

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, shape = packed
        return host.to(device, non_blocking=True).expand(shape)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextlib.contextmanager
def reference_mode(model: nn.Module) -> Iterator[None]:
    """The frozen base: the same weights with the LoRA adapter disabled (no second copy)."""
    inner = getattr(model, "module", model)
    if not hasattr(inner, "disable_adapter"):
        raise TypeError("reference log-probs need a PEFT model (the reference is the bare base)")
    with inner.disable_adapter():
        yield


def load_for_inference(
    name: str,
    adapter: str | None = None,
    quantization: str = "none",
    dtype: str = "auto",
    device: torch.device | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
):
    """-> (model in eval mode, tokenizer) for generation: the base in `dtype` or 4-bit NF4, with an
    optional LoRA adapter (local folder or Hub id) on top.

    The adapter stays a separate PEFT module and is never merged: merging into a 4-bit base would
    round the LoRA update into the quantised weights and evaluate a different model.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if quantization not in ("nf4", "none"):
        raise ConfigError(f"quantization must be nf4 or none, got '{quantization}'")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model_path(name)
    dt = compute_dtype(dtype, device)
    kwargs = dict(
        dtype=dt,
        attn_implementation=attention(attn_implementation, device, dt),
        trust_remote_code=trust_remote_code,
        revision=revision,
    )
    if quantization == "nf4":
        kwargs["quantization_config"] = _quantization_config(dt)
        kwargs["device_map"] = {"": device}
    quiet_loading_bars()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = load_tokenizer(path, revision, trust_remote_code)
    except OSError as e:
        raise ConfigError(
            f"could not load model '{name}': {e}\n  Fix: give a local folder, or a Hub id with "
            "network access (HF_HUB_OFFLINE=1 allows only models already in the Hub cache)."
        ) from None
    if quantization != "nf4":
        model.to(device)
    if adapter:
        try:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"could not load adapter '{adapter}': {e}\n  Fix: give the folder holding "
                "adapter_config.json (e.g. <output_dir>/adapter), or a Hub id with network access."
            ) from None
    model.requires_grad_(False)
    model.eval()
    return model, tokenizer
