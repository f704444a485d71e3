"""`ibpo push`: the staged upload, the model card and the push path, on a real tiny run.

The run is made by the real trainer (tiny Qwen3, 2 steps, a reward that alternates so the LoRA
weights move) and evaluated by the real gsm8k evaluation on two fixture problems. The network is
mocked, except in the one `network` test, which needs HF_TOKEN and the Hub.
"""

import json
import os
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ibpo.cli import main as cli_main
from ibpo.hub import push as hub
from ibpo.hub.card import license_for
from ibpo.hub.push import HubError, build_model_card, check_repo_id, prepare_upload, push
from ibpo.rewards import GRADERS

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "benchmarks"
FAKE_TOKEN = "hf_" + "FakeTokenForTests" * 2  # the shape of a real token, 37 characters
RUN_RECORD = {"ibpo_config.yaml", "summary.json", "metrics.jsonl", "README.md"}
# the run trains the tiny model in this process: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """A finished run's output_dir (adapter, checkpoints, records, a plot, an evaluation)."""
    import ibpo.trainer as trainer
    from ibpo.evaluation.cli import main as eval_main
    from ibpo.recipe import load_config

    out = tmp_path_factory.mktemp("hub") / "run"
    cfg = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "model.quantization=none",
            "train.steps=2",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "rollout.eval_max_new_tokens=4",
            "data.eval_size=4",
            "run.save_every=1",
            "train.learning_rate=0.05",
            f"run.output_dir={out}",
        ],
    )
    calls = iter(range(10_000))  # a random tiny model never answers: force a learning signal
    GRADERS["alternating"] = lambda text, answer: float(next(calls) % 2)
    try:
        cfg.reward.functions = "alternating"
        trainer.run_recipe(cfg)
    finally:
        del GRADERS["alternating"]
    if not list(out.glob("plots/*.png")):  # the trainer may write plots itself
        (out / "plots").mkdir(exist_ok=True)
        (out / "plots" / "reward.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    args = [
        "--model",
        tiny_model_dir,
        "--adapter",
        str(out / "adapter"),
        "--data",
        str(FIXTURES / "gsm8k.jsonl"),
        "--limit",
        "2",
        "--n",
        "2",
        "--max-new-tokens",
        "4",
        "--output-dir",
        str(out / "eval" / "gsm8k"),
        "--no-progress",
    ]
    assert eval_main(args, benchmark="gsm8k") == 0
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(run, dest)
    return dest


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _card_data(text: str):
    from huggingface_hub import ModelCard

    return ModelCard(text).data


# --- staging -------------------------------------------------------------------------------------


def test_staging_holds_exactly_the_upload(run, tmp_path):
    ckpt = run / "checkpoints" / "step-2"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "process-0.pt").is_file()
    staged = prepare_upload(run, "alice/tiny-ibpo", tmp_path / "stage")
    tokenizer = _files(run / "adapter") - {"README.md", *hub.ADAPTER_FILES}
    assert {"tokenizer.json", "tokenizer_config.json"} <= tokenizer
    plots = {f"plots/{p.name}" for p in run.glob("plots/*.png")}
    assert _files(staged) == {*hub.ADAPTER_FILES, *tokenizer, *RUN_RECORD, *plots}
    assert (staged / "adapter_model.safetensors").read_bytes() == (
        run / "adapter" / "adapter_model.safetensors"
    ).read_bytes()
    assert (staged / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    with pytest.raises(HubError, match="not empty"):  # never mixes with what a folder holds
        prepare_upload(run, "alice/tiny-ibpo", staged)


def test_no_local_path_is_staged(run, tmp_path, tiny_model_dir):
    """Absolute paths (the output_dir, a local base model folder) can name a user or machine:
    the summary, the recipe, the card and the adapter config carry none."""
    staged = prepare_upload(run, "alice/tiny-ibpo", tmp_path / "stage")
    assert str(run) in (run / "summary.json").read_text()  # the local record has them
    for f in staged.rglob("*"):
        if f.is_file() and f.suffix in {".json", ".yaml", ".md", ".jsonl"}:
            text = f.read_text()
            assert str(run.parent) not in text and tiny_model_dir not in text, f.name
    assert json.loads((staged / "summary.json").read_text())["adapter"] == "<local>/adapter"


def test_staged_adapter_reloads_with_identical_outputs(run, tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    staged = prepare_upload(run, "alice/tiny-ibpo", tmp_path / "stage")
    ids = torch.tensor([[5, 9, 17, 30, 3, 22, 8]])

    def logits(adapter: Path | None) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter))
        with torch.no_grad():
            return model.eval()(ids).logits

    original, reloaded = logits(run / "adapter"), logits(staged)
    assert torch.equal(original, reloaded)
    assert not torch.allclose(original, logits(None))  # the adapter is not the identity


