import contextlib

import pytest
import torch

from ibpo.config import ModelConfig
from ibpo.generation import generate
from ibpo.logprobs import completion_logprobs
from ibpo.modeling import compute_dtype, load_policy, reference_mode


def _rollout(model, tok, seed=0):
    torch.manual_seed(seed)
    return generate(model, tok, ["What is 3+4?", "7*2=?"], 2, 10, 4)


def _logp(model, ro):
    return completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask
    )[0]


def test_auto_dtype_is_fp32_on_cpu():
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_reference_is_the_shared_base(tiny_model_dir, quantization):
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization=quantization), torch.device("cpu")
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # one copy of the base: no tensor storage appears twice, and the reference forward runs
    # through exactly the modules the policy uses (hooks fire on the same base layers)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(ptrs) == len(set(ptrs))
    n_base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    n_total = sum(p.numel() for p in model.parameters())
    assert n_total - n_base == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    calls = []
    base_layer = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    handle = base_layer.register_forward_hook(lambda *a: calls.append(1))
    ro = _rollout(model, tok)
    calls.clear()
    with torch.no_grad():
        pol = _logp(model, ro)
        with reference_mode(model):
            ref = _logp(model, ro)
    handle.remove()
    assert len(calls) == 2
    torch.testing.assert_close(pol, ref)  # LoRA B starts at zero: policy == reference
    # after an update the policy moves, the reference does not
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model.train()
    (-_logp(model, ro).sum()).backward()
    opt.step()
    with torch.no_grad():
        pol2 = _logp(model, ro)
        with reference_mode(model):
            ref2 = _logp(model, ro)
    torch.testing.assert_close(ref2, ref)
    assert not torch.allclose(pol2, pol)


def test_bnb_cpu_repack_fix_gradients_unchanged_by_generate(tiny_model_dir):
    """Regression: LoRA grads identical with and without a preceding generate (4-bit, CPU)."""
    import bitsandbytes as bnb

    def grads(with_generate: bool):
        torch.manual_seed(0)
        model, tok = load_policy(
            ModelConfig(name=tiny_model_dir, quantization="nf4"), torch.device("cpu")
        )
        layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
        ids = tok(
            ["<user>What is 1+2?\n<assistant>3<eos>"], return_tensors="pt", add_special_tokens=False
        )["input_ids"]
        if with_generate:
            _rollout(model, tok)  # eval mode, no grad: would repack the 4-bit weights
        model.train()
        am = torch.ones_like(ids)
        lp, _ = completion_logprobs(model, ids, am, 5, torch.ones(1, ids.shape[1] - 5))
        lp.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    a, b = grads(False), grads(True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)
    assert any(g.abs().sum() > 0 for g in a.values())


def _nf4_policy(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization="nf4"), torch.device("cpu")
    )
    for n, p in model.named_parameters():  # a non-zero adapter, so folding it in matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
    return model, tok


def test_dequantized_base_generates_and_trains_like_the_4bit_layers(tiny_model_dir):
    from ibpo.modeling import dequantized_base

    model, tok = _nf4_policy(tiny_model_dir)
    ro = _rollout(model, tok, seed=3)
    model.eval()
    with torch.no_grad():
        plain, plain_ref = _logp(model, ro), None
        with reference_mode(model):
            plain_ref = _logp(model, ro)
        with dequantized_base(model, merge_lora=True) as n:
            assert n == 7 * 2  # every LoRA-wrapped 4-bit linear of the 2 layers, folded
            torch.testing.assert_close(_logp(model, ro), plain, atol=1e-5, rtol=1e-5)
            again = _rollout(model, tok, seed=3)  # same sampling, same tokens
            with reference_mode(model):  # the folded copy must not serve the bare base
                torch.testing.assert_close(_logp(model, ro), plain_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(again.input_ids, ro.input_ids)
    assert not (plain - plain_ref).abs().max() < 1e-4  # the adapter does change the log-probs

    def grads(fast: bool):
        model.train()
        model.zero_grad()
        with dequantized_base(model) if fast else contextlib.nullcontext():
            if fast:  # every LoRA layer runs as one fused node (_QLoraLinear), none of PEFT's
                fused = [
                    m for m in model.modules() if hasattr(m, "lora_A") and "forward" in vars(m)
                ]
                assert len(fused) == 7 * 2
            _logp(model, ro).sum().backward()  # under gradient checkpointing
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}

    a, b = grads(False), grads(True)
    assert a.keys() == b.keys() and any(g.abs().sum() > 0 for g in a.values())
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)
    # nothing is left behind: the classes' forwards are back, with no per-layer copies
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def test_dequantized_base_follows_the_adapter_between_entries(tiny_model_dir):
    from ibpo.modeling import dequantized_base

    model, tok = _nf4_policy(tiny_model_dir)
    ro = _rollout(model, tok)
    model.eval()
    with torch.no_grad():
        with dequantized_base(model, merge_lora=True):
            before = _logp(model, ro)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05)
        with dequantized_base(model, merge_lora=True):
            after = _logp(model, ro)
        torch.testing.assert_close(after, _logp(model, ro), atol=1e-5, rtol=1e-5)
    assert (after - before).abs().max() > 1e-3


