"""Hostile classes against the graders, each tested as the mechanism that lets a family through:

* signals across the check harness: an exception a solution raises must never steer the trusted
  check's own iteration (a StopIteration inside `map()` ends `all(...)` as if every answer were
  right). Every built-in exception class is raised against checks built with all, any, map,
  filter, zip, next, iter(f, sentinel), sum, sorted, generators and comprehensions;
* one number for many golds: an answer equals at most one gold of a kind (integers near it,
  decimals at its written precision, fractions of small denominators, multiple-choice options),
  whatever its magnitude, noise digits or form; and a chain of equalities states every value
  it holds.
"""

from __future__ import annotations

import builtins
import random
from fractions import Fraction

import pytest

from ibpo.rewards.math import answers_match, math_reward
from ibpo.sandbox.cases import Limits, TestCase
from ibpo.sandbox.run import run_tests
from tests.conftest import sandbox_modes

MODES = sandbox_modes()
EXCEPTIONS = sorted(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)

# Each pattern is a check that holds for the right answers: candidate(name, a) == a * 2 for
# `two`, == False for `zero` (a solution that never finds anything). Given a candidate that
# raises, a pattern must raise too, never return True.
PATTERNS = r"""
XS = [1, 2, 3]
PATTERNS = [
    lambda c: all(map(lambda a: c(a) == a * 2, XS)),
    lambda c: not any(map(lambda a: c(a) != a * 2, XS)),
    lambda c: all(c(a) == a * 2 for a in XS),
    lambda c: [c(a) for a in XS] == [2, 4, 6],
    lambda c: list(map(c, XS)) == [2, 4, 6],
    lambda c: list(filter(lambda a: c(a) != a * 2, XS)) == [],
    lambda c: next(filter(lambda a: c(a) != a * 2, XS), None) is None,
    lambda c: all(x * 2 == y for x, y in zip(XS, map(c, XS))),
    lambda c: sum(map(c, XS)) == 12,
    lambda c: sorted(XS, key=c) == [1, 2, 3],
    lambda c: list(iter(lambda: c(0), 0)) == [],
    lambda c: {a: c(a) for a in XS} == {1: 2, 2: 4, 3: 6},
    lambda c: min(map(c, XS)) == 2 and max(map(c, XS)) == 6,
]
"""
META_CHECK = (
    PATTERNS
    + "NAMES = "
    + repr(EXCEPTIONS)
    + r"""
def check(candidate):
    forged = []
    for name in NAMES:
        for i, pattern in enumerate(PATTERNS):
            try:
                if pattern(lambda a, name=name: candidate(name, a)):
                    forged.append((name, i))
            except BaseException:
                pass  # the solution's exception reached the check: not a pass
    assert forged == [], forged
    for i, pattern in enumerate(PATTERNS):  # the patterns hold for a right answer
        assert pattern(lambda a: candidate("", a)), i
"""
)
RAISER = (
    "import builtins\n"
    "def double(name, a):\n"
    "    if not name:\n"
    "        return a * 2\n"
    "    cls = getattr(builtins, name)\n"
    "    try:\n"
    "        error = cls('boom')\n"
    "    except Exception:\n"
    "        error = cls.__new__(cls)\n"
    "    raise error\n"
)


@pytest.mark.parametrize("mode", MODES)
def test_no_exception_a_solution_raises_steers_the_check(mode):
    """One sandboxed check runs every pattern against a solution raising each built-in exception
    class: the check itself asserts that none of them held (and that all hold for the right
    answers), so its pass is the claim."""
    case = TestCase("check", META_CHECK, fn_name="double")
    r = run_tests(RAISER, [case], Limits(time_s=20), mode=mode)[0]
    assert r.status == "passed", r.reason


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "harness",
    [
        "def check(candidate):\n    assert all(map(lambda a: candidate(a) == a + 1, [1, 2]))\n",
        "def check(candidate):\n    assert not any(map(candidate, [1, 2]))\n",
        "def check(candidate):\n    assert list(iter(lambda: candidate(0), 5)) == [1, 2]\n",
    ],
)
def test_a_stop_iteration_is_no_pass(mode, harness):
    code = "def f(a):\n    raise StopIteration\n"
    r = run_tests(code, [TestCase("check", harness, fn_name="f")], Limits(time_s=5), mode=mode)[0]
    assert r.status != "passed"
    assert "StopIteration" in r.reason


def test_a_solution_s_exception_class_still_reaches_the_check():
    """A check may test for the class a solution raises: ValueError, KeyError, IndexError..."""
    harness = (
        "def check(candidate):\n"
        "    for name in ('ValueError', 'KeyError', 'IndexError', 'ZeroDivisionError'):\n"
        "        try:\n"
        "            candidate(name, 1)\n"
        "        except getattr(__import__('builtins'), name):\n"
        "            pass\n"
        "        else:\n"
        "            assert False, name\n"
    )
    r = run_tests(RAISER, [TestCase("check", harness, fn_name="double")], Limits(time_s=5))[0]
    assert r.status == "passed", r.reason


