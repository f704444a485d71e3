"""What None inherits (recipe.resolve: config.inherit and the objective's registration), that
config.py imports nothing from ibpo, and that each registration is one the recipe can set."""

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ibpo import config, recipe
from ibpo.algo.objectives import AGGREGATIONS, OBJECTIVES, SHIPPED, step_normaliser
from ibpo.cli import main
from ibpo.config import Config, ConfigError, ObjectiveConfig
from ibpo.recipe import load_config, resolve

ROOT = Path(__file__).resolve().parents[1]


# --- no import cycle -----------------------------------------------------------------------------


def test_config_imports_nothing_from_ibpo():
    tree = ast.parse((ROOT / "ibpo/config.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("ibpo"), node.module
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("ibpo") for a in node.names)
    code = "import sys, ibpo.config; print(sorted(m for m in sys.modules if m.startswith('ibpo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['ibpo', 'ibpo.config']"
    assert not (ROOT / "ibpo/config_checks.py").exists()


# --- the registrations, as a recipe reads them ----------------------------------------------------


def test_each_registration_is_settable_from_a_recipe():
    """Every keyword argument a shipped surrogate takes that the objective section can set has a
    default in the registration (so the recipe's value reaches the loss), and every aggregation
    the registry accepts is one the step normaliser computes."""
    for name in SHIPPED:
        spec = OBJECTIVES[name]
        params = inspect.signature(spec.surrogate).parameters
        settable = {k for k in recipe.SURROGATE_PARAMETERS if k in params}
        assert set(spec.kwargs) == settable, name
        assert recipe.objective_spec(name) is spec  # its defaults pass the fields' rules
    for aggregation in AGGREGATIONS:
        step_normaliser(aggregation, [3, 4], 8)
    with pytest.raises(ValueError):
        step_normaliser("sum", [3, 4], 8)
    assert tuple(n for n in SHIPPED if OBJECTIVES[n].repairs) == ("ibpo",)


def test_moved_names_are_importable_from_their_old_homes():
    from ibpo import sizes
    from ibpo.hub.card import HubError
    from ibpo.hub.push import check_repo_id

    assert sizes.VLLM_BATCHED_TOKENS == config.VLLM_BATCHED_TOKENS == 8192
    assert check_repo_id("alice/run") == "alice/run"
    with pytest.raises(HubError, match="Fix: --repo-id"):
        check_repo_id("a--b/c")
    with pytest.raises(ConfigError, match="Fix: --repo-id"):
        config.check_repo_id("noslash")


# --- resolve --------------------------------------------------------------------------------------


def _inherit_fields(cfg: Config):
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            if f.metadata.get("inherit"):
                yield obj, f


def test_resolve_fills_every_inherit_field():
    cfg = load_config(
        None,
        [
            "rollout.max_new_tokens=40",
            "rollout.temperature=0.7",
            "rollout.generation_batch_size=32",
            "data.question_column=q",
            "data.answer_column=a",
            "data.answer_format=gsm8k",
        ],
    )
    rep, data = cfg.repair, cfg.data
    assert (rep.max_new_tokens, rep.temperature, rep.batch_size) == (40, 0.7, 32)
    assert (data.eval_question_column, data.eval_answer_column) == ("q", "a")
    assert data.eval_answer_format == "gsm8k" and rep.enabled is True
    assert all(getattr(obj, f.name) is not None for obj, f in _inherit_fields(cfg))
    # "the same source" is not a copy: left as it is
    assert data.eval_dataset is None and data.eval_subset is None
    own = load_config(
        None, ["repair.max_new_tokens=7", "data.eval_answer_format=boxed", "repair.enabled=false"]
    )
    assert own.repair.max_new_tokens == 7 and own.data.eval_answer_format == "boxed"
    assert own.repair.enabled is False


@pytest.mark.parametrize("name", SHIPPED)
def test_resolve_fills_the_objective_defaults(name):
    from ibpo.recipe import resolve_params

    cfg = load_config(None, [f"objective.name={name}"])
    obj, defaults = cfg.objective, recipe.defaults(OBJECTIVES[name])
    for key, value in defaults.items():
        assert getattr(obj, key) == value, key
    for key in recipe.SURROGATE_PARAMETERS:  # one it does not take stays null
        assert (getattr(obj, key) is None) == (key not in defaults)
    assert cfg.repair.enabled is OBJECTIVES[name].repairs
    # the unresolved section resolves to the same parameters
    assert resolve_params(cfg.objective) == resolve_params(ObjectiveConfig(name=name))


def test_resolve_is_idempotent_and_a_written_config_loads_back_to_itself(tmp_path):
    for overrides in (
        [],
        ["objective.name=dapo", "objective.eps_high=0.3"],
        ["objective.name=grpo", "repair.enabled=true", "rollout.top_p=0.9"],
    ):
        cfg = load_config(None, overrides)
        assert resolve(cfg) == cfg and resolve(cfg) is not cfg
        path = tmp_path / "config.yaml"  # what the trainer writes to output_dir
        path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        assert load_config(path) == cfg
        assert recipe.from_dict(yaml.safe_load(path.read_text())) == cfg


def test_a_config_written_with_nulls_by_an_older_version_loads():
    old = Config().to_dict()  # unresolved: every inherit field null, as older versions wrote it
    assert old["repair"]["max_new_tokens"] is None and old["objective"]["eps_low"] is None
    assert recipe.from_dict(old) == load_config()


def test_a_resolved_config_keeps_its_objective_parameters_under_another_objective():
    """A resolved config.yaml pins the parameters of its objective: reused as a recipe for
    another objective, one that objective does not take is an error naming the fix."""
    cfg = load_config()
    tree = cfg.to_dict()
    tree["objective"]["name"] = "grpo"
    with pytest.raises(ConfigError, match=r"objective\.weights does not apply to 'grpo'.*=null"):
        recipe.from_dict(tree)


def test_ibpo_config_prints_the_resolved_config(capsys):
    assert main(["config", "objective.name=dapo", "rollout.max_new_tokens=30"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (
        printed == load_config(None, ["objective.name=dapo", "rollout.max_new_tokens=30"]).to_dict()
    )
    assert printed["objective"]["overlong_buffer"] == 0.2 and printed["repair"]["enabled"] is False
    assert printed["repair"]["max_new_tokens"] == 30


def test_a_runs_config_yaml_is_its_recipe_and_inherits_afresh(tmp_path):
    """The trainer writes the recipe form (to_dict(recipe=True)): what resolve filled in is null
    again, so the file rerun with another objective or a shorter rollout inherits anew."""
    cfg = load_config(None, ["rollout.max_new_tokens=40", "repair.temperature=0.5"])
    assert cfg.repair.max_new_tokens == 40 and "repair.max_new_tokens" in cfg.inherited
    assert "repair.temperature" not in cfg.inherited  # set by the user: kept
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(recipe=True), sort_keys=False))
    assert load_config(path) == cfg
    rerun = load_config(path, ["objective.name=grpo", "rollout.max_new_tokens=20"])
    assert rerun.repair.max_new_tokens == 20 and rerun.repair.temperature == 0.5
    assert rerun.objective.weights is None and rerun.repair.enabled is False
    assert rerun.objective.eps_high == OBJECTIVES["grpo"].kwargs["eps_high"]


def test_resume_compares_resolved_settings(tmp_path):
    """A checkpoint's recipe-form config.json (and one an older version wrote, all nulls)
    against the resumed run's resolved config: only real changes are named."""
    import json

    from ibpo.run.outdir import resume_changes

    cfg = load_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict(recipe=True)))
    assert resume_changes(tmp_path, cfg) == []
    (tmp_path / "config.json").write_text(json.dumps(Config().to_dict()))
    assert resume_changes(tmp_path, cfg) == []
    changed = resume_changes(tmp_path, load_config(None, ["objective.eps_low=0.1"]))
    assert changed == ["objective.eps_low: 0.2 -> 0.1"]


