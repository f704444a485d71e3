"""What a run records about itself: the code it ran (commit and dirty tree, in a git checkout,
a dirty one, without git, installed without a repository), where it is written (summary.json,
config.yaml's first line) and shown (`ibpo report`), and the rollout's prompt tokens a step
logs beside its decoded ones."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import ibpo
from ibpo.data import Example
from ibpo.generation import Rollout
from ibpo.recipe import load_config
from ibpo.run import report, version
from ibpo.step import score_round
from tests.conftest import grader_rewards, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git repository holding a package `pkg/` at one commit, with its run folders ignored."""
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "step.py").write_text("x = 1\n")
    (root / "README.md").write_text("a project\n")
    (root / ".gitignore").write_text("runs/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "first")
    return root


def test_a_clean_checkout_records_its_commit(repo):
    head = _git(repo, "rev-parse", "HEAD")
    want = {"version": ibpo.__version__, "commit": head, "dirty": False}
    assert version.code_version(repo / "pkg") == want
    # what a study writes beside the code does not make the tree dirty: ignored run folders,
    # an untracked note outside the package
    (repo / "runs" / "a").mkdir(parents=True)
    (repo / "runs" / "a" / "metrics.jsonl").write_text("{}\n")
    (repo / "notes.txt").write_text("todo\n")
    assert version.code_version(repo / "pkg") == want
    assert version.describe(want) == f"ibpo {ibpo.__version__}, commit {head[:12]} (clean)"


def test_a_changed_tracked_file_or_a_new_module_makes_it_dirty(repo):
    (repo / "README.md").write_text("edited\n")  # tracked, outside the package
    assert version.code_version(repo / "pkg")["dirty"] is True
    _git(repo, "checkout", "--", "README.md")
    assert version.code_version(repo / "pkg")["dirty"] is False
    (repo / "pkg" / "new.py").write_text("y = 2\n")  # untracked, inside the package
    found = version.code_version(repo / "pkg")
    assert found["dirty"] is True and found["commit"] == _git(repo, "rev-parse", "HEAD")
    assert version.describe(found).endswith("(dirty tree)")
    (repo / "pkg" / "new.py").unlink()
    (repo / "pkg" / "step.py").write_text("x = 2\n")  # staged, not committed
    _git(repo, "add", "pkg/step.py")
    assert version.code_version(repo / "pkg")["dirty"] is True


def test_no_git_is_unknown_never_an_error(repo, tmp_path, monkeypatch):
    unknown = {"version": ibpo.__version__, "commit": "unknown", "dirty": "unknown"}
    alone = tmp_path / "site-packages" / "pkg"  # a package outside any repository
    alone.mkdir(parents=True)
    (alone / "__init__.py").write_text("")
    assert version.code_version(alone) == unknown
    assert version.code_version(tmp_path / "gone") == unknown
    # a virtual environment kept inside another project's repository: its package is ignored
    # there, so that repository's commit is not the package's
    (repo / ".gitignore").write_text("runs/\n.venv/\n")
    venv_pkg = repo / ".venv" / "lib" / "pkg"
    venv_pkg.mkdir(parents=True)
    (venv_pkg / "__init__.py").write_text("")
    assert version.code_version(venv_pkg) == unknown
    assert "commit unknown" in version.describe(unknown)
    # git missing from the machine, or hanging
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert version.code_version(repo / "pkg") == unknown
    monkeypatch.undo()

    def hangs(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], 10)

    monkeypatch.setattr(version.subprocess, "run", hangs)
    assert version.code_version(repo / "pkg") == unknown


def test_a_package_installed_without_git_reports_unknown(tmp_path):
    """The package's files copied as an installer would, outside any repository: importing it
    and asking works, and says unknown."""
    site = tmp_path / "site"
    for name in ("__init__.py", "run/__init__.py", "run/version.py"):
        (site / "ibpo" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "ibpo" / name, site / "ibpo" / name)
    code = (
        "import json, ibpo; from ibpo.run.version import code_version; "
        "print(json.dumps([ibpo.__file__, code_version()]))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],  # -S: not the development install's site-packages
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    where, found = json.loads(done.stdout)
    assert Path(where).is_relative_to(site)
    assert found == {"version": ibpo.__version__, "commit": "unknown", "dirty": "unknown"}


def test_config_yaml_keeps_the_version_in_a_comment_and_stays_a_recipe(tmp_path):
    code = {"version": "0.1.0", "commit": "a" * 40, "dirty": True}
    cfg = load_config(None, ["train.steps=3"])
    path = tmp_path / "config.yaml"
    path.write_text(version.header(code) + yaml.safe_dump(cfg.to_dict(recipe=True)))
    assert version.from_header(path.read_text()) == code
    assert load_config(path, []) == cfg
    assert version.from_header("model:\n  name: x\n") is None  # a run from before
    assert version.from_header("# code: {not json\n") is None


def test_ibpo_report_shows_the_code(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / report.METRICS).write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    assert "not recorded" in _code_line(out)  # neither summary nor config.yaml say
    code = {"version": "0.1.0", "commit": "b" * 40, "dirty": False}
    (out / "config.yaml").write_text(version.header(code) + "train:\n  steps: 1\n")
    assert _code_line(out) == f"ibpo 0.1.0, commit {'b' * 12} (clean)"  # a run going on
    dirty = {**code, "commit": "c" * 40, "dirty": True}
    (out / report.SUMMARY).write_text(json.dumps({"status": "completed", "code": dirty}))
    assert _code_line(out) == f"ibpo 0.1.0, commit {'c' * 12} (dirty tree)"  # summary first


def _code_line(out: Path) -> str:
    line = next(x for x in report.summary_table(out).splitlines() if x.strip().startswith("code "))
    return line.strip()[len("code") :].strip()


def test_a_run_without_git_trains_and_records_unknown(tiny_model_dir, tmp_path, monkeypatch):
    from ibpo.trainer import run_recipe

    alone = tmp_path / "installed" / "ibpo"
    alone.mkdir(parents=True)
    monkeypatch.setattr(version, "PACKAGE", alone)  # as if installed from a wheel
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            "model.quantization=none",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "rollout.eval_max_new_tokens=4",
            "data.eval_size=1",
            "objective.name=dfpo",  # no repairs: the record is the point, not the step
            f"run.output_dir={out}",
            "train.steps=1",
        ],
    )
    summary = run_recipe(cfg)
    unknown = {"version": ibpo.__version__, "commit": "unknown", "dirty": "unknown"}
    assert summary["status"] == "completed" and summary["code"] == unknown
    assert json.loads((out / "summary.json").read_text())["code"] == unknown
    assert version.from_header((out / "config.yaml").read_text()) == unknown
    assert load_config(out / "config.yaml", []).train.steps == 1  # still a recipe
    assert "commit unknown" in _code_line(out)
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["rollout_prefill_tokens"] > 0


