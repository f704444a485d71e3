"""The memory planner: exact byte counts against bitsandbytes / PEFT / transformers, activation
estimates against the tensors a CPU run keeps alive, suggestions, and `ibpo plan`."""

import json
import math
from pathlib import Path

import pytest
import torch

from bench.memtrack import LiveTensorBytes
from ibpo import sizes
from ibpo.cli import main
from ibpo.config import ConfigError
from ibpo.plan import fit as plan
from ibpo.plan import phases
from ibpo.recipe import load_config

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = dict(model_type="qwen3", num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             vocab_size=151936)  # fmt: skip
QWEN3_8B = QWEN3 | dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                        tie_word_embeddings=False)  # fmt: skip
QWEN3_4B = QWEN3 | dict(hidden_size=2560, num_hidden_layers=36, intermediate_size=9728,
                        tie_word_embeddings=True)  # fmt: skip
QWEN3_1_7B = QWEN3 | dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                          intermediate_size=6144, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls run fastest on one thread; more only stall on a busy CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(*overrides):
    return load_config(None, ["model.name=unused", *overrides])


def _shape(d):
    return sizes.ModelShape.from_dict(d)


@pytest.mark.parametrize(
    "config, billions",
    [(QWEN3_8B, 8.2), (QWEN3_4B, 4.0), (QWEN3_1_7B, 1.7)],
    ids=["8B", "4B", "1.7B"],
)
def test_parameter_counts_match_published_totals(config, billions):
    assert _shape(config).parameter_count() / 1e9 == pytest.approx(billions, rel=0.03)


@pytest.mark.parametrize(
    "targets", ["all-linear", ["q_proj", "v_proj"], ["down_proj"], r".*\.mlp\..*_proj"]
)
def test_lora_count_is_exactly_peft(targets):
    from peft import LoraConfig, get_peft_model

    from tests.conftest import make_tiny_qwen3

    model = make_tiny_qwen3(54)
    shape = _shape(model.config.to_dict())
    peft = get_peft_model(model, LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert sizes.lora_parameter_count(shape, 8, targets) == trainable > 0


def test_nf4_weight_bytes_are_exactly_bitsandbytes(tiny_model_dir):
    import bitsandbytes as bnb

    from ibpo.modeling import load_policy

    cfg = load_config(None, [f"model.name={tiny_model_dir}", "model.dtype=bfloat16"])
    model, _ = load_policy(cfg.model, torch.device("cpu"))
    total = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.weight.quant_state
            assert qs.blocksize == sizes.NF4_BLOCK and qs.nested
            assert qs.state2.blocksize == sizes.NF4_NESTED_BLOCK
            state = [qs.absmax, qs.code, qs.state2.absmax, qs.state2.code, qs.offset]
            total += sum(t.numel() * t.element_size() for t in [module.weight, *state])
    total += sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if "lora_" not in n and not isinstance(p, bnb.nn.Params4bit)
    )
    shape = sizes.load_model_shape(tiny_model_dir, cfg.model)
    assert sizes.weight_bytes(shape, "nf4", 2) == total
    lora = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in lora} == {torch.float32}  # PEFT upcasts adapters: F32 is right


