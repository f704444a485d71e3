"""The benchmark scripts end to end in their smoke modes (tiny Qwen3, one timed step, 4 tokens).

They print figures, they are not timed tests: here only their plumbing and the consistency of what
they report are checked.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    from ibpo.config import load_config

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


def test_bench_demo_smoke(tiny_model_dir, capsys, tmp_path):
    """Two seeds of a tiny `ibpo train`, each in its own process, with the range printed."""
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


@pytest.fixture
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from a second, busy core
    yield
    torch.set_num_threads(threads)


def test_bench_gpu_smoke_measures_the_recipe_phase_by_phase(tmp_path, one_thread):
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
    assert json.loads(out.read_text()) == summary


def test_bench_gpu_keeps_what_it_measured_when_a_phase_fails(tmp_path, one_thread, monkeypatch):
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
    assert list(row["phases"]) == ["build", "load", "rollout", "repairs"]
    assert saved[:4] == [["build"], ["build", "load"], ["build", "load", "rollout"],
                         ["build", "load", "rollout", "repairs"]]  # fmt: skip
    nxt = {"config": "tiny:8", "status": "running", "phases": {}}
    bench.bench_config("tiny:8", args, device, nxt, lambda: None)
    assert nxt["status"] == "ok" and "update" in nxt["phases"]
    assert bench.step.update_policy is failing_once  # the hooks put back what they wrapped


def test_bench_gpu_without_4bit_measures_what_fits(one_thread):
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
    summary = bench.main(["--smoke", "--quantization", "none", "--configs", "tiny:8"])
    r = summary["results"][0]
    assert r["status"] == "ok" and r["phases"]["load"]["optimizer"] == "AdamW"


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


def test_the_learning_run_learns_and_a_frozen_one_is_told_apart(one_thread, capsys):
    """20 steps of the tiny Qwen3 on the share of character tokens: the reward rises by more
    than the margin; with a learning rate of 1e-9 it does not, and the script says so."""
    bench = _script("bench_gpu")
    result = bench.main(["--learn"])
    assert result["learned"] and result["last"] > result["first"] + 0.2, result["rewards"]
    assert len(result["rewards"]) == 20
    with pytest.raises(SystemExit, match="the training reward did not rise"):
        bench.main(["--learn", "--learn-lr", "1e-9"])


def test_bench_gpu_meter_records_the_devices_peak_beside_torchs(monkeypatch):
    """On CUDA a phase records torch's peaks and the device's lowest free memory seen while it
    ran (mem_get_info: what torch's cap does not see), and the planner's figure; torch.cuda is
    stood in for here, with free memory dipping during the phase."""
    import time

    bench = _script("bench_gpu")
    cuda = bench.torch.cuda
    free = iter([20, 12, 9, 15] + [15] * 10_000)  # GiB free, as the poller reads it
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda: None)
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
    assert list(v) == ["today", "reference-first", "unshared"] and res["steps"] == 2
    today, first, unshared = v["today"], v["reference-first"], v["unshared"]
    assert today["repairs"] > 0
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