def test_dequantized_base_is_only_for_small_4bit_models_on_cpu(tiny_model_dir, monkeypatch):
    import ibpo.modeling as modeling
    from ibpo.modeling import dequantized_bytes, use_dequantized_base

    model, _ = _nf4_policy(tiny_model_dir)
    size = dequantized_bytes(model)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    nf4 = ModelConfig(quantization="nf4")
    assert use_dequantized_base(nf4, cpu, model)
    assert not use_dequantized_base(ModelConfig(quantization="none"), cpu, model)
    assert not use_dequantized_base(nf4, cuda, model)
    monkeypatch.setattr(modeling, "AUTO_DEQUANTIZE_MAX_BYTES", size - 1)  # a model too big for it
    assert not use_dequantized_base(nf4, cpu, model)
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14  # 7 linears x 2 layers; fp32 on CPU
    assert size == sum(m.in_features * m.out_features * 4 for m in layers)


def _fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    """torch.cuda as it answers on a GPU of this compute capability. Like torch, it counts
    emulated bf16 in is_bf16_supported() unless asked not to (sm75 says True by default)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    native = capability >= (8, 0)
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: including_emulation or native,
    )


def _flash_attn(monkeypatch, present: bool) -> None:
    """importlib finds the flash-attn package (or not)."""
    import importlib.util

    real, fake = importlib.util.find_spec, object() if present else None

    def find_spec(name, *args):
        return fake if name == "flash_attn" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_attention_auto_picks_flash_attention_only_on_cuda_with_the_package(monkeypatch):
    from ibpo.modeling import attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention("eager", cuda) == "eager" and attention("sdpa", cuda) == "sdpa"
    _fake_gpu(monkeypatch, (8, 0))
    _flash_attn(monkeypatch, True)
    assert attention("auto", cuda) == "flash_attention_2"
    assert attention("auto", cpu) == "sdpa"
    _flash_attn(monkeypatch, False)
    assert attention("auto", cuda) == "sdpa"


@pytest.mark.parametrize(
    "capability, dtype",
    [((7, 5), torch.float32), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)],
    ids=["sm75", "sm80", "sm90"],
)
def test_auto_dtype_is_bf16_only_on_gpus_with_native_bf16(monkeypatch, capability, dtype):
    """A pre-Ampere GPU emulates bf16 (torch.cuda.is_bf16_supported() says True): slow, so auto
    computes in fp32 there, not in fp16 (fp16 training would need loss scaling)."""
    _fake_gpu(monkeypatch, capability)
    cuda = torch.device("cuda", 0)
    assert compute_dtype("auto", cuda) == dtype
    assert compute_dtype("float16", cuda) == torch.float16  # as asked (training refuses it)


def test_attention_auto_needs_ampere_and_half_precision_for_flash_attention(monkeypatch):
    """flash-attn 2 refuses GPUs below sm80 and has no fp32 kernels: auto falls back to sdpa."""
    from ibpo.modeling import attention

    cuda = torch.device("cuda", 0)
    _flash_attn(monkeypatch, True)
    _fake_gpu(monkeypatch, (7, 5))
    assert attention("auto", cuda) == "sdpa"
    assert attention("auto", cuda, torch.float16) == "sdpa"
    _fake_gpu(monkeypatch, (8, 0))
    assert attention("auto", cuda) == "flash_attention_2"  # with the auto dtype, bf16
    assert attention("auto", cuda, torch.bfloat16) == "flash_attention_2"
    assert attention("auto", cuda, torch.float32) == "sdpa"


@pytest.mark.parametrize(
    "capability, fix",
    [((7, 5), r"dtype=float32 .*compute capability 7\.5"), ((8, 6), r"dtype=bfloat16")],
    ids=["sm75", "sm86"],
)
def test_float16_training_is_refused_before_loading(monkeypatch, tiny_model_dir, capability, fix):
    """ibpo does no loss scaling, without which fp16 gradients underflow: training in fp16 is a
    ConfigError naming model.dtype and what to use on this GPU, raised before any weight loads."""
    from ibpo.config import ConfigError

    _fake_gpu(monkeypatch, capability)
    cfg = ModelConfig(name=tiny_model_dir, quantization="none", dtype="float16")
    refused = r"model\.dtype=float16 training needs loss scaling.*"
    with pytest.raises(ConfigError, match=refused + fix):
        load_policy(cfg, torch.device("cuda", 0))
    with pytest.raises(ConfigError, match=r"model\.dtype=float32"):
        load_policy(cfg, torch.device("cpu"))


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_offloaded_activations_take_the_layer_inputs_and_keep_the_gradients(
    tiny_model_dir, quantization
):
    """model.offload_activations relies on gradient checkpointing saving every layer's input as
    a saved tensor, so that saved-tensor hooks can move it to the host (CUDA) and back: each
    decoder layer's input must reach the hooks. The LoRA gradients are unchanged by the hooks."""
    from ibpo.modeling import offloaded_activations

    cfg = ModelConfig(name=tiny_model_dir, quantization=quantization)
    model, tok = load_policy(cfg, torch.device("cpu"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
    ro = _rollout(model, tok)
    model.train()

    def step(hooks):
        model.zero_grad(set_to_none=True)
        with hooks:
            logp, _ = completion_logprobs(
                model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask
            )
        logp.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    layers = model.get_base_model().model.layers
    inputs, packed = [], set()
    handles = [
        layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for layer in layers
    ]
    seen = torch.autograd.graph.saved_tensors_hooks(
        lambda t: packed.add(t.data_ptr()) or t, lambda t: t
    )
    step(seen)
    for h in handles:
        h.remove()
    first_pass = inputs[: len(layers)]  # (backward recomputes the layers and calls them again)
    assert len(first_pass) == len(layers)
    assert all(x.data_ptr() in packed for x in first_pass)
    # the copies on: every saved tensor goes out to a separate buffer and comes back from it
    plain, offloaded = step(contextlib.nullcontext()), step(offloaded_activations(True, True))
    assert plain.keys() == offloaded.keys() and plain
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], atol=0, rtol=0)
    assert max(g.abs().max().item() for g in plain.values()) > 1e-4


