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
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
STAGES = ("install", "environment", "bnb_cuda", "bench_gpu", "learning", "gpu_suite")
BNB_WHEEL = "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"


def _run(*args, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
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
    # first of all, the versions found (peft's is not known in advance), importing nothing
    assert lines[0].startswith("versions: peft ") and "transformers " in lines[0]
    for i, name in enumerate(STAGES, 1):
        assert any(x.startswith(f"stage {i} {name}: would run") for x in lines), name
    assert f"carried bitsandbytes wheel: yes, {BNB_WHEEL}, CUDA libraries: cuda128" in said
    assert "--no-index --no-deps --target" in said and str(wheels / BNB_WHEEL) in said
    assert "IBPO_GPU_REPORT=" in said and "-m pytest -m gpu tests/test_gpu_e2e.py" in said
    assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1" in said  # the image's plugins stay out
    # bench_gpu under the 23.5 GiB cap; at worst (install, environment and bnb_cuda at their
    # 40, 45 and 40 s timeouts) 530 - 125 - 45 - 120 = 240 s, less 30 s for its start-up
    assert "bench/bench_gpu.py --cap-gb 23.5 --out" in said and "--budget-s 210" in said
    assert "guaranteed even if every earlier stage runs to its timeout: bench_gpu 240 s, " in said
    assert "learning 45 s, gpu_suite 120 s" in said
    assert "order: install -> environment -> bnb_cuda -> bench_gpu -> learning -> gpu_suite" in said
    assert "files back in $OUT: 2 (gpu_check.json, gpu_check.log), at most 8 come back" in said
    assert str(out / "gpu_check") not in said  # no raw files under $OUT
    for name in ("bnb_cuda", "bench_gpu", "learning"):
        line = next(x for x in lines if x.startswith(f"stage {STAGES.index(name) + 1} {name}"))
        assert "unless the environment stage finds no CUDA device" in line
    report = _report(out)
    assert report["dry_run"] and report["carried"]["bitsandbytes_wheel"] == BNB_WHEEL
    assert report["carried"]["cuda_libraries"] == ["libbitsandbytes_cuda128.so"]
    assert [s["name"] for s in report["stages"]] == list(STAGES)
    assert all(s["status"] == "planned" and "rc" not in s for s in report["stages"])
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json"]  # nothing ran


def test_dry_run_says_why_a_stage_would_not_run(tmp_path):
    out, empty = tmp_path / "out", tmp_path / "no-wheels"
    empty.mkdir()
    skip = ["--skip", "bench_gpu", "learning", "gpu_suite"]  # no guaranteed share to keep
    proc = _run("--dry-run", "--out", out, "--wheels", empty, *skip, "--budget-s", "90")
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout
    assert f"stage 1 install: would be skipped: no wheels in {empty}" in said
    assert "carried bitsandbytes wheel: NO" in said
    assert "stage 4 bench_gpu: would be skipped: --skip bench_gpu" in said
    # 90 s less 30 kept back: environment 45, bnb_cuda the other 15
    assert "stage 2 environment: would run, timeout 45 s at worst" in said
    assert "stage 3 bnb_cuda: would run (unless" in said and "timeout 15 s at worst" in said
    stages = {s["name"]: s for s in _report(out)["stages"]}
    assert stages["install"]["status"] == "skipped" and stages["bench_gpu"]["status"] == "skipped"
    assert stages["bnb_cuda"]["timeout_s"] == 15 and stages["gpu_suite"]["status"] == "skipped"
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
        (["--budget-s", "300"], "cannot guarantee bench_gpu 240 s, learning 45 s, gpu_suite 120"),
        (["--budget-s", "200", "--skip", "bench_gpu"], "give at least 320 s"),
        (["--fake-device", "H200"], "--fake-device must look like"),
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
    (wheels / "pytest-9.2.0-py3-none-any.whl").write_bytes(b"")  # the image has pytest
    cuda = torch.cuda.is_available()
    skip = ["gpu_suite", *(["bnb_cuda", "bench_gpu", "learning"] if cuda else [])]
    proc = _run("--out", out, "--wheels", wheels, "--skip", *skip, timeout=240)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _report(out)
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(STAGES) and report["finished"]
    assert stages["install"]["status"] == "failed" and stages["install"]["rc"] not in (0, None)
    assert "retried" not in stages["install"]  # one wheel: nothing to retry one by one
    assert report["carried"]["not_installed"] == ["pytest-9.2.0-py3-none-any.whl"]
    assert not any(Path(c).name.startswith("pytest-") for c in stages["install"]["command"])
    assert stages["environment"]["status"] == "ok" and stages["environment"]["rc"] == 0
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["cuda_available"] is cuda
    # the versions first (peft's among them), bitsandbytes' import tried last, in a child
    # the distribution's version (torch.__version__ may add the build: 2.11.0+cu130)
    assert report["environment"]["versions"]["torch"] == metadata.version("torch")
    assert list(report["environment"]["versions"])[0] == "peft"
    # the dev venv has bitsandbytes; a busy CPU may take longer than the probe waits for it
    said = report["environment"]["bitsandbytes_imports"]
    assert said is True or said == "import bitsandbytes did not finish in 30 s", said
    assert list(report["image_versions"])[0] == "peft"
    assert proc.stdout.startswith("versions: peft ")
    log = out / "gpu_check.log"
    assert Path(stages["environment"]["log"]) == log
    assert "[environment] GPU_CHECK_ENV {" in log.read_text()  # one combined log
    assert "[environment] GPU_CHECK_ENV {" in proc.stdout  # the child's output, as it goes
    # what comes back from $OUT: the report and the log, well under the device's 8 files
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    assert report["out_files"] == {"written": ["gpu_check.json", "gpu_check.log"], "max": 8}
    assert "fallback" not in report  # no CUDA device, or bnb_cuda skipped by --skip
    assert stages["gpu_suite"]["status"] == "skipped"
    assert stages["gpu_suite"]["reason"] == "--skip gpu_suite"
    if not cuda:
        for name in ("bnb_cuda", "bench_gpu", "learning"):
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
    record = gc.run_stage(stage, 2, dict(os.environ), tmp_path / "gpu_check.log")
    assert record["status"] == "timeout" and "ended" in record["reason"]
    assert record["seconds"] < 30 and "started" in record["output_tail"]
    assert "[sleepy] started" in (tmp_path / "gpu_check.log").read_text()


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


def test_dry_run_shows_the_plan_rows_the_bench_would_measure(tmp_path):
    """Against a fake device: the 8B recipe's own shapes (32 completions of 512 + 1024 tokens,
    LoRA r32) with the planner's figure per phase, and the fallback's sizes without 4-bit."""
    out = tmp_path / "out"
    proc = _run("--dry-run", "--out", out, "--fake-device", "RTX 4090:23.6", "--cap-gb", "23.5")
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout
    assert "fake device: RTX 4090, 23.6 GiB; torch capped at 23.5 GiB" in said
    row = next(x for x in said.splitlines() if x.startswith("bench rows (plan): recipe:"))
    # the 8B recipe's own shapes, decoding as many new tokens as the bench's time allows
    assert "qwen3-8b, 32 completions x 512+1024 tokens, LoRA r32" in row and ": fits" in row
    for phase in ("generation", "repair", "training", "evaluation"):
        assert f" {phase} " in row, phase
    fallback = next(x for x in said.splitlines() if x.startswith("fallback bench rows (plan): rec"))
    assert "qwen3-8b does not fit the plan under 23.5 GiB" in fallback and ": fits" in fallback
    assert "fallback if bnb_cuda fails" in said and "IBPO_GPU_QUANTIZATION=none" in said
    report = _report(out)
    rows = {r["config"]: r for r in report["bench_plan"]["nf4"]}
    assert rows["recipe"]["plan_phases_gb"]["generation"] > 0 and rows["recipe"]["plan_fits"]
    assert report["timeouts_worst_case"]["bench_gpu"] >= 240
    # row status: the headline row runs even at worst (its required phases fit the bench's
    # guaranteed share); the time plan per phase; the headline rule
    recipe = rows["recipe"]
    assert set(recipe["plan_seconds"]) == {
        "build", "load", "rollout", "repairs", "update", "evaluation", "update_offload"
    }  # fmt: skip
    # at the decode engine's planned rate the 8B recipe fits its full 1024 new tokens at worst
    # (no carried wheels: no install stage before the bench)
    assert recipe["schedule"] == {"at worst": "runs", "at its full timeout": "runs"}
    assert "new_tokens_capped" not in recipe and "; at worst: runs;" in row
    assert "seconds build " in row
    assert "bench_gpu's status is its headline row's" in said
    assert "bench time plan (bench_gpu.plan_seconds: the rates an H200 measured" in said
    for r in report["bench_plan"]["none"]:  # the fallback's rows have theirs too
        assert r["planned"] and r["schedule"]["at worst"]


@pytest.mark.parametrize("skip", [(), ("bench_gpu",), ("learning",), ("install", "gpu_suite")])
def test_the_budget_guarantees_each_share(skip):
    """Whatever runs to its timeout before them, bench_gpu, learning and the suite each keep
    their share, at the least budget parse_args accepts and above it."""
    gc = _module()
    floor = gc.budget_needed(skip)
    shared = [n for n in gc.MIN_S if n not in skip]
    assert floor == gc.RESERVE_S + sum(
        gc.TIMEOUTS[n] for n in ("install", "environment", "bnb_cuda") if n not in skip
    ) + sum(gc.MIN_S[n] for n in shared)
    for budget in (floor, floor + 1, 560, 1000):
        worst = gc.worst_case_timeouts(budget, skip)
        for name in shared:
            assert worst[name] >= gc.MIN_S[name], (budget, worst)
        assert sum(worst.values()) <= budget - gc.RESERVE_S
    given = ["--skip", *skip] if skip else []
    assert gc.parse_args(["--dry-run", "--out", "/tmp", *given]).budget_s >= floor  # default
    assert gc.STAGES.index("bench_gpu") < gc.STAGES.index("gpu_suite")  # measured first


def test_a_real_run_keeps_the_later_shares(tmp_path):
    """run_all's own timeouts: a stage that would take the whole budget is capped so that the
    stages after it keep their shares (stand-in stages that only print)."""
    gc = _module()
    assert gc.stage_timeout(330, 400, ["learning", "gpu_suite"]) == 400 - 45 - 120
    assert gc.stage_timeout(330, 800, ["learning", "gpu_suite"]) == 330  # its own
    assert gc.stage_timeout(90, 200, ["gpu_suite"]) == 80
    assert gc.stage_timeout(240, 500, []) == 240
    # a stage whose timeout would fall under MIN_STAGE_S is skipped, saying for whom
    out, raw = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    raw.mkdir()
    py = sys.executable
    stages = [
        gc.Stage("environment", [py, "-c", "print('env')"], 45),
        gc.Stage("learning", [py, "-c", "print('learn')"], 90),
        gc.Stage("gpu_suite", [py, "-c", "print('suite')"], 240),
    ]
    report = {"stages": [], "environment": None}
    gc.run_all(stages, report, out, tmp_path / "site", 30 + 45 + 120 + 10, raw)
    done = {r["name"]: r for r in report["stages"]}
    assert done["environment"]["status"] == "skipped"
    assert done["environment"]["reason"].endswith("kept for learning, gpu_suite")
    assert done["learning"]["status"] == "ok" and done["learning"]["timeout_s"] <= 55
    assert done["gpu_suite"]["status"] == "ok" and done["gpu_suite"]["timeout_s"] >= 120


def test_a_failed_bnb_probe_on_a_cuda_device_switches_the_later_stages_to_bf16():
    gc = _module()
    report = {"environment": {"cuda_available": True}, "stages": []}
    report["stages"].append({"name": "bnb_cuda", "status": "failed", "rc": 1})
    gc.decide_fallback(report)
    assert report["fallback"]["reason"] == "bnb_cuda failed (rc 1)"
    bench = gc.with_fallback(gc.Stage("bench_gpu", ["python", "bench/bench_gpu.py"], 10))
    suite = gc.with_fallback(gc.Stage("gpu_suite", ["python", "-m", "pytest"], 10, {"A": "1"}))
    assert bench.command[-2:] == ["--quantization", "none"]
    assert suite.env == {"A": "1", "IBPO_GPU_QUANTIZATION": "none"}
    # an environment stage that could not say whether CUDA is there does not stop the fallback
    report = {"environment": None, "stages": [{"name": "bnb_cuda", "status": "timeout"}]}
    gc.decide_fallback(report)
    assert report["fallback"]["reason"] == "bnb_cuda timeout (rc None)"
    # a probe that passed, or no CUDA device at all: no fallback
    for env, status in (({"cuda_available": True}, "ok"), ({"cuda_available": False}, "failed")):
        report = {"environment": env, "stages": [{"name": "bnb_cuda", "status": status}]}
        gc.decide_fallback(report)
        assert "fallback" not in report


def test_a_skipped_test_on_a_cuda_device_is_flagged_with_its_numbers():
    gc = _module()
    why = "two identical runs differ on this GPU (max |dLoRA| = 3.1e-05): an exact resume ..."
    tests = {
        "test_checkpoints_and_an_exact_resume": {"outcome": "skipped", "message": why},
        "test_dynamic_sampling": {"outcome": "passed", "message": None},
    }
    report, record = {}, {"status": "ok"}
    gc.flag_skips(report, record, tests, cuda=True)
    assert record["flag"] == "1 test(s) skipped on a CUDA device: not passes"
    assert report["flags"] == [f"gpu_suite skipped test_checkpoints_and_an_exact_resume: {why}"]
    report, record = {}, {"status": "ok"}
    gc.flag_skips(report, record, tests, cuda=False)  # on CPU every gpu test skips: no flag
    assert report == {} and "flag" not in record


def test_run_all_against_a_fake_device_falls_back_and_keeps_two_files(tmp_path):
    """The stages' commands replaced by stand-ins: an environment that reports CUDA, a
    bitsandbytes probe that fails. The bench and the suite then run without 4-bit (their own
    output shows what they were given), and $OUT holds the report and the log only."""
    gc = _module()
    py = sys.executable
    show = (
        "import os, sys; print('ARGS', sys.argv[1:], 'Q', os.environ.get('IBPO_GPU_QUANTIZATION'))"
    )
    env_line = gc.ENV_MARK + json.dumps({"cuda_available": True, "gpu": "fake"})
    stages = [
        gc.Stage("environment", [py, "-c", f"print({env_line!r})"], 30),
        gc.Stage(
            "bnb_cuda", [py, "-c", "raise SystemExit('no kernel image')"], 30, needs_cuda=True
        ),
        gc.Stage("bench_gpu", [py, "-c", show, "--cap-gb", "23.5"], 30, needs_cuda=True),
        gc.Stage("gpu_suite", [py, "-c", show], 30, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}),
    ]
    out, raw = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    raw.mkdir()
    report = {"stages": [], "environment": None}
    rc = gc.run_all(stages, report, out, tmp_path / "site", 600, raw)
    assert rc == 1  # bnb_cuda failed
    done = {r["name"]: r for r in report["stages"]}
    assert report["environment"]["cuda_available"] is True
    assert done["bnb_cuda"]["status"] == "failed" and report["fallback"]["reason"].startswith(
        "bnb_cuda failed"
    )
    assert done["bench_gpu"]["command"][-4:-2] == ["--quantization", "none"]  # then --budget-s
    assert "'--quantization', 'none'" in done["bench_gpu"]["output_tail"]
    assert done["gpu_suite"]["env"]["IBPO_GPU_QUANTIZATION"] == "none"
    assert "Q none" in done["gpu_suite"]["output_tail"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    log = (out / "gpu_check.log").read_text()
    assert all(f"== {s.name}:" in log for s in stages) and "[bnb_cuda] no kernel image" in log


HIDDEN_BNB_RUN = r"""
import json, os, sys
from pathlib import Path
sys.modules["bitsandbytes"] = None  # hidden: `import bitsandbytes` fails, find_spec finds none
os.environ["IBPO_GPU_QUANTIZATION"] = "none"  # what gpu_check sets when bnb_cuda fails
import pytest, torch
torch.set_num_threads(1)
import tests.test_gpu_e2e as e2e
model_dir, tmp = sys.argv[1], Path(sys.argv[2])
mp = pytest.MonkeyPatch()
try:
    entry = e2e.check_wrong_then_right(model_dir, tmp / "train", mp)
finally:
    mp.undo()
mp = pytest.MonkeyPatch()
try:
    evaluated = e2e.check_eval_script(model_dir, tmp / "eval", mp)
finally:
    mp.undo()
bench = e2e.runpy.run_path("bench/bench_gpu.py", run_name="bench_gpu")
summary = bench["main"](["--smoke", "--quantization", "none", "--configs", "recipe"])
print("HIDDEN " + json.dumps({
    "no_4bit": e2e.NO_4BIT, "facts": entry["facts"], "eval": evaluated["loaded"],
    "bench": {k: summary[k] for k in ("status", "rows", "quantization")},
    "bench_phases": list(summary["results"][0]["phases"]),
    "bench_optimizer": summary["results"][0]["phases"]["load"]["optimizer"],
    "bnb_module": repr(sys.modules.get("bitsandbytes")),
}))
"""


def test_the_fallback_runs_with_bitsandbytes_hidden(tiny_model_dir, tmp_path):
    """What gpu_check runs when bitsandbytes' CUDA probe fails, in a process where bitsandbytes
    cannot be imported: the suite's harness (a train() run and the eval script, with
    expectations that follow IBPO_GPU_QUANTIZATION=none) and bench_gpu's recipe row without
    4-bit. Nothing imports bitsandbytes, and every phase still runs."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("IBPO_GPU_REPORT", None)
    proc = subprocess.run(
        [sys.executable, "-c", HIDDEN_BNB_RUN, tiny_model_dir, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("HIDDEN "))[7:])
    assert got["no_4bit"] and got["bnb_module"] == "None"  # still hidden: never imported
    model, opt = got["facts"]["model"], got["facts"]["optimizer"]
    assert model["linear4bit"] == 0 and model["base_dtypes"] == ["torch.bfloat16"]
    assert opt["type"] == "AdamW" and opt["states"] == model["lora_tensors"] > 0
    assert got["eval"]["linear4bit"] == 0 and got["eval"]["lora"]
    assert got["bench"] == {"status": "ok", "rows": {"recipe": "ok"}, "quantization": "none"}
    assert got["bench_phases"] == ["build", "load", "rollout", "repairs", "update",
                                   "evaluation", "update_offload"]  # fmt: skip
    assert got["bench_optimizer"] == "AdamW"


def test_without_bitsandbytes_a_4bit_run_names_the_fix():
    """The other side of the fallback: asking for 4-bit where bitsandbytes cannot be imported
    ends in one message naming both fixes, before any model is built."""
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "import torch\n"
        "from ibpo.config import ConfigError\n"
        "from ibpo.modeling import quantize_nf4\n"
        "try:\n"
        "    quantize_nf4(torch.nn.Linear(4, 4), torch.bfloat16)\n"
        "except ConfigError as e:\n"
        "    print('MESSAGE', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert "MESSAGE model.quantization=nf4 needs bitsandbytes" in proc.stdout, proc.stderr
    assert "model.quantization=none" in proc.stdout


def test_an_environment_probe_that_says_nothing_gates_nothing(tmp_path):
    """The environment stage fails before printing what it found: the CUDA stages still run
    (each finds out for itself) and say why; a bench that exits 0 while its headline row failed
    fails its stage, and the summary line names each row."""
    gc = _module()
    py = sys.executable
    bench_json = json.dumps(
        {
            "headline": "recipe",
            "status": "failed",
            "rows": {"recipe": "failed (OutOfMemoryError during repairs)", "4b:2048": "ok"},
        }
    )
    out, raw = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    raw.mkdir()
    write = f"open({str(raw / 'bench_gpu.json')!r}, 'w').write({bench_json!r})"
    stages = [
        gc.Stage("environment", [py, "-c", "raise SystemExit('driver hung')"], 30),
        gc.Stage("bnb_cuda", [py, "-c", "print('probe ran')"], 30, needs_cuda=True),
        gc.Stage("bench_gpu", [py, "-c", write], 30, needs_cuda=True),
    ]
    report = {"stages": [], "environment": None}
    assert gc.run_all(stages, report, out, tmp_path / "site", 600, raw) == 1
    done = {r["name"]: r for r in report["stages"]}
    assert done["environment"]["status"] == "failed" and report["environment"] is None
    assert done["bnb_cuda"]["status"] == "ok" and "probe ran" in done["bnb_cuda"]["output_tail"]
    assert done["bnb_cuda"]["note"].startswith("the environment stage did not say")
    bench = done["bench_gpu"]
    assert bench["rc"] == 0 and bench["status"] == "failed"
    assert bench["reason"] == "headline row recipe: failed (OutOfMemoryError during repairs)"
    assert gc.summary_line(report["stages"]) == (
        "environment failed, bnb_cuda ok, bench_gpu failed "
        "[recipe failed (OutOfMemoryError during repairs); 4b:2048 ok]"
    )
    # a bench that wrote no rows at all is no pass either
    record = {"status": "ok"}
    gc.judge_bench(record, None)
    assert record["status"] == "failed" and "no results" in record["reason"]


def test_the_environment_probe_reports_before_a_crashing_bitsandbytes(tmp_path):
    """A bitsandbytes that kills the process as it imports (a CUDA library it cannot load): the
    versions and torch's facts are printed before, and the probe says what happened."""
    fake = tmp_path / "site" / "bitsandbytes"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os\nos._exit(139)\n")
    gc = _module()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-c", gc.ENV_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [x.split(" ")[0] for x in lines] == [
        "GPU_CHECK_VERSIONS", "GPU_CHECK_ENV", "GPU_CHECK_ENV_BNB"
    ]  # fmt: skip
    versions = gc.marked_json(proc.stdout, gc.VERSIONS_MARK)
    assert list(versions)[0] == "peft" and versions["torch"] == metadata.version("torch")
    assert gc.marked_json(proc.stdout, gc.ENV_MARK)["torch"] == torch.__version__
    said = gc.marked_json(proc.stdout, gc.ENV_BNB_MARK)["bitsandbytes_imports"]
    assert said == "exit status 139"


