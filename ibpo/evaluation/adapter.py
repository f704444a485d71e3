"""What a LoRA adapter was trained on: its base model, the base's revision and quantization, read
from what the adapter carries, so that `ibpo eval BENCH --adapter DIR` needs no --model or
--quantization.

Sources, first found wins: the run's recipe (config.yaml, which `ibpo train` writes in the run
folder, found in the adapter folder or up to three folders above it, as for
`<output_dir>/checkpoints/step-N/adapter`; or ibpo_config.yaml, which `ibpo push` uploads beside
the adapter), then the adapter's adapter_config.json (`base_model_name_or_path`, `revision`; no
quantization). A Hub id is read through huggingface_hub's download cache.

Not here: loading the model (modeling.py) or checking that the adapter fits the base (PEFT does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ibpo.config import ConfigError

RECIPES = ("config.yaml", "ibpo_config.yaml")  # the run's own, the pushed copy


@dataclass
class TrainedOn:
    """The base an adapter was trained on; `names` holds every spelling of it that was recorded
    (the recipe's model.name, the adapter config's path or Hub id)."""

    model: str | None = None
    revision: str | None = None
    quantization: str | None = None  # None: not recorded (no recipe)
    names: set[str] = field(default_factory=set)
    source: str = ""


def _local_files(adapter: Path) -> tuple[Path | None, Path | None]:
    config = adapter / "adapter_config.json"
    folders = [adapter, *list(adapter.parents)[:3]]
    recipe = next((d / n for d in folders for n in RECIPES if (d / n).is_file()), None)
    return (config if config.is_file() else None), recipe


def _hub_files(repo: str) -> tuple[Path | None, Path | None]:
    from huggingface_hub import hf_hub_download

    found = []
    for name in ("adapter_config.json", "ibpo_config.yaml"):
        try:  # offline with the files cached works; anything else: not recorded
            found.append(Path(hf_hub_download(repo, name)))
        except Exception:
            found.append(None)
    return found[0], found[1]


def _read(path: Path | None, load) -> dict:
    try:
        tree = load(path.read_text()) if path else {}
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return tree if isinstance(tree, dict) else {}


def trained_on(adapter: str) -> TrainedOn:
    """What `adapter` (a local folder or a Hub id) records about its base; empty if nothing."""
    path = Path(adapter)
    if not path.is_dir() and (adapter.startswith((".", "/", "~")) or adapter.count("/") > 1):
        raise ConfigError(
            f"no adapter folder '{adapter}' (nor is it a Hub id). Fix: --adapter "
            "<output_dir>/adapter, a checkpoint's adapter folder, or a Hub id USER/NAME"
        )
    config, recipe = _local_files(path) if path.is_dir() else _hub_files(adapter)
    peft = _read(config, json.loads)
    model = _read(recipe, yaml.safe_load).get("model") or {}
    model = model if isinstance(model, dict) else {}
    found = TrainedOn()
    base = peft.get("base_model_name_or_path")
    if isinstance(base, str) and base:
        found.model, found.revision = base, peft.get("revision")
        found.names.add(base.rstrip("/"))
        found.source = str(config)
    if isinstance(model.get("name"), str):  # the name the user trained with: preferred
        found.model, found.revision = model["name"], model.get("revision")
        found.names.add(model["name"].rstrip("/"))
        found.quantization = model.get("quantization")
        found.source = str(recipe)
    return found


def fill_from_adapter(args) -> list[str]:
    """Set args.model, args.model_revision and args.quantization that were not given from what
    the adapter records; -> the lines to print (where they came from; given ones that differ)."""
    notes: list[str] = []
    found = trained_on(args.adapter) if args.adapter else TrainedOn()
    if args.model is None:
        if args.adapter and found.model is None:
            raise ConfigError(
                f"adapter '{args.adapter}' records no base model (no adapter_config.json or run "
                "recipe could be read). Fix: --model, the base it was trained on"
            )
        if found.model is not None:
            args.model = found.model
            if args.model_revision is None:
                args.model_revision = found.revision
            notes.append(f"base model {args.model}, from {found.source}")
    elif found.names and args.model.rstrip("/") not in found.names:
        notes.append(
            f"warning: --model {args.model} is not the base the adapter was trained on "
            f"({', '.join(sorted(found.names))}, per {found.source})"
        )
    if args.quantization is None:
        args.quantization = found.quantization or "none"
        if found.quantization:
            notes.append(f"quantization {args.quantization}, from {found.source}")
        elif args.adapter:
            notes.append(
                "quantization none: the adapter does not record it (no run recipe); "
                "--quantization nf4 if it was trained on a 4-bit base"
            )
    elif found.quantization and args.quantization != found.quantization:
        notes.append(
            f"warning: --quantization {args.quantization}, but the adapter was trained on a "
            f"{found.quantization} base (per {found.source})"
        )
    return notes