def test_a_checkpoint_adapter_is_pushed_with_its_own_metrics(run, tmp_path):
    adapter = run / "checkpoints" / "step-1" / "adapter"
    staged = prepare_upload(adapter, "alice/tiny-ibpo-step1", tmp_path / "stage")
    assert "summary.json" not in _files(staged)  # the summary describes the end of the run
    steps = [json.loads(x)["step"] for x in (staged / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
    assert "checkpoint step 1" in (staged / "README.md").read_text()


def test_missing_adapter_names_the_fix(run, tmp_path):
    with pytest.raises(HubError, match="run `ibpo train` first"):
        prepare_upload(tmp_path, "alice/x", tmp_path / "stage")
    stopped = _copy(run, tmp_path)
    shutil.rmtree(stopped / "adapter")
    with pytest.raises(HubError, match=r"checkpoints/step-2/adapter"):
        prepare_upload(stopped, "alice/x", tmp_path / "stage")


@pytest.mark.parametrize(
    "repo_id",
    ["noslash", "a/b/c", "a//b", "-a/b", "a/b-", "a/b.git", "a--b/c", "a/b..c", "", "a b/c", "a/"],
)
def test_malformed_repo_ids_are_rejected(repo_id):
    with pytest.raises(HubError, match="Fix: --repo-id"):
        check_repo_id(repo_id)


def test_good_repo_ids_pass():
    for repo_id in ("alice/qwen3-1.7b-gsm8k-ibpo", "Org_1/x.y", "u/" + "n" * 90):
        assert check_repo_id(repo_id) == repo_id


# --- model card ----------------------------------------------------------------------------------


def test_card_parses_and_reports_the_run(run):
    from ibpo.evaluation.cli import markdown_row

    card = build_model_card(run, "alice/tiny-ibpo")
    data = _card_data(card)
    assert data.library_name == "peft" and data.pipeline_tag == "text-generation"
    assert data.base_model is None and data.license == "other"  # a local base folder
    assert "base_model" not in data.to_dict() and "names no `base_model`" in card
    assert {"ibpo", "lora", "peft", "reinforcement-learning"} <= set(data.tags)
    assert "qlora" not in data.tags  # model.quantization=none
    assert "set it to the base model's license" in card
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    assert f"before (greedy, n=4) | {before:.3f} |" in card
    assert f"after (greedy, n=4) | {after:.3f} |" in card
    rewards = [json.loads(x)["reward"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert f"| reward, first step | {rewards[0]:.3f} |" in card
    assert f"| reward, max | {max(rewards):.3f} |" in card
    assert "| steps | 2 |" in card and "| status | completed |" in card
    assert "| steps logged | 2 |" in card
    for text in (
        "arXiv 2604.13088",
        "arXiv 2501.17974",
        "@article{",
        "Token Gradient Cancellation",
    ):
        assert text in card
    evaluation = json.loads((run / "eval" / "gsm8k" / "summary.json").read_text())
    assert markdown_row(evaluation).strip() in card  # the real evaluation's row
    assert 'PeftModel.from_pretrained(base, "alice/tiny-ibpo")' in card
    assert "lora_r: 16" in card and "reward:\n  functions: alternating" in card  # the recipe
    assert all(f"](plots/{p.name})" in card for p in run.glob("plots/*.png"))


def test_model_index_holds_the_adapters_evaluation(run, tmp_path, monkeypatch):
    """The written README.md parses back with huggingface_hub, model-index and all; the card is
    never sent to the Hub's validator (it needs the network)."""
    from huggingface_hub import ModelCard, metadata_load

    def refuse(*args, **kwargs):
        raise AssertionError("ModelCard.validate posts the card to the Hub")

    monkeypatch.setattr(ModelCard, "validate", refuse)
    staged = prepare_upload(run, "alice/tiny-ibpo", tmp_path / "stage")
    card = ModelCard.load(staged / "README.md")
    assert "model-index" in metadata_load(staged / "README.md")
    assert card.data.model_name == "tiny-ibpo"
    s = json.loads((run / "eval" / "gsm8k" / "summary.json").read_text())
    got = {r.metric_type: r for r in card.data.eval_results}
    assert {k: r.metric_value for k, r in got.items()} == {
        "accuracy": s["avg@2"],
        "pass@1": s["pass@1"],
        "pass@2": s["pass@2"],
        "maj@2": s["maj@2"],
    }
    for r in got.values():
        assert r.task_type == "text-generation" and r.dataset_type == "gsm8k"  # --data: local
        assert r.dataset_name == "gsm8k (gsm8k.jsonl, local)" and r.dataset_split is None
        assert r.metric_name.endswith("(2 problems, T=0.6, 4 new tokens)")
    assert got["accuracy"].metric_name.startswith("avg@2 ")
    assert "/" not in str(card.data.to_dict()["model-index"])  # no local path


def _eval_copy(run: Path, dest: Path, **changes) -> None:
    dest.mkdir(parents=True)
    s = json.loads((run / "eval" / "gsm8k" / "summary.json").read_text())
    (dest / "summary.json").write_text(json.dumps({**s, **changes}))


def test_model_index_names_hub_benchmarks_and_leaves_out_the_base_alone(run, tmp_path):
    from ibpo.evaluation.benchmarks import BENCHMARKS

    out = _copy(run, tmp_path)
    shutil.rmtree(out / "eval")
    hub_data = {"data": BENCHMARKS["gsm8k"].dataset, "revision": "a" * 40, "problems": 1319}
    scores = {"avg@2": 0.25, "pass@1": 0.25, "pass@2": 0.5, "maj@2": 0.5}
    _eval_copy(run, out / "eval" / "hub", **hub_data, **scores)
    base = {"adapter": None, "avg@2": 0.75, "pass@1": 0.75, "pass@2": 1.0, "maj@2": 1.0}
    _eval_copy(run, out / "eval" / "base", **hub_data, **base)
    card = build_model_card(out, "alice/x")
    assert "| gsm8k | tiny-qwen30 | - | 2 | 0.750 |" in card  # the base's row is in the table
    results = _card_data(card).eval_results
    assert {r.metric_type: r.metric_value for r in results} == {
        "accuracy": 0.25,
        "pass@1": 0.25,
        "pass@2": 0.5,
        "maj@2": 0.5,
    }
    r = results[0]
    where = (r.dataset_type, r.dataset_name, r.dataset_config, r.dataset_split, r.dataset_revision)
    assert where == ("openai/gsm8k", "gsm8k", "main", "test", "a" * 40)
    assert r.metric_name == "avg@2 (1319 problems, T=0.6, 4 new tokens)"

    shutil.rmtree(out / "eval" / "hub")  # only the base model evaluated: no model-index
    card = build_model_card(out, "alice/x")
    assert "## Evaluation" in card and "model-index" not in card.split("\n---\n")[0]
    assert _card_data(card).eval_results is None


def test_base_model_override_is_a_hub_id(run, tmp_path):
    card = build_model_card(run, "alice/x", base_model="Qwen/Qwen3-0.6B")
    data = _card_data(card)
    assert data.base_model == "Qwen/Qwen3-0.6B" and data.license == "apache-2.0"
    assert "names no `base_model`" not in card and "A LoRA adapter for `Qwen/Qwen3-0.6B`" in card
    with pytest.raises(HubError, match="--base-model"):  # a path would be published as is
        prepare_upload(run, "alice/x", tmp_path / "stage", base_model="/home/alice/qwen3")


def test_a_local_bases_license_comes_from_its_card(tmp_path):
    base = tmp_path / "my-base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# base\n")
    assert license_for(None, str(base)) == "mit"
    (base / "README.md").write_text("---\n- not a mapping\n---\n")
    assert license_for(None, str(base)) is None
    (base / "README.md").write_text("---\nlicense: [unclosed\n---\n")
    assert license_for(None, str(base)) is None


def test_card_reports_evaluations_given_explicitly(run, tmp_path):
    moved = _copy(run, tmp_path)
    shutil.move(moved / "eval", tmp_path / "elsewhere")
    assert "## Evaluation" not in build_model_card(moved, "alice/x")
    card = build_model_card(moved, "alice/x", eval_dirs=[tmp_path / "elsewhere"])
    assert "## Evaluation" in card and "| gsm8k |" in card
    with pytest.raises(HubError, match="--eval-dir"):
        build_model_card(moved, "alice/x", eval_dirs=[tmp_path / "missing"])


def test_card_reads_metrics_with_evaluation_lines_and_a_torn_tail(run, tmp_path):
    out = _copy(run, tmp_path)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "eval_accuracy": 0.5, "eval_n": 4}) + "\n")
        f.write('{"step": 3, "reward": 0.')  # killed mid-write
    card = build_model_card(out, "alice/x")
    assert "| steps logged | 2 |" in card
    assert f"| policy entropy, last step | {steps[-1]['entropy']:.3f} |" in card


