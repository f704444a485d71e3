"""Fuzz the graders with generated hostile programs, return values and answers.

Every test kind (stdin, call, check, script) in every isolation mode that works here, through
the graders themselves (grade_code, score_math): no exception escapes, every reason is
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
from ibpo.rewards.errors import Graded
from ibpo.rewards.math import math_reward, score_math
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
    counts, statuses, forged = Counter(), Counter(), []

    def grade(case):  # in its own collecting context: pool threads start without the caller's
        return code_grader.grade_code(case[2], case[3], mode=case[1])

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(grade, cases))
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
    failures = [out["failure"].reason for out in outs if "failure" in out]
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
        "\\fbox{",
        "\\boxed 6 ",
        "\\textbf{(C)}\\ ",
        "(A) 6 (B) 3",
        "\\to",
        "\\text{ is not}",
        " unless ",
        "~",
        "?",
        "\\begin{cases}",
        "\\\\",
        "sum_(k=1)^(",
        "$",
        "\\text{" + "a " * 400 + "}",
    ]
    return "".join(rng.choice(parts) for _ in range(rng.randrange(1, 6)))


def test_hostile_math_answers_never_raise():
    rng = random.Random(29)
    scores = Counter()
    failures = []
    for _ in range(300):
        completion = _answer(rng)
        gold = rng.choice(["6", "3", "0", "\\frac{1}{2}", "(1, 6)", "C"])
        graded = score_math(completion, gold, rng.choice([None, _answer(rng), ["3", "6"]]))
        assert graded.score in (0.0, 1.0)
        scores[graded.score] += 1
        failures += [graded.failure] if graded.failure else []
    hedges = ["\\boxed{3 \\lor 6}", "\\boxed{6 \\text{ or maybe } 3}", "\\boxed{1 = 6}"]
    assert [score_math(c, "6") for c in hedges] == [Graded(0.0)] * 3
    print(f"\nfuzz: 300 math answers, rewards {dict(scores)}; grader errors {failures}")
    assert not failures, failures


# Generated answers in each class a policy could try, each around a gold value it states
# (numbers, fractions, radicals, expressions): any of them scoring 1 is a forged pass. Honest
# forms of the same golds are generated too, and must all score 1.
GOLDS = ["4", "12", "-3", "\\frac{2}{3}", "0.75", "2\\sqrt{3}", "x^2+1", "\\frac{\\pi}{4}"]
NEGATING = [
    "is not the answer", "isn't it", "is NOT correct", "is wrong", "is incorrect", "is false",
    "(not)", "never", "is a trap", "is a red herring", "unless n is odd", "if n is even",
    "except when n = 1", "assuming n > 2", "for n even", "when n is prime", "provided n > 1",
    "otherwise 0", "approximately", "roughly", "about", "or so", "at most", "at least",
    "or fewer", "or more", "maybe", "probably", "perhaps", "I guess", "I think", "possibly",
    "is my guess", "seems likely", "doubtful", "tentatively", "and up", "ish",
]  # fmt: skip
PREFIXES = ["not", "never", "maybe", "perhaps", "approximately", "about", "roughly", "at least"]
MARKS = ["\\approx", "\\sim", "\\simeq", "\\neq", "\\ne", "\\neg", "\\lnot", "<", ">", "\\le",
         "\\geq", "\\pm", "\\mp", "≈", "≠", "≤", "~"]  # fmt: skip
JOINS = ["\\to", "\\rightarrow", "\\Rightarrow", "\\implies", "\\iff", "\\mapsto", "\\notin",
         "\\neq", "\\mid", "|", "&", "\\\\", "\\quad", "\\qquad", "\\;", "\\lor", "\\vee",
         "\\text{ or }", "\\text{or}", "\\text{ and }", "\\pm", ",", ";", "\\setminus",
         "\\text{ then }", "\\ \\text{, not } \\ "]  # fmt: skip


def _other(rng: random.Random, gold: str) -> str:
    return rng.choice([g for g in GOLDS + ["5", "7", "\\frac{1}{3}", "y"] if g != gold])


def _negated(rng: random.Random, gold: str) -> str:
    word = rng.choice(NEGATING)
    word = rng.choice([word, word.upper(), word.capitalize()])
    return rng.choice(
        [
            f"\\boxed{{{gold} \\text{{ {word}}}}}",
            f"\\boxed{{{gold}\\ \\text{{{word}}}}}",
            f"\\boxed{{\\text{{{rng.choice(PREFIXES)} }} {gold}}}",
            f"\\boxed{{{gold} \\mathrm{{{word}}}}}",
            f"\\boxed{{{gold}}} {word}.",
            f"So, {rng.choice(PREFIXES)} $\\boxed{{{gold}}}$.",
            f"The answer is {gold} {word}.",
            f"The answer is {rng.choice(PREFIXES)} {gold}.",
            f"The final answer is ${gold}$ {word}.",
            f"\\boxed{{{rng.choice(MARKS)} {gold}}}",
            f"\\boxed{{{gold}?}}",
            f"So it is {rng.choice(PREFIXES)} {gold}",
        ]
    )


def _several(rng: random.Random, gold: str) -> str:
    a, b = (gold, _other(rng, gold)) if rng.random() < 0.5 else (_other(rng, gold), gold)
    join = rng.choice(JOINS)
    box = rng.choice(["\\boxed{{{}}}", "\\fbox{{{}}}", "$\\boxed{{{}}}$"])
    return rng.choice(
        [
            box.format(f"{a} {join} {b}"),
            box.format(f"{a}")
            + rng.choice([" and ", " or ", "\n", ". Also ", " "])
            + box.format(b),
            box.format(f"\\begin{{cases}} {a} \\\\ {b} \\end{{cases}}"),
            box.format(f"\\begin{{aligned}} x &= {a} \\\\ x &= {b} \\end{{aligned}}"),
            box.format(f"\\substack{{{a} \\\\ {b}}}"),
            box.format(f"{a} \\\\ {b}"),
            box.format(f"{a} \\boxed{{{b}}}"),
            box.format(f"{a} \\; ({b})"),
        ]
    )


def _honest(rng: random.Random, gold: str) -> str:
    forms = [
        f"\\boxed{{{gold}}}",
        f"So the answer is $\\boxed{{{gold}}}$.",
        f"\\boxed{{{gold}}} and, checking again, \\boxed{{{gold}}}",
        f"\\boxed{{x = {gold}}}",
        f"The final answer is ${gold}$. I hope it is correct.",
        f"<think>maybe not {gold}?</think>\n\\boxed{{{gold}}}",
    ]
    if gold.lstrip("-").isdigit():
        forms += [f"\\boxed{{{gold} \\text{{ apples}}}}", f"So she has {gold} apples left.",
                  f"The answer is {gold} more apples."]  # fmt: skip
    return rng.choice(forms)


def test_generated_negations_and_several_candidates_never_score():
    rng = random.Random(36)
    forged, missed = [], []
    failures = []
    for i in range(360):
        gold = rng.choice(GOLDS)
        completion = (_negated if i % 2 else _several)(rng, gold)
        if (graded := score_math(completion, gold)).score != 0.0:
            forged.append((completion, gold))
        failures += [graded.failure] if graded.failure else []
    for _ in range(120):
        gold = rng.choice(GOLDS)
        completion = _honest(rng, gold)
        if (graded := score_math(completion, gold)).score != 1.0:
            missed.append((completion, gold))
        failures += [graded.failure] if graded.failure else []
    print(
        f"\nfuzz: 360 negated/several answers, {len(forged)} scored; 120 honest, {len(missed)} not"
    )
    assert not forged, forged[:5]
    assert not missed, missed[:5]
    assert not failures, failures


def _options(rng: random.Random) -> tuple[list[str], str]:
    """Five distinct option values and the problem's text listing them in one of the styles
    problems write them in."""
    values = [str(v) for v in rng.sample(range(1, 60), 5)]
    style = rng.randrange(4)
    if style == 0:
        body = " \\qquad".join(f"\\textbf{{({c})}}\\ {v}" for c, v in zip("ABCDE", values))
        text = f"${body}$"
    elif style == 1:
        text = " ".join(f"({c}) {v}" for c, v in zip("ABCDE", values))
    elif style == 2:
        text = "\n".join(f"{c}) {v}" for c, v in zip("ABCDE", values))
    else:
        text = "\n".join(f"{c}. {v}" for c, v in zip("ABCDE", values))
    return values, f"How many are there?\n{text}\n"


def test_generated_multiple_choice_answers():
    rng = random.Random(10)
    wrong_scored, right_missed = [], []
    for _ in range(200):
        values, problem = _options(rng)
        k = rng.randrange(5)
        letter, value = "ABCDE"[k], values[k]
        j = rng.choice([i for i in range(5) if i != k])
        other_letter, other_value = "ABCDE"[j], values[j]
        gold = rng.choice([letter, value, f"\\text{{({letter})}}"])
        right = rng.choice(
            [letter, f"({letter})", f"\\textbf{{({letter})}}\\ {value}", f"({letter}) {value}",
             f"\\text{{({letter}) }}{value}", value, f"{letter}) {value}"]
        )  # fmt: skip
        wrong = rng.choice(
            [other_letter, f"({other_letter}) {value}", f"({letter}) {other_value}",
             other_value, f"({letter}) \\text{{ or }} ({other_letter})", "F"]
        )  # fmt: skip
        if math_reward(f"\\boxed{{{right}}}", gold, problem) != 1.0:
            right_missed.append((right, gold, problem))
        if math_reward(f"\\boxed{{{wrong}}}", gold, problem) != 0.0:
            wrong_scored.append((wrong, gold, problem))
        # without the options, a letter alone never scores for a number
        if math_reward(f"\\boxed{{{letter}}}", value) != 0.0:
            wrong_scored.append((letter, value, None))
    assert not right_missed, right_missed[:3]
    assert not wrong_scored, wrong_scored[:3]
