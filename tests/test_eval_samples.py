"""Evaluation samples are a function of (problem, sample index, seed): growing --n, resuming after
a kill mid-problem and another --batch-size give the samples of one uninterrupted run, on the HF
backend and the vllm one (tests/fake_vllm); and the two maj@n conventions on hand-made votes.

Driven through the command line (`evaluation.cli.main`) on the tiny Qwen3 of conftest.py, which
samples gibberish: what is compared is the completion text of each (problem, sample) key."""

import json
import sys
from pathlib import Path

import pytest

from ibpo.evaluation.evaluate import majority_correct, summarize

ROOT = Path(__file__).resolve().parents[1]
GSM8K = str(ROOT / "tests" / "fixtures" / "benchmarks" / "gsm8k.jsonl")
FAKE = str(Path(__file__).parent / "fake_vllm")


@pytest.fixture(autouse=True)
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["hf", "vllm"])
def backend(request, monkeypatch):
    if request.param == "vllm":
        monkeypatch.syspath_prepend(FAKE)
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            monkeypatch.delitem(sys.modules, name)
        import vllm

        assert vllm.__file__.startswith(FAKE)
    yield request.param
    if request.param == "vllm":
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            sys.modules.pop(name, None)


def run(model_dir, out, backend, n, batch_size=8, *extra):
    from ibpo.evaluation.cli import main

    args = ["--model", model_dir, "--data", GSM8K, "--n", str(n), "--batch-size",
            str(batch_size), "--max-new-tokens", "8", "--temperature", "1.0", "--top-p", "0.9",
            "--backend", backend, "--output-dir", str(out), "--no-progress", *extra]  # fmt: skip
    return main(args, benchmark="gsm8k")


def samples(out) -> dict[tuple[str, int], str]:
    lines = (Path(out) / "samples.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    keys = [(r["problem_id"], r["sample"]) for r in recs]
    assert len(keys) == len(set(keys)), "a key was written twice"
    return {(r["problem_id"], r["sample"]): r["completion"] for r in recs}


def test_growing_n_adds_new_samples_equal_to_a_fresh_run(tiny_model_dir, backend, tmp_path):
    assert run(tiny_model_dir, tmp_path / "fresh", backend, 4) == 0
    fresh = samples(tmp_path / "fresh")
    assert run(tiny_model_dir, tmp_path / "grown", backend, 2) == 0
    assert run(tiny_model_dir, tmp_path / "grown", backend, 4) == 0
    grown = samples(tmp_path / "grown")
    assert grown == fresh
    for pid in ("0", "1"):  # the new samples are not copies of the first ones
        assert len({grown[(pid, i)] for i in range(4)}) > 2, [grown[(pid, i)] for i in range(4)]


def test_resume_after_a_kill_mid_problem_equals_an_uninterrupted_run(
    tiny_model_dir, backend, tmp_path
):
    out = tmp_path / "run"
    assert run(tiny_model_dir, out, backend, 4, 3) == 0
    whole = samples(out)
    path = out / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:20])  # killed after 2 samples of problem 0
    assert run(tiny_model_dir, out, backend, 4, 3) == 0
    assert samples(out) == whole


def test_batch_size_does_not_change_the_samples(tiny_model_dir, backend, tmp_path):
    assert run(tiny_model_dir, tmp_path / "b3", backend, 4, 3) == 0
    assert run(tiny_model_dir, tmp_path / "b8", backend, 4, 8) == 0
    assert samples(tmp_path / "b3") == samples(tmp_path / "b8")
    # the seed still matters
    assert run(tiny_model_dir, tmp_path / "s1", backend, 4, 8, "--seed", "1") == 0
    assert samples(tmp_path / "s1") != samples(tmp_path / "b8")


# --- maj@n conventions ---------------------------------------------------------------------------


