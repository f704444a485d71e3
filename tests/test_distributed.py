"""Two CPU processes (gloo) through Accelerate, DDP and FSDP2: every rank ends with the same LoRA
weights, the update equals one process's update on the combined batch, and (FSDP) a run resumed
from a checkpoint ends exactly where an uninterrupted one does."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.dist_worker import BATCH_GROUPS, OBJECTIVES, lora_state, make_policy, run_update

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]


FSDP_CONFIG = ROOT / "recipes" / "accelerate" / "fsdp_qlora_2gpu.yaml"


def _fsdp_env() -> dict[str, str]:
    """The FSDP_* variables `accelerate launch --config_file fsdp_qlora_2gpu.yaml` gives each
    process (Accelerate's own launcher code): the worker runs the recipe's FSDP settings."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(FSDP_CONFIG), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    return {k: v for k, v in env.items() if "FSDP" in k}


def _torchrun(args: list[str], tmp_path: Path, fsdp: bool = False, ok: bool = True):
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        # a worker that dies by a signal (an abort in C++) prints every thread's Python stack
        "PYTHONFAULTHANDLER": "1",
    }
    env.update(_fsdp_env() if fsdp else {})
    # --standalone: a local rendezvous on a free port (a fixed port could be taken)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        *args,
    ]
    # its own session: a run that hangs is killed whole (workers included), not just torchrun
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert (res.returncode == 0) == ok, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_match_one_process_on_the_combined_batch(tiny_model_dir, tmp_path, fsdp):
    from accelerate import Accelerator

    _torchrun(["update", tiny_model_dir, str(tmp_path)], tmp_path, fsdp)
    acc = Accelerator(cpu=True)
    # FSDP reduce-scatters (another summation order than DDP's all-reduce): last bits differ
    atol = 2e-5 if fsdp else 2e-6
    for objective in OBJECTIVES:
        r0 = torch.load(tmp_path / f"{objective}-rank0.pt")
        r1 = torch.load(tmp_path / f"{objective}-rank1.pt")
        single = run_update(tiny_model_dir, objective, list(range(BATCH_GROUPS)), acc)
        assert r0.keys() == r1.keys() == single.keys() and r0
        initial = lora_state(make_policy(tiny_model_dir, objective, torch.device("cpu"))[1])
        for name in r0:
            assert torch.equal(r0[name], r1[name]), (objective, name)  # ranks stay equal
            torch.testing.assert_close(r0[name], single[name], atol=atol, rtol=1e-5)
        # the updates moved the adapter well beyond that tolerance: the match is not vacuous
        assert max((r0[n] - initial[n]).abs().max().item() for n in r0) > 1e-3
    if fsdp:  # generation: full weights inside `gathered`, shards around it and per layer
        _check_fsdp_generation(tiny_model_dir, tmp_path)


def _check_fsdp_generation(model_dir: str, tmp_path: Path) -> None:
    from ibpo.generation import generate

    found = [torch.load(tmp_path / f"gather-rank{r}.pt") for r in (0, 1)]
    for f in found:
        assert f["sharded"] == {"before": True, "inside": False, "after": True}
    cfg, model, tok = make_policy(model_dir, "ibpo", torch.device("cpu"))
    single = generate(model, tok, ["what is 2 + 3?", "hello"], 2, 6, 8, do_sample=False).input_ids
    for f in found:  # greedy tokens on both ranks equal one unsharded process's
        assert torch.equal(f["tokens"], single)