def _rollout(prompt_len: int, n: int, prefill: int | None) -> Rollout:
    ids = torch.ones(n, prompt_len + 2, dtype=torch.long, device="cpu")
    att = torch.ones_like(ids)
    att[0, 0] = 0  # one left-padded prompt: real lengths prompt_len - 1, prompt_len, ...
    mask = torch.ones(n, 2, device="cpu")
    return Rollout(
        input_ids=ids,
        attention_mask=att,
        completion_mask=mask,
        prompt_len=prompt_len,
        texts=["1"] * n,
        truncated=torch.zeros(n, dtype=torch.bool),
        prefill_tokens=prefill,
    )


@pytest.mark.parametrize("prefill, want", [(None, 4 * 5 - 1), (7, 7)])
def test_a_round_logs_the_prompt_tokens_its_rollout_ran(prefill, want):
    """The backend's count where it gives one (a prompt run once for its G samples), else the
    prompts' real tokens."""
    cfg = load_config(None, ["rollout.group_size=2", "repair.enabled=false"])
    examples = [Example("1+1?", "2"), Example("2+2?", "4")]

    def generator(tok, prompts, n, *args, **kwargs):
        assert n == 2 and len(prompts) == 2
        return _rollout(5, 4, prefill)

    rewards = grader_rewards(lambda text, gold: 0.0)
    r = score_round(generator, make_tokenizer(), examples, cfg, False, rewards, random.Random(0))
    assert r.stats["rollout_prefill_tokens"] == want
    assert r.stats["generated_tokens"] == 8


def test_a_round_reports_its_own_grader_failures_not_an_earlier_gradings():
    """A step's grader_errors are its gradings' failures: one the held-out evaluation (or any
    grading before) met is that grading's, and never reaches the next round."""
    from ibpo.rewards import errors

    cfg = load_config(None, ["rollout.group_size=2", "repair.enabled=false"])
    examples = [Example("1+1?", "2"), Example("2+2?", "4")]

    def fails_on(bad):
        def grade(text, gold):
            if gold == bad:  # as a built-in grader does with a failure of its own
                return errors.Graded(0.0, errors.failed("math", RecursionError("deep")))
            return errors.Graded(1.0)

        return grader_rewards(grade)

    def generator(tok, prompts, n, *args, **kwargs):
        return _rollout(5, 4, None)

    before = fails_on("2")
    earlier = before.score(["1"], {"answer": ["2"]}, ["p"])  # e.g. the held-out evaluation's
    assert len(earlier.failures) == 1
    r = score_round(generator, make_tokenizer(), examples, cfg, False, before, random.Random(0))
    assert [f.kind for f in r.gradings[0].failures] == ["math", "math"]  # its G = 2 of "1+1?"
    clean = score_round(
        generator, make_tokenizer(), examples, cfg, False, fails_on("9"), random.Random(0)
    )
    assert [g.failures for g in clean.gradings] == [[]]


def test_token_counts_add_up_over_processes(monkeypatch):
    """What a step spent is the sum over processes (each rolls out its own prompts), not a mean
    weighted by trained sequences."""
    from ibpo import distributed

    keys = ("generated_tokens", "rollout_prefill_tokens", "repair_prefill_tokens",
            "repair_prompt_tokens", "repair_decode_tokens")  # fmt: skip
    ranks = [{**{k: 10.0 for k in keys}, "trained_sequences": 1.0, "reward": 0.0},
             {**{k: 30.0 for k in keys}, "trained_sequences": 3.0, "reward": 1.0}]  # fmt: skip
    monkeypatch.setattr(distributed, "gather_object", lambda _: ranks)

    class TwoProcesses:
        num_processes = 2

    m = distributed.gather_metrics(TwoProcesses(), dict(ranks[0]))
    assert all(m[k] == 40.0 for k in keys)
    assert m["reward"] == 0.75  # a rate: weighted by trained sequences
