"""Train -> evaluate -> push with nothing repeated: `ibpo eval` reads the base model and its
quantization from the adapter's run, `ibpo push` finds that evaluation at its default place, and
`run.hub_repo_id` uploads after the final held-out evaluation, which the card reports.

A real tiny run (tiny Qwen3 from a config, 2 steps) in a folder laid out as a user's: the run in
outputs/run, evaluations in outputs/eval/. The Hub is mocked (HfApi's three calls)."""

import json
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from ibpo.cli import main
from ibpo.config import ConfigError
from ibpo.evaluation.adapter import fill_from_adapter, trained_on

# the journeys train the tiny model in this process: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "benchmarks"
FAKE_TOKEN = "hf_" + "FakeTokenForJourneys" * 2


def _mock_hub(monkeypatch) -> list[dict]:
    """HfApi's calls the push makes; each upload records the card it carried."""
    from huggingface_hub import HfApi

    uploads = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **k: f"https://hf.co/{repo_id}")
    monkeypatch.setattr(HfApi, "repo_info", lambda self, repo_id, **k: Namespace(private=True))

    def upload_folder(self, **kwargs):
        card = (Path(kwargs["folder_path"]) / "README.md").read_text()
        uploads.append({"repo_id": kwargs["repo_id"], "card": card})

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return uploads


@pytest.fixture(scope="module")
def home(tiny_model_dir, tmp_path_factory):
    """A user's folder after `ibpo train` with run.hub_repo_id set (the uploads it made)."""
    home = tmp_path_factory.mktemp("journey")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(home)
        uploads = _mock_hub(mp)
        code = main(
            [
                "train",
                f"model.name={tiny_model_dir}",
                "model.quantization=none",
                "train.steps=2",
                "train.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=4",
                "rollout.eval_max_new_tokens=4",
                "data.eval_size=2",
                "run.output_dir=outputs/run",
                "run.hub_repo_id=alice/tiny-journey",
            ]
        )
    assert code == 0
    return home, uploads


def test_push_to_hub_uploads_after_the_final_evaluation_with_it_in_the_card(home):
    folder, uploads = home
    summary = json.loads((folder / "outputs" / "run" / "summary.json").read_text())
    after = summary["eval_after"]
    assert after and "accuracy" in after  # the final evaluation ran before the upload
    (upload,) = uploads
    assert upload["repo_id"] == "alice/tiny-journey"
    line = next(ln for ln in upload["card"].splitlines() if "held-out accuracy after" in ln)
    assert line.endswith(f"| {after['accuracy']:.3f} |")


def _eval(*extra: str) -> int:
    args = ["eval", "gsm8k", "--data", str(FIXTURES / "gsm8k.jsonl"), "--limit", "1", "--n", "1"]
    return main([*args, "--max-new-tokens", "4", "--temperature", "0", "--no-progress", *extra])


def test_eval_reads_the_base_from_the_run_and_push_finds_the_evaluation(
    home, tiny_model_dir, monkeypatch, capsys
):
    folder, _ = home
    monkeypatch.chdir(folder)
    # no --model, no --quantization: the run's recipe says what the adapter was trained on
    assert _eval("--adapter", "outputs/run/adapter") == 0
    captured = capsys.readouterr()
    assert f"eval: base model {tiny_model_dir}, from " in captured.err
    assert "outputs/run/config.yaml" in captured.err
    (evaluated,) = (folder / "outputs" / "eval").glob("gsm8k-*/summary.json")
    s = json.loads(evaluated.read_text())
    assert s["model"] == tiny_model_dir and s["quantization"] == "none"
    assert s["adapter_path"] == str((folder / "outputs" / "run" / "adapter").resolve())

    # push finds it at the default place; so does a summary written before adapter_path existed
    for legacy in (False, True):
        if legacy:
            s.pop("adapter_path")
            evaluated.write_text(json.dumps(s))
        stage = folder / f"stage-{legacy}"
        args = ["push", "outputs/run", "--repo-id", "alice/tiny", "--dry-run"]
        assert main([*args, "--staging-dir", str(stage)]) == 0
        card = (stage / "README.md").read_text()
        assert "## Evaluation" in card and "| gsm8k | " in card
        assert "model-index" in card

    # from anywhere else, the run's sibling eval/ folder is still found (outputs/eval)
    monkeypatch.chdir(folder / "outputs")
    stage = folder / "stage-elsewhere"
    args = ["push", "run", "--repo-id", "alice/tiny", "--dry-run", "--staging-dir", str(stage)]
    assert main(args) == 0
    assert "| gsm8k | " in (stage / "README.md").read_text()


