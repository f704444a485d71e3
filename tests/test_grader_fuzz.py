"""Fuzz the graders with generated hostile programs, return values and answers.

Every test kind (stdin, call, check, script) in every isolation mode that works here, through
the graders themselves (grade_code, math_reward): no exception escapes, every reason is
bounded, nothing a program started is left running, and no forged pass scores (the programs
never compute the answer; the script kind is forgeable by design and only has to stay
contained). Deterministic: the programs come from a seeded generator.

The programs never touch anything but their own process, its process group and its own file
descriptors: in socket-patch mode they run unisolated on this machine.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from ibpo.rewards import code as code_grader
from ibpo.rewards import errors
from ibpo.rewards.math import math_reward
from ibpo.sandbox import run as sandbox
from tests.conftest import alive

MODES = [m for m in sandbox.MODES if sandbox.mode_works(m)]
CASES = 240  # programs, spread over kinds and modes
TAG = f"fz{uuid.uuid4().hex[:10]}"  # the name every daemon of this run gives itself

CHECK = "def check(candidate):\n    assert candidate(2, 3) == 6\n"
SPECS = {
    "stdin": {"tests": [{"input": "2 3\n", "output": "6\n"}] * 2},
    "call": {"tests": [{"input": "2\n3", "output": "6"}] * 2, "fn_name": "mul"},
    "check": {"tests": [], "test_code": CHECK, "entry_point": "mul"},
    "script": {"tests": [], "test_code": CHECK, "entry_point": "mul", "harness": "compatible"},
}


def _value(rng: random.Random, depth: int = 0) -> str:
    """Python source of a hostile return value (never equal to 6)."""
    pick = rng.randrange(14 if depth < 3 else 8)
    if pick == 0:
        n, box = rng.choice([900, 985, 986, 987, 1000, 3000, 50_000]), rng.choice("[({")
        close = {"[": "]", "(": ",)", "{": "}"}[box]
        wrap = "{'k': v}" if box == "{" else f"{box}v{close}"
        return f"(lambda: [v := 7] and [v := {wrap} for _ in range({n})] and v)()"
    if pick == 1:
        return rng.choice(["10 ** 100_000", "-(7 ** 20_000)", "2 ** 64 + 1"])
    if pick == 2:
        return rng.choice(["'x' * 10 ** 6", "'6' * 3", "'\\udcff' * 9", "b'\\x00' * 99"])
    if pick == 3:
        return rng.choice(["float('nan')", "float('inf')", "-0.0", "5.999999999", "6 + 1e-9j"])
    if pick == 4:
        return "(lambda l: (l.append(l), l)[1])([])"  # a list that holds itself
    if pick == 5:
        return "type('E', (), {'__eq__': lambda s, o: True, '__hash__': lambda s: 0})()"
    if pick == 6:
        return "type('I', (int,), {'__eq__': lambda s, o: True})(7)"
    if pick == 7:
        return rng.choice(["None", "...", "NotImplemented", "iter([6])", "(x for x in [6])"])
    items = ", ".join(_value(rng, depth + 1) for _ in range(rng.randrange(1, 4)))
    return rng.choice([f"[{items}]", f"({items},)", f"{{'a': [{items}]}}", f"{{{items}}}"])


def _behaviour(rng: random.Random) -> str:
    """Source of something hostile a program does (to itself only) before it returns."""
    sig = rng.choice([1, 2, 3, 6, 9, 10, 11, 13, 14, 15, 24, 25, 31, 32, 34, 35, 40, 50, 64])
    fd = rng.choice([0, 2, *range(3, 12)])  # not stdout: "6" there would be the answer
    forged = rng.choice(["D", "V 6", "R 6", "6", "E AssertionError", "D\\nD", "\\x00" * 3])
    return rng.choice(
        [
            f"import os; os.kill(os.getpid(), {sig})",
            f"import os; os.killpg(0, {sig})",
            f"import os; os._exit({rng.randrange(-5, 300)})",
            f"raise SystemExit({rng.choice(['None', '0', '6', repr('6'), 'object()'])})",
            f"import os\ntry:\n    os.write({fd}, b'{forged}\\n')\nexcept OSError:\n    pass",
            "import os\nfor fd in range(3, 40):\n    try:\n        os.write(fd, b'D\\n')\n"
            "    except OSError:\n        pass",
            "import os; os.write(1, bytes(range(256)) * 64)",
            "import sys; sys.stderr.write('e' * 10 ** 6)",
            "import os; os.close(1)",
            "def r(n):\n    return r(n + 1)\nr(0)",
            "class B(Exception):\n    def __str__(self):\n        raise RecursionError()\n"
            "raise B()",
            f"raise ValueError('m' * {rng.choice([10, 10**5, 10**6])})",
            "import sys; sys.setrecursionlimit(10 ** 6)",
            "import builtins; builtins.print = lambda *a, **k: None",
            "import os, ctypes, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        ctypes.CDLL(None).prctl(15, b'{TAG}', 0, 0, 0)\n        time.sleep(60)\n"
            "    os._exit(0)",
            "import threading, time\nfor _ in range(6):\n"
            "    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()",
            "while True:\n    pass" if rng.random() < 0.3 else "pass",
            "pass",
        ]
    )


def _program(rng: random.Random, kind: str) -> str:
    """A completion: a hostile solution in one of the forms a model writes."""
    when = rng.choice(["top", "call", "both"])
    body = _behaviour(rng)
    top = body if when in ("top", "both") else ""
    inner = "\n".join("    " + ln for ln in (body if when != "top" else "pass").splitlines())
    if kind == "stdin":
        code = f"{top}\ndef main():\n{inner}\n    print({_value(rng)})\nmain()\n"
    else:
        code = f"{top}\ndef mul(a, b):\n{inner}\n    return {_value(rng)}\n"
    if kind == "call" and rng.random() < 0.3:
        code += "class Solution:\n    def mul(self, a, b):\n        return mul(a, b)\n"
    wrap = rng.randrange(4)
    if wrap == 0:
        return f"```python\n{code}```"
    if wrap == 1:
        return f"<think>```python\nprint(6)\n```</think>\nSure.\n```py\n{code}"  # unclosed fence
    if wrap == 2:
        return f"Here it is:\n```\n{code}\n```\nand ```python\n{code}\n```"
    return code


@pytest.mark.skipif(os.name != "posix", reason="the sandbox needs POSIX")
def test_hostile_programs_in_every_kind_and_mode():
    if not MODES:
        pytest.skip("no isolation mode works here")
    rng = random.Random(29)
    kinds = list(SPECS)
    cases = []
    for i in range(CASES):
        kind, mode = kinds[i % len(kinds)], MODES[(i // len(kinds)) % len(MODES)]
        spec = dict(SPECS[kind], time_s=0.5)
        cases.append((kind, mode, _program(rng, kind), json.dumps(spec)))
    errors.take()
    counts, statuses, forged = Counter(), Counter(), []
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda c: code_grader.grade_code(c[2], c[3], mode=c[1]), cases))
    for (kind, mode, completion, _), out in zip(cases, outs):
        counts[kind, mode] += 1
        for r in out["results"]:
            statuses[r["status"]] += 1
            assert r["isolation"] == mode and len(r["reason"]) <= 320
        assert len(out["reason"]) <= 320, out["reason"][:400]
        passed = any(r["status"] == "passed" for r in out["results"])
        if kind != "script" and (out["reward"] != 0.0 or passed):
            forged.append((kind, mode, completion))
    deadline = time.monotonic() + 3
    while alive(TAG) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(TAG)
    for pid in left:
        os.kill(pid, 9)
    failures = errors.take()
    print(f"\nfuzz: {sum(counts.values())} programs, {dict(sorted(counts.items()))}")
    print(f"fuzz: test statuses {dict(statuses)}; grader errors {failures}; left running {left}")
    assert not forged, forged[:3]
    assert not left, f"{len(left)} daemons outlived their tests"
    assert not failures, failures


def _answer(rng: random.Random) -> str:
    parts = [
        "\\boxed{" * rng.randrange(1, 3000),
        "}" * rng.randrange(0, 50),
        "{" * 5000 + "1" + "}" * 5000,
        "10^{10^{10}}",
        "9^9^9^9",
        "1e999999",
        "1" * 5000,
        "(" * 2000,
        "\\frac{1}{0}",
        "0/0",
        "\\sqrt{-1}",
        "x = y = z = 3",
        "3 \\lor 6",
        "6 \\text{ or maybe } 3",
        "1 = 6",
        "\\pm 6",
        "0.0000006",
        "6!!!!!!",
        "(10^5)!",
        "\\begin{pmatrix}" * 50,
        "<think>",
        "</think>",
        "\x00\udcff\u2212",
        "####",
        "The answer is",
        "\\text{" * 300,
        "6.000000000001",
        "5.9999999999",
        "[1, 6)",
        "\\{6, 6, 6\\}",
    ]
    return "".join(rng.choice(parts) for _ in range(rng.randrange(1, 6)))


def test_hostile_math_answers_never_raise():
    rng = random.Random(29)
    errors.take()
    scores = Counter()
    for _ in range(300):
        completion, gold = _answer(rng), rng.choice(["6", "3", "0", "\\frac{1}{2}", "(1, 6)"])
        reward = math_reward(completion, gold)
        assert reward in (0.0, 1.0)
        scores[reward] += 1
    hedges = ["\\boxed{3 \\lor 6}", "\\boxed{6 \\text{ or maybe } 3}", "\\boxed{1 = 6}"]
    assert [math_reward(c, "6") for c in hedges] == [0.0, 0.0, 0.0]
    failures = errors.take()
    print(f"\nfuzz: 300 math answers, rewards {dict(scores)}; grader errors {failures}")
    assert not failures, failures
