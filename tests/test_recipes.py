"""Recipes: each loads, opens with its header (purpose, hardware, plan, launch, baseline), fits
the hardware it states by `ibpo plan` (the header's `# Plan:` command, run through the CLI, and
the peak line it quotes), and launches with an existing Accelerate config that matches it."""

import contextlib
import io
import shlex
from pathlib import Path

import pytest
import yaml

from ibpo.cli import main
from ibpo.plan import fit as plan
from ibpo.recipe import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(ROOT.glob("recipes/*/*.yaml"))
ACCELERATE = [p for p in RECIPES if p.parent.name == "accelerate"]
MODEL_RECIPES = [p for p in RECIPES if p.parent.name != "accelerate"]
KEYS = ("Purpose", "Hardware", "Launch", "Baseline")
NUMBERS = {1: "one", 2: "two"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _header(path: Path) -> tuple[list[str], dict[str, str]]:
    """(the leading comment lines, 'Key' -> the text after '# Key:' for each header key)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    keys = {}
    for line in lines:
        key, sep, rest = line[1:].partition(":")
        if sep and key.strip() in (*KEYS, "Plan") and key.strip() not in keys:
            keys[key.strip()] = rest.strip()
    return lines, keys


def _is_gpu(path: Path) -> bool:
    return not _header(path)[1]["Hardware"].startswith("CPU")


GPU_RECIPES = [p for p in MODEL_RECIPES if _is_gpu(p)]


def _plan_command(path: Path) -> list[str]:
    cmd = shlex.split(_header(path)[1]["Plan"])
    assert cmd[:3] == ["ibpo", "plan", _rel(path)], cmd
    return cmd


def _option(cmd: list[str], name: str, default: str) -> str:
    return cmd[cmd.index(name) + 1] if name in cmd else default


@pytest.mark.parametrize("path", MODEL_RECIPES, ids=_rel)
def test_recipe_loads_with_its_header(path):
    cfg = load_config(path)
    lines, keys = _header(path)
    assert lines[0].startswith("# Purpose:")
    assert set(KEYS) <= set(keys), f"{_rel(path)} lacks {set(KEYS) - set(keys)}"
    assert cfg.train.steps > 0
    # the baseline is one override away
    assert "objective.name=grpo" in keys["Baseline"]
    assert load_config(path, ["objective.name=grpo"]).objective.name == "grpo"
    # the prompt renders (a template's own braces, e.g. \\boxed{}, stay as they are)
    from ibpo.data import user_message

    rendered = user_message("What is 6 x 7?", cfg.data)
    assert "What is 6 x 7?" in rendered and "{question}" not in rendered


@pytest.mark.parametrize("path", GPU_RECIPES, ids=_rel)
def test_recipe_fits_the_hardware_it_states(path, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):  # recipes of known models plan offline
        raise AssertionError("ibpo plan asked the Hub for a model config")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.chdir(ROOT)  # the header's command is run from the repository root
    lines, keys = _header(path)
    cmd = _plan_command(path)
    gpus, memory = int(_option(cmd, "--gpus", "1")), float(_option(cmd, "--gpu-memory-gb", "24"))
    sharding = _option(cmd, "--sharding", "ddp")
    hardware = keys["Hardware"].lower()
    assert f"{NUMBERS[gpus]} {memory:g} gb gpu" in hardware
    assert gpus == 1 or sharding in hardware
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(cmd[1:]) == 0
    peak = next(line for line in out.getvalue().splitlines() if line.startswith("peak:"))
    assert f"fits on {gpus} x {memory:g} GiB" in peak and "NOT" not in peak, peak
    quoted = lines[lines.index(next(x for x in lines if x.startswith("# Plan:"))) + 1]
    assert quoted == "#   " + peak, f"update the header of {_rel(path)}: '#   {peak}'"


@pytest.mark.parametrize("path", MODEL_RECIPES, ids=_rel)
def test_launch_command_uses_an_existing_matching_accelerate_config(path):
    lines, keys = _header(path)
    assert shlex.split(keys["Launch"])[-1] == _rel(path)
    commands = [
        shlex.split(x[x.index("accelerate launch") :]) for x in lines if "accelerate launch" in x
    ]
    assert commands or not _is_gpu(path)
    for cmd in commands:
        assert cmd[-1] == _rel(path) and "recipes/train.py" in cmd
        assert (ROOT / "recipes/train.py").is_file()
        config = ROOT / cmd[cmd.index("--config_file") + 1]
        assert config.parent == ROOT / "recipes/accelerate" and config.is_file(), config
        acc = yaml.safe_load(config.read_text())
        if not _is_gpu(path):
            assert acc["use_cpu"] is True
            continue
        plan_cmd = _plan_command(path)
        gpus = int(_option(plan_cmd, "--gpus", "1"))
        fsdp = _option(plan_cmd, "--sharding", "ddp") == "fsdp"
        assert acc["num_processes"] == gpus and acc["num_machines"] == 1
        assert acc["distributed_type"] == ("FSDP" if fsdp else "MULTI_GPU" if gpus > 1 else "NO")


def test_accelerate_configs_parse():
    from accelerate.commands.config.config_args import load_config_from_file

    names = {p.name for p in ACCELERATE}
    assert {"cpu.yaml", "single_gpu.yaml", "ddp_2gpu.yaml", "fsdp_qlora_2gpu.yaml"} <= names
    assert any(yaml.safe_load(p.read_text())["num_machines"] > 1 for p in ACCELERATE)
    for p in ACCELERATE:
        c = load_config_from_file(str(p))  # Accelerate's own reader
        assert c.num_processes >= c.num_machines >= 1, p.name
        if c.num_machines > 1:
            assert c.main_process_ip and c.main_process_port and c.machine_rank == 0, p.name
        if c.distributed_type == "FSDP":
            fc = c.fsdp_config  # what FSDP-QLoRA needs (see the file's comments)
            assert fc["fsdp_version"] == 2 and fc["fsdp_reshard_after_forward"] is True
            assert not fc["fsdp_cpu_ram_efficient_loading"] and not fc["fsdp_offload_params"]
            assert fc["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3DecoderLayer"


def test_fsdp_recipe_claims_14b_fits_only_with_fsdp():
    path = ROOT / "recipes/qwen3_8b/math_ibpo_2gpu_fsdp.yaml"
    overrides = [
        "model.name=Qwen/Qwen3-14B",
        "rollout.generation_batch_size=8",
        "repair.batch_size=4",
    ]
    cfg = load_config(path, overrides)
    fsdp = plan.estimate(None, cfg, 2, 24.0, "fsdp")
    ddp = plan.estimate(None, cfg, 2, 24.0, "ddp")
    offload = load_config(path, [*overrides, "model.offload_activations=true"])
    offloaded = plan.estimate(None, offload, 2, 24.0, "ddp")
    assert fsdp.fits and not ddp.fits and offloaded.fits
    text = " ".join(line.lstrip("# ") for line in _header(path)[0])
    assert " ".join(overrides) in text
    assert (
        f"the planner gives {fsdp.peak_gb:.1f} GiB per GPU under FSDP and "
        f"{ddp.peak_gb:.1f} GiB under DDP"
    ) in text
    assert f"DDP would, at {offloaded.peak_gb:.1f} GiB" in text


def test_fsdp_recipe_is_the_ddp_recipe_with_another_optimizer():
    """As its header says: FSDP lowers the training peak of the 8B, not the generation one."""
    ddp = load_config(ROOT / "recipes/qwen3_8b/math_ibpo_2gpu_ddp.yaml")
    fsdp = load_config(ROOT / "recipes/qwen3_8b/math_ibpo_2gpu_fsdp.yaml")
    assert fsdp.train.optimizer == "adamw" != ddp.train.optimizer
    a = plan.estimate(None, ddp, 2, 24.0, "ddp").phases
    b = plan.estimate(None, fsdp, 2, 24.0, "fsdp").phases
    assert sum(b["training"].values()) < sum(a["training"].values())
    assert sum(b["generation"].values()) > sum(a["generation"].values())
    fsdp.train.optimizer, fsdp.run.output_dir = ddp.train.optimizer, ddp.run.output_dir
    assert fsdp == ddp


def test_embedded_recipe_equals_the_default_config():
    recipe = load_config(ROOT / "recipes/smollm2_135m/arithmetic_ibpo_cpu.yaml")
    default = load_config()
    recipe.run.output_dir = default.run.output_dir
    assert recipe == default
