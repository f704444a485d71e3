"""A recipe resolved against what the package registers: the entry point from a YAML file,
overrides or a saved config to the settings a run uses.

config.py holds the schema and every rule it can state alone (the fields' types, choices and
ranges, what spans fields, what None inherits) and imports nothing of ibpo, so it cannot know
which objectives or reward functions exist. This module can: it checks the values a registry
backs (the objective's name against ibpo.algo.objectives.OBJECTIVES, objective.weights, gate,
aggregation and kl_estimator against the algorithm's tables, the surrogate parameters the
objective takes, each reward against ibpo.rewards.REWARDS or as an import path) and fills what
the objective's registration declares (its parameters, repair.enabled,
rollout.dynamic_sampling) before config.inherit fills the rest. An objective registered before
the recipe loads is checked and filled the same way as a shipped one: its registration's
defaults must satisfy the fields' rules, which only this layer can check.

    load_config(recipe, overrides)   YAML / a Config, then overrides -> checked, resolved Config
    from_dict(tree)                  a run's saved config (migrated) -> checked, resolved Config
    resolve_params(cfg.objective)    the objective section -> the ResolvedObjective the step calls

Not here: reading YAML and overrides, migrating renamed keys, the field rules (config.py); the
objectives themselves (algo/objectives.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ibpo import config
from ibpo.algo.objectives import (
    AGGREGATIONS,
    GATES,
    KL_ESTIMATORS,
    OBJECTIVES,
    WEIGHT_TRANSFORMS,
    ObjectiveSpec,
    ResolvedObjective,
)
from ibpo.config import Config, ConfigError, ObjectiveConfig
from ibpo.rewards import REWARDS

# objective field -> the algorithm's names it takes
CHOICES: dict[str, Collection[str]] = {
    "weights": WEIGHT_TRANSFORMS,
    "gate": GATES,
    "aggregation": AGGREGATIONS,
    "kl_estimator": KL_ESTIMATORS,
}
# What every objective's registration gives a default for, besides its surrogate's parameters.
SHARED = ("aggregation", "scale_rewards", "overlong_buffer", "overlong_penalty")
_FIELDS = {f.name: f for f in dataclasses.fields(ObjectiveConfig)}
# The objective section's surrogate keyword arguments (config.declared(surrogate=True)).
SURROGATE_PARAMETERS = tuple(k for k, f in _FIELDS.items() if f.metadata.get("surrogate"))


# --- the entry points --------------------------------------------------------------------------


def load_config(
    recipe: str | Path | Config | None = None,
    overrides: list[str] | Mapping[str, Any] | None = None,
) -> Config:
    """Defaults <- recipe YAML (or a Config's values, what it inherited inheriting afresh) <-
    `section.key=value` overrides (or a mapping {"section.key": value}) (config.read_recipe),
    validated, then resolved."""
    return resolve(validate(config.read_recipe(recipe, overrides)))


def from_dict(tree: dict[str, Any], origin: str = "config") -> Config:
    """A run's saved config (config.yaml or config.json, also one an older version wrote:
    config.read_saved migrates it) -> the Config, validated and resolved."""
    return resolve(validate(config.read_saved(tree, origin)))


def validate(cfg: Config) -> Config:
    """config.validate (every field rule, what spans fields), then the values a registry backs:
    the objective section (check_objective) and the reward names. -> cfg, unchanged."""
    config.validate(cfg)
    check_objective(cfg.objective)
    for name in config.reward_list(cfg.objective):
        if name not in REWARDS and ":" not in name and "/" not in name:
            raise ConfigError(
                f"objective.reward={name!r}; choose one of: {', '.join(REWARDS)}, or an "
                "import path 'package.module:function', or a reward model's Hub id or folder "
                "(org/name)"
            )
    return cfg


def resolve(cfg: Config) -> Config:
    """A copy of `cfg` with what its objective declares filled where the recipe left None (the
    objective's parameters, repair.enabled, rollout.dynamic_sampling), then what the fields
    inherit (config.inherit). Idempotent."""
    spec = check_objective(cfg.objective)
    declared = {f"objective.{key}": value for key, value in defaults(spec).items()}
    declared["repair.enabled"] = spec.repairs
    declared["rollout.dynamic_sampling"] = spec.dynamic_sampling
    return config.inherit(cfg, declared)


# --- the objective -------------------------------------------------------------------------------


def defaults(spec: ObjectiveSpec) -> dict[str, Any]:
    """What the objective section's None fields take for `spec`: the shared settings and its
    surrogate's keyword arguments, by the section's field names."""
    return {**{key: getattr(spec, key) for key in SHARED}, **spec.kwargs}


def objective_spec(name: str) -> ObjectiveSpec:
    """The registration of objective `name`, its defaults checked against the objective
    section's rules; a ConfigError names the registered objectives, or the default at fault."""
    spec = OBJECTIVES.get(name)
    if spec is None:
        raise ConfigError(
            f"objective.name={name!r}; choose one of: {', '.join(OBJECTIVES)} (or register your "
            "own with ibpo.algo.objectives.register_objective, docs/objectives.md)"
        )
    where = f"objective {name!r} (its register_objective call)"
    unknown = [k for k in spec.kwargs if k not in SURROGATE_PARAMETERS]
    if unknown:
        raise ConfigError(
            f"{where}: not an objective parameter: {', '.join(unknown)}; a surrogate's keyword "
            f"arguments are among {', '.join(SURROGATE_PARAMETERS)}"
        )
    try:
        section = config.section_with("objective", {"name": name, **defaults(spec)})
        _check_choices(section)
    except ConfigError as e:
        raise ConfigError(f"{where}: default {e}") from None
    return spec


def check_objective(obj: ObjectiveConfig) -> ObjectiveSpec:
    """The objective section: its own rules (config.check_objective), a registered name, the
    algorithm's names for weights, gate, aggregation and kl_estimator, and no surrogate
    parameter set that the objective does not take. -> its spec."""
    config.check_objective(obj)
    spec = objective_spec(obj.name)
    _check_choices(obj)
    for key in SURROGATE_PARAMETERS:
        if getattr(obj, key) is not None and key not in spec.kwargs:
            raise ConfigError(
                f"objective.{key} does not apply to '{obj.name}' (it takes: "
                f"{', '.join(spec.kwargs) or 'none'}); set objective.{key}=null"
            )
    return spec


def _check_choices(obj: ObjectiveConfig) -> None:
    for key, names in CHOICES.items():
        value = getattr(obj, key)
        if value is not None and value not in names:
            null = _FIELDS[key].metadata.get("null")
            tail = f" (or null: {null})" if null else ""
            raise ConfigError(f"objective.{key}={value!r}; choose one of: {', '.join(names)}{tail}")


def resolve_params(obj: ObjectiveConfig) -> ResolvedObjective:
    """An objective section -> its ResolvedObjective: the registration's surrogate and level
    with the section's parameters. The section is checked (check_objective); one that resolve
    filled is used as it is (a run's config resolves once), and in one built by hand the None
    parameters take the objective's defaults."""
    spec = check_objective(obj)
    obj = copy.copy(obj)
    for key, value in defaults(spec).items():
        if getattr(obj, key) is None:
            setattr(obj, key, value)
    return ResolvedObjective(
        obj.name,
        spec.surrogate,
        {key: getattr(obj, key) for key in spec.kwargs},
        obj.aggregation,
        obj.scale_rewards,
        spec.repairs,
        obj.kl_coef,
        obj.overlong_buffer,
        obj.overlong_penalty,
        KL_ESTIMATORS[obj.kl_estimator],
        obj.behavior_policy,
        obj.importance_sampling,
        obj.is_cap,
        spec.level,
    )
