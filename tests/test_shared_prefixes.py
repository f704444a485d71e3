"""Prompts of one generate() call that begin alike run their common prefix once
(generation.prefixes: plan_shared_prefixes, shared_prefix_inputs): the same samples and log-probs as
the plain left-padded batch, fewer prompt tokens through the model, and the plain batch wherever
sharing would not pay or the model cannot take it."""

import random

import pytest
import torch

from ibpo.config import DataConfig, ModelConfig, RepairConfig
from ibpo.data import Example
from ibpo.generation import generate, hf_generator, set_kv_cache
from ibpo.generation.prefixes import padded_cost, plan_shared_prefixes, shares_prefixes
from ibpo.logprobs import completion_logprobs
from ibpo.modeling import load_policy
from ibpo.repair import RepairGeneration, run_repairs
from tests.conftest import grader_rewards, make_tiny_qwen3, make_tokenizer

# Repair-like prompts: two groups, each a long shared question then per-row attempts of several
# lengths, and one prompt that shares nothing.
QUESTION_A = "what is 12+30? answer with just the number. here is an attempt:"
QUESTION_B = "what is 9*9? answer with just the number. here is an attempt:"
PROMPTS = [
    QUESTION_A + " 41. another: 42. fix it",
    QUESTION_A + " 7. another: 42. fix",
    QUESTION_A + " 40",
    "hello there",
    QUESTION_B + " 80. another: 81",
    QUESTION_B + " 18. another: 81. fix the first one",
]


def _policy(tiny_model_dir):
    model, tok = load_policy(
        ModelConfig(name=tiny_model_dir, quantization="none"), torch.device("cpu")
    )
    return model, tok


def test_plan_covers_every_row_in_order_and_keeps_a_token_per_row():
    a = list(range(20))
    rows = [a + [50], a + [51, 52], a + [53], [7, 8, 9], a[:12] + [60], a[:12] + [61]]
    plan = plan_shared_prefixes(rows)
    assert plan is not None
    assert [(s, e) for s, e, _ in plan] == [(0, 3), (3, 4), (4, 6)]
    assert plan[0][2] == 20 and plan[2][2] == 12  # each run's longest common prefix
    for start, end, length in plan:
        assert all(length < len(rows[i]) for i in range(start, end))
        assert all(rows[i][:length] == rows[start][:length] for i in range(start, end))
    assert padded_cost(rows, plan) < padded_cost(rows, None)
    # identical prompts share all but their last token
    twins = plan_shared_prefixes([a, a, a])
    assert twins == [(0, 3, 19)]


def test_plan_declines_where_nothing_is_shared_or_padding_would_cost_more():
    assert plan_shared_prefixes([[1, 2, 3], [4, 5, 6]]) is None
    # a shared prefix shorter than the minimum is not worth a forward of its own
    assert plan_shared_prefixes([[1, 2, 3, 4, 5], [1, 2, 3, 9, 9]]) is None
    # two short rows sharing 10 tokens beside a long lone row: the rests would all pad to the
    # long row's length, unless the lone row goes whole into the prefix batch
    short = list(range(10))
    rows = [short + [90], short + [91], list(range(100, 160))]
    plan = plan_shared_prefixes(rows)
    assert plan == [(0, 2, 10), (2, 3, 59)]
    assert padded_cost(rows, plan) < padded_cost(rows, None)


# identical prompts and a lone long one: every row's rest is its last token (no second forward)
TWINS = [QUESTION_A + " 41"] * 3 + [QUESTION_B * 2]


