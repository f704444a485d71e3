"""TRL's GRPOConfig and ibpo's keys: the one table between them (NAMES).

Each GRPOConfig name of the table is, in ibpo, an override alias (`overrides={"num_generations":
4}`, `ibpo train num_generations=4`) that sets ibpo's key(s) with TRL's value translated, and a
name of the TrainingArguments-like `args` callbacks get (TrainingArgs: the run's value under
TRL's name). A value without an exact ibpo meaning (`scale_rewards="batch"`, `loss_type="sapo"`,
`max_steps=-1`) is an error naming it. A `trl.GRPOConfig` given where a recipe goes is read field
by field (`grpo_config_overrides`): only the fields set away from GRPOConfig's defaults count,
each as its alias; a field without an ibpo meaning is an error naming it, or a warning where
ignoring it changes nothing the run learns (IGNORED: logging, dataloader workers...).
docs/rewards.md's table is `markdown_table()` (a test holds them equal).

What TRL's names do not carry over, by design: the batch is counted in prompts per process
(`train.prompts_per_step`), which the batch names translate to; `loss_type` is the aggregation of
TRL's clipped token objective, so it selects ibpo's `grpo` with that aggregation.

Not here: reading overrides (recipe.py calls `to_ibpo` and `batch_overrides`), the schema
(config.py).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ibpo.config import Config, ConfigError

# TRL's loss_type -> ibpo's aggregation of the clipped token ratio (objective grpo).
LOSS_TYPES = {"grpo": "seq_mean", "dapo": "token_mean", "dr_grpo": "token_sum"}
# The objectives whose loss is a clipped ratio, which loss_type and importance_sampling_level
# keep; any other (ibpo, dfpo, one of yours) becomes grpo, TRL's objective.
CLIPPED = ("grpo", "dr_grpo", "dapo", "gspo")
# The names that together give the batch (train.prompts_per_step), read once all are known.
BATCH = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "steps_per_generation",
)
TRL_PER_DEVICE_BATCH = 8  # GRPOConfig's per_device_train_batch_size


def _no(name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} has no ibpo equivalent: {why}")


def _plain(key: str) -> Callable[[Any, Config, Mapping], dict[str, Any]]:
    return lambda value, cfg, given: {key: _scalar(value)}


def _scalar(value: Any) -> Any:
    """An enum of transformers' (SchedulerType.COSINE) as its value."""
    return value.value if isinstance(value, enum.Enum) else value


def _only(name: str, accepted: Any, why: str):
    def to(value, cfg, given):
        if _scalar(value) != accepted:
            raise _no(name, value, why)
        return {}

    return to


def _loss_type(value, cfg: Config, given) -> dict[str, Any]:
    if value not in LOSS_TYPES:
        raise _no(
            "loss_type",
            value,
            f"ibpo takes TRL's {', '.join(LOSS_TYPES)} (the clipped token objective's "
            "aggregations over the whole step); for ibpo's own objectives set objective.name "
            "(docs/objectives.md)",
        )
    name = cfg.objective.name if cfg.objective.name in CLIPPED else "grpo"
    return {"objective.name": name, "objective.aggregation": LOSS_TYPES[value]}


def _epsilon(value, cfg, given) -> dict[str, Any]:
    # TRL's epsilon_high defaults to epsilon
    high = {} if "epsilon_high" in given else {"objective.params.eps_high": value}
    return {"objective.params.eps_low": value, **high}


def _scale_rewards(value, cfg, given) -> dict[str, Any]:
    scale = {True: True, False: False, "group": True, "none": False}
    if isinstance(value, (bool, str)) and value in scale:
        return {"objective.scale_rewards": scale[value]}
    raise _no(
        "scale_rewards",
        value,
        "ibpo divides by the std of each group (group, true) or not at all (none, false); "
        "the std of the whole batch is not one of its choices",
    )


def _level(value, cfg: Config, given) -> dict[str, Any]:
    if value == "sequence":
        return {"objective.name": "gspo"}
    if value == "token":
        keep = cfg.objective.name in CLIPPED and cfg.objective.name != "gspo"
        return {"objective.name": cfg.objective.name if keep else "grpo"}
    raise _no("importance_sampling_level", value, "ibpo's levels are token and sequence")


