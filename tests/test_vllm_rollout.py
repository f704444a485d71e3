"""The vllm rollout backend (ibpo/generation/vllm.py), driven through tests/fake_vllm: a stand-in
for vLLM's offline API run by transformers + PEFT on CPU (vLLM itself needs CUDA). What is tested is
ibpo's side: the Rollout it builds, the adapter it sends every phase, sleeping between phases,
the KV budget, the trainer on this backend, and the errors a user can hit."""

import sys
from pathlib import Path

import pytest
import torch

from ibpo.config import ConfigError
from ibpo.generation import generate
from ibpo.modeling import load_policy
from ibpo.recipe import load_config

FAKE = str(Path(__file__).parent / "fake_vllm")


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.syspath_prepend(FAKE)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    import vllm

    assert vllm.__file__.startswith(FAKE)
    yield vllm
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def _policy(tiny_model_dir, *overrides):
    cfg = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "model.quantization=none",
            "rollout.backend=vllm",
            "rollout.max_new_tokens=6",
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            *overrides,
        ],
    )
    torch.manual_seed(0)
    model, tok = load_policy(cfg.model, torch.device("cpu"))
    _perturb(model, seed=1)
    return cfg, model, tok


def _perturb(model, seed):
    """A non-zero adapter (LoRA B starts at zero): generations depend on it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


PROMPTS = ["What is 12+30?", "a", "hello there"]


def test_greedy_rollout_equals_the_policys_own(fake_vllm, tiny_model_dir):
    """Same tokens, same padded tensors, masks and texts as generation.generate; the adapter is what
    the engine served (the base alone answers differently)."""
    from ibpo.generation import VLLMEngine

    cfg, model, tok = _policy(tiny_model_dir)
    engine = VLLMEngine.start(cfg, model, tok)
    hf = generate(model, tok, PROMPTS, 2, 6, batch_size=4, do_sample=False)
    with engine.serving(model) as gen:
        ours = gen(tok, PROMPTS, 2, 6, 4, do_sample=False)
    assert ours.prompt_len == hf.prompt_len and ours.texts == hf.texts
    for field in ("input_ids", "attention_mask", "completion_mask", "truncated"):
        assert torch.equal(getattr(ours, field), getattr(hf, field)), field
    llm = fake_vllm.ENGINES[-1]
    assert llm.requests[-1][0] == len(PROMPTS)  # one request per prompt, n samples each
    with model.disable_adapter():
        base = generate(model, tok, PROMPTS, 1, 6, batch_size=4, do_sample=False)
    assert base.texts != hf.texts[::2]


def test_every_phase_serves_the_adapter_as_it_is_now(fake_vllm, tiny_model_dir):
    """A new LoRA id and directory per phase (the engine caches by id), the previous directory
    removed; asleep outside a phase; the saved adapters go with the engine."""
    from ibpo.generation import VLLMEngine

    cfg, model, tok = _policy(tiny_model_dir)
    engine = VLLMEngine.start(cfg, model, tok)
    llm = fake_vllm.ENGINES[-1]
    assert engine.asleep and llm.asleep and llm.sleeps == 1
    texts, paths = [], []
    for seed in (1, 2):
        _perturb(model, seed)
        with engine.serving(model) as gen:
            assert not llm.asleep
            texts.append(gen(tok, PROMPTS, 1, 6, 4, do_sample=False).texts)
            lora = llm.requests[-1][1]
            paths.append(Path(lora.lora_path))
        assert llm.asleep
        assert texts[-1] == generate(model, tok, PROMPTS, 1, 6, 4, do_sample=False).texts
    assert texts[0] != texts[1]
    assert sorted(llm.adapters) == [1, 2]
    assert not paths[0].exists() and paths[1].is_dir()
    with pytest.raises(RuntimeError, match="asleep"):
        gen(tok, PROMPTS, 1, 6, 4, do_sample=False)
    engine.close()
    assert not engine.workdir.exists()


def test_sampling_seeds_follow_torch_rng(fake_vllm, tiny_model_dir):
    """Seeds come from torch's RNG (restored on resume): same RNG state, same samples; each
    prompt gets its own seed."""
    from ibpo.generation import VLLMEngine

    cfg, model, tok = _policy(tiny_model_dir)
    engine = VLLMEngine.start(cfg, model, tok)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        with engine.serving(model) as gen:
            runs.append(gen(tok, ["a", "a"], 3, 6, 4, temperature=1.0))
    assert torch.equal(runs[0].input_ids, runs[1].input_ids)
    assert runs[0].texts[:3] != runs[0].texts[3:]  # same prompt twice, different seeds
    torch.manual_seed(8)
    with engine.serving(model) as gen:
        assert gen(tok, ["a", "a"], 3, 6, 4, temperature=1.0).texts != runs[0].texts
    # greedy calls (evaluation) draw nothing from torch's RNG, as the hf backend's do not
    torch.manual_seed(7)
    with engine.serving(model) as gen:
        gen(tok, PROMPTS, 1, 6, 4, do_sample=False)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(7).get_state())


def test_sampled_rows_are_grouped_prompt_major(fake_vllm, tiny_model_dir):
    """Row b * G + j is sample j of prompt b: at a temperature near 0 every sample of a prompt
    is that prompt's greedy completion, and the prompts' completions differ."""
    from ibpo.generation import VLLMEngine

    cfg, model, tok = _policy(tiny_model_dir)
    engine = VLLMEngine.start(cfg, model, tok)
    with engine.serving(model) as gen:
        sampled = gen(tok, PROMPTS, 3, 6, 4, temperature=1e-4)
    greedy = generate(model, tok, PROMPTS, 1, 6, 4, do_sample=False).texts
    assert sampled.texts == [t for t in greedy for _ in range(3)]
    assert len(set(greedy)) == len(PROMPTS)


def test_sampled_rollouts_carry_the_engines_log_probs(fake_vllm, tiny_model_dir):
    """The engine's per-token log-probs (processed: at the sampling temperature) become the
    rollout's behaviour log-probs; here the stand-in runs the policy's own fp32 weights, so they
    equal the trainer's log-probs. Greedy requests ask for none."""
    from ibpo.generation import VLLMEngine
    from ibpo.logprobs import completion_logprobs

    cfg, model, tok = _policy(tiny_model_dir)
    engine = VLLMEngine.start(cfg, model, tok)
    with engine.serving(model) as gen:
        ro = gen(tok, PROMPTS, 2, 6, 4, temperature=0.8)
        greedy = gen(tok, PROMPTS, 1, 6, 4, do_sample=False)
    assert greedy.logprobs is None
    assert ro.logprobs.shape == ro.completion_mask.shape
    assert fake_vllm.ENGINES[-1].last_params[0].logprobs is None  # the greedy call, last
    model.eval()
    trainer, _ = completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask, 64, 0.8
    )
    torch.testing.assert_close(ro.logprobs, trainer * ro.completion_mask, atol=1e-4, rtol=0)
    assert (ro.logprobs[ro.completion_mask > 0] < 0).all()


