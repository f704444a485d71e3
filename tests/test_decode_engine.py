"""The package's decode engine (generation/decode.py, rollout.decode=graph) against HF generate
(rollout.decode=eager): the same greedy tokens, the same sampled tokens from the same streams,
log-probs equal to the trainer's, on a tiny Qwen3 with grouped-query attention and LoRA and on
the real SmolLM2-135M (Llama); the fallbacks to HF generate and the rollout.decode key."""

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from ibpo import step
from ibpo.config import ConfigError
from ibpo.generation import DecodeEngine, decode_engine, generate
from ibpo.generation.decode import _State
from ibpo.generation.streams import sampling_stream
from ibpo.logprobs import completion_logprobs
from ibpo.recipe import load_config
from tests.conftest import make_tiny_qwen3, make_tokenizer

# small matmuls: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
# different real lengths (left padding); the first two share a long prefix (shared_prefix_inputs)
PROMPTS = [
    "what is 12+30? answer with just the number.",
    "what is 12+30? answer with just the number. it is 41, fix it",
    "hi",
    "a much longer prompt: 12*3=? and then 7-2=? and then",
]


def _policy(seed: int = 3):
    """A tiny Qwen3 (4 query heads, 2 KV heads) with a LoRA adapter whose update is not zero."""
    tok = make_tokenizer()
    model = make_tiny_qwen3(len(tok), seed=seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(seed))
    return model, tok


def _ending_early(model, tok):
    """The policy with a second stop id: a token greedy decoding emits a few tokens into the
    first prompt, so that rows end at different steps."""
    ro = generate(model, tok, PROMPTS, 1, 40, 4, do_sample=False)
    stop = ro.host_tokens()[0][4]
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    return model


def _both(model, tok, engine, prompts, samples, **kw):
    """(HF generate's rollout, the engine's) for the same call, each from the same stream."""
    out = []
    for e in (None, engine):
        with sampling_stream(CPU, 7, 1):
            out.append(generate(model, tok, prompts, samples, engine=e, **kw))
    return out


@pytest.mark.parametrize("bucket", [8, 64])
@pytest.mark.parametrize("samples,batch", [(1, 4), (3, 6), (3, 4)])
def test_greedy_decoding_gives_hf_generates_tokens(bucket, samples, batch):
    """Left padding, rows ending early, groups prefilled once (3, 6), shared prefixes (1, 4),
    slices of other sizes (3, 4), and bucket boundaries crossed (8 columns)."""
    model, tok = _policy()
    _ending_early(model, tok)
    engine = DecodeEngine(model)
    engine.bucket = bucket
    hf, ours = _both(
        model, tok, engine, PROMPTS, samples, max_new_tokens=40, batch_size=batch, do_sample=False
    )
    assert engine.calls > 0 and engine._state is None  # it decoded, and kept nothing
    assert torch.equal(hf.input_ids, ours.input_ids)
    assert torch.equal(hf.completion_mask, ours.completion_mask)
    assert hf.texts == ours.texts and ours.logprobs is None
    assert min(ours.lengths) < 40 < max(ours.lengths) + 1  # some rows ended early, some did not
    assert max(ours.lengths) + ours.prompt_len > bucket  # more than one bucket
    if samples == 1:  # the first two prompts ran their common prefix once
        assert ours.prefill_tokens < sum(len(tok(p).input_ids) for p in PROMPTS)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 12, 0.9)])
