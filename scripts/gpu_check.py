"""The prepared device check: everything this repository can only check on CUDA, in one command,
with one JSON report.

On the device tool (one GPU; Python 3.12, torch, transformers, peft, accelerate and pytest with
its plugins preinstalled; no bitsandbytes, no network), from the repository root, with carry
[".whl"] and timeout_s 600:

    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT

Before anything else it prints the versions it finds (peft first: the image's peft version is
not known in advance), read from package metadata without importing them.

Stages, in order, each recorded as ok / failed / timeout / skipped (with the reason); a stage
that fails does not stop the next. Each runs under its own timeout, capped by what is left of
--budget-s (560 s by default: the device allows 600 s a command) less the guaranteed shares
(MIN_S) of the stages after it, so bench_gpu, the learning run and the suite each keep theirs
even if every earlier stage runs to its timeout:
  1. install      the carried wheels (.whl/*.whl) into a temporary folder with `pip install
                  --no-index --no-deps --target` (nothing is fetched), first on every later
                  stage's PYTHONPATH; wheels of what the image has (pytest, pluggy, ...: IN_IMAGE)
                  are never installed, a carried copy first on the path can break the suite;
  2. environment  versions, then torch and the GPU, then whether bitsandbytes imports (last, in
                  a child process: a crash there cannot take the lines before it along), and
                  which modules the training loop imports are there;
  3. bnb_cuda     bitsandbytes' CUDA kernels: an NF4 round trip and one paged 8-bit AdamW step.
                  If it fails on a device that may have CUDA, the later stages fall back to a
                  bf16 base without 4-bit and torch AdamW (bench_gpu --quantization none at the
                  sizes the planner fits, IBPO_GPU_QUANTIZATION=none for the suite) and the
                  report's "fallback" says why;
  4. bench_gpu    bench/bench_gpu.py under a 23.5 GiB allocator cap: the 8B recipe's own
                  shapes, phase by phase, beside the planner (see its docstring), decoding the
                  longest halving of the recipe's new tokens that fits its --budget-s (any
                  --bench-configs rows after it only if their planned seconds fit). The stage
                  fails when its headline row (the recipe) is not ok; each row's status is in
                  the report and the summary line;
  5. learning     bench_gpu.py --learn: 20 steps of ibpo with its repairs on a tiny Qwen3 whose
                  training reward must rise;
  6. gpu_suite    `pytest -m gpu tests/test_gpu_e2e.py` (and GPU_TESTS' other files) with
                  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1,
                  in what the others left; a test skipped on a CUDA device is flagged in the
                  report's "flags" with its reason (the exact-resume test's carries its numbers).
Stages 3-5 are skipped only when the environment stage says there is no CUDA device; one that
failed before saying gates nothing. Progress is printed as it goes (each child's output, prefixed
with its stage).

Files: the device returns at most 8 files from $OUT (OUT_FILES_MAX). The check writes two there:
<out>/gpu_check.json, the report, rewritten after every stage (a run cut short keeps what it
did), and <out>/gpu_check.log, every stage's whole output. The stages' own files (JUnit XML,
the suite's memory table, bench_gpu's and the learning run's JSON) go to a temporary work folder
and into the report. Exit status: 0 when every stage that ran passed, 1 otherwise.

    python3 scripts/gpu_check.py --dry-run --out /tmp/plan   # any machine: the plan, nothing run

--dry-run prints the versions, the order, the file bound, the budget (each stage's timeout if
every earlier one ran to its own, and the guaranteed shares), what is carried (whether .whl/
holds a bitsandbytes wheel with CUDA libraries), each stage's command, the fallback plan, the
headline rule, and the rows bench_gpu would measure with the planner's figure per phase against
--fake-device, with 4-bit and without, each with its planned seconds and whether it would start
(at worst, and with the bench's whole timeout); it writes the plan as the report and runs
nothing. tests/test_gpu_check.py runs it.

The carried wheels: .whl/ is git-ignored. Fetch them where the package index is reachable, at
the development venv's versions, for the device's Python 3.12 (about 45 MiB; carry allows 64):
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl \\
        bitsandbytes==0.50.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \\
        antlr4-python3-runtime==4.13.2 rapidfuzz==3.14.6
    unzip -l .whl/bitsandbytes-*.whl | grep libbitsandbytes_cuda   # the CUDA libraries
math-verify and rapidfuzz: the math grader and the repairs' token alignment, which the loop
imports. Not pytest: the image has it.

Not here: what the CPU test suite covers, several GPUs, deciding what to fix.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The bench runs before the suite: the 8B recipe's row is what only the device can measure.
# the suite: the end-to-end harness first, then the gpu-marked tests of the CPU suite's files
# (the device side of code the CPU suite checks with host tensors)
GPU_TESTS = (
    "tests/test_gpu_e2e.py",
    "tests/test_shared_prefixes.py",
    "tests/test_sampling_streams.py",
    "tests/test_decode_engine.py",
)
STAGES = ("install", "environment", "bnb_cuda", "bench_gpu", "learning", "gpu_suite")
# Each stage's own timeout (s); the overall --budget-s caps them further. The quick stages are
# quick unless something hangs (a driver, a lock).
TIMEOUTS = {"install": 40, "environment": 45, "bnb_cuda": 40, "bench_gpu": 330, "learning": 90,
            "gpu_suite": 240}  # fmt: skip
# Guaranteed shares: even if every stage before it runs to its timeout, each of these has this
# much, because every stage's timeout is capped by what is left less the shares of the stages
# after it that will run (stage_timeout; parse_args refuses a --budget-s that cannot give them).
MIN_S = {"bench_gpu": 240, "learning": 45, "gpu_suite": 120}
RESERVE_S = 30  # kept back from the budget: ending a stage that timed out (<= 20 s), the report
MIN_STAGE_S = 15  # a stage with less than this left is skipped rather than started and killed
# bench_gpu's own --budget-s is its timeout less this: its imports and CUDA start-up before its
# clock starts, and the last row's save after it
BENCH_STARTUP_S = 30
# The device image's versions (what docs/gpu.md's CPU run against them used); the check prints
# what it finds first, peft's among them, and the report names every difference.
DEVICE_VERSIONS = {"torch": "2.11", "transformers": "5.17", "accelerate": "1.15",
                   "tokenizers": "0.23.2", "huggingface_hub": "1.33", "peft": None}  # fmt: skip
TAIL_CHARS = 4000  # output tail per stage in the report (the whole output is in the log)
# The device returns at most 8 files from $OUT. The check writes two there: the report and one
# combined log (plus, only for the instant of a rewrite, the report's .tmp): raw files (JUnit
# XML, the suite's memory table, bench_gpu's JSON) go to a work folder and into the report.
OUT_FILES_MAX = 8
OUT_FILES = ("gpu_check.json", "gpu_check.log")
# In the device image already (pytest and its plugins among them): a carried copy put first on
# the path can break the suite at start-up, so these wheels are never installed.
IN_IMAGE = ("pytest", "pluggy", "iniconfig", "pygments", "packaging")
ENV_MARK, BNB_MARK = "GPU_CHECK_ENV ", "GPU_CHECK_BNB "
VERSIONS_MARK, ENV_BNB_MARK = "GPU_CHECK_VERSIONS ", "GPU_CHECK_ENV_BNB "

# Versions, the GPU, and the modules the loop, the suite and the graders import (a missing one is
# named, not fatal), in the order least likely to hang or crash first, each printed as one marked
# JSON line as soon as it is known: the versions (importing nothing; peft first), then torch and
# the GPU, then whether bitsandbytes imports, tried last and in a child process of its own, so
# that a crash or hang there cannot take the lines before it along.
ENV_PROBE = r"""
import importlib.metadata as md, importlib.util, json, platform, subprocess, sys
versions = {}
for dist in ("peft", "torch", "transformers", "accelerate", "tokenizers", "huggingface_hub",
             "bitsandbytes"):
    try:
        versions[dist] = md.version(dist)
    except md.PackageNotFoundError:
        versions[dist] = None
