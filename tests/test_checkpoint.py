"""Checkpoints and fault handling on the tiny Qwen3 (CPU).

* A run killed with SIGKILL, resumed, stopped with SIGTERM, resumed again ends with the same LoRA
  tensors (torch.equal) and per-step rewards as an uninterrupted run with the same seed.
* A crash in the middle of a save leaves the previous checkpoint loadable and `latest` on it.
* Non-finite steps are skipped, counted and, consecutive, stop the run with a checkpoint.
* Out of memory ends the run with advice; Ctrl-C saves a checkpoint; a second one stops at once.
"""

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ibpo.trainer as trainer_mod
from ibpo.algo.spending import SpendingState
from ibpo.config import ConfigError
from ibpo.data import PromptStream, builtin_examples
from ibpo.modeling import load_policy
from ibpo.recipe import load_config
from ibpo.rewards import GRADERS
from ibpo.run import checkpoint as ckpt
from ibpo.run import failures
from ibpo.step_parts import StepParts
from ibpo.trainer import run_recipe

# one intra-op thread (conftest.one_thread), here and in the training processes started
pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
REWARD = "ckpt_test_parity"
# deterministic in the text and about half right on the random tiny model: real advantages
REWARD_SRC = "lambda text, answer: float(sum(map(ord, text)) % 2)"
# The training process: the slow imports first, so that it can start while the previous run is
# still training; it begins once the file named by CKPT_TEST_GO exists.
DRIVER = f"""
import os, sys, time
import accelerate, peft, transformers.models.qwen3, ibpo.trainer
from ibpo.cli import main
from ibpo.rewards import GRADERS
GRADERS[{REWARD!r}] = {REWARD_SRC}
while not os.path.exists(os.environ["CKPT_TEST_GO"]):
    time.sleep(0.01)
sys.exit(main(["train", *sys.argv[1:]]))
"""


def _args(model_dir, out, steps, *extra):
    return [
        f"model.name={model_dir}",
        "model.quantization=none",
        f"train.steps={steps}",
        "train.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "data.eval_size=0",
        f"reward.functions={REWARD}",
        "run.save_every=1",
        "train.log_reference_kl=false",
        "repair.max_repairs_per_group=1",
        "repair.template='{question}|{attempt}|{reference}'",
        f"run.output_dir={out}",
        *extra,
    ]


@pytest.fixture
def reward(monkeypatch):
    monkeypatch.setitem(GRADERS, REWARD, eval(REWARD_SRC))


@pytest.fixture
def spawn(tmp_path):
    """Start training processes (each trains once tmp_path/<name>.go exists); none outlives
    the test."""
    procs = []

    def start(name: str, args: list[str]) -> subprocess.Popen:
        procs.append(_spawn(tmp_path, name, args))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _spawn(tmp_path: Path, name: str, args: list[str]) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    # same intra-op threads as this process: CPU kernels then reduce in the same order
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "HF_HUB_OFFLINE": "1",
        "CKPT_TEST_GO": str(tmp_path / f"{name}.go"),
    }
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, str(driver), *args],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    end = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"training exited early ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if time.time() > end:
            proc.kill()
            pytest.fail("timed out waiting for a checkpoint")
        time.sleep(0.01)


def _latest_step(root: Path) -> int:
    found = ckpt.latest_checkpoint(root)
    return ckpt.step_of(found) if found else 0


def _lora(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(adapter_dir / "adapter_model.safetensors")


def _rewards(run: Path) -> list[tuple[int, float]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["reward"]) for m in map(json.loads, lines)]


# The repair spending rule at work: about half the repairs succeed on the tiny model, under this
# floor, so steps skip and probe; its state crosses the resume (a fresh state would spend at once
# and log another running success rate).
SPENDING = ("repair.min_success=0.9", "repair.probe_every=2")


def _spending(run: Path) -> list[tuple]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    keys = ("repairs", "repairs_skipped", "repair_probe", "repair_running_success")
    return [(m["step"], *(m.get(k) for k in keys)) for m in map(json.loads, lines)]


