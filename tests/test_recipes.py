from pathlib import Path

import pytest
import yaml

from ibpo.config import load_config

RECIPES = sorted(Path(__file__).resolve().parents[1].glob("recipes/*/*.yaml"))
MODEL_RECIPES = [p for p in RECIPES if p.parent.name != "accelerate"]


@pytest.mark.parametrize("path", MODEL_RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_loads_and_documents_its_launch(path):
    cfg = load_config(path)
    head = path.read_text().splitlines()[:8]
    assert head[0].startswith("# Purpose:")
    assert any("Launch:" in line for line in head) and any("Hardware:" in line for line in head)
    assert cfg.train.steps > 0


def test_accelerate_configs_parse():
    configs = [p for p in RECIPES if p.parent.name == "accelerate"]
    assert configs
    for p in configs:
        assert "distributed_type" in yaml.safe_load(p.read_text())


def test_embedded_recipe_equals_the_default_config():
    recipe = load_config(
        Path(__file__).resolve().parents[1] / "recipes/smollm2_135m/arithmetic_ibpo_cpu.yaml"
    )
    default = load_config()
    recipe.train.output_dir = default.train.output_dir
    assert recipe == default
