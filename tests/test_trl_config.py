"""TRL's GRPOConfig as a TRL user writes it: its names as overrides (translated to ibpo's keys,
an error naming each value or field without an ibpo meaning), a GRPOConfig object where a
recipe goes (only the fields set away from its defaults count), the docs' table being the
code's, and the TrainingArguments-like `args` callbacks get."""

import copy
import dataclasses
import warnings
from pathlib import Path

import pytest
import yaml

from ibpo.config import ConfigError
from ibpo.recipe import load_config
from ibpo.trl_config import NAMES, TrainingArgs, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def grpo_config(**fields):
    from trl import GRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes about its own fields
        return GRPOConfig(**{"output_dir": "trl-out", "bf16": False, **fields})


def test_grpo_config_names_are_overrides_of_ibpo_keys():
    cfg = load_config(None, {
        "num_generations": 4, "max_completion_length": 32, "learning_rate": 1e-5, "beta": 0.04,
        "loss_type": "dr_grpo", "scale_rewards": "none", "num_iterations": 2, "max_steps": 3,
        "epsilon": 0.1, "temperature": 0.7, "use_bias_correction_kl": True,
    })  # fmt: skip
    ro, tr, obj = cfg.rollout, cfg.train, cfg.objective
    assert (ro.group_size, ro.max_new_tokens, ro.temperature) == (4, 32, 0.7)
    assert (tr.learning_rate, tr.updates_per_rollout, tr.steps) == (1e-5, 2, 3)
    # TRL's dr_grpo is the clipped token ratio summed over max_completion_length x sequences
    assert (obj.name, obj.aggregation, obj.scale_rewards) == ("grpo", "token_sum", False)
    assert (obj.kl_coef, obj.kl_estimator) == (0.04, "k3_ratio")
    assert obj.params == {"eps_low": 0.1, "eps_high": 0.1}  # epsilon_high defaults to epsilon
    # config.yaml records ibpo's keys, and it loads again as a recipe
    tree = cfg.to_dict(recipe=True)
    assert tree["rollout"]["group_size"] == 4 and "num_generations" not in str(tree)
    assert load_config(None, [f"{s}.{k}={v!r}" for s in ("rollout",) for k, v in
                              tree[s].items() if v is not None]).rollout == ro  # fmt: skip
    # as key=value strings (the CLI), TRL's values: scale_rewards group, loss_type dapo
    cfg = load_config(None, ["loss_type=dapo", "scale_rewards=group", "epsilon=0.1",
                             "epsilon_high=0.3", "objective.name=gspo"])  # fmt: skip
    obj = cfg.objective
    assert (obj.name, obj.aggregation, obj.scale_rewards) == ("gspo", "token_mean", True)
    assert obj.params == {"eps_low": 0.1, "eps_high": 0.3}
    assert load_config(None, ["importance_sampling_level=sequence"]).objective.name == "gspo"
    assert load_config(None, ["use_vllm=true"]).rollout.backend == "vllm"


