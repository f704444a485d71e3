import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ibpo.config import ModelConfig
from ibpo.generation import generate
from ibpo.logprobs import (
    ROW_BLOCKS,
    checkpointed_head_logprobs,
    completion_logprobs,
    fused_head_logprobs,
    fused_head_supported,
    naive_completion_logprobs,
    unwrap,
)
from ibpo.modeling import load_policy
from tests.conftest import make_tiny_qwen3

# tiny models: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    torch.manual_seed(0)
    cfg = ModelConfig(name=tiny_model_dir, quantization="none", dtype="float32")
    model, tok = load_policy(cfg, torch.device("cpu"))
    # give the adapter non-zero weights so that gradients reach both LoRA A and B
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model, tok


def _direct(model, ids, att, prompt_len, temperature):
    """Log-probs of the next tokens and entropies from the model's full logits, in float64."""
    pos = (att.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits
    logp_all = (logits[:, prompt_len - 1 : -1].double() / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_values_and_grads(policy, chunk, temperature):
    model, tok = policy
    torch.manual_seed(1)
    ro = generate(model, tok, ["What is 2+3?", "1+1=?"], 3, 12, 6, temperature=1.0)
    assert (ro.attention_mask[:, 0] == 0).any()  # a left-padded prompt
    mask = ro.completion_mask.clone()
    mask[0, 1] = 0  # a hole inside a completion too
    args = (ro.input_ids, ro.attention_mask, ro.prompt_len, mask)
    model.train()
    assert fused_head_supported(unwrap(model).get_output_embeddings())
    fast, ent = _assert_matches_naive(model, args, temperature, chunk)
    assert not ent.requires_grad
    assert (fast[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()
    with torch.no_grad():
        _, direct_ent = _direct(model, *args[:3], temperature)
    torch.testing.assert_close(ent, (direct_ent * mask).float(), atol=1e-5, rtol=1e-5)


def _head_case(dtype, bias, M=37, H=16, V=300, std=0.5):
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(H, V, bias=bias)
    nn.init.normal_(head.weight, std=std, generator=g)
    if bias:
        nn.init.normal_(head.bias, std=1.0, generator=g)
    head = head.to(dtype).requires_grad_(False)
    hidden = torch.randn(M, H, generator=g).to(dtype)
    return head, hidden, torch.randint(0, V, (M,), generator=g), torch.randn(M, generator=g)


def _run(fn, head, hidden, targets, weights, chunk, temperature):
    h = hidden.clone().requires_grad_()
    logp, ent = fn(head, h, targets, chunk, temperature)
    (logp * weights).sum().backward()
    return logp.detach(), ent, h.grad


@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_equals_definition_and_checkpointed(chunk, temperature, bias):
    head, hidden, targets, w = _head_case(torch.float32, bias)
    fused = _run(fused_head_logprobs, head, hidden, targets, w, chunk, temperature)
    ckpt = _run(checkpointed_head_logprobs, head, hidden, targets, w, chunk, temperature)
    # the definitions in float64: log softmax, entropy, d logp / d h = (W_t - E_p[W]) / T
    W = head.weight.double()
    logits = hidden.double() @ W.T + (head.bias.double() if bias else 0)
    logp_all = (logits / temperature).log_softmax(-1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(p * logp_all).sum(-1)
    grad = w[:, None].double() * (W[targets] - p @ W) / temperature
    for ours in (fused, ckpt):
        torch.testing.assert_close(ours[0].double(), logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[1].double(), entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[2].double(), grad, atol=1e-5, rtol=1e-5)
    for a, b in zip(fused, ckpt):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fused_head_bf16_gradient_stays_accurate_on_confident_tokens():
    """bf16 head, targets the model is sure of (p_t up to ~1): W_t - E_p[W] is small, and the
    fused gradient keeps it to bf16 precision instead of subtracting nearly equal bf16 sums."""
    head, hidden, _, _ = _head_case(torch.bfloat16, False, M=64, H=64, V=2000, std=3.0)
    W = head.weight.double()
    logits = (hidden.double() @ W.T).to(torch.bfloat16).double()  # what the head outputs
    targets = logits.argmax(-1)
    assert logits.softmax(-1).max(-1).values.max() > 0.999
    p = logits.softmax(-1)
    exact = W[targets] - p @ W
    logp, ent, grad = _run(fused_head_logprobs, head, hidden, targets, torch.ones(64), 16, 1.0)
    err = (grad.double() - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert err.median() < 5e-3 and err.max() < 0.1
    assert grad.dtype == torch.bfloat16
    ckpt = _run(checkpointed_head_logprobs, head, hidden, targets, torch.ones(64), 16, 1.0)
    torch.testing.assert_close(logp, ckpt[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ckpt[1], atol=1e-4, rtol=1e-4)


def _batch(vocab: int, N=3, P=6, T=9):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (N, P + T), generator=g)
    att = torch.ones_like(ids)
    att[0, :3], ids[0, :3] = 0, 0  # left padding
    mask = torch.ones(N, T)
    mask[1, 6:] = 0  # ended early
    return ids, att, P, mask


def _lora(model, targets):
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    return model


def _assert_matches_naive(model, args, temperature=0.7, chunk=4):
    """Log-probs and LoRA gradients equal the full-logits computation; -> (logp, entropy)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fast, ent = completion_logprobs(model, *args, chunk_tokens=chunk, temperature=temperature)
    g_fast = torch.autograd.grad(fast.sum(), params)
    slow = naive_completion_logprobs(model, *args, temperature=temperature)
    g_slow = torch.autograd.grad(slow.sum(), params)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_fast, g_slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    return fast, ent


def test_tied_embeddings_take_the_fused_path():
    from transformers import AutoModelForCausalLM, Qwen3Config

    base = make_tiny_qwen3(60)
    cfg = Qwen3Config(**{**base.config.to_dict(), "tie_word_embeddings": True})
    model = _lora(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), "all-linear")
    head = unwrap(model).get_output_embeddings()
    assert head.weight is unwrap(model).get_input_embeddings().weight
    assert fused_head_supported(head)
    _assert_matches_naive(model, _batch(60))


def test_trained_lm_head_falls_back_and_gets_its_gradient():
    model = _lora(make_tiny_qwen3(60), ["q_proj", "v_proj"])
    head = unwrap(model).get_output_embeddings()
    head.weight.requires_grad_(True)  # e.g. full fine-tuning of the head
    args = _batch(60)
    _assert_matches_naive(model, args)  # includes head.weight's gradient
    hidden = torch.randn(4, head.in_features)
    with pytest.raises(ValueError, match="does not train lm_head"):
        fused_head_logprobs(head, hidden, torch.zeros(4, dtype=torch.long))
    with torch.no_grad():  # nothing is trained without grad: the fused path serves
        fused_head_logprobs(head, hidden, torch.zeros(4, dtype=torch.long))


def test_lora_on_lm_head_falls_back():
    model = _lora(make_tiny_qwen3(60), ["q_proj", "lm_head"])
    head = unwrap(model).get_output_embeddings()
    assert not fused_head_supported(head)  # a PEFT LoRA layer around the Linear
    assert any(p.requires_grad for p in head.parameters())
    _assert_matches_naive(model, _batch(60))
    with pytest.raises(TypeError, match="plain nn.Linear"):
        fused_head_logprobs(head, torch.randn(2, 64), torch.zeros(2, dtype=torch.long))


def test_only_plain_linear_heads_are_fused():
    assert fused_head_supported(nn.Linear(8, 16))
    hooked = nn.Linear(8, 16)
    hooked.register_forward_pre_hook(lambda module, args: None)  # as FSDP2 / offloading do
    assert not fused_head_supported(hooked)

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert not fused_head_supported(Scaled(8, 16))
    bnb = pytest.importorskip("bitsandbytes")
    assert not fused_head_supported(bnb.nn.Linear4bit(8, 16))


def test_no_grad_and_empty_selections(policy):
    model, _ = policy
    ids, att, P, mask = _batch(len(policy[1]))
    with torch.no_grad():
        frozen, ent = completion_logprobs(model, ids, att, P, mask, 4, 0.7)
    assert not frozen.requires_grad
    live, live_ent = completion_logprobs(model, ids, att, P, mask, 4, 0.7)
    torch.testing.assert_close(frozen, live.detach())
    torch.testing.assert_close(ent, live_ent)
    empty, empty_ent = completion_logprobs(model, ids, att, P, torch.zeros_like(mask))
    assert empty.shape == mask.shape and (empty == 0).all() and (empty_ent == 0).all()


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_logprobs", ROOT / "bench/bench_logprobs.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_memory_is_one_fp32_chunk_and_nothing_of_it_is_kept(dtype):
    live_bytes = _bench().LiveTensorBytes
    M, H, V = 128, 16, 6000
    head, hidden, targets, w = _head_case(dtype, False, M=M, H=H, V=V)
    h = hidden.clone().requires_grad_()
    with live_bytes() as fused:
        logp, _ = fused_head_logprobs(head, h, targets, M)
        kept = fused.live  # what forward leaves for backward (and the outputs)
        (logp * w).sum().backward()
    with live_bytes() as ckpt:
        logp, _ = checkpointed_head_logprobs(head, h, targets, M)
        (logp * w).sum().backward()
    per_entry = fused.peak / (M * V)
    assert per_entry <= 4 + 4 / ROW_BLOCKS + 0.1  # one fp32 [M, V] buffer + a row block
    assert kept <= 2 * M * H * 4  # [M, H]-sized: no [M, V] tensor survives forward
    assert ckpt.peak / (M * V) >= 12  # the tracker sees the checkpointed path's copies


def test_bench_logprobs_smoke():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/bench_logprobs.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "| variant | peak MiB | / naive |" in out.stdout
    assert "| variant | fwd+bwd s |" in out.stdout
    res = json.loads(out.stdout.strip().splitlines()[-1])
    mem, speed = res["memory"], res["speed"]
    assert mem["naive"]["ratio"] == 1.0
    assert mem["fused"]["peak_mib"] < mem["checkpoint"]["peak_mib"] < mem["naive"]["peak_mib"]
    for v in ("checkpoint", "fused"):
        assert mem[v]["max_abs_dlogp"] < 1e-4 and mem[v]["max_abs_dgrad"] < 1e-4
        assert mem[v]["rss_mib"] > 0
        assert speed[v]["max_abs_dgrad"] < 1e-4 and len(speed[v]["seconds_all"]) == 3


def test_logprobs_match_generate_scores(policy):
    """Left padding + position ids agree with what `generate` sampled from."""
    model, tok = policy
    model.eval()
    enc = tok(["What is 2+3?", "1?"], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **enc,
        max_new_tokens=6,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[],
    )
    P = enc["input_ids"].shape[1]
    comp = out.sequences[:, P:]
    scores = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    mask = torch.ones_like(comp, dtype=torch.float32)
    am = torch.cat([enc["attention_mask"], torch.ones_like(comp)], 1)
    with torch.no_grad():
        ours, ent = completion_logprobs(model, out.sequences, am, P, mask)
    torch.testing.assert_close(ours, scores, atol=1e-4, rtol=1e-4)
    assert (ent > 0).all()


def test_heads_with_accelerate_hooks_are_not_fused():
    from ibpo.logprobs import fused_head_supported

    head = torch.nn.Linear(4, 6, bias=False)
    assert fused_head_supported(head)
    head._hf_hook = object()  # accelerate's dispatch/offload hook (weights may live elsewhere)
    assert not fused_head_supported(head)
    other = torch.nn.Linear(4, 6, bias=False)
    other.forward = lambda x: x  # an instance forward replaced by a wrapper
    assert not fused_head_supported(other)