# --- one number for many golds ------------------------------------------------------------


def _neighbours(value: Fraction, written: str) -> dict[str, set[str]]:
    """Golds an answer near `value` could be taken for, by kind: integers around it, decimals at
    its written precision around it, and fractions of denominators up to 12 near it."""
    kinds = {"integer": {str(int(value) + k) for k in range(-3, 4)}, "decimal": set()}
    if "." in written:
        places = len(written) - written.index(".") - 1
        for k in range(-3, 4):
            x = value + k * Fraction(1, 10**places)
            whole, part = divmod(x.numerator * 10**places // x.denominator, 10**places)
            kinds["decimal"].add(f"{whole}.{part:0{places}d}")
    kinds["fraction"] = {
        f"\\frac{{{round(value * q) + d}}}{{{q}}}" for q in range(2, 13) for d in (-1, 0, 1)
    }
    return kinds


def _same_value(a: str, b: str) -> bool:
    """Whether two golds are one value (both read exactly)."""
    from ibpo.rewards.math import _as_number, _normalize

    x, y = _as_number(_normalize(a)), _as_number(_normalize(b))
    return x is not None and x == y


def _answers(rng: random.Random) -> list[str]:
    out = ["1000000000000.5", "500000000.5", "123456789.5", "0.30000000000000004", "1e-13"]
    out += ["999999999999.9999999", "2.0000000000000004", "0.333333", "0.142857", "3.1415927"]
    for _ in range(60):
        magnitude = 10 ** rng.randint(0, 14)
        whole = rng.randint(0, 9) * magnitude + rng.randint(0, magnitude)
        digits = rng.choice([1, 2, 6, 9, 17])
        frac = "".join(rng.choice("0123456789") for _ in range(digits))
        out.append(f"{whole}.{frac}")
    return out


def test_an_answer_equals_at_most_one_gold_of_a_kind():
    rng = random.Random(47)
    for answer in _answers(rng):
        value = Fraction(answer) if "e" not in answer else Fraction(float(answer))
        for kind, golds in _neighbours(value, answer).items():
            distinct = []
            for g in sorted(golds):
                if answers_match(answer, g) and not any(_same_value(g, h) for h in distinct):
                    distinct.append(g)
            assert len(distinct) <= 1, (answer, kind, distinct)


@pytest.mark.parametrize("answer", ["1000000000000.5", "500000000.5", "7.5"])
def test_a_half_integer_scores_for_neither_neighbour_nor_their_letters(answer):
    low = int(Fraction(answer))
    for gold in (str(low), str(low + 1)):
        assert math_reward(f"The answer is \\boxed{{{answer}}}.", gold) == 0.0
    options = {"A": str(low), "B": str(low + 1), "C": "2", "D": "3"}
    for letter in ("A", "B"):
        assert math_reward(f"\\boxed{{{answer}}}", letter, options) == 0.0
    assert math_reward(f"\\boxed{{{low}}}", "A", options) == 1.0  # the honest answer


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("0.30000000000000004", "0.3", True),  # a float's printout
        ("11.999999999999998", "12", True),
        ("0.333333", "\\frac{1}{3}", False),  # a fraction is exact
        ("0.0123457", "\\frac{1}{81}", False),
        ("3.1415927", "3.14159", True),  # a rounded gold
        ("0.3", "\\frac{1}{3}", False),
        ("0.3333334", "0.333333", True),  # more exact than a rounded gold, rounding to it
        ("0.3333336", "0.333333", False),
        ("1e-13", "0", False),
        ("12.5", "12", False),
    ],
)
def test_exact_and_rounded_numbers(answer, gold, expected):
    assert answers_match(answer, gold) is expected


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("x = 4 = 3", "3", False),
        ("x = 4 = 3", "4", False),
        ("x = 3 = 3", "3", True),
        ("x = 2 + 2 = 4", "4", True),
        ("y = 5 = 5 = 6", "6", False),
        ("x = 2 \\text{ or } x = 3", "2, 3", True),  # two statements, one value each
        ("x = 4 = 3, y = 1", "3", False),
    ],
)
def test_a_chain_of_equalities_states_every_value_it_holds(answer, gold, expected):
    assert math_reward(f"\\boxed{{{answer}}}", gold) == float(expected)


# --- the trainer's own time ----------------------------------------------------------------


def _unbox_as_before(content: str) -> str:
    """The peeling loop a box's content went through before (one brace scan per layer)."""
    from ibpo.rewards.math import _BOX, _closing_brace

    s = _BOX.sub("", content).strip()
    while s.startswith("{") and _closing_brace(s, 0) == len(s) - 1:
        s = s[1:-1].strip()
    return s


