"""The benchmark scripts end to end in their smoke modes (tiny Qwen3, one timed step, 4 tokens).

They print figures, they are not timed tests: here only their plumbing and the consistency of what
they report are checked.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a tiny model gains nothing from a second, busy core (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _json_line(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_step_smoke_splits_the_step(tiny_model_dir, capsys):
    import ibpo.step

    bench = _script("bench_step")
    original = ibpo.step.sequence_logprobs
    assert bench.main(["--smoke", "--model", tiny_model_dir]) == 0
    out = capsys.readouterr().out
    for phase in ("generate", "repair", "frozen", "forward", "backward", "optimizer", "**step**"):
        assert f"| {phase}" in out or f"&nbsp;{phase}" in out
    res = _json_line(out)
    m = res["mean"]
    assert res["steps"] == 1 and len(res["per_step"]) == 1 and res["objective"] == "ibpo"
    # the smoke recipe repairs (objective ibpo) and trains: every timed phase ran
    for key in ("generate", "repair", "forward", "backward", "optimizer", "repair_tokens"):
        assert m[key] > 0, key
    assert m["frozen"] < m["forward"]  # no reference / old log-probs in the smoke recipe
    parts = m["forward"] + m["backward"] + m["optimizer"] + m["other"]
    assert parts == pytest.approx(m["update"], rel=1e-6, abs=1e-9)
    phases = m["generate"] + m["repair"] + m["score"] + m["frozen"] + m["update"]
    assert phases == pytest.approx(m["step"], rel=1e-6)
    assert m["step"] <= m["wall"]
    assert 0 < m["completion_tokens"] <= 2 * 2 * 4  # B * G * max_new_tokens
    assert res["tokens_per_second"] == pytest.approx(m["completion_tokens"] / m["step"])
    assert 0.05 < res["peak_memory_gb"] <= res["process_peak_memory_gb"]
    assert ibpo.step.sequence_logprobs is original  # the timing wrappers are gone


def test_bench_step_reports_a_bad_override(tiny_model_dir, capsys):
    bench = _script("bench_step")
    assert bench.main(["--smoke", "--model", tiny_model_dir, "train.no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_bench_step_arguments():
    bench = _script("bench_step")
    parsed = bench.parse(["r.yaml", "a.b=1", "--steps", "4", "c.d=2", "--cpu"])
    assert parsed == ("r.yaml", ["a.b=1", "c.d=2"], 4, 1, True)
    recipe, overrides, *_ = bench.parse(["a.b=1", "--model", "M"])
    assert recipe is None and overrides == ["a.b=1", "model.name=M"]
    with pytest.raises(SystemExit):
        bench.parse(["--smoke"])  # a smoke run needs a small local model


def test_trl_matched_ibpo_settings_are_a_valid_config():
    from ibpo.recipe import load_config

    cmp = _script("bench_vs_trl")
    ns = cmp.parse(["--group-size", "4", "--prompts-per-step", "3", "train.seed=5"])
    cfg = load_config(None, cmp.ibpo_overrides(ns))
    # one generate call and one forward/backward over all B * G sequences, as TRL's step
    assert cfg.rollout.generation_batch_size == 12 and cfg.train.micro_batch_groups == 3
    assert not cfg.train.log_reference_kl and cfg.objective.kl_coef == 0
    assert cfg.train.seed == 5  # trailing overrides reach the ibpo runs, last


def test_bench_vs_trl_worker_failure_is_reported(capsys):
    cmp = _script("bench_vs_trl")  # a real subprocess that fails at once on a bad argument
    with pytest.raises(RuntimeError, match="the ibpo run failed"):
        cmp.launch("ibpo", ["--steps", "0"])
    assert "--steps >= 1" in capsys.readouterr().err


def test_bench_vs_trl_smoke(tiny_model_dir, capsys):
    pytest.importorskip("trl")
    cmp = _script("bench_vs_trl")
    # in-process: the same measurements without two interpreter start-ups (CI time)
    assert cmp.main(["--smoke", "--in-process", "--model", tiny_model_dir]) == 0
    out = capsys.readouterr().out
    assert "| step time s |" in out and "| peak RSS GB, timed steps |" in out
    res = _json_line(out)
    runs = res["runs"]
    assert [r["framework"] for r in runs] == ["trl", "ibpo"]
    for r in runs:
        assert len(r["step_times"]) == 1 and r["step_times"][0] > 0
        assert r["completion_length"] == 4.0  # forced to max_new_tokens on both sides
        assert r["peak_memory_scope"] == "timed steps" and r["peak_memory_gb"] > 0.05
    ratio = res["summary"]["ratio"]["step_times"]
    assert ratio == pytest.approx(runs[1]["step_times"][0] / runs[0]["step_times"][0])


def test_bench_mismatch_smoke(tiny_model_dir, capsys):
    """Each CPU path on the tiny model: honest paths agree to rounding; with the adapter dropped
    the first step still matches (LoRA B = 0 before any update)."""
    bench = _script("bench_mismatch")
    paths = "fp32,nf4 dropped"
    assert bench.main(["--smoke", "--model", tiny_model_dir, "--paths", paths]) == 0
    report = _json_line(capsys.readouterr().out)
    assert set(report["paths"]) == {"fp32", "nf4 dropped"}
    assert report["paths"]["fp32"]["max"]["mismatch_kl"] < 1e-8
    assert report["paths"]["nf4 dropped"]["kl_per_step"][0] < 1e-6
    assert bench.main(["--smoke", "--paths", "bf16"]) == 2


def test_bench_demo_smoke(tiny_model_dir, capsys, tmp_path, monkeypatch):
    """Two seeds of a tiny `ibpo train`, each in its own process, with the range printed."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the runs' processes: one thread, as here
    bench = _script("bench_demo")
    out = tmp_path / "demo"
    assert (
        bench.main(["--smoke", "--model", tiny_model_dir, "--seeds", "0,1", "--out", str(out)]) == 0
    )
    text = capsys.readouterr().out
    report = _json_line(text)
    assert [r["seed"] for r in report["runs"]] == [0, 1]
    assert all(r["n"] == 4 and 0 <= r["after"] <= 1 for r in report["runs"])
    assert "range over 2 seeds" in text
    assert (out / "seed-1" / "run" / "summary.json").is_file()
    for r in report["runs"]:  # the step figures docs/cpu.md quotes
        assert r["step_time"] >= r["time_generate"] > 0 and r["peak_memory_gb"] > 0
        assert r["residual_max"] == 0.0  # ibpo's default: the cancellation-safe objective
    assert "per step, mean:" in text