@pytest.mark.parametrize(
    "prompts, batch_size",
    [(PROMPTS, 8), (PROMPTS, 4), (TWINS, 8)],  # one slice; slices of different plans; twins
)
def test_shared_prefixes_sample_what_the_plain_batch_samples(tiny_model_dir, prompts, batch_size):
    """The same tokens from the same streams, log-probs equal to float error, and fewer prompt
    tokens run (the prefixes once per run)."""
    model, tok = _policy(tiny_model_dir)
    found = {}
    for share in (False, True):
        torch.manual_seed(5)
        found[share] = generate(model, tok, prompts, 1, 12, batch_size, share_prefixes=share)
    plain, shared = found[False], found[True]
    assert torch.equal(plain.input_ids, shared.input_ids)  # prompts left-padded as always
    assert torch.equal(plain.completion_mask, shared.completion_mask)
    assert plain.texts == shared.texts
    torch.testing.assert_close(shared.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    total = sum(shared.host_prompt_lengths())
    assert plain.prefill_tokens == total
    assert shared.prefill_tokens < total - len(QUESTION_A)  # at least one run's prefix saved
    greedy = [
        generate(model, tok, prompts, 1, 12, batch_size, do_sample=False, share_prefixes=s)
        for s in (False, True)
    ]
    assert torch.equal(greedy[0].input_ids, greedy[1].input_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_samples_carry_the_policys_teacher_forced_log_probs(
    tiny_model_dir, temperature
):
    """The repair tokens' log-probs: what the sampler recorded over the shared-prefix cache is
    what one plain forward of each whole sequence gives (the trainer's own log-probs)."""
    model, tok = _policy(tiny_model_dir)
    torch.manual_seed(1)
    ro = generate(model, tok, PROMPTS, 1, 10, 8, temperature=temperature, share_prefixes=True)
    assert ro.prefill_tokens < sum(ro.host_prompt_lengths())
    logp, _ = completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask, 64, temperature
    )
    torch.testing.assert_close(logp * ro.completion_mask, ro.logprobs, atol=1e-5, rtol=0)


def test_repairs_with_shared_prefixes_match_repairs_without(tiny_model_dir):
    """run_repairs over a real tiny policy: the same repairs, phi and masks either way, and the
    metrics tell the prompt tokens run from the prompts' tokens."""
    model, tok = _policy(tiny_model_dir)
    G = 4
    examples = [Example("what is 12+30? answer with the number", "42"), Example("9*9=?", "81")]
    torch.manual_seed(0)
    rollout = generate(model, tok, [e.question for e in examples], G, 6, 8)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    reward_fn = grader_rewards(lambda text, answer: float(answer in text))
    outs = {}
    for share in (False, True):
        torch.manual_seed(3)
        gen = RepairGeneration(hf_generator(model, share), tok, DataConfig(), 8, 16, 1.0, 1.0)
        outs[share] = run_repairs(
            gen, examples, rollout, rewards, reward_fn, RepairConfig(), random.Random(0)
        )
    plain, shared = outs[False], outs[True]
    assert torch.equal(plain.phi, shared.phi) and torch.equal(plain.edited, shared.edited)
    assert plain.stats["repair_tokens"] == shared.stats["repair_tokens"]
    prompt_tokens = plain.stats["repair_prompt_tokens"]
    assert plain.stats["repair_prefill_tokens"] == prompt_tokens
    assert shared.stats["repair_prompt_tokens"] == prompt_tokens
    # 6 repairs, 3 per group: each group's question and template head run once, not 3 times
    assert shared.stats["repairs"] == 6
    assert shared.stats["repair_prefill_tokens"] < 0.9 * prompt_tokens


def _sliding_model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = make_tokenizer()
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return AutoModelForCausalLM.from_config(cfg), tok


def test_models_that_cannot_take_interior_padding_run_every_prompt_whole(tiny_model_dir):
    """A sliding window counts cache slots (padding included), flash-attention packs batches by
    the mask and a static cache is generate()'s own: each falls back to the plain batch."""
    model, tok = _policy(tiny_model_dir)
    assert shares_prefixes(model)
    set_kv_cache(model, "static")
    assert not shares_prefixes(model)
    ro = generate(model, tok, PROMPTS, 1, 4, 8)
    assert ro.prefill_tokens == sum(ro.host_prompt_lengths())
    set_kv_cache(model, "dynamic")
    plain = make_tiny_qwen3(len(tok))
    plain.config._attn_implementation = "flash_attention_2"
    assert not shares_prefixes(plain)
    sliding, tok = _sliding_model()
    assert "sliding_attention" in sliding.config.layer_types
    assert not shares_prefixes(sliding)
    ro = generate(sliding, tok, PROMPTS, 1, 4, 8)
    assert ro.prefill_tokens == sum(ro.host_prompt_lengths())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_prefixes_on_cuda_carry_the_teacher_forced_log_probs():
    """On the device: every tensor of the shared-prefix path on CUDA, the sampler's log-probs
    those of a plain forward (float32, sdpa), and the same greedy tokens as the plain batch."""
    tok = make_tokenizer()
    model = make_tiny_qwen3(len(tok), seed=4).cuda()
    model.config._attn_implementation = "sdpa"
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    assert shares_prefixes(model)
    torch.manual_seed(2)
    ro = generate(model, tok, PROMPTS, 1, 10, 8, share_prefixes=True)
    assert ro.input_ids.is_cuda and ro.logprobs.is_cuda
    assert ro.prefill_tokens < sum(ro.host_prompt_lengths())
    logp, _ = completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask, 64, 1.0
    )
    torch.testing.assert_close(logp * ro.completion_mask, ro.logprobs, atol=1e-4, rtol=0)
    greedy = [
        generate(model, tok, PROMPTS, 1, 10, 8, do_sample=False, share_prefixes=s)
        for s in (False, True)
    ]
    assert torch.equal(greedy[0].input_ids, greedy[1].input_ids)