def test_kv_cache_is_exactly_the_transformers_cache():
    from tests.conftest import make_tiny_qwen3

    model = make_tiny_qwen3(54).eval()
    N, P, T = 3, 5, 7
    ids = torch.randint(3, 54, (N, P))
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=T,
            min_new_tokens=T,
            eos_token_id=1,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
    cache = out.past_key_values
    measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    shape = _shape(model.config.to_dict())
    assert sizes.kv_cache_bytes(shape, N, P + T - 1, 4) == measured  # the last token is not fed


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(hidden, intermediate, vocab, overrides) -> (4-bit LoRA policy, config, shape); models
    are built once per shape and shared by the tests of this module."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from ibpo.modeling import load_policy
    from tests.conftest import make_tokenizer

    built = {}

    def get(hidden, inter, vocab, overrides):
        if (hidden, inter, vocab) not in built:
            path = tmp_path_factory.mktemp("plan-model")
            d = dict(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=inter,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=hidden // 4,
                tie_word_embeddings=False,
                pad_token_id=0,
                eos_token_id=1,
            )
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(Qwen3Config(**d)).save_pretrained(path)
            make_tokenizer().save_pretrained(path)
            cfg = load_config(None, [f"model.name={path}", "model.dtype=bfloat16"])
            built[(hidden, inter, vocab)] = (load_policy(cfg.model, torch.device("cpu"))[0], path)
        model, path = built[(hidden, inter, vocab)]
        base = [f"model.name={path}", "model.dtype=bfloat16", "data.eval_size=0"]
        cfg = load_config(None, [*base, "train.prompts_per_step=1", *overrides])
        return model, cfg, sizes.load_model_shape(str(path), cfg.model)

    return get


def _transient(parts):
    """Components allocated during the phase (the tracker does not see persistent state)."""
    skip = ("base weights", "LoRA weights", "optimizer state", "rollout tensors")
    return sum(v for k, v in parts.items() if not k.startswith(skip))


SHAPES = [(256, 768, 54), (64, 192, 8000)]  # layer-bound, and head/logits-bound (large vocab)


@pytest.mark.parametrize("hidden, inter, vocab", SHAPES)
def test_training_activations_track_live_tensors(policy, hidden, inter, vocab):
    from ibpo.logprobs import completion_logprobs

    N, P, T, chunk = 8, 16, 48, sizes.CHUNK_TOKENS
    model, cfg, shape = policy(
        hidden,
        inter,
        vocab,
        [
            f"rollout.group_size={N}",
            f"data.max_prompt_tokens={P}",
            f"rollout.max_new_tokens={T}",
        ],
    )
    model.train()  # gradient checkpointing acts in train mode only, as in the trainer
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, 54, (N, P + T))
    att = torch.ones_like(ids)
    att[0, :3] = 0  # left padding: the attention mask is materialised as on a real batch
    with LiveTensorBytes() as mem:
        logp, _ = completion_logprobs(model, ids, att, P, torch.ones(N, T), chunk)
        logp.sum().backward()
    predicted = _transient(phases.phase_bytes(shape, cfg)["training"])
    assert 0.95 <= predicted / mem.peak <= 1.3  # a conservative estimate, but not a loose one


@pytest.mark.parametrize(  # prefill-bound twice, then bound by the last step's sampling logits
    "shape, P, T, decode",
    [(SHAPES[0], 96, 4, False), (SHAPES[1], 96, 4, False), (SHAPES[1], 8, 8, True)],
)
def test_generation_estimate_of_distinct_prompts_tracks_live_tensors(policy, shape, P, T, decode):
    """N distinct prompts in one generate() call (as repairs and evaluation make them): every
    row is prefilled."""
    hidden, inter, vocab = shape
    N = 16
    model, cfg, dims = policy(hidden, inter, vocab, [f"data.max_prompt_tokens={P}"])
    model.eval()
    ids = torch.randint(3, 54, (N, P))
    att = torch.ones_like(ids)
    att[0, :2] = 0
    with torch.no_grad(), LiveTensorBytes() as mem:
        model.generate(
            input_ids=ids,
            attention_mask=att,
            max_new_tokens=T,
            min_new_tokens=T,
            do_sample=True,
            top_k=None,
            eos_token_id=1,
            pad_token_id=0,
        )
    b = phases.dtype_bytes(cfg.model)
    sampling = sizes.sampling_bytes(N, dims.vocab, b, 1.0, sample=True)
    parts = phases._generation(dims, cfg.model, b, N, P, T, sampling)
    assert ("sampling logits" in parts) == decode  # the case the parameters mean to test
    predicted = _transient(parts)
    assert 0.9 <= predicted / mem.peak <= 1.3