def _vllm_correction(value, cfg, given) -> dict[str, Any]:
    if value is False:
        return {"objective.importance_sampling": "none"}
    raise _no(
        "vllm_importance_sampling_correction",
        value,
        "ibpo corrects at its objective's own level (per token for grpo, dr_grpo and dapo; "
        "per sequence for ibpo, dfpo and gspo): set objective.importance_sampling=truncate or "
        "mask, and objective.is_cap (TRL's defaults: sequence_mask, 3.0)",
    )


def _max_steps(value, cfg, given) -> dict[str, Any]:
    if isinstance(value, int) and value < 0:
        raise _no("max_steps", value, "TRL then counts epochs; ibpo counts steps: set max_steps")
    return {"train.steps": value}


def _steps(name: str, key: str):
    def to(value, cfg, given):
        if value is None:  # TRL's "as logging_steps": nothing of its own
            return {}
        if isinstance(value, float) and 0 < value < 1:
            raise _no(name, value, "a share of the run below 1; give a number of steps")
        return {key: int(value) if isinstance(value, float) and value.is_integer() else value}

    return to


def _scheduler(value, cfg, given) -> dict[str, Any]:
    value = _scalar(value)
    if value not in ("constant", "linear", "cosine"):
        raise _no("lr_scheduler_type", value, "ibpo's schedules are constant, linear and cosine")
    return {"train.lr_scheduler": value}


def _optim(value, cfg, given) -> dict[str, Any]:
    value = _scalar(value)
    kinds = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "paged_adamw_8bit": "adamw_8bit"}
    if value not in kinds:
        raise _no("optim", value, f"ibpo's optimizers are {', '.join(kinds)} (AdamW)")
    return {"train.optimizer": kinds[value]}


def _chat_template_kwargs(value, cfg, given) -> dict[str, Any]:
    value = dict(value or {})
    other = sorted(set(value) - {"enable_thinking"})
    if other:
        raise _no("chat_template_kwargs", value, f"ibpo passes only enable_thinking, not {other}")
    return {"data.enable_thinking": value.get("enable_thinking")}


def _report_to(value, cfg, given) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n for n in names if n != "none"]
    unknown = [n for n in names if n not in ("tensorboard", "wandb", "trackio")]
    if unknown:
        raise _no("report_to", value, "ibpo's trackers are tensorboard, wandb and trackio")
    return {"run.log_with": (names[0] if len(names) == 1 else names) or None}


def _eval_strategy(value, cfg, given) -> dict[str, Any]:
    value = _scalar(value)
    if value == "no":
        return {"data.eval_size": 0, "train.eval_every": 0}
    if value == "steps":
        return {}  # eval_steps says how often
    raise _no("eval_strategy", value, "ibpo evaluates every train.eval_every steps (eval_steps)")


def _ignored(why: str):
    def to(value, cfg, given):
        print(f"ibpo: warning: {why}; the TRL name is ignored", file=sys.stderr)
        return {}

    return to


def _flag(name: str, key: str, true: Any, false: Any):
    def to(value, cfg, given):
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return {key: true if value else false}

    return to


@dataclass(frozen=True)
class Name:
    """One GRPOConfig field: its default there, the ibpo key(s) it sets and ibpo's default (the
    doc table's columns), `to` (TRL's value, the config as read so far and every TRL name given
    with it -> ibpo's keys, or a ConfigError for a value without an ibpo meaning: `batch`
    names return none, batch_overrides reads them together) and `back` (a run's Config and its
    processes -> the value under TRL's name, for callbacks' args)."""

    trl: str
    there: str
    key: str
    here: str
    to: Callable[[Any, Config, Mapping[str, Any]], dict[str, Any]]
    back: Callable[[Config, int], Any]


def _batch(value, cfg, given) -> dict[str, Any]:
    return {}  # batch_overrides


def _agg_loss_type(cfg: Config) -> str | None:
    return {agg: lt for lt, agg in LOSS_TYPES.items()}.get(cfg.objective.aggregation)