def test_bench_decode_smoke_times_each_variant(tmp_path):
    """bench_decode on CPU (tiny Qwen3): every variant, HF generate and the engine, measured with
    seconds per decoding step from its two calls, the ratio against the first, the mismatch,
    and the file written."""
    bench = _script("bench_decode")
    out = tmp_path / "decode.json"
    summary = bench.main(["--smoke", "--out", str(out)])
    names = [v["name"] for v in summary["variants"]]
    assert names == [v["name"] for v in bench.variants(16)] and len(names) == 7
    assert {v["decode"] for v in summary["variants"]} == {"eager", "graph"}
    for v in summary["variants"]:
        assert v["status"] == "ok", v["status"]
        assert 0 <= v["mismatch_kl"] < 1e-3  # fp32 on CPU: both paths sample the trainer's policy
        assert v["long_s"] > 0 and v["short_s"] > 0 and v["step_s"] > 0
        assert v["rows"] == v["batch"]
        assert v["tokens_per_s"] == pytest.approx(v["rows"] / v["step_s"], rel=1e-3)
    assert summary["variants"][0]["vs_first"] == 1.0
    assert json.loads(out.read_text()) == summary


def test_bench_gpu_smoke_measures_the_recipe_phase_by_phase(tmp_path):
    """The recipe row on CPU (tiny Qwen3, 8 tokens): every phase with its time, tokens/s and the
    planner's figure, the mismatch, and the file rewritten with each phase."""
    bench = _script("bench_gpu")
    out = tmp_path / "bench.json"
    summary = bench.main(["--smoke", "--configs", "recipe", "--out", str(out)])
    row = summary["results"][0]
    assert row["status"] == "ok" and "error" not in row, row.get("error")
    assert list(row["phases"]) == list(bench.PHASES)
    assert (row["completions"], row["generation_batch_size"], row["lora_r"]) == (32, 32, 32)
    assert row["repair_batch_size"] == 8 and row["quantization"] == "nf4"
    for name in ("rollout", "repairs", "update", "update_offload", "evaluation"):
        phase = row["phases"][name]
        assert phase["tokens"] > 0 and phase["tokens_per_s"] > 0 and phase["seconds"] >= 0, name
        assert phase["plan_gb"] == row["plan_phases_gb"][bench.PLAN_PHASE[name]] > 0, name
    assert row["phases"]["rollout"]["tokens"] == 32 * 8  # forced to full length
    assert row["phases"]["repairs"]["repairs"] > 0
    assert 0 <= row["mismatch"]["mismatch_kl"] < 1e-2 and row["mismatch"]["mismatch_abs_max"] > 0
    # the repair prompts fed are the plan's (one token per character, attempts at full length)
    fed = row["repair_prompts"]
    assert (
        abs(fed["prompt_tokens_max"] - fed["prompt_tokens_planned"])
        <= 0.1 * fed["prompt_tokens_planned"]
    )
    assert fed["prompt_tokens_planned"] == 32 + 2 * 8 + 256  # prompt, attempt, reference, template
    assert all(p["plan_s"] == row["plan_seconds"][k] for k, p in row["phases"].items())
    assert summary["status"] == "ok" and summary["rows"] == {"recipe": "ok"}
    assert summary["summary"] == "bench_gpu ok: recipe ok"
    assert json.loads(out.read_text()) == summary