def test_killed_and_resumed_run_equals_an_uninterrupted_one(
    tiny_model_dir, tmp_path, reward, spawn
):
    steps, run = 7, tmp_path / "run"
    root = run / "checkpoints"
    resume = _args(tiny_model_dir, run, steps, "run.resume_from=latest", *SPENDING)
    a = spawn("a", _args(tiny_model_dir, run, steps, *SPENDING))
    b = spawn("b", resume)  # imports while `a` runs, trains after it
    (tmp_path / "a.go").touch()
    # 1. SIGKILL once step-2 is saved (perhaps in the middle of saving step 3)
    _wait_for(lambda: _latest_step(root) >= 2, a, tmp_path / "a.log")
    a.send_signal(signal.SIGKILL)
    assert a.wait() == -signal.SIGKILL
    killed_at = ckpt.step_of(ckpt.latest_checkpoint(root))
    assert 2 <= killed_at <= steps - 3  # `b` has steps to run after its first save
    with open(run / "metrics.jsonl", "a") as f:  # a step logged after the checkpoint
        f.write(json.dumps({"step": killed_at + 1, "reward": -1.0}) + "\n")
    # 2. resume; SIGTERM once it has saved a step of its own: it saves and exits cleanly
    (tmp_path / "b.go").touch()
    _wait_for(lambda: _latest_step(root) > killed_at, b, tmp_path / "b.log")
    b.send_signal(signal.SIGTERM)
    # 143 = 128 + SIGTERM: interrupted, resumable (a scheduler must not read it as done)
    assert b.wait(timeout=120) == 143, (tmp_path / "b.log").read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["status"] == "interrupted" and killed_at < stopped < steps
    assert summary["resumed_from"] == str(root / f"step-{killed_at}")
    assert ckpt.latest_checkpoint(root) == root / f"step-{stopped}"
    assert summary["checkpoint"] == str(root / f"step-{stopped}")
    assert "SIGTERM" in (tmp_path / "b.log").read_text()
    assert [s for s, _ in _rewards(run)] == list(range(1, stopped + 1))  # no duplicate lines
    # 3. resume to the end (in this process), and an uninterrupted run with the same seed
    resumed = run_recipe(load_config(None, resume))
    assert resumed["status"] == "completed" and resumed["steps"] == steps
    ref = run_recipe(load_config(None, _args(tiny_model_dir, tmp_path / "ref", steps, *SPENDING)))
    assert ref["status"] == "completed"
    got, want = _lora(run / "adapter"), _lora(tmp_path / "ref" / "adapter")
    assert got.keys() == want.keys() and any("lora_B" in k for k in got)
    assert any(want[k].abs().sum() > 0 for k in want if "lora_B" in k)  # it did learn
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert _rewards(run) == _rewards(tmp_path / "ref")
    assert len({r for _, r in _rewards(run)}) > 1
    # the same spending decisions, step by step, and the rule did skip and probe
    spent = _spending(tmp_path / "ref")
    assert _spending(run) == spent
    assert any(s[1] == 0 and s[2] > 0 for s in spent)  # a step that skipped its repairs
    assert any(s[3] == 1.0 for s in spent)  # a probe
    assert len(ckpt.list_checkpoints(root)) == ckpt.KEEP_CHECKPOINTS == 2


def _older_layout(tree: dict) -> dict:
    """A config tree as versions before objective.params and the reward section wrote it: the
    objective's knobs and every reward key in the objective section, under their old names."""
    objective, reward = dict(tree["objective"]), tree.pop("reward")
    objective.update(objective.pop("params"))
    old_names = {"functions": "reward", "weights": "reward_weights", "timeout": "reward_timeout",
                 "sandbox": "code_sandbox"}  # fmt: skip
    objective.update({old_names.get(k, k): v for k, v in reward.items()})
    return {**tree, "objective": objective}


def test_a_checkpoint_saved_with_the_older_objective_and_reward_keys_resumes(
    tiny_model_dir, tmp_path, reward, capsys
):
    """The run's config.yaml and its checkpoint's config.json as an older version wrote them
    (the objective's knobs and the rewards in the objective section): rerun as the recipe, the
    run resumes from its checkpoint, names no changed setting, and the keys are read at their
    new place (one line each)."""
    import yaml

    run = tmp_path / "run"
    args = _args(tiny_model_dir, run, 2, "objective.name=dfpo", "objective.params.gate=group")
    assert run_recipe(load_config(None, args))["status"] == "completed"
    saved = ckpt.latest_checkpoint(run / "checkpoints")
    recipe = yaml.safe_load((run / "config.yaml").read_text())
    assert recipe["objective"]["params"] == {"gate": "group"}  # the recipe form
    (run / "config.yaml").write_text(yaml.safe_dump(_older_layout(recipe), sort_keys=False))
    state = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps(_older_layout(state)))
    capsys.readouterr()
    resumed = run_recipe(
        load_config(run / "config.yaml", ["run.resume_from=latest", "train.steps=3"])
    )
    assert resumed["status"] == "completed" and resumed["steps"] == 3
    assert resumed["resumed_from"] == str(saved)
    out = capsys.readouterr()
    assert "differ from the checkpoint" not in out.out + out.err
    assert "'objective.gate' is now 'objective.params.gate'" in out.err
    assert "'objective.reward' is now 'reward.functions'" in out.err
    rewritten = yaml.safe_load((run / "config.yaml").read_text())  # the new layout again
    assert rewritten["objective"]["params"] == {"gate": "group"}
    assert rewritten["reward"]["functions"] == REWARD
    # the older config.json is read in the new layout: a knob changed since is named
    from ibpo.run.outdir import resume_changes

    other = load_config(run / "config.yaml", ["objective.params.gate=token"])
    assert resume_changes(saved, other) == ["objective.params.gate: 'group' -> 'token'"]


