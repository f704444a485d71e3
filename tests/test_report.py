"""The end-of-run report on synthetic run folders: reading torn/resumed metrics, the overview
figure's panels and PNG, the terminal summary's figures, and `main`'s exit codes."""

import json
import math
import random

import pytest
from matplotlib.image import imread

from ibpo.run import report

ALL_PANELS = [
    "training reward",
    "completion length (tokens)",
    "entropy",
    "KL to reference",
    "cancellation residual",
    report.HELDOUT_TITLE,
    "repair success rate",
    "step time (s)",
]


def step_row(step: int, rng: random.Random) -> dict:
    """One training line with every metric the overview draws or the table summarises."""
    return {
        "step": step,
        "reward": rng.random(),
        "accuracy": rng.random(),
        "completion_length": rng.uniform(5, 20),
        "entropy": rng.uniform(0.5, 2),
        "kl": rng.uniform(0, 0.3),
        "residual": rng.uniform(0, 0.01),
        "repair_success_rate": rng.random(),
        "step_time": rng.uniform(1, 3),
        "tokens_per_second": rng.uniform(50, 100),
        "peak_memory_gb": rng.uniform(1, 4),
        "skipped_nonfinite": float(rng.random() < 0.2),
    }


def write_lines(path, rows, torn: str = "") -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows) + torn
    path.write_text(text)


