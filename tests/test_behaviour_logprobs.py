"""Behaviour log-probs: each backend reports, per sampled token, its log-prob under the
distribution it sampled from (generation.sampling.SampledLogprobs for HF generate)."""

import math

import pytest
import torch

from ibpo.config import ModelConfig
from ibpo.generation import concat_rollouts, generate
from ibpo.generation.sampling import SampledLogprobs, top_k_filter, top_p_filter
from ibpo.logprobs import completion_logprobs
from ibpo.modeling import load_policy

# small matmuls: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_top_k_and_top_p_filters_keep_the_expected_tokens():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.05, 0.1, 0.8]]))
    kept = torch.isfinite(top_k_filter(scores, 2))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    # the nucleus: the most likely tokens until their mass reaches p
    kept = torch.isfinite(top_p_filter(scores, 0.75))
    assert kept.tolist() == [[True, True, False, False], [False, False, False, True]]
    kept = torch.isfinite(top_p_filter(scores, 0.81))
    assert kept.tolist() == [[True, True, True, False], [False, False, True, True]]
    assert torch.equal(top_p_filter(scores, 1.0), scores)
    assert torch.equal(top_k_filter(scores, 0), scores)
    # a near-zero p keeps exactly the top token
    assert torch.isfinite(top_p_filter(scores, 1e-6)).sum(-1).tolist() == [1, 1]


def _reference_logprobs(model, ro, temperature, top_k, top_p):
    """The sampling distribution recomputed from a full forward (no KV cache)."""
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits.float()
    P = ro.prompt_len
    scores = logits[:, P - 1 : -1] / temperature
    n, t, v = scores.shape
    flat = top_p_filter(top_k_filter(scores.reshape(n * t, v), top_k), top_p)
    lp = flat.log_softmax(-1).view(n, t, v)
    lp = lp.gather(-1, ro.completion_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(ro.completion_mask > 0, lp, 0.0)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 6, 1.0), (0.9, 0, 0.8)]
)
def test_hf_generate_reports_the_log_probs_it_sampled_from(
    tiny_model_dir, temperature, top_k, top_p
):
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization="none"), torch.device("cpu")
    )
    torch.manual_seed(0)
    ro = generate(
        model,
        tok,
        ["a", "What is 12+30?"],
        4,
        10,
        batch_size=3,  # slices of different widths, joined
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    assert ro.logprobs is not None and ro.logprobs.shape == ro.completion_mask.shape
    assert ro.logprobs.dtype == torch.float32
    assert (ro.logprobs[ro.completion_mask == 0] == 0).all()
    ref = _reference_logprobs(model, ro, temperature, top_k, top_p)
    assert torch.isfinite(ro.logprobs).all()
    assert (ro.logprobs <= 0).all()
    torch.testing.assert_close(ro.logprobs, ref, atol=1e-5, rtol=0)
    if top_k or top_p < 1:  # truncation renormalises: some token is likelier than untruncated
        full = _reference_logprobs(model, ro, temperature, 0, 1.0)
        assert (ro.logprobs - full)[ro.completion_mask > 0].max() > 1e-3
    # the trainer's log-probs (full distribution at the temperature) agree when nothing truncates
    trainer, _ = completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask, 64, temperature
    )
    if not top_k and top_p == 1:
        torch.testing.assert_close(trainer * ro.completion_mask, ro.logprobs, atol=1e-5, rtol=0)


def test_greedy_generate_reports_none_and_selection_keeps_log_probs(tiny_model_dir):
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization="none"), torch.device("cpu")
    )
    greedy = generate(model, tok, ["a"], 1, 6, batch_size=2, do_sample=False)
    assert greedy.logprobs is None
    torch.manual_seed(1)
    a = generate(model, tok, ["a", "bc"], 2, 5, batch_size=4)
    b = generate(model, tok, ["What is 1+2?"], 2, 9, batch_size=4)
    sel = a.select([3, 0])
    assert torch.equal(sel.logprobs, a.logprobs[[3, 0]])
    joined = concat_rollouts([a, b], tok.pad_token_id)
    T = joined.completion_mask.shape[1]
    assert joined.logprobs.shape == (6, T)
    assert torch.equal(joined.logprobs[:4, : a.logprobs.shape[1]], a.logprobs)
    assert torch.equal(joined.logprobs[4:, : b.logprobs.shape[1]], b.logprobs)
    assert (joined.logprobs[joined.completion_mask == 0] == 0).all()
    # a rollout without them joined with one that has them: none (not a partial tensor)
    greedy_b = generate(model, tok, ["x"], 2, 4, batch_size=4, do_sample=False)
    assert concat_rollouts([a, greedy_b], tok.pad_token_id).logprobs is None


def test_recorder_refuses_a_processor_that_ran_after_it():
    rec = SampledLogprobs(1.0, 0, 1.0)
    scores = torch.zeros(2, 5)
    rec(torch.zeros(2, 3, dtype=torch.long), scores)
    with pytest.raises(RuntimeError, match="another logits processor"):
        rec.finish(torch.zeros(2, 2, dtype=torch.long))
    rec = SampledLogprobs(1.0, 0, 1.0)
    rec(torch.zeros(2, 3, dtype=torch.long), scores)
    out = rec.finish(torch.tensor([[1], [4]]))
    torch.testing.assert_close(out, torch.full((2, 1), -math.log(5)))


def test_draw_samples_the_processed_distribution_and_never_a_zero_probability_token():
    from ibpo.generation.sampling import draw

    torch.manual_seed(0)
    scores = torch.tensor([[0.0, 1.0, float("-inf"), 2.0, float("-inf")]]).repeat(20000, 1)
    lse = scores.logsumexp(-1, keepdim=True)
    tokens = draw(scores, lse).squeeze(1)
    counts = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    expected = torch.softmax(scores[0], -1).double()
    assert counts[2] == 0 and counts[4] == 0  # filtered tokens never come out
    torch.testing.assert_close(counts, expected, atol=0.012, rtol=0)  # ~4 sigma at n = 20000
    # a one-token distribution, and the top of the range: always that token
    one = torch.full((3, 6), float("-inf"))
    one[:, 5] = 0.0
    assert draw(one, one.logsumexp(-1, keepdim=True)).eq(5).all()