class _Crash(BaseException):
    """Stands for the process dying in the middle of a save."""


def _parts(model_dir: str):
    from accelerate import Accelerator

    cfg = load_config(None, [f"model.name={model_dir}", "model.quantization=none"])
    acc = Accelerator(cpu=True)
    model, _ = load_policy(cfg.model, torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    sum((p**2).sum() for p in model.parameters() if p.requires_grad).backward()
    opt.step()  # non-empty optimizer state
    sched.step()
    stream = PromptStream(builtin_examples("arithmetic", "train")[:10], seed=0, shuffle=True)
    stream.take(13)  # into the second epoch
    history = SpendingState(attempts=12.5, successes=1.5, prompt_tokens=900, idle=3)
    return acc, StepParts(model, opt, sched, stream, random.Random(7), history)


def _draws(parts) -> tuple:
    return (
        torch.rand(3),
        random.random(),
        np.random.rand(),
        parts.rng.random(),
        parts.stream.take(2),
    )


def test_crash_mid_save_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    acc, parts = _parts(tiny_model_dir)
    root = tmp_path / "checkpoints"
    first = ckpt.save_checkpoint(acc, root, parts, ckpt.TrainerState(step=1), None, keep=2)
    lora = {n: p for n, p in parts.model.named_parameters() if p.requires_grad}
    saved = {n: p.detach().clone() for n, p in lora.items()}
    adam = {k: v.clone() for k, v in parts.optimizer.state[next(iter(lora.values()))].items()}
    expected = _draws(parts)  # what the run would draw next
    history = parts.repair_history
    parts.repair_history = SpendingState()
    with torch.no_grad():
        for p in lora.values():
            p.add_(1.0)
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            raise _Crash
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(_Crash):
        ckpt.save_checkpoint(acc, root, parts, ckpt.TrainerState(step=2), None, keep=2)
    monkeypatch.setattr(torch, "save", real_save)
    assert (root / ".tmp-step-2").is_dir() and not (root / "step-2").exists()
    assert ckpt.latest_checkpoint(root) == first
    assert ckpt.resolve_resume("latest", tmp_path) == first
    assert ckpt.resolve_resume(str(tmp_path), tmp_path / "elsewhere") == first

    state = ckpt.load_checkpoint(acc, first, parts)
    assert state.step == 1
    assert all(torch.equal(p, saved[n]) for n, p in lora.items())
    restored = parts.optimizer.state[next(iter(lora.values()))]
    assert all(torch.equal(restored[k], v) for k, v in adam.items())
    again = _draws(parts)
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]
    assert parts.repair_history == history  # the repair spending rule's history

    # the next save removes the leftover and moves `latest`; keep=1 drops step-1
    second = ckpt.save_checkpoint(acc, root, parts, ckpt.TrainerState(step=2), None, keep=1)
    assert not list(root.glob(".tmp-*")) and not first.exists()
    assert (root / "latest").read_text().strip() == "step-2"
    # a dangling pointer (crash between a rename and the pointer) falls back to the newest
    (root / "latest").write_text("step-9\n")
    assert ckpt.latest_checkpoint(root) == second
    meta = json.loads((second / "trainer_state.json").read_text())
    (second / "trainer_state.json").write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(ConfigError, match="written by 2 process"):
        ckpt.load_checkpoint(acc, second, parts)
    assert meta["fsdp"] is False  # FSDP's optimizer state is keyed by name: never mixed
    (second / "trainer_state.json").write_text(json.dumps({**meta, "fsdp": True}))
    with pytest.raises(ConfigError, match="written with FSDP"):
        ckpt.load_checkpoint(acc, second, parts)
    with pytest.raises(ConfigError, match="no checkpoint"):
        ckpt.resolve_resume(str(tmp_path / "nowhere"), tmp_path)
    assert ckpt.resolve_resume("latest", tmp_path / "empty") is None