def test_sampling_draws_the_same_tokens_and_reports_the_trainers_log_probs(
    temperature, top_k, top_p
):
    model, tok = _policy()
    engine = DecodeEngine(model)
    engine.bucket = 16
    kw = dict(max_new_tokens=30, batch_size=6, temperature=temperature, top_k=top_k, top_p=top_p)
    hf, ours = _both(model, tok, engine, PROMPTS[:2], 4, **kw)
    assert torch.equal(hf.input_ids, ours.input_ids)  # the same draws from the same stream
    torch.testing.assert_close(ours.logprobs, hf.logprobs, atol=1e-5, rtol=0)
    assert (ours.logprobs[ours.completion_mask == 0] == 0).all()
    if top_k == 0 and top_p == 1.0:  # nothing truncated: the trainer's log-probs are the same
        trainer, _ = completion_logprobs(
            model,
            ours.input_ids,
            ours.attention_mask,
            ours.prompt_len,
            ours.completion_mask,
            64,
            temperature,
        )
        torch.testing.assert_close(trainer * ours.completion_mask, ours.logprobs, atol=1e-5, rtol=0)


def test_logits_processors_run_before_the_pick_as_in_hf_generate():
    """Evaluation's per-row seeded sampling is a logits processor over greedy decoding."""
    from ibpo.evaluation.cli import SeededSampling

    model, tok = _policy()
    engine = DecodeEngine(model)
    rollouts = []
    for e in (None, engine):
        seeded = SeededSampling([11, 12, 13, 14], 0.8, 0.95, "cpu")
        rollouts.append(
            generate(
                model, tok, PROMPTS, 1, 25, 4, do_sample=False, logits_processor=[seeded], engine=e
            )
        )
    assert torch.equal(rollouts[0].input_ids, rollouts[1].input_ids)


def test_min_new_tokens_of_the_generation_config_holds():
    model, tok = _policy()
    model.generation_config.min_new_tokens = 12
    hf, ours = _both(
        model, tok, DecodeEngine(model), PROMPTS, 2, max_new_tokens=20, batch_size=8, do_sample=True
    )
    assert torch.equal(hf.input_ids, ours.input_ids)
    assert min(ours.lengths) >= 12


def test_one_engine_serves_calls_of_other_sizes_and_keeps_nothing_between_them():
    model, tok = _policy()
    engine = DecodeEngine(model)
    calls = [(PROMPTS, 2, 10, 8), (PROMPTS[:1], 3, 30, 8), (PROMPTS, 2, 10, 3)]
    for prompts, samples, new, batch in calls:
        hf, ours = _both(model, tok, engine, prompts, samples, max_new_tokens=new,
                         batch_size=batch)  # fmt: skip
        assert torch.equal(hf.input_ids, ours.input_ids)
        assert engine._state is None
    assert engine.calls == 1 + 1 + 3  # the last call in slices of 3 rows


def test_a_failed_capture_decodes_with_hf_generate_and_says_why(monkeypatch, caplog):
    model, tok = _policy()
    engine = DecodeEngine(model, capture=True)  # CUDA's path on CPU: capture is forced to fail

    def fail(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_State, "capture", fail)
    with caplog.at_level(logging.WARNING):
        hf, ours = _both(model, tok, engine, PROMPTS, 2, max_new_tokens=12, batch_size=8)
    assert torch.equal(hf.input_ids, ours.input_ids)
    assert "not permitted" in engine.disabled
    said = [r.getMessage() for r in caplog.records if "rollout.decode=graph" in r.getMessage()]
    assert len(said) == 1 and "HF generate" in said[0]


def test_decode_key_picks_the_engine_and_unsupported_models_fall_back(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    model, _ = _policy()
    assert decode_engine(model, "eager") is None
    assert decode_engine(model, "auto") is None  # CPU: HF generate
    assert isinstance(decode_engine(model, "graph"), DecodeEngine)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=40))
    with caplog.at_level(logging.WARNING):
        assert decode_engine(gpt2, "graph") is None
    assert any("model type 'gpt2'" in r.getMessage() for r in caplog.records)
    assert load_config(None, ["rollout.decode=graph"]).rollout.decode == "graph"
    with pytest.raises(ConfigError, match="rollout.decode"):
        load_config(None, ["rollout.decode=fast"])


