"""Two CPU processes (gloo) through Accelerate: DDP gives every rank the same LoRA weights, and
the update equals one process's update on the combined batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.dist_worker import BATCH_GROUPS, OBJECTIVES, lora_state, make_policy, run_update

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = Path(__file__).resolve().parents[1]


def _torchrun(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    # --standalone: a local rendezvous on a free port (a fixed port could be taken)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), *args]  # fmt: skip
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_two_processes_match_one_process_on_the_combined_batch(tiny_model_dir, tmp_path):
    from accelerate import Accelerator

    _torchrun(["update", tiny_model_dir, str(tmp_path)], tmp_path)
    acc = Accelerator(cpu=True)
    for objective in OBJECTIVES:
        r0 = torch.load(tmp_path / f"{objective}-rank0.pt")
        r1 = torch.load(tmp_path / f"{objective}-rank1.pt")
        single = run_update(tiny_model_dir, objective, list(range(BATCH_GROUPS)), acc)
        assert r0.keys() == r1.keys() == single.keys() and r0
        initial = lora_state(make_policy(tiny_model_dir, objective, torch.device("cpu"))[1])
        for name in r0:
            assert torch.equal(r0[name], r1[name]), (objective, name)  # DDP keeps ranks equal
            torch.testing.assert_close(r0[name], single[name], atol=2e-6, rtol=1e-5)
        # the updates moved the adapter well beyond that tolerance: the match is not vacuous
        assert max((r0[n] - initial[n]).abs().max().item() for n in r0) > 1e-3


def test_two_process_training_run(tiny_model_dir, tmp_path):
    """A whole `train()` on 2 processes: same adapter on both ranks, one metrics line per step
    gathered over them, a checkpoint with each process's state, and an adapter on disk."""
    out = tmp_path / "run"
    _torchrun(["train", tiny_model_dir, str(tmp_path), "model.quantization=none",
               "train.steps=2", "train.prompts_per_step=2", "rollout.group_size=2",
               "rollout.max_new_tokens=6", "rollout.eval_max_new_tokens=4", "data.eval_size=4",
               "train.learning_rate=0.01", f"train.output_dir={out}", "train.progress=false",
               "train.plots=false"], tmp_path)  # fmt: skip
    r0, r1 = torch.load(tmp_path / "train-rank0.pt"), torch.load(tmp_path / "train-rank1.pt")
    assert r0["lora"].keys() == r1["lora"].keys() and r0["lora"]
    for name in r0["lora"]:
        assert torch.equal(r0["lora"][name], r1["lora"][name]), name
    assert r0["summary"]["status"] == r1["summary"]["status"] == "completed"
    assert r0["summary"]["eval_after"]["n"] == 4  # evaluation is split over processes, then joined
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]  # the main process writes, once per step
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (latest / "process-0.pt").is_file() and (latest / "process-1.pt").is_file()
    assert (out / "adapter" / "adapter_config.json").is_file()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["train"]["prompts_per_step"] == 2


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_unverified_sharding_is_refused_with_the_way_forward(kind):
    from accelerate.utils import DistributedType

    from ibpo.config import ConfigError
    from ibpo.trainer import _check_distributed

    class Fake:
        distributed_type = getattr(DistributedType, kind)

    with pytest.raises(ConfigError, match="ddp_2gpu.yaml"):
        _check_distributed(Fake())
    Fake.distributed_type = DistributedType.MULTI_GPU
    _check_distributed(Fake())  # DDP is fine