def make_run(out, steps=20, evals=(5, 10, 15), summary=True, seed=0):
    """A run that was killed after step 12 (torn line), resumed from step 8 (steps 9-12 logged
    again with other values) and finished. Returns (final rows by step, eval points, summary)."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    first = {s: step_row(s, rng) for s in range(1, min(12, steps) + 1)}
    final = {s: step_row(s, rng) for s in range(9, steps + 1)}
    final = {**first, **final}
    evals = {s: {"step": s, "eval_accuracy": rng.random(), "eval_n": 40} for s in evals}

    def with_evals(rows):
        return [x for r in rows for x in ([r, evals[r["step"]]] if r["step"] in evals else [r])]

    lines = with_evals(list(first.values()))
    lines += with_evals([final[s] for s in range(9, steps + 1)])
    write_lines(out / report.METRICS, lines, torn='{"step": 21, "reward": 0.')
    s = None
    if summary:
        s = {
            "eval_before": {"accuracy": 0.1, "n": 40},
            "eval_after": {"accuracy": 0.55, "n": 40},
            "steps": steps,
            "objective": "ibpo",
            "model": "tiny",
            "quantization": "none",
            "dataset": "builtin:arithmetic",
            "status": "completed",
            "message": None,
            "nonfinite_steps": int(sum(r["skipped_nonfinite"] for r in final.values())),
            "resumed_from": str(out / "checkpoints/step-8"),
            "checkpoint": str(out / f"checkpoints/step-{steps}"),
            "wall_seconds": 3725.0,
            "adapter": str(out / "adapter"),
        }
        (out / report.SUMMARY).write_text(json.dumps(s))
    return [final[k] for k in sorted(final)], evals, s


def table_value(table: str, label: str) -> str:
    """The value column of the table line with this label."""
    for line in table.splitlines()[1:]:
        if line.strip().startswith(label + "  "):
            return line.strip()[len(label) :].strip()
    raise AssertionError(f"no line {label!r} in\n{table}")


def mean(xs):
    return sum(xs) / len(xs)


# --- reading ---


def test_read_metrics_drops_torn_line_and_keeps_last_logged_step(tmp_path, capsys):
    final, evals, _ = make_run(tmp_path / "run", summary=False)
    rows = report.read_metrics(tmp_path / "run" / report.METRICS)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for row, want in zip(rows, final):  # replayed steps 9-12 hold the resumed run's values
        for key, value in want.items():
            assert row[key] == value
    # evaluation lines are merged into their step, not mistaken for a replay of it
    assert {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r} == {
        s: e["eval_accuracy"] for s, e in evals.items()
    }
    assert capsys.readouterr().err == ""  # a torn last line is expected, not worth a note


def test_read_metrics_notes_a_broken_middle_line(tmp_path, capsys):
    path = tmp_path / report.METRICS
    path.write_text(
        '{"step": 1, "reward": 0.5}\nnot json\n{"reward": 1}\n{"step": 2, "reward": 1}\n'
    )
    rows = report.read_metrics(path)
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.5), (2, 1)]
    err = capsys.readouterr().err
    assert "line 2 is not valid JSON" in err and "line 3 has no integer 'step'" in err


def test_series_skips_missing_and_non_finite_values():
    rows = [{"step": 1, "kl": 0.5}, {"step": 2}, {"step": 3, "kl": math.nan}, {"step": 4, "kl": 1}]
    assert report.series(rows, "kl") == ([1, 4], [0.5, 1.0])


def test_moving_average_is_a_trailing_mean():
    assert report.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    rng = random.Random(1)
    xs = [rng.random() for _ in range(30)]
    got = report.moving_average(xs, 7)
    want = [mean(xs[max(0, i - 6) : i + 1]) for i in range(30)]
    assert got == pytest.approx(want)


def test_heldout_points_put_before_at_zero_and_after_at_the_last_step(tmp_path):
    _, evals, summary = make_run(tmp_path / "run")
    rows = report.read_metrics(tmp_path / "run" / report.METRICS)
    pts = report.heldout_points(rows, summary)
    want = [(0, 0.1), *((s, e["eval_accuracy"]) for s, e in evals.items()), (20, 0.55)]
    assert pts == want


# --- plots ---


def assert_png(path):
    img = imread(path)  # raises on a file that is not a PNG
    assert path.suffix == ".png" and path.stat().st_size > 0
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_plot_run_writes_the_overview_with_every_panel(tmp_path):
    out = tmp_path / "run"
    _, _, summary = make_run(out)
    paths = report.plot_run(out)
    assert paths == [out / report.PLOTS / report.OVERVIEW]
    assert_png(paths[0])
    rows = report.read_metrics(out / report.METRICS)
    fig = report.build_figure(rows, summary)
    assert [ax.get_title() for ax in fig.axes] == ALL_PANELS
    reward_ax = fig.axes[0]
    # raw + moving average for reward and accuracy (20 steps > a 3-step window)
    assert len(reward_ax.lines) == 4
    heldout = fig.axes[ALL_PANELS.index(report.HELDOUT_TITLE)].lines[0]
    assert list(heldout.get_xdata()) == [0, 5, 10, 15, 20]


def test_missing_metrics_leave_their_panels_out(tmp_path):
    rows = [{"step": s, "reward": s / 10, "step_time": 2.0} for s in range(1, 6)]
    write_lines(tmp_path / report.METRICS, rows)
    fig = report.build_figure(report.read_metrics(tmp_path / report.METRICS), None)
    assert [ax.get_title() for ax in fig.axes] == ["training reward", "step time (s)"]
    assert_png(report.plot_run(tmp_path)[0])


def test_one_step_still_plots_and_zero_steps_skip(tmp_path):
    one, empty = tmp_path / "one", tmp_path / "empty"
    make_run(one, steps=1, evals=())
    assert_png(report.plot_run(one)[0])
    fig = report.build_figure(report.read_metrics(one / report.METRICS))
    assert report.HELDOUT_TITLE not in [ax.get_title() for ax in fig.axes]  # no summary given
    assert [len(line.get_xdata()) for line in fig.axes[0].lines] == [1, 1]
    empty.mkdir()
    (empty / report.METRICS).write_text("")
    assert report.plot_run(empty) == [] and not (empty / report.PLOTS).exists()
    assert report.build_figure([], None) is None


# --- summary table ---


def test_summary_table_reports_the_runs_figures(tmp_path):
    out = tmp_path / "run"
    final, evals, summary = make_run(out)
    (out / report.PLOTS).mkdir()  # the table lists the plots it finds (plot_run is tested above)
    (out / report.PLOTS / report.OVERVIEW).write_bytes(b"")
    table = report.summary_table(out)
    lines = table.splitlines()
    assert len(lines) <= 20 and str(out) in lines[0]
    starts = {len(x) - len(x.lstrip()) for x in lines[1:]}
    assert starts == {2}  # labels indented alike, values in one column:
    label_width = max(len(x.strip().split("  ")[0]) for x in lines[1:])
    assert all(x[2 + label_width : 4 + label_width] == "  " for x in lines[1:])

    assert table_value(table, "status") == "completed"
    assert table_value(table, "steps") == "20"
    assert table_value(table, "non-finite steps") == f"{summary['nonfinite_steps']} skipped"
    assert table_value(table, "wall time") == "1h 02m 05s"
    e = [f"@{s} {v['eval_accuracy']:.3f}" for s, v in evals.items()]
    assert table_value(table, "held-out accuracy") == (
        f"before 0.100 -> {' -> '.join(e)} -> after 0.550  (n=40)"
    )
    reward = [r["reward"] for r in final]
    assert table_value(table, "train reward").startswith(
        f"{mean(reward[:2]):.3f} -> {mean(reward[-2:]):.3f}"
    )
    assert table_value(table, "final entropy") == f"{final[-1]['entropy']:.3f}"
    assert table_value(table, "mean residual") == f"{mean([r['residual'] for r in final]):.4f}"
    assert table_value(table, "mean KL") == f"{mean([r['kl'] for r in final]):.4f}"
    tokens = sum(r["tokens_per_second"] * r["step_time"] for r in final)
    rate = tokens / sum(r["step_time"] for r in final)
    assert table_value(table, "tokens/s").startswith(f"{rate:.1f} ")
    peak = max(r["peak_memory_gb"] for r in final)
    assert table_value(table, "peak memory") == f"{peak:.2f} GiB"
    assert table_value(table, "adapter") == summary["adapter"]
    assert table_value(table, "checkpoint") == summary["checkpoint"]
    assert table_value(table, "plots") == str(out / report.PLOTS / report.OVERVIEW)
    assert table_value(table, "resumed from") == summary["resumed_from"]


def test_summary_table_reports_the_repair_cost(tmp_path):
    out = tmp_path / "run"
    make_run(out, summary=False)
    assert "repair cost" not in report.summary_table(out)  # a run that logged no repairs
    rows = [
        {"step": s, "repair_prefill_tokens": p, "repair_decode_tokens": d, "time_repair": t}
        for s, p, d, t in [(1, 100.0, 40.0, 1.0), (2, 300.0, 60.0, 2.0)]
    ]
    (out / report.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert table_value(report.summary_table(out), "repair cost") == (
        "200 prefill + 50 decode tokens, 1.50 s  (mean per step)"
    )
    for r, prompt in zip(rows, (150.0, 450.0)):  # a run that shares prompt prefixes
        r["repair_prompt_tokens"] = prompt
    (out / report.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert table_value(report.summary_table(out), "repair cost") == (
        "200 prefill (of 300 prompt tokens) + 50 decode tokens, 1.50 s  (mean per step)"
    )


def test_summary_table_reports_the_repair_spending(tmp_path):
    out = tmp_path / "run"
    make_run(out, summary=False)
    assert "repair spending" not in report.summary_table(out)
    keys = ("repairs", "repairs_skipped", "repair_successes", "repair_cost_share",
            "repair_probe", "repair_success_rate")  # fmt: skip
    steps = [(8, 0, 1, 0.6, 0, 0.125), (0, 8, 0, 0.0, 0, 0.0), (4, 4, 1, 0.4, 1, 0.25)]
    rows = [{"step": s + 1, **dict(zip(keys, v))} for s, v in enumerate(steps)]
    (out / report.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = report.summary_table(out)
    assert table_value(table, "repair spending") == (
        "12 run, 12 skipped (pooled success 0.167; 1 step without repairs, 1 probe), "
        "0.33 of the tokens  (mean share per step)"
    )
    # the mean success rate is over the steps that ran repairs
    assert table_value(table, "repair success") == f"{(0.125 + 0.25) / 2:.3f}"


def test_summary_table_of_a_run_without_summary(tmp_path):
    out = tmp_path / "run"
    final, _, _ = make_run(out, steps=12, evals=(2, 4, 6, 8, 10), summary=False)
    for step in (2, 10):  # the newest by number, not by name
        (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
    table = report.summary_table(out)
    assert table_value(table, "status").startswith("no summary.json")
    assert table_value(table, "steps") == "12"
    skipped = int(sum(r["skipped_nonfinite"] for r in final))
    assert table_value(table, "non-finite steps") == f"{skipped} skipped"
    wall = report._duration(sum(r["step_time"] for r in final))
    assert table_value(table, "wall time") == f"{wall} (sum of step times)"
    held = table_value(table, "held-out accuracy")
    assert held.startswith("@2 ") and " -> ... -> @8 " in held and held.endswith("(n=40)")
    assert table_value(table, "checkpoint") == str(out / "checkpoints" / "step-10")
    assert table_value(table, "adapter") == "none saved"
    assert table_value(table, "plots") == "none written"


def test_summary_table_leaves_out_metrics_never_logged(tmp_path):
    write_lines(tmp_path / report.METRICS, [{"step": 1, "reward": 0.25}])
    summary = {
        "status": "interrupted",
        "message": "stopped by SIGTERM\n  resume with ...",
        "steps": 1,
        "eval_before": None,
        "eval_after": None,
    }
    (tmp_path / report.SUMMARY).write_text(json.dumps(summary))
    table = report.summary_table(tmp_path)
    assert table_value(table, "status") == "interrupted: stopped by SIGTERM"
    assert table_value(table, "held-out accuracy").startswith("n/a")
    assert table_value(table, "train reward").startswith("0.250 -> 0.250")
    for label in ("mean KL", "mean residual", "final entropy", "tokens/s", "peak memory"):
        assert f"  {label}  " not in table


# --- command ---


def test_main_prints_the_table_and_writes_plots(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()  # a small run keeps the figure cheap; the panels are tested above
    write_lines(out / report.METRICS, [{"step": s, "reward": s / 4} for s in range(1, 5)])
    assert report.main([str(out), "--no-plots"]) == 0
    assert not (out / report.PLOTS).exists()
    assert report.main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"ibpo report: {out}") and "training.png" in printed
    assert_png(out / report.PLOTS / report.OVERVIEW)


def test_main_fails_clearly_without_metrics(tmp_path, capsys):
    assert report.main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} has no metrics.jsonl" in err and "run.output_dir" in err
