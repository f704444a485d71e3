import json
import os
import random
import sqlite3
import subprocess
import sys

import pytest
import torch

from ibpo.data import PromptStream, builtin_examples
from ibpo.modeling import load_policy
from ibpo.recipe import load_config, resolve_params
from ibpo.rewards import GRADERS
from ibpo.step import rl_step
from ibpo.step_parts import StepParts
from ibpo.trainer import build_optimizer, run_recipe


class GradRecorder(torch.optim.Optimizer):
    """An optimizer that records the gradients it is asked to apply (and applies them as plain
    SGD when lr > 0, so that a second update on the same rollout is off-policy)."""

    def __init__(self, params, lr: float = 0.0):
        super().__init__(params, {"lr": lr})
        self.grads = []

    @torch.no_grad()
    def step(self, closure=None):
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad, alpha=-g["lr"])


def _setup(tiny_model_dir, overrides, peft_config=None):
    from accelerate import Accelerator

    base = [f"model.name={tiny_model_dir}", "rollout.max_new_tokens=8", "rollout.group_size=4"]
    cfg = load_config(None, [*base, "train.prompts_per_step=4", *overrides])
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model, tok = load_policy(cfg.model, torch.device("cpu"), peft_config=peft_config)
    for n, p in model.named_parameters():  # non-zero adapter so every LoRA matrix gets a grad
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(2))
    return cfg, acc, model, tok


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _examples():
    return builtin_examples("arithmetic", "train")[:4]


def _step(model, tok, opt, sched, acc, cfg):
    stream = PromptStream(_examples(), seed=0, shuffle=False)
    parts = StepParts(model, opt, sched, stream, random.Random(0))
    return rl_step(parts, tok, acc, cfg, resolve_params(cfg.objective), step=0)


def test_one_step_changes_lora_only(tiny_model_dir):
    cfg, acc, model, tok = _setup(
        tiny_model_dir, ["model.quantization=nf4", "train.learning_rate=0.01"]
    )
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    # force a learning signal: rewards from the grader are mostly 0 on a random model

    calls = iter(range(10_000))
    GRADERS["alternating"] = lambda text, ans: float(next(calls) % 2)
    try:
        cfg.reward.functions = "alternating"
        m = _step(model, tok, opt, sched, acc, cfg)
    finally:
        del GRADERS["alternating"]
    after = model.state_dict()
    # compare bytes: packed 4-bit weights stored as float32 may contain NaN bit patterns
    changed = [n for n in before if not torch.equal(_bytes(before[n]), _bytes(after[n]))]
    assert changed and [n for n in changed if "lora_" not in n] == []
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    for key in ("reward", "loss", "entropy", "grad_norm", "step_time", "peak_memory_gb"):
        assert key in m
    assert m["reward"] == 0.5 and m["zero_variance_groups"] == 0.0


# all groups at once; one group per micro-batch; two (sorted, cut micro-batches)
BATCHINGS = (["train.micro_batch_groups=4"], ["train.micro_batch_groups=1"],
             ["train.micro_batch_groups=2"])  # fmt: skip


