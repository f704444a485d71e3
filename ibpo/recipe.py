"""From a recipe to the settings a run uses: reading, overrides, migration, checks, resolution.

    load_config(recipe, overrides)   YAML / a Config, then overrides -> checked, resolved Config
    from_dict(tree)                  a run's saved config (migrated) -> checked, resolved Config
    resolve_params(cfg.objective)    the objective section -> the ResolvedObjective the step calls

Both entry points go the same way: the defaults, then the YAML tree (its values coerced to the
fields' types), then the overrides; each field's own rule and each reward against
ibpo.rewards.GRADERS or as an import path; then resolution, once (resolve): the objective
against its registration (`check_objective`: the name in ibpo.algo.objectives.OBJECTIVES,
aggregation and kl_estimator in the algorithm's tables, objective.params through the knobs it
declares, ObjectiveSpec.resolve), and what it declares (its params, its shared defaults,
repair.enabled, rollout.dynamic_sampling) and what each None-means-inherit field inherits filled
in, so that every later reader, the saved config.yaml and `ibpo config` see the values the run
uses; last, the rules between fields (check_across) on those values. An objective
registered before the recipe loads is checked and filled the same way as a shipped one, its own
knobs included.

A key of an older version is an error in a recipe or an override, naming what replaced it
(RENAMED, REMOVED); a saved config (from_dict: resume, `ibpo report`) is migrated instead. A
key that moved (MOVED: the objective's knobs into objective.params, the rewards into their own
section) is read at its new place everywhere, with one line naming the new key for a recipe or
an override.

Not here: the schema and its rules (config.py); the objectives themselves (algo/objectives.py).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from ibpo.algo.objectives import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    OBJECTIVES,
    ObjectiveSpec,
    ParamError,
    ResolvedObjective,
)
from ibpo.config import (
    BUILTIN_PROMPT_TEMPLATE,
    Config,
    ConfigError,
    DataConfig,
    ObjectiveConfig,
    check_across,
    check_fields,
    reward_list,
)
from ibpo.rewards import GRADERS
from ibpo.trl_config import batch_overrides, grpo_config_overrides, is_training_arguments, to_ibpo

# objective field -> the algorithm's names it takes
CHOICES: dict[str, Collection[str]] = {"aggregation": AGGREGATIONS, "kl_estimator": KL_ESTIMATORS}
# What every objective's registration gives a default for, besides its own params.
SHARED = ("aggregation", "scale_rewards", "overlong_buffer", "overlong_penalty")
_FIELDS = {f.name: f for f in dataclasses.fields(ObjectiveConfig)}


# --- keys of older versions ------------------------------------------------------------------

# The operational switches that once were train.* and are now run.* (some since removed).
_TRAIN_TO_RUN = (
    "output_dir", "resume_from", "overwrite", "save_every", "keep_checkpoints", "progress",
    "log_with", "plots", "push_to_hub", "hub_repo_id", "hub_private",
)  # fmt: skip
# A key renamed in a later version -> its new name ("section.key").
RENAMED: dict[str, str] = {f"train.{key}": f"run.{key}" for key in _TRAIN_TO_RUN}
# The held-out set's keys that once were data.eval_<item>, now items of data.eval.
_EVAL_ITEMS = ("dataset", "subset", "split", "question_column", "answer_column", "answer_format")
FOLDED: dict[str, str] = {f"data.eval_{item}": f"data.eval.{item}" for item in _EVAL_ITEMS}
# A key that moved -> its place now ("section.key", or "section.key.item" in a mapping). Read
# at the new place everywhere: a recipe or an override that sets the old one gets one line
# naming the new key; a saved config is moved silently.
MOVED: dict[str, str] = {
    **{
        f"objective.{k}": f"objective.params.{k}"
        for k in ("weights", "gate", "eps_low", "eps_high")
    },
    "objective.reward": "reward.functions",
    "objective.reward_weights": "reward.weights",
    "objective.reward_timeout": "reward.timeout",
    "objective.correct_threshold": "reward.correct_threshold",
    "objective.failed_threshold": "reward.failed_threshold",
    "objective.code_sandbox": "reward.sandbox",
}
# A key removed in a later version -> what happens now, or what to set instead.
REMOVED: dict[str, str] = {
    "model.trust_remote_code": "models load without remote code (trust_remote_code=False): use "
    "a model transformers supports",
    "model.lora_dropout": "the adapter has no dropout, which would make the update's log-probs "
    "differ from the rollout's (a peft_config= given to ibpo.train is used as it is)",
    "model.cpu_dequantize": "on CPU a 4-bit base is dequantised once per phase whenever that "
    "copy stays under 4 GiB (never for DoRA adapters)",
    "model.attn_implementation": "attention is flash_attention_2 on CUDA when the flash-attn "
    "package is installed, else sdpa",
    "data.shuffle": "the training rows are always shuffled, by train.seed",
    "rollout.top_k": "rollouts sample from the whole distribution, or top_p's: use rollout.top_p",
    "rollout.eval_batch_size": "rollout.generation_batch_size sizes the held-out batches too: "
    "set that",
    "rollout.kv_cache": "rollout.decode=graph decodes over a static cache of its own; "
    "rollout.decode=eager (HF generate) grows its cache per token",
    "rollout.share_prefixes": "prompts that begin alike share their prefix wherever the model "
    "allows it (what is sampled is the same)",
    "rollout.vllm_sleep": "the vLLM engine sleeps between generation phases, so that training "
    "has the GPU",
    "rollout.vllm_kv_cache_gb": "vLLM's KV cache holds one rollout.generation_batch_size batch "
    "at full length: set that",
    "rollout.mismatch_warn_kl": "the mismatch warning is at KL 0.005; rollout.mismatch_stop_kl "
    "stops the run",
    "rollout.max_resample_rounds": "dynamic sampling refills for at most 3 rounds",
    "objective.reward_workers": "a reward function gets a step's completions at once, so one "
    "that waits on a service can fan out itself (an `async def` one runs beside the others)",
    "repair.max_new_tokens": "repairs use rollout.max_new_tokens: set that",
    "repair.temperature": "repairs use rollout.temperature: set that",
    "train.max_nonfinite_steps": "3 non-finite steps in a row stop the run with a checkpoint",
    "train.eval_before": "the held-out set is evaluated before and after training whenever "
    "data.eval_size > 0 (0 skips both)",
    "train.logprob_chunk_tokens": "log-probs run 1024 completion tokens at a time; for memory, "
    "lower train.micro_batch_groups",
    "train.weight_decay": "AdamW runs without weight decay",
    "train.micro_batch_tokens": "a micro-batch holds whole groups: for memory, lower "
    "train.micro_batch_groups",
    "run.progress": "the progress bar shows when the output is a terminal",
    "run.plots": "every run writes its plots and end-of-run report",
    "run.overwrite": "an earlier run in run.output_dir is moved to previous-<time>/, never "
    "deleted: delete that folder yourself, or choose another run.output_dir",
    "run.push_to_hub": "set run.hub_repo_id=<user>/<name> to push at the end (null: no push)",
    "run.hub_private": "the end-of-run push creates a private repo; `ibpo push OUTPUT_DIR "
    "--repo-id <user>/<name> --public` publishes",
    "run.keep_checkpoints": "the last two checkpoints are kept",
}


def _gone(section: str, key: str) -> str | None:
    """What to tell a recipe or override that sets `section.key`, a key of an older version;
    None for a key that never was."""
    old = f"{section}.{key}"
    new = RENAMED.get(old, old)
    if new in REMOVED:
        return f"'{old}' was removed: {REMOVED[new]}"
    if old in FOLDED:
        item = FOLDED[old].rsplit(".", 1)[1]
        return (
            f"'{old}' is now '{FOLDED[old]}'; use that (in a recipe: data: eval: {{{item}: ...}})"
        )
    if old in RENAMED:
        return f"'{old}' was renamed to '{RENAMED[old]}'; use that"
    if old in MOVED:  # left in place by `move`: the new key is set as well
        return f"'{old}' is now '{MOVED[old]}', which is set as well: keep only '{MOVED[old]}'"
    return None


def move(tree: Any, origin: str | None = None) -> Any:
    """A recipe's or a saved config's tree with each MOVED key at its new place (a copy; a null
    knob of the objective, which an older version saved for an objective without it, is
    dropped). `origin`: a recipe's name, for the one line each moved key gets (a saved config
    moves silently). Where the new key is set as well, the old one stays, for the reading to
    name. Anything not a mapping of mappings is returned as it is."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for old, new in MOVED.items():
        (old_section, old_key), new_path = old.split("."), new.split(".")
        source = tree.get(old_section)
        if not isinstance(source, dict) or old_key not in source:
            continue
        target = tree.setdefault(new_path[0], {})
        if not isinstance(target, dict):
            continue
        if len(new_path) == 3:  # an item of a mapping
            items = target.get(new_path[1])
            items = dict(items) if isinstance(items, dict) else {}
            if new_path[2] in items:
                continue
            value = source.pop(old_key)
            if value is not None:
                items[new_path[2]] = value
            target[new_path[1]] = items
        elif new_path[1] not in target:
            target[new_path[1]] = source.pop(old_key)
        else:
            continue
        if origin is not None:
            say_moved(origin, old, new)
    return tree