@pytest.mark.parametrize("path", ["eager", "graph"])
@pytest.mark.parametrize(  # prefill-bound, then bound by the last step's logits
    "shape, P, T, decode", [(SHAPES[0], 200, 2, False), (SHAPES[1], 8, 8, True)]
)
def test_rollout_estimate_tracks_live_tensors(policy, shape, P, T, decode, path):
    """A rollout's generate() call of whole groups, as the trainer makes it: each group's prompt is
    prefilled once and its cache repeated to the group's rows (generation.prefixes.prefill), so the
    prefill's working set is the prompts', not the rows'; decoded by HF generate (eager) or by
    the decode engine at the planner's bucket (graph: its static cache and the prompt cache it
    copies)."""
    from ibpo.generation import DecodeEngine, generate
    from tests.conftest import make_tokenizer

    hidden, inter, vocab = shape
    G, prompts = 8, 2
    model, cfg, dims = policy(
        hidden,
        inter,
        vocab,
        [
            f"rollout.group_size={G}",
            f"train.prompts_per_step={prompts}",
            f"rollout.generation_batch_size={G * prompts}",
            f"data.max_prompt_tokens={P}",
            f"rollout.max_new_tokens={T}",
            "repair.enabled=false",
            f"rollout.decode={path}",
        ],
    )
    tok = make_tokenizer()
    texts = [("12+34=" * P)[:P], ("9*8-7=" * P)[:P]]
    assert [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts] == [P, P]
    engine = None
    if path == "graph":
        engine = DecodeEngine(model)
        engine.bucket = sizes.DECODE_BUCKET  # the planner's (CUDA's) bucket
    torch.manual_seed(0)
    with torch.no_grad(), LiveTensorBytes() as mem:
        out = generate(model, tok, texts, G, T, G * prompts, engine=engine)
        assert engine is None or engine.calls == 1  # the engine decoded
    assert out.prefill_tokens < G * prompts * P  # the group prefill ran
    parts = phases.phase_bytes(dims, cfg)["generation"]
    logits = "sampling logits" if path == "eager" else "sampling logits (graph pool)"
    assert (logits in parts) == decode  # the case the parameters mean to test
    predicted = _transient(parts)
    assert 0.9 <= predicted / mem.peak <= 1.3


@pytest.mark.parametrize(
    "template",
    [
        None,  # the default: 256 characters besides its placeholders
        "{question}|{attempt}|{reference}",
        "Fix it: {attempt}\nGiven: {reference}\nProblem: {question}\n" + "Be brief. " * 40,
    ],
    ids=["default", "terse", "long"],
)
def test_the_planned_repair_prompt_is_the_one_the_code_sends(template):
    """With a character tokenizer (one token per character: bench/bench_gpu.py's) the planner's
    repair prompt length is exactly that of repair_prompt's rendering, for a problem at
    data.max_prompt_tokens and an attempt and a reference at full length."""
    from bench.bench_gpu import make_tokenizer
    from ibpo.data import Example, render_prompt
    from ibpo.repair import repair_prompt

    tok, T = make_tokenizer(256), 40
    question = "what is 12 + 34 * 5 - 6 ?"
    extra = [f"repair.template={json.dumps(template)}"] if template else []
    cfg = _cfg(f"rollout.max_new_tokens={T}", "objective.name=ibpo", *extra)
    cfg.data.max_prompt_tokens = len(tok(render_prompt(tok, question, cfg.data))["input_ids"])
    attempt, reference = "1" + "2 + 3 = 5" * 4 + "9" * 3, "7" * T
    assert len(attempt) == len(reference) == T
    sent = repair_prompt(tok, Example(question, "164"), attempt, reference, cfg.repair, cfg.data)
    _, planned, new = sizes.repair_generation(cfg)
    assert planned == len(tok(sent)["input_ids"]) and new == T
    # not the 96 tokens once assumed for every template: the template's own text is counted
    body = cfg.repair.template
    for p in ("{question}", "{attempt}", "{reference}"):
        body = body.replace(p, "")
    assert planned - cfg.data.max_prompt_tokens - 2 * T == len(body)


