"""A rerun, a bad start or an interruption never costs an earlier run; exit codes say how a run
ended (tiny Qwen3, CPU, through `ibpo train`).

* A fresh start into an output_dir holding a run moves that run aside to previous-<time>/, only
  once the data and the model have loaded: a start that fails leaves it whole and in place;
  nothing deletes it (run.overwrite is refused, naming this).
* An output_dir that cannot be created is one configuration error (exit 2).
* Exit codes: completed 0, failed 1, bad input 2, out of memory 3, non-finite 4, SIGINT 130,
  SIGTERM 143; the same code is in summary.json.
* Ctrl-C while loading or in the first evaluation ends with one line; a second Ctrl-C in the loop
  keeps the last checkpoint's adapter as the run's.
"""

import hashlib
import itertools
import json
import os
import pathlib
import signal

import pytest
import torch

import ibpo.trainer as trainer_mod
from ibpo.cli import main
from ibpo.rewards import GRADERS
from ibpo.run import checkpoint as ckpt
from ibpo.run import failures
from tests.test_checkpoint import REWARD, REWARD_SRC, _args, _lora
from tests.test_run_lifecycle import full_disk

# the runs train the tiny model in this process: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def reward(monkeypatch):
    monkeypatch.setitem(GRADERS, REWARD, eval(REWARD_SRC))


def _train(model_dir, out, steps, *extra) -> int:
    return main(["train", *_args(model_dir, out, steps, "objective.name=grpo", *extra)])


def _tree(root) -> dict[str, str]:
    """relative path -> sha256 of every file under root."""
    root = pathlib.Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _previous(out) -> list[pathlib.Path]:
    return sorted(p for p in out.iterdir() if p.name.startswith("previous-"))


def _finished_run(model_dir, out):
    assert _train(model_dir, out, 1) == 0
    (out / "eval-gsm8k").mkdir()
    (out / "eval-gsm8k" / "results.json").write_text("{}")
    return _tree(out)