def _nan_advantages(nan_steps: set[int]):
    """step.group_advantages, NaN in the given steps (one call per step without dynamic
    sampling): a non-finite loss from inside the step (a NaN reward is an error of its own)."""
    import ibpo.step as step_mod

    real, calls = step_mod.group_advantages, itertools.count()

    def advantages(rewards, scale):
        out = real(rewards, scale)
        return out * float("nan") if next(calls) + 1 in nan_steps else out

    return advantages


def test_nonfinite_steps_are_skipped_and_stop_the_run(
    tiny_model_dir, tmp_path, monkeypatch, reward
):
    import ibpo.step as step_mod

    monkeypatch.setattr(step_mod, "group_advantages", _nan_advantages({2, 4, 5}))
    monkeypatch.setattr(failures, "MAX_NONFINITE_STEPS", 2)
    out = tmp_path / "run"
    args = _args(
        tiny_model_dir,
        out,
        8,
        "objective.name=grpo",
        "run.save_every=0",
        "train.lr_scheduler=linear",
    )
    cfg = load_config(None, args)
    summary = run_recipe(cfg)
    assert summary["status"] == "nonfinite" and summary["steps"] == 5
    assert summary["nonfinite_steps"] == 3
    assert "2 consecutive steps (4-5)" in summary["message"]
    assert "resume with run.resume_from=latest" in summary["message"]
    # strict JSON: non-finite values are written as null, never NaN / Infinity
    no_nan = lambda c: pytest.fail(f"metrics.jsonl holds {c}")  # noqa: E731
    lines = [
        json.loads(x, parse_constant=no_nan)
        for x in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["skipped_nonfinite"] for m in lines] == [0, 1, 0, 1, 1]
    assert lines[1]["loss"] is None or lines[1]["grad_norm"] is None
    # the schedule counts updates made: a skipped step does not advance it (linear over 8 steps:
    # 8/8 for step 1; step 2 skipped, so steps 2 and 3 both run at 7/8; steps 4-5 at 6/8)
    base = cfg.train.learning_rate
    assert [m["lr"] for m in lines] == pytest.approx(
        [base * f for f in (1, 7 / 8, 7 / 8, 6 / 8, 6 / 8)]
    )
    last = out / "checkpoints" / "step-5"
    assert (
        summary["checkpoint"] == str(last) and ckpt.latest_checkpoint(out / "checkpoints") == last
    )
    state = torch.load(last / "optimizer.pt", weights_only=True)["state"]
    assert {float(s["step"]) for s in state.values()} == {2.0}  # steps 1 and 3 only
    assert torch.load(last / "scheduler.pt", weights_only=True)["last_epoch"] == 2
    weights = _lora(out / "adapter")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert torch.equal(weights[next(iter(weights))], _lora(last / "adapter")[next(iter(weights))])


@pytest.mark.parametrize(
    "error",
    [
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),
    ],
)
def test_out_of_memory_ends_with_advice(tiny_model_dir, tmp_path, monkeypatch, reward, error):
    real_step, calls = trainer_mod.rl_step, itertools.count()

    def step(*args, **kwargs):
        if next(calls) == 2:
            raise error
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "rl_step", step)
    out = tmp_path / "run"
    summary = run_recipe(load_config(None, _args(tiny_model_dir, out, 4, "objective.name=grpo")))
    assert summary["status"] == "out_of_memory" and summary["steps"] == 2
    for knob in (
        "train.micro_batch_groups",
        "rollout.generation_batch_size",
        "rollout.max_new_tokens",
        "ibpo plan",
        "step 3",
        "run.resume_from=latest",
    ):
        assert knob in summary["message"]
    # <output_dir>/adapter (what push and evaluation pick up) is the checkpoint's, not the live one
    assert summary["adapter"] == str(out / "adapter")
    saved, kept = _lora(out / "checkpoints" / "step-2" / "adapter"), _lora(out / "adapter")
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in saved)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_other_errors_propagate(tiny_model_dir, tmp_path, monkeypatch, reward):
    def step(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(trainer_mod, "rl_step", step)
    with pytest.raises(ValueError, match="a bug"):
        run_recipe(load_config(None, _args(tiny_model_dir, tmp_path / "run", 2)))


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_saves_a_checkpoint_and_twice_stops_at_once(
    tiny_model_dir, tmp_path, monkeypatch, reward, presses
):
    real_step, calls = trainer_mod.rl_step, itertools.count()

    def step(*args, **kwargs):
        metrics = real_step(*args, **kwargs)
        if next(calls) == 1:  # during step 2
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
        return metrics

    monkeypatch.setattr(trainer_mod, "rl_step", step)
    out = tmp_path / "run"
    summary = run_recipe(
        load_config(None, _args(tiny_model_dir, out, 5, "objective.name=grpo", "run.save_every=0"))
    )
    assert summary["status"] == "interrupted"
    root = out / "checkpoints"
    if presses == 1:  # step 2 finishes and is saved
        assert summary["steps"] == 2 and ckpt.latest_checkpoint(root) == root / "step-2"
        assert (out / "adapter" / "adapter_model.safetensors").is_file()
    else:  # the second press interrupts step 2: nothing saved (save_every=0), and the live
        # adapter, maybe mid-update, is not taken for the run's
        assert summary["steps"] == 1 and ckpt.latest_checkpoint(root) is None
        assert not (out / "adapter").exists() and summary["adapter"] is None


class _FakeCuda:
    """torch.cuda as one process sees it: `count` visible devices, the process's own device
    `current` (Accelerate's set_device), one RNG state per visible device; records the devices
    whose state is read or set. An index outside the visible ones fails (an invalid ordinal)."""

    def __init__(self, monkeypatch, count: int, current: int, states: dict[int, torch.Tensor]):
        self.count, self.current, self.states = count, current, dict(states)
        self.gets, self.sets = [], []
        for name in (
            "is_available",
            "device_count",
            "current_device",
            "get_rng_state",
            "set_rng_state",
            "get_rng_state_all",
            "set_rng_state_all",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def _index(self, device) -> int:
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            index = self.current if device.index is None else device.index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        index = self._index(device)
        self.gets.append(index)
        return self.states[index].clone()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda") -> None:
        index = self._index(device)
        self.states[index] = new_state.clone()
        self.sets.append(index)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.count)]

    def set_rng_state_all(self, new_states) -> None:
        for i, s in enumerate(new_states):
            self.set_rng_state(s, i)


