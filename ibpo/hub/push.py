"""Push a trained LoRA adapter to the Hugging Face Hub with a model card.

`ibpo push OUTPUT_DIR --repo-id USER/NAME` (and `run.hub_repo_id` at the end of a run) uploads
what someone using the adapter needs, assembled first in a staging folder:

    adapter_config.json, adapter_model.safetensors  the LoRA adapter (PEFT format)
    tokenizer files                                 as the trainer saved them beside the adapter
    README.md                                       the model card, model-index included (card.py)
    ibpo_config.yaml                                the run's recipe (secret-like keys dropped)
    summary.json, metrics.jsonl, plots/*.png        the run's record, when present

Never checkpoints, optimizer or scheduler state, RNG states or evaluation samples. OUTPUT_DIR is a
run's output_dir, or an adapter folder such as `<output_dir>/checkpoints/step-N/adapter` (a run
that stopped early). What the card says is card.py's business.

The token comes only from HF_TOKEN or the cached `hf auth login` (huggingface_hub reads them); it is
never printed or written, and staging refuses to finish if a staged file contains it. Repos are
private unless --public; pushing privately to an existing public repo is refused.

Not here: the card's contents and its metadata, model-index included (card.py), merging the
adapter into the base, or pushing checkpoints for resuming elsewhere. The card goes up with the rest
in one upload_folder commit, not by `ModelCard.push_to_hub` (which posts it to the Hub's validator
first).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from ibpo.hub.card import (
    ADAPTER_FILES,
    RUN_FILES,
    TOKENIZER_FILES,
    HubError,
    base_model_id,
    build_model_card,
    check_repo_id,
    locate,
    plot_files,
    run_config,
    run_files,
    scrub,
)

_HF_TOKEN_SHAPE = re.compile(rb"hf_[A-Za-z0-9]{30,}")
_TEXT_SUFFIXES = {".json", ".jsonl", ".yaml", ".md", ".txt", ".jinja", ".model"}


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
    else:  # a local base with no known Hub id: its folder name, not the path on this machine
        config["base_model_name_or_path"] = scrub(config.get("base_model_name_or_path"))
    dest.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prepare_upload(
    output_dir: Path,
    repo_id: str,
    staging_dir: Path,
    eval_dirs=(),
    base_model: str | None = None,
    token: str | None = None,
) -> Path:
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
    files = run_files(loc)
    cfg = run_config(files)
    model = (cfg or {}).get("model", {})
    base_id = base_model_id(model.get("name"), base_model)
    _stage_adapter_config(
        loc["adapter"] / ADAPTER_FILES[0],
        staging / ADAPTER_FILES[0],
        base_id,
        model.get("revision") if not base_model else None,
    )
    for name in (ADAPTER_FILES[1], *TOKENIZER_FILES):
        if (loc["adapter"] / name).is_file():
            shutil.copyfile(loc["adapter"] / name, staging / name)
    for name in RUN_FILES:
        if name == "summary.json" and name in files:  # its paths are this machine's
            summary = scrub(json.loads(files[name].read_text()))
            (staging / name).write_text(json.dumps(summary, indent=2) + "\n")
        elif name in files:
            shutil.copyfile(files[name], staging / name)
    if cfg:
        (staging / "ibpo_config.yaml").write_text(yaml.safe_dump(scrub(cfg), sort_keys=False))
    for plot in plot_files(loc):
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
        return (
            "the Hub rejected the token (401). Fix: `hf auth login` with a valid token, or set "
            "HF_TOKEN"
        )
    if status == 403:
        return (
            f"the token may not write to '{repo_id.split('/')[0]}' (403: {first}). Fix: a token "
            "with write access (`hf auth login`), or another --repo-id namespace"
        )
    return f"pushing to '{repo_id}' failed ({type(error).__name__}: {first}). Check the connection"


def push(
    output_dir: Path,
    repo_id: str,
    private: bool = True,
    eval_dirs=(),
    commit_message: str | None = None,
    token: str | None = None,
    base_model: str | None = None,
) -> str:
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
        raise HubError(
            "no Hugging Face token. Fix: `hf auth login` (a token with write access), "
            "or set HF_TOKEN"
        )
    with tempfile.TemporaryDirectory(prefix="ibpo-push-") as tmp:
        staging = prepare_upload(
            output_dir, repo_id, Path(tmp) / "upload", eval_dirs, base_model, token
        )
        api = hf.HfApi()
        try:
            url = api.create_repo(repo_id, token=token, private=private, exist_ok=True)
            # create_repo ignores `private` for a repo that exists: never publish by surprise
            if private and not api.repo_info(repo_id, token=token).private:
                raise HubError(
                    f"'{repo_id}' exists and is public; nothing was pushed. Fix: "
                    "`ibpo push OUTPUT_DIR --public` to push to it, or another "
                    "--repo-id (run.hub_repo_id)"
                )
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
    p.add_argument(
        "--eval-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="an `ibpo eval` --output-dir to report (repeatable)",
    )
    p.add_argument(
        "--base-model", help="Hub id of the base when it was trained from a local folder"
    )
    p.add_argument("--commit-message")
    p.add_argument(
        "--dry-run", action="store_true", help="write the staging folder and list it; no network"
    )
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
        url = push(
            args.output_dir,
            args.repo_id,
            not args.public,
            args.eval_dir,
            args.commit_message,
            base_model=args.base_model,
        )
    except HubError as e:
        print(f"ibpo push: error: {e}", file=sys.stderr)
        return 2
    note = "public; an existing private repo stays private" if args.public else "private"
    print(f"pushed to {url} ({note})")
    return 0
