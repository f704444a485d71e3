"""The study script: its statistics against hand-computed values, its report from synthetic
runs, and its smoke mode end to end on the tiny model (json, md, plots; a rerun skips)."""

import importlib.util
import json
import math
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    """bench/study.py, the command line; its modules (bench/study_*.py) import one another from
    bench/, as they do when it runs as a script."""
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("study", ROOT / "bench/study.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["study"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("study", None)
    sys.path.remove(str(ROOT / "bench"))


def _study_module(name: str):
    """A module-scoped fixture giving bench/study_<name>.py (imported once `study` set the path)."""

    @pytest.fixture(scope="module")
    def fixture(study):
        return importlib.import_module(f"study_{name}")

    return fixture


stats, grid, reading, compare, report, workers, archive = map(
    _study_module, ["stats", "grid", "runs", "compare", "report", "workers", "archive"]
)


def test_sign_test_is_exact_and_two_sided(stats):
    assert stats.sign_test([0.1] * 5) == pytest.approx(2 / 32)  # 5 of 5: the floor at 5 seeds
    assert stats.sign_test([-0.1] * 6) == pytest.approx(2 / 64)
    assert stats.sign_test([1] * 8 + [-1] * 2) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert stats.sign_test([1, -1, 0, 0]) == 1.0  # ties are left out; 1 vs 1 caps at 1
    assert stats.sign_test([0, 0]) == 1.0


def test_t_interval_of_a_known_list(stats):
    mean, low, high = stats.mean_ci([1, 2, 3, 4, 5])
    half = 2.7764451 * math.sqrt(2.5) / math.sqrt(5)  # t(0.975, 4) x sd / sqrt(n)
    assert mean == 3 and low == pytest.approx(3 - half) and high == pytest.approx(3 + half)
    # printed tables (4 decimals), where a series expansion of the normal quantile is off by 2e-3
    for df, t in ((11, 2.2010), (12, 2.1788), (13, 2.1604), (30, 2.0423), (100, 1.9840)):
        assert stats.t_critical(df) == pytest.approx(t, abs=1e-4)
    # df = 1: the Cauchy distribution, tan(0.475 pi)
    assert stats.t_critical(1) == pytest.approx(math.tan(0.475 * math.pi))
    assert math.isnan(stats.t_critical(0))
    assert math.isnan(stats.mean_ci([0.5])[1])


def test_bootstrap_is_reproducible_and_bounded(stats):
    diffs = [0.1, -0.05, 0.2, 0.0, 0.15]
    low, high = stats.bootstrap_ci(diffs)
    assert (low, high) == stats.bootstrap_ci(diffs)  # fixed RNG seed
    assert min(diffs) <= low < sum(diffs) / 5 < high <= max(diffs)
    assert stats.bootstrap_ci([0.1] * 5) == pytest.approx((0.1, 0.1))


def _record(arm, regime, seed, after):
    return {
        "arm": arm, "regime": regime, "seed": seed,
        "command": f"python -m ibpo.cli train objective.name={arm} train.seed={seed}",
        "n_eval": 200, "before": 0.4, "after": after, "gain": after - 0.4,
        "curve": [(0, 0.4), (2, after)], "token_curve": [(0, 0.4), (100.0, after)],
        "reward": [0.1, 0.2], "entropy": [1.0, 0.9], "kl": [0.0, 0.01], "residual": [0.0, 0.0],
        "repairs": [2.0, 8.0], "repair_success_rate": [0.5, 0.25], "repair_success": 0.3,
        "repair_tokens": [5.0, 5.0], "loss": [0.1, 0.2],
        "truncated": [0.8, 0.5],
        "generated_tokens": 100.0, "repair_tokens_total": 10.0, "wall": 1.0,
    }  # fmt: skip


def test_repair_success_is_pooled_over_attempts(grid, report, reading):
    # 1 of 2 and 2 of 8: 3 of 10 attempts succeeded, though the per-step rates average 0.375
    assert reading.pooled_repair_success([2.0, 8.0], [0.5, 0.25]) == pytest.approx(0.3)
    assert reading.pooled_repair_success([0.0, 4.0], [0.0, 0.0]) == 0.0
    assert reading.pooled_repair_success([0.0, None], [0.0, None]) is None  # no repairs: no rate
    runs = [_record("on-ibpo", grid.ON, s, 0.6) for s in range(2)]
    runs.append({**_record("on-dfpo", grid.ON, 0, 0.5), "repair_success": None})
    _, md = report.build_report(runs, pending=[])
    table = md.split("## Per arm")[1].split("## Paired")[0]
    cells = {r.split("|")[1].strip(): r.split("|") for r in table.splitlines() if r.startswith("|")}
    assert "repair success" in cells["arm"][8]
    # the mean over seeds and the runs' lowest and highest
    assert cells["on-ibpo"][8].strip() == "0.300 (0.300-0.300)"
    assert cells["on-dfpo"][8].strip() == "n/a"


def test_against_a_folder_without_a_study_is_one_clear_error(study, tmp_path):
    with pytest.raises(SystemExit, match="no study runs there"):
        study.main(["--report-only", "--out", str(tmp_path / "s"), "--against", str(tmp_path)])


def test_the_report_says_how_long_the_runs_took(grid, report):
    runs = [
        {**_record("on-ibpo", grid.ON, s, 0.5), "wall": w} for s, w in enumerate([60, 600, 120])
    ]
    _, md = report.build_report(runs, pending=[])
    assert "Wall time per run: 1.0-10.0 min, median 2.0; 0.2 hours in all." in md


def test_the_f_test_against_closed_forms(stats):
    # F(4, 4): P(F > f) = 1 - I_x(2, 2) = 1 - (3x^2 - 2x^3) with x = f / (1 + f)
    f = 1.5**2
    x = f / (1 + f)
    assert stats.f_test_greater(1.5, 5, 1.0, 5) == pytest.approx(1 - (3 * x**2 - 2 * x**3))
    assert stats.f_test_greater(1.0, 5, 1.0, 5) == pytest.approx(0.5)
    # F(2, 2): P(F > f) = 1 / (1 + f); F(1, 1): 1 - (2 / pi) atan(sqrt(f))
    assert stats.f_test_greater(2.0, 3, 1.0, 3) == pytest.approx(1 / 5)
    assert stats.f_test_greater(3.0, 2, 1.0, 2) == pytest.approx(1 - 2 / math.pi * math.atan(3))


def test_pairs_are_compared_step_by_step_and_against_another_study(compare, grid, report, stats):
    def arm(name, rewards, after):
        return [{**_record(name, grid.ON, s, a), "reward": r} for s, (r, a) in
                enumerate(zip(rewards, after))]  # fmt: skip

    arms = {"a": arm("a", [[0.0, 0.5, 0.25], [0.0, 0.0, 0.0]], [0.6, 0.5]),
            "b": arm("b", [[0.0, 0.25, 0.25], [0.0, 0.5, 0.5]], [0.5, 0.5])}  # fmt: skip
    c = compare.compare(arms, "a", "b")
    # step 1 left out of the gap: seed 0 differs by 0.25 then 0, seed 1 by 0.5 twice
    assert c["reward_gap"] == pytest.approx((0.125 + 0.5) / 2)
    assert c["equal_reward_steps"] == [2, 1]
    here = [{"label": "x", **c}]
    there = [{"label": "x", **c, "diffs": [0.3, -0.1], "mean": 0.1, "reward_gap": 0.4}]
    md = report.against_md(here, there, "old")
    row = [r for r in md.splitlines() if r.startswith("| x |")][0].split("|")
    sd_here, sd_there = stats.sd([0.1, 0.0]), stats.sd([0.3, -0.1])
    assert float(row[6]) == pytest.approx((sd_there / sd_here) ** 2, abs=0.005)
    assert float(row[7]) == pytest.approx(stats.f_test_greater(sd_there, 2, sd_here, 2), abs=0.005)
    assert row[8].strip() == "0.312" and row[9].strip() == "0.400"


def test_report_pairs_seeds_and_says_what_is_significant(compare, grid, report):
    seeds = range(6)
    records = [_record("on-ibpo", grid.ON, s, 0.6) for s in seeds]
    records += [_record("on-dfpo", grid.ON, s, 0.5) for s in seeds]
    records += [_record("on-grpo", grid.ON, s, 0.5 + (0.1 if s % 2 else -0.1)) for s in seeds]
    data, md = report.build_report(records, pending=[])
    comps = {c["label"]: c for c in data["comparisons"]}
    ibpo = comps["on-policy ibpo - dfpo (Part 2: repairs)"]
    assert ibpo["wins"] == 6 and ibpo["sign_p"] == pytest.approx(2 / 64)
    assert ibpo["mean"] == pytest.approx(0.1)
    grpo = comps["on-policy dfpo - grpo (Part 1: the objective)"]
    assert (grpo["wins"], grpo["losses"]) == (3, 3) and grpo["sign_p"] == 1.0
    assert "so it is significant at 0.05" in md and "so it is not significant at 0.05" in md
    assert ibpo["t_ci"] == pytest.approx([0.1, 0.1]) and compare.significant(ibpo)
    assert not compare.significant(grpo)
    # a consistent difference: both intervals exclude 0; a spread one: only the bootstrap does
    close = compare.compare(
        {"a": [_record("a", grid.ON, s, 0.5 + d) for s, d in enumerate([0.04, 0.1, 0.16, 0.08])],
         "b": [_record("b", grid.ON, s, 0.5) for s in range(4)]}, "a", "b")  # fmt: skip
    assert close["bootstrap_ci"][0] > 0 and compare.significant(close)
    wide = compare.compare(
        {"a": [_record("a", grid.ON, s, 0.5 + d) for s, d in enumerate([0.01, 0.3, 0.02, 0.25])],
         "b": [_record("b", grid.ON, s, 0.5) for s in range(4)]}, "a", "b")  # fmt: skip
    assert wide["bootstrap_ci"][0] > 0 and not compare.significant(wide)
    # final accuracy, then the mean curve over the evaluations
    assert "| on-ibpo | on-policy | 6 | 0.600 [0.600, 0.600] | 0.400 -> 0.600 | +0.200" in md
    assert "| 0.0000 | 80.0% -> 50.0% |" in md  # truncation, first step -> last
    # dfpo - grpo differs by +-0.1 per seed: sd 0.110; a +-0.05 t-interval at 21 seeds
    # (2.0860 x 0.1095 / sqrt(21) = 0.0499), not at 20 (2.0930 x 0.1095 / sqrt(20) = 0.0513)
    assert "| on-policy dfpo - grpo (Part 1: the objective) | 0.110 | 21 |" in md
    # the command lines: the shared part once, each arm's own overrides in a table
    assert (
        md.count("python -m ibpo.cli train") == 1 and "| on-grpo | `objective.name=on-grpo` |" in md
    )


def test_the_report_tells_whether_the_edit_mask_acted(compare, grid, report):
    ibpo = [_record("on-ibpo", grid.ON, s, 0.6) for s in range(2)]
    shaping = [_record("ablation-shaping-only", grid.ABLATION, s, 0.6) for s in range(2)]
    shaping[1] = {**shaping[1], "loss": [0.1, 0.25], "after": 0.55}  # parted at step 2
    assert compare.first_difference(ibpo[0], shaping[0]) is None
    assert compare.first_difference(ibpo[1], shaping[1]) == 2
    _, md = report.build_report(ibpo + shaping, pending=[])
    assert "| 0 | 2 of 2 | never: the mask did not act | 0.600 | 0.600 |" in md
    assert "| 1 | 2 of 2 | 2 | 0.600 | 0.550 |" in md


def test_the_report_gives_each_repairing_run_its_success_locality_and_mask_action(grid, report):
    ibpo = _record("on-ibpo", grid.ON, 0, 0.6)
    # step 1: a success that kept 30% of the attempt, the mask lowered 2% of the tokens' blame;
    # step 2: a success that kept 10%, the mask did not act (the repaired member was lifted)
    ibpo.update(edited_token_fraction=[0.7, 0.9], lifted_blame_fraction=[0.02, 0.0])
    # the spending rule skipped 6 planned repairs at step 2; repairs were 40% and 20% of tokens
    ibpo.update(repairs_skipped=[0.0, 6.0], repair_cost_share=[0.4, 0.2])
    # the repair phase took 3 of step 1's 10 seconds and 1 of step 2's 10: 0.20 of the seconds
    ibpo.update(time_repair=[3.0, 1.0], step_time=[10.0, 10.0])
    old = {**_record("on-ibpo", grid.ON, 1, 0.5), "edited_token_fraction": [None, None]}
    dfpo = {**_record("on-dfpo", grid.ON, 0, 0.5), "repairs": [0.0, 0.0], "repair_success": None}
    _, md = report.build_report([ibpo, old, dfpo], pending=[])
    table = md.split("## Repairs per run")[1].split("## Did")[0]
    row = "| on-ibpo | 0 | 10 | 6 | 0.300 | 2 of 2 | 0.200 | 1 of 2 | 0.0100 | 0.30 | 0.20 "
    assert row + "| 0.600 |" in table
    # a run from before these metrics were logged says so instead of inventing them
    old_row = "| on-ibpo | 1 | 10 | n/a | 0.300 | 2 of 2 | - | n/a of 2 | n/a | n/a | n/a | 0.500 |"
    assert old_row in table
    assert "on-dfpo" not in table  # no repairs, no row


def test_smoke_end_to_end_and_resume(grid, study, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["--smoke", "--model", str(tiny_model_dir), "--out", str(out), "--threads", "1"]
    assert study.main(argv) == 0
    data = json.loads((out / "study.json").read_text())
    assert {r["arm"] for r in data["runs"]} == set(grid.SMOKE_ARMS)
    assert len(data["runs"]) == 2 * len(grid.SMOKE_ARMS) and not data["pending"]
    for run in data["runs"]:
        assert [s for s, _ in run["curve"]] == [0, 1, 2]  # start, every step, end
        assert run["n_eval"] == 4 and run["generated_tokens"] > 0 and len(run["kl"]) == 2
        assert run["token_curve"][-1][0] == run["generated_tokens"]
    ibpo = [r for r in data["runs"] if r["arm"] == "on-ibpo"]
    assert all(r["repair_tokens_total"] > 0 for r in ibpo)  # repairs count as generated tokens
    # every run logged its rollouts' prompt tokens and recorded the code it ran
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    for run in data["runs"]:
        assert run["rollout_prompts_recorded"] and run["rollout_prefill_tokens"] > 0
        assert run["code"]["commit"] == head.stdout.strip() and run["code"]["dirty"] in (
            True,
            False,
        )
    # the rollout prompt tokens bench/rollout_prompts.py rebuilds for older runs are the ones a
    # run logs: the same prompts, counted the same way
    spec = importlib.util.spec_from_file_location(
        "rollout_prompts", ROOT / "bench/rollout_prompts.py"
    )
    rebuild = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rebuild)
    from ibpo.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    for run in data["runs"]:
        logged = [json.loads(x) for x in (Path(run["dir"]) / "train/metrics.jsonl").open()]
        logged = {x["step"]: x["rollout_prefill_tokens"] for x in logged if "reward" in x}
        assert rebuild.rebuilt_counts(run["command"], tok) == logged
    axes = {c["axis"] for c in data["equal_compute"] if c["label"] == "mask only - ibpo"}
    assert axes == {"steps", "decode", "tokens", "seconds"}
    md = (out / "study.md").read_text()
    assert f"commit {head.stdout[:12]}" in md.split("## Code")[1]
    assert "| on-ibpo | on-policy | 2 |" in md and "train.updates_per_rollout=2" in md
    assert md.count("python -m ibpo.cli train") == 1  # the shared part; each run's line in json
    assert all("python -m ibpo.cli train" in r["command"] for r in data["runs"])
    assert "| ablation-mask-only | `objective.name=ibpo train.updates_per_rollout=1" in md
    for png in ("accuracy.png", "dynamics.png"):
        assert (out / png).stat().st_size > 10_000
    capsys.readouterr()
    assert study.main(argv) == 0  # every run is found done and skipped
    assert capsys.readouterr().out.count("[skip]") == 6
    (out / "study.md").unlink()
    assert study.main([*argv, "--report-only"]) == 0 and (out / "study.md").read_text() == md


def test_every_planned_run_is_a_valid_config(grid, study, tmp_path):
    from ibpo.recipe import load_config

    runs = grid.plan(study.parse([]), tmp_path)
    assert len(runs) == 13 * 5 and len({r.dir for r in runs}) == len(runs)
    assert [r.seed for r in runs[:13]] == [0] * 13  # seeds are the outer loop
    cfgs = {r.arm.name: load_config(None, r.args) for r in runs if r.seed == 0}
    for name, cfg in cfgs.items():
        assert cfg.train.steps == 20 and cfg.data.eval_size >= 200 and cfg.train.eval_every == 5
        assert cfg.model.quantization == "none" and cfg.train.log_reference_kl
        assert cfg.train.updates_per_rollout == (2 if name.startswith("off-") else 1)
        assert cfg.rollout.dynamic_sampling is (name == "off-dapo")  # DAPO's own default
        assert cfg.repair.enabled is ("ibpo" in name or name.startswith("ablation"))
    assert cfgs["equal-dfpo"].rollout.group_size == 12 and cfgs["on-dfpo"].rollout.group_size == 8
    assert cfgs["ablation-shaping-only"].repair.unchanged_weight == 1
    assert cfgs["ablation-mask-only"].repair.shaping_lambda == 0
    assert cfgs["ablation-k3"].repair.references == 2
    steps = grid.plan(study.parse(["--equal-by", "steps", "objective.kl_coef=0.01"]), tmp_path)
    equal = next(r for r in steps if r.arm.name == "equal-dfpo")
    assert load_config(None, equal.args).train.steps == 30
    assert all(load_config(None, r.args).objective.kl_coef == 0.01 for r in steps[:2])
    sweep = grid.plan(study.parse(["--sweep", "--lrs", "1e-4,1e-3"]), tmp_path)
    lrs = sorted((r.arm.name, load_config(None, r.args).train.learning_rate) for r in sweep)
    assert lrs == [("sweep-dfpo-lr1e-3", 1e-3), ("sweep-dfpo-lr1e-4", 1e-4),
                   ("sweep-grpo-lr1e-3", 1e-3), ("sweep-grpo-lr1e-4", 1e-4)]  # fmt: skip
    assert {r.seed for r in sweep} == {0} and all("sweep" in str(r.dir) for r in sweep)


def test_claims_and_unfinished_runs(reading, workers, tmp_path):
    run = tmp_path / "run"
    assert workers.claim(run) and not workers.claim(run)  # this process holds it
    (run / ".claimed").write_text("999999999")  # a process that is gone: taken over
    assert workers.claim(run) and (run / ".claimed").read_text() == str(__import__("os").getpid())
    (run / "train").mkdir()
    (run / "train/summary.json").write_text(json.dumps({"eval_after": None}))
    assert not reading.is_done(run)  # written before the final evaluation: not done
    (run / "train/summary.json").write_text(json.dumps({"eval_after": {"accuracy": 0.5}}))
    assert reading.is_done(run)


def test_workers_run_each_run_once_in_its_own_process(study, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "study"
    tiny = ["--steps", "1", "--eval-every", "0", "--eval-size", "4", "--group-size", "2"]
    tiny += ["--max-new-tokens", "4", "--dataset", "builtin:arithmetic", "--prompts", "1"]
    argv = ["--model", str(tiny_model_dir), "--out", str(out), "--arms", "on-dfpo,on-grpo"]
    assert study.main([*argv, *tiny, "--seeds", "0", "--workers", "2", "--threads", "1"]) == 0
    assert capsys.readouterr().out.count("[run]") == 2
    data = json.loads((out / "study.json").read_text())
    assert sorted(r["arm"] for r in data["runs"]) == ["on-dfpo", "on-grpo"]
    assert all((Path(r["dir"]) / "train.log").is_file() for r in data["runs"])


def test_a_bad_override_stops_the_study_before_any_run(study, tmp_path):
    with pytest.raises(SystemExit, match="unknown key 'train.kl_coef'"):
        study.main(["--out", str(tmp_path), "train.kl_coef=0.1"])
    assert not list(tmp_path.glob("runs/*"))


def test_smoke_sweep_is_its_own_table(study, tiny_model_dir, tmp_path):
    out = tmp_path / "study"
    argv = ["--smoke", "--sweep", "--lrs", "1e-4,1e-3", "--model", str(tiny_model_dir)]
    assert study.main([*argv, "--out", str(out), "--threads", "1"]) == 0
    data = json.loads((out / "study.json").read_text())
    assert not data["runs"] and len(data["sweep"]) == 4
    md = (out / "study.md").read_text()
    assert "## Learning-rate sweep" in md and "| sweep-grpo-lr1e-3 | 0 |" in md
    assert "## Per arm" not in md and (out / "sweep.png").stat().st_size > 10_000


# --- equal compute ---------------------------------------------------------------------------


def test_interpolation_reads_between_evaluations_and_never_beyond(stats):
    curve = [(0.0, 0.2), (600.0, 0.5), (800.0, 0.7)]
    assert stats.interpolate(curve, 400.0) == pytest.approx(0.2 + 0.3 * 400 / 600)
    assert stats.interpolate(curve, 600.0) == 0.5 and stats.interpolate(curve, 0.0) == 0.2
    assert stats.interpolate(curve, 700.0) == pytest.approx(0.6)
    # no compute between two evaluations: the later (more trained) one
    assert stats.interpolate([(0.0, 0.2), (0.0, 0.3), (10.0, 0.5)], 0.0) == 0.3
    for x in (-1.0, 801.0):
        with pytest.raises(ValueError, match="outside"):
            stats.interpolate(curve, x)
    # the cheaper run at its end, the other between its evaluations; and along the way
    cheap = [(0.0, 0.2), (200.0, 0.4), (400.0, 0.6)]
    assert stats.at_equal_compute(curve, cheap) == pytest.approx((400.0, 0.4, 0.6))
    assert stats.at_equal_compute(curve, cheap, 0.25) == pytest.approx((100.0, 0.25, 0.3))


def test_seed_counts_from_the_t_interval_and_the_t_test_power(stats):
    spread = 0.0906  # the sd of the 11-seed study's paired differences (docs/study.md)
    assert stats.seeds_for_half_width(spread) == 16
    t = {15: 2.1314, 14: 2.1448}  # t(0.975, df), printed tables
    assert t[15] * spread / math.sqrt(16) <= 0.05 < t[14] * spread / math.sqrt(15)
    assert stats.seeds_for_power(spread) == 28
    # power against a simulation of the paired t-test: 40,000 studies of 27 and of 28 seeds
    rng = np.random.default_rng(7)
    for n in (27, 28):
        d = rng.normal(0.05, spread, size=(40_000, n))
        t_stat = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
        found = float((abs(t_stat) > stats.t_critical(n - 1)).mean())
        assert found == pytest.approx(stats.t_power(n, spread, 0.05), abs=0.01)
    assert stats.t_power(28, spread, 0.0) == pytest.approx(0.05)  # the test's size
    assert math.isnan(stats.seeds_for_half_width(float("nan")))
    assert math.isnan(stats.seeds_for_power(0.0))


def _write_run(out, arm, seed, *, evals, final, step_tokens, step_seconds, repair_prompts=0.0,
               rollout_prompts=50.0, steps=4, reward=0.5):  # fmt: skip
    """A finished study run folder: study_run.json, train/summary.json, train/metrics.jsonl
    (per step: decoded tokens, prompt tokens the rollout and the repairs ran, step time;
    held-out evaluations at the steps of `evals`)."""
    run = out / "runs" / f"{arm}-s{seed}"
    (run / "train").mkdir(parents=True)
    meta = {"arm": arm, "regime": "on-policy", "seed": seed, "command": f"python -m ibpo.cli "
            f"train objective.name={arm[3:]} train.seed={seed}"}  # fmt: skip
    (run / "study_run.json").write_text(json.dumps(meta))
    summary = {"steps": steps, "eval_before": {"accuracy": 0.2, "n": 100},
               "eval_after": {"accuracy": final, "n": 100}, "wall_seconds": 10.0}  # fmt: skip
    (run / "train" / "summary.json").write_text(json.dumps(summary))
    lines = []
    for step in range(1, steps + 1):
        row = {"step": step, "reward": reward, "generated_tokens": step_tokens,
               "repairs": 4.0 if arm == "on-ibpo" else 0.0, "step_time": step_seconds}  # fmt: skip
        if repair_prompts is not None:  # None: a run from before the step logged them
            row["repair_prefill_tokens"] = repair_prompts
        if rollout_prompts is not None:
            row["rollout_prefill_tokens"] = rollout_prompts
        lines.append(row)
        if step in evals:
            lines.append({"step": step, "eval_accuracy": evals[step], "eval_n": 100})
    text = "".join(json.dumps(x) + "\n" for x in lines)
    (run / "train" / "metrics.jsonl").write_text(text)


def _study_where_verdicts_differ(out, seeds=4, rollout_prompts=50.0, repair_prompts=300.0):
    """ibpo ahead at equal steps (+0.05 +- 0.01 each seed) and behind at equal decoded tokens:
    it decodes 200 tokens a step to dfpo's 100, and at dfpo's whole budget (400) it has only
    reached two thirds of the way from its start (0.2) to its step-3 evaluation (0.5 + e)."""
    for s in range(seeds):
        e, d = 0.02 * s, (0.0, 0.01, -0.01, 0.02)[s]
        _write_run(out, "on-dfpo", s, evals={2: 0.4 + e}, final=0.6 + e, step_tokens=100.0,
                   step_seconds=1.0, rollout_prompts=rollout_prompts)  # fmt: skip
        _write_run(out, "on-ibpo", s, evals={3: 0.5 + e}, final=0.65 + e + d, step_tokens=200.0,
                   step_seconds=3.0, repair_prompts=repair_prompts,
                   rollout_prompts=rollout_prompts)  # fmt: skip
    return [0.05 + (0.0, 0.01, -0.01, 0.02)[s] for s in range(seeds)]


def test_equal_steps_and_equal_tokens_can_disagree(compare, report, reading, tmp_path):
    at_steps = _study_where_verdicts_differ(tmp_path)
    data, md = report.build_report(*reading.collect(tmp_path))
    found = {c["axis"]: c for c in data["equal_compute"] if c["a"] == "on-ibpo"}
    assert set(found) == {"steps", "decode", "tokens", "seconds"}
    steps, decode = found["steps"], found["decode"]
    assert steps["diffs"] == pytest.approx(at_steps) and compare.verdict(steps) == "higher"
    assert steps["diffs"] == pytest.approx(data["comparisons"][0]["diffs"])  # = final accuracy
    # at 400 decoded tokens: ibpo 0.2 + (0.3 + e) x 400 / 600, dfpo its final 0.6 + e
    e = [0.02 * s for s in range(4)]
    want = [0.2 + (0.3 + x) * 2 / 3 - (0.6 + x) for x in e]
    assert decode["diffs"] == pytest.approx(want) and compare.verdict(decode) == "lower"
    assert decode["budgets"] == [400.0] * 4 and decode["ratios"] == [2.0] * 4
    assert (decode["wins"], decode["losses"]) == (0, 4)
    # prompt + decode: ibpo 550 a step (200 + 50 + 300), dfpo 150; compared at dfpo's 600
    tokens = found["tokens"]
    assert tokens["budgets"] == [600.0] * 4 and tokens["ratios"] == pytest.approx([550 / 150] * 4)
    # 600 of ibpo's 1,650 by step 3: on its line from (0, 0.2) to (1,650, 0.5 + e)
    assert tokens["diffs"] == pytest.approx([0.2 + (0.3 + x) * 600 / 1650 - (0.6 + x) for x in e])
    assert found["seconds"]["budgets"] == [4.0] * 4  # dfpo's 4 s; ibpo spends 3 s a step
    # along the way: at half of the common decode budget (200): ibpo 0.2 + (0.3 + e) / 3, dfpo
    # its step-2 evaluation
    half = decode["along"]["0.5"]["diffs"]
    assert half == pytest.approx([0.2 + (0.3 + x) / 3 - (0.4 + x) for x in e])
    section = md.split("## At equal compute")[1].split("## Compute per run")[0]
    row = next(r for r in section.splitlines() if "| decode tokens | 4 |" in r)
    assert "| 2.00x (2.00-2.00) | 400 tokens |" in row and row.endswith("| lower |")
    assert "Verdicts that depend on what is held equal" in section
    assert "higher at equal steps; lower at equal decode tokens" in section
    per_run = md.split("## Compute per run")[1].split("##")[0]
    assert (
        "| on-ibpo | 4 | 4 (4-4) | 800 (800-800) | 200 (200-200) | 1,200 (1,200-1,200) " in per_run
    )


@pytest.mark.parametrize("unlogged", ["rollout_prompts", "repair_prompts"])
def test_prompt_tokens_are_left_out_where_runs_did_not_log_them(
    report, reading, study, tmp_path, unlogged
):
    _study_where_verdicts_differ(tmp_path, **{unlogged: None})
    data, md = report.build_report(*reading.collect(tmp_path))
    assert {c["axis"] for c in data["equal_compute"]} == {"steps", "decode", "seconds"}
    (why,) = [line for line in md.splitlines() if ", not at equal " in line]
    assert why.startswith("on-policy ibpo - dfpo (Part 2: repairs), not at equal prompt + decode")
    assert "did not log the prompt tokens" in why
    per_run = md.split("## Compute per run")[1].split("##")[0]
    ibpo = next(r for r in per_run.splitlines() if r.startswith("| on-ibpo |")).split(" | ")
    assert ibpo[4 if unlogged == "rollout_prompts" else 5] == "not logged"
    assert ibpo[7] == "n/a"  # no prompt + decode total
    # and the command line still rebuilds the report from the folders
    assert study.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "## At equal compute" in (tmp_path / "study.md").read_text()


def test_the_headline_pair_at_sixteen_seeds_is_one_command(grid, study, tmp_path):
    assert grid.seed_list("0-4,9,3") == [0, 1, 2, 3, 4, 9]
    ns = study.parse(["--seeds", "0-15", "--arms", "on-ibpo,on-dfpo"])
    runs = grid.plan(ns, tmp_path)
    assert sorted({r.seed for r in runs}) == list(range(16)) and len(runs) == 32
    assert {r.arm.name for r in runs} == {"on-ibpo", "on-dfpo"}
    with pytest.raises(SystemExit, match="numbers or ranges"):
        grid.seed_list("0-x")


def test_the_command_lines_name_every_override_an_arm_ran_with(grid, report):
    """An override some of an arm's runs had (the thread count of runs started by another
    invocation) is listed with its seeds, never hidden behind the first run's."""
    runs = []
    for seed in range(5):
        r = _record("on-ibpo", grid.ON, seed, 0.5)
        threads = 2 if seed in (2, 3) else 1
        runs.append({**r, "command": f"OMP_NUM_THREADS={threads} {r['command']}"})
    runs.append(_record("on-dfpo", grid.ON, 0, 0.5))
    md = report.commands_md(runs)
    assert (
        "| on-ibpo | `objective.name=on-ibpo`; by seed: `OMP_NUM_THREADS=1` (seeds 0-1, 4), "
        "`OMP_NUM_THREADS=2` (seeds 2-3) |" in md
    )
    assert "| on-dfpo | `objective.name=on-dfpo` |" in md
    assert report.seed_ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"


def test_a_study_whose_runs_had_different_thread_counts_says_so_at_the_top(grid, report):
    """A run's summation order follows its threads: arms (or seeds) at different counts compute
    different things, and the report says which runs had which before any figure."""
    runs = []
    for arm in ("on-ibpo", "on-dfpo"):
        for seed in range(4):
            r = _record(arm, grid.ON, seed, 0.5)
            threads = 2 if (arm, seed) in (("on-ibpo", 3), ("on-dfpo", 1)) else 1
            runs.append({**r, "command": f"HF_HUB_OFFLINE=1 OMP_NUM_THREADS={threads} ibpo train"})
    warning = report.mixed_threads(runs)
    assert warning.startswith("**Warning: these runs computed at different thread counts**")
    assert "1 thread: on-ibpo seeds 0-2; on-dfpo seeds 0, 2-3" in warning
    assert "2 threads: on-ibpo seeds 3; on-dfpo seeds 1" in warning
    md = report.build_report(runs, [])[1]
    assert warning in md.split("## ", 1)[0]  # above every section
    same = [{**r, "command": "OMP_NUM_THREADS=1 ibpo train"} for r in runs]
    assert report.mixed_threads(same) == ""
    assert "different thread counts" not in report.build_report(same, [])[1]


def test_step_seconds_from_reruns_that_reproduced_the_runs(report, reading, study, tmp_path):
    """--seconds-from: a run takes its rerun's step seconds when the rerun took the same steps
    (the same loss and reward at each); a run whose rerun differs, or that has none, is left out
    of the comparison at equal step seconds, and the report says how many were taken."""
    out, rerun = tmp_path / "study", tmp_path / "rerun"
    _study_where_verdicts_differ(out)  # ibpo 3 s a step, dfpo 1 s, as measured on a busy machine
    for s in range(4):  # the reruns: ibpo 1.5 s a step; seed 3's ibpo rerun drew other rewards
        _write_run(rerun, "on-dfpo", s, evals={}, final=0.0, step_tokens=0.0, step_seconds=1.0)
        _write_run(rerun, "on-ibpo", s, evals={}, final=0.0, step_tokens=0.0, step_seconds=1.5,
                   reward=0.25 if s == 3 else 0.5)  # fmt: skip
    data, md = report.build_report(*reading.collect(out, [rerun]))
    found = {c["axis"]: c for c in data["equal_compute"] if c["a"] == "on-ibpo"}
    seconds = found["seconds"]
    assert seconds["seeds"] == [0, 1, 2] and seconds["ratios"] == [1.5] * 3
    # at dfpo's 4 s: ibpo on its line from (0 s, 0.2) to (4.5 s at step 3, 0.5 + e); dfpo 0.6 + e
    e = [0.02 * s for s in range(3)]
    assert seconds["budgets"] == [4.0] * 3
    assert seconds["diffs"] == pytest.approx([0.2 + (0.3 + x) * 4 / 4.5 - (0.6 + x) for x in e])
    assert found["decode"]["seeds"] == [0, 1, 2, 3]  # the other axes keep every seed
    assert f"(7 from {rerun}): 7 of 8 runs have a timed run that took the same steps" in md
    per_run = md.split("## Compute per run")[1].split("##")[0]
    ibpo = next(r for r in per_run.splitlines() if r.startswith("| on-ibpo |"))
    assert ibpo.endswith("| 6.0 (6.0-6.0), 3 runs |")
    # without --seconds-from the runs' own seconds stand; a folder without runs is one error
    plain = {c["axis"]: c for c in report.build_report(*reading.collect(out))[0]["equal_compute"]}
    assert plain["seconds"]["ratios"] == [3.0] * 4
    assert "timed run" not in report.build_report(*reading.collect(out))[1]
    with pytest.raises(SystemExit, match="--seconds-from .*no study runs there"):
        study.main(["--report-only", "--out", str(out), "--seconds-from", str(tmp_path / "x")])
    # several folders: the first timed run that reproduced a run gives its seconds. A second
    # folder times ibpo seed 3 (2 s a step) and dfpo seed 0 again (9 s, not taken: the first
    # folder's reproduced it)
    more = tmp_path / "more"
    _write_run(more, "on-ibpo", 3, evals={}, final=0.0, step_tokens=0.0, step_seconds=2.0)
    _write_run(more, "on-dfpo", 0, evals={}, final=0.0, step_tokens=0.0, step_seconds=9.0)
    # a timed run with the same loss and reward but other repairs (all failed, so nothing
    # else showed it) is not the run: its seconds are not taken
    fewer = tmp_path / "fewer"
    _write_run(fewer, "on-ibpo", 3, evals={}, final=0.0, step_tokens=0.0, step_seconds=0.5)
    metrics = fewer / "runs" / "on-ibpo-s3" / "train" / "metrics.jsonl"
    rows = [{**json.loads(x), "repairs": 1.0} for x in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in rows))
    argv = ["--report-only", "--out", str(out), "--seconds-from", str(rerun), str(fewer), str(more)]
    assert study.main(argv) == 0
    md = (out / "study.md").read_text()
    assert f"(1 from {more}, 7 from {rerun}): 8 of 8 runs" in md
    seconds = {c["axis"]: c for c in json.loads((out / "study.json").read_text())["equal_compute"]}
    assert seconds["seconds"]["seeds"] == [0, 1, 2, 3]
    assert seconds["seconds"]["ratios"] == [1.5, 1.5, 1.5, 2.0]


def test_runs_with_only_a_final_evaluation_are_compared_where_their_curves_reach(
    report, reading, tmp_path
):
    """Runs without the evaluation before training and without periodic ones (a timing rerun)
    have one point on each curve: the report compares them at equal steps, reads nothing it
    would have to extrapolate, and does not fail."""
    for s in range(3):
        for arm, tokens in (("on-dfpo", 100.0), ("on-ibpo", 200.0)):
            _write_run(tmp_path, arm, s, evals={}, final=0.5 + 0.01 * s * (arm == "on-ibpo"),
                       step_tokens=tokens, step_seconds=1.0)  # fmt: skip
            summary = tmp_path / "runs" / f"{arm}-s{s}" / "train" / "summary.json"
            data = json.loads(summary.read_text())
            summary.write_text(json.dumps({**data, "eval_before": None}))
    data, md = report.build_report(*reading.collect(tmp_path))
    found = {c["axis"]: c for c in data["equal_compute"]}
    assert set(found) == {"steps", "seconds"}  # the token axes end at different budgets
    assert found["steps"]["diffs"] == pytest.approx([0.0, 0.01, 0.02])
    assert list(found["steps"]["along"]) == ["1.0"]
    assert "| steps | n/a | n/a | n/a | +0.010 [" in md
    # each missing axis says why: the curves' one point each, not prompts that went unlogged
    why = [line for line in md.splitlines() if ", not at equal " in line]
    assert [w.split(", not at equal ")[1].split(":")[0] for w in why] == [
        "decode tokens",
        "prompt + decode tokens",
    ]
    assert all("do not both reach the budget they share" in w for w in why)


def test_the_spending_rule_is_summed_per_arm_from_the_runs_logs(report, reading, tmp_path):
    """The rule's figures in the report (repairs run and skipped, successes, repairing steps and
    probes, steps under the floor) are counted from each run's metrics and its saved floor."""
    for s in range(2):
        for arm in ("on-dfpo", "on-ibpo"):
            _write_run(tmp_path, arm, s, evals={}, final=0.5, step_tokens=100.0, step_seconds=1.0)
            train = tmp_path / "runs" / f"{arm}-s{s}" / "train"
            (train / "config.yaml").write_text("repair:\n  min_success: 0.1\n  probe_every: 2\n")
            if arm == "on-dfpo":
                continue
            rows = [json.loads(x) for x in (train / "metrics.jsonl").read_text().splitlines()]
            # step 1 spends (4 repairs, 1 succeeds: r = 0.25), step 2 spends (4, none: 0.125
            # for seed 0; seed 1 falls to 0.05, under the floor), then skip, probe
            running = ((0.25, 0.125, 0.125, 0.1), (0.25, 0.05, 0.05, 0.04))[s]
            plan = [(4, 0, 0.25, 0), (4, 0, 0.0, 0), (0, 4, 0.0, 0), (2, 2, 0.0, 1)]
            for row, (ran, skipped, rate, probe), r in zip(rows, plan, running):
                row.update(repairs=float(ran), repairs_skipped=float(skipped),
                           repair_success_rate=rate, repair_probe=float(probe),
                           repair_running_success=r)  # fmt: skip
            (train / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    records, pending = reading.collect(tmp_path)
    assert {r["min_success"] for r in records} == {0.1}
    md = report.build_report(records, pending)[1]
    (line,) = [x for x in md.splitlines() if x.startswith("* on-")]  # dfpo planned no repairs
    assert line == (
        "* on-ibpo, 2 runs, 8 steps (floor 0.1): 20 repairs ran and 12 were skipped (38% of "
        "those planned); 2 of the 20 succeeded (10%). Repairs ran at 6 steps, 2 of them probes; "
        "the running success rate was under the floor after 3 of the 8 steps."
    )
    # runs with no floor (repair.min_success=0): only the budget skipped, so no probes and no
    # steps under a floor are counted
    for s in range(2):
        config = tmp_path / "runs" / f"on-ibpo-s{s}" / "train" / "config.yaml"
        config.write_text("repair:\n  min_success: 0\n")
    md = report.build_report(*reading.collect(tmp_path))[1]
    (line,) = [x for x in md.splitlines() if x.startswith("* on-")]
    assert line.startswith("* on-ibpo, 2 runs, 8 steps (floor 0.0): 20 repairs ran and 12 were")
    assert line.endswith("Repairs ran at 6 steps; with no floor, only the budget skipped repairs.")
    (tmp_path / "runs" / "on-ibpo-s0" / "train" / "config.yaml").write_text(
        "repair:\n  min_success: 0.1\n"
    )
    md = report.build_report(*reading.collect(tmp_path))[1]
    (line,) = [x for x in md.splitlines() if x.startswith("* on-")]
    assert "(floor 0.0, 0.1)" in line and line.endswith(
        "probes and steps under it are not counted."
    )
    # runs of versions without the rule (nothing logged as skipped): the rule is not summed
    for s in range(2):
        metrics = tmp_path / "runs" / f"on-ibpo-s{s}" / "train" / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        rows = [{k: v for k, v in r.items() if k != "repairs_skipped"} for r in rows]
        metrics.write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert "spending rule" not in report.build_report(*reading.collect(tmp_path))[1]


def test_against_another_study_pairs_the_seeds_of_a_changed_arm(report, tmp_path):
    """A study that reruns arm a with a change and keeps arm b's very runs: the report's
    against-section gives arm a here minus arm a there, seed by seed, and says b's runs are
    the same; where b's runs differ it says so."""
    there, here = tmp_path / "there", tmp_path / "here"
    _study_where_verdicts_differ(there)
    _study_where_verdicts_differ(here)
    change = (0.02, 0.03, 0.01, 0.04)
    for s, up in enumerate(change):
        summary = here / "runs" / f"on-ibpo-s{s}" / "train" / "summary.json"
        data = json.loads(summary.read_text())
        data["eval_after"]["accuracy"] += up
        summary.write_text(json.dumps(data))
    md = report.report(here, against=there)
    (row,) = [r for r in md.splitlines() if r.startswith("| on-policy ibpo - dfpo")][-1:]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1:3] == ["4", "yes"]
    assert float(cells[3]) == pytest.approx(statistics.fmean(change), abs=5e-4)
    assert cells[5] == "4 / 0 / 0" and cells[7] == "yes"
    # arm b changed too: the rows say its runs are not the same
    summary = here / "runs" / "on-dfpo-s0" / "train" / "summary.json"
    data = json.loads(summary.read_text())
    data["eval_after"]["accuracy"] += 0.1
    summary.write_text(json.dumps(data))
    md = report.report(here, against=there)
    row = [r for r in md.splitlines() if r.startswith("| on-policy ibpo - dfpo")][-1]
    assert row.split("|")[3].strip() == "no"


def test_a_packed_study_reads_as_its_folders_did_and_packs_to_the_same_bytes(
    study, archive, grid, reading, report, tmp_path
):
    out, packed = tmp_path / "work" / "mine", tmp_path / "studies"
    _study_where_verdicts_differ(out)
    (out / "runs" / "on-ibpo-s0" / "train" / "checkpoints").mkdir()  # never packed
    (out / "runs" / "on-ibpo-s0" / "train" / "checkpoints" / "state.pt").write_bytes(b"x" * 64)
    on_disk = report.report_text(out)
    path, folders, total = archive.pack(out, packed)
    assert path == packed / "mine.tar.xz" and len(folders) == total == 8
    first = path.read_bytes()
    assert archive.pack(out, packed)[0].read_bytes() == first  # packed again: the same bytes
    with tarfile.open(path, "r:xz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.mode) for m in members} == {(0, 0, 0, "", 0o644)}
    assert not any("checkpoints" in m.name for m in members)
    assert all(m.name.startswith(f"{out.as_posix()}/runs/") for m in members)
    shutil.rmtree(out / "runs")
    assert reading.collect(out)[0] == []  # without the archive: nothing
    assert report.report_text(out, packed=packed) == on_disk  # run paths, figures, text
    copy = tmp_path / "copy"  # what bench/rollout_prompts.py rebuilds counts in
    reading.copy_runs(out, copy, packed)
    assert report.report_text(copy)[0]["comparisons"] == on_disk[0]["comparisons"]
    # a run added on disk joins the packed ones; the same folder again replaces its packed run
    _write_run(out, "on-grpo", 0, evals={}, final=0.5, step_tokens=100.0, step_seconds=1.0)
    assert len(reading.collect(out, packed=packed)[0]) == 9
    assert archive.pack(out, packed)[1:] == ([out / "runs" / "on-grpo-s0"], 9)
    # the command line reads the archive too, and its runner skips what is packed and done
    shutil.rmtree(out / "runs")
    argv = ["--out", str(out), "--packed", str(packed), "--arms", "on-ibpo,on-grpo"]
    runs = grid.plan(study.parse([*argv, "--seeds", "0-4"]), out)
    left = {(r.arm.name, r.seed) for r in study.not_packed(runs, out, packed)}
    assert left == {("on-ibpo", 4), ("on-grpo", 1), ("on-grpo", 2), ("on-grpo", 3), ("on-grpo", 4)}
    assert study.main([*argv, "--report-only"]) == 0
    assert (out / "study.md").read_text().count("| on-ibpo | on-policy | 4 |") == 1


def test_packing_never_overwrites_another_folders_study(archive, tmp_path):
    packed = tmp_path / "studies"
    _study_where_verdicts_differ(tmp_path / "a" / "study", seeds=1)
    _study_where_verdicts_differ(tmp_path / "b" / "study", seeds=1)
    archive.pack(tmp_path / "a" / "study", packed)
    with pytest.raises(SystemExit, match=r"holds the runs of .*a/study, not of .*b/study"):
        archive.pack(tmp_path / "b" / "study", packed)
    assert archive.packed_members(tmp_path / "b" / "study", packed) == {}  # not b's runs


def test_docs_hold_no_runs_and_the_crn16_report_regenerates_from_its_archives(report, monkeypatch):
    """docs/ holds the reports only; the 16-seed report, with its comparison against the
    11-seed study and the step seconds of its timed reruns, comes back byte for byte from the
    packed runs, read where the report names them (docs/study/...)."""
    assert not list((ROOT / "docs").rglob("study_run.json"))
    monkeypatch.chdir(ROOT)
    here = Path("docs/study/crn16")
    data, md = report.report_text(
        here, Path("docs/study/crn11"), [Path("docs/study/crn16-seconds")], Path("studies")
    )
    assert md == (here / "study.md").read_text()
    assert json.dumps(data, indent=1) + "\n" == (here / "study.json").read_text()