def _rng(value: int) -> torch.Tensor:
    return torch.full((8,), value, dtype=torch.uint8)


def _stream_parts():
    stream = PromptStream(builtin_examples("arithmetic", "train")[:10], seed=0, shuffle=True)
    return StepParts(None, None, None, stream, random.Random(7))


OWN, OTHER, FRESH = _rng(1), _rng(2), _rng(9)  # this process's GPU, another one, untouched


@pytest.mark.parametrize(
    "saved_with, resumed_with",
    [((2, 1), (1, 0)), ((1, 0), (2, 1)), ((2, 1), (2, 1))],
    ids=["2-visible-to-1", "1-visible-to-2", "same-layout"],
)
def test_resume_restores_the_cuda_rng_of_the_process_own_gpu(monkeypatch, saved_with, resumed_with):
    """Rank 1 saves, then resumes with another number of visible GPUs (CUDA_VISIBLE_DEVICES per
    process, or all GPUs visible): its own GPU's RNG state is the one restored, onto its own
    GPU, whatever index that GPU has now; no other device's state is read or set (touching a
    device creates a CUDA context there: memory on another process's GPU)."""
    (count, current), parts = saved_with, _stream_parts()
    states = {i: OWN if i == current else OTHER for i in range(count)}
    cuda = _FakeCuda(monkeypatch, count, current, states)
    saved = ckpt._process_state(parts)
    assert cuda.gets == [current]
    count, current = resumed_with
    cuda = _FakeCuda(monkeypatch, count, current, {i: FRESH for i in range(count)})
    ckpt._restore_process(saved, parts)
    assert torch.equal(cuda.states[current], OWN)
    assert cuda.sets == [current]
    assert all(torch.equal(s, FRESH) for i, s in cuda.states.items() if i != current)


def test_an_older_checkpoint_with_another_gpu_layout_says_the_cuda_rng_is_not_restored(
    monkeypatch,
):
    """Checkpoints written before the own-GPU key hold every visible GPU's state by position:
    with the same number visible the process's entry is restored; with another, which entry was
    its own is unknown, so a warning says the CUDA RNG keeps the run's seed (no IndexError, no
    other process's state)."""
    parts = _stream_parts()
    cuda = _FakeCuda(monkeypatch, 2, 1, {0: OTHER, 1: OWN})
    old = ckpt._process_state(parts)
    old.pop("cuda_own")
    old["cuda"] = [OTHER, OWN]  # torch.cuda.get_rng_state_all() on rank 1 of 2 visible
    ckpt._restore_process(old, parts)
    assert torch.equal(cuda.states[1], OWN) and cuda.sets == [1]
    for count, current in ((1, 0), (4, 1)):
        cuda = _FakeCuda(monkeypatch, count, current, {i: FRESH for i in range(count)})
        with pytest.warns(RuntimeWarning, match="CUDA RNG state is not restored"):
            ckpt._restore_process(old, parts)
        assert cuda.sets == []