def test_unboxing_peels_in_one_pass_what_the_layer_by_layer_loop_peeled():
    from ibpo.rewards.math import _unbox

    rng = random.Random(6)
    for _ in range(3000):
        s = "".join(rng.choice("{{}} 4x\\") for _ in range(rng.randint(0, 14)))
        assert _unbox(s) == _unbox_as_before(s), s
    deep = "{" * 20000 + " 4 " + "}" * 20000  # 40 KB: each layer rescanned would be 4e8 steps
    assert _unbox(deep) == "4"
    assert math_reward("\\boxed{" + deep + "}", "4") == 1.0


# --- what qualifies an answer, and what is a remark about something else ---------------------

OPTIONS = {"A": "1", "B": "2", "C": "3", "D": "4"}


@pytest.mark.parametrize(
    "completion, gold, options",
    [
        (r"\boxed{\frac{1}{4}}, or 25%", r"\frac{1}{4}", None),  # the same value again
        (r"\boxed{0.5}, i.e. \frac{1}{2}", "0.5", None),
        (r"\boxed{4}, not 5", "4", None),  # another value rejected
        (r"\boxed{12} apples, which is more than 10", "12", None),  # a comparison
        (r"\boxed{2} hours, not minutes", "2", None),  # another unit rejected
        (r"\boxed{\text{Option C}}", "C", OPTIONS),
        (r"The correct option is **(C)**.", "C", OPTIONS),
        (r"\boxed{c}", "C", OPTIONS),
        (r"\boxed{(c)}", "C", OPTIONS),
        (r"\boxed{\sum_{k=1}^n \frac{1}{k}}", "sum_(k=1)^n1/k", None),  # CHAMP's spelling
        ("I think the answer is 4.", "4", None),  # the clause's lead, as before
    ],
)
def test_honest_answers_with_a_remark_score(completion, gold, options):
    assert math_reward(completion, gold, options) == 1.0


ZERO_WIDTH = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad"]
LOOKALIKE_O = ["\u043e", "\u03bf", "\uff4f"]  # Cyrillic, Greek, full-width o


@pytest.mark.parametrize(
    "template",
    [
        r"\boxed{{4}} is {neg} the answer",
        r"The answer is {neg} \boxed{{4}}",
        r"\boxed{{4 \text{{ is {neg} it}}}}",
    ],
)
def test_a_negation_hidden_by_invisible_or_lookalike_characters_still_negates(template):
    for zw in ZERO_WIDTH:
        assert math_reward(template.format(neg=f"n{zw}ot"), "4") == 0.0, repr(zw)
    for o in LOOKALIKE_O:
        assert math_reward(template.format(neg=f"n{o}t"), "4") == 0.0, repr(o)
    assert math_reward(template.format(neg="not"), "4") == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        r"\boxed{4}. Wait, that is wrong.",
        "\\boxed{4}\nThat is incorrect.",
        r"\boxed{4}. No, the answer is something else.",
        r"\boxed{4}. Actually, that was a mistake.",
        r"\boxed{4}. Hmm, my answer is not right.",
        r"Definitely not: \boxed{4}",
        r"Maybe, I think the answer is \boxed{4}",
        r"It could be, perhaps, \boxed{4}",
        r"Perhaps, \boxed{4}",
        r"\boxed{4}, not 4",
        r"\boxed{4}, or 5",
        r"\boxed{4 \text{ nicht}}",
        r"\boxed{4 \text{ nein}}",
        r"\boxed{4 \text{ non}}",
        r"\boxed{4 \text{ pas}}",
        r"\boxed{4 \text{ нет}}",
        r"\boxed{4 \text{ 不是}}",
        r"\boxed{4 \text{ ない}}",
    ],
)
def test_retractions_colons_earlier_hedges_and_other_languages_do_not_score(completion):
    assert math_reward(completion, "4") == 0.0


@pytest.mark.parametrize(
    "retraction",
    ["Hmm, no.", "Is that right?", "But wait, that can't be right.", "I'm not sure about this.",
     "Wrong.", "Never mind.", "Hold on, let me redo this.", "Oops, I made a mistake."],
)  # fmt: skip
def test_a_retraction_in_any_later_sentence_zeroes_every_kind_of_answer(retraction):
    for joint in [". ", "\n\n", ". Let me check once more. "]:
        assert math_reward(f"\\boxed{{4}}{joint}{retraction}", "4") == 0.0, joint
    assert math_reward(f"The answer is 4. {retraction}", "4") == 0.0
    assert math_reward(f"So she has 4 apples. {retraction}", "4") == 0.0
    assert math_reward("The answer is 4. Let me check once more: 2 + 2 = 4.", "4") == 1.0