def test_bench_tokenizer_round_trips_decode_then_encode():
    """1,024 random ids of Qwen3's vocabulary decode to text that encodes back to the same ids
    (repair prompts hold completions at the length they were sampled), whitespace included."""
    import random

    bench = _script("bench_gpu")
    tok = bench.make_tokenizer(151936)
    assert len(tok) == 151936
    rng = random.Random(0)
    ids = [rng.randrange(len(bench.SPECIALS), 151936) for _ in range(1024)]
    text = tok.decode(ids, skip_special_tokens=True)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    # newlines and spaces next to each other stay one token each
    spaces = [len(bench.SPECIALS) + bench.CHARS.index(c) for c in "\n\n . \n"]
    assert tok(tok.decode(spaces), add_special_tokens=False)["input_ids"] == spaces
    fillers = bench.filler_tokens(151936 - len(bench.SPECIALS) - len(bench.CHARS))
    assert all(len(f) == 1 and not f.isspace() and f not in bench.CHARS for f in fillers)
    assert len(set(fillers)) == len(fillers) and tok.padding_side == "left"


def test_bench_refuses_repair_prompts_off_the_plan():
    bench = _script("bench_gpu")
    assert bench.check_repair_prompts([2700, 2816], 2816) == {
        "prompt_tokens_max": 2816,
        "prompt_tokens_planned": 2816,
    }
    bench.check_repair_prompts([2560], 2816)  # 9% short: within
    with pytest.raises(bench.PlanMismatch, match="up to 17600 tokens against the plan's 2816"):
        bench.check_repair_prompts([17600], 2816)


