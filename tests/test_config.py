import pytest

from ibpo.cli import main
from ibpo.config import ConfigError
from ibpo.recipe import load_config, parse_override


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
        ("objective.params.weights=min_replace", None),  # valid for ibpo: no error
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
    assert parse_override("a.b=null") == (["a", "b"], None)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("data.eval.split=test") == (["data", "eval", "split"], "test")
    assert load_config(None, ["train.learning_rate=1e-4"]).train.learning_rate == 1e-4


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["train", "train.nope=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'train.nope'" in err and "Traceback" not in err
    assert main(["config", "objective.name=gspo"]) == 0
    assert "name: gspo" in capsys.readouterr().out


# --- rules declared on the fields --------------------------------------------------------------


def _rule_fields():
    """(section, field) for every field that declares a choice or a range."""
    import dataclasses

    from ibpo.config import Config

    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            if "choices" in f.metadata or "low" in f.metadata:
                yield section.name, f


def test_every_declared_rule_rejects_a_value_outside_it():
    """A sweep over the fields' metadata: each choice refuses another word, each range a value
    beyond each of its ends, with a message naming the key."""
    checked = 0
    for section, f in _rule_fields():
        key, meta = f"{section}.{f.name}", f.metadata
        bad = []
        if "choices" in meta:
            bad.append(("'nope'", f"{key}='nope'; choose one of: {', '.join(meta['choices'])}"))
        if "low" in meta:
            bad.append((meta["low"] - 1 if not meta["open_low"] else meta["low"], f"{key} must "))
            if meta["high"] is not None:
                high = meta["high"] if meta["open_high"] else meta["high"] + 1
                bad.append((high, f"{key} must lie in"))
        if "low" in meta and "int" not in str(f.type):
            bad.append((".nan", f"{key} must "))  # NaN satisfies no range
        for value, message in bad:
            with pytest.raises(ConfigError) as e:
                load_config(None, [f"{key}={value}"])
            assert message in str(e.value), (key, value, str(e.value))
            checked += 1
    assert checked > 50


def test_every_registry_backed_choice_rejects_a_name_outside_it():
    """The objective's names that the algorithm's tables give (recipe.CHOICES), checked when the
    recipe resolves: another word is one message naming the key and every choice."""
    from ibpo.recipe import CHOICES

    for key, names in CHOICES.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"objective.{key}=nope"])
        assert f"objective.{key}='nope'; choose one of: {', '.join(names)}" in str(e.value)
        for name in names:  # each choice is accepted (by an objective that takes the key)
            load_config(None, ["objective.name=ibpo", f"objective.{key}={name}"])