def test_fsdp_training_resumes_exactly(tiny_model_dir, tmp_path):
    """FSDP2 over 2 processes: a 3-step run and a 2-step run resumed for step 3 end with equal
    LoRA tensors (adapter and optimizer state gathered into the checkpoint, scattered back); the
    saved adapter is the live one; repairs and evaluation (5 problems in batches of 2: 2 calls
    on one process, 1 on the other) run on gathered weights."""
    args = [
        "model.quantization=none",
        "train.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "data.eval_size=5",
        "rollout.eval_max_new_tokens=4",
        "rollout.generation_batch_size=2",
        "reward.functions=parity",
        "run.save_every=1",
        "train.learning_rate=0.01",
        "repair.max_repairs_per_group=1",
        "repair.template='{question}|{attempt}|{reference}'",
    ]
    _torchrun(["resume", tiny_model_dir, str(tmp_path), *args], tmp_path, fsdp=True)
    r0, r1 = (torch.load(tmp_path / f"resume-rank{r}.pt") for r in (0, 1))
    full, resumed = r0["full"], r0["resumed"]
    assert full["summary"]["status"] == resumed["summary"]["status"] == "completed"
    assert resumed["summary"]["resumed_from"] == str(tmp_path / "part" / "checkpoints" / "step-2")
    assert full["summary"]["eval_after"]["n"] == 5
    assert full["lora"].keys() == resumed["lora"].keys() and full["lora"]
    for name, value in full["lora"].items():
        assert torch.equal(value, resumed["lora"][name]), name
        # (under FSDP both ranks gather the same shards: this holds by construction; the
        # single-process comparison in the update test is what checks the arithmetic)
        assert torch.equal(value, r1["full"]["lora"][name]), name
    assert max(v.abs().max().item() for n, v in full["lora"].items() if "lora_B" in n) > 1e-3
    saved = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    assert {n.replace(".default", ""): v for n, v in full["lora"].items()}.keys() == saved.keys()
    for name, value in full["lora"].items():
        assert torch.equal(saved[name.replace(".default", "")], value), name
    step3 = tmp_path / "full" / "checkpoints" / "step-3"
    assert json.loads((step3 / "trainer_state.json").read_text())["fsdp"] is True
    rewards = [
        [json.loads(x)["reward"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("full", "part")
    ]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 3 and len(set(rewards[0])) > 1


def test_two_process_training_run(tiny_model_dir, tmp_path):
    """A whole `train()` on 2 processes: same adapter on both ranks, one metrics line per step
    gathered over them, a checkpoint with each process's state, and an adapter on disk; the
    repair spending rule holds one state on both ranks, learnt from both ranks' repairs."""
    out = tmp_path / "run"
    _torchrun(
        [
            "train",
            tiny_model_dir,
            str(tmp_path),
            "model.quantization=none",
            "train.steps=3",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=6",
            "rollout.eval_max_new_tokens=4",
            "data.eval_size=4",
            "train.learning_rate=0.01",
            "reward.functions=parity",
            "repair.min_success=0.9",
            "repair.probe_every=2",
            # short repair prompts: the default template alone is over the token budget of
            # these 2-token-per-member rollouts
            "repair.template='{question}|{attempt}|{reference}'",
            f"run.output_dir={out}",
        ],
        tmp_path,
    )
    r0, r1 = torch.load(tmp_path / "train-rank0.pt"), torch.load(tmp_path / "train-rank1.pt")
    assert r0["lora"].keys() == r1["lora"].keys() and r0["lora"]
    for name in r0["lora"]:
        assert torch.equal(r0["lora"][name], r1["lora"][name]), name
    # one LoRA init, then each process its own sampling streams (torch, the repair planner)
    assert not torch.equal(r0["torch_rng"], r1["torch_rng"])
    assert r0["repair_rng"] != r1["repair_rng"]
    assert r0["summary"]["status"] == r1["summary"]["status"] == "completed"
    assert r0["summary"]["eval_after"]["n"] == 4  # evaluation is split over processes, then joined
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]  # the main process writes, once per step
    # each rank repaired its own groups; the rule's history and decisions are the same on both
    s0, s1 = r0["repair_rule"], r1["repair_rule"]
    assert len(s0) == len(s1) == 3
    assert [s["mode"] for s in s0] == [s["mode"] for s in s1]
    assert [s["state"] for s in s0] == [s["state"] for s in s1]
    assert any(a["local"] != b["local"] for a, b in zip(s0, s1))
    attempts = sum(s["local"][0] for s in s0 + s1)  # both ranks' repairs, once each
    assert attempts > 0 and s0[0]["state"]["attempts"] == s0[0]["local"][0] + s1[0]["local"][0]
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (latest / "process-0.pt").is_file() and (latest / "process-1.pt").is_file()
    assert (out / "adapter" / "adapter_config.json").is_file()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["train"]["prompts_per_step"] == 2


def test_fsdp_qlora_shards_the_4bit_weights_and_trains_as_ddp_does(tiny_model_dir, tmp_path):
    """FSDP-QLoRA proper: the packed NF4 codes (stored in the compute dtype) are split over the
    2 processes, and 2 steps with repairs give the LoRA weights DDP gives (bitsandbytes' CPU
    kernels; 4-bit matmuls leave more rounding than fp32: 1e-4)."""
    args = [
        "model.quantization=nf4",
        "--bnb-kernels",
        "train.steps=2",
        "train.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "data.eval_size=0",
        "reward.functions=parity",
        "train.learning_rate=0.01",
        "repair.max_repairs_per_group=1",
        "repair.template='{question}|{attempt}|{reference}'",
    ]
    found = {}
    for kind in ("ddp", "fsdp"):
        out = tmp_path / kind
        out.mkdir()
        _torchrun(
            ["train", tiny_model_dir, str(out), *args, f"run.output_dir={out / 'run'}"],
            tmp_path,
            fsdp=kind == "fsdp",
        )
        found[kind] = torch.load(out / "train-rank0.pt")
    ddp, fsdp = found["ddp"], found["fsdp"]
    assert ddp["q_proj_weight"]["local"] == ddp["q_proj_weight"]["full"]
    assert fsdp["q_proj_weight"]["local"] * 2 == fsdp["q_proj_weight"]["full"]
    assert fsdp["summary"]["status"] == "completed" and fsdp["summary"]["quantization"] == "nf4"
    lora = {n.removeprefix("module."): v for n, v in ddp["lora"].items()}
    assert lora.keys() == fsdp["lora"].keys() and lora
    for name, value in fsdp["lora"].items():
        torch.testing.assert_close(value, lora[name], atol=1e-4, rtol=1e-4)
    assert max(v.abs().max().item() for n, v in lora.items() if "lora_B" in n) > 1e-2


def test_launch_check_refuses_what_the_loop_does_not_run():
    from accelerate.utils import DistributedType

    from ibpo.config import ConfigError
    from ibpo.distributed import check_launch
    from ibpo.recipe import load_config

    class Fake:
        distributed_type, is_fsdp2 = DistributedType.FSDP, False

    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        check_launch(Fake(), cfg)
    Fake.is_fsdp2 = True
    check_launch(Fake(), cfg)  # FSDP2 is fine, with `auto` (torch AdamW under FSDP) or adamw
    check_launch(Fake(), load_config(None, ["train.optimizer=adamw"]))
    with pytest.raises(ConfigError, match="train.optimizer=adamw"):
        check_launch(Fake(), load_config(None, ["train.optimizer=adamw_8bit"]))
    Fake.distributed_type = DistributedType.DEEPSPEED
    with pytest.raises(ConfigError, match="ddp_2gpu.yaml or fsdp_qlora_2gpu.yaml"):
        check_launch(Fake(), cfg)
    Fake.distributed_type = DistributedType.MULTI_GPU
    check_launch(Fake(), load_config(None, ["train.optimizer=adamw_8bit"]))  # DDP is fine
    Fake.num_processes = 2  # one vLLM engine beside one policy
    with pytest.raises(ConfigError, match="rollout.backend=hf"):
        check_launch(Fake(), load_config(None, ["rollout.backend=vllm"]))
    Fake.distributed_type, Fake.num_processes = DistributedType.NO, 1
    check_launch(Fake(), load_config(None, ["rollout.backend=vllm"]))


@pytest.mark.parametrize("kind", ["NO", "MULTI_GPU", "FSDP"])
def test_accelerate_mixed_precision_is_refused_on_every_path(kind):
    """Accelerate autocasts the wrapped forward, which DDP/FSDP go through and one process does
    not: one precision switch (model.dtype), so 1 and 2 GPUs compute the same numbers."""
    from accelerate.utils import DistributedType

    from ibpo.config import ConfigError
    from ibpo.distributed import check_launch
    from ibpo.recipe import load_config

    class Fake:
        distributed_type, is_fsdp2, num_processes = DistributedType[kind], True, 1
        mixed_precision = "bf16"

    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match='mixed_precision: "no".*model.dtype=bfloat16'):
        check_launch(Fake(), cfg)
    Fake.mixed_precision = "no"
    check_launch(Fake(), cfg)