def test_bench_gpu_keeps_what_it_measured_when_a_phase_fails(tmp_path, monkeypatch):
    """An error that is no OOM, in the first configuration's update: the row keeps the phases
    before it, saved after each, names the error and its phase, and the next one still runs."""
    bench = _script("bench_gpu")
    real, calls = bench.step.update_policy, []

    def failing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("no kernel image is available for execution on the device")
        return real(*a, **k)

    monkeypatch.setattr(bench.step, "update_policy", failing_once)
    saved: list[list[str]] = []
    args = bench.parse_args(["--smoke", "--configs", "recipe"])
    args.group_size, args.prompt_chars = 4, 24
    device = bench.torch.device("cpu")
    row = {"config": "recipe", "status": "running", "phases": {}}
    bench.bench_config("recipe", args, device, row, lambda: saved.append(list(row["phases"])))
    assert row["status"] == "failed" and row["error"]["type"] == "ValueError"
    assert row["error"]["phase"] == "update" and "no kernel image" in row["error"]["message"]
    assert bench.row_status(row) == "failed (ValueError during update)"
    assert list(row["phases"]) == ["build", "load", "rollout", "repairs"]
    saved = [s for i, s in enumerate(saved) if i == 0 or s != saved[i - 1]]  # distinct
    assert saved[:4] == [["build"], ["build", "load"], ["build", "load", "rollout"],
                         ["build", "load", "rollout", "repairs"]]  # fmt: skip
    nxt = {"config": "tiny:8", "status": "running", "phases": {}}
    bench.bench_config("tiny:8", args, device, nxt, lambda: None)
    assert nxt["status"] == "ok" and "update" in nxt["phases"]
    assert bench.step.update_policy is failing_once  # the hooks put back what they wrapped
    # the headline (first) row failed: the run failed, whatever the rows after it did
    summary = {"headline": "recipe", "results": [row, nxt]}
    bench.summarise(summary)
    assert summary["status"] == "failed"
    assert summary["rows"] == {"recipe": "failed (ValueError during update)", "tiny:8": "ok"}
    assert summary["summary"] == (
        "bench_gpu failed: recipe failed (ValueError during update); tiny:8 ok"
    )
    summary = {"headline": "tiny:8", "results": [nxt, row]}
    bench.summarise(summary)
    assert summary["status"] == "ok"


def test_bench_starts_no_row_that_does_not_fit_its_budget(tmp_path):
    """The script itself: a headline row whose planned seconds do not fit --budget-s is skipped
    and says why (nothing is built), and the run exits 1 with one line naming it."""
    import subprocess

    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--smoke", "--configs", "tiny:8",
         "--budget-s", "3", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    row = summary["results"][0]
    assert row["status"].startswith("skipped: time: row tiny:8 planned 5 s") and not row["phases"]
    assert "3 s left of --budget-s 3" in row["status"]
    assert summary["status"] == "failed"
    assert proc.stdout.strip().splitlines()[-1] == f"bench_gpu failed: tiny:8 {row['status']}"


def test_a_phase_that_no_longer_fits_stops_its_row_before_it(monkeypatch):
    """The deadline is checked again before each phase with the plan scaled by what the run
    measured: a row whose build ran long stops before its rollout (not cut in the middle), and
    an optional phase that does not fit is left out, saying so."""
    bench = _script("bench_gpu")
    now = [0.0]
    real = bench.build_base

    def slow_build(*a, **k):
        now[0] += 1000.0  # the build "took" 1000 s
        return real(*a, **k)

    monkeypatch.setattr(bench, "build_base", slow_build)
    args = bench.parse_args(["--smoke", "--configs", "tiny:8"])
    args.group_size, args.prompt_chars = 4, 24
    deadline = bench.Deadline(60, clock=lambda: now[0])
    row = {"config": "tiny:8", "status": "running", "phases": {}}
    bench.bench_config("tiny:8", args, bench.torch.device("cpu"), row, lambda: None, deadline)
    assert row["status"].startswith("stopped: time: before rollout planned"), row["status"]
    assert list(row["phases"]) == ["build", "load"] and bench.row_status(row) == row["status"]
    # an optional phase: left out and recorded, the row goes on
    row = {"phases": {}, "plan_seconds": {"evaluation": 30.0}}
    meter = bench.Meter(row, bench.torch.device("cpu"), lambda: None)
    meter.deadline = bench.Deadline(20, clock=lambda: 0.0)
    assert not bench._optional(meter, "evaluation")
    assert meter.row["left_out"]["evaluation"].startswith("evaluation planned 30 s")
    meter.deadline = bench.Deadline(40, clock=lambda: 0.0)
    assert bench._optional(meter, "evaluation")