def test_offload_activations_needs_checkpointing():
    from ibpo.config import ConfigError
    from ibpo.recipe import load_config

    with pytest.raises(ConfigError, match="gradient_checkpointing=true"):
        load_config(None, ["model.offload_activations=true", "model.gradient_checkpointing=false"])


def _peak_bytes(fn):
    """(fn's result, peak live tensor bytes while it ran) on the CPU."""
    from bench.memtrack import LiveTensorBytes

    with LiveTensorBytes() as live:
        out = fn()
    return out, live.peak


def test_offloaded_activations_keep_parameter_views_in_place():
    """Under DDP/FSDP the training forward runs lm_head inside the model (logits_to_keep=1), and
    autograd saves lm_head's weight as an expanded stride-0 view ([N, H, V], stride 0 in N): a
    view of a parameter, alive anyway. Copying it out would materialise N * H * V elements on the
    host (and a temporary on the GPU): offloading must leave such views where they are. The
    gradients stay exactly those without offloading."""
    from ibpo.modeling import offloaded_activations
    from tests.conftest import make_tiny_qwen3

    model = make_tiny_qwen3(4096)  # H = 64: lm_head's weight is 1 MiB, its [4, H, V] view 4 MiB
    model.requires_grad_(False)
    for layer in model.model.layers:  # frozen head, trained layers: as under LoRA
        layer.self_attn.q_proj.weight.requires_grad_(True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    ids = torch.randint(3, 4096, (4, 10), generator=torch.Generator().manual_seed(0))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(input_ids=ids, logits_to_keep=1, use_cache=False)
    weight = model.lm_head.weight
    # the premise: autograd does save an expanded view of the head's weight
    assert any(t._base is weight and 0 in t.stride() for t in saved)

    def step(hooks):
        model.zero_grad(set_to_none=True)
        with hooks:
            logits, peak = _peak_bytes(
                lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False).logits
            )
        logits.float().square().sum().backward()
        return peak, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_peak, plain = step(contextlib.nullcontext())
    off_peak, offloaded = step(offloaded_activations(True, cpu_copies=True))
    # what offloading adds on the host is the layer inputs (a few KiB), never a weight-sized copy
    assert off_peak - plain_peak < weight.nbytes // 4, (off_peak, plain_peak)
    assert plain.keys() == offloaded.keys() and plain
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], atol=0, rtol=0)