print("GPU_CHECK_VERSIONS " + json.dumps(versions), flush=True)
info = {"python": sys.version.split()[0], "platform": platform.platform(), "modules": {}}
# module -> distribution; found without importing (fast), with where it comes from
for mod, dist in (("torch", "torch"), ("transformers", "transformers"), ("peft", "peft"),
                  ("accelerate", "accelerate"), ("bitsandbytes", "bitsandbytes"),
                  ("pytest", "pytest"), ("yaml", "PyYAML"), ("numpy", "numpy"),
                  ("safetensors", "safetensors"), ("tokenizers", "tokenizers"), ("tqdm", "tqdm"),
                  ("huggingface_hub", "huggingface_hub"), ("rapidfuzz", "rapidfuzz"),
                  ("math_verify", "math-verify"),
                  ("latex2sympy2_extended", "latex2sympy2_extended"),
                  ("antlr4", "antlr4-python3-runtime"), ("sympy", "sympy"),
                  ("datasets", "datasets"), ("matplotlib", "matplotlib"),
                  ("flash_attn", "flash-attn")):
    spec = importlib.util.find_spec(mod)
    if spec is None:
        info["modules"][mod] = "missing"
        continue
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        version = "unknown version"
    info["modules"][mod] = f"{version} ({spec.origin})"
try:
    import torch
    info.update(torch=torch.__version__, torch_imports=True, torch_cuda_build=torch.version.cuda,
                cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=round(p.total_memory / 2**30, 2),
                    capability=f"{p.major}.{p.minor}", bf16=torch.cuda.is_bf16_supported())
except Exception as e:
    info["torch_imports"] = f"{type(e).__name__}: {e}"[:300]
try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=10).stdout.strip()
except Exception as e:
    info["nvidia_smi"] = f"not run ({type(e).__name__})"
print("GPU_CHECK_ENV " + json.dumps(info), flush=True)
try:
    r = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True,
                       text=True, timeout=30)
    last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    bnb = True if r.returncode == 0 else last[:300]
except subprocess.TimeoutExpired:
    bnb = "import bitsandbytes did not finish in 30 s"
