"""What None inherits (recipe.resolve: recipe.inherit and the objective's registration), that
config.py imports nothing from ibpo, and that each registration is one the recipe can set."""

import ast
import copy
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
    """Every keyword argument a shipped surrogate takes besides the step's is a param the
    registration declares (so the recipe's value reaches the loss), each param's default passes
    its own rule, and every aggregation the registry accepts is one the step normaliser
    computes."""
    step = {"logp", "old_logp", "adv", "mask", "seq_adv", "group_size", "rho"}
    for name in SHIPPED:
        spec = OBJECTIVES[name]
        params = inspect.signature(spec.surrogate).parameters
        assert set(spec.params) == set(params) - step, name
        for key, p in spec.params.items():
            assert p.take(key, p.default) == p.default
        assert recipe.objective_spec(name) is spec  # its shared defaults pass the fields' rules
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
            "rollout.generation_batch_size=32",
            "data.question_column=q",
            "data.answer_column=a",
            "data.answer_format=gsm8k",
            "data.subset=main",
        ],
    )
    rep, ev = cfg.repair, cfg.data.eval
    assert rep.batch_size == 32 and rep.enabled is True
    assert (ev["question_column"], ev["answer_column"], ev["answer_format"]) == ("q", "a", "gsm8k")
    assert ev["subset"] == "main"  # the training source: its configuration
    assert all(getattr(obj, f.name) is not None for obj, f in _inherit_fields(cfg))
    # "the same source" is not a copy: left as it is
    assert ev["dataset"] is None
    own = load_config(
        None, ["repair.batch_size=7", "data.eval.answer_format=boxed", "repair.enabled=false"]
    )
    assert own.repair.batch_size == 7 and own.data.eval["answer_format"] == "boxed"
    assert own.repair.enabled is False


# what a None may still mean after loading: not "inherit", something of its own
_NONE_OF_ITS_OWN = {
    "model.revision", "data.subset", "data.system_prompt", "data.enable_thinking",
    "data.prompt_template", "rollout.mismatch_stop_kl", "reward.weights",
    "reward.timeout", "run.resume_from", "run.log_with", "run.hub_repo_id",
}  # fmt: skip


@pytest.mark.parametrize("name", SHIPPED)
def test_no_inherited_value_is_none_after_loading(name):
    """Every None-means-inherit value holds what it inherits once the recipe has loaded (so no
    reader derives it again): the declared ones (an objective's parameters, repair.enabled,
    rollout.dynamic_sampling), the `inherit=` fields and data.eval's items; objective.params
    holds every param the objective declares, and no other."""
    cfg = load_config(None, [f"objective.name={name}", "data.dataset=tests/fixtures/x.jsonl"])
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            key, value = f"{section.name}.{f.name}", getattr(getattr(cfg, section.name), f.name)
            if key not in _NONE_OF_ITS_OWN:
                assert value is not None, key
    params = cfg.objective.params
    assert list(params) == list(OBJECTIVES[name].params)
    assert all(v is not None for v in params.values())
    ev = cfg.data.eval
    assert all(ev[k] is not None for k in ("split", "question_column", "answer_column"))
    assert ev["answer_format"] is not None
    assert load_config().data.prompt_template is not None  # a built-in task's prompt


@pytest.mark.parametrize("name", SHIPPED)
def test_resolve_fills_the_objective_defaults(name):
    from ibpo.recipe import resolve_params

    cfg = load_config(None, [f"objective.name={name}"])
    spec = OBJECTIVES[name]
    obj, defaults = cfg.objective, recipe.defaults(spec)
    for key, value in defaults.items():
        assert getattr(obj, key) == value, key
    assert obj.params == {key: p.default for key, p in spec.params.items()}
    assert cfg.repair.enabled is OBJECTIVES[name].repairs
    # the unresolved section resolves to the same parameters
    assert resolve_params(cfg.objective) == resolve_params(ObjectiveConfig(name=name))


