"""The objective comparison script end to end in its smoke mode (tiny model, 2 steps)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the runs train the tiny model in this process: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _script():
    spec = importlib.util.spec_from_file_location("compare", ROOT / "bench/compare_objectives.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_smoke_writes_table_plot_and_resumes(tiny_model_dir, tmp_path, capsys):
    mod = _script()
    out = tmp_path / "cmp"
    argv = [
        "--smoke",
        "--model",
        str(tiny_model_dir),
        "--objectives",
        "ibpo,grpo",
        "--seeds",
        "0,1",
        "--out",
        str(out),
    ]
    assert mod.main(argv) == 0
    md = (out / "comparison.md").read_text()
    assert "| ibpo |" in md and "| grpo |" in md and "±" in md
    assert (out / "comparison.png").stat().st_size > 10_000
    data = json.loads((out / "comparison.json").read_text())
    assert set(data) == {"ibpo", "grpo"} and len(data["ibpo"]) == 2
    for run in data["ibpo"] + data["grpo"]:
        assert len(run["reward"]) == 2 and run["tokens"] > 0 and run["n_eval"] == 4
    # every ibpo step is exchangeable by construction
    assert all(r == 0.0 for run in data["ibpo"] for r in run["residual"])
    capsys.readouterr()
    assert mod.main(argv) == 0  # second call: every run is found done and skipped
    assert capsys.readouterr().out.count("[skip]") == 4
