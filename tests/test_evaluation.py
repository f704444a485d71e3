"""Benchmark evaluation: metrics against hand-computed values, fixtures in each Hub schema, the
resumable sample file, and every eval script end to end on the real SmolLM2-135M (`slow`)."""

import base64
import importlib.util
import json
import os
import pickle
import runpy
import zlib
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest

from ibpo.config import ConfigError, DataConfig
from ibpo.evaluation.benchmarks import BENCHMARKS, decode_lcb_tests, lcb_files, load_problems
from ibpo.evaluation.cli import markdown_row
from ibpo.evaluation.evaluate import (
    append_samples,
    majority_correct,
    pass_at_k,
    pass_ks,
    read_samples,
    summarize,
    vote_clusters,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "benchmarks"
SCRIPTS = ROOT / "scripts"


def fixture(name: str) -> str:
    return str(FIXTURES / f"{name}.jsonl")


# --- metrics -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 0.25),  # c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (8, 2, 4, 1 - 15 / 70),  # 1 - C(6,4)/C(8,4)
        (4, 0, 4, 0.0),
        (4, 3, 2, 1.0),  # fewer than k wrong samples: some draw of k always holds a right one
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    n, c, k = 1000, 500, 300
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_ks_are_powers_of_two_and_n():
    assert pass_ks(1) == [1]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert pass_ks(8) == [1, 2, 4, 8]


def test_majority_vote_groups_equal_numbers_and_breaks_ties_by_order():
    for mode in ("grader", "text"):
        assert majority_correct(["1/2", "0.5", "3", None], [1.0, 1.0, 0.0, 0.0], mode) == 1.0
        assert majority_correct(["3", "4"], [0.0, 1.0], mode) == 0.0  # tie: the earlier wins
        assert majority_correct(["4", "3", "3"], [1.0, 0.0, 0.0], mode) == 0.0
        assert majority_correct([None, None], [0.0, 0.0], mode) == 0.0
    assert majority_correct(["1/2", "3", "0.5", "3"], [1.0, 0.0, 1.0, 0.0], "grader") == 1.0
    assert majority_correct(["1/2", "3", "0.5", "3"], [1.0, 0.0, 1.0, 0.0], "text") == 0.0
    with pytest.raises(ValueError, match="text or grader"):
        majority_correct(["1"], [1.0], "cluster")


def test_majority_vote_groups_answers_the_grader_calls_equal():
    """Three ways of writing 1/2 outvote two 3s; the same for thousands separators and units."""
    answers = ["\\dfrac{1}{2}", "\\frac{1}{2}", "\\tfrac12", "3", "3"]
    assert majority_correct(answers, [1.0, 1.0, 1.0, 0.0, 0.0], "grader") == 1.0
    assert majority_correct(answers, [1.0, 1.0, 1.0, 0.0, 0.0], "text") == 0.0  # "3" x 2
    answers = ["1,000", "1{,}000", "1000 \\text{ dollars}", "999", "999"]
    assert majority_correct(answers, [1.0, 1.0, 1.0, 0.0, 0.0], "grader") == 1.0
    assert vote_clusters(["2", None, "2.0", "x", "4/2"]) == [0, None, 0, 3, 0]


def test_a_completion_cut_off_in_a_think_block_the_template_opened_holds_no_answer(tmp_path):
    """Templates that open <think> in the prompt leave "</think>" alone in the completion: one cut
    off mid-thought must not be graded on a draft answer inside its thinking."""
    from ibpo.evaluation.benchmarks import Problem
    from ibpo.evaluation.evaluate import run_benchmark
    from ibpo.rewards.functions import reward_set
    from ibpo.rewards.math import extract_answer, text_to_grade

    class OpensThinking:  # a chat template ending in an open think block
        chat_template = "(any)"

        def apply_chat_template(self, messages, **kwargs):
            return messages[-1]["content"] + "\n<|assistant|>\n<think>\n"

    problems = [Problem("p", "What is 200 + 4?", "204")]
    got = {}
    for name, text, cut in [
        ("cut", "Maybe \\boxed{204}? Wait, let me check the", True),
        ("done", "200 + 4 = 204.\n</think>\n\\boxed{204}", False),
    ]:
        sampler = lambda prompts, seeds, t=text, c=cut: [(t, 12, c) for _ in prompts]  # noqa: E731
        build = lambda s=sampler: (s, OpensThinking())  # noqa: E731
        (tmp_path / name).mkdir()
        records = run_benchmark(
            problems,
            1,
            tmp_path / name,
            build,
            reward_set("math"),
            extract_answer,
            None,
            4,
            progress=False,
        )
        got[name] = records[("p", 0)]
    assert got["cut"]["reward"] == 0.0 and got["cut"]["extracted"] is None
    assert got["done"]["reward"] == 1.0 and got["done"]["extracted"] == "204"
    assert text_to_grade("Q<think>\n\n</think>\n\n", "\\boxed{1}") == "\\boxed{1}"  # closed


def test_livecodebench_contest_date_window():
    bench = BENCHMARKS["livecodebench"]
    ids = lambda dates: [p.id for p in load_problems(bench, fixture("livecodebench"), dates=dates)]  # noqa: E731
    assert ids((None, None)) == ["abc900_a", "9901"]
    assert ids(("2025-01-05", None)) == ["9901"]
    assert ids((None, "2025-01-04")) == ["abc900_a"]
    with pytest.raises(ConfigError, match="no problems"):
        ids(("2025-02-01", "2025-03-01"))
    with pytest.raises(ConfigError, match="YYYY-MM-DD"):
        ids(("Jan 2025", None))
    with pytest.raises(ConfigError, match="LiveCodeBench only"):
        load_problems(BENCHMARKS["gsm8k"], fixture("gsm8k"), dates=("2025-01-01", None))


def test_summarize_by_hand():
    class P:
        def __init__(self, pid):
            self.id = pid

    def rec(pid, i, reward, ans, length):
        return {
            "problem_id": pid,
            "sample": i,
            "reward": reward,
            "extracted": ans,
            "length": length,
            "truncated": length == 8,
        }

    recs = [
        rec("a", 0, 1.0, "2", 4),
        rec("a", 1, 0.0, "3", 8),
        rec("b", 0, 0.0, "5", 6),
        rec("b", 1, 0.0, "5", 6),
        rec("b", 2, 1.0, "9", 2),
    ]
    records = {(r["problem_id"], r["sample"]): r for r in recs}
    s = summarize([P("a"), P("b")], records, n=2, vote=True)  # sample b/2 is beyond n: ignored
    assert s["avg@2"] == pytest.approx(0.25)
    assert s["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert s["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert s["maj@2"] == pytest.approx(0.5)  # a: tie -> "2" (right); b: "5" (wrong)
    assert s["maj@2_grader"] == pytest.approx(0.5)
    assert s["mean_length"] == pytest.approx(6.0) and s["truncated"] == pytest.approx(0.25)
    assert summarize([P("a")], records, n=2, vote=False)["maj@2"] is None
    row = markdown_row({**s, "benchmark": "x", "model": "org/m", "adapter": None})
    assert row == "| x | m | - | 2 | 0.250 | 0.250 | 0.500 | 0.500 | 6 | 0.250 |\n"
    one = summarize([P("a")], records, n=1, vote=True)
    head = markdown_row({**one, "benchmark": "x", "model": "m", "adapter": None}, header=True)
    assert head.splitlines()[0].count("pass@1") == 1  # n = 1: pass@1 is pass@n


# --- the resumable sample file -------------------------------------------------------------------


def test_partial_last_line_is_dropped_and_appending_continues(tmp_path):
    path = tmp_path / "samples.jsonl"
    full = [{"problem_id": "p", "sample": i, "reward": 1.0} for i in range(2)]
    append_samples(path, full)
    with path.open("a") as f:
        f.write('{"problem_id": "p", "sample": 2, "rew')  # killed mid-write
    assert set(read_samples(path)) == {("p", 0), ("p", 1)}
    append_samples(path, [{"problem_id": "p", "sample": 2, "reward": 0.0}])
    lines = path.read_text().splitlines()
    assert [json.loads(x)["sample"] for x in lines] == [0, 1, 2]
    path.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(ConfigError, match="line 2"):
        read_samples(path)


# --- benchmarks and fixtures ---------------------------------------------------------------------

EXPECTED_GOLD = {
    "math500": ["12", "\\frac{3}{4}", "4"],
    "aime24": ["24", "9"],
    "aime25": ["55", "32"],
    "amc23": ["27", "25"],  # 27.0 in the file: integers lose the .0
    "gsm8k": ["7", "30"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_GOLD))
def test_math_fixtures_load_with_boxed_prompt(name):
    problems = load_problems(BENCHMARKS[name], data=fixture(name))
    assert [p.gold for p in problems] == EXPECTED_GOLD[name]
    assert all(p.prompt.endswith("within \\boxed{}.") for p in problems)
    assert len({p.id for p in problems}) == len(problems)


def test_math_answers_grade_with_the_training_grader():
    from ibpo.rewards import GRADERS

    for name, golds in EXPECTED_GOLD.items():
        for p, gold in zip(load_problems(BENCHMARKS[name], data=fixture(name)), golds):
            assert GRADERS["math"](f"So the answer is \\boxed{{{gold}}}.", p.gold).score == 1.0
            assert GRADERS["math"]("So the answer is \\boxed{1000003}.", p.gold).score == 0.0


def test_livecodebench_rows_decode_public_and_compressed_private_tests():
    problems = load_problems(BENCHMARKS["livecodebench"], data=fixture("livecodebench"))
    stdin, functional = (json.loads(p.gold) for p in problems)
    assert [t["output"] for t in stdin["tests"]] == ["7\n", "30\n", "0\n"]
    assert "fn_name" not in stdin and functional["fn_name"] == "arrayTotal"
    assert len(functional["tests"]) == 3
    assert "standard input" in problems[0].prompt
    assert "def arrayTotal" in problems[1].prompt and "```python" in problems[1].prompt


def test_livecodebench_decoder_refuses_pickled_globals():
    evil = base64.b64encode(zlib.compress(pickle.dumps(os.getcwd))).decode()
    with pytest.raises(pickle.UnpicklingError):
        decode_lcb_tests(evil)


def test_livecodebench_release_tags():
    assert lcb_files("release_v2") == ["test.jsonl", "test2.jsonl"]
    assert lcb_files("v6") == ["test6.jsonl"]
    assert lcb_files("v4_v5") == ["test4.jsonl", "test5.jsonl"]
    with pytest.raises(ConfigError):
        lcb_files("latest-ish")


def test_humaneval_without_the_hub_uses_the_package_copy(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems = load_problems(BENCHMARKS["humaneval"], limit=2)
    assert [p.id for p in problems] == ["HumanEval/0", "HumanEval/1"]
    assert json.loads(problems[0].gold)["entry_point"] == "has_close_elements"


def test_wrong_schema_and_unreachable_hub_are_clear_errors(monkeypatch):
    with pytest.raises(ConfigError, match="no column"):
        load_problems(BENCHMARKS["aime24"], data=fixture("math500"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="--data"):
        load_problems(BENCHMARKS["amc23"])


def _code_reward():
    from ibpo.rewards import GRADERS

    if "code" not in GRADERS:
        pytest.skip("ibpo.rewards has no code grader")
    return GRADERS["code"]


def test_canonical_code_solutions_score_one():
    grade = _code_reward()
    he = load_problems(BENCHMARKS["humaneval"], data=fixture("humaneval"))
    rows = [json.loads(x) for x in open(fixture("humaneval"))]
    for p, row in zip(he, rows):
        body = row["prompt"] + row["canonical_solution"]
        assert grade(f"```python\n{body}```", p.gold).score == 1.0
        assert grade(f"```python\n{row['prompt']}    return None\n```", p.gold).score == 0.0
    solutions = json.loads((FIXTURES / "livecodebench_solutions.json").read_text())
    for p in load_problems(BENCHMARKS["livecodebench"], data=fixture("livecodebench")):
        assert grade(solutions[p.id], p.gold).score == 1.0
        assert grade("```python\nprint(0)\n```", p.gold).score == 0.0


# --- the scripts end to end on SmolLM2 -----------------------------------------------------------


@pytest.fixture(scope="module")
def cached_loader():
    """Scripts load the model themselves; within this module one load per setting is enough.
    One torch thread: on the shared 2-core machines a second thread mostly waits on the other
    jobs (generation ran 5x slower with 2 threads under load)."""
    import torch

    import ibpo.modeling as modeling

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    real, cache = modeling.load_for_inference, {}

    def load(name, adapter=None, quantization="none", dtype="auto", **kw):
        key = (name, adapter, quantization, dtype)
        if key not in cache:
            cache[key] = real(name, adapter, quantization, dtype, **kw)
        return cache[key]

    yield load
    torch.set_num_threads(threads)


@pytest.fixture
def run_script(cached_loader, monkeypatch):
    import ibpo.modeling as modeling

    monkeypatch.setattr(modeling, "load_for_inference", cached_loader)

    def run(name: str, *args: str) -> int:
        script = runpy.run_path(str(SCRIPTS / f"eval_{name}.py"), run_name="eval_script")
        return script["run"]([*args, "--no-progress"])

    return run


def _quick(model, out, *extra, limit=2, tokens=16):
    return (
        "--model",
        model,
        "--n",
        "2",
        "--max-new-tokens",
        str(tokens),
        "--batch-size",
        "8",
        "--limit",
        str(limit),
        "--output-dir",
        str(out),
        *extra,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_script_end_to_end(name, smollm2_dir, run_script, tmp_path, capsys):
    if BENCHMARKS[name].reward == "code":
        _code_reward()
    out = tmp_path / name
    assert run_script(name, *_quick(smollm2_dir, out, "--data", fixture(name))) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == name and summary["problems"] == 2 and summary["n"] == 2
    for key in ("avg@2", "pass@1", "pass@2", "mean_length"):
        assert 0.0 <= summary[key] <= (1.0 if key != "mean_length" else 16.0)
    assert (summary["maj@2"] is None) == (BENCHMARKS[name].reward == "code")
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted((s["problem_id"], s["sample"]) for s in samples) == sorted(
        (p.id, i)
        for p in load_problems(BENCHMARKS[name], data=fixture(name), limit=2)
        for i in range(2)
    )
    assert all(s["length"] >= 1 and s["completion"] is not None for s in samples)
    assert f"| {name} | " in capsys.readouterr().out
    assert (out / "results.md").read_text().count("\n") == 3


@pytest.mark.slow
def test_resume_after_a_kill_completes_without_duplicates(
    smollm2_dir, run_script, tmp_path, monkeypatch
):
    out = tmp_path / "resume"
    out.mkdir()
    kept = {
        "problem_id": "0",
        "sample": 0,
        "completion": "Ana has 7 apples. Answer: 7",
        "extracted": "7",
        "reward": 1.0,
        "length": 9,
        "truncated": False,
    }
    half = json.dumps({**kept, "sample": 1, "completion": "Ana"})[:30]  # killed mid-write
    (out / "samples.jsonl").write_text(json.dumps(kept) + "\n" + half)
    args = _quick(smollm2_dir, out, "--data", fixture("gsm8k"), limit=1)
    assert run_script("gsm8k", *args) == 0
    lines = (out / "samples.jsonl").read_text().splitlines()
    keys = [(json.loads(x)["problem_id"], json.loads(x)["sample"]) for x in lines]
    assert keys == [("0", 0), ("0", 1)]  # the partial line is gone, sample 1 generated once
    assert json.loads(lines[0]) == kept  # the finished sample was kept, not generated again
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pass@2"] == 1.0 and summary["avg@2"] >= 0.5  # it counts in the metrics
    # Nothing left to do: no model is loaded, the summary is rebuilt from the file.
    import ibpo.modeling as modeling

    def no_load(*a, **k):
        raise AssertionError("model loaded although every sample is done")

    monkeypatch.setattr(modeling, "load_for_inference", no_load)
    assert run_script("gsm8k", *args) == 0
    # Different sampling settings must not be mixed into the same file.
    assert run_script("gsm8k", *args, "--temperature", "1.0") == 2


@pytest.mark.slow
def test_adapter_is_applied_on_a_4bit_base(smollm2_dir, run_script, cached_loader, tmp_path):
    import bitsandbytes as bnb
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=8, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )  # random B: the adapter changes the outputs
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    greedy = ("--n", "1", "--temperature", "0", "--quantization", "nf4")
    outs = {}
    for tag, extra in (("base", ()), ("lora", ("--adapter", str(tmp_path / "adapter")))):
        out = tmp_path / tag
        args = _quick(
            smollm2_dir, out, "--data", fixture("amc23"), *greedy, *extra, limit=1, tokens=8
        )
        assert run_script("amc23", *args) == 0
        outs[tag] = [json.loads(x)["completion"] for x in open(out / "samples.jsonl")]
        assert json.loads((out / "summary.json").read_text())["quantization"] == "nf4"
    assert outs["base"] != outs["lora"]
    model, _ = cached_loader(smollm2_dir, str(tmp_path / "adapter"), "nf4", "auto")  # as run
    assert isinstance(model, PeftModel)  # a separate adapter ...
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())  # ... on 4-bit layers
    assert any("lora_B" in name for name, _ in model.named_parameters())


def test_missing_vllm_is_a_clear_error(tmp_path, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed")
    from ibpo.evaluation.cli import main

    args = ["--data", fixture("gsm8k"), "--backend", "vllm", "--output-dir", str(tmp_path)]
    assert main(args, benchmark="gsm8k") == 2
    assert "needs vLLM" in capsys.readouterr().err


class Plain:
    """A tokenizer whose chat template is the last message's text."""

    chat_template = "(any)"

    def apply_chat_template(self, messages, **kwargs):
        return messages[-1]["content"]


def _grader_fails_on(text: str, monkeypatch) -> None:
    """The math grader raises (as on a pathological expression) on any answer holding `text`."""
    from ibpo.rewards import math as grader

    real = grader._normalize

    def flaky(s):
        if text in s:
            raise RecursionError("deep")
        return real(s)

    monkeypatch.setattr(grader, "_normalize", flaky)


def test_a_grader_failure_is_recorded_per_sample_and_counted(tmp_path, monkeypatch):
    """A grader that fails on one sample scores it 0 and says why; the run goes on."""
    from ibpo.evaluation.benchmarks import Problem
    from ibpo.evaluation.evaluate import run_benchmark
    from ibpo.rewards.functions import reward_set
    from ibpo.rewards.math import extract_answer

    _grader_fails_on("13", monkeypatch)
    problems = [Problem("a", "6 + 7?", "13"), Problem("b", "2 + 2?", "4")]
    answers = {"6 + 7?": "\\boxed{13}", "2 + 2?": "\\boxed{4}"}
    sampler = lambda prompts, seeds: [(answers[p], 5, False) for p in prompts]  # noqa: E731
    records = run_benchmark(
        problems, 1, tmp_path, lambda: (sampler, Plain()), reward_set("math"), extract_answer,
        None, 4, progress=False,
    )  # fmt: skip
    assert records[("a", 0)]["reward"] == 0.0
    assert records[("a", 0)]["grader_error"].startswith("grader error (math): RecursionError")
    assert records[("b", 0)]["reward"] == 1.0 and "grader_error" not in records[("b", 0)]
    assert summarize(problems, records, n=1, vote=True)["grader_errors"] == 1


def test_a_benchmark_problems_options_reach_the_math_grader(tmp_path):
    """A multiple-choice benchmark problem (MATH has AMC ones, gold `\\text{(C)}`): its text
    gives the options, so the letter, the value or both are graded against the gold letter."""
    from ibpo.evaluation.benchmarks import Problem
    from ibpo.evaluation.evaluate import run_benchmark
    from ibpo.rewards.functions import reward_set
    from ibpo.rewards.math import extract_answer

    amc = r"How many? $\textbf{(A)}\ 8 \qquad\textbf{(B)}\ 10 \qquad\textbf{(C)}\ 12$"
    prompt = amc + "\n\nPlease reason step by step."
    answers = ["\\boxed{12}", "\\boxed{C}", "\\boxed{(C)\\ 12}", "\\boxed{(B)\\ 12}"]
    problems = [Problem(str(i), f"{prompt} #{i}", "\\text{(C)}") for i in range(4)]
    sampler = lambda prompts, seeds: [(answers[int(p[-1])], 5, False) for p in prompts]  # noqa: E731
    records = run_benchmark(
        problems, 1, tmp_path, lambda: (sampler, Plain()), reward_set("math"), extract_answer,
        None, 4, progress=False,
    )  # fmt: skip
    assert [records[(str(i), 0)]["reward"] for i in range(4)] == [1.0, 1.0, 1.0, 0.0]


def test_benchmarks_and_the_held_out_evaluation_give_the_same_verdicts(tmp_path, monkeypatch):
    """One grading route (rewards.functions.grade_completions) for a benchmark and the trainer's
    held-out evaluation: the same completions get the same verdicts, a failure of the grader
    itself included, which each reports as its own (a sample's grader_error; the evaluation's
    grader_errors, logged as eval_grader_errors, never a step's)."""
    from types import SimpleNamespace

    from ibpo.evaluation.benchmarks import Problem, reward_fns
    from ibpo.evaluation.evaluate import as_example, evaluate_accuracy, run_benchmark
    from ibpo.rewards.math import extract_answer
    from ibpo.run.log import log_eval

    _grader_fails_on("77", monkeypatch)
    answers = {  # problem -> (gold, completion)
        "6 + 7?": ("13", "6 + 7 = 13, so \\boxed{13}"),
        "2 + 2?": ("4", "\\boxed{5}"),
        "70 + 7?": ("77", "\\boxed{77}"),  # the grader itself fails: scored 0
        "3 * 3?": ("9", "9 + 7 = 16. Answer: 9"),
        "1 + 1?": ("2", "\\boxed{2}, or maybe 3"),  # hedged
    }
    problems = [Problem(f"p{i}", q, gold) for i, (q, (gold, _)) in enumerate(answers.items())]

    def completion_for(prompt: str) -> str:
        return next(text for q, (_, text) in answers.items() if q in prompt)

    sampler = lambda prompts, seeds: [(completion_for(p), 5, False) for p in prompts]  # noqa: E731
    bench = BENCHMARKS["gsm8k"]
    records = run_benchmark(
        problems, 1, tmp_path, lambda: (sampler, Plain()), reward_fns(bench), extract_answer,
        None, 8, progress=False,
    )  # fmt: skip

    def generate(tokenizer, prompts, n, max_new_tokens, batch_size, do_sample=True):
        texts = [completion_for(p) for p in prompts]
        return SimpleNamespace(
            texts=texts, host_tokens=lambda: [[1]] * len(texts), lengths=[1], tool_traces=None
        )

    data = DataConfig(prompt_template="{question}")
    held_out = [
        evaluate_accuracy(generate, Plain(), [as_example(p)], data, reward_fns(bench), 8, 8)
        for p in problems
    ]
    verdicts = [records[(p.id, 0)]["reward"] >= 1.0 for p in problems]
    assert verdicts == [True, False, False, True, False]
    assert [e["accuracy"] == 1.0 for e in held_out] == verdicts
    failed = ["grader_error" in records[(p.id, 0)] for p in problems]
    assert [e["grader_errors"] for e in held_out] == [int(f) for f in failed] == [0, 0, 1, 0, 0]

    lines = []
    log_eval(held_out[2], 3, None, SimpleNamespace(write=lines.append, flush=lambda: None),
             SimpleNamespace(is_main_process=False), None)  # fmt: skip
    assert json.loads(lines[0])["eval_grader_errors"] == 1.0
