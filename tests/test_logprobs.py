import pytest
import torch

from ibpo.config import ModelConfig
from ibpo.logprobs import completion_logprobs, naive_completion_logprobs
from ibpo.modeling import load_policy
from ibpo.rollout import generate


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


@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_values_and_grads(policy, chunk, temperature):
    model, tok = policy
    torch.manual_seed(1)
    ro = generate(model, tok, ["What is 2+3?", "1+1=?"], 3, 12, 6, temperature=1.0)
    args = (ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    fast, _ = completion_logprobs(model, *args, chunk_tokens=chunk, temperature=temperature)
    g_fast = torch.autograd.grad((fast * ro.completion_mask).sum(), params)
    slow = naive_completion_logprobs(model, *args, temperature=temperature)
    g_slow = torch.autograd.grad(slow.sum(), params)
    torch.testing.assert_close(fast * ro.completion_mask, slow, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_fast, g_slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_logprobs_match_generate_scores(policy):
    """Left padding + position ids agree with what `generate` sampled from."""
    model, tok = policy
    model.eval()
    enc = tok(["What is 2+3?", "1?"], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=[])  # fmt: skip
    P = enc["input_ids"].shape[1]
    comp = out.sequences[:, P:]
    scores = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    mask = torch.ones_like(comp, dtype=torch.float32)
    am = torch.cat([enc["attention_mask"], torch.ones_like(comp)], 1)
    with torch.no_grad():
        ours, ent = completion_logprobs(model, out.sequences, am, P, mask)
    torch.testing.assert_close(ours, scores, atol=1e-4, rtol=1e-4)
    assert (ent > 0).all()
