"""A group's prompt computed once (logprobs.pack_shared_prompts): the same log-probs, entropies
and LoRA gradients as one row per member, and packing only where it is cheaper and safe."""

import pytest
import torch
from torch import nn

from ibpo.logprobs import (
    completion_logprobs,
    naive_completion_logprobs,
    pack_shared_prompts,
    shared_prompt_packing,
)
from tests.conftest import make_tiny_qwen3

G = 3


def _groups(vocab: int, seed: int = 0):
    """Two prompts of different real lengths (left-padded to P = 6), G members each, completions
    of different lengths right-padded to T = 5: [N, P + T] ids, mask, completion mask."""
    gen = torch.Generator().manual_seed(seed)
    P, T = 6, 5
    prompt_lens, comp_lens = [6, 4], [[5, 3, 1], [2, 5, 4]]
    rows, att, cmask = [], [], []
    for b in range(2):
        prompt = torch.randint(3, vocab, (prompt_lens[b],), generator=gen)
        for i in range(G):
            comp = torch.randint(3, vocab, (T,), generator=gen)
            n = comp_lens[b][i]
            comp[n:] = 0  # padding after the end
            pad = P - prompt_lens[b]
            rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, comp]))
            att.append(
                torch.cat([torch.zeros(pad), torch.ones(prompt_lens[b] + n), torch.zeros(T - n)])
            )
            cmask.append(torch.cat([torch.ones(n), torch.zeros(T - n)]))
    return torch.stack(rows), torch.stack(att).long(), P, torch.stack(cmask)


def _policy(checkpointing: bool, attn: str = "sdpa"):
    from peft import LoraConfig, get_peft_model

    model = make_tiny_qwen3(40, seed=1)
    model.config._attn_implementation = attn
    model.requires_grad_(False)
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(2))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    return model


def _logp_and_grads(model, args, group_size):
    params = [p for p in model.parameters() if p.requires_grad]
    logp, ent = completion_logprobs(
        model, *args, chunk_tokens=4, temperature=0.8, group_size=group_size
    )
    grads = torch.autograd.grad(
        (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum(), params
    )
    return logp, ent, grads


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_groups_give_the_same_logprobs_entropies_and_gradients(checkpointing):
    model = _policy(checkpointing)
    args = _groups(40)
    assert shared_prompt_packing(model, 2 * G, args[2], args[0].shape[1] - args[2], G)
    packed, packed_ent, g_packed = _logp_and_grads(model, args, G)
    rows, rows_ent, g_rows = _logp_and_grads(model, args, 1)
    naive = naive_completion_logprobs(model, *args, temperature=0.8)
    torch.testing.assert_close(packed, rows, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_ent, rows_ent, atol=1e-5, rtol=1e-5)
    assert (packed[args[3] == 0] == 0).all()  # padding stays zero
    for a, b in zip(g_packed, g_rows):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in g_packed)


def test_the_packed_mask_keeps_members_apart():
    ids, att, P, _ = _groups(40)
    T = ids.shape[1] - P
    packed_ids, mask, pos, index = pack_shared_prompts(ids, att, P, G)
    L = P + G * T
    assert packed_ids.shape == (2, L) and mask.shape == (2, 1, L, L)
    m = mask[0, 0]
    first, second = slice(P, P + T), slice(P + T, P + 2 * T)
    assert not m[second, first].any() and not m[first, second].any()  # members never see each other
    assert m[P + T + 2, :P].all()  # a completion token sees the whole (unpadded) prompt ...
    assert not m[:P, P:].any()  # ... and the prompt sees no completion
    assert not m[1, P : P + 1].any() and m[P + 1, P]  # causal inside a member
    assert mask[1, 0, P, : P - 4].sum() == 0  # prompt 2's left padding is never attended
    # each member's tokens keep the positions of its own row
    full = (att.cumsum(-1) - 1).clamp_min(0)
    torch.testing.assert_close(pos[1, P + 2 * T : P + 3 * T], full[5, P:])
    assert index[:, 0].eq(P - 1).all() and index[2, 1] == P + 2 * T


def test_packing_only_where_cheaper_safe_and_sdpa():
    model = _policy(False)
    assert shared_prompt_packing(model, 6, 6, 5, G)
    assert not shared_prompt_packing(model, 6, 6, 5, 1)  # no groups
    assert not shared_prompt_packing(model, 7, 6, 5, G)  # not whole groups
    assert not shared_prompt_packing(model, 16, 4, 400, 8)  # long completions: attention dominates
    assert not shared_prompt_packing(model, 2048 * 8, 200, 2048, 8)  # masks over the budget
    model.config._attn_implementation = "eager"  # eager adds the mask: it needs a float one
    assert not shared_prompt_packing(model, 6, 6, 5, G)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert not shared_prompt_packing(model, 6, 6, 5, G)


@pytest.mark.parametrize("do_sample", [False, True])
def test_generation_prefills_each_prompt_once_with_the_same_result(
    tiny_model_dir, monkeypatch, do_sample
):
    import ibpo.generation.hf as hf
    from ibpo.config import ModelConfig
    from ibpo.modeling import load_policy

    model, tok = load_policy(ModelConfig(name=tiny_model_dir), torch.device("cpu"))
    prompts = ["What is 3+4?", "7*2=?"]  # different lengths: left padding
    calls = []
    real_prefill = hf.prefill
    monkeypatch.setattr(hf, "prefill", lambda *a: calls.append(a[1].shape) or real_prefill(*a))

    def run():
        torch.manual_seed(5)
        return hf.generate(model, tok, prompts, 3, 8, 6, do_sample=do_sample)

    shared = run()
    assert calls and calls[0][0] == 6  # one call over the slice's 6 rows ...
    monkeypatch.setattr(hf, "shares_prefill", lambda *a: False)
    separate = run()
    assert len(calls) == 1  # ... and none with sharing off
    assert torch.equal(shared.input_ids, separate.input_ids)
    assert torch.equal(shared.completion_mask, separate.completion_mask)
    if do_sample:
        torch.testing.assert_close(shared.logprobs, separate.logprobs, atol=1e-5, rtol=1e-5)


def test_prefill_sharing_needs_whole_groups_and_the_dynamic_cache(tiny_model_dir):
    from ibpo.config import ModelConfig
    from ibpo.generation import set_kv_cache
    from ibpo.generation.prefixes import shares_prefill
    from ibpo.modeling import load_policy

    model, _ = load_policy(ModelConfig(name=tiny_model_dir), torch.device("cpu"))
    assert shares_prefill(model, torch.Size([6, 9]), 3)
    assert not shares_prefill(model, torch.Size([6, 9]), 1)  # one sample: nothing to share
    assert not shares_prefill(model, torch.Size([4, 9]), 3)  # a slice cutting a group
    assert not shares_prefill(model, torch.Size([6, 1]), 3)  # a one-token prompt
    set_kv_cache(model, "static")
    assert not shares_prefill(model, torch.Size([6, 9]), 3)