def test_a_non_ascii_repair_template_is_counted_in_bytes():
    """Byte-level BPE tokenizers make at most one token per UTF-8 byte: the planner's bound."""
    assert sizes.repair_template_tokens("{question}é{attempt}{reference}") == 2
    assert sizes.repair_template_tokens("{question}{attempt}{reference}") == 0


def test_more_tokens_and_bigger_batches_need_more_memory():
    base = ["train.prompts_per_step=8", "rollout.max_new_tokens=1024", "data.eval_size=0"]
    for key, small, big, phase in [
        ("rollout.max_new_tokens", 512, 2048, "training"),
        ("rollout.max_new_tokens", 512, 2048, "generation"),
        ("data.max_prompt_tokens", 128, 1024, "training"),
        ("train.micro_batch_groups", 1, 4, "training"),
        ("rollout.generation_batch_size", 8, 64, "generation"),
        ("model.lora_r", 8, 64, "training"),
    ]:
        a = plan.estimate(QWEN3_4B, _cfg(*base, f"{key}={small}"))
        b = plan.estimate(QWEN3_4B, _cfg(*base, f"{key}={big}"))
        assert sum(b.phases[phase].values()) > sum(a.phases[phase].values()), key
        assert b.allocated_gb >= a.allocated_gb, key
    nf4 = plan.estimate(QWEN3_4B, _cfg("model.quantization=nf4")).components
    bf16 = plan.estimate(QWEN3_4B, _cfg("model.quantization=none")).components
    assert bf16["base weights (none)"] > 3 * nf4["base weights (nf4)"]


def test_training_phase_arithmetic_by_hand():
    cfg = _cfg(
        "rollout.group_size=8",
        "rollout.max_new_tokens=1024",
        "data.max_prompt_tokens=512",
        "train.micro_batch_groups=1",
        "model.lora_r=16",
    )
    train = phases.phase_bytes(_shape(QWEN3_8B), cfg)["training"]
    # 36 checkpointed layer inputs [8 x 1536, 4096] bf16 + RoPE + the bool padding mask
    S = 8 * 1536
    assert train["activations: layer inputs"] == 36 * S * 4096 * 2 + 2 * S * 128 * 2 + 8 * 1536**2
    assert train["LoRA grads (fp32)"] == 4 * 36 * 16 * sum(
        a + b for a, b in _shape(QWEN3_8B).linears().values()
    )


def test_suggestions_fit_and_are_the_largest_that_do():
    base = [
        "model.name=unused",
        "rollout.max_new_tokens=2048",
        "train.prompts_per_step=16",
        "rollout.generation_batch_size=128",
        "train.micro_batch_groups=4",
    ]
    p = plan.estimate(QWEN3_4B, load_config(None, base), 1, 24.0)
    assert not p.fits and p.suggestions
    fixed = plan.estimate(QWEN3_4B, load_config(None, [*base, *p.suggestions]), 1, 24.0)
    assert fixed.fits and fixed.peak_gb <= 24.0
    for s in p.suggestions:  # one notch larger on any knob would not fit
        key, value = s.split("=")
        larger = int(value) + 1 if key.endswith("micro_batch_groups") else int(value) * 2
        others = [o for o in p.suggestions if o != s]
        bigger = load_config(None, [*base, *others, f"{key}={larger}"])
        assert not plan.estimate(QWEN3_4B, bigger, 1, 24.0).fits, s