def say_moved(origin: str, old: str, new: str) -> None:
    """The one line a moved key gets where a recipe or an override sets it."""
    print(f"ibpo: note: {origin}: '{old}' is now '{new}'; read as that ({_how_to_write(new)})",
          file=sys.stderr)  # fmt: skip


def _how_to_write(key: str) -> str:
    """How a recipe writes `key`: 'reward: {functions: ...}'."""
    parts = key.split(".")
    inner = f"{{{parts[-1]}: ...}}"
    for part in reversed(parts[:-1]):
        inner = f"{part}: {inner}" if part == parts[0] else f"{{{part}: {inner}}}"
    return f"in a recipe: {inner}"


def migrate(tree: Any) -> Any:
    """A saved config's tree (one an older version wrote) as this version reads it: a copy with
    each RENAMED key moved to its new name, each FOLDED one into its mapping and each REMOVED one
    dropped (run.push_to_hub=false clears run.hub_repo_id: it no longer pushes). Where the new
    name is set as well the old one stays, for the reading to name. Anything not a mapping of
    mappings is returned as it is."""
    if not isinstance(tree, dict):
        return tree
    tree = move(tree)
    for old, new in {**RENAMED, **FOLDED}.items():
        (old_section, old_key), (new_section, *new_keys) = old.split("."), new.split(".")
        source = tree.get(old_section)
        if not isinstance(source, dict) or old_key not in source:
            continue
        target = tree.setdefault(new_section, {})
        if isinstance(target, dict) and len(new_keys) == 2:  # an item of a mapping
            value = source.pop(old_key)
            items = target.setdefault(new_keys[0], {})
            if isinstance(items, dict) and value is not None:
                items.setdefault(new_keys[1], value)
        elif isinstance(target, dict) and new_keys[0] not in target:
            target[new_keys[0]] = source.pop(old_key)
    run = tree.get("run")
    if isinstance(run, dict) and run.get("push_to_hub") is False:
        run["hub_repo_id"] = None
    for key in REMOVED:
        section, name = key.split(".")
        if isinstance(tree.get(section), dict):
            tree[section].pop(name, None)
    return tree