def test_batch_names_give_prompts_per_step(monkeypatch):
    names = {"num_generations": 4, "per_device_train_batch_size": 8}
    assert load_config(None, names).train.prompts_per_step == 2
    names["gradient_accumulation_steps"] = 2
    assert load_config(None, names).train.prompts_per_step == 4
    monkeypatch.setenv("WORLD_SIZE", "2")  # generation_batch_size counts every process's
    names = {"num_generations": 4, "generation_batch_size": 16}
    assert load_config(None, names).train.prompts_per_step == 2
    with pytest.raises(ConfigError, match="12 completions per process and step .* not whole "):
        load_config(None, {"num_generations": 8, "per_device_train_batch_size": 12})
    with pytest.raises(ConfigError, match="steps_per_generation=4 has no ibpo equivalent"):
        load_config(None, {"per_device_train_batch_size": 8, "steps_per_generation": 4})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scale_rewards": "batch"}, "scale_rewards='batch' has no ibpo equivalent: ibpo divides"),
        (["loss_type=sapo"], "override 'loss_type=sapo': loss_type='sapo' has no ibpo equivalent"),
        ({"max_steps": -1}, "max_steps=-1 has no ibpo equivalent: TRL then counts epochs"),
        ({"top_k": 50}, "top_k=50 has no ibpo equivalent"),
        ({"weight_decay": 0.1}, "weight_decay=0.1 has no ibpo equivalent"),
        ({"vllm_mode": "server"}, "vllm_mode='server' has no ibpo equivalent: ibpo's vLLM"),
        ({"num_train_epochs": 2}, "num_train_epochs=2 has no ibpo equivalent: ibpo counts steps"),
        ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type='polynomial' has no ibpo"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions=True has no ibpo"),
        # a key that is neither: the message keeps the value, in either form
        ({"stepz": 10}, "override stepz=10: 'stepz' is neither section.key"),
        (["stepz=10"], "override 'stepz=10': 'stepz' is neither section.key"),
        (["a.b.c.d=1"], "override 'a.b.c.d=1': the key must be section.key"),
        ({"use_vllm": "yes"}, "use_vllm: expected true/false, got 'yes'"),
    ],
)
def test_a_trl_value_or_name_without_an_ibpo_meaning_is_one_error_naming_it(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_a_grpo_config_is_read_field_by_field(capsys):
    args = grpo_config(num_generations=4, per_device_train_batch_size=12, learning_rate=1e-5,
                       beta=0.04, loss_type="grpo", scale_rewards="none", max_steps=5,
                       logging_steps=1, temperature=0.9, lr_scheduler_type="cosine")  # fmt: skip
    cfg = load_config(args, {"train.warmup_steps": 2})  # overrides go on top
    assert cfg.run.output_dir == "trl-out"
    assert (cfg.rollout.group_size, cfg.train.prompts_per_step, cfg.rollout.temperature) == (
        4, 3, 0.9,
    )  # fmt: skip
    assert (cfg.train.learning_rate, cfg.train.steps, cfg.train.lr_scheduler) == (1e-5, 5, "cosine")
    assert (cfg.objective.name, cfg.objective.kl_coef, cfg.objective.scale_rewards) == (
        "grpo", 0.04, False,
    )  # fmt: skip
    assert cfg.train.warmup_steps == 2
    # fields left at GRPOConfig's defaults take ibpo's: its seed 42, max_completion_length 512
    assert (cfg.train.seed, cfg.rollout.max_new_tokens) == (0, 16)
    # per_device_train_batch_size left at 8: ibpo's 4 prompts per step, whatever the group
    assert load_config(grpo_config(num_generations=2)).train.prompts_per_step == 4
    assert "GRPOConfig's logging_steps change nothing here" in capsys.readouterr().err
    # a GRPOConfig left at its defaults is ibpo's defaults in its output_dir
    plain = load_config(grpo_config())
    assert plain.to_dict() == load_config(None, {"run.output_dir": "trl-out"}).to_dict()


def test_a_grpo_config_field_without_an_ibpo_meaning_is_named():
    args = grpo_config(num_train_epochs=1, mask_truncated_completions=True, vllm_mode="server")
    with pytest.raises(ConfigError) as e:
        load_config(args)
    text = str(e.value)
    for part in ("num_train_epochs=1 has no ibpo equivalent: ibpo counts steps",
                 "mask_truncated_completions=True has no ibpo equivalent: leave it at "
                 "GRPOConfig's default (False)", "vllm_mode='server' has no"):  # fmt: skip
        assert part in text
    with pytest.raises(ConfigError, match="GRPOConfig: scale_rewards='batch' has no ibpo"):
        load_config(grpo_config(scale_rewards="batch"))
    with pytest.raises(ConfigError, match="the recipe is a dict. Fix: pass a YAML path"):
        load_config({"train": {"steps": 1}})


def test_the_docs_table_is_the_code_s_and_every_name_is_grpo_config_s():
    from trl import GRPOConfig

    assert markdown_table() in (ROOT / "docs" / "rewards.md").read_text()
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert [n.trl for n in NAMES if n.trl not in fields] == []


def test_callbacks_args_read_back_as_trl_names_and_translate_to_the_same_run(monkeypatch):
    cfg = load_config(None, {
        "objective.name": "grpo", "train.optimizer": "adamw", "data.eval_size": 0,
        "rollout.group_size": 4, "train.prompts_per_step": 3, "train.steps": 7,
        "run.output_dir": "somewhere", "data.enable_thinking": False,
        "run.log_with": "tensorboard", "train.warmup_steps": 2,
    })  # fmt: skip
    args = TrainingArgs(cfg, world_size=2, process_index=1)
    assert (args.output_dir, args.logging_steps, args.max_steps) == ("somewhere", 1, 7)
    assert (args.num_generations, args.per_device_train_batch_size) == (4, 12)
    assert (args.generation_batch_size, args.loss_type, args.scale_rewards) == (24, "grpo", "group")
    assert (args.world_size, args.should_log, args.should_save) == (2, False, False)
    assert args.train.steps == 7 and args.config is cfg  # the Config behind it
    assert copy.deepcopy(args).max_steps == 7 and not hasattr(args, "no_such_setting")
    # every name the view shows translates back to the same settings (its own table's inverse)
    ignored = ("logging_steps", "log_completions")
    given = {k: v for k, v in args.to_dict().items() if k not in ignored}
    monkeypatch.setenv("WORLD_SIZE", "2")  # the processes generation_batch_size counts
    assert load_config(None, given).to_dict() == cfg.to_dict()
    assert yaml.safe_load(yaml.safe_dump(args.to_dict()))  # plain values, as TrainingArguments'
