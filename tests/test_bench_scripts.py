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
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
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
    # the terse template's prompts are shorter than today's
    v = res["variants"]
    assert (
        v["template=terse"]["prefill_tokens_per_seed"]
        < v["default budget=4"]["prefill_tokens_per_seed"]
    )


def test_wilson_interval():
    bench = _script("bench_repairs")
    assert bench.wilson(0, 0) == (0.0, 1.0)
    lo, hi = bench.wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert bench.wilson(0, 20)[0] == 0.0 and 0 < bench.wilson(0, 20)[1] < 0.2