# --- the entry points ------------------------------------------------------------------------


def load_config(
    recipe: str | Path | Config | None = None,
    overrides: list[str] | Mapping[str, Any] | None = None,
) -> Config:
    """Defaults <- recipe YAML (or a Config's values, what it inherited inheriting afresh) <-
    `section.key=value` overrides (or a mapping {"section.key": value}), checked and resolved."""
    return check_across(resolve(validate(read_recipe(recipe, overrides))))


def from_dict(tree: dict[str, Any], origin: str = "config") -> Config:
    """A run's saved config (config.yaml or config.json, also one an older version wrote:
    migrated) -> the Config, checked and resolved."""
    cfg = Config()
    _update(cfg, migrate(tree), origin)
    return check_across(resolve(validate(cfg)))


def read_recipe(
    recipe: str | Path | Config | None = None,
    overrides: list[str] | Mapping[str, Any] | None = None,
) -> Config:
    """Defaults <- recipe <- overrides, as read: neither checked nor resolved. The recipe may be
    a trl.GRPOConfig, whose fields set away from their defaults are read as overrides in front
    of the others; an override's key may be one of TRL's GRPOConfig names (trl_config.NAMES)."""
    cfg = Config()
    items = _override_items(overrides)
    if isinstance(recipe, Config):
        _update(cfg, recipe.to_dict(recipe=True), "the given Config")
    elif is_training_arguments(recipe):
        pairs = grpo_config_overrides(recipe)
        items = [("GRPOConfig", [k], v) for k, v in pairs] + items
    elif isinstance(recipe, (str, Path)):
        _update(cfg, move(_read_yaml(recipe), str(recipe)), str(recipe))
    elif recipe is not None:
        raise ConfigError(
            f"the recipe is a {type(recipe).__name__}. Fix: pass a YAML path, a packaged "
            "recipe's name, an ibpo Config or a trl.GRPOConfig"
        )
    given = {path[0]: value for _, path, value in items if len(path) == 1}
    for origin, path, value in items:
        if len(path) == 1:  # one of TRL's names: the ibpo keys it stands for
            try:
                keys = to_ibpo(path[0], value, cfg, given)
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None
            for key, v in keys.items():
                _update(cfg, _tree(key.split("."), v), f"{origin} ({key})")
            continue
        old = ".".join(path)
        if old in MOVED:
            say_moved(origin, old, MOVED[old])
            path = MOVED[old].split(".")
        _update(cfg, _tree(path, value), origin)
    batch = batch_overrides(given, cfg.rollout.group_size)
    for key, value in batch.items():
        section, name = key.split(".")
        _update(cfg, {section: {name: value}}, "TRL's batch names")
    return cfg