def _with_model(run: Path, tmp_path: Path, name: str, quantization: str, dataset: str) -> Path:
    import yaml

    dest = tmp_path / "variant"
    shutil.copytree(run / "adapter", dest / "adapter")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"].update(name=name, quantization=quantization)
    cfg["data"]["dataset"] = dataset
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dest


@pytest.mark.parametrize(
    "name, base, license",
    [
        ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B", "apache-2.0"),
        ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
        ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B", "other"),
    ],
)
def test_card_metadata_for_hub_bases(run, tmp_path, name, base, license):
    out = _with_model(run, tmp_path, name, "nf4", "openai/gsm8k")
    staged = prepare_upload(out, "alice/x", tmp_path / "stage")
    card = (staged / "README.md").read_text()
    data = _card_data(card)
    assert (data.base_model, data.license, data.datasets) == (base, license, ["openai/gsm8k"])
    assert "qlora" in data.tags and f"base_model:adapter:{base}" in data.tags
    assert (license == "other") == ("set it to the base model's license" in card)
    assert ("dequantised from the Q4_1 GGUF" in card) == (name == "smollm2-135m")
    adapter_cfg = json.loads((staged / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == base  # not the trainer's local path


def test_builtin_and_local_datasets_are_not_listed_as_hub_datasets(run, tmp_path):
    out = _with_model(run, tmp_path, "Qwen/Qwen3-0.6B", "none", str(FIXTURES / "gsm8k.jsonl"))
    data = _card_data(build_model_card(out, "alice/x"))
    assert data.datasets is None and "qlora" not in data.tags


def test_an_older_runs_recipe_is_staged_with_the_new_key_names(run, tmp_path, monkeypatch):
    """A run whose config.yaml an older version wrote (train.output_dir..., keys since removed,
    the rewards and the objective's knobs in the objective section): the staged ibpo_config.yaml
    and the card's recipe hold run.*, reward.* and objective.params and no removed key, so the
    file reruns."""
    import yaml

    from ibpo.recipe import load_config
    from ibpo.rewards import GRADERS

    out = _copy(run, tmp_path)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    monkeypatch.setitem(GRADERS, cfg["reward"]["functions"], lambda text, answer: 0.0)
    reward = cfg.pop("reward")
    cfg["objective"].update(reward=reward["functions"], code_sandbox=reward["sandbox"],
                            reward_timeout=reward["timeout"], gate="token")  # fmt: skip
    cfg["objective"].pop("params", None)
    cfg["train"].update(cfg.pop("run"), plots=True)
    cfg["rollout"]["eval_batch_size"] = 100
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    staged = prepare_upload(out, "alice/x", tmp_path / "stage")
    recipe = yaml.safe_load((staged / "ibpo_config.yaml").read_text())
    assert "output_dir" not in recipe["train"] and "output_dir" in recipe["run"]
    assert "plots" not in recipe["run"] and "eval_batch_size" not in recipe["rollout"]
    assert (
        recipe["reward"]["functions"] == reward["functions"] and "reward" not in recipe["objective"]
    )
    assert recipe["objective"]["params"] == {"gate": "token"} and "gate" not in recipe["objective"]
    load_config(staged / "ibpo_config.yaml", ["run.output_dir=" + str(tmp_path / "again")])
    card = (staged / "README.md").read_text()
    assert "\nrun:\n" in card and "  output_dir:" in card.split("\nrun:\n")[1]


# --- the token -----------------------------------------------------------------------------------


def test_the_token_is_never_staged(run, tmp_path, monkeypatch):
    import yaml

    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    out = _copy(run, tmp_path)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["train"]["hub_token"] = FAKE_TOKEN  # a key named like a secret is dropped
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    staged = prepare_upload(out, "alice/x", tmp_path / "stage")
    for path in staged.rglob("*"):
        assert not path.is_file() or FAKE_TOKEN.encode() not in path.read_bytes(), path
    recipe = yaml.safe_load((staged / "ibpo_config.yaml").read_text())
    assert "hub_token" not in recipe["train"] and recipe["rollout"]["max_new_tokens"] == 4

    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "message": f"x {FAKE_TOKEN}"}))
    with pytest.raises(HubError, match="summary.json") as caught:
        prepare_upload(out, "alice/x", tmp_path / "stage2")
    assert FAKE_TOKEN not in str(caught.value)
    assert list((tmp_path / "stage2").iterdir()) == []  # nothing half-staged is left behind