def test_fields_that_allow_null_accept_it():
    nullable = [
        "repair.batch_size",
        "repair.enabled",
        "data.eval.answer_format",
        "data.eval.question_column",
        "data.eval.dataset",
        "objective.params.weights",  # an objective's own knob: its default
        "objective.params.gate",
        "objective.params.eps_low",
        "objective.params.eps_high",
        "objective.aggregation",
        "objective.scale_rewards",
        "objective.overlong_buffer",
        "objective.overlong_penalty",
        "rollout.mismatch_stop_kl",
    ]
    load_config(None, [f"{key}=null" for key in nullable])


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.quantization=x", "model.quantization='x'; choose one of: nf4, none"),
        ("rollout.group_size=0", "rollout.group_size must be >= 2"),
        ("rollout.generation_batch_size=0", "rollout.generation_batch_size must be > 0"),
        ("data.eval.answer_format=latex", "data.eval.answer_format='latex'; choose one of: "),
        ("data.eval.answer_format=latex", "code_tests (or null: training's)"),
        ("data.eval={splitt: x}", "data.eval: unknown key 'splitt'; its keys: dataset, subset"),
        ("data.eval=test", "data.eval: expected a mapping (key: value), got 'test'"),
        ("data.eval.split=[a]", "data.eval.split: ['a'] is not a valid"),
        ("repair.batch_size=0", "must be > 0 (or null: rollout.generation_batch_size)"),
        ("repair.rho=1.5", "repair.rho must lie in [0, 1]"),
        ("repair.shaping_lambda=-1", "repair.shaping_lambda must be >= 0"),
        ("repair.template=fix {question} {attempt}", "repair.template must contain '{reference}'"),
        ("objective.overlong_buffer=1", "objective.overlong_buffer must lie in [0, 1)"),
        ("objective.kl_coef=-0.1", "objective.kl_coef must be >= 0"),
        ("objective.params.eps_low=1", "objective.params.eps_low=1.0 must lie in [0, 1)"),
        ("objective.params.eps_high=-1", "objective.params.eps_high=-1.0 must be >= 0"),
        ("objective.params.gate=token", None),  # ibpo takes a gate
        ("objective.params.gate=x", "objective.params.gate='x'; choose one of: none, group, token"),
        ("objective.params.eps_low=wide", "objective.params.eps_low: expected float, got 'wide'"),
        ("objective.params=3", "objective.params: expected a mapping (key: value), got 3"),
        ("run.resume_from=' '", "run.resume_from must be null, 'latest' or a checkpoint path"),
        ("data.max_prompt_tokens=0", "data.max_prompt_tokens must be > 0"),
    ],
)
def test_field_messages(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


# --- checks that span fields, and the new ranges -----------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.answer_format=code_tests"],
            "data.answer_format=code_tests gives test specs, "
            "which reward.functions=math scores 0 for every completion: set reward.functions=code",
        ),
        (["data.eval.answer_format=code_tests"], "data.eval.answer_format=code_tests gives test"),
        (
            ["reward.functions=code", "data.answer_format=gsm8k"],
            "reward.functions=code runs the answer as a JSON test spec, not a gsm8k answer: "
            "set data.answer_format=code_tests",
        ),
        (
            [
                "reward.functions=code",
                "data.answer_format=code_tests",
                "data.eval.answer_format=boxed",
            ],
            "set data.eval.answer_format=code_tests",
        ),
        (["train.learning_rate=0"], "train.learning_rate must be > 0"),
        (["train.learning_rate=-1e-4"], "train.learning_rate must be > 0"),
        (["train.max_grad_norm=0"], "train.max_grad_norm must be > 0 (.inf = no clipping)"),
        (["train.max_grad_norm=-1"], "train.max_grad_norm must be > 0"),
        (["train.warmup_steps=-1"], "train.warmup_steps must be >= 0"),
        (["rollout.top_p=0"], "rollout.top_p must lie in (0, 1]"),
        (["rollout.top_p=1.1"], "rollout.top_p must lie in (0, 1]"),
        (["run.hub_repo_id=a--b/c"], "Fix: run.hub_repo_id="),
        (
            ["objective.name=grpo", "objective.params.weights=min_replace"],
            "objective.params.weights is not a parameter of objective 'grpo' (it takes: "
            "eps_low, eps_high); remove it from objective.params",
        ),
        (["reward.functions=nope"], "reward.functions='nope'; choose one of: math, code"),
        (["rollout.backend=vllm", "rollout.generation_batch_size=9000"], "<= 8192"),
    ],
)
def test_cross_field_and_range_checks(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_values_at_the_edges_are_accepted():
    cfg = load_config(
        None,
        [
            "rollout.top_p=1",
            "rollout.top_p=0.9",
            "train.max_grad_norm=.inf",
            "train.warmup_steps=0",
            "train.learning_rate=1e-8",
            "reward.functions=code",
            "data.answer_format=code_tests",
        ],
    )
    assert cfg.train.max_grad_norm == float("inf")
    assert cfg.data.eval["answer_format"] == "code_tests"
    # the code grader also takes a column that already holds its JSON specs
    assert load_config(None, ["reward.functions=code"]).data.answer_format == "plain"


def test_a_reward_registered_at_run_time_is_accepted(monkeypatch):
    from ibpo.rewards import GRADERS

    monkeypatch.setitem(GRADERS, "parity", lambda text, answer: float(len(text) % 2))
    assert load_config(None, ["reward.functions=parity"]).reward.functions == "parity"
    monkeypatch.delitem(GRADERS, "parity")
    with pytest.raises(ConfigError, match="choose one of: math, code"):
        load_config(None, ["reward.functions=parity"])


def test_the_run_section_holds_what_once_was_train_and_the_old_names_are_renamed():
    """Where and how the job runs (run.*) is apart from what is learned (train.*): every run key
    was a train key once, and RENAMED maps each old name to a key that exists or was removed
    since (REMOVED says what became of it)."""
    import dataclasses

    from ibpo.config import Config, RunConfig, TrainConfig
    from ibpo.recipe import REMOVED, RENAMED

    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not run_keys & train_keys
    assert {f"run.{key}" for key in run_keys} <= set(RENAMED.values())
    assert [f.name for f in dataclasses.fields(Config)][-1] == "run"
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        assert not hasattr(getattr(Config(), old_section), old_key), old
        assert hasattr(getattr(Config(), new_section), new_key) or new in REMOVED, new


@pytest.mark.parametrize("key", ["output_dir", "resume_from", "log_with", "hub_repo_id"])
def test_a_renamed_key_names_its_new_name(tmp_path, key):
    with pytest.raises(ConfigError, match=rf"'train\.{key}' was renamed to 'run\.{key}'; use that"):
        load_config(None, [f"train.{key}=x"])
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"train:\n  steps: 2\n  {key}: x\n")
    with pytest.raises(
        ConfigError, match=rf"old\.yaml: 'train\.{key}' was renamed to 'run\.{key}'; use that"
    ):
        load_config(recipe)
    with pytest.raises(ConfigError, match="unknown key 'train.bar'"):  # others: as before
        load_config(None, ["train.bar=1"])


