"""Checks of a loaded Config: every value a user can set is in range and consistent with the rest.

One clear ConfigError per problem, naming the key and the fix, raised before anything is loaded
(a bad Hub repo id or objective parameter fails here, not after hours of training).
Not here: the dataclasses, YAML and overrides (config.py).
"""

from __future__ import annotations

from ibpo.config import Config, ConfigError, RepairConfig
from ibpo.sizes import VLLM_BATCHED_TOKENS

_CHOICES = {
    ("model", "quantization"): ("nf4", "none"),
    ("model", "dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("model", "attn_implementation"): ("auto", "sdpa", "eager", "flash_attention_2"),
    ("data", "answer_format"): ("plain", "gsm8k", "boxed", "code_tests"),
    ("train", "lr_scheduler"): ("constant", "linear", "cosine"),
    ("train", "optimizer"): ("auto", "adamw", "adamw_8bit"),
    ("rollout", "kv_cache"): ("dynamic", "static"),
    ("rollout", "backend"): ("hf", "vllm"),
    ("repair", "reference_selection"): ("correct_first", "correct_only", "random"),
}

_POSITIVE = [
    ("rollout", "group_size"),
    ("rollout", "max_new_tokens"),
    ("rollout", "generation_batch_size"),
    ("rollout", "eval_max_new_tokens"),
    ("rollout", "eval_batch_size"),
    ("train", "prompts_per_step"),
    ("train", "micro_batch_groups"),
    ("train", "updates_per_rollout"),
    ("train", "logprob_chunk_tokens"),
    ("model", "lora_r"),
    ("repair", "references"),
    ("repair", "max_repairs_per_group"),
]


def validate(cfg: Config) -> None:
    from ibpo.objectives import OBJECTIVES, resolve_params
    from ibpo.rewards import REWARDS

    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(f"{section}.{key}={value!r}; choose one of: {', '.join(choices)}")
    if cfg.data.eval_answer_format not in (None, *_CHOICES[("data", "answer_format")]):
        choices = ", ".join(_CHOICES[("data", "answer_format")])
        value = cfg.data.eval_answer_format
        raise ConfigError(f"data.eval_answer_format={value!r}; choose one of: {choices} "
                          "(or null: data.answer_format)")  # fmt: skip
    for section, key in _POSITIVE:
        if getattr(getattr(cfg, section), key) <= 0:
            raise ConfigError(f"{section}.{key} must be > 0")
    if cfg.train.steps < 0 or cfg.data.eval_size < 0 or cfg.rollout.max_resample_rounds < 0:
        raise ConfigError("train.steps, data.eval_size, rollout.max_resample_rounds must be >= 0")
    if cfg.train.save_every < 0 or cfg.train.max_nonfinite_steps < 0:
        raise ConfigError("train.save_every and train.max_nonfinite_steps must be >= 0 (0 = off)")
    if cfg.train.micro_batch_tokens < 0:
        raise ConfigError("train.micro_batch_tokens must be >= 0 (0 = no token cap)")
    if cfg.train.eval_every < 0:
        raise ConfigError("train.eval_every must be >= 0 (0 = evaluate only before and after)")
    if cfg.model.offload_activations and not cfg.model.gradient_checkpointing:
        raise ConfigError("model.offload_activations offloads what gradient checkpointing saves: "
                          "set model.gradient_checkpointing=true")  # fmt: skip
    if cfg.train.eval_every and cfg.data.eval_size == 0:
        raise ConfigError("train.eval_every needs held-out problems: set data.eval_size > 0")
    if cfg.train.push_to_hub and not cfg.train.hub_repo_id:
        raise ConfigError("train.push_to_hub=true needs train.hub_repo_id=<user>/<name>")
    if cfg.train.push_to_hub:
        from ibpo.hub import check_repo_id

        check_repo_id(cfg.train.hub_repo_id)  # a bad id fails now, not after hours of training
    if cfg.train.keep_checkpoints < 1:
        raise ConfigError("train.keep_checkpoints must be >= 1 (resuming needs one)")
    if cfg.train.resume_from is not None and not cfg.train.resume_from.strip():
        raise ConfigError("train.resume_from must be null, 'latest' or a checkpoint path")
    if cfg.rollout.group_size < 2:
        raise ConfigError("rollout.group_size must be >= 2: advantages compare members of a group")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 (rollouts are sampled)")
    if cfg.rollout.vllm_kv_cache_gb is not None and cfg.rollout.vllm_kv_cache_gb <= 0:
        raise ConfigError("rollout.vllm_kv_cache_gb must be > 0 (or null: sized from the batch)")
    if cfg.rollout.backend == "vllm" and cfg.rollout.generation_batch_size > VLLM_BATCHED_TOKENS:
        raise ConfigError(
            f"rollout.generation_batch_size must be <= {VLLM_BATCHED_TOKENS} with the vllm "
            "backend (its sequences at once may not exceed its tokens per step)"
        )
    if cfg.objective.name not in OBJECTIVES:
        raise ConfigError(
            f"objective.name={cfg.objective.name!r}; choose one of: {', '.join(OBJECTIVES)}"
        )
    if cfg.objective.reward not in REWARDS:
        raise ConfigError(
            f"objective.reward={cfg.objective.reward!r}; choose one of: {', '.join(REWARDS)}"
        )
    resolve_params(cfg.objective)  # raises ConfigError on a bad weights/gate/aggregation value
    if "{question}" not in cfg.data.prompt_template:
        raise ConfigError("data.prompt_template must contain '{question}'")
    _validate_repair(cfg.repair)


def _validate_repair(rep: RepairConfig) -> None:
    for key in ("rho", "unchanged_weight"):
        if not 0.0 <= getattr(rep, key) <= 1.0:
            raise ConfigError(f"repair.{key} must lie in [0, 1]")
    if rep.shaping_lambda < 0:
        raise ConfigError("repair.shaping_lambda must be >= 0")
    if rep.max_new_tokens is not None and rep.max_new_tokens <= 0:
        raise ConfigError("repair.max_new_tokens must be > 0 (or null for rollout.max_new_tokens)")
    if rep.batch_size is not None and rep.batch_size <= 0:
        raise ConfigError("repair.batch_size must be > 0 (or null: rollout.generation_batch_size)")
    if rep.temperature is not None and rep.temperature <= 0:
        raise ConfigError("repair.temperature must be > 0 (or null for rollout.temperature)")
    for field_name in ("{question}", "{attempt}", "{reference}"):
        if field_name not in rep.template:
            raise ConfigError(f"repair.template must contain '{field_name}'")
