"""What a run leaves behind when it is rerun, resumed differently, or fails late (tiny Qwen3, CPU).

* Rerunning an interrupted command moves its checkpoints aside (previous-*/), as a fresh start
  does with any earlier run, so its adapter and summary are never taken for the new run's.
* Resuming applies a changed learning rate (the restored optimizer would keep the old one) and
  names other changed settings (also against the settings an older version saved, the run keys
  under train); a save after resuming from an earlier step drops the later ones.
* Out of memory in a periodic evaluation keeps the finished step; a failed final evaluation, or a
  full disk, still ends with a summary that says what happened.
"""

import json
import os

import pytest
import torch

import ibpo.trainer as trainer_mod
from ibpo.config import ConfigError
from ibpo.recipe import load_config
from ibpo.rewards import GRADERS
from ibpo.run import checkpoint as ckpt
from ibpo.run import failures
from ibpo.trainer import run_recipe
from tests.test_checkpoint import REWARD, REWARD_SRC, _args, _lora

# the runs train the tiny model in this process: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def reward(monkeypatch):
    monkeypatch.setitem(GRADERS, REWARD, eval(REWARD_SRC))


def _run(model_dir, out, steps, *extra):
    return run_recipe(
        load_config(None, _args(model_dir, out, steps, "objective.name=grpo", *extra))
    )


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_rerunning_an_interrupted_command_moves_its_checkpoints_aside(
    tiny_model_dir, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    monkeypatch.setattr(failures.GracefulStop, "requested", lambda self, acc: True)
    summary = _run(tiny_model_dir, out, 3)
    assert summary["status"] == "interrupted" and summary["steps"] == 1
    assert "run.resume_from=latest" in summary["message"]
    monkeypatch.undo()
    monkeypatch.setitem(GRADERS, REWARD, eval(REWARD_SRC))
    # a plain rerun starts afresh: the interrupted run moves aside whole, resumable from there
    assert _run(tiny_model_dir, out, 2)["status"] == "completed"
    (prev,) = [p for p in out.iterdir() if p.name.startswith("previous-")]
    assert ckpt.latest_checkpoint(prev / "checkpoints").name == "step-1"  # nothing deleted
    assert json.loads((prev / "summary.json").read_text())["status"] == "interrupted"
    # a fresh start that fails in its first step leaves no adapter or summary of the earlier run
    # behind to be pushed as its own: that run is under previous-*/ too
    monkeypatch.setattr(trainer_mod, "rl_step", _oom)
    summary = _run(tiny_model_dir, out, 2)
    assert summary["status"] == "out_of_memory" and summary["adapter"] is None
    assert not (out / "adapter").exists() and not (out / "checkpoints").exists()
    assert json.loads((out / "summary.json").read_text())["status"] == "out_of_memory"
    assert len([p for p in out.iterdir() if p.name.startswith("previous-")]) == 2
    # run.overwrite is gone: nothing a run does deletes an earlier one
    with pytest.raises(ConfigError, match="never deleted"):
        _run(tiny_model_dir, out, 1, "run.overwrite=true")


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_resume_applies_a_new_learning_rate_and_names_other_changes(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    monkeypatch.setattr(ckpt, "KEEP_CHECKPOINTS", 5)  # step-1 stays to resume from
    _run(tiny_model_dir, out, 3, "train.learning_rate=1e-3", "train.warmup_steps=2")
    # the logged rate is the one the step used: warmup 1/2, then the full rate
    assert [m["lr"] for m in _metrics(out)] == pytest.approx([5e-4, 1e-3, 1e-3])
    capsys.readouterr()
    step1 = out / "checkpoints" / "step-1"
    # its settings as a version before the run section saved them (the run keys under train):
    # read with those keys moved, the only change named is the real one
    old = json.loads((step1 / "config.json").read_text())
    old["train"].update(old.pop("run"))
    (step1 / "config.json").write_text(json.dumps(old))
    changed = ["train.learning_rate=1e-5", "objective.kl_coef=0.3", "run.save_every=2"]
    _run(tiny_model_dir, out, 2, "train.warmup_steps=2", f"run.resume_from={step1}", *changed)
    said = capsys.readouterr().out
    assert "train.learning_rate: 0.001 -> 1e-05" in said
    assert "objective.kl_coef: 0.1 -> 0.3" in said and "train.steps" not in said
    assert "continues with the new ones: objective.kl_coef: 0.1 -> 0.3\n" in said
    assert [m["lr"] for m in _metrics(out)] == pytest.approx([5e-4, 1e-5])
    # resumed from step 1: its first save removed step-3 of the abandoned history
    names = [p.name for p in ckpt.list_checkpoints(out / "checkpoints")]
    assert (
        names == ["step-1", "step-2"]
        and ckpt.latest_checkpoint(out / "checkpoints").name == "step-2"
    )
    saved = json.loads((out / "checkpoints" / "step-2" / "config.json").read_text())
    assert saved["train"]["learning_rate"] == 1e-5  # the new history's own checkpoint


def test_out_of_memory_in_a_periodic_evaluation_keeps_the_finished_step(
    tiny_model_dir, tmp_path, monkeypatch
):
    calls = []
    real = trainer_mod.evaluate_accuracy

    def evaluate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the evaluation after step 1 (the first is before training)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "evaluate_accuracy", evaluate)
    out = tmp_path / "run"
    summary = _run(
        tiny_model_dir,
        out,
        3,
        "data.eval_size=2",
        "train.eval_every=1",
        "run.save_every=0",
        "rollout.eval_max_new_tokens=4",
    )
    assert summary["status"] == "out_of_memory" and summary["steps"] == 1
    assert "evaluation after step 1" in summary["message"]
    assert "rollout.generation_batch_size" in summary["message"]
    assert summary["checkpoint"] == str(out / "checkpoints" / "step-1")
    live, kept = _lora(out / "adapter"), _lora(out / "checkpoints" / "step-1" / "adapter")
    assert all(torch.equal(live[k], kept[k]) for k in kept)


def test_a_failed_final_evaluation_still_writes_the_summary(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    real, calls = trainer_mod.evaluate_accuracy, []

    def evaluate(*args, **kwargs):  # the evaluation before training passes, the final one fails
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the grader's worker died")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "evaluate_accuracy", evaluate)
    out = tmp_path / "run"
    summary = _run(tiny_model_dir, out, 1, "data.eval_size=2")
    assert summary["status"] == "completed" and "worker died" in summary["eval_after"]["error"]
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (
        out / "adapter"
    ).is_dir() and "final held-out evaluation failed" in capsys.readouterr().err


def full_disk(monkeypatch) -> None:
    """The second checkpoint write from here on fails as a full disk would (ENOSPC)."""
    real, calls = ckpt._fsync_tree, []

    def fsync(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, os.strerror(28))
        return real(path)

    monkeypatch.setattr(ckpt, "_fsync_tree", fsync)


def test_a_full_disk_while_saving_ends_with_the_last_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch
):
    full_disk(monkeypatch)
    out = tmp_path / "run"
    summary = _run(tiny_model_dir, out, 3)
    assert summary["status"] == "failed" and summary["steps"] == 2
    assert "free disk space" in summary["message"] and "step-1" in summary["message"]
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")] == []
    kept = _lora(out / "checkpoints" / "step-1" / "adapter")
    assert summary["adapter"] == str(out / "adapter")
    assert all(torch.equal(_lora(out / "adapter")[k], kept[k]) for k in kept)