# --- configs saved before the run section ----------------------------------------------------


def _train_layout(tree: dict) -> dict:
    """`tree` as versions before the run section wrote it: the run keys under train."""
    tree = {section: dict(values) for section, values in tree.items()}
    tree["train"].update(tree.pop("run"))
    return tree


def test_a_saved_config_with_the_run_keys_under_train_is_migrated(tmp_path):
    run = [
        "run.output_dir=out/x",
        "run.resume_from=latest",
        "run.plots=false",
        "run.push_to_hub=true",
        "run.hub_repo_id=alice/x",
    ]
    cfg = load_config(None, [*run, "train.steps=3"])
    for tree in (cfg.to_dict(), cfg.to_dict(recipe=True)):
        old = _train_layout(tree)
        assert "output_dir" in old["train"] and "run" not in old
        assert recipe.from_dict(old) == cfg  # silently: config.yaml / config.json of an old run
        assert "run" not in old and "output_dir" in old["train"]  # the input is left as it was
    # a recipe or an override with the old names is an error naming the new ones, not migrated
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_train_layout(cfg.to_dict(recipe=True)), sort_keys=False))
    with pytest.raises(ConfigError, match=r"'train\.output_dir' was renamed to 'run\.output_dir'"):
        load_config(path)
    # both names at once: which one was meant is not guessed
    both = cfg.to_dict()
    both["train"]["output_dir"] = "elsewhere"
    with pytest.raises(ConfigError, match=r"'train\.output_dir' was renamed to 'run\.output_dir'"):
        recipe.from_dict(both)


def test_an_older_checkpoint_with_the_run_keys_under_train_still_resumes(tmp_path):
    """A checkpoint's config.json written before the run section: resuming compares it as it
    was meant (no spurious changes), and names a real one."""
    import json

    from ibpo.run.outdir import resume_changes

    cfg = load_config(None, ["run.output_dir=out/x"])
    saved = _train_layout(load_config(None, ["run.output_dir=out/y"]).to_dict(recipe=True))
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert resume_changes(tmp_path, cfg) == []  # output_dir: a run setting, free to change
    changed = resume_changes(tmp_path, load_config(None, ["train.seed=1", "run.save_every=1"]))
    assert changed == ["train.seed: 0 -> 1"]


@pytest.mark.parametrize("name", SHIPPED)
def test_dynamic_sampling_is_dapos_default_and_any_objective_may_set_it(name, tmp_path):
    cfg = load_config(None, [f"objective.name={name}"])
    assert cfg.rollout.dynamic_sampling is (name == "dapo")
    assert "rollout.dynamic_sampling" in cfg.inherited  # the recipe form leaves it to the objective
    for value in (False, True):
        own = load_config(None, [f"objective.name={name}", f"rollout.dynamic_sampling={value}"])
        assert own.rollout.dynamic_sampling is value
        assert "rollout.dynamic_sampling" not in own.inherited
    # a dapo run's config.yaml, rerun as another objective, takes that objective's default
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(load_config(None, ["objective.name=dapo"]).to_dict(recipe=True)))
    rerun = load_config(path, [f"objective.name={name}"])
    assert rerun.rollout.dynamic_sampling is (name == "dapo")
