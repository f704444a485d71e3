import pytest

from ibpo.cli import main
from ibpo.config import ConfigError, load_config, parse_override


def test_defaults_are_the_embedded_demo():
    cfg = load_config()
    assert cfg.model.name == "smollm2-135m" and cfg.model.quantization == "nf4"
    assert cfg.objective.name == "ibpo" and cfg.data.dataset.startswith("builtin:")


def test_recipe_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 3\n  learning_rate: 1\nobjective:\n  name: grpo\n")
    cfg = load_config(
        recipe,
        ["train.steps=5", "objective.kl_coef=0.04", "model.lora_target_modules=[q_proj, v_proj]"],
    )
    assert cfg.train.steps == 5
    assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)
    assert cfg.objective.name == "grpo" and cfg.objective.kl_coef == 0.04
    assert cfg.model.lora_target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown key 'train.stepz'.*steps"),
        ("trian.steps=3", "unknown section 'trian'.*train"),
        ("train.steps=three", "train.steps: expected int"),
        ("model.gradient_checkpointing=1", "expected true/false"),
        ("objective.name=ppo", "choose one of: ibpo, dfpo, grpo, dr_grpo, dapo, gspo"),
        ("model.quantization=int8", "choose one of: nf4, none"),
        ("rollout.group_size=1", "group_size must be >= 2"),
        ("objective.weights=min_replace", None),  # valid for ibpo: no error
        ("data.prompt_template=hello", "must contain '{question}'"),
        ("steps=3", "section.key"),
    ],
)
def test_config_errors_name_the_key(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_unknown_key_in_recipe(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  nmae: x\n")
    with pytest.raises(ConfigError, match="bad.yaml.*unknown key 'model.nmae'"):
        load_config(recipe)


def test_parse_override_yaml_scalars():
    assert parse_override("a.b=null") == ("a", "b", None)
    assert parse_override("a.b=[1, 2]") == ("a", "b", [1, 2])
    assert load_config(None, ["train.learning_rate=1e-4"]).train.learning_rate == 1e-4


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["train", "train.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'train.nope'" in err and "Traceback" not in err
    assert main(["config", "objective.name=gspo"]) == 0
    assert "name: gspo" in capsys.readouterr().out