def test_offloaded_activations_copy_expanded_tensors_at_their_storage_size():
    """A saved tensor that is an expanded (stride-0) view of an activation goes to the host at
    the size of what it views, not at its expanded size, and comes back expanded."""
    from ibpo.modeling import offloaded_activations

    n, h = 4096, 64
    row = torch.randn(1, h, requires_grad=True)
    col = torch.randn(n, 1, requires_grad=True)

    def step(hooks):
        row.grad = col.grad = None
        with hooks:  # mul saves both operands: [n, h] views of [1, h] and [n, 1]
            out, peak = _peak_bytes(lambda: (row.expand(n, h) * col.expand(n, h)).sum())
        out.backward()
        return peak, row.grad.clone(), col.grad.clone()

    plain_peak, *plain = step(contextlib.nullcontext())
    off_peak, *offloaded = step(offloaded_activations(True, cpu_copies=True))
    assert off_peak - plain_peak <= 4 * (n + h) * 2, (off_peak, plain_peak)  # not 2 x n x h x 4
    for a, b in zip(plain, offloaded):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_qlora_node_gradients_match_autograd_in_float64(monkeypatch):
    """_QLoraLinear's hand-written backward against autograd of the same sum (gradcheck)."""
    import ibpo.modeling as modeling
    from ibpo.modeling import _QLoraLinear

    class FakeBase:  # what the node reads of a 4-bit layer: its bias, its weight via _dequantize
        bias = None

    torch.manual_seed(0)
    w = torch.randn(5, 4, dtype=torch.float64)
    monkeypatch.setattr(modeling, "_dequantize", lambda layer: w)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, a, b: _QLoraLinear.apply(x, FakeBase(), a, b, 0.7), (x, a, b)
    )
    out = _QLoraLinear.apply(x, FakeBase(), a, b, 0.7)
    torch.testing.assert_close(out, x @ w.t() + 0.7 * (x @ a.t()) @ b.t())
    bare = _QLoraLinear.apply(x, FakeBase(), None, None, 1.0)
    torch.testing.assert_close(bare, x @ w.t())
    assert torch.autograd.gradcheck(
        lambda x: _QLoraLinear.apply(x, FakeBase(), None, None, 1.0), (x,)
    )


def test_lora_dropout_keeps_peft_forward_under_dequantized_base(tiny_model_dir):
    from peft import LoraConfig

    from ibpo.modeling import dequantized_base

    torch.manual_seed(0)
    model, _ = load_policy(  # dropout: only an adapter given as peft_config= has it
        ModelConfig(name=tiny_model_dir, quantization="nf4"),
        torch.device("cpu"),
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1, target_modules="all-linear"),
    )
    model.train()
    with dequantized_base(model) as n:
        assert n == 7 * 2  # the 4-bit layers still skip bitsandbytes' per-call path ...
        fused = [m for m in model.modules() if hasattr(m, "lora_A") and "forward" in vars(m)]
        assert fused == []  # ... but dropout on x is PEFT's: no fused node
