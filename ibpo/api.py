"""The Python API: `ibpo.train(...)`, a run from Python as `ibpo train` runs it from the shell.

    import ibpo

    def brief(completions, **kwargs):
        return [1.0 if len(c) < 40 else 0.0 for c in completions]

    result = ibpo.train(
        overrides={"train.steps": 20},
        dataset=[{"question": "What is 2 + 3?", "answer": "5"}, ...],
        reward_funcs=["math", brief],
        reward_weights=[1.0, 0.5],
    )
    result.summary["eval_after"], result.adapter

`recipe`: a YAML path, a Config, a trl.GRPOConfig (its fields set away from their defaults
read as TRL's names: ibpo/trl_config.py) or None (the embedded CPU demo's defaults);
`overrides`: "section.key=value" strings or a mapping {"section.key": value}, applied on top
(a key may be one of TRL's GRPOConfig names). `dataset`: a `datasets.Dataset` or a list of
dicts, in place of data.dataset (every column reaches the reward functions; the held-out rows
are carved out of it as for a local file; its string prompts are asked as given unless
data.prompt_template says otherwise), or a `datasets.IterableDataset`, streamed (read as drawn,
its held-out rows its first ones unless eval_dataset= gives them). `reward_funcs`: a reward function
in TRL's convention, or a list of them, where a string is a built-in name, an import path or a
reward model's Hub id, and a pair (model, tokenizer) a reward model
(ibpo/rewards/functions.py); `reward_weights`: one weight each. `callbacks`: objects with
TRL-like hooks (ibpo/run/callbacks.py). `eval_dataset`: held-out rows in place of
data.eval.dataset. `peft_config`: a peft.LoraConfig in place of the model.lora_* keys.
`tools`: functions the policy may call in its rollouts, as TRL's tools= (type hints and a
docstring describe each), or names as rollout.tools takes them (`"python"`: the built-in
sandboxed interpreter; docs/tools.md). The run's
config.yaml records a Python function by its import path `module:qualname`, which resumes from
YAML only for a function defined at a module's top level; passing the functions again always
does.

The CLI (`ibpo train`, recipes/train.py) loads the recipe once and calls `run_loaded`; under
`accelerate launch` every process does, as every process runs the CLI. Configuration errors
raise ConfigError (the CLI prints its one line and exits 2), a reward function failing in the
held-out evaluation before training RewardError (one line, exit 6); how the run ended is
`result.status` (summary.json's `status` and `exit_code`, as the CLI exits).

Not here: the run itself (trainer.py), the schema (config.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ibpo.catalog import resolve_recipe
from ibpo.config import Config, ConfigError
from ibpo.data import IN_MEMORY
from ibpo.recipe import load_config
from ibpo.rewards.functions import import_path
from ibpo.tools.schema import BUILTIN
from ibpo.trainer import run_recipe

# a built-in tool passed as a function is recorded by its name (ibpo.tools.schema.BUILTIN)
BUILTIN_NAMES = {fn: name for name, fn in BUILTIN.items()}


@dataclass
class TrainResult:
    """What a run left: its summary (summary.json's), the adapter's folder and the output
    folder."""

    summary: dict
    adapter: Path | None
    output_dir: Path

    @property
    def status(self) -> str:
        return self.summary["status"]


def train(
    recipe: str | Path | Config | Any = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    *,
    dataset=None,
    reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
    reward_weights: Sequence[float] | None = None,
    callbacks: Sequence[Any] | None = None,
    eval_dataset=None,
    peft_config=None,
    tools: Sequence[Callable | str] | None = None,
) -> TrainResult:
    """Train: the recipe with its overrides, on `dataset` when given, graded by `reward_funcs`
    when given, observed and steered by `callbacks`, held out on `eval_dataset`, with the
    adapter `peft_config` (module docstring). What the arguments set in the configuration joins
    the overrides, so that the recipe loads (and is checked) once. -> TrainResult."""
    if isinstance(recipe, (str, Path)):  # a file, or a packaged recipe's name (ibpo recipes)
        recipe = resolve_recipe(str(recipe))
    extra: dict[str, Any] = {}
    for arg, key, rows in (("dataset", "data.dataset", dataset),
                           ("eval_dataset", "data.eval.dataset", eval_dataset)):  # fmt: skip
        if rows is None:
            continue
        if isinstance(rows, (str, Path)):
            raise ConfigError(
                f"{arg}= takes rows (a datasets.Dataset or a list of dicts). Fix: for a file or "
                f"Hub id, pass overrides={{'{key}': {str(rows)!r}}}"
            )
        extra[key] = IN_MEMORY  # what the data is decides the prompts' default
    if peft_config is not None:
        extra.update(_lora_settings(peft_config))
    funcs = None
    if reward_funcs is not None:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        names = [f if isinstance(f, str) else import_path(f) for f in funcs]
        extra["reward.functions"] = names if len(names) > 1 else names[0]
    if reward_weights is not None:
        extra["reward.weights"] = [float(w) for w in reward_weights]
    if tools is not None:  # recorded by name, as reward functions are; built-ins by theirs
        tools = list(tools)
        extra["rollout.tools"] = [
            t if isinstance(t, str) else BUILTIN_NAMES.get(t, None) or import_path(t) for t in tools
        ]
    cfg = load_config(recipe, _with_overrides(overrides, extra))
    return run_loaded(cfg, dataset, funcs, callbacks, eval_dataset, peft_config, tools)


def run_loaded(
    cfg: Config,
    rows=None,
    reward_funcs=None,
    callbacks=None,
    eval_rows=None,
    peft_config=None,
    tools=None,
) -> TrainResult:
    """Run a config as load_config returned it (checked and resolved; `ibpo train` loads it
    once and calls this), with what `train` was given in Python. -> TrainResult."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    summary = run_recipe(
        cfg,
        rows=rows,
        reward_funcs=reward_funcs,
        callbacks=callbacks,
        eval_rows=eval_rows,
        peft_config=peft_config,
        tools=tools,
    )
    adapter = summary.get("adapter")
    return TrainResult(summary, Path(adapter) if adapter else None, Path(cfg.run.output_dir))


def _with_overrides(overrides, extra: dict[str, Any]):
    """`overrides` (a mapping, a list of "k=v" strings or None) with `extra` after them, its
    values as given (in a list: (key, value) pairs, which load_config takes as they are)."""
    if isinstance(overrides, Mapping):
        return {**overrides, **extra}
    return [*(overrides or []), *extra.items()]


def _lora_settings(peft_config) -> dict[str, Any]:
    """A LoraConfig given in Python: its rank, alpha and target modules, recorded in the model
    section (config.yaml, `ibpo plan`); the object itself is used as it is."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(
            f"peft_config= is a {type(peft_config).__name__}; ibpo trains LoRA adapters. Fix: "
            "pass a peft.LoraConfig (rsLoRA, DoRA and modules_to_save are its options)"
        )
    settings = {"model.lora_r": peft_config.r, "model.lora_alpha": peft_config.lora_alpha}
    targets = peft_config.target_modules
    if targets is not None:
        settings["model.lora_target_modules"] = (
            targets if isinstance(targets, str) else sorted(targets)
        )
    return settings