def _recorded_steps(tiny_model_dir, overrides, lr=0.0, metrics=None) -> list[GradRecorder]:
    """One step per batching of BATCHINGS, same seed and rewards; each step's recorder (and its
    metrics appended to `metrics`)."""

    recorders = []
    for batching in BATCHINGS:
        cfg, acc, model, tok = _setup(tiny_model_dir, [*batching, *overrides])
        opt = GradRecorder([p for p in model.parameters() if p.requires_grad], lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        counter = iter(range(10_000))
        GRADERS["alternating"] = lambda t, a, c=counter: float(next(c) % 3 == 0)
        cfg.reward.functions = "alternating"
        try:
            torch.manual_seed(5)
            m = _step(model, tok, opt, sched, acc, cfg)
            if metrics is not None:
                metrics.append(m)
        finally:
            del GRADERS["alternating"]
        recorders.append(opt)
    return recorders


def _assert_same_grads(grads: list[list[torch.Tensor]]) -> None:
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("objective", ["ibpo", "grpo", "dr_grpo", "gspo"])
def test_micro_batch_times_accumulation_invariance(tiny_model_dir, objective):
    steps = _recorded_steps(
        tiny_model_dir, [f"objective.name={objective}", "objective.kl_coef=0.1"]
    )
    grads = [opt.grads[0] for opt in steps]
    assert any(g.abs().sum() > 0 for g in grads[0])
    _assert_same_grads(grads)


@pytest.mark.parametrize("objective", ["ibpo", "grpo"])
def test_off_policy_update_is_invariant_to_micro_batching(tiny_model_dir, objective):
    """Two updates per rollout: the second runs with ratios != 1 (Min-Replace weights, GRPO's
    clip), and its gradient must not depend on how the step is split into micro-batches."""
    overrides = [f"objective.name={objective}", "train.updates_per_rollout=2"]
    metrics = []
    steps = _recorded_steps(tiny_model_dir, overrides, lr=2.0, metrics=metrics)
    assert all(len(opt.grads) == 2 for opt in steps)
    # the second update is off-policy: its gradient differs from the first's
    assert any(not torch.allclose(a, b) for a, b in zip(*steps[0].grads))
    _assert_same_grads([opt.grads[1] for opt in steps])
    # the logged rates are weighted by what they average over, not by micro-batch: the same
    # whatever the split (grpo's clip fraction, ibpo's group weight; entropy and KL)
    rate = "clip_fraction" if objective == "grpo" else "weight_mean"
    assert metrics[0][rate] != (1.0 if objective == "ibpo" else 0.0)  # the off-policy update acted
    for key in (rate, "entropy", "kl", "loss"):
        for m in metrics[1:]:
            assert m[key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7), key


def test_old_logprobs_are_the_rollout_policy_s_even_with_lora_dropout(tiny_model_dir):
    """Frozen (old) log-probs run without dropout, whatever mode the model is in: with an
    adapter's dropout > 0 (a peft_config= of ibpo.train) two calls agree and equal the
    eval-mode policy's."""
    from peft import LoraConfig

    from ibpo.batching import cut
    from ibpo.generation import generate
    from ibpo.step import frozen_logprobs, sequence_logprobs

    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.5, target_modules="all-linear")
    cfg, acc, model, tok = _setup(tiny_model_dir, [], peft_config=lora)
    ro = generate(model, tok, ["What is 1 + 1?", "hello"], 2, 6, batch_size=8)
    mb = cut(ro, list(range(ro.num_sequences)))
    model.train()
    a, b = (frozen_logprobs(model, [mb], 64, 1.0, False, 1)[0] for _ in range(2))
    assert model.training  # the mode is restored
    model.eval()
    with torch.no_grad():
        policy = sequence_logprobs(model, mb, 64, 1.0)[0]
        model.train()
        dropped = sequence_logprobs(model, mb, 64, 1.0)[0]
    assert not torch.allclose(dropped, policy)  # dropout does act in train mode
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, policy)


def test_train_writes_adapter_summary_and_metrics(tiny_model_dir, tmp_path):
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
            "data.eval_size=6",
            f"run.output_dir={out}",
            "train.steps=3",
            "train.eval_every=2",
        ],
    )
    summary = run_recipe(cfg)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert summary["steps"] == 3 and summary["status"] == "completed"
    assert summary["isolation"] is None  # no test ran in the sandbox
    assert summary["eval_before"]["n"] == 6 and summary["eval_after"]["n"] == 6
    assert (out / "adapter" / "adapter_config.json").is_file()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # steps 1-3, and the periodic evaluation after step 2 (the last step has eval_after)
    assert [x["step"] for x in lines] == [1, 2, 2, 3]
    assert [x["grader_errors"] for x in lines if "reward" in x] == [0.0, 0.0, 0.0]
    assert lines[2].keys() == {"step", "eval_accuracy", "eval_n", "eval_grader_errors"}
    assert lines[2]["eval_n"] == 6 and lines[2]["eval_grader_errors"] == 0.0
    assert 0.0 <= lines[2]["eval_accuracy"] <= 1.0
    png = out / "plots" / "training.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


def test_trackers_through_accelerate_get_every_step_and_eval(tiny_model_dir, tmp_path):
    """tensorboard, wandb (offline mode) and trackio (its local database) in one run; the test
    extra installs their packages. A fresh process: trackio reads TRACKIO_DIR when first
    imported, and other tests (TRL's) import it."""
    for name in ("tensorboardX", "wandb", "trackio"):
        pytest.importorskip(name)
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_SILENT": "true",
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    (tmp_path / "wandb").mkdir()
    out = tmp_path / "run"
    args = [
        f"model.name={tiny_model_dir}",
        "model.quantization=none",
        "train.steps=2",
        "train.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "rollout.eval_max_new_tokens=4",
        "data.eval_size=4",
        f"run.output_dir={out}",
        "run.log_with=[tensorboard,wandb,trackio]",
        "train.eval_every=1",
    ]
    code = f"from ibpo.cli import main; raise SystemExit(main(['train', *{args!r}]))"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    tags = (b"reward", b"residual", b"entropy", b"eval_accuracy")
    events = b"".join(p.read_bytes() for p in out.rglob("events.out.tfevents*"))
    wandb_run = b"".join(p.read_bytes() for p in (tmp_path / "wandb").rglob("run-*.wandb"))
    for tag in tags:  # scalars are stored under their metric names
        assert tag in events and tag in wandb_run, tag
    with sqlite3.connect(tmp_path / "trackio" / "ibpo.db") as db:
        rows = db.execute("select step, metrics from metrics").fetchall()
    logged = [(step, json.loads(m)) for step, m in rows]
    assert sorted({step for step, _ in logged}) == [1, 2]
    keys = set().union(*(m.keys() for _, m in logged))
    assert {t.decode() for t in tags} <= keys


