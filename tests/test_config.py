import pytest

from ibpo.cli import main
from ibpo.config import ConfigError, parse_override
from ibpo.recipe import load_config


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
        "repair.max_new_tokens",
        "repair.temperature",
        "repair.batch_size",
        "repair.enabled",
        "rollout.vllm_kv_cache_gb",
        "data.eval_answer_format",
        "data.eval_question_column",
        "objective.weights",
        "objective.gate",
        "objective.eps_low",
        "objective.eps_high",
        "objective.aggregation",
        "objective.scale_rewards",
        "objective.overlong_buffer",
        "objective.overlong_penalty",
        "model.cpu_dequantize",
    ]
    load_config(None, [f"{key}=null" for key in nullable])


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.quantization=x", "model.quantization='x'; choose one of: nf4, none"),
        ("rollout.group_size=0", "rollout.group_size must be >= 2"),
        ("rollout.generation_batch_size=0", "rollout.generation_batch_size must be > 0"),
        ("data.eval_answer_format=latex", "code_tests (or null: data.answer_format)"),
        ("rollout.vllm_kv_cache_gb=0", "rollout.vllm_kv_cache_gb must be > 0 (or null"),
        ("repair.max_new_tokens=0", "must be > 0 (or null: rollout.max_new_tokens)"),
        ("repair.rho=1.5", "repair.rho must lie in [0, 1]"),
        ("repair.shaping_lambda=-1", "repair.shaping_lambda must be >= 0"),
        ("repair.template=fix {question} {attempt}", "repair.template must contain '{reference}'"),
        ("objective.overlong_buffer=1", "objective.overlong_buffer must lie in [0, 1)"),
        ("objective.kl_coef=-0.1", "objective.kl_coef must be >= 0"),
        ("objective.eps_low=1", "objective.eps_low must lie in [0, 1)"),
        ("objective.gate=token", None),  # ibpo takes a gate
        ("run.keep_checkpoints=0", "run.keep_checkpoints must be >= 1 (resuming needs one)"),
        ("train.micro_batch_tokens=-1", "train.micro_batch_tokens must be >= 0 (0 = no token cap)"),
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
            "which objective.reward=math scores 0 for every completion: set objective.reward=code",
        ),
        (["data.eval_answer_format=code_tests"], "data.eval_answer_format=code_tests gives test"),
        (
            ["objective.reward=code", "data.answer_format=gsm8k"],
            "objective.reward=code runs the answer as a JSON test spec, not a gsm8k answer: "
            "set data.answer_format=code_tests",
        ),
        (
            [
                "objective.reward=code",
                "data.answer_format=code_tests",
                "data.eval_answer_format=boxed",
            ],
            "set data.eval_answer_format=code_tests",
        ),
        (["train.learning_rate=0"], "train.learning_rate must be > 0"),
        (["train.learning_rate=-1e-4"], "train.learning_rate must be > 0"),
        (["train.max_grad_norm=0"], "train.max_grad_norm must be > 0 (.inf = no clipping)"),
        (["train.max_grad_norm=-1"], "train.max_grad_norm must be > 0"),
        (["train.weight_decay=-0.1"], "train.weight_decay must be >= 0"),
        (["train.warmup_steps=-1"], "train.warmup_steps must be >= 0"),
        (["rollout.top_p=0"], "rollout.top_p must lie in (0, 1]"),
        (["rollout.top_p=1.1"], "rollout.top_p must lie in (0, 1]"),
        (["rollout.top_k=-1"], "rollout.top_k must be >= 0 (0 = off)"),
        (["run.push_to_hub=true"], "run.push_to_hub=true needs run.hub_repo_id"),
        (["run.push_to_hub=true", "run.hub_repo_id=a--b/c"], "Fix: run.hub_repo_id="),
        (
            ["objective.name=grpo", "objective.weights=min_replace"],
            "objective.weights does not apply to 'grpo' (it takes: eps_low, eps_high)",
        ),
        (["objective.reward=nope"], "objective.reward='nope'; choose one of: math, code"),
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
            "rollout.top_k=0",
            "train.max_grad_norm=.inf",
            "train.weight_decay=0",
            "train.warmup_steps=0",
            "train.learning_rate=1e-8",
            "objective.reward=code",
            "data.answer_format=code_tests",
        ],
    )
    assert cfg.train.max_grad_norm == float("inf") and cfg.data.eval_answer_format == "code_tests"
    # the code grader also takes a column that already holds its JSON specs
    assert load_config(None, ["objective.reward=code"]).data.answer_format == "plain"


def test_a_reward_registered_at_run_time_is_accepted(monkeypatch):
    from ibpo.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "parity", lambda text, answer: float(len(text) % 2))
    assert load_config(None, ["objective.reward=parity"]).objective.reward == "parity"
    monkeypatch.delitem(REWARDS, "parity")
    with pytest.raises(ConfigError, match="choose one of: math, code"):
        load_config(None, ["objective.reward=parity"])


def test_the_run_section_holds_what_once_was_train_and_the_old_names_are_renamed():
    """Where and how the job runs (run.*) is apart from what is learned (train.*): every run key
    was a train key once, and RENAMED maps each old name to a key that exists."""
    import dataclasses

    from ibpo.config import RENAMED, Config, RunConfig, TrainConfig

    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not run_keys & train_keys
    assert {k: v for k, v in RENAMED.items() if v.startswith("run.")} == {
        f"train.{key}": f"run.{key}" for key in run_keys
    }
    assert [f.name for f in dataclasses.fields(Config)][-1] == "run"
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        assert not hasattr(getattr(Config(), old_section), old_key), old
        assert hasattr(getattr(Config(), new_section), new_key), new


@pytest.mark.parametrize("key", ["output_dir", "resume_from", "push_to_hub", "progress"])
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