print("GPU_CHECK_ENV_BNB " + json.dumps({"bitsandbytes_imports": bnb}), flush=True)
"""

# bitsandbytes on the GPU: NF4 quantise/dequantise (its relative mean error was 0.091 with
# bitsandbytes' CPU backend on these random values: the bound is about twice that) and one step
# of the optimizer train.optimizer=auto picks, on a tensor large enough to get 8-bit state
# (>= 4096 elements) in paged memory (>= 1e5 elements, bitsandbytes' thresholds).
BNB_PROBE = r"""
import json, torch, bitsandbytes as bnb, bitsandbytes.functional as F
torch.manual_seed(0)
x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
q, state = F.quantize_4bit(x, quant_type="nf4", compress_statistics=True)
y = F.dequantize_4bit(q, state)
rel = ((y.float() - x.float()).abs().mean() / x.float().abs().mean()).item()
p = torch.nn.Parameter(torch.randn(512, 256, device="cuda"))
opt = bnb.optim.PagedAdamW8bit([p], lr=1e-3)
p.grad = torch.randn_like(p)
before = p.detach().clone()
opt.step()
torch.cuda.synchronize()
s = opt.state[p]
out = {"bitsandbytes": bnb.__version__, "nf4_relative_error": rel,
       "adam_state_dtype": str(s["state1"].dtype),
       "adam_state_paged": bool(getattr(s["state1"], "is_paged", False)),
       "adam_max_change": (p.detach() - before).abs().max().item()}