def test_train_output_dir_names_run_output_dir():
    message = "'train.output_dir' was renamed to 'run.output_dir'; use that"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.output_dir=x"])
    assert str(e.value) == f"override 'train.output_dir=x': {message}"
    assert load_config(None, ["run.output_dir=x"]).run.output_dir == "x"


# --- keys removed or folded: refused in recipes and overrides, naming what replaced them -------


@pytest.mark.parametrize(
    "key, message",
    [
        ("rollout.eval_batch_size", "rollout.generation_batch_size sizes the held-out batches"),
        ("repair.max_new_tokens", "repairs use rollout.max_new_tokens: set that"),
        ("repair.temperature", "repairs use rollout.temperature: set that"),
        ("run.push_to_hub", "set run.hub_repo_id=<user>/<name> to push at the end"),
        ("run.overwrite", "moved to previous-<time>/, never deleted"),
        ("train.eval_before", "whenever data.eval_size > 0 (0 skips both)"),
        ("rollout.top_k", "use rollout.top_p"),
        ("model.trust_remote_code", "models load without remote code"),
        ("train.progress", "the progress bar shows when the output is a terminal"),
    ],
)
def test_a_removed_key_is_refused_naming_what_replaced_it(tmp_path, key, message):
    from ibpo.recipe import REMOVED, RENAMED

    assert RENAMED.get(key, key) in REMOVED
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=1"])
    assert str(e.value).startswith(f"override '{key}=1': '{key}' was removed: ")
    assert message in str(e.value)
    section, name = key.split(".")
    recipe = tmp_path / "old.yaml"
    recipe.write_text(f"{section}:\n  {name}: 1\n")
    with pytest.raises(ConfigError, match=rf"old\.yaml: '{key}' was removed: "):
        load_config(recipe)


def test_every_removed_key_says_what_happens_now():
    """One message per removed key, and none of them still a field."""
    import dataclasses

    from ibpo.config import Config
    from ibpo.recipe import FOLDED, REMOVED

    for key, message in {**REMOVED, **FOLDED}.items():
        section, name = key.split(".")
        assert name not in {f.name for f in dataclasses.fields(getattr(Config(), section))}
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}=x"])
        assert f"'{key}' " in str(e.value) and len(message) > 10