NAMES: tuple[Name, ...] = (
    Name("max_completion_length", "512", "`rollout.max_new_tokens`",
         "16: the CPU demo's arithmetic answers; every recipe sets its own (1024-2048)",
         _plain("rollout.max_new_tokens"), lambda c, w: c.rollout.max_new_tokens),
    Name("learning_rate", "1e-6", "`train.learning_rate`",
         "5e-4: LoRA adapters (from zero, a small fraction of the weights) need a far larger rate "
         "than full fine-tuning, TRL's default case",
         _plain("train.learning_rate"), lambda c, w: c.train.learning_rate),
    Name("beta", "0.0", "`objective.kl_coef`",
         "0.1: a k3 KL to the base; cheap here (the reference is the base with the adapter off) "
         "and it keeps a small model's policy near its start",
         _plain("objective.kl_coef"), lambda c, w: c.objective.kl_coef),
    Name("use_bias_correction_kl", "true", "`objective.kl_estimator` (true: `k3_ratio`)",
         "`k3` ([objectives.md](objectives.md))",
         _flag("use_bias_correction_kl", "objective.kl_estimator", "k3_ratio", "k3"),
         lambda c, w: c.objective.kl_estimator == "k3_ratio"),
    Name("eval_strategy", "`no`", "`data.eval_size` (`no`: 0)",
         "100: a held-out accuracy before and after every run, carved out of the training rows "
         "when the data has no eval split; `steps` with `eval_steps` also every `eval_steps`",
         _eval_strategy,
         lambda c, w: "no" if not c.data.eval_size else "steps" if c.train.eval_every else "no"),
    Name("eval_steps", "`logging_steps`", "`train.eval_every`", "0: before and after only",
         _steps("eval_steps", "train.eval_every"), lambda c, w: c.train.eval_every or None),
    Name("num_generations", "8", "`rollout.group_size`", "8",
         _plain("rollout.group_size"), lambda c, w: c.rollout.group_size),
    Name("per_device_train_batch_size", "8 completions",
         "`train.prompts_per_step` (x `gradient_accumulation_steps` / `num_generations`)",
         "4 prompts (x `group_size` completions) per process",
         _batch, lambda c, w: c.train.prompts_per_step * c.rollout.group_size),
    Name("gradient_accumulation_steps", "1", "`train.prompts_per_step` (as above)",
         "micro-batches are ibpo's own (`train.micro_batch_groups`, the same gradient)",
         _batch, lambda c, w: 1),
    Name("generation_batch_size", "per device x processes x `steps_per_generation`",
         "`train.prompts_per_step` (/ processes / `num_generations`)",
         "one rollout of every process's prompts per step",
         _batch, lambda c, w: c.train.prompts_per_step * c.rollout.group_size * w),
    Name("steps_per_generation", "`gradient_accumulation_steps`", "(none)",
         "only its default: a step updates on its whole rollout (`num_iterations` times)",
         _batch, lambda c, w: 1),
    Name("num_iterations", "1", "`train.updates_per_rollout`", "1",
         _plain("train.updates_per_rollout"), lambda c, w: c.train.updates_per_rollout),
    Name("temperature", "1.0", "`rollout.temperature`", "the same",
         _plain("rollout.temperature"), lambda c, w: c.rollout.temperature),
    Name("top_p", "1.0", "`rollout.top_p`", "the same",
         _plain("rollout.top_p"), lambda c, w: c.rollout.top_p),
    Name("top_k", "0", "(none)", "no top-k (only 0 is taken): `top_p` truncates",
         _only("top_k", 0, "rollouts sample from the whole distribution, or top_p's"),
         lambda c, w: 0),
    Name("loss_type", "`dapo`", "`objective.name`, `objective.aggregation`",
         "`ibpo`; TRL's `grpo`, `dapo`, `dr_grpo` are ibpo's `grpo` aggregated by `seq_mean`, "
         "`token_mean`, `token_sum` ([objectives.md](objectives.md))",
         _loss_type, lambda c, w: _agg_loss_type(c)),
    Name("epsilon", "0.2",
         "`objective.params.eps_low` (and `eps_high` unless `epsilon_high` is set)",
         "the objective's own (ibpo: 0.2, 0.28)", _epsilon,
         lambda c, w: c.objective.params.get("eps_low")),
    Name("epsilon_high", "= `epsilon`", "`objective.params.eps_high`", "the objective's own",
         _plain("objective.params.eps_high"), lambda c, w: c.objective.params.get("eps_high")),
    Name("scale_rewards", "`group`", "`objective.scale_rewards` (`group`: true, `none`: false)",
         "the objective's own; the std is the group's population std (TRL: Bessel's); `batch` "
         "has no equivalent",
         _scale_rewards,
         lambda c, w: {True: "group", False: "none"}.get(c.objective.scale_rewards)),
    Name("importance_sampling_level", "`token`", "`objective.name` (`sequence`: `gspo`)",
         "sequence-level ratios are GSPO's objective",
         _level, lambda c, w: "sequence" if c.objective.name == "gspo" else "token"),
    Name("vllm_importance_sampling_correction", "true",
         "`objective.importance_sampling` (false: `none`)",
         "`none`: the mismatch is measured every step and warned about first "
         "([objectives.md](objectives.md))",
         _vllm_correction, lambda c, w: c.objective.importance_sampling != "none"),
    Name("use_vllm", "false", "`rollout.backend` (true: `vllm`)", "`hf`",
         _flag("use_vllm", "rollout.backend", "vllm", "hf"),
         lambda c, w: c.rollout.backend == "vllm"),
    Name("reward_weights", "1 each", "`reward.weights`", "the same",
         _plain("reward.weights"), lambda c, w: c.reward.weights),
    Name("max_steps", "-1 (3 epochs)", "`train.steps`", "20 (the demo)",
         _max_steps, lambda c, w: c.train.steps),
    Name("lr_scheduler_type", "linear", "`train.lr_scheduler`", "constant",
         _scheduler, lambda c, w: c.train.lr_scheduler),
    Name("warmup_steps", "0", "`train.warmup_steps`", "0",
         _steps("warmup_steps", "train.warmup_steps"), lambda c, w: c.train.warmup_steps),
    Name("max_grad_norm", "1.0", "`train.max_grad_norm`", "1.0",
         _plain("train.max_grad_norm"), lambda c, w: c.train.max_grad_norm),
    Name("weight_decay", "0.0", "(none)", "no weight decay (only 0.0 is taken)",
         _only("weight_decay", 0.0, "AdamW runs without weight decay"), lambda c, w: 0.0),
    Name("optim", "`adamw_torch_fused`", "`train.optimizer` (`paged_adamw_8bit`: `adamw_8bit`)",
         "`auto`: paged 8-bit AdamW on CUDA, else AdamW",
         _optim, lambda c, w: "paged_adamw_8bit" if c.train.optimizer == "adamw_8bit"
         else "adamw_torch"),
    Name("seed", "42", "`train.seed`", "0", _plain("train.seed"), lambda c, w: c.train.seed),
    Name("gradient_checkpointing", "true", "`model.gradient_checkpointing`", "true",
         _plain("model.gradient_checkpointing"), lambda c, w: c.model.gradient_checkpointing),
    Name("chat_template_kwargs", "none", "`data.enable_thinking`", "none (Qwen3's switch)",
         _chat_template_kwargs,
         lambda c, w: None if c.data.enable_thinking is None
         else {"enable_thinking": c.data.enable_thinking}),
    Name("save_steps", "500", "`run.save_every`", "50",
         _steps("save_steps", "run.save_every"), lambda c, w: c.run.save_every),
    Name("output_dir", "`trainer_output`", "`run.output_dir`", "`outputs/ibpo-demo`",
         _plain("run.output_dir"), lambda c, w: c.run.output_dir),
    Name("report_to", "none", "`run.log_with`", "none",
         _report_to, lambda c, w: [c.run.log_with] if isinstance(c.run.log_with, str)
         else list(c.run.log_with or [])),
    Name("logging_steps", "10", "(none: ignored, with a warning)", "every step is logged",
         _ignored("every step is logged"), lambda c, w: 1),
    Name("log_completions", "false", "(none: ignored, with a warning)",
         "every completion is in `completions.jsonl`",
         _ignored("every completion is in completions.jsonl"), lambda c, w: True),
)  # fmt: skip
BY_NAME = {n.trl: n for n in NAMES}