def test_text_vote_lets_missing_answers_vote_and_grader_vote_lets_them_abstain():
    answers, rewards = [None, None, "7"], [0.0, 0.0, 1.0]
    assert majority_correct(answers, rewards, mode="text") == 0.0  # "" wins 2 to 1
    assert majority_correct(answers, rewards, mode="grader") == 1.0  # only "7" votes
    # text: "1/2" and "0.5" are different strings; grader: one cluster of two
    answers, rewards = ["3", "1/2", "0.5 ", "3"], [0.0, 1.0, 1.0, 0.0]
    assert majority_correct(answers, rewards, mode="text") == 0.0
    assert majority_correct(["1/2", "3", "0.5"], [1.0, 0.0, 1.0], mode="grader") == 1.0
    assert majority_correct(["1/2", "3", "0.5"], [1.0, 0.0, 1.0], mode="text") == 1.0  # first
    assert majority_correct([" 7", "7 ", "8"], [1.0, 1.0, 0.0], mode="text") == 1.0  # stripped
    assert majority_correct([None, "8", "8"], [0.0, 0.0, 0.0], mode="text") == 0.0


def test_summary_reports_both_votes():
    class P:
        id = "a"

    recs = {
        ("a", i): {"reward": r, "extracted": x, "length": 3, "truncated": False}
        for i, (r, x) in enumerate([(0.0, None), (0.0, None), (1.0, "7")])
    }
    s = summarize([P()], recs, n=3, vote=True)
    assert s["maj@3"] == 0.0 and s["maj@3_grader"] == 1.0
    s = summarize([P()], recs, n=3, vote=False)
    assert s["maj@3"] is None and s["maj@3_grader"] is None


def test_seeded_sampling_draws_hfs_distribution():
    """Gumbel-max over HF's temperature + top-p warped logits: the token frequencies over many
    seeds match softmax(warped logits), and one row's draw ignores the other rows."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    from ibpo.evaluation.cli import SeededSampling

    logits = torch.tensor([[2.0, 1.5, 0.5, -1.0, -3.0]])
    warped = TopPLogitsWarper(0.9)(None, TemperatureLogitsWarper(0.7)(None, logits.clone()))
    expected = torch.softmax(warped, -1)[0]
    assert expected[-1] == 0.0  # top-p removed the tail
    rows = 20000
    noisy = SeededSampling(list(range(rows)), 0.7, 0.9, "cpu")(None, logits.repeat(rows, 1))
    freq = torch.bincount(noisy.argmax(-1), minlength=5).double() / rows
    assert torch.allclose(freq, expected.double(), atol=0.015), (freq, expected)
    alone = SeededSampling([7], 0.7, 0.9, "cpu")(None, logits.clone())
    assert torch.equal(alone[0], noisy[7])


def test_samples_drawn_before_per_sample_seeds_are_not_mixed_in(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "old"
    assert run(tiny_model_dir, out, "hf", 2) == 0
    fingerprint = json.loads((out / "run.json").read_text())
    del fingerprint["sample_seeds"]  # as written before each sample had its own seed
    (out / "run.json").write_text(json.dumps(fingerprint))
    assert run(tiny_model_dir, out, "hf", 4) == 2
    assert "before each sample had its own seed" in capsys.readouterr().err
    assert run(tiny_model_dir, out, "hf", 4, 8, "--overwrite") == 0
    # greedy samples need no seed: a greedy folder from before still resumes
    greedy = tmp_path / "greedy"
    assert run(tiny_model_dir, greedy, "hf", 1, 8, "--temperature", "0") == 0
    assert "sample_seeds" not in json.loads((greedy / "run.json").read_text())


def test_the_decode_engine_writes_the_samples_hf_generate_writes(
    tiny_model_dir, tmp_path, monkeypatch
):
    """--decode graph (the package's engine, with evaluation's per-sample seeded sampling as a
    logits processor) against --decode eager (HF generate): the same completions."""
    from ibpo.generation.decode import DecodeEngine

    calls = []
    decode = DecodeEngine.decode
    monkeypatch.setattr(DecodeEngine, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    assert run(tiny_model_dir, tmp_path / "eager", "hf", 3, 4, "--decode", "eager") == 0
    assert not calls
    assert run(tiny_model_dir, tmp_path / "graph", "hf", 3, 4, "--decode", "graph") == 0
    assert calls  # the engine decoded
    assert samples(tmp_path / "graph") == samples(tmp_path / "eager")