def test_auto_optimizer_avoids_paged_8bit_under_fsdp(tiny_model_dir):
    from ibpo.trainer import build_optimizer

    cfg, model, _ = make_policy(tiny_model_dir, "ibpo", torch.device("cpu"))
    opt = build_optimizer(model, cfg, torch.device("cuda"), fsdp=True)  # builds nothing on CUDA
    assert type(opt) is torch.optim.AdamW


def test_one_process_out_of_memory_ends_the_run_instead_of_hanging(tiny_model_dir, tmp_path):
    """Process 1 runs out of memory in step 2 while process 0 goes on into the update's first
    collective. Process 1 must not wait for the others (they cannot join another collective): it
    reports with its advice and exits 1, process 0's collective then fails, and the launcher
    ends the run in seconds, not at a collective timeout."""
    import time

    out = tmp_path / "run"
    start = time.monotonic()
    res = _torchrun(
        [
            "oom",
            tiny_model_dir,
            str(tmp_path),
            "model.quantization=none",
            "train.steps=3",
            "train.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=4",
            "data.eval_size=0",
            f"run.output_dir={out}",
        ],
        tmp_path,
        ok=False,
    )
    assert time.monotonic() - start < 150
    assert "ibpo: process 1: out of memory in step 2" in res.stderr, res.stderr[-3000:]


LEAVER = """
import atexit, sys
import torch.distributed as dist
import ibpo.distributed as distributed

class TwoProcesses:
    num_processes = 2

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
atexit.register(lambda: print("exit handler ran", flush=True))
distributed.ended_together(TwoProcesses(), sys.argv[2] == "together")
print("run ended", end="")  # unflushed: leave() must flush it
distributed.leave_if_ended_together(5)
print(" and the process went on")
"""


@pytest.mark.parametrize("together", [True, False], ids=["together", "alone"])
def test_a_process_that_ended_together_leaves_without_the_cpp_teardown(tmp_path, together):
    """A finished DDP process on gloo can abort in C++'s teardown after its last line (SIGABRT,
    a failed launch); `ibpo train` leaves such a process with os._exit once its exit handlers ran,
    the output is flushed and the group destroyed. A process that ended alone exits normally."""
    res = subprocess.run(
        [sys.executable, "-c", LEAVER, str(tmp_path / "store"), "together" if together else "no"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    if together:
        assert res.returncode == 5, res.stderr
        assert res.stdout == "run ended" + "exit handler ran\n"
    else:
        assert res.returncode == 0, res.stderr
        assert res.stdout == "run ended and the process went on\nexit handler ran\n"