# GRPOConfig fields that change nothing a run learns: set away from their default, ignored with
# a warning. (The table's logging_steps and log_completions are ignored the same way.)
IGNORED = frozenset({
    "logging_steps", "log_completions", "logging_strategy", "logging_first_step", "log_level",
    "log_level_replica", "log_on_each_node", "logging_nan_inf_filter", "disable_tqdm",
    "run_name", "project", "num_completions_to_print", "log_unique_prompts", "log_multimodal",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "remove_unused_columns", "gradient_checkpointing_kwargs",
    "activation_checkpointing_kwargs", "ddp_find_unused_parameters", "ddp_timeout",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "save_total_limit", "save_only_model",
    "torch_empty_cache_steps", "per_device_eval_batch_size", "eval_on_start",
    "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "pad_to_multiple_of",
    "include_num_input_tokens_seen", "skip_memory_metrics", "ds3_gather_for_generation",
    "hub_token",
})  # fmt: skip
# Fields a GRPOConfig derives from others (compared through them) or that its environment
# decides (bf16 follows the GPU, as ibpo's model.dtype=auto does).
DERIVED = frozenset({"bf16", "activation_checkpointing", "logging_dir"})
# Why a common field has no ibpo meaning (others get a general line).
WHY_NOT = {
    "num_train_epochs": "ibpo counts steps: set max_steps (train.steps)",
    "fp16": "training refuses float16 (it would need loss scaling); ibpo picks bfloat16 on GPUs "
    "that have it, else float32",
    "vllm_mode": "ibpo's vLLM engine runs beside the policy in the training process (colocate)",
    "shuffle_dataset": "the training rows are always shuffled, by train.seed",
    "push_to_hub": "set run.hub_repo_id=<user>/<name> (the end-of-run push)",
    "resume_from_checkpoint": "set run.resume_from=latest or a checkpoint folder",
    "vllm_importance_sampling_mode": "ibpo corrects at its objective's own level: "
    "objective.importance_sampling=truncate or mask",
    "vllm_importance_sampling_clip_max": "set objective.is_cap",
    "max_prompt_length": "set data.max_prompt_tokens (longer prompts are left out, not cut)",
}