# --- pushing -------------------------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """Every Hub call of HfApi fails the test unless a test replaces it."""
    from huggingface_hub import HfApi

    def refuse(*args, **kwargs):
        raise AssertionError("the network was used")

    for name in ("create_repo", "repo_info", "upload_folder", "whoami"):
        monkeypatch.setattr(HfApi, name, refuse)


def test_push_offline_or_without_token_names_the_fix(run, monkeypatch, no_network, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        push(run, "alice/x")
    assert cli_main(["push", str(run), "--repo-id", "alice/x"]) == 2
    err = capsys.readouterr().err
    assert "Fix: unset it" in err and "Traceback" not in err and FAKE_TOKEN not in err

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no cached login either
    with pytest.raises(HubError, match=r"`hf auth login`.*HF_TOKEN"):
        push(run, "alice/x")


def _mock_hub(monkeypatch, existing_private: bool = True, fail=None):
    from huggingface_hub import HfApi

    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = {"repo_id": repo_id, **kwargs}
        return f"https://huggingface.co/{repo_id}"

    def repo_info(self, repo_id, **kwargs):
        return SimpleNamespace(private=existing_private)

    def upload_folder(self, **kwargs):
        if fail is not None:
            raise fail
        folder = Path(kwargs["folder_path"])
        calls["upload_folder"] = {**kwargs, "files": _files(folder)}
        calls["token_seen"] = any(
            FAKE_TOKEN.encode() in p.read_bytes() for p in folder.rglob("*") if p.is_file()
        )

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_push_is_private_by_default_and_uploads_the_staged_folder(run, tmp_path, monkeypatch):
    calls = _mock_hub(monkeypatch)
    url = push(run, "alice/tiny-ibpo")
    assert url == "https://huggingface.co/alice/tiny-ibpo"
    assert calls["create_repo"]["private"] is True and calls["create_repo"]["exist_ok"] is True
    expected = _files(prepare_upload(run, "alice/tiny-ibpo", tmp_path / "stage"))
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "alice/tiny-ibpo" and upload["files"] == expected
    assert not calls["token_seen"] and not Path(upload["folder_path"]).exists()  # cleaned up

    calls = _mock_hub(monkeypatch)
    assert cli_main(["push", str(run), "--repo-id", "alice/pub", "--public"]) == 0
    assert calls["create_repo"]["private"] is False


def test_push_refuses_an_existing_public_repo_and_explains_http_errors(run, monkeypatch):
    calls = _mock_hub(monkeypatch, existing_private=False)
    with pytest.raises(HubError, match="exists and is public"):
        push(run, "alice/already-public")
    assert "upload_folder" not in calls

    response = SimpleNamespace(status_code=403)
    forbidden = OSError("403 Forbidden: you cannot write here")
    forbidden.response = response
    _mock_hub(monkeypatch, fail=forbidden)
    with pytest.raises(HubError, match="write access"):
        push(run, "bob/x")


def test_cli_dry_run_stages_and_lists_without_network(run, tmp_path, no_network, capsys):
    out = _copy(run, tmp_path)
    assert cli_main(["push", str(out), "--repo-id", "alice/x", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "README.md" in printed and "adapter_model.safetensors" in printed
    assert "nothing was uploaded" in printed
    staged = _files(out / "hub-staging")
    assert "README.md" in staged and not any("checkpoint" in f for f in staged)
    # a second dry run replaces its own staging folder
    assert cli_main(["push", str(out), "--repo-id", "alice/x", "--dry-run"]) == 0
    assert _files(out / "hub-staging") == staged
    assert cli_main(["push", str(out), "--repo-id", "not-a-repo-id", "--dry-run"]) == 2
    assert "Fix: --repo-id" in capsys.readouterr().err


def test_push_adapter_script_is_ibpo_push(run, tmp_path, no_network, monkeypatch, capsys):
    import runpy

    script = Path(__file__).resolve().parents[1] / "scripts" / "push_adapter.py"
    stage = tmp_path / "stage"
    argv = [str(script), str(run), "--repo-id", "alice/x", "--dry-run", "--staging-dir", str(stage)]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0 and "nothing was uploaded" in capsys.readouterr().out
    assert _files(stage) == _files(prepare_upload(run, "alice/x", tmp_path / "again"))


# --- the real Hub --------------------------------------------------------------------------------


@pytest.mark.network
@pytest.mark.skipif(
    not os.environ.get("HF_TOKEN") or hub._offline(),
    reason="needs HF_TOKEN and the Hub (HF_HUB_OFFLINE unset)",
)
def test_real_push_uploads_a_private_repo(run):
    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = f"{api.whoami()['name']}/ibpo-test-{uuid.uuid4().hex[:8]}"
    try:
        url = push(run, repo_id)
        assert repo_id in url and api.repo_info(repo_id).private
        files = set(api.list_repo_files(repo_id))
        assert {"README.md", *hub.ADAPTER_FILES, "ibpo_config.yaml"} <= files
        assert not any("optimizer" in f or f.startswith("checkpoints") for f in files)
    finally:
        api.delete_repo(repo_id, missing_ok=True)


def test_card_states_the_code_reward_sandbox(run, tmp_path):
    out = _copy(run, tmp_path)
    assert "isolation mode" not in build_model_card(out, "alice/x")  # a math run: no sandbox
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "isolation": "bwrap, namespaces"}))
    card = build_model_card(out, "alice/x")
    assert "| code sandbox (isolation modes used) | bwrap, namespaces |" in card