print("GPU_CHECK_BNB " + json.dumps(out), flush=True)
assert y.dtype == torch.bfloat16 and y.shape == x.shape and rel < 0.2, out
assert out["adam_state_dtype"] == "torch.uint8" and out["adam_state_paged"], out
assert 0 < out["adam_max_change"] < 1e-2, out
print("bitsandbytes CUDA kernels: ok", flush=True)
"""


@dataclass
class Stage:
    name: str
    command: list[str]
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    skip: str | None = None  # why it will not run (None: it runs)
    needs_cuda: bool = False  # decided by the environment stage


# --- what is carried --------------------------------------------------------------------------


def carried(wheels_dir: Path) -> dict:
    """The wheels in `wheels_dir`, and whether one is bitsandbytes with CUDA libraries inside."""
    found = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    wheels = [w for w in found if _dist(w.name) not in IN_IMAGE]
    info = {
        "dir": str(wheels_dir),
        "exists": wheels_dir.is_dir(),
        "wheels": [w.name for w in wheels],
        "not_installed": [w.name for w in found if _dist(w.name) in IN_IMAGE],
        "mib": round(sum(w.stat().st_size for w in wheels) / 2**20, 1),
        "bitsandbytes_wheel": None,
        "cuda_libraries": [],
    }
    for w in wheels:
        if not w.name.lower().startswith("bitsandbytes-"):
            continue
        info["bitsandbytes_wheel"] = w.name
        try:
            names = zipfile.ZipFile(w).namelist()
        except zipfile.BadZipFile:
            info["bitsandbytes_error"] = "not a zip file"
            continue
        libs = [Path(n).name for n in names if Path(n).name.startswith("libbitsandbytes_cuda")]
        info["cuda_libraries"] = sorted(libs)
    return info


def image_versions() -> dict:
    """The installed versions of DEVICE_VERSIONS' distributions (None: missing), read from their
    metadata without importing them; peft first."""
    import importlib.metadata as md

    out = {}
    for dist in ("peft", *(d for d in DEVICE_VERSIONS if d != "peft"), "bitsandbytes"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def _dist(wheel: str) -> str:
    return wheel.split("-")[0].lower().replace("_", "-")


# --- the plan ---------------------------------------------------------------------------------


def build_stages(args, raw: Path, site: Path, carry: dict) -> list[Stage]:
    """The stages in order; `raw`: the work folder for the stages' own files (not $OUT)."""
    py = sys.executable
    suite_env = {
        # the image's plugins stay out of the suite's start-up (tests/conftest.py needs none)
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "IBPO_GPU_REPORT": str(raw / "gpu_e2e_memory.json"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # cuBLAS' documented setting for run-to-run reproducible results (the exact-resume test
        # compares LoRA tensors bit for bit); it must be set before the process first uses cuBLAS
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    bench = [
        py,
        "bench/bench_gpu.py",
        "--cap-gb",
        f"{args.cap_gb:g}",
        "--out",
        str(raw / "bench_gpu.json"),
    ]
    if args.bench_configs:
        bench += ["--configs", args.bench_configs]
    learn = [py, "bench/bench_gpu.py", "--learn", "--out", str(raw / "learning.json")]
    wheels = [str(Path(carry["dir"]) / w) for w in carry["wheels"]]
    install = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
    install += wheels
    # -v: each test's outcome is printed as it ends, so a suite cut short by its timeout (no
    # JUnit file then) still says how far it got
    suite = [
        py,
        "-m",
        "pytest",
        "-m",
        "gpu",
        *GPU_TESTS,
        "-v",
        "-rA",
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(raw / "gpu_suite.xml"),
    ]
    stages = [
        Stage("install", install, TIMEOUTS["install"]),
        Stage("environment", [py, "-c", ENV_PROBE], TIMEOUTS["environment"]),
        Stage("bnb_cuda", [py, "-c", BNB_PROBE], TIMEOUTS["bnb_cuda"], needs_cuda=True),
        Stage("bench_gpu", bench, TIMEOUTS["bench_gpu"], {"HF_HUB_OFFLINE": "1"}, needs_cuda=True),
        Stage("learning", learn, TIMEOUTS["learning"], {"HF_HUB_OFFLINE": "1"}, needs_cuda=True),
        Stage("gpu_suite", suite, TIMEOUTS["gpu_suite"], env=suite_env),
    ]
    if not carry["wheels"]:
        stages[0].skip = (
            f"no wheels in {carry['dir']} (see this script's docstring to fetch "
            "them); later stages use whatever python3 can import"
        )
    for s in stages:
        if s.name in args.skip:
            s.skip = f"--skip {s.name}"
    return stages


def bench_budget(timeout_s: float) -> int:
    """bench_gpu's --budget-s: its timeout less its start-up; it starts no row and no phase whose
    planned seconds do not fit in what is left of that (bench_gpu's Deadline)."""
    return max(int(timeout_s - BENCH_STARTUP_S), 1)


def stage_timeout(own_s: float, left: float, later: list[str]) -> int:
    """A stage's timeout: its own (`own_s`), capped by what is `left` less the guaranteed shares
    (MIN_S) of the stages `later` in the run that will run, so each of those keeps its share."""
    keep = sum(MIN_S.get(n, 0) for n in later)
    return int(max(min(own_s, left - keep), 0))


def worst_case_timeouts(budget_s: float, skip=()) -> dict[str, int]:
    """Each stage's timeout if every stage before it ran to its own: what --budget-s guarantees
    (each stage of MIN_S gets at least its share, see parse_args). Real runs give later stages
    whatever the earlier ones left."""
    names = [n for n in STAGES if n not in skip]
    left, out = budget_s - RESERVE_S, {}
    for i, name in enumerate(names):
        out[name] = stage_timeout(TIMEOUTS[name], left, names[i + 1 :])
        left -= out[name]
    return out


def budget_needed(skip=()) -> int:
    """The least --budget-s that gives every stage of MIN_S its share after the stages before
    them ran to their timeouts (0 when none of them runs)."""
    names = [n for n in STAGES if n not in skip]
    shared = [n for n in names if n in MIN_S]
    if not shared:
        return 0
    before = names[: names.index(shared[0])]
    return RESERVE_S + sum(TIMEOUTS[n] for n in before) + sum(MIN_S[n] for n in shared)


# When bitsandbytes' CUDA kernels fail (or bitsandbytes is not there), the later stages still
# measure: a bf16 base without 4-bit and torch AdamW, at the sizes the planner fits.
FALLBACK_ARGS = {"bench_gpu": ["--quantization", "none"], "learning": ["--quantization", "none"]}
FALLBACK_ENV = {"gpu_suite": {"IBPO_GPU_QUANTIZATION": "none"}}


def with_fallback(stage: Stage) -> Stage:
    return Stage(
        stage.name,
        [*stage.command, *FALLBACK_ARGS.get(stage.name, [])],
        stage.timeout_s,
        {**stage.env, **FALLBACK_ENV.get(stage.name, {})},
        stage.skip,
        stage.needs_cuda,
    )


def bench_plan_rows(args, quantization: str, budgets: dict[str, int]) -> list[dict]:
    """What bench_gpu would measure, per configuration and phase, as the planner sees it under
    the cap, and which rows it would start under each of `budgets` (its --budget-s) if every
    phase took its planned seconds: the rows a dry run shows against the (fake) device."""
    bench = _bench_module()
    configs = args.bench_configs or bench.parse_args([]).configs
    bargs = bench.parse_args(
        ["--configs", configs, "--cap-gb", f"{args.cap_gb:g}", "--quantization", quantization]
    )
    planned = {}
    for when, budget in budgets.items():  # the recipe row's decode length follows the budget
        rows = []
        for item in configs.split(","):
            row = {"config": item, "phases": {}}
            cfg, arch, _ = bench._setup(item, bargs, row, (budget, 1.0))
            row.update(planned=cfg is not None, model=row.get("model", f"qwen3-{arch}"))
            rows.append(row)
        bench.planned_schedule(rows, budget)
        planned[when] = rows
    rows = planned[list(budgets)[-1]]  # the rows as the whole timeout plans them
    for i, row in enumerate(rows):
        row["schedule"] = {when: trial[i]["schedule"] for when, trial in planned.items()}
    return rows


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def print_plan(stages: list[Stage], carry: dict, args, out: Path) -> dict:
    """The plan, printed; returns what the dry run's report adds (timeouts, bench rows)."""
    name, gib = args.fake_device
    print("gpu_check: dry run: nothing is installed or run")
    print(f"fake device: {name}, {gib:g} GiB; torch capped at {args.cap_gb:g} GiB")
    print(
        f"files back in $OUT: {len(OUT_FILES)} ({', '.join(OUT_FILES)}), at most "
        f"{OUT_FILES_MAX} come back"
    )
    print(f"order: {' -> '.join(s.name for s in stages)}")
    worst = worst_case_timeouts(args.budget_s, [s.name for s in stages if s.skip])
    shares = ", ".join(f"{n} {worst[n]} s" for n in STAGES if n in MIN_S and n in worst)
    print(
        f"budget: {args.budget_s:g} s overall, {RESERVE_S} s kept back; a stage's timeout is its "
        "own, capped by what is left less the shares of the stages after it; guaranteed even "
        f"if every earlier stage runs to its timeout: {shares or 'none'} "
        f"(at least {', '.join(f'{k} {v} s' for k, v in MIN_S.items())})"
    )
    _print_carried(carry)
    for i, s in enumerate(stages, 1):
        if s.skip:
            print(f"stage {i} {s.name}: would be skipped: {s.skip}")
            continue
        when = " (unless the environment stage finds no CUDA device)" if s.needs_cuda else ""
        timeout = f"timeout {worst[s.name]:g} s at worst"
        if s.name in MIN_S:  # what the others leave, up to its own timeout
            timeout = (
                f"what is left, up to {s.timeout_s} s ({worst[s.name]:g} s at worst, "
                f"guaranteed {MIN_S[s.name]} s)"
            )
        print(f"stage {i} {s.name}: would run{when}, {timeout}:")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s.env.items())
        command = s.command
        if s.name == "bench_gpu":
            command = [*command, "--budget-s", str(bench_budget(worst[s.name]))]
        shown = [c if len(c) < 200 else "<probe script, see gpu_check.py>" for c in command]
        print(f"    {env + ' ' if env else ''}{shlex.join(shown)}")
        if s.name == "install":
            print("    (if that fails: each wheel on its own; without pip, unzipped)")
    fallback = "; ".join(
        [f"{k} adds {' '.join(v)}" for k, v in FALLBACK_ARGS.items()]
        + [
            f"{k} gets {' '.join(f'{a}={b}' for a, b in v.items())}"
            for k, v in FALLBACK_ENV.items()
        ]
    )
    print(f"fallback if bnb_cuda fails: bf16 base without 4-bit, torch AdamW: {fallback}")
    print(
        "bench_gpu's status is its headline row's (the first of its --configs): the stage fails "
        "when that row fails, is skipped or stops, whatever the other rows did"
    )
    budgets = {
        "at worst": bench_budget(worst.get("bench_gpu", 0)),
        "at its full timeout": bench_budget(TIMEOUTS["bench_gpu"]),
    }
    print(
        "bench time plan (bench_gpu.plan_seconds: the rates an H200 measured; decoding at the "
        "decode engine's planned rate, not yet measured): "
        f"--budget-s {budgets['at worst']} at worst, "
        f"{budgets['at its full timeout']} at its full timeout; a row starts only if its "
        "required phases fit, an optional phase only if it still fits"
    )
    rows = {q: bench_plan_rows(args, q, budgets) for q in ("nf4", "none")}
    for q, label in (("nf4", "bench rows (plan)"), ("none", "fallback bench rows (plan)")):
        for r in rows[q]:
            _print_row(label, r, args.cap_gb)
    return {"timeouts_worst_case": worst, "bench_budget_s": budgets, "bench_plan": rows}


def _print_row(label: str, r: dict, cap_gb: float) -> None:
    if not r["planned"]:
        print(f"{label}: {r['config']}: {r.get('status')}")
        return
    phases = ", ".join(f"{k} {v:.2f}" for k, v in r["plan_phases_gb"].items())
    extra = f" ({r['fallback']})" if r.get("fallback") else ""
    seconds = ", ".join(f"{k} {v:.0f}" for k, v in r["plan_seconds"].items())
    schedule = "; ".join(f"{k}: {v}" for k, v in r["schedule"].items())
    print(
        f"{label}: {r['config']}: {r['model']}{extra}, {r['completions']} completions x "
        f"{r['prompt_tokens']}+{r['new_tokens']} tokens, LoRA r{r['lora_r']}: GiB {phases}; "
        f"peak {r['plan_peak_phase']} {r['plan_peak_gb']:.2f} of {cap_gb:g}: "
        f"{'fits' if r['plan_fits'] else 'does NOT fit'}; seconds {seconds}; {schedule}"
    )


def _print_carried(carry: dict) -> None:
    bnb = carry["bitsandbytes_wheel"]
    print(
        f"carried: {len(carry['wheels'])} wheel(s), {carry['mib']} MiB, in {carry['dir']}"
        + ("" if carry["exists"] else " (the folder does not exist)")
    )
    for w in carry["wheels"]:
        print(f"  {w}")
    for w in carry["not_installed"]:
        print(f"  {w}: not installed (the device image has it; do not carry it)")
    if bnb and carry["cuda_libraries"]:
        libs = ", ".join(
            n.removeprefix("libbitsandbytes_").removesuffix(".so") for n in carry["cuda_libraries"]
        )
        print(f"carried bitsandbytes wheel: yes, {bnb}, CUDA libraries: {libs}")
    elif bnb:
        print(
            f"carried bitsandbytes wheel: yes, {bnb}, but NO libbitsandbytes_cuda*.so inside: "
            "it cannot run on the GPU"
        )
    else:
        print(
            "carried bitsandbytes wheel: NO: model.quantization=nf4 and the paged 8-bit "
            "optimizer need bitsandbytes on the device (the fallback runs without)"
        )


# --- running ----------------------------------------------------------------------------------


def run_stage(stage: Stage, timeout_s: float, env: dict, log: Path) -> dict:
    """Run one stage's command, streaming its output (prefixed) to stdout and, appended, to the
    combined log. The whole output is kept in the result's "_text" (for collect)."""
    header = f"\n== {stage.name}: timeout {timeout_s:.0f} s: {shlex.join(stage.command)[:400]}"
    print(header, flush=True)
    tail: deque[str] = deque(maxlen=400)
    lines: list[str] = []
    start = time.monotonic()
    result = {"status": "failed", "rc": None, "log": str(log)}
    with open(log, "a") as f:
        f.write(header + "\n")
        try:
            # its own session: on timeout the whole process group is ended (a pytest run's
            # children too), and nothing else
            proc = subprocess.Popen(
                stage.command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError as e:
            result.update(status="error", reason=f"could not start: {e}")
            print(f"[{stage.name}] could not start: {e}", flush=True)
            return {**result, "seconds": 0.0, "output_tail": "", "_text": ""}

        def pump():
            for line in proc.stdout:
                f.write(f"[{stage.name}] {line}")
                f.flush()
                tail.append(line)
                lines.append(line)
                print(f"[{stage.name}] {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            result["rc"] = proc.wait(timeout=timeout_s)
            result["status"] = "ok" if result["rc"] == 0 else "failed"
        except subprocess.TimeoutExpired:
            result["status"] = "timeout"
            result["reason"] = f"still running after {timeout_s:.0f} s: ended"
            _end(proc)
            result["rc"] = proc.returncode
        reader.join(timeout=10)
    result["seconds"] = round(time.monotonic() - start, 1)
    result["output_tail"] = "".join(tail)[-TAIL_CHARS:]
    result["_text"] = "".join(lines)
    print(
        f"== {stage.name}: {result['status']} (rc {result['rc']}, {result['seconds']} s)",
        flush=True,
    )
    return result


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL after 10 s if it is still there."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def marked_json(text: str, mark: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith(mark):
            try:
                return json.loads(line[len(mark) :])
            except json.JSONDecodeError:
                return None
    return None


def junit_outcomes(path: Path) -> dict | None:
    """pytest's JUnit XML -> {test: {outcome, seconds, message}}."""
    if not path.is_file():
        return None
    try:
        tree = ET.parse(path)
    except ET.ParseError as e:
        return {"_error": f"unreadable JUnit XML: {e}"}
    tests = {}
    for case in tree.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "")[:2000]
                break
        tests[case.get("name")] = {
            "outcome": outcome,
            "seconds": float(case.get("time", 0)),
            "message": message,
        }
    return tests


def outcomes_from_log(log: str) -> dict:
    """pytest -v's 'file::test OUTCOME' lines (when there is no JUnit file: a suite ended by its
    timeout); a test that started but has no line is the one that was running."""
    tests = {}
    for line in log.splitlines():
        line = line.removeprefix("[gpu_suite] ")
        if "::" not in line:
            continue
        name, _, rest = line.partition("::")[2].partition(" ")
        word = rest.split()[0] if rest.split() else ""
        if word in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS"):
            tests[name] = {"outcome": word.lower(), "seconds": None, "message": None}
        elif not word and name not in tests:  # -v writes the name when a test starts
            tests[name] = {
                "outcome": "running when the suite ended",
                "seconds": None,
                "message": None,
            }
    return tests


def read_json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {"_error": f"unreadable: {e}"}


def write_report(out: Path, report: dict) -> None:
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out / "gpu_check.json")  # a run killed mid-write keeps the previous one


def stage_record(s: Stage, timeout_s: float | None = None) -> dict:
    return {
        "name": s.name,
        "command": s.command,
        "env": s.env,
        "timeout_s": timeout_s if timeout_s is not None else s.timeout_s,
        "status": "skipped" if s.skip else "planned",
        "reason": s.skip,
    }


def retry_install(command: list[str], site: Path, deadline: float, env: dict) -> list[dict]:
    """After a failed install, each wheel on its own: one that does not fit this Python (rapidfuzz
    is fetched for 3.12) must not keep bitsandbytes out. Without pip, wheels are unzipped into
    the folder (what an install with --no-deps amounts to, minus scripts)."""
    wheels = [c for c in command if c.endswith(".whl")]
    pip = command[: command.index("--target") + 2]
    no_pip = (
        subprocess.run(
            [sys.executable, "-c", "import pip"], env=env, capture_output=True
        ).returncode
        != 0
    )
    results = []
    for wheel in wheels:
        item = {"wheel": Path(wheel).name}
        try:
            if no_pip:
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(site)
                item.update(how="unzipped", ok=True)
            else:
                left = max(deadline - time.monotonic(), 1)
                proc = subprocess.run(
                    [*pip, "--upgrade", wheel],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=min(60, left),
                )
                item.update(
                    how="pip", ok=proc.returncode == 0, output=(proc.stdout + proc.stderr)[-1000:]
                )
        except (OSError, zipfile.BadZipFile, subprocess.TimeoutExpired) as e:
            item.update(ok=False, output=f"{type(e).__name__}: {e}"[:1000])
        print(
            f"[install] one by one: {item['wheel']}: {'ok' if item['ok'] else 'failed'}", flush=True
        )
        results.append(item)
    return results


def run_all(
    stages: list[Stage], report: dict, out: Path, site: Path, budget_s: float, raw: Path
) -> int:
    log = out / "gpu_check.log"
    log.write_text("")
    deadline = time.monotonic() + budget_s - RESERVE_S
    python_path = os.pathsep.join(
        p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    base_env = {**os.environ, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1"}
    failed = False
    for i, s in enumerate(stages):
        record = stage_record(s)
        report["stages"].append(record)
        left = deadline - time.monotonic()
        cuda = (report.get("environment") or {}).get("cuda_available")
        # only a probe that says there is no CUDA device skips the CUDA stages: one that failed
        # before saying (cuda None) gates nothing; those stages find out for themselves
        if not s.skip and s.needs_cuda and cuda is False:
            s.skip = f"no CUDA device (environment stage: cuda_available={cuda!r})"
        if not s.skip and s.needs_cuda and cuda is None:
            record["note"] = "the environment stage did not say whether CUDA is there: run anyway"
        later = [t.name for t in stages[i + 1 :] if not t.skip]
        timeout = stage_timeout(s.timeout_s, left, later)
        if not s.skip and left < MIN_STAGE_S:
            s.skip = f"overall budget spent ({max(left, 0):.0f} s left of --budget-s {budget_s:g})"
        elif not s.skip and timeout < MIN_STAGE_S:
            s.skip = (
                f"{max(left, 0):.0f} s left of --budget-s {budget_s:g}, kept for "
                f"{', '.join(n for n in later if n in MIN_S)}"
            )
        if s.skip:
            record.update(status="skipped", reason=s.skip)
            print(f"\n== {s.name}: skipped: {s.skip}", flush=True)
            write_report(out, report)
            continue
        if report.get("fallback"):
            s = with_fallback(s)
        command = s.command
        if s.name == "bench_gpu":
            command = [*command, "--budget-s", str(bench_budget(timeout))]
        s = Stage(s.name, command, s.timeout_s, s.env)
        record.update(command=command, env=s.env, timeout_s=round(timeout))
        record.update(run_stage(s, timeout, {**base_env, **s.env}, log))
        several = sum(c.endswith(".whl") for c in s.command) > 1
        if s.name == "install" and record["status"] == "failed" and several:
            record["retried"] = retry_install(s.command, site, deadline, base_env)
            ok = [r["ok"] for r in record["retried"]]
            if any(ok):  # what did install is used; only a partial install counts as failed
                record["status"] = "ok (one by one)" if all(ok) else "partial"
        collect(s.name, record, report, raw, record.pop("_text", ""))
        failed |= not record["status"].startswith("ok")
        decide_fallback(report)
        write_report(out, report)
    return 1 if failed else 0


def decide_fallback(report: dict) -> None:
    """After bnb_cuda: if it did not pass on a CUDA device, the later stages run without 4-bit
    (and the report says why)."""
    done = {r["name"]: r for r in report["stages"]}
    bnb = done.get("bnb_cuda")
    cuda = (report.get("environment") or {}).get("cuda_available")
    # no fallback where there is surely no CUDA device; where the environment stage could not
    # say, a failed probe still switches the later stages to what runs without bitsandbytes
    if cuda is False or bnb is None or bnb["status"] == "ok" or report.get("fallback"):
        return
    why = bnb.get("reason") or f"bnb_cuda {bnb['status']} (rc {bnb.get('rc')})"
    report["fallback"] = {
        "reason": why,
        "what": "bf16 base without 4-bit and torch AdamW, at the sizes the planner fits",
        "args": FALLBACK_ARGS,
        "env": FALLBACK_ENV,
    }
    print(f"\n== fallback: {why}: later stages run without 4-bit", flush=True)


def collect(name: str, record: dict, report: dict, raw: Path, log: str) -> None:
    """What a stage produced (its output `log`, its files in `raw`), into the report."""
    if name == "environment":
        env = marked_json(log, ENV_MARK)
        if env is not None:
            env.update(marked_json(log, ENV_BNB_MARK) or {"bitsandbytes_imports": "not probed"})
        versions = marked_json(log, VERSIONS_MARK)
        if versions is not None:
            env = {**(env or {}), "versions": versions}
            report["versions_differ"] = versions_differ(versions)
        report["environment"] = env
    elif name == "bnb_cuda":
        report["bnb_cuda"] = marked_json(log, BNB_MARK)
    elif name == "gpu_suite":
        tests = junit_outcomes(raw / "gpu_suite.xml") or outcomes_from_log(log)
        report["gpu_suite"] = {"tests": tests, "memory": read_json(raw / "gpu_e2e_memory.json")}
        cuda = (report.get("environment") or {}).get("cuda_available")
        outcomes = {t.get("outcome") for t in (tests or {}).values() if isinstance(t, dict)}
        if cuda and outcomes == {"skipped"} and record["status"] == "ok":
            record.update(
                status="failed",
                reason="every test skipped, yet the environment stage found a CUDA device",
            )
        flag_skips(report, record, tests or {}, cuda)
    elif name == "bench_gpu":
        report["bench_gpu"] = read_json(raw / "bench_gpu.json")
        judge_bench(record, report["bench_gpu"])
    elif name == "learning":
        report["learning"] = read_json(raw / "learning.json")


def judge_bench(record: dict, bench) -> None:
    """Each row's status into the stage's record; the stage failed when the headline row (the
    8B recipe by default) did, whatever the exit status said, or when there are no rows."""
    if not isinstance(bench, dict) or "rows" not in bench:
        if record["status"] == "ok":
            record.update(status="failed", reason="bench_gpu wrote no results with row status")
        return
    record["rows"] = bench["rows"]
    head = bench.get("headline")
    if bench.get("status") != "ok" and record["status"] == "ok":
        record.update(
            status="failed", reason=f"headline row {head}: {bench['rows'].get(head, 'not run')}"
        )


def versions_differ(found: dict) -> dict:
    """{distribution: {found, expected}} where the image's version is not DEVICE_VERSIONS'."""
    out = {}
    for dist, want in DEVICE_VERSIONS.items():
        have = found.get(dist)
        if want is not None and not (have or "").startswith(want):
            out[dist] = {"found": have, "expected": want}
    return out


def summary_line(stages: list[dict]) -> str:
    """One line: each stage's status, with the bench's rows."""
    parts = []
    for s in stages:
        rows = s.get("rows")
        extra = f" [{'; '.join(f'{k} {v}' for k, v in rows.items())}]" if rows else ""
        parts.append(f"{s['name']} {s['status']}{extra}")
    return ", ".join(parts)


def flag_skips(report: dict, record: dict, tests: dict, cuda) -> None:
    """A skip is not a pass: on a CUDA device every skipped test is flagged, with its reason
    (the exact-resume test's carries the two reference runs' difference)."""
    skipped = {
        k: v.get("message")
        for k, v in tests.items()
        if isinstance(v, dict) and v.get("outcome") == "skipped"
    }
    if not (cuda and skipped):
        return
    record["flag"] = f"{len(skipped)} test(s) skipped on a CUDA device: not passes"
    report.setdefault("flags", []).extend(f"gpu_suite skipped {k}: {m}" for k, m in skipped.items())


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="The device check: install the carried wheels, probe the environment and "
        "bitsandbytes' CUDA kernels, run the GPU suite and bench_gpu, one JSON report.",
        epilog="On the device: PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT "
        "(carry .whl)",
    )
    ap.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for the report (default: $OUT)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=560.0,
        help="overall limit (s), capping every stage's timeout (the device allows 600 s a "
        "command: give its timeout_s 600)",
    )
    ap.add_argument(
        "--cap-gb",
        type=float,
        default=23.5,
        help="bench_gpu's CUDA allocator cap (GiB): a 24 GB card less what torch does not see",
    )
    ap.add_argument(
        "--bench-configs",
        default=None,
        metavar="recipe,SIZE:TOKENS,...",
        help="bench_gpu's --configs (default: its own: recipe)",
    )
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="folder of carried wheels")
    ap.add_argument(
        "--fake-device",
        default="NVIDIA H200:139.8",
        metavar="NAME:GIB",
        help="--dry-run only: the device the plan is shown against",
    )
    ap.add_argument(
        "--skip",
        nargs="+",
        default=[],
        choices=STAGES,
        metavar="STAGE",
        help=f"stages not to run: {', '.join(STAGES)}",
    )
    args = ap.parse_args(argv)
    _check_args(ap, args)
    return args


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each bad value stops the check with a message naming the option (before anything runs)."""
    if not args.out:
        ap.error("--out is required when $OUT is not set (the folder for the report)")
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be > 0 seconds, got {args.budget_s:g}")
    need = budget_needed(args.skip)
    if args.budget_s < need:
        shares = ", ".join(f"{n} {MIN_S[n]} s" for n in STAGES if n in MIN_S and n not in args.skip)
        ap.error(
            f"--budget-s {args.budget_s:g} cannot guarantee {shares} after the stages before "
            f"them: give at least {need} s, or --skip some of them"
        )
    name, _, gib = args.fake_device.rpartition(":")
    try:
        args.fake_device = (name, float(gib))
    except ValueError:
        ap.error(f"--fake-device must look like 'NVIDIA H200:139.8', got {args.fake_device!r}")
    if args.cap_gb <= 0:
        ap.error(f"--cap-gb must be > 0 GiB, got {args.cap_gb:g}")
    if args.bench_configs is not None and not all(
        item == "recipe" or (item.count(":") == 1 and all(item.split(":")))
        for item in args.bench_configs.split(",")
    ):
        ap.error(
            f"--bench-configs must look like 8b:1024,4b:2048 (or recipe,4b:2048), got "
            f"{args.bench_configs!r}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    versions = image_versions()  # first of all: peft's version on the image is not known
    print(
        "versions: " + ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items()), flush=True
    )
    carry = carried(Path(args.wheels).resolve())
    if args.dry_run:
        site = Path(tempfile.gettempdir()) / "gpu-check-site-XXXX"
        raw = Path(tempfile.gettempdir()) / "gpu-check-work-XXXX"
    else:
        site = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
        raw = Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
    stages = build_stages(args, raw, site, carry)
    report = {
        "tool": "scripts/gpu_check.py",
        "dry_run": args.dry_run,
        "argv": sys.argv[1:],
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "budget_s": args.budget_s,
        "carried": carry,
        "image_versions": versions,
        "image_versions_differ": versions_differ(versions),
        "site_packages": str(site),
        "out_files": {"written": list(OUT_FILES), "max": OUT_FILES_MAX},
        "environment": None,
        "stages": [],
    }
    if args.dry_run:
        report.update(print_plan(stages, carry, args, out), fake_device=args.fake_device)
        worst = report["timeouts_worst_case"]
        report["stages"] = [stage_record(s, worst.get(s.name)) for s in stages]
        write_report(out, report)
        return 0
    print(
        f"gpu_check: {len(stages)} stages, budget {args.budget_s:g} s, report "
        f"{out / 'gpu_check.json'}",
        flush=True,
    )
    print(f"carried: {', '.join(carry['wheels']) or 'nothing'}", flush=True)
    start = time.monotonic()
    try:
        rc = run_all(stages, report, out, site, args.budget_s, raw)
    finally:
        shutil.rmtree(site, ignore_errors=True)  # the installed wheels: a temporary folder
        shutil.rmtree(raw, ignore_errors=True)  # its files are in the report
        report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        write_report(out, report)
    line = summary_line(report["stages"])
    print(f"\ngpu_check: {line}; report {out / 'gpu_check.json'}", flush=True)
    for flag in report.get("flags", []):
        print(f"FLAG: {flag}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