def to_ibpo(name: str, value: Any, cfg: Config, given: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's `name`=`value` as ibpo's keys ("section.key" -> value), read against the config
    as read so far and every TRL name given with it; a ConfigError names a value (or a name)
    without an ibpo meaning."""
    entry = BY_NAME.get(name)
    if entry is None:
        raise ConfigError(unknown_name(name, value))
    if isinstance(value, enum.Enum):
        value = value.value
    return entry.to(value, cfg, given)


def unknown_name(name: str, value: Any) -> str:
    """The message for a key without a section that is not one of NAMES."""
    if name in WHY_NOT or name in IGNORED or _is_grpo_field(name):
        why = WHY_NOT.get(name) or "ibpo has no such setting (docs/rewards.md lists TRL's names)"
        return str(_no(name, value, why))
    return (
        f"'{name}' is neither section.key (e.g. train.steps=10) nor one of TRL's GRPOConfig "
        "names (docs/rewards.md)"
    )


def _is_grpo_field(name: str) -> bool:
    try:
        from trl import GRPOConfig
    except ImportError:
        return False
    return name in {f.name for f in dataclasses.fields(GRPOConfig)}


def batch_overrides(given: Mapping[str, Any], group_size: int) -> dict[str, Any]:
    """train.prompts_per_step from TRL's batch names (BATCH) given together: the completions each
    process samples per step, per_device_train_batch_size x gradient_accumulation_steps (or
    generation_batch_size / processes), over the group size; {} when none is given."""
    if not any(k in given for k in BATCH):
        return {}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accum = int(given.get("gradient_accumulation_steps", 1))
    per_device = int(given.get("per_device_train_batch_size", TRL_PER_DEVICE_BATCH))
    spg = given.get("steps_per_generation")
    if spg is not None and spg != accum:
        raise _no(
            "steps_per_generation",
            spg,
            f"TRL would take {spg} / {accum} optimizer steps per generation; an ibpo step updates "
            "on its whole rollout (num_iterations times): leave it at gradient_accumulation_steps",
        )
    completions = per_device * accum
    gen = given.get("generation_batch_size")
    if gen is not None:
        if "per_device_train_batch_size" in given and gen != completions * world:
            raise _no(
                "generation_batch_size",
                gen,
                f"with per_device_train_batch_size={per_device} x gradient_accumulation_steps="
                f"{accum} x {world} processes TRL would take several optimizer steps per "
                "generation: give one of them",
            )
        if gen % world:
            raise ConfigError(f"generation_batch_size={gen} is not a multiple of {world} processes")
        completions = gen // world
    if completions % group_size:
        raise ConfigError(
            f"{completions} completions per process and step (TRL's batch names) are not whole "
            f"groups of num_generations={group_size}. Fix: a multiple of {group_size}"
        )
    return {"train.prompts_per_step": completions // group_size}


# --- a GRPOConfig where a recipe goes --------------------------------------------------------


def is_training_arguments(obj: Any) -> bool:
    """A transformers TrainingArguments (GRPOConfig is one), told without importing it."""
    return any(c.__name__ == "TrainingArguments" for c in type(obj).__mro__)


def grpo_config_overrides(args: Any) -> list[tuple[str, Any]]:
    """A GRPOConfig -> (TRL name, value) overrides: output_dir and each field of the table set
    away from GRPOConfig's defaults. A changed field without an ibpo meaning is a ConfigError
    (all of them named); an IGNORED one gets a warning."""
    if not hasattr(args, "num_generations"):
        raise ConfigError(
            f"recipe= is a {type(args).__name__}; ibpo reads TRL's GRPOConfig. Fix: pass a "
            "trl.GRPOConfig, a YAML recipe or a Config"
        )
    changed = _changed_fields(args)
    problems = [
        str(_no(k, v, WHY_NOT.get(k) or f"leave it at GRPOConfig's default ({d!r})"))
        for k, (v, d) in changed.items()
        if k not in BY_NAME and k not in IGNORED and k not in DERIVED
    ]
    if getattr(args, "fp16", False):
        problems.append(str(_no("fp16", True, WHY_NOT["fp16"])))
    if problems:
        raise ConfigError("GRPOConfig: " + "; ".join(dict.fromkeys(problems)))
    ignored = sorted(k for k in changed if k in IGNORED)
    if ignored:
        print(
            f"ibpo: warning: GRPOConfig's {', '.join(ignored)} change nothing here and are "
            "ignored (every step is logged; docs/rewards.md)",
            file=sys.stderr,
        )
    out = [("output_dir", args.output_dir)]
    batch = [k for k in BATCH if k in changed]
    if batch:  # the batch as TRL derives it: per device, accumulation and steps per generation
        out += [(k, getattr(args, k)) for k in BATCH if k != "generation_batch_size"]
    out += [(k, _scalar(v)) for k, (v, _) in changed.items() if k in BY_NAME and k not in BATCH]
    return [(k, v) for k, v in out if k not in IGNORED]


def _changed_fields(args: Any) -> dict[str, tuple[Any, Any]]:
    """field -> (value, GRPOConfig's default) for each field set away from its default: the
    reference is a fresh GRPOConfig of the same class and environment (output directory,
    precision, device), so that what its __post_init__ derives compares alike."""
    same = {k: getattr(args, k) for k in ("output_dir", "bf16", "fp16", "use_cpu")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = type(args)(**same)
    except Exception as e:  # a setting its own class refuses alone: name it, not a traceback
        raise ConfigError(f"GRPOConfig: could not read its defaults ({e})") from None
    out = {}
    for f in dataclasses.fields(args):
        if not f.init:
            continue
        value, default = getattr(args, f.name), getattr(reference, f.name)
        if _scalar(value) != _scalar(default):
            out[f.name] = (value, default)
    return out


# --- the args callbacks get ------------------------------------------------------------------


class TrainingArgs:
    """A TrainingArguments-like view of a run's Config, the `args` callbacks get: every name of
    the table under TRL's meaning (output_dir, logging_steps: 1, max_steps...), the processes
    (world_size, process_index, should_log, should_save); what else a callback reads comes
    from the Config itself (`args.train.steps`)."""

    def __init__(self, cfg: Config, world_size: int = 1, process_index: int = 0):
        self.config = cfg
        for n in NAMES:
            setattr(self, n.trl, n.back(cfg, world_size))
        self.world_size, self.process_index = world_size, process_index
        self.should_log = self.should_save = process_index == 0

    def __getattr__(self, name: str) -> Any:  # only for what __init__ did not set
        config = self.__dict__.get("config")
        if config is None or name.startswith("__"):  # copy and pickle probe dunder names
            raise AttributeError(name)
        return getattr(config, name)

    def to_dict(self) -> dict[str, Any]:
        return {n.trl: getattr(self, n.trl) for n in NAMES}


def markdown_table() -> str:
    """docs/rewards.md's table of TRL's names, as the docs hold it."""
    lines = [
        "| `GRPOConfig` | default there | ibpo key | default here, and why it differs |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{n.trl}` | {n.there} | {n.key} | {n.here} |" for n in NAMES]
    return "\n".join(lines) + "\n"
