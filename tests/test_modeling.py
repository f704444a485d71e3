import contextlib

import pytest
import torch

from ibpo.config import ModelConfig
from ibpo.logprobs import completion_logprobs
from ibpo.modeling import compute_dtype, load_policy, reference_mode
from ibpo.rollout import generate


def _rollout(model, tok, seed=0):
    torch.manual_seed(seed)
    return generate(model, tok, ["What is 3+4?", "7*2=?"], 2, 10, 4)


def _logp(model, ro):
    return completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len,
                               ro.completion_mask)[0]  # fmt: skip


def test_auto_dtype_is_fp32_on_cpu():
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_reference_is_the_shared_base(tiny_model_dir, quantization):
    model, tok = load_policy(ModelConfig(name=tiny_model_dir, quantization=quantization),
                             torch.device("cpu"))  # fmt: skip
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
        model, tok = load_policy(ModelConfig(name=tiny_model_dir, quantization="nf4"),
                                 torch.device("cpu"))  # fmt: skip
        layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
        ids = tok(["<user>What is 1+2?\n<assistant>3<eos>"], return_tensors="pt",
                  add_special_tokens=False)["input_ids"]  # fmt: skip
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
    model, tok = load_policy(ModelConfig(name=tiny_model_dir, quantization="nf4"),
                             torch.device("cpu"))  # fmt: skip
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
    assert not use_dequantized_base(ModelConfig(quantization="nf4", cpu_dequantize=False), cpu,
                                    model)  # fmt: skip
    assert not use_dequantized_base(ModelConfig(quantization="none"), cpu, model)
    assert not use_dequantized_base(ModelConfig(quantization="nf4", cpu_dequantize=True), cuda,
                                    model)  # fmt: skip
    monkeypatch.setattr(modeling, "AUTO_DEQUANTIZE_MAX_BYTES", size - 1)  # a model too big for it
    assert not use_dequantized_base(nf4, cpu, model)
    assert use_dequantized_base(ModelConfig(quantization="nf4", cpu_dequantize=True), cpu, model)
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14  # 7 linears x 2 layers; fp32 on CPU
    assert size == sum(m.in_features * m.out_features * 4 for m in layers)


def test_attention_auto_picks_flash_attention_only_on_cuda_with_the_package(monkeypatch):
    import importlib.util

    from ibpo.modeling import attention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention("eager", cuda) == "eager" and attention("sdpa", cuda) == "sdpa"
    real = importlib.util.find_spec

    def installed(present):
        fake = object() if present else None
        return lambda name, *a: fake if name == "flash_attn" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", installed(True))
    assert attention("auto", cuda) == "flash_attention_2"
    assert attention("auto", cpu) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", installed(False))
    assert attention("auto", cuda) == "sdpa"


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
            logp, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len,
                                          ro.completion_mask)  # fmt: skip
        logp.sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    layers = model.get_base_model().model.layers
    inputs, packed = [], set()
    handles = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
               for layer in layers]  # fmt: skip
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
    from ibpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="gradient_checkpointing=true"):
        load_config(None, ["model.offload_activations=true", "model.gradient_checkpointing=false"])