def test_engine_arguments(fake_vllm, tiny_model_dir, monkeypatch):
    """NF4 base through bitsandbytes, a LoRA slot for the rank, sleep mode, a fixed KV budget;
    a vLLM without bitsandbytes is refused with the fix."""
    import types

    from ibpo.generation import VLLMEngine, engine_kwargs
    from ibpo.sizes import ModelShape, kv_cache_bytes, vllm_budget

    kw = engine_kwargs(fake_vllm, "nf4", 12)
    processed = {"logprobs_mode": "processed_logprobs"}
    assert kw == dict(
        quantization="bitsandbytes", enable_lora=True, max_lora_rank=16, max_loras=1, **processed
    )
    assert engine_kwargs(fake_vllm, "none", None) == processed
    cfg, model, tok = _policy(tiny_model_dir, "rollout.generation_batch_size=3")
    VLLMEngine.start(cfg, model, tok)
    args = fake_vllm.ENGINES[-1].kwargs
    assert args["enable_sleep_mode"] and args["max_lora_rank"] == 16 and args["dtype"] == "float32"
    shape = ModelShape.from_dict(model.config.to_dict())
    length, kv = vllm_budget(shape, cfg, 4, model.config.max_position_embeddings)
    assert args["kv_cache_memory_bytes"] == kv and args["max_model_len"] == length
    # 3 sequences of prompt + new tokens, in fp32 (the CPU compute dtype), in whole 256-token
    # blocks; a request may use all of it, up to the model's 256 positions
    tokens = 3 * (cfg.data.max_prompt_tokens + 6)
    assert kv == kv_cache_bytes(shape, 1, -(-tokens // 256) * 256, 4) and length == 256
    assert vllm_budget(shape, cfg, 4)[0] == tokens
    quant = types.ModuleType("vllm.model_executor.layers.quantization")
    quant.QUANTIZATION_METHODS = ["awq", "fp8"]
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.quantization", quant)
    with pytest.raises(ConfigError, match="vllm<0.28"):
        engine_kwargs(fake_vllm, "nf4", 16)


def test_training_on_the_vllm_backend(fake_vllm, tiny_model_dir, tmp_path, monkeypatch):
    """A whole run: held-out answers, rollouts and IBPO's repairs come from the engine, each
    phase (eval before, 2 steps, eval after) with the adapter as it is then; the adapter trains."""
    from ibpo.rewards import GRADERS
    from ibpo.trainer import run_recipe

    # a random tiny model never answers right: reward odd-length answers, so groups differ
    monkeypatch.setitem(GRADERS, "odd_length", lambda text, answer: float(len(text) % 2))
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "model.quantization=none",
            "rollout.backend=vllm",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "rollout.eval_max_new_tokens=4",
            "data.eval_size=4",
            f"run.output_dir={out}",
            "train.steps=2",
            "train.learning_rate=0.05",
            "reward.functions=odd_length",
            "repair.cost_share=1",  # every planned repair runs, in one request
            "repair.min_success=0",
            "repair.reference_selection=correct_first",  # the repair counts below need every plan
        ],
    )
    summary = run_recipe(cfg)
    assert summary["status"] == "completed" and summary["eval_after"]["n"] == 4
    llm = fake_vllm.ENGINES[-1]
    ids = [lora.lora_int_id for _, lora in llm.requests]
    assert sorted(set(ids)) == [1, 2, 3, 4] and ids == sorted(ids) and llm.asleep
    assert not Path(llm.requests[-1][1].lora_path).parent.exists()  # engine closed, files gone
    sizes = [n for n, lora in llm.requests if lora.lora_int_id == 2]
    assert sizes[0] == 2 and len(sizes) == 2  # 2 prompts, then one request for the repairs
    from safetensors.torch import load_file

    weights = load_file(out / "adapter" / "adapter_model.safetensors")
    assert max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k) > 0