def test_a_rerun_that_fails_to_start_leaves_the_finished_run_in_place(
    tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "run"
    before = _finished_run(tiny_model_dir, out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    capsys.readouterr()
    assert _train(tiny_model_dir, out, 2, f"data.dataset={bad}") == 2
    err = capsys.readouterr().err
    assert "ibpo: error: dataset" in err and "row 1: no answer" in err
    assert _tree(out) == before and _previous(out) == []  # config.yaml too


def test_a_successful_rerun_moves_the_previous_run_aside(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    before = _finished_run(tiny_model_dir, out)
    capsys.readouterr()
    assert _train(tiny_model_dir, out, 2) == 0
    (prev,) = _previous(out)
    assert _tree(prev) == before  # everything that was there, eval folders included
    assert f"moved the earlier run (completed) to {prev}" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert (out / "adapter").is_dir() and not (out / "eval-gsm8k").exists()
    assert ckpt.latest_checkpoint(out / "checkpoints").name == "step-2"
    # a third start moves the second run aside next to the first, not into it
    assert _train(tiny_model_dir, out, 1) == 0
    assert len(_previous(out)) == 2 and _previous(prev) == []


def test_rerunning_an_interrupted_run_moves_its_checkpoints_aside(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    real_step = trainer_mod.rl_step

    def step(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "rl_step", step)
    assert _train(tiny_model_dir, out, 3) == 130
    monkeypatch.setattr(trainer_mod, "rl_step", real_step)
    capsys.readouterr()
    assert _train(tiny_model_dir, out, 1) == 0
    (prev,) = _previous(out)
    err = capsys.readouterr().err
    assert f"moved the earlier run (interrupted) to {prev}" in err
    assert f"run.resume_from={prev}" in err and "run.resume_from=latest" in err
    assert ckpt.latest_checkpoint(prev / "checkpoints").name == "step-1"  # nothing lost


def test_a_finished_run_is_never_deleted(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    _finished_run(tiny_model_dir, out)
    capsys.readouterr()
    assert _train(tiny_model_dir, out, 2, "run.overwrite=true") == 2  # the old key: refused
    assert "'run.overwrite' was removed" in capsys.readouterr().err
    assert _previous(out) == [] and (out / "eval-gsm8k").exists()  # untouched
    assert _train(tiny_model_dir, out, 2) == 0
    (prev,) = _previous(out)
    assert (prev / "eval-gsm8k").exists()  # moved aside, whole
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def _permission_denied(self, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(self))


@pytest.mark.parametrize("where", ["proc", "under_a_file", "permission"])
def test_an_output_dir_that_cannot_be_created_is_a_config_error(
    tiny_model_dir, tmp_path, monkeypatch, capsys, where
):
    if where == "proc":
        out = pathlib.Path("/proc/ibpo-test/run")
    elif where == "under_a_file":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "run"
    else:
        out = tmp_path / "locked" / "run"
        monkeypatch.setattr(pathlib.Path, "mkdir", _permission_denied)
    assert _train(tiny_model_dir, out, 1) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ibpo: error: run.output_dir={out}: cannot create it") and (
        "Traceback" not in err
    )


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _signal_in_step(sig):
    real_step = trainer_mod.rl_step

    def step(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return real_step(*args, **kwargs)

    return step


@pytest.mark.parametrize(
    "ending, code",
    [
        ("completed", 0),
        ("failed", 1),
        ("out_of_memory", 3),
        ("nonfinite", 4),
        ("SIGINT", 130),
        ("SIGTERM", 143),
    ],
)
def test_the_exit_code_says_how_the_run_ended(
    tiny_model_dir, tmp_path, monkeypatch, capsys, ending, code
):
    real_step = trainer_mod.rl_step
    extra = []
    if ending == "failed":
        full_disk(monkeypatch)
    elif ending == "out_of_memory":
        monkeypatch.setattr(trainer_mod, "rl_step", _oom)
    elif ending == "nonfinite":
        monkeypatch.setattr(
            trainer_mod, "rl_step", lambda *a, **k: {**real_step(*a, **k), "skipped_nonfinite": 1}
        )
        monkeypatch.setattr(failures, "MAX_NONFINITE_STEPS", 1)
    elif ending.startswith("SIG"):
        monkeypatch.setattr(trainer_mod, "rl_step", _signal_in_step(getattr(signal, ending)))
    out = tmp_path / "run"
    assert _train(tiny_model_dir, out, 3, *extra) == code
    summary = json.loads((out / "summary.json").read_text())
    status = "interrupted" if ending.startswith("SIG") else ending
    assert summary["status"] == status and summary["exit_code"] == code
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["load_policy", "evaluate_accuracy"])
def test_ctrl_c_before_training_ends_with_one_line_and_loses_nothing(
    tiny_model_dir, tmp_path, monkeypatch, capsys, where
):
    out = tmp_path / "run"
    before = _finished_run(tiny_model_dir, out)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, where, interrupt)
    capsys.readouterr()
    assert _train(tiny_model_dir, out, 2, "data.eval_size=2") == 130
    err = capsys.readouterr().err
    assert "ibpo: interrupted before training started; nothing to resume" in err
    assert "Traceback" not in err
    if where == "load_policy":  # before the data and the model were ready: nothing moved
        assert _tree(out) == before and _previous(out) == []
    else:  # the model had loaded: the earlier run is whole under previous-*/
        (prev,) = _previous(out)
        assert _tree(prev) == before and not (out / "summary.json").exists()


def test_a_second_ctrl_c_keeps_the_last_checkpoints_adapter(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    real_step, calls = trainer_mod.rl_step, itertools.count()

    def step(*args, **kwargs):
        m = real_step(*args, **kwargs)  # the live adapter has moved on: step 3's update
        if next(calls) == 2:
            raise KeyboardInterrupt  # as the second Ctrl-C does, before step 3 is counted
        return m

    monkeypatch.setattr(trainer_mod, "rl_step", step)
    out = tmp_path / "run"
    assert _train(tiny_model_dir, out, 5) == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 2
    assert summary["adapter"] == str(out / "adapter")
    kept, live = _lora(out / "checkpoints" / "step-2" / "adapter"), _lora(out / "adapter")
    assert kept.keys() == live.keys() and all(torch.equal(kept[k], live[k]) for k in kept)


def test_a_second_ctrl_c_before_any_checkpoint_saves_no_adapter(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    def step(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "rl_step", step)
    out = tmp_path / "run"
    assert _train(tiny_model_dir, out, 3, "run.save_every=0") == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["adapter"] is None and not (out / "adapter").exists()
    assert "adapter is not saved" in summary["message"]
    assert "adapter is not saved" in capsys.readouterr().err