def test_the_planned_schedule_follows_the_runs_rules():
    """A dry run's schedule: rows in order while their required phases fit, optional phases
    while they still fit; a row the planner could not fit says so."""
    bench = _script("bench_gpu")
    plan = {"build": 30, "load": 10, "rollout": 60, "repairs": 60, "update": 20,
            "evaluation": 60, "update_offload": 25}  # fmt: skip
    rows = [
        {"config": "recipe", "plan_seconds": plan},
        {"config": "skipped", "status": "skipped: the plan does not fit"},
        {"config": "4b:2048", "plan_seconds": {"build": 15, "load": 10, "rollout": 100}},
    ]
    bench.planned_schedule(rows, 210)
    # required 180 s of 210: evaluation's 60 do not fit, update_offload's 25 still do
    assert rows[0]["schedule"] == "runs, without evaluation"
    assert rows[1]["schedule"] == "skipped: the plan does not fit"
    assert rows[2]["schedule"].startswith("skipped: row 4b:2048 planned 125 s")
    bench.planned_schedule(rows, 400)
    assert rows[0]["schedule"] == "runs" and rows[2]["schedule"] == "runs"
    d = bench.Deadline(100, clock=lambda: 0.0)
    d.record(planned=10, measured=30)  # the device is 3x slower than planned
    assert d.scale == 3 and d.check("x", 30) is None and "planned 120 s" in d.check("x", 40)
    d = bench.Deadline(100, clock=lambda: 0.0)
    d.record(planned=10, measured=1)  # much faster: the plan is halved at most
    assert d.scale == 0.5


def test_bench_gpu_without_4bit_measures_what_fits():
    """The fallback: no NF4 layer, torch AdamW; the 8B recipe that does not fit without 4-bit
    is measured on the largest Qwen3 the planner fits (planned only here: nothing is built)."""
    bench = _script("bench_gpu")
    args = bench.parse_args(["--quantization", "none", "--cap-gb", "23.5"])
    row = {"phases": {}}
    cfg, arch, _ = bench._setup("recipe", args, row)
    assert arch == "4b" and "qwen3-8b does not fit" in row["fallback"] and row["plan_fits"]
    assert cfg.model.quantization == "none" and cfg.train.optimizer == "adamw"
    row = {"phases": {}}
    assert bench._setup("8b:1024", args, row)[0] is None and row["status"].startswith("skipped")
    # run without 4-bit (and without bitsandbytes): tests/test_gpu_check.py's hidden-bitsandbytes
    # test runs the recipe row that way