def _tree(path: list[str], value: Any) -> dict[str, Any]:
    """["section", "key"(, "item")] and a value -> the tree a recipe would hold."""
    section, key, *rest = path
    return {section: {key: {rest[0]: value} if rest else value}}


def _override_items(overrides) -> list[tuple[str, list[str], Any]]:
    """Overrides (a mapping, or "k=v" strings and (key, value) pairs) -> (what a message calls
    it, the key's path, the value): a string's value parsed as YAML, a mapping's as given."""
    if isinstance(overrides, Mapping):
        overrides = list(overrides.items())
    items = []
    for item in overrides or []:
        if isinstance(item, tuple):  # from a mapping: the value as given, not YAML text
            text = f"{item[0]}={item[1]!r}"
            items.append((f"override {text}", _key_path(str(item[0]), text), item[1]))
        else:
            path, value = parse_override(item)
            items.append((f"override '{item}'", path, value))
    return items


def _read_yaml(recipe: str | Path) -> dict[str, Any]:
    path = Path(recipe)
    if not path.is_file():
        raise ConfigError(f"recipe '{recipe}' not found")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe '{recipe}' is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"recipe '{recipe}' must be a mapping of sections")
    return tree


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.steps=10' -> (['train', 'steps'], 10); 'data.eval.split=test' -> (['data', 'eval',
    'split'], 'test') for an item of a mapping; 'num_generations=4' -> (['num_generations'], 4)
    for one of TRL's names; values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    path, raw = text.split("=", 1)
    parts = _key_path(path, text)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e})") from None
    return parts, value


def _key_path(key: str, text: str) -> list[str]:
    """An override's key as its parts: section.key, section.key.item, or one TRL name."""
    parts = key.strip().split(".")
    if len(parts) not in (1, 2, 3) or not all(parts):
        raise ConfigError(
            f"override '{text}': the key must be section.key (e.g. train.steps=10) or one of "
            "TRL's GRPOConfig names (docs/rewards.md)"
        )
    return parts