def test_engine_failures(fake_vllm, tiny_model_dir, tmp_path, monkeypatch):
    """vLLM refusing to start is a ConfigError naming the knobs; an error in the middle of a run
    still shuts the engine down and removes its files."""
    import ibpo.trainer as trainer
    from ibpo.generation import VLLMEngine

    cfg, model, tok = _policy(tiny_model_dir)

    def refuse(*args, **kwargs):
        raise ValueError("Free memory on device is less than desired GPU memory utilization")

    with monkeypatch.context() as m:
        m.setattr(fake_vllm, "LLM", refuse)
        with pytest.raises(ConfigError, match="lower rollout.generation_batch_size"):
            VLLMEngine.start(cfg, model, tok)

    def broken_step(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(trainer, "rl_step", broken_step)
    started, start = [], VLLMEngine.start.__func__

    def recording_start(cls, *args):
        started.append(start(cls, *args))
        return started[-1]

    monkeypatch.setattr(VLLMEngine, "start", classmethod(recording_start))
    run = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "model.quantization=none",
            "rollout.backend=vllm",
            "data.eval_size=0",
            "train.steps=1",
            f"run.output_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(RuntimeError, match="a bug"):
        trainer.run_recipe(run)
    assert len(started) == 1 and started[0].llm is None  # closed
    assert not started[0].workdir.exists()


def test_vllm_backend_errors(tiny_model_dir, monkeypatch):
    from ibpo.generation import import_vllm

    with pytest.raises(ConfigError, match="rollout.backend"):
        load_config(None, ["rollout.backend=sglang"])
    with pytest.raises(ConfigError, match="vllm_kv_cache_gb' was removed: .* set that"):
        load_config(None, ["rollout.vllm_kv_cache_gb=2"])
    with pytest.raises(ConfigError, match="<= 8192"):
        load_config(None, ["rollout.backend=vllm", "rollout.generation_batch_size=9000"])
    from ibpo.plan.fit import estimate

    with pytest.raises(ConfigError, match="--gpus 1"):
        estimate("Qwen/Qwen3-1.7B", load_config(None, ["rollout.backend=vllm"]), gpus=2)
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed
    with pytest.raises(ConfigError, match=r"ibpo\[vllm\]"):
        import_vllm()


def test_benchmark_evaluation_on_vllm_equals_hf(fake_vllm, tiny_model_dir, tmp_path):
    """`--backend vllm` of the evaluation scripts: the adapter as a LoRA request gives the
    completions the hf backend gives (greedy), graded and written the same way."""
    import json

    from ibpo.evaluation.cli import main

    _, model, _ = _policy(tiny_model_dir)
    model.save_pretrained(tmp_path / "adapter")
    fixture = Path(__file__).parent / "fixtures" / "benchmarks" / "gsm8k.jsonl"
    samples = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / backend
        args = [
            "--model",
            tiny_model_dir,
            "--adapter",
            str(tmp_path / "adapter"),
            "--data",
            str(fixture),
            "--n",
            "1",
            "--temperature",
            "0",
            "--max-new-tokens",
            "6",
            "--backend",
            backend,
            "--max-model-len",
            "200",
            "--output-dir",
            str(out),
        ]
        assert main(args, benchmark="gsm8k") == 0
        rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
        samples[backend] = [(r["completion"], r["reward"]) for r in rows]
    assert samples["vllm"] == samples["hf"] and len(samples["hf"]) == 2  # the whole fixture
    llm = fake_vllm.ENGINES[-1]
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_model_len"] == 200
    assert sorted(llm.adapters) == [1]


def test_bench_vllm_smoke_through_the_stand_in():
    """bench/bench_vllm.py (the checks a real engine needs) runs end to end on the stand-in,
    and its checks hold there: adapter served, the same after sleep / wake, greedy agreement."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": FAKE, "HF_HUB_OFFLINE": "1"}
    script = str(root / "bench" / "bench_vllm.py")
    proc = subprocess.run(
        [sys.executable, script, "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["adapter_served"] and result["same_after_wake"]
    assert result["greedy_identical_share"] == 1.0 and result["greedy_identical_to_base_share"] < 1
    assert result["vllm_tokens_per_s"] > 0 and result["plan_generation_gb"] > 0