def test_versions_that_differ_from_the_device_image_are_named():
    gc = _module()
    found = {"peft": "0.99", "torch": "2.11.0+cu130", "transformers": "5.24.0",
             "accelerate": "1.15.0", "tokenizers": "0.23.2", "huggingface_hub": None}  # fmt: skip
    assert gc.versions_differ(found) == {
        "transformers": {"found": "5.24.0", "expected": "5.17"},
        "huggingface_hub": {"found": None, "expected": "1.33"},
    }


def test_the_bench_halves_the_new_tokens_that_do_not_fit_its_time():
    """Decoding through HF generate (5.5 ms per layer-step measured), the 8B recipe's 1024 new
    tokens do not fit the bench's share at worst: it decodes the longest halving that does; at
    the engine's planned rate they fit."""
    bench = _module()._bench_module()

    import copy

    arch = bench.ARCHS["8b"]
    engine = bench.recipe_config(bench.parse_args([]), "8b")  # the recipe row's config
    eager = copy.deepcopy(engine)
    eager.rollout.decode = "eager"
    assert eager.rollout.max_new_tokens == 1024
    assert bench.fit_new_tokens(arch, eager, 250) in (128, 256, 512)
    assert bench.fit_new_tokens(arch, engine, 250) == 1024
    assert bench.fit_new_tokens(arch, eager, 10) is None