@pytest.mark.parametrize(
    "old, item", [("eval_split", "split"), ("eval_question_column", "question_column")]
)
def test_a_folded_eval_key_names_its_item(tmp_path, old, item):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.{old}=x"])
    assert f"'data.{old}' is now 'data.eval.{item}'; use that" in str(e.value)
    cfg = load_config(None, [f"data.eval.{item}=x"])
    assert cfg.data.eval[item] == "x"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  eval: {{{item}: y}}\n")
    assert load_config(recipe).data.eval[item] == "y"


def test_the_eval_mapping_keeps_the_items_a_recipe_or_override_does_not_name(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  dataset: a/b\n  subset: main\n  eval: {split: validation}\n")
    cfg = load_config(recipe, ["data.eval={answer_column: gold}"])
    ev = cfg.data.eval
    assert ev["split"] == "validation" and ev["answer_column"] == "gold"
    assert ev["question_column"] == "question" and ev["subset"] == "main"  # training's
    assert ev["dataset"] is None  # the training source, not a copy of its name
    other = load_config(recipe, ["data.eval.dataset=c/d"]).data.eval
    assert other["subset"] is None  # another dataset: its own default configuration


# --- the schema's size, and docs/config.md kept to it ------------------------------------------


def _documented() -> tuple[set[str], str]:
    """("section.key" of every row under a section heading of docs/config.md, its whole text)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    keys, section = set(), None
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section and (m := re.match(r"\| `(\w+)` \|", line)):
            keys.add(f"{section}.{m.group(1)}")
    return keys, text


def test_the_schema_holds_at_most_82_keys_each_documented():
    import dataclasses

    from ibpo.config import Config
    from ibpo.recipe import FOLDED, MOVED, REMOVED

    schema = {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(Config)
        for f in dataclasses.fields(s.default_factory())
    }
    assert len(schema) <= 82
    documented, text = _documented()
    assert documented == schema  # every key once under its section, and no key the schema lacks
    for key in {*REMOVED, *FOLDED}:  # the removed keys' table
        section, name = key.split(".")
        assert f"`{key}`" in text or f"`{name}`" in text, key
    for key in MOVED:  # the moved keys' table
        assert f"`{key}`" in text and f"`{MOVED[key]}`" in text, key


# --- keys that moved: read at their new place, with one line naming it -------------------------


def _set(key: str, value: str) -> str:
    """A recipe's YAML setting `key` ("section.key" or "section.key.item") to `value`."""
    section, name, *item = key.split(".")
    inner = f"{{{item[0]}: {value}}}" if item else value
    return f"{section}:\n  {name}: {inner}\n"


MOVED_VALUES = {  # a value each moved key takes that is not its default
    "objective.weights": "adv_orthogonal",
    "objective.gate": "token",
    "objective.eps_low": "0.1",
    "objective.eps_high": "0.3",
    "objective.reward": "code",
    "objective.reward_weights": "[2.0]",
    "objective.reward_timeout": "5",
    "objective.correct_threshold": "0.9",
    "objective.failed_threshold": "0.1",
    "objective.code_sandbox": "allow_per_process_memory",
}


def _read(cfg, key: str):
    section, name, *item = key.split(".")
    value = getattr(getattr(cfg, section), name)
    return value[item[0]] if item else value


@pytest.mark.parametrize("old", sorted(MOVED_VALUES))
def test_a_moved_key_is_read_at_its_new_place_naming_it_once(tmp_path, capsys, old):
    from ibpo.recipe import MOVED

    new, raw = MOVED[old], MOVED_VALUES[old]
    extra = ["data.answer_format=code_tests"] if old == "objective.reward" else []
    expected = _read(load_config(None, [f"{new}={raw}", *extra]), new)
    capsys.readouterr()
    assert _read(load_config(None, [f"{old}={raw}", *extra]), new) == expected
    err = capsys.readouterr().err
    assert err.count(f"'{old}' is now '{new}'") == 1, err
    recipe = tmp_path / "old.yaml"
    recipe.write_text(_set(old, raw))
    assert _read(load_config(recipe, extra), new) == expected
    assert f"old.yaml: '{old}' is now '{new}'" in capsys.readouterr().err
    recipe.write_text(_set(new, raw))  # at its new place: read as it is, and no line
    assert _read(load_config(recipe, extra), new) == expected
    assert "is now" not in capsys.readouterr().err


def test_a_moved_key_set_at_both_places_is_one_error_naming_the_one_to_keep(tmp_path):
    recipe = tmp_path / "both.yaml"
    recipe.write_text("objective:\n  eps_high: 0.3\n  params: {eps_high: 0.4}\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert str(e.value) == (
        f"{recipe}: 'objective.eps_high' is now 'objective.params.eps_high', which is set as "
        "well: keep only 'objective.params.eps_high'"
    )


def test_every_moved_key_has_a_value_in_the_test_and_a_new_place_in_the_schema():
    from ibpo.config import Config
    from ibpo.recipe import MOVED

    assert set(MOVED) == set(MOVED_VALUES)
    for old, new in MOVED.items():
        section, name, *_ = new.split(".")
        assert hasattr(getattr(Config(), section), name), new
        assert not hasattr(Config().objective, old.split(".")[1]), old


def test_an_old_recipe_with_the_moved_objective_and_reward_keys_trains_the_same_config(tmp_path):
    """A recipe written before the reward section and objective.params: the same resolved
    Config as its rewrite, and a saved config.yaml of that time loads (resume, report) silently."""
    import yaml

    from ibpo.recipe import from_dict

    old = tmp_path / "old.yaml"
    old.write_text(
        "objective:\n  name: dfpo\n  gate: group\n  eps_high: 0.3\n  reward: [math, code]\n"
        "  reward_weights: [1.0, 0.5]\n  code_sandbox: allow_socket_patch\n"
        "  failed_threshold: 0.2\n"
    )
    new = tmp_path / "new.yaml"
    new.write_text(
        "objective:\n  name: dfpo\n  params: {gate: group, eps_high: 0.3}\n"
        "reward:\n  functions: [math, code]\n  weights: [1.0, 0.5]\n"
        "  sandbox: allow_socket_patch\n  failed_threshold: 0.2\n"
    )
    a, b = load_config(old), load_config(new)
    assert a.to_dict() == b.to_dict() and a.inherited == b.inherited
    assert a.objective.params == {"weights": "min_replace", "gate": "group", "eps_low": 0.2,
                                  "eps_high": 0.3}  # fmt: skip
    # a saved config.yaml as the older version wrote it: every objective field resolved, the
    # knobs an objective does not take saved as null
    saved = yaml.safe_load(old.read_text())
    saved["objective"].update(weights="min_replace", eps_low=None, correct_threshold=1.0)
    assert from_dict(saved).to_dict() == a.to_dict()
    grpo = {"objective": {"name": "grpo", "weights": None, "gate": None, "eps_low": 0.1}}
    assert from_dict(grpo).objective.params == {"eps_low": 0.1, "eps_high": 0.2}


def test_the_objective_section_holds_only_the_objective():
    import dataclasses

    from ibpo.config import ObjectiveConfig, RewardConfig

    objective = [f.name for f in dataclasses.fields(ObjectiveConfig)]
    assert len(objective) <= 12
    assert not [k for k in objective if "reward" in k and k != "scale_rewards"]
    assert "sandbox" not in " ".join(objective) and "threshold" not in " ".join(objective)
    assert [f.name for f in dataclasses.fields(RewardConfig)] == [
        "functions", "weights", "timeout", "correct_threshold", "failed_threshold", "sandbox"
    ]  # fmt: skip