# --- reading values into the schema ----------------------------------------------------------


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
    if origin is dict:
        _, item_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (key: value), got {value!r}")
        return {k: _coerce(v, item_tp, f"{key}.{k}") for k, v in value.items()}
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
    """Set each of `values` on a section, coerced to its field's type; a mapping field takes
    the items given and keeps the others."""
    hints = typing.get_type_hints(type(section_obj))
    valid = [f.name for f in dataclasses.fields(section_obj)]
    for key, value in values.items():
        if key not in valid:
            raise ConfigError(
                _gone(section, key)
                or f"unknown key '{section}.{key}'; valid keys in '{section}': {', '.join(valid)}"
            )
        value = _coerce(value, hints[key], f"{section}.{key}")
        if isinstance(value, dict):
            value = {**getattr(section_obj, key), **value}
        setattr(section_obj, key, value)


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


def section_with(section: str, values: Mapping[str, Any]) -> Any:
    """A fresh `section` (e.g. "objective") with `values` set as a recipe sets them: each a key
    of the section, of its field's type and within its field's rule, or a ConfigError naming the
    first that is not."""
    obj = next(f for f in dataclasses.fields(Config) if f.name == section).default_factory()
    _apply(obj, section, dict(values))
    check_fields(obj, section)
    return obj


# --- checks and resolution -------------------------------------------------------------------


def validate(cfg: Config) -> Config:
    """Every field's own rule, then the reward names (the objective against its registration
    is resolve's). -> cfg, unchanged."""
    for f in dataclasses.fields(cfg):
        check_fields(getattr(cfg, f.name), f.name)
    for name in reward_list(cfg.reward):
        if name not in GRADERS and ":" not in name and "/" not in name:
            raise ConfigError(
                f"reward.functions={name!r}; choose one of: {', '.join(GRADERS)}, or an "
                "import path 'package.module:function', or a reward model's Hub id or folder "
                "(org/name)"
            )
    return cfg


def resolve(cfg: Config) -> Config:
    """A copy of `cfg` with what its objective declares filled where the recipe left None or
    left out (its params, its shared defaults, repair.enabled, rollout.dynamic_sampling), then
    what the fields inherit (inherit). Idempotent."""
    spec, params = check_objective(cfg.objective)
    declared = {f"objective.{key}": value for key, value in defaults(spec).items()}
    declared.update({f"objective.params.{key}": value for key, value in params.items()})
    declared["repair.enabled"] = spec.repairs
    declared["rollout.dynamic_sampling"] = spec.dynamic_sampling
    cfg = inherit(cfg, declared)
    cfg.objective.params = dict(params)  # as resolved: of their types, in declared order
    return cfg


def inherit(cfg: Config, declared: Mapping[str, Any] | None = None) -> Config:
    """A copy of a checked `cfg` with every None-means-inherit value set to what it inherits:
    first `declared` ("section.key" or "section.key.item" -> value: what a registry declares
    for this run), then the
    fields declared with `inherit=` (repair.batch_size from rollout.generation_batch_size), the
    held-out set's items (data.eval: its columns and answer format from training's, and for the
    training source its subset) and a built-in task's prompt (data.prompt_template:
    BUILTIN_PROMPT_TEMPLATE). A value the user set keeps it. Idempotent. Other None values (a
    Hub revision, data.eval's dataset: "the training source", not a copy...) mean something
    else and stay None. `inherited` lists what was filled, so that the recipe form
    (to_dict(recipe=True)) inherits afresh."""
    before = cfg.to_dict(recipe=True)
    cfg = copy.deepcopy(cfg)
    for key, value in (declared or {}).items():
        section, name, *item = key.split(".")
        obj = getattr(cfg, section)
        if item and getattr(obj, name).get(item[0]) is None:
            getattr(obj, name)[item[0]] = value
        elif not item and getattr(obj, name) is None:
            setattr(obj, name, value)
    if cfg.data.prompt_template is None and cfg.data.dataset.startswith("builtin:"):
        cfg.data.prompt_template = BUILTIN_PROMPT_TEMPLATE
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            source = f.metadata.get("inherit")
            if source and getattr(obj, f.name) is None:
                src_section, src_key = source.split(".")
                setattr(obj, f.name, getattr(getattr(cfg, src_section), src_key))
    _inherit_eval(cfg.data)
    cfg.inherited = frozenset(_filled(before, cfg.to_dict()))
    return cfg


