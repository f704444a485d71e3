"""The device check is ready before there is a device (CPU).

* scripts/gpu_check.py --dry-run prints every stage with its command and timeout, or why it would
  be skipped, says what is carried (a bitsandbytes wheel with CUDA libraries or not), writes the
  plan as its report and runs nothing; bad arguments stop it with a message naming the option.
* A real run on CPU: a wheel that does not install fails its stage and the next ones still run;
  stages that need CUDA say so; the report holds each stage's status and the environment.
* The GPU suite's harness (tests/test_gpu_e2e.py: scripted rewards, phase meter, report) runs the
  body of its first test on CPU: 4-bit base, bf16, repairs, held-out evaluation.

Not here: anything on CUDA, which is what the check is for.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
STAGES = ("install", "environment", "bnb_cuda", "gpu_suite", "bench_gpu")
BNB_WHEEL = "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"


def _run(*args, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _fake_bnb_wheel(folder: Path, cuda: bool = True) -> Path:
    """A zip named like the bitsandbytes wheel, holding the names dry-run looks at (and nothing a
    pip install would accept)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / BNB_WHEEL
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("bitsandbytes/__init__.py", "")
        if cuda:
            z.writestr("bitsandbytes/libbitsandbytes_cuda128.so", "")
    return path


def _report(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


def test_dry_run_prints_every_stage_and_what_is_carried(tmp_path):
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    _fake_bnb_wheel(wheels)
    proc = _run("--dry-run", "--out", out, "--wheels", wheels)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout
    assert "dry run: nothing is installed or run" in said
    lines = said.splitlines()
    for i, name in enumerate(STAGES, 1):
        assert any(x.startswith(f"stage {i} {name}: would run") for x in lines), name
    assert f"carried bitsandbytes wheel: yes, {BNB_WHEEL}, CUDA libraries: cuda128" in said
    assert "--no-index --no-deps --target" in said and str(wheels / BNB_WHEEL) in said
    assert "IBPO_GPU_REPORT=" in said and "-m pytest -m gpu tests/test_gpu_e2e.py" in said
    # bench_gpu under the 24 GiB cap, starting no size in the second half of its 300 s
    assert "bench/bench_gpu.py --cap-gb 24 --out" in said and "--budget-s 150" in said
    for name in ("bnb_cuda", "bench_gpu"):
        line = next(x for x in lines if x.startswith(f"stage {STAGES.index(name) + 1} {name}"))
        assert "only if the environment stage finds a CUDA device" in line
    report = _report(out)
    assert report["dry_run"] and report["carried"]["bitsandbytes_wheel"] == BNB_WHEEL
    assert report["carried"]["cuda_libraries"] == ["libbitsandbytes_cuda128.so"]
    assert [s["name"] for s in report["stages"]] == list(STAGES)
    assert all(s["status"] == "planned" and "rc" not in s for s in report["stages"])
    assert not (out / "gpu_check" / "logs").exists()  # nothing ran


def test_dry_run_says_why_a_stage_would_not_run(tmp_path):
    out, empty = tmp_path / "out", tmp_path / "no-wheels"
    empty.mkdir()
    proc = _run(
        "--dry-run", "--out", out, "--wheels", empty, "--skip", "bench_gpu", "--budget-s", "100"
    )
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout
    assert f"stage 1 install: would be skipped: no wheels in {empty}" in said
    assert "carried bitsandbytes wheel: NO" in said
    assert "stage 5 bench_gpu: would be skipped: --skip bench_gpu" in said
    assert "stage 4 gpu_suite: would run, timeout 100 s" in said  # capped by the budget
    stages = {s["name"]: s for s in _report(out)["stages"]}
    assert stages["install"]["status"] == "skipped" and stages["bench_gpu"]["status"] == "skipped"
    assert stages["gpu_suite"]["timeout_s"] == 100
    # a bitsandbytes wheel without CUDA libraries is named as such
    _fake_bnb_wheel(empty, cuda=False)
    said = _run("--dry-run", "--out", out, "--wheels", empty).stdout
    assert "but NO libbitsandbytes_cuda*.so inside" in said


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--cap-gb", "-1"], "--cap-gb must be > 0"),
        (["--skip", "nosuchstage"], "invalid choice: 'nosuchstage'"),
        (["--bench-configs", "8b"], "--bench-configs must look like 8b:1024"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_arguments_are_named(tmp_path, args, message):
    proc = _run("--dry-run", "--out", tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_without_out_or_dollar_out_it_says_so():
    proc = _run("--dry-run")
    assert proc.returncode == 2 and "--out is required when $OUT is not set" in proc.stderr


def test_a_failing_stage_does_not_stop_the_next(tmp_path):
    """Install fails (the fake wheel is no wheel), the environment stage still runs; on a
    machine without CUDA the CUDA stages are skipped and say why (on one with CUDA, they and the
    suite are skipped by --skip, to keep this test short)."""
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    _fake_bnb_wheel(wheels)
    cuda = torch.cuda.is_available()
    skip = ["gpu_suite", *(["bnb_cuda", "bench_gpu"] if cuda else [])]
    proc = _run("--out", out, "--wheels", wheels, "--skip", *skip, timeout=240)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _report(out)
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(STAGES) and report["finished"]
    assert stages["install"]["status"] == "failed" and stages["install"]["rc"] not in (0, None)
    assert "retried" not in stages["install"]  # one wheel: nothing to retry one by one
    assert stages["environment"]["status"] == "ok" and stages["environment"]["rc"] == 0
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["cuda_available"] is cuda
    assert Path(stages["environment"]["log"]).is_file()
    assert "[environment] GPU_CHECK_ENV {" in proc.stdout  # the child's output, as it goes
    assert stages["gpu_suite"]["status"] == "skipped"
    assert stages["gpu_suite"]["reason"] == "--skip gpu_suite"
    if not cuda:
        for name in ("bnb_cuda", "bench_gpu"):
            assert stages[name]["status"] == "skipped"
            assert stages[name]["reason"].startswith("no CUDA device"), stages[name]
    assert "install failed, environment ok" in proc.stdout


def test_the_gpu_suite_harness_runs_on_cpu(tiny_model_dir, tmp_path, monkeypatch):
    """check_wrong_then_right on CPU: the scripted rewards land where meant (every completion
    wrong, then right), every phase is seen, and the report file is written (no memory figures
    without CUDA)."""
    import tests.test_gpu_e2e as e2e

    report = tmp_path / "memory.json"
    monkeypatch.setenv("IBPO_GPU_REPORT", str(report))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from a second, busy core
    try:
        entry = e2e.check_wrong_then_right(tiny_model_dir, tmp_path, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    assert entry["status"] == "completed"
    assert set(entry["phase_calls"]) == {"generation", "repair", "training", "evaluation"}
    written = json.loads(report.read_text())["runs"]["wrong_then_right"]
    assert written["facts"]["optimizer"]["type"] == ("PagedAdamW8bit" if e2e.CUDA else "AdamW")
    for name, row in written["phases"].items():
        assert row["planned_bytes"] > 0, name  # the planner's figure is there either way
        assert (row["measured_bytes"] is None) == (not e2e.CUDA)


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_a_stage_past_its_timeout_is_ended_with_its_children(tmp_path):
    gc = _module()
    # the stage starts a child of its own that would outlive it if only the stage were killed
    code = (
        "import subprocess, sys, time; print('started', flush=True); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "time.sleep(120)"
    )
    stage = gc.Stage("sleepy", [sys.executable, "-c", code], timeout_s=2)
    record = gc.run_stage(stage, 2, dict(os.environ), tmp_path)
    assert record["status"] == "timeout" and "ended" in record["reason"]
    assert record["seconds"] < 30 and "started" in record["output_tail"]
    assert "started" in (tmp_path / "sleepy.log").read_text()


def test_suite_outcomes_come_from_its_log_when_there_is_no_junit_file():
    gc = _module()
    log = (
        "collected 3 items\n\n"
        "tests/test_gpu_e2e.py::test_a PASSED [ 33%]\n"
        "tests/test_gpu_e2e.py::test_b FAILED [ 66%]\n"
        "tests/test_gpu_e2e.py::test_c "
    )
    assert {k: v["outcome"] for k, v in gc.outcomes_from_log(log).items()} == {
        "test_a": "passed",
        "test_b": "failed",
        "test_c": "running when the suite ended",
    }