def test_end_of_run_extras_never_fail_a_finished_run(tmp_path, monkeypatch, capsys):
    import ibpo.hub.push
    import ibpo.run.report
    from ibpo.trainer import finish_run

    cfg = load_config(None, ["run.hub_repo_id=alice/run"])

    def boom(*a, **k):
        raise KeyError("config")

    monkeypatch.setattr(ibpo.run.report, "plot_run", boom)
    monkeypatch.setattr(ibpo.hub.push, "push", boom)
    finish_run(tmp_path, cfg, "completed")  # no exception
    err = capsys.readouterr().err
    assert "plots or summary not written" in err and f"Retry: ibpo push {tmp_path}" in err


def test_eval_every_needs_a_held_out_set():
    from ibpo.config import ConfigError

    with pytest.raises(ConfigError, match="eval_size"):
        load_config(None, ["train.eval_every=5", "data.eval_size=0"])


def test_a_code_reward_refuses_the_socket_patch_sandbox(tmp_path, monkeypatch):
    """RL-written programs need a sandbox that contains them: socket-patch alone is refused
    before anything is touched, unless the run opts in by name."""
    from ibpo.config import ConfigError
    from ibpo.rewards import code as code_grader
    from ibpo.sandbox import memory

    monkeypatch.setattr(code_grader, "isolation_mode", lambda: "socket-patch")
    monkeypatch.setattr(code_grader, "uncontained", lambda mode: None)
    out = tmp_path / "run"
    overrides = ["reward.functions=code", "data.answer_format=plain", f"run.output_dir={out}"]
    with pytest.raises(ConfigError, match="bubblewrap.*reward.sandbox=allow_socket_patch"):
        run_recipe(load_config(None, overrides))
    assert not out.exists()
    allow = code_grader.training_policy("allow_socket_patch")
    assert code_grader.check_training_sandbox(allow) == "socket-patch"
    monkeypatch.setattr(code_grader, "isolation_mode", lambda: "namespaces")
    monkeypatch.setattr(memory, "_probe", lambda: ("cgroup-v2", "/sys/fs/cgroup"))
    assert code_grader.check_training_sandbox(code_grader.training_policy("isolated")) == (
        "namespaces"
    )


def test_a_code_reward_refuses_a_sandbox_without_a_whole_test_memory_bound(tmp_path, monkeypatch):
    """Without a writable memory cgroup, memfd and shared-memory pages escape every
    per-process limit: refused like socket-patch, unless the run opts in by name."""
    from ibpo.config import ConfigError
    from ibpo.rewards import code as code_grader
    from ibpo.sandbox import memory

    monkeypatch.setattr(code_grader, "isolation_mode", lambda: "bwrap")
    monkeypatch.setattr(memory, "_probe", lambda: ("per-process", ""))
    out = tmp_path / "run"
    overrides = ["reward.functions=code", "data.answer_format=plain", f"run.output_dir={out}"]
    with pytest.raises(ConfigError, match="no memory cgroup.*allow_per_process_memory"):
        run_recipe(load_config(None, overrides))
    assert not out.exists()
    for name in ("allow_per_process_memory", "allow_socket_patch"):
        assert code_grader.check_training_sandbox(code_grader.training_policy(name)) == "bwrap"


def test_summary_isolation_joins_every_process_s_record(monkeypatch):
    """With several processes each records the tests it started; the summary names them all,
    except for a process that may join no collective (out of memory alone), which names its own."""
    from types import SimpleNamespace

    from ibpo import trainer
    from ibpo.sandbox.policy import Record

    run = SimpleNamespace(
        accelerator=SimpleNamespace(num_processes=2), sandbox=Record(modes={"bwrap": 3})
    )
    others = [{"namespaces": 1, "bwrap": 2}]
    monkeypatch.setattr(trainer, "gather_object", lambda mine: [*mine, *others])
    assert trainer.Run.isolation(run, alone=False) == "bwrap, namespaces"
    assert trainer.Run.isolation(run, alone=True) == "bwrap"
    run.sandbox, others[:] = Record(), [{}]
    assert trainer.Run.isolation(run, alone=False) is None