def test_resolve_is_idempotent_and_a_written_config_loads_back_to_itself(tmp_path):
    for overrides in (
        [],
        ["objective.name=dapo", "objective.params.eps_high=0.3"],
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
    assert old["repair"]["batch_size"] is None and old["objective"]["params"] == {}
    assert recipe.from_dict(old) == load_config()


def test_a_resolved_config_keeps_its_objective_parameters_under_another_objective():
    """A resolved config.yaml pins the parameters of its objective: reused as a recipe for
    another objective, one that objective does not take is an error naming the fix."""
    cfg = load_config()
    tree = cfg.to_dict()
    tree["objective"]["name"] = "grpo"
    with pytest.raises(ConfigError, match=r"objective\.params\.weights is not a parameter of "):
        recipe.from_dict(tree)


def test_ibpo_config_prints_the_resolved_config(capsys):
    assert main(["config", "objective.name=dapo", "rollout.max_new_tokens=30"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (
        printed == load_config(None, ["objective.name=dapo", "rollout.max_new_tokens=30"]).to_dict()
    )
    assert printed["objective"]["overlong_buffer"] == 0.2 and printed["repair"]["enabled"] is False
    assert printed["repair"]["batch_size"] == 64
    assert printed["data"]["eval"]["question_column"] == "question"


def test_a_runs_config_yaml_is_its_recipe_and_inherits_afresh(tmp_path):
    """The trainer writes the recipe form (to_dict(recipe=True)): what resolve filled in is null
    again, so the file rerun with another objective or other settings inherits anew."""
    cfg = load_config(None, ["rollout.generation_batch_size=40", "data.eval.answer_format=plain"])
    assert cfg.repair.batch_size == 40 and "repair.batch_size" in cfg.inherited
    assert "data.eval.question_column" in cfg.inherited
    assert "data.eval.answer_format" not in cfg.inherited  # set by the user: kept
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(recipe=True), sort_keys=False))
    assert load_config(path) == cfg
    rerun = load_config(
        path,
        [
            "objective.name=grpo",
            "rollout.generation_batch_size=20",
            "data.question_column=q",
            "data.answer_format=gsm8k",
        ],
    )
    assert rerun.repair.batch_size == 20 and rerun.data.eval["question_column"] == "q"
    assert rerun.data.eval["answer_format"] == "plain"
    assert "weights" not in rerun.objective.params and rerun.repair.enabled is False
    assert rerun.objective.params["eps_high"] == OBJECTIVES["grpo"].params["eps_high"].default


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
    changed = resume_changes(tmp_path, load_config(None, ["objective.params.eps_low=0.1"]))
    assert changed == ["objective.params.eps_low: 0.2 -> 0.1"]


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


# --- configs saved before keys were removed or folded ----------------------------------------


def test_an_older_saved_config_with_removed_and_folded_keys_loads():
    """A run's config.yaml from before the pruning (resume, `ibpo report`): each removed key is
    dropped, data.eval_* moves into data.eval, and push_to_hub=false keeps a recorded repo id
    from pushing; the result is what the same settings load as today."""
    from ibpo.recipe import REMOVED

    old = load_config(None, ["data.dataset=a/b", "data.subset=main"]).to_dict()
    old["data"].pop("eval")
    old["data"].update(
        eval_dataset=None, eval_split="validation", eval_subset=None,
        eval_question_column="question", eval_answer_column="answer", eval_answer_format=None,
    )  # fmt: skip
    for key in REMOVED:
        section, name = key.split(".")
        old[section][name] = 0  # any value: dropped
    old["run"].update(push_to_hub=False, hub_repo_id="alice/x")
    saved = copy.deepcopy(old)
    cfg = recipe.from_dict(old)
    assert old == saved  # the input is left as it was
    want = load_config(None, ["data.dataset=a/b", "data.subset=main", "data.eval.split=validation"])
    assert cfg.to_dict() == want.to_dict()
    assert cfg.run.hub_repo_id is None  # it did not push then: it does not now
    old["run"]["push_to_hub"] = True
    assert recipe.from_dict(old).run.hub_repo_id == "alice/x"
    # an older train.* layout of a removed run key is dropped too
    older = load_config().to_dict()
    older["train"].update(progress=False, plots=True, keep_checkpoints=3, overwrite=True)
    assert recipe.from_dict(older) == load_config()


def test_an_older_checkpoint_with_removed_keys_resumes_without_spurious_changes(tmp_path):
    import json

    from ibpo.run.outdir import resume_changes

    cfg = load_config()
    saved = cfg.to_dict(recipe=True)
    saved["rollout"].update(eval_batch_size=100, kv_cache="dynamic", top_k=0)
    saved["repair"].update(max_new_tokens=None, temperature=None)
    saved["train"].update(weight_decay=0.0, eval_before=True)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert resume_changes(tmp_path, cfg) == []