def test_a_generation_phase_with_decode_graph_uses_and_frees_the_engine(tiny_model_dir):
    from ibpo.modeling import load_policy

    cfg = load_config(
        None, [f"model.name={tiny_model_dir}", "model.quantization=nf4", "rollout.decode=graph"]
    )
    model, tok = load_policy(cfg.model, CPU)
    with step.generating(model, cfg, CPU) as generator:
        engine = generator.keywords["engine"]
        ro = generator(tok, PROMPTS[:2], 4, 8, 8, do_sample=True)
        assert isinstance(engine, DecodeEngine) and engine.calls == 1
    assert engine._state is None and ro.logprobs is not None


@pytest.mark.slow
def test_smollm2_greedy_and_sampled_rollouts_match_hf_generate(smollm2_dir):
    """The real model, 4-bit with LoRA as the demo trains it (CPU: the base dequantised once with
    the adapter folded in), through the trainer's generation phase."""
    from ibpo.modeling import load_policy

    over = [f"model.name={smollm2_dir}", "model.quantization=nf4"]
    eager = load_config(None, [*over, "rollout.decode=eager"])
    graph = load_config(None, [*over, "rollout.decode=graph"])
    model, tok = load_policy(eager.model, CPU)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.01, generator=torch.Generator().manual_seed(0))
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for a, b in [(3, 4), (12, 9), (40, 2)]
    ]
    out = {}
    for cfg in (eager, graph):
        with step.generating(model, cfg, CPU) as generator:
            greedy = generator(tok, prompts, 1, 20, 8, do_sample=False)
            with sampling_stream(CPU, 0, 0):
                sampled = generator(tok, prompts[:1], 4, 12, 8, do_sample=True)
        out[cfg.rollout.decode] = greedy, sampled
    (g_hf, s_hf), (g_ours, s_ours) = out["eager"], out["graph"]
    assert g_hf.texts == g_ours.texts and torch.equal(g_hf.input_ids, g_ours.input_ids)
    # a draw can land within float error of a boundary between two tail tokens of the 49k
    # vocabulary; where the tokens agree, so do their log-probs
    same = s_hf.completion_mask * s_ours.completion_mask
    agree = (s_hf.input_ids == s_ours.input_ids)[:, s_hf.prompt_len :].float() * same
    assert agree.sum() >= 0.9 * same.sum()
    diff = (s_hf.logprobs - s_ours.logprobs).abs() * agree
    assert diff.max() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_decode_what_the_uncaptured_step_does():
    dev = torch.device("cuda")
    model, tok = _policy()
    model.to(dev)
    for do_sample in (False, True):
        rollouts = []
        for capture in (False, True):
            engine = DecodeEngine(model, capture=capture)
            engine.bucket = 16
            with sampling_stream(dev, 3, 4):
                rollouts.append(
                    generate(model, tok, PROMPTS, 3, 40, 12, do_sample=do_sample, engine=engine)
                )
            assert engine.disabled is None
        assert torch.equal(rollouts[0].input_ids, rollouts[1].input_ids)
        if do_sample:
            torch.testing.assert_close(rollouts[0].logprobs, rollouts[1].logprobs)


def test_the_step_logs_the_share_of_decoding_spent_on_ended_rows(tiny_model_dir, tmp_path):
    """decode_idle_share: 1 - completion tokens / (rows x steps of each generate() call)."""
    import json

    from ibpo.trainer import run_recipe

    out = tmp_path / "run"
    cfg = load_config(None, [f"model.name={tiny_model_dir}", "model.quantization=none",
                             "train.steps=1", "data.eval_size=0", "repair.enabled=false",
                             "rollout.decode=graph", f"run.output_dir={out}"])  # fmt: skip
    run_recipe(cfg)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    slots, tokens = row["decode_slot_steps"], row["decode_slot_tokens"]
    assert slots >= tokens > 0 and slots % cfg.rollout.group_size == 0
    assert row["decode_idle_share"] == pytest.approx(1 - tokens / slots)