def test_push_leaves_out_another_adapters_evaluation(home, monkeypatch):
    folder, _ = home
    monkeypatch.chdir(folder)
    other = folder / "other"
    shutil.copytree(folder / "outputs" / "run", other, ignore=shutil.ignore_patterns("eval*"))
    fake = folder / "outputs" / "eval" / "gsm8k-elsewhere+adapter"
    fake.mkdir(parents=True, exist_ok=True)
    summary = next((folder / "outputs" / "eval").glob("gsm8k-*+adapter/summary.json"))
    s = json.loads(summary.read_text())
    (fake / "summary.json").write_text(json.dumps({**s, "adapter_path": str(other / "adapter")}))
    stage = folder / "stage-other"
    args = ["push", "outputs/run", "--repo-id", "alice/tiny", "--dry-run"]
    assert main([*args, "--staging-dir", str(stage)]) == 0
    # the run's own evaluation only (two rows if the other adapter's were taken too) ...
    assert (stage / "README.md").read_text().count("| gsm8k | ") == 1
    # ... and the other adapter's card has its own one
    stage2 = folder / "stage-other2"
    args = ["push", str(other), "--repo-id", "a/b", "--dry-run", "--staging-dir", str(stage2)]
    assert main(args) == 0
    assert (stage2 / "README.md").read_text().count("| gsm8k | ") == 1
    shutil.rmtree(fake)


# --- what an adapter records, without loading a model --------------------------------------------


def _adapter(tmp_path: Path, base: str, recipe: dict | None, where: str = "checkpoints/step-2"):
    run = tmp_path / "run"
    adapter = run / where / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    if recipe is not None:
        (run / "config.yaml").write_text(yaml.safe_dump({"model": recipe}))
    return str(adapter)


def _args(adapter, model=None, quantization=None, revision=None) -> Namespace:
    return Namespace(
        adapter=adapter, model=model, quantization=quantization, model_revision=revision
    )


def test_a_checkpoints_adapter_takes_the_runs_recipe(tmp_path):
    recipe = {"name": "org/base", "revision": "abc123", "quantization": "nf4"}
    args = _args(_adapter(tmp_path, "/cache/snapshots/x", recipe))
    notes = fill_from_adapter(args)
    assert (args.model, args.model_revision, args.quantization) == ("org/base", "abc123", "nf4")
    assert notes[0].startswith("base model org/base, from ") and "config.yaml" in notes[0]
    assert notes[1].startswith("quantization nf4, from ")


def test_given_settings_that_differ_are_kept_with_a_warning(tmp_path):
    adapter = _adapter(tmp_path, "/cache/snapshots/x", {"name": "org/base", "quantization": "nf4"})
    args = _args(adapter, model="org/other", quantization="none")
    notes = fill_from_adapter(args)
    assert (args.model, args.quantization) == ("org/other", "none")
    assert len(notes) == 2 and all(n.startswith("warning: ") for n in notes)
    assert "org/base" in notes[0] and "nf4 base" in notes[1]
    # either recorded spelling of the base matches, with or without a trailing slash
    for model in ("org/base", "/cache/snapshots/x/"):
        assert fill_from_adapter(_args(adapter, model=model, quantization="nf4")) == []


def test_an_adapter_without_a_recipe_says_what_it_cannot_tell(tmp_path):
    args = _args(_adapter(tmp_path, "org/base", None, where="."))
    notes = fill_from_adapter(args)
    assert (args.model, args.quantization) == ("org/base", "none")
    assert "does not record it" in notes[1] and "--quantization nf4" in notes[1]
    assert trained_on(args.adapter).quantization is None


def test_an_adapter_recording_no_base_names_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="records no base model.*Fix: --model"):
        fill_from_adapter(_args(str(tmp_path / "empty")))
    for typo in ("outputs/run/adaptr", "./adapter"):  # a path that is not there: not a Hub id
        with pytest.raises(ConfigError, match="no adapter folder .*Fix: --adapter"):
            fill_from_adapter(_args(str(tmp_path / typo) if typo[0] == "." else typo))
    args = _args(None)  # no adapter: nothing is filled in (the CLI takes the embedded model)
    assert fill_from_adapter(args) == [] and args.model is None and args.quantization == "none"


def test_a_pushed_adapters_recipe_beside_it_counts(tmp_path):
    adapter = tmp_path / "downloaded"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "a/b"}))
    recipe = {"model": {"name": "a/b", "quantization": "nf4"}}
    (adapter / "ibpo_config.yaml").write_text(yaml.safe_dump(recipe))
    args = _args(str(adapter))
    fill_from_adapter(args)
    assert (args.model, args.quantization) == ("a/b", "nf4")