def _inherit_eval(data: DataConfig) -> None:
    """data.eval's null items: training's columns and answer format; training's subset where
    the held-out set is the training source (another dataset's null subset is its default)."""
    ev = data.eval
    same = ev.get("dataset") in (None, data.dataset)
    own = {
        "question_column": data.question_column,
        "answer_column": data.answer_column,
        "answer_format": data.answer_format,
        "subset": data.subset if same else None,
    }
    for item, value in own.items():
        if ev.get(item) is None:
            ev[item] = value


def _filled(before: dict, after: dict):
    """ "section.key" (or "section.key.item") of each value None in `before` and set in `after`."""
    for section, values in before.items():
        for key, value in values.items():
            new = after[section][key]
            if isinstance(value, dict):  # an open mapping's item may be new
                yield from (
                    f"{section}.{key}.{item}"
                    for item, now in new.items()
                    if value.get(item) is None and now is not None
                )
            elif value is None and new is not None:
                yield f"{section}.{key}"


# --- the objective -------------------------------------------------------------------------------


def defaults(spec: ObjectiveSpec) -> dict[str, Any]:
    """What the objective section's None shared fields take for `spec`."""
    return {key: getattr(spec, key) for key in SHARED}


def objective_spec(name: str) -> ObjectiveSpec:
    """The registration of objective `name`, its shared defaults checked against the objective
    section's rules; a ConfigError names the registered objectives, or the default at fault.
    (Its params' defaults passed their own rules when it registered.)"""
    spec = OBJECTIVES.get(name)
    if spec is None:
        raise ConfigError(
            f"objective.name={name!r}; choose one of: {', '.join(OBJECTIVES)} (or register your "
            "own with ibpo.algo.objectives.register_objective, docs/objectives.md)"
        )
    try:
        _check_choices(section_with("objective", {"name": name, **defaults(spec)}))
    except ConfigError as e:
        raise ConfigError(
            f"objective {name!r} (its register_objective call): default {e}"
        ) from None
    return spec


def check_objective(obj: ObjectiveConfig) -> tuple[ObjectiveSpec, dict[str, Any]]:
    """The objective section against its registration, the one place it is checked: a
    registered name, the algorithm's names for aggregation and kl_estimator, and
    objective.params through the knobs the objective declares (their types, rules and
    defaults). -> (its spec, every param's value)."""
    spec = objective_spec(obj.name)
    _check_choices(obj)
    try:
        return spec, spec.resolve(obj.params)
    except ParamError as e:
        raise ConfigError(str(e)) from None


def _check_choices(obj: ObjectiveConfig) -> None:
    for key, names in CHOICES.items():
        value = getattr(obj, key)
        if value is not None and value not in names:
            null = _FIELDS[key].metadata.get("null")
            tail = f" (or null: {null})" if null else ""
            raise ConfigError(f"objective.{key}={value!r}; choose one of: {', '.join(names)}{tail}")


def resolve_params(obj: ObjectiveConfig) -> ResolvedObjective:
    """An objective section -> its ResolvedObjective: the registration's surrogate and level
    with the section's values, the surrogate's keyword arguments being its params resolved
    (`check_objective`). A section that resolve filled is used as it is (a run's config resolves
    once); in one built by hand, what is None or left out takes the objective's defaults."""
    spec, params = check_objective(obj)
    shared = {key: value if (value := getattr(obj, key)) is not None else default
              for key, default in defaults(spec).items()}  # fmt: skip
    return ResolvedObjective(
        obj.name,
        spec.surrogate,
        params,
        shared["aggregation"],
        shared["scale_rewards"],
        spec.repairs,
        obj.kl_coef,
        shared["overlong_buffer"],
        shared["overlong_penalty"],
        KL_ESTIMATORS[obj.kl_estimator],
        obj.behavior_policy,
        obj.importance_sampling,
        obj.is_cap,
        spec.level,
    )
