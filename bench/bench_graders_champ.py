r"""Check the math grader on the gold answers of CHAMP (270 competition problems, MIT licence).

    pip install champ-dataset   # a measurement aid only, not a dependency of ibpo
    python bench/bench_graders_champ.py [-v]

Three counts over the gold answers:
  self       `\boxed{gold}` against the gold: must be accepted;
  wrong      two perturbations that must be rejected: the next problem's gold (the first after it
             whose numbers differ: "0" is not wrong for "0 is the only possible value"), and the
             gold with its last integer plus one
             (`2^(n-1)` -> `2^(n-2)`; golds without a digit are left out);
  rewritten  equivalent LaTeX of the golds that are a formula or number alone (`a/b` ->
             `\frac{a}{b}`, `sqrt(x)` -> `\sqrt{x}`, `^(e)` -> `^{e}`, `*` -> `\cdot`, `floor(x)`
             -> `{\lfloor x \rfloor}`, `...` -> `\ldots`) inside a sentence: must be accepted.
With -v, each failure is printed.
"""

from __future__ import annotations

import re
import sys

_LATEX = [
    (r"sqrt\(([^()]*)\)", r"\\sqrt{\1}"),
    (r"floor\(([^()]*)\)", r"{\\lfloor \1 \\rfloor}"),
    (r"\^\(([^()]*)\)", r"^{\1}"),
    (r"(?<![\w)])(\w+)/(\w+)(?![\w(])", r"\\frac{\1}{\2}"),
    (r"\*", r" \\cdot "),
    (r"\.\.\.", r"\\ldots"),
]


def _latex(gold: str) -> str:
    for pattern, repl in _LATEX:
        gold = re.sub(pattern, repl, gold)
    return gold


def _bump_last_integer(gold: str) -> str | None:
    nums = list(re.finditer(r"\d+", gold))
    if not nums:
        return None
    m = nums[-1]
    return gold[: m.start()] + str(int(m.group()) + 1) + gold[m.end() :]


def main() -> int:
    try:
        import champ_dataset
    except ImportError:
        print("skipped: champ-dataset is not installed (pip install champ-dataset)")
        return 0
    from ibpo.rewards.math import math_reward

    verbose = "-v" in sys.argv
    problems = list(champ_dataset.load("v0").problems.values())
    golds = [p.answer for p in problems]

    def count(label: str, pairs: list[tuple[str, str]], want: float) -> None:
        bad = [(c, g) for c, g in pairs if math_reward(c, g) != want]
        print(f"{label}: {len(pairs) - len(bad)}/{len(pairs)}")
        for c, g in bad if verbose else ():
            print(f"    {c!r} vs gold {g!r}")

    count("self accepted", [(f"\\boxed{{{g}}}", g) for g in golds], 1.0)
    others = []
    for i, g in enumerate(golds):
        digits = re.findall(r"\d+", g)
        other = next(h for h in golds[i + 1 :] + golds[:i] if re.findall(r"\d+", h) != digits)
        others.append((f"\\boxed{{{other}}}", g))
    count("other problem's gold rejected", others, 0.0)
    bumped = [(f"\\boxed{{{b}}}", g) for g in golds if (b := _bump_last_integer(g))]
    count("last integer + 1 rejected", bumped, 0.0)
    # Golds that are one formula or number alone (the dataset marks formulas with @@...@@).
    formulas = [
        p.answer
        for p in problems
        if re.fullmatch(r"@@[^@]*@@|-?\d+", p.raw_answer) and _latex(p.answer) != p.answer
    ]
    rewritten = [(f"So the answer is $\\boxed{{{_latex(g)}}}$.", g) for g in formulas]
    count("equivalent LaTeX accepted", rewritten, 1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