def test_no_suggestion_when_nothing_fits():
    p = plan.estimate(QWEN3_8B, _cfg("rollout.max_new_tokens=32768"), 1, 8.0)
    assert not p.fits and p.suggestions == []
    assert any("no batch setting fits" in n for n in p.notes)


def test_ddp_adds_gradient_buckets_and_splits_evaluation():
    held_out = ("data.eval_size=500", "rollout.generation_batch_size=500")
    one = plan.estimate(QWEN3_1_7B, _cfg(*held_out), 1)
    two = plan.estimate(QWEN3_1_7B, _cfg(*held_out), 2)
    assert "DDP grad buckets" in two.phases["training"]
    assert two.phases["training"]["DDP grad buckets"] == one.phases["training"]["LoRA grads (fp32)"]
    assert sum(two.phases["evaluation"].values()) < sum(one.phases["evaluation"].values())


def test_embedded_default_plans_offline():
    p = plan.estimate(None, load_config(), 1, 24.0)
    assert p.model == "smollm2-135m" and p.fits
    assert p.parameters / 1e6 == pytest.approx(134.5, rel=0.01)


def _write_config(tmp_path, d) -> Path:
    folder = tmp_path / "qwen3-1.7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def test_cli_plan_prints_a_table(tmp_path, capsys):
    folder = _write_config(tmp_path, QWEN3_1_7B)
    recipe = ROOT / "recipes/qwen3_1.7b/gsm8k_ibpo_1gpu.yaml"
    rc = main(
        [
            "plan",
            str(recipe),
            "rollout.max_new_tokens=512",
            "--gpus",
            "2",
            "--gpu-memory-gb",
            "24",
            "--model-config",
            str(folder / "config.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "KV cache" in out and "torch allocations" in out and "on 2 x 24 GiB" in out
    assert main(["plan", f"model.name={folder}"]) == 0  # a model folder as model.name
    assert "1.72B parameters" in capsys.readouterr().out


def test_cli_plan_bad_model_config(tmp_path, capsys):
    assert main(["plan", "--model-config", str(tmp_path / "missing" / "config.json")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    assert main(["plan", "--model-config", str(bad)]) == 2
    assert "not a decoder LM config" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="gpus"):
        plan.estimate(QWEN3_8B, _cfg(), gpus=0)


# --- the table of known architectures -----------------------------------------------------------

# Totals published on the Qwen3 model cards (billions: all parameters, without embeddings); the
# 0.6B total is exact (keras-hub's qwen3_0.6b_en preset lists 596,049,920).
PUBLISHED = {"Qwen/Qwen3-0.6B": (0.6, 0.44), "Qwen/Qwen3-1.7B": (1.7, 1.4),
             "Qwen/Qwen3-4B": (4.0, 3.6), "Qwen/Qwen3-8B": (8.2, 6.95),
             "Qwen/Qwen3-14B": (14.8, 13.2)}  # fmt: skip


def test_known_architectures_match_published_configs_and_totals():
    table = sizes.KNOWN_ARCHITECTURES
    assert set(table) == set(PUBLISHED)
    # the independent transcriptions above (and in bench/bench_gpu.py before it imported this)
    assert table["Qwen/Qwen3-8B"] == QWEN3_8B
    assert table["Qwen/Qwen3-4B"] == QWEN3_4B
    assert table["Qwen/Qwen3-1.7B"] == QWEN3_1_7B
    assert _shape(table["Qwen/Qwen3-0.6B"]).parameter_count() == 596_049_920
    for name, (total, non_embedding) in PUBLISHED.items():
        shape = _shape(table[name])
        embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
        assert shape.parameter_count() / 1e9 == pytest.approx(total, abs=0.05), name
        assert (shape.parameter_count() - embeddings) / 1e9 == pytest.approx(
            non_embedding, abs=0.01 if total < 1 else 0.05
        ), name


def test_known_models_plan_without_the_hub(monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked for a tabulated config")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    p = plan.estimate(None, load_config(None, ["model.name=Qwen/Qwen3-8B"]))
    assert p.model == "Qwen/Qwen3-8B" and p.parameters == _shape(QWEN3_8B).parameter_count()


# --- FSDP -----------------------------------------------------------------------------------------

# decode=eager: under FSDP the trainer decodes with HF generate (the engine does not run on
# sharded weights), and these tests compare sharding, not decoding
FSDP_CFG = ["rollout.max_new_tokens=1024", "train.prompts_per_step=8", "model.lora_r=32",
            "data.eval_size=64", "rollout.decode=eager", "train.optimizer=adamw"]  # fmt: skip


def test_fsdp_on_one_gpu_equals_ddp():
    cfg = _cfg(*FSDP_CFG)
    ddp, fsdp = (plan.estimate(QWEN3_8B, cfg, 1, 24.0, s) for s in ("ddp", "fsdp"))
    assert fsdp.phases == ddp.phases and fsdp.peak_gb == ddp.peak_gb


@pytest.mark.parametrize("gpus", [1, 2])
def test_auto_optimizer_under_fsdp_is_counted_as_torch_adamw(gpus):
    """trainer.build_optimizer takes torch AdamW under FSDP on any number of GPUs (paged 8-bit
    AdamW does not take FSDP's parameters): the plan counts its fp32 moments, also on one GPU."""
    shape = _shape(QWEN3_8B)
    auto = phases.phase_bytes(shape, _cfg(*FSDP_CFG[:-1]), gpus, "fsdp")
    adamw = phases.phase_bytes(shape, _cfg(*FSDP_CFG), gpus, "fsdp")
    ddp = phases.phase_bytes(shape, _cfg(*FSDP_CFG[:-1]), gpus, "ddp")
    assert auto["training"]["optimizer state"] == adamw["training"]["optimizer state"]
    # 8-bit AdamW (DDP's auto) holds about a quarter of fp32 AdamW's moments
    assert ddp["training"]["optimizer state"] * 3 < auto["training"]["optimizer state"] * gpus


@pytest.mark.parametrize("gpus", [2, 4])
def test_fsdp_divides_the_persistent_state_by_gpus(gpus):
    shape, cfg = _shape(QWEN3_8B), _cfg(*FSDP_CFG)
    one = phases.phase_bytes(shape, cfg, 1)
    ddp = phases.phase_bytes(shape, cfg, gpus, "ddp")
    fsdp = phases.phase_bytes(shape, cfg, gpus, "fsdp")
    state = 36 * sum(sizes.nf4_state_bytes(a * b) for a, b in shape.linears().values())
    for phase in fsdp:
        f, d = fsdp[phase], ddp[phase]
        assert f["LoRA weights (fp32)"] == math.ceil(d["LoRA weights (fp32)"] / gpus)
        assert f["optimizer state"] == math.ceil(d["optimizer state"] / gpus)
        assert (
            f["base weights (nf4)"] == math.ceil((d["base weights (nf4)"] - state) / gpus) + state
        )
        # everything per micro-batch or per generate call is what a DDP replica holds
        same = set(d) - {
            "base weights (nf4)",
            "LoRA weights (fp32)",
            "optimizer state",
            "LoRA grads (fp32)",
            "DDP grad buckets",
        }
        assert {k: f[k] for k in same} == {k: d[k] for k in same}
    assert fsdp["training"]["LoRA grads (fp32)"] == math.ceil(
        one["training"]["LoRA grads (fp32)"] / gpus
    )
    assert "DDP grad buckets" not in fsdp["training"]
    # all-gathered: embeddings + untied lm_head + final norm, two whole layers (packed 4-bit)
    layer = sum(math.ceil(a * b / 2) for a, b in shape.linears().values()) + (2 * 4096 + 256) * 2
    layer += 4 * 32 * sum(a + b for a, b in shape.linears().values())  # its LoRA, fp32
    assert fsdp["training"]["FSDP all-gathered parameters"] == (
        2 * 151936 * 4096 * 2 + 4096 * 2 + 2 * layer
    )


def test_fsdp_needs_less_than_ddp_where_layers_dominate():
    """Training: FSDP below DDP for the 8B and 14B. Generation, repairs and evaluation run on a
    whole gathered copy beside the shards: more than a DDP replica."""
    cfg = _cfg(*FSDP_CFG)
    for name in ("Qwen/Qwen3-8B", "Qwen/Qwen3-14B"):
        ddp, fsdp = (plan.estimate(name, cfg, 2, 24.0, s) for s in ("ddp", "fsdp"))
        for phase in ddp.phases:
            total, replica = sum(fsdp.phases[phase].values()), sum(ddp.phases[phase].values())
            if phase == "training":
                assert total < replica, name
                assert "FSDP all-gathered parameters" in fsdp.phases[phase]
            else:
                assert total > replica, (name, phase)
                parts = fsdp.phases[phase]
                assert "FSDP all-gathered parameters" not in parts
                assert parts["FSDP gathered weights (generation)"] > parts["base weights (nf4)"]
    # a small model with a large vocabulary: its gathered embeddings outweigh half of its
    # decoder layers (the module docstring says so)
    cfg = _cfg("data.eval_size=0", "rollout.decode=eager")  # LoRA r 16, 8-bit AdamW: little state
    ddp, fsdp = (plan.estimate("Qwen/Qwen3-0.6B", cfg, 2, 24.0, s) for s in ("ddp", "fsdp"))
    assert sum(fsdp.phases["generation"].values()) > sum(ddp.phases["generation"].values())


def test_cli_plan_fsdp(capsys):
    args = ["plan", "model.name=Qwen/Qwen3-8B", *FSDP_CFG, "--gpus", "2", "--sharding", "fsdp"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "FSDP all-gathered parameters" in out and "on 2 x 24 GiB (FSDP)" in out
    with pytest.raises(SystemExit):
        main(["plan", "--sharding", "zero3"])
    with pytest.raises(ConfigError, match="sharding"):
        plan.estimate(QWEN3_8B, _cfg(), 2, 24.0, "zero3")


def test_offloaded_activations_leave_one_layer_input_on_the_gpu():
    base = plan.estimate("Qwen/Qwen3-8B", _cfg(), 1, 24.0)
    off = plan.estimate("Qwen/Qwen3-8B", _cfg("model.offload_activations=true"), 1, 24.0)
    a, b = base.phases["training"], off.phases["training"]
    shape = sizes.KNOWN_ARCHITECTURES["Qwen/Qwen3-8B"]
    inputs_gib = a["activations: layer inputs"] - b["activations: layer inputs"]
    one_gib = inputs_gib / shape["num_hidden_layers"]  # one layer's input comes back in backward
    assert b["activations: layer inputs"] < 0.05 * a["activations: layer inputs"]
    drop = sum(a.values()) - sum(b.values())
    assert abs(drop - (inputs_gib - one_gib)) < 1e-6
    assert any("pinned host memory" in n for n in off.notes)
    assert off.phases["generation"] == base.phases["generation"]


def test_vllm_backend_moves_generation_into_the_engine():
    """rollout.backend=vllm: generation phases hold the policy's state plus the engine's copy of
    the base (same NF4 bytes), a LoRA slot at vLLM's rank, the KV budget of one batch at full
    length, and a prefill-chunk workspace; training is unchanged while the engine sleeps."""
    hf = plan.estimate("Qwen/Qwen3-8B", _cfg(), 1, 24.0).phases
    v = plan.estimate("Qwen/Qwen3-8B", _cfg("rollout.backend=vllm"), 1, 24.0).phases
    gen = v["generation"]
    assert gen["vLLM base weights (nf4)"] == gen["base weights (nf4)"]
    assert "KV cache" not in gen and "sampling logits" not in gen
    cfg = _cfg()
    shape = sizes.ModelShape.from_dict(sizes.KNOWN_ARCHITECTURES["Qwen/Qwen3-8B"])
    batch = min(cfg.rollout.generation_batch_size, cfg.train.prompts_per_step * 8)
    kv = sizes.kv_cache_bytes(shape, batch, cfg.data.max_prompt_tokens + 1024, 2)
    cfg = _cfg("rollout.max_new_tokens=1024")
    assert sizes.vllm_budget(shape, cfg, 2)[1] == kv  # already whole 256-token blocks
    slot = sizes.lora_parameter_count(shape, 16, "all-linear") * 2  # r=16 -> a rank-16 slot
    assert math.isclose(gen["vLLM LoRA slot"], slot / 2**30)
    process = "vLLM CUDA graphs, buffers (estimate)"
    assert v["training"] == {**hf["training"], process: gen[process]}
    notes = plan.estimate("Qwen/Qwen3-8B", _cfg("rollout.backend=vllm"), 1, 24.0).notes
    assert any("estimate, not measured" in n for n in notes)


def test_fsdp_training_counts_the_checkpointed_log_prob_head(monkeypatch):
    """Under FSDP the live lm_head carries FSDP2's hooks and a DTensor weight, so the update takes
    the checkpointed log-prob head (five fp32 [chunk, V] copies in backward), not the fused one
    (test below): at 4096-token chunks of Qwen3's vocabulary that is ~10 GiB more. One GPU under
    FSDP2 too: Accelerate wraps a one-process run the same way."""
    shape = _shape(QWEN3_8B)  # one group per micro-batch (as the FSDP recipe): the head dominates
    monkeypatch.setattr(phases, "CHUNK_TOKENS", 4096)  # chunks of 4096 tokens: the head dominates
    cfg = _cfg(*FSDP_CFG, "train.micro_batch_groups=1")
    checkpointed = sizes.HEAD_CHUNK_BYTES_CHECKPOINTED * 4096 * 151936
    for gpus in (1, 2):
        train = phases.phase_bytes(shape, cfg, gpus, "fsdp")["training"]
        assert train.get("activations: log-prob head chunk", 0) >= checkpointed, gpus
    ddp, fsdp = (
        sum(phases.phase_bytes(shape, cfg, 1, s)["training"].values()) for s in ("ddp", "fsdp")
    )
    # on one GPU nothing else differs: the checkpointed head (12.5 GiB) replaces one layer's
    # backward (4.5 GiB), which the fused head (2.9 GiB) stayed under
    assert fsdp - ddp > 7.5 * 2**30


def test_the_live_fsdp_head_is_the_checkpointed_one_the_planner_counts(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Two CPU processes (gloo) wrap the tiny policy with Accelerate's FSDP2 as the FSDP recipe's
    Accelerate config does (tests/dist_head_worker.py): the live lm_head fails
    fused_head_supported and a training forward of the log-prob path takes the checkpointed
    head, which is what the planner counts for sharding=fsdp. Without FSDP both say fused."""
    import tests.test_distributed as dist
    from ibpo.logprobs import fused_head_supported
    from tests.conftest import make_tiny_qwen3

    monkeypatch.setattr(dist, "WORKER", ROOT / "tests" / "dist_head_worker.py")
    dist._torchrun([tiny_model_dir, str(tmp_path)], tmp_path, fsdp=True)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"head-rank{rank}.json").read_text())
        assert found["fsdp"] and found["called"] == ["checkpointed_head_logprobs"], found
        assert not found["fused_before"] and not found["fused_after"], found
    model = load_config(None, [f"model.name={tiny_model_dir}"]).model
    assert not phases.fused_head(model, "fsdp")
    assert phases.fused_head(model, "ddp") and fused_head_supported(make_tiny_qwen3(54).lm_head)