def test_random_weights_quantised_in_memory_match_a_loaded_nf4_base(tiny_model_dir):
    """quantize_nf4 on weights in memory packs them as from_pretrained's NF4 load of the same
    weights does: same packed bytes, same scales, same logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from ibpo.modeling import _quantization_config, disable_cpu_bf16_repack, quantize_nf4

    mine = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    assert quantize_nf4(mine, torch.bfloat16) == 2 * 7
    loaded = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir,
        dtype=torch.bfloat16,
        quantization_config=_quantization_config(torch.bfloat16),
        device_map={"": "cpu"},
    )
    a, b = mine.model.layers[1].mlp.down_proj, loaded.model.layers[1].mlp.down_proj
    assert type(a) is type(b) and a.weight.quant_type == b.weight.quant_type == "nf4"
    # the packed bytes, stored as bf16 (some patterns read as NaN): compared as bytes
    assert torch.equal(a.weight.data.view(torch.uint8), b.weight.data.view(torch.uint8))
    assert torch.equal(a.weight.quant_state.absmax, b.weight.quant_state.absmax)
    assert type(mine.lm_head) is torch.nn.Linear  # lm_head stays 16-bit, as loaded
    for model in (mine, loaded):  # what load_policy does on a CPU (bitsandbytes' repack bug)
        assert disable_cpu_bf16_repack(model) == 2 * 7
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, loaded(ids).logits)


def test_the_learning_run_learns_and_a_frozen_one_is_told_apart(capsys):
    """20 steps of ibpo with repairs on the tiny Qwen3, rewarded for writing mostly character
    tokens: the reward rises by more than the margin; with a learning rate of 1e-9 it does not
    (10 steps), and the script says so."""
    bench = _script("bench_gpu")
    result = bench.main(["--learn"])
    assert result["learned"] and result["last"] > result["first"] + 0.2, result["rewards"]
    assert len(result["rewards"]) == 20
    # the default objective with its repairs, on the 4-bit base
    assert (result["objective"], result["quantization"]) == ("ibpo", "nf4")
    assert result["repaired"] and sum(result["repairs"]) > 0
    assert max(result["repair_success_rate"]) > 0  # repairs that succeeded shaped the rewards
    # the threshold is what about one in seven untrained completions reaches: a low start
    assert 0.2 <= result["threshold"] <= 0.9 and result["rewards"][0] < 0.3
    with pytest.raises(SystemExit, match="the training reward did not rise"):
        bench.main(["--learn", "--learn-lr", "1e-9", "--learn-steps", "10"])


def test_bench_gpu_meter_records_the_devices_peak_beside_torchs(monkeypatch):
    """On CUDA a phase records torch's peaks and the device's lowest free memory seen while it
    ran (mem_get_info: what torch's cap does not see), and the planner's figure; torch.cuda is
    stood in for here, with free memory dipping during the phase."""
    import time

    bench = _script("bench_gpu")
    cuda = bench.torch.cuda
    free = iter([20, 12, 9, 15] + [15] * 10_000)  # GiB free, as the poller reads it
    calls = []
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(cuda, "mem_get_info", lambda: (next(free) * 2**30, 24 * 2**30))
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda: 7 * 2**30)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda: 8 * 2**30)
    saves = []
    row = {"phases": {}, "plan_phases_gb": {"generation": 6.5}}
    meter = bench.Meter(row, bench.torch.device("cuda"), lambda: saves.append(1))
    meter.start("rollout")
    time.sleep(0.2)  # the poller reads a few times
    rec = meter.end(tokens=100)
    assert (rec["alloc_gb"], rec["reserved_gb"], rec["plan_gb"]) == (7.0, 8.0, 6.5)
    assert rec["device_used_gb"] == 24 - 9  # the dip, not the end
    assert rec["tokens"] == 100 and row["phases"]["rollout"] is rec and saves == [1]
    # the previous phase's cached blocks go back before the peaks restart: the phase's own
    assert calls == ["empty_cache", "reset"]


def test_bench_repairs_quick_reports_every_variant(tiny_model_dir, capsys):
    bench = _script("bench_repairs")
    assert bench.main(["--quick", "--model", tiny_model_dir]) == 0
    res = _json_line(capsys.readouterr().out)
    assert list(res["variants"]) == ["default budget=4", "template=terse"]
    for r in res["variants"].values():
        # 2 problems x G = 2: every failed member is repaired once (K = 2), each with 1-4 tokens
        assert 1 <= r["repairs"] <= 4
        assert 0.0 <= r["ci95"][0] <= r["success"] <= r["ci95"][1] <= 1.0
        assert r["repairs"] <= r["decode_tokens_per_seed"] <= 4 * r["repairs"]
        assert r["prefill_tokens_per_seed"] > r["decode_tokens_per_seed"]
        assert r["prefill_tokens_per_seed"] <= r["prompt_tokens_per_seed"]
        n_ok, n_other = r["correct_reference"][0], r["other_reference"][0]
        assert n_ok + n_other == r["repairs"]  # every repair showed one reference or the other
    first = res["variants"]["default budget=4"]
    assert first["better"] == first["worse"] == 0 and first["sign_p"] == 1.0  # itself
    assert first["paired"] == first["repairs"]  # K = 2: one repair per failed completion
    # the terse template's prompts are shorter than today's
    v = res["variants"]
    assert (
        v["template=terse"]["prompt_tokens_per_seed"]
        < v["default budget=4"]["prompt_tokens_per_seed"]
    )
    assert bench.main(["--quick", "--model", tiny_model_dir, "--variants", "template=terse"]) == 0
    assert list(_json_line(capsys.readouterr().out)["variants"]) == ["template=terse"]
    with pytest.raises(SystemExit, match="unknown variants"):
        bench.main(["--quick", "--model", tiny_model_dir, "--variants", "nope"])


def test_paired_comparison_counts_only_the_completions_both_repaired():
    bench = _script("bench_repairs")
    base = {1: True, 2: False, 3: False, 4: True, 5: False}
    other = {1: True, 2: True, 3: True, 4: False, 6: True}  # 6: repaired by one only
    got = bench.paired(base, other)
    assert got == {"paired": 4, "better": 2, "worse": 1, "sign_p": 1.0}
    assert bench.paired({k: False for k in range(8)}, {k: True for k in range(8)})["sign_p"] == (
        pytest.approx(2 / 2**8)
    )


def test_bench_repair_cost_smoke_runs_each_variant_on_the_same_repairs(tiny_model_dir, capsys):
    bench = _script("bench_repair_cost")
    assert bench.main(["--smoke", "--model", tiny_model_dir]) == 0
    res = _json_line(capsys.readouterr().out)
    v = res["variants"]
    assert list(v) == ["correct-first", "correct-only", "reference-first", "unshared"]
    assert res["steps"] == 2
    today, first, unshared = v["correct-first"], v["reference-first"], v["unshared"]
    assert today["repairs"] > 0
    # correct-only runs exactly the planned repairs that show a correct sibling
    only = v["correct-only"]
    assert only["repairs"] == only["repairs_correct_ref"] == today["repairs_correct_ref"]
    assert only["repairs_other_ref"] == 0 and today["repairs_other_ref"] > 0
    # the same repairs (one plan) under each variant; only the prompts' order and sharing differ
    assert today["repairs"] == first["repairs"] == unshared["repairs"]
    assert unshared["prefill"] == unshared["prompt"] == today["prompt"]
    assert today["prefill"] < today["prompt"]
    assert first["prefill"] < today["prefill"]  # reference and instruction shared as well
    for r in v.values():
        assert r["s_generate"] > 0 and r["s_phase"] >= r["s_generate"]


def test_bench_repairs_replays_the_spending_rule_over_recorded_runs(tmp_path, capsys):
    bench = _script("bench_repairs")
    run = tmp_path / "runs" / "on-ibpo-s0" / "train"
    run.mkdir(parents=True)
    # 10 steps of 4 repairs: none succeeds, except all 4 at step 8
    rows = [{"step": t, "repairs": 4.0, "repair_success_rate": float(t == 8)} for t in range(1, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "runs" / "dfpo" / "train").mkdir(parents=True)  # no repairs: left out
    (tmp_path / "runs" / "dfpo" / "train" / "metrics.jsonl").write_text('{"step": 1}\n')
    argv = ["--replay", str(tmp_path / "runs"), "--floors", "0,0.5", "--probes", "3"]
    assert bench.main(argv) == 0
    res = _json_line(capsys.readouterr().out)
    assert res["runs"] == 1
    every, rule = res["rows"]
    assert every["repairs"] == every["successes"] == every["steps"] == 1.0
    # floor 0.5: step 1 measures, skip 2-3, probe 4, skip 5-6, probe 7, skip 8 (the success
    # lost), 9, probe 10
    assert rule["steps"] == 0.4 and rule["repairs"] == 0.4 and rule["successes"] == 0.0
    with pytest.raises(SystemExit, match="no run"):
        bench.main(["--replay", str(tmp_path / "runs" / "dfpo")])


def test_wilson_interval():
    bench = _script("bench_repairs")
    assert bench.wilson(0, 0) == (0.0, 1.0)
    lo, hi = bench.wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert bench.wilson(0, 20)[0] == 0.0 and 0 < bench.wilson(0, 20)[1] < 0.2
