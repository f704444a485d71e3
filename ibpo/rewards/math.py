r"""Math answer grading: extract the final answer, normalise it, compare it with the gold answer.

Extraction first: verifying a whole completion can match a restated expression ("9 + 7 = 26"
would count for 16). Qwen3 thinking is dropped (`<think>...</think>`; an unterminated `<think>`
to the end, so a completion cut off mid-thought has no answer; all before a lone `</think>`, for
templates that open the block in the prompt). Then the answer is what the `\boxed{...}`,
`\fbox{...}` or `\boxed 5` hold (an empty box is ignored; an unterminated one: no answer), when
they all hold one answer (repeated, or written two ways: `\frac{1}{2}` and `0.5`; a choice's
letter and its value): several different boxed answers are no answer, and so are more than
MAX_BOXES boxes. Else the last "answer is ..." / "Answer: ..." / "#### ..." (a `$...$` span or
the first sentence; a lone number in prose alone: "The answer is 12 apples" -> 12); else the
last number.

Negations, conditions and hedges (QUALIFIERS, by kind: negation, condition, hedge,
approximation, bound, wrongness, a sentence's own words, several values; and the marks
`\neq`, `\approx`, `<`, `\pm`, `?` ...): an answer holding a kind the gold answer does not
hold is no answer (`4 \text{ is not the answer}`, `4 \text{ unless } n \text{ is odd}`,
`\approx 4`, `\text{at least } 4`, `4?`, `4 \text{ is the answer}`), while units and labels
hold none (`4 \text{ apples}`, "7 square meters", "4 more", `x = 4`). Several values ("or",
"and", `\lor`, `\pm`) count only for a gold answer of one value (`x = 2 \text{ or } x = 3` for
`2, 3` scores). Prose next to an answer counts too: the last words of the clause before a box
or the final number and the rest of its sentence ("not \boxed{4}", "\boxed{4} if n is even",
"\boxed{4}, or maybe 5", "so it is not 12", "12?"), and an "answer is" sentence that
qualifies its number is kept whole ("The answer is not 4" is not 4). In prose only the words
that qualify there count (_PROSE_WORDS: "the answer would be 12 for the party" is 12).

Multiple choice: with the problem's options (`choices`: a dataset column or the problem's text,
choices_of), a letter stands for its option's value, so the letter, the value or both
(`\textbf{(C)}\ 12`, "(C) 12", `C`, `12`) score against a gold letter or value; a letter with
a value must agree with the options (`(B) 12` where (B) is 10 is wrong). Without the options a
letter matches the same letter, a letter with a value matches by its value, and a letter alone
is a symbol, which no number equals.

Normalisation (both sides) drops `$`, `\(\)`, `\[\]`, `\left`/`\right`, spacing (`\ `, while the
row break `\\` of a matrix or cases stays, `\\[2pt]` as `\\`), degrees, `\%`, dollar signs, a
whole `\text{...}`, trailing units (`\text{ cm}`, "5 dollars"; not "2 or x", "4 if n is even"), a
trailing period and a leading `x =`; `\dfrac`/`\tfrac` -> `\frac`; `\varnothing`, `\{\}`, `∅` ->
`\emptyset`; `\ldots`, `\cdots`, `...` -> `\dots`; ASCII `floor(x)`, `ceil(x)` ->
`\lfloor x\rfloor`, `\lceil x\rceil`; `1,000` / `1{,}000` -> 1000 (`1,2` stays a pair); `(B)` -> B.
Percent: the sign is a unit, so `50\%` equals 50 and not 0.5.

Comparison: an answer holding several values (a comma, or two numbers with only space
between them: `3 \quad 4`) for a gold answer of one is wrong; an equation counts only with a
variable on its left (`x = 2`, `AB = 5`, `x_1 = 4`), so `1 = 2` and `f(x) = 3` are wrong unless
the gold is an equation too.

Plain numbers (`12`, `0.5`, `1/2`, `\frac{1}{2}`, `1.5e3`, `6.02 \times 10^{23}`), and sets,
intervals and tuples of them, are compared in Python, exactly, with two readings that never let
one answer equal two golds written at one precision: against a gold of at most FLOAT_DIGITS
significant digits an answer's floating-point noise drops (`0.30000000000000004` is 0.3), and a
gold written as a decimal of at least ROUNDED_DIGITS significant digits (`3.14159`) takes an
answer that rounds to it. Integers and fractions are exact: `1000000.5` is not 1000000,
`0.0000004` and `1e-13` are not 0, `0.333333` is not `\frac{1}{3}`. Sets in any order, `[1,2)`
is not `[1,2]`. Identical strings match. Sympy
cannot tell what `\dots` stands for, so lists with an
ellipsis (`1, 3, 5, \dots`) are compared here, item by item in order, the ellipsis in the same
places, and any other answer with one as text only. Only the rest (radicals, matrices,
expressions, symbolic factorials such as `n \cdot (n-1)!`, ...) reaches sympy, through
math-verify. Its parser drops what it cannot read and keeps the rest (`3 \to 4`, `3 \\ 4`, a
`cases` or `aligned` row, `\substack`, `4 \; (n \neq 2)` read as 4, 4, the last row, 2), so
a match counts only when the parse kept the whole answer: each number, letter, symbol command
(`\pi`) and `\text{...}` of it appears in the parsed expression or changes it when replaced
(deleted), up to MAX_PROBES tries (_parse_holds_all). ASCII `sum_(k=1)^n` (CHAMP) is read as
`\sum_{k=1}^{n}`.

Time bound: math-verify's signal timeouts only work in the main thread, so they are off. Answers
over MAX_ANSWER_CHARS, power towers, exponents over MAX_EXPONENT, and factorials sympy would
evaluate to a huge number (`1001!`, `(10^5)!`, `3!!!`, `(n-n+999 \cdot 999)!`) are compared as
text only. The rest runs in a pool of worker processes over pipes, so any thread (or
daemonic pool process) may grade. Overrunning VERIFY_TIMEOUT_S counts as wrong and kills the
worker: a stuck sympy call (often C big-integer code) cannot be interrupted, and a thread could
not be stopped at all. The kernel also caps each comparison at WORKER_CPU_S of CPU, so nothing
burns on if this process dies. The price: a worker start (1-3 s, at the first sympy comparison
and after each kill) and a pipe round trip (well under 1 ms) per comparison. Verdicts are cached,
timeouts included, so a repeated pathological answer costs one kill. Where no worker can start
(non-POSIX, no subprocess), math-verify runs in-process behind the text guards, with a warning.

A failure of the grader itself (any exception) is no match, returned with the score
(score_math -> errors.Graded).

Not here: partial credit, tolerance beyond the rules above, unit conversion (5 m vs 500 cm), code
execution (sandbox), format rewards, dataset-specific gold parsing (data/rows.py).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
import unicodedata
from fractions import Fraction

from ibpo.rewards.errors import Graded, failed

# We turn math-verify's signal timeouts off on purpose (thread safety); silence its reminder.
logging.getLogger("math_verify").setLevel(logging.ERROR)
_log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 5.0  # wall clock for one math-verify comparison, then its worker is killed
WORKER_CPU_S = 10  # kernel limit on the CPU seconds of one comparison inside a worker
MAX_ANSWER_CHARS = 400  # longer answers are compared as text only
MAX_EXPONENT = 10_000  # a larger literal exponent is compared as text only
MAX_FACTORIAL = 1_000  # likewise n! for larger n
ROUNDED_DIGITS = 6  # a gold decimal with this many significant digits may be a number rounded
_MAX_WORKERS = 4  # concurrent comparisons; more threads wait for a free worker
_WORKER_MEMORY = 4 << 30  # address-space cap of a worker (bytes)

# ---------------------------------------------------------------------------- extraction
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_BOX_TOKEN = re.compile(r"[^\s$]+")
# Greedy `.*` so the last "answer is" of a line wins.
_ANSWER_LINE = re.compile(
    r"^.*(?:\b(?:answer|option|choice)\s*(?:is|:|=)|####)\s*:?(.*)$", re.I | re.M
)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_COEFFICIENT = re.compile(r"\d[A-Za-z](?![A-Za-z])")  # "3x" is not 3 (while "5cm" is 5)
# A minus after a word or bracket is subtraction ("9-7" ends in 7, not -7).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?|(?<![\w)\]])-?\.\d+"
)
# Around an answer in prose: the clause before it ends at a sentence or clause mark, the text
# after it at the end of its sentence ("\boxed{4}, or maybe 5" is hedged).
_CLAUSE_MARK = re.compile(r"[;:!?\n]|[.,](?:\s|$)")
_SENTENCE_MARK = re.compile(r"[;!?\n]|\.(?:\s|$)")
_CONTEXT_CHARS = 200  # how far around an answer its context is read
_WORDS_BEFORE = 2  # words of the clause before an answer that may qualify it ("maybe 4")
MAX_CANDIDATES = 8  # more different boxes than this: no answer, without comparing them
MAX_BOXES = 32  # more boxes than this (even all alike): no answer, read no further


def text_to_grade(prompt: str, completion: str) -> str:
    """The completion as graders must read it: with "<think>" in front when the prompt left a
    think block open (chat templates that start the model's thinking themselves), so that a
    completion cut off mid-thought holds no answer, as it would had the model opened the block."""
    if prompt.rfind("<think>") > prompt.rfind("</think>"):
        return "<think>" + completion
    return completion


def strip_thinking(text: str) -> str:
    text = _THINK.sub("", text)
    end = text.rfind("</think>")
    return text[end + len("</think>") :] if end >= 0 else text


def _closing_brace(text: str, i: int) -> int | None:
    """The index of the brace closing the one at text[i], or None when it is not closed."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _boxes(text: str) -> list[tuple[int, int, str]] | None:
    r"""(start, end, content) of every \boxed{...} / \fbox{...} / `\boxed 5`, in order; a box
    inside a box is part of its content. None when one is unterminated (cut off inside it).
    Linear in the text: the scan goes on after each box's end, and stops after MAX_BOXES + 1."""
    out, i = [], 0
    while len(out) <= MAX_BOXES and (m := _BOX.search(text, i)):
        j = m.end()
        if not text.startswith("{", j):
            token = _BOX_TOKEN.match(text, j)
            if token:
                out.append((m.start(), token.end(), token.group(0)))
            i = token.end() if token else j
            continue
        end = _closing_brace(text, j)
        if end is None:
            return None
        out.append((m.start(), end + 1, text[j + 1 : end].strip()))
        i = end + 1
    return out


def _unbox(content: str) -> str:
    r"""A box's content without boxes inside it: `\boxed{\boxed{4}}` is 4. Linear in the
    content: every brace is paired in one pass, then the pairs that wrap the whole text are
    peeled from the outside in (`{{ {4} }}` is 4)."""
    s = _BOX.sub("", content).strip()
    closing, stack = {}, []  # index of an opening brace -> index of its closing one
    for i, c in enumerate(s):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            closing[stack.pop()] = i
    lo, hi = 0, len(s) - 1
    while lo < hi and s[lo] == "{" and closing.get(lo) == hi:
        lo, hi = lo + 1, hi - 1
        while lo <= hi and s[lo].isspace():
            lo += 1
        while hi >= lo and s[hi].isspace():
            hi -= 1
    return s[lo : hi + 1]


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} / \fbox{...} (nested braces) or `\boxed 5`, else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    m = _BOX.match(text, start) if start >= 0 else None
    if m is None:
        return None
    i = m.end()
    if not text.startswith("{", i):
        token = _BOX_TOKEN.match(text, i)
        return token.group(0) if token else None
    end = _closing_brace(text, i)
    return None if end is None else text[i + 1 : end].strip()


def _context_qualifies(text: str, start: int, end: int, answer: str | None = None) -> bool:
    """Whether the prose around text[start:end] (an answer, `answer` its content) negates,
    conditions or hedges it:
    * before it, in its sentence: the last words of the clause that leads to it ("not",
      "maybe", "about"; a clause ending in a colon leads on: "Definitely not: 4"), and a hedge
      in the clause before that ("Maybe, I think the answer is 4");
    * after it, the rest of its sentence ("if n is even", "is wrong", "or 5", "?"), less the
      remarks about something else (_remarks: "or 25%" for 1/4, "not 5", "hours, not
      minutes", "which is more than 10");
    * the next sentence, when it takes the answer back ("Wait, that is wrong.")."""
    before = _scan_text(text[max(0, start - _CONTEXT_CHARS) : start])
    marks = list(_SENTENCE_MARK.finditer(before))
    clauses = [c for c in _CLAUSE_SPLIT.split(before[marks[-1].end() :] if marks else before)]
    clauses = [c for c in clauses if c.split()]  # the answer may follow a comma directly
    lead = " ".join(clauses[-1].split()[-_WORDS_BEFORE:]) if clauses else ""
    earlier = clauses[-2] if len(clauses) > 1 else ""
    if _qualifiers(lead, prose=True) or "hedge" in _qualifiers(earlier, prose=True):
        return True
    after = _scan_text(text[end : end + _CONTEXT_CHARS])
    stop = _SENTENCE_MARK.search(after)
    rest, following = (after[: stop.end()], after[stop.end() :]) if stop else (after, "")
    if _qualifiers(_remarks(rest, answer), prose=True):
        return True
    return _retracted(following)


def _retracted(text: str) -> bool:
    """Whether a sentence of `text` (what follows an answer's sentence, read up to
    _CONTEXT_CHARS x 2) takes the answer back."""
    text = _scan_text(text[: 2 * _CONTEXT_CHARS])
    start = 0
    for mark in [*_SENTENCE_MARK.finditer(text), None]:
        end = mark.end() if mark else len(text)
        if _RETRACTION.search(text[start:end]):
            return True
        start = end
    return False


# A clause ends at a comma or semicolon; a colon leads on to what follows it.
_CLAUSE_SPLIT = re.compile(r";|,(?:\s|$)")
# A sentence that takes the answer before it back.
_RETRACTION = re.compile(
    r"(?i)^\W*(?:(?:but\s+)?wait|no\b|nope|oops|hmm+|actually\b|scratch that|never\s*mind|"
    r"on second thought|not quite|correction|hold on|wrong\b|is (?:that|this|it) right)"
    r"|\b(?:i'?m|i am) not (?:sure|certain|confident)|\b(?:made|make) a mistake|\blet me redo"
    r"|\bcan'?t be right\b"
    r"|\b(?:that|this|it|which|the (?:above|answer|result)|my (?:answer|result))\s*"
    r"(?:'s|is|was|seems|looks|must be|might be)?\s*(?:not\s+(?:right|correct|true|it)|wrong|"
    r"incorrect|false|a mistake|mistaken|an error|off)\b"
)
# Remarks after an answer that are about something else: another form of the same value
# ("or 25%"), a value or unit the answer is not ("not 5", "not minutes"), a comparison of the
# answer with something ("which is more than 10").
_OTHER_FORM = re.compile(r"(?i),?\s*\b(?:or|i\.?e\.?|that is|equivalently)\s+\$?([^\s,;$]+)\$?")
_NOT_THIS = re.compile(r"(?i),?\s*\bnot\s+(?:an?\s+|the\s+)?\$?([^\s,;.!?$]+)\$?")
_COMPARISON = re.compile(
    r"(?i),?\s*\b(?:which|that|and that|this)\s+(?:is|are|was)\s+(?:much\s+|a lot\s+)?"
    r"(?:more|less|greater|fewer|smaller|larger|bigger|higher|lower)\s+than\s+\$?[^\s,;$]+\$?"
)
# What "not" may reject after an answer without rejecting it: nouns a value is counted in.
_UNIT_NOUNS = frozenset(
    "seconds second minutes minute hours hour days day weeks week months month years year "
    "meters meter metres metre centimeters centimetres cm mm km kilometers kilometres inches "
    "inch feet foot miles mile yards grams gram kg kilograms pounds ounces tons liters litres "
    "milliliters ml dollars dollar cents cent euros euro pounds degrees degree radians radian "
    "percent units unit squares square cubes cube points point people persons ways".split()
)


def _remarks(rest: str, answer: str | None) -> str:
    """`rest` (what follows an answer in its sentence) without the remarks about something
    else than the answer: "or X" / "i.e. X" where X is the answer's own value, "not X" where X
    is another value or a unit, "which is more than X". Without the answer, `rest` as it is."""
    if answer is None:
        return rest

    def same(x: str) -> bool:
        value = x.rstrip(".")
        if value.endswith("%") and (n := _as_number(value[:-1].rstrip("\\"))) is not None:
            value = str(n / 100)  # 25% as a value: 1/4
        return _answers_match(value, answer)

    def other_form(m: re.Match) -> str:
        return "" if same(m.group(1)) else m.group(0)

    def not_this(m: re.Match) -> str:
        x = m.group(1).rstrip(".").lower()
        unit = x in _UNIT_NOUNS
        other = _as_number(_normalize(x)) is not None and not same(x)
        return "" if unit or other else m.group(0)

    rest = _OTHER_FORM.sub(other_form, rest)
    rest = _NOT_THIS.sub(not_this, rest)
    return _COMPARISON.sub("", rest)


_MARKDOWN_EMPHASIS = re.compile(r"\*\*|__|(?<![\w\\])\*(?!\s)|(?<=\S)\*(?![\w])")


def _answer_span(span: str) -> str:
    """The answer part of what follows "answer is": a $...$ span or the first sentence. A
    sentence that qualifies its answer ("not 4", "4 if n is even") is kept whole."""
    span = _MARKDOWN_EMPHASIS.sub("", span).strip()  # "**(C)**": the option, not the stars
    delim = "$$" if span.startswith("$$") else "$" if span.startswith("$") else ""
    sentence = _SENTENCE_END.split(span, maxsplit=1)[0].strip()
    if delim and (close := span.find(delim, len(delim))) > 0:
        if _context_qualifies(span, 0, close + len(delim)):
            return sentence
        return span[: close + len(delim)]
    span = sentence
    if _qualifiers(span, prose=True) or _chosen(span):
        return span  # "not 4", "4 if n is even", "(C) 12": not just the number in it
    if not any(c in span for c in "\\^{}") and not _COEFFICIENT.search(span):
        nums = _NUMBER.findall(span)
        if len(nums) == 1:  # "12 apples", "x = 5"; several numbers may be a tuple: keep whole
            return nums[0]
    return span


def _final_answer(text: str, choices: dict | None) -> str | None:
    text = strip_thinking(text or "").replace("\u2212", "-")  # Unicode minus
    if "\\boxed" in text or "\\fbox" in text:
        boxes = _boxes(text)
        if boxes is None or len(boxes) > MAX_BOXES:
            return None  # cut off inside a box, or boxes by the dozen
        answer = _one_answer([a for _, _, c in boxes if (a := _unbox(c))], choices)
        if answer is None or any(_context_qualifies(text, s, e, answer) for s, e, _ in boxes):
            return None  # "\boxed{4} is not the answer"
        return answer
    for line in reversed(list(_ANSWER_LINE.finditer(text))):
        if ans := _answer_span(line.group(1).strip()):
            # taken back in a later sentence: "The answer is 4. Wait, that is wrong."
            rest = text[line.start(1) :]
            stop = _SENTENCE_MARK.search(rest)
            return None if stop and _retracted(rest[stop.end() :]) else ans
    nums = list(_NUMBER.finditer(text))
    if not nums or _context_qualifies(text, nums[-1].start(), nums[-1].end()):
        return None  # "so it is not 12", "12?"
    return nums[-1].group(0)


def _one_answer(answers: list[str], choices: dict | None) -> str | None:
    """The last of the boxed answers when all of them are one answer (the same one repeated,
    or written two ways: `\\frac{1}{2}` and `0.5`, a choice's letter and its value); None when
    they are several different answers (`\\boxed{3} ... \\boxed{4}`) or there is none."""
    if not answers:
        return None
    last, seen = answers[-1], {_squash(answers[-1])}
    others = []
    for a in answers[:-1]:
        if (key := _squash(a)) not in seen:
            seen.add(key)
            others.append(a)
            if len(others) >= MAX_CANDIDATES:
                return None
    # a failure comparing them is the grading's (score_math returns it), not a mismatch
    if all(_answers_match(a, last, choices) and _answers_match(last, a, choices) for a in others):
        return last
    return None


def extract_answer(text: str, choices=None) -> str | None:
    """The final answer of a completion (raw text, not normalised), or None when it gives none:
    no answer, an answer its own words negate, condition or hedge, or several different boxed
    answers. `choices`: the problem's options, as math_reward takes them (a letter and its
    value boxed apart are one answer). Never raises: a failure of the grader itself is logged
    (errors.failed) and is no answer."""
    try:
        return _final_answer(text, choices_of(choices))
    except Exception as e:
        failed("math", e)
        return None


# ---------------------------------------------------------------------------- normalisation
# A row break `\\` (with its optional spacing, `\\[2pt]`) is matched first and kept, so that
# the spacing command `\ ` cannot take its second backslash.
_DROP = re.compile(
    r"(\\\\)(?:\s*\[\s*-?[\d.]+\s*[a-z]{2}\s*\])?"
    r"|\\(?:left|right)(?![A-Za-z])|\\[,!;: ]|\\q?quad(?![A-Za-z])|\\displaystyle|~"
    r"|\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°|\\?%|\\?\$"
)
# One spelling for symbols LaTeX writes several ways, so that they match as text.
_ALIASES = [
    (re.compile(r"\\varnothing(?![A-Za-z])|∅|\\\{\s*\\\}"), r"\\emptyset"),
    (re.compile(r"\\[lc]?dots[cbmio]?(?![A-Za-z])|…|\.\.\.|\\cdot\s*\\cdot\s*\\cdot"), r"\\dots"),
]
# ASCII floor(x) / ceil(x), as gold answers write them, in LaTeX: what math-verify parses.
_ASCII_BRACKET = re.compile(r"(?<![A-Za-z\\])(floor|ceil)\s*\(")
_ASCII_LATEX = {"floor": ("\\lfloor ", "\\rfloor"), "ceil": ("\\lceil ", "\\rceil")}
# ASCII sums and products, as CHAMP writes them: `sum_(k=1)^n 1/k` -> `\sum_{k=1}^{n} 1/k`
# (math-verify reads the ASCII form as the number 1, whatever follows it).
# a bare upper limit is one letter or one number, as after LaTeX's ^: `^n1/k` is n, then 1/k
_ASCII_SUM = re.compile(
    r"(?<![A-Za-z\\])(sum|prod)_\(([^()]*)\)\^(\([^()]*\)|\{[^{}]*\}|\d+|[A-Za-z])"
)


def _ascii_sum(m: re.Match) -> str:
    top = m.group(3)
    top = top[1:-1] if top[0] in "({" else top
    return f"\\{m.group(1)}_{{{m.group(2)}}}^{{{top}}} "


_TEXT_ALL = re.compile(r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mbox)\{([^{}]*)\}")
_UNIT_TEXT = re.compile(
    r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?$"
)
_UNIT_WORDS = re.compile(r"(?<=\d)\s+([A-Za-z]{2,}(?:\s+[A-Za-z]+)*)\.?$")
_MATH_WORDS = {"pi", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "sqrt", "mod"}
# Words that join a second answer or a condition, so what follows is no unit: "2 or x" is not 2.
_MATH_WORDS |= {"or", "and", "nor", "not", "but", "if", "unless", "otherwise", "except"}
_ASSIGN = re.compile(
    r"^(?:[A-Za-z]{1,3}|\\[A-Za-z]+)(?:_(?:\{\w*\}|\w+))?\s*=\s*"
)  # x, AB, x_1, \alpha
_CANDIDATES = re.compile(r",|\\text\{[^{}]*\}|\\(?:lor|vee|quad)(?![A-Za-z])|\b(?:or|and)\b")
_RELATION = re.compile(r"(?<![<>!=])=(?!=)")  # an equation's "=", not "<=", "!=", "=="
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d{1,3}(?: \d{3})+")
_CHOICE = re.compile(r"\(?([A-J])\)?")
_FRAC_ALIAS = re.compile(r"\\[dt]frac(?![A-Za-z])")
_MATH_MODE = re.compile(r"\\\((.*)\\\)|\\\[(.*)\\\]", re.DOTALL)


def _ascii_brackets(s: str) -> str:
    r"""`floor(n/2)` -> `\lfloor n/2\rfloor` (likewise ceil); unbalanced ones are left alone."""
    while m := _ASCII_BRACKET.search(s):
        depth, end = 1, m.end()
        while depth and end < len(s):
            depth += {"(": 1, ")": -1}.get(s[end], 0)
            end += 1
        if depth:
            break
        left, right = _ASCII_LATEX[m.group(1)]
        if s[: m.start()].rstrip().endswith(("^", "_")):  # 2^floor(n/2): a braced exponent
            left, right = "{" + left, right + "}"
        s = s[: m.start()] + left + s[m.end() : end - 1] + right + s[end:]
    return s


def _normalize(s: str) -> str:
    s = s.strip().replace("\u2212", "-")
    if m := _MATH_MODE.fullmatch(s):  # \(...\) or \[...\]
        s = m.group(1) if m.group(1) is not None else m.group(2)
    s = _DROP.sub(lambda m: m.group(1) or "", s).replace("{,}", ",")
    for pattern, spelling in _ALIASES:
        s = pattern.sub(spelling, s)
    s = _ascii_brackets(s)
    s = _ASCII_SUM.sub(_ascii_sum, s)
    s = _FRAC_ALIAS.sub(r"\\frac", s).strip()
    if m := _TEXT_ALL.fullmatch(s):
        s = m.group(1).strip()
    s = _UNIT_TEXT.sub("", s)
    m = _UNIT_WORDS.search(s)
    if m and not set(m.group(1).lower().split()) & _MATH_WORDS:
        s = s[: m.start()]
    s = s.strip().rstrip(".").strip()
    if _outside_braces(s).count("=") == 1:  # not the "=" of \sum_{k=1}
        s = _ASSIGN.sub("", s, count=1)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "").replace(" ", "")
    if m := _CHOICE.fullmatch(s):
        s = m.group(1)
    return re.sub(r"^-\s+", "-", s)


# ---------------------------------------------------------------------------- qualifiers
# Words and marks that negate, condition, hedge or bound an answer, by kind. An answer holding a
# kind the gold answer does not hold is no answer: "4 \text{ is not the answer}", "4 if n is
# even", "\approx 4", "at least 4", "4?". Units and labels hold none ("4 \text{ apples}", "7
# square meters", "x = 4"), and neither does "4 more" (the question's own words). A box holding
# a sentence (the "statement" kind: "4 \text{ is the answer}") is no answer either. Extension
# point: a word joins its kind here.
QUALIFIERS: dict[str, frozenset[str]] = {
    kind: frozenset(words.split())
    for kind, words in {
        "negation": "not no never none nothing neither nor cannot nope isnt arent wasnt werent "
        "dont doesnt didnt wont wouldnt couldnt shouldnt cant aint hasnt havent hadnt nah",
        "condition": "if iff unless when whenever where wherever whereas while provided "
        "providing assuming assume assumes assumed assumption suppose supposing supposed given "
        "except excepting excluding exclude besides otherwise else for with",
        "hedge": "maybe perhaps possibly probably likely unlikely presumably supposedly "
        "apparently seemingly seems seem seemed appears guess guessed guessing unsure uncertain "
        "unclear doubt doubtful dubious questionable tentative tentatively unverified unconfirmed "
        "conjecture conjectured speculative hypothetically allegedly arguably think believe "
        "suspect hope might may could would should etc",
        "approximation": "approximately approximate approx about around roughly nearly almost "
        "circa ish estimate estimated",
        "bound": "than least most atleast atmost upto beyond exceeding exceeds",
        "wrongness": "wrong incorrect false untrue invalid impossible mistake mistaken error "
        "erroneous bogus fake trap decoy herring distractor bait reject rejected discard "
        "discarded ignore ignored excluded eliminated disregard nonsense wrongly incorrectly "
        "falsely",
        "statement": "is are was were been being the this that these those its which who what "
        "does did has have had will shall you they she our your their",
        # several values: allowed where the gold answer lists several ("x = 2 or x = 3")
        "alternative": "or and either alternatively",
    }.items()
}
# Next to an answer in prose, only these words qualify it: "the answer would be 12 for the
# party" is an answer, "it is not 12", "maybe 12" and "12 if n is even" are not.
_PROSE_WORDS = (
    QUALIFIERS["negation"]
    | QUALIFIERS["approximation"]
    | QUALIFIERS["wrongness"]
    | QUALIFIERS["hedge"] - {"would", "should", "hope", "etc"}
    | {"if", "iff", "unless", "except", "excepting", "excluding", "otherwise", "provided"}
    | {"providing", "assuming", "supposing", "suppose", "or", "either", "than", "least", "most"}
)
_QUALIFIER_MARKS = [
    (
        re.compile(
            r"\\(?:neq|ne|not|neg|lnot|notin|nexists|nmid|nleq|ngeq|nless|ngtr)(?![A-Za-z])"
            r"|[≠¬∉∄]|!="
        ),
        "negation",
    ),
    (
        re.compile(
            r"\\(?:le|leq|leqq|leqslant|ge|geq|geqq|geqslant|lt|gt|ll|gg|lesssim|gtrsim)"
            r"(?![A-Za-z])|[<>≤≥≲≳]"
        ),
        "bound",
    ),
    (
        re.compile(
            r"\\(?:approx|approxeq|thickapprox|sim|simeq|thicksim|doteq|propto)(?![A-Za-z])"
            r"|[≈≃∼∝]|(?:^|(?<=[\s=(]))~"  # a leading ~ ("~4"), not a tie ("1~000")
        ),
        "approximation",
    ),
    (re.compile(r"\\(?:lor|vee|pm|mp)(?![A-Za-z])|\|\||[±∓∨]"), "alternative"),
    (
        re.compile(
            r"\b(?:and|or)\s+(?:up|upwards?|above|over|higher|more|greater|larger|beyond|below"
            r"|under|lower|less|fewer|smaller|so)\b",
            re.I,
        ),
        "bound",
    ),
    (re.compile(r"\?"), "hedge"),
]
# In prose, "for", "when", "where" and "with" condition an answer when a variable or a
# quantifier follows: "12 for n even", "12 when $x = 2$", not "12 for a party" or "with $5$".
_PROSE_CONDITION = re.compile(
    r"\b(?:for|when|whenever|where|with)\s+"
    r"(?:all|every|each|any|some|(?![aAI]\b)[A-Za-z](?![A-Za-z])|\$\s*[A-Za-z])",
    re.I,
)
# Environment names (`cases`, `aligned`) are no words of the answer.
_ENVIRONMENT = re.compile(r"\\(?:begin|end)\s*\{[^{}]*\}")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_PROSE_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?")
# Negations of other languages (a policy may write its "not" in any): words, and the
# characters that negate in scripts written without spaces.
_FOREIGN_NEGATION = re.compile(
    r"(?i)\b(?:nicht|nein|kein|keine|keinen|keiner|niemals|non(?!-)|pas|jamais|aucun|aucune|nie|"
    r"niet|nee|geen|nunca|nada|ningun|ninguno|ninguna|nessuno|niente|mai|não|nao|nem|нет|не|"
    r"ни|никогда|nej|ikke|inte|hayır|değil|yok|không|chẳng|tidak|bukan|नहीं|لا|ليس|לא)\b"
    r"|[不没沒非否无無未莫勿]|ない|いいえ|아니|않"
)


# Invisible characters a word can hide behind ("n<ZWSP>ot"), and letters of other scripts that
# look like Latin ones ("nоt" with a Cyrillic o): gone, or read as Latin, before any qualifier
# scan (NFKC folds full-width and styled letters).
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f"
                        "\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f"
                        "\ufeff\uffa0]")  # fmt: skip
_LOOKALIKE = str.maketrans(
    "аеорсухіјѕԁԛԝАВЕКМНОРСТХІЈЅαεορτυνικχΑΒΕΗΙΚΜΝΟΡΤΥΧΖ",
    "aeopcyxijsdqwABEKMHOPCTXIJSaeoptuvikxABEHIKMNOPTYXZ",
)


def _scan_text(s: str) -> str:
    """`s` as the qualifier scans read it: NFKC, invisible characters dropped, look-alike
    letters of other scripts as the Latin ones."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", s)).translate(_LOOKALIKE)


@functools.lru_cache(maxsize=4096)
def _qualifiers(s: str, prose: bool = False) -> frozenset[str]:
    """The kinds of qualifier `s` holds (see QUALIFIERS); `prose`: only _PROSE_WORDS count."""
    s = _scan_text(s)
    kinds = {kind for pattern, kind in _QUALIFIER_MARKS if pattern.search(s)}
    if _FOREIGN_NEGATION.search(s):
        kinds.add("negation")
    if prose and _PROSE_CONDITION.search(s):
        kinds.add("condition")
    words = _LATEX_COMMAND.sub(" ", _ENVIRONMENT.sub(" ", s))
    for word in _PROSE_WORD.findall(words):
        word = word.lower().replace("’", "'")
        if word.endswith("n't"):
            word = "not"
        word = word.split("'")[0]  # "that's" -> "that"
        if prose and word not in _PROSE_WORDS:
            continue
        kinds.update(kind for kind, ws in QUALIFIERS.items() if word in ws)
    return frozenset(kinds)


def _qualified(pred: str, gold: str) -> bool:
    """Whether `pred` holds a kind of qualifier that `gold` does not: several values joined
    ("or", `\\pm`) only count where the gold answer is one value."""
    extra = _qualifiers(pred) - _qualifiers(gold)
    if extra == {"alternative"}:
        return len(_items(_normalize(gold))) == 1
    return bool(extra)


# ---------------------------------------------------------------------------- choices
# A multiple-choice problem's options: letter -> the option's text. From a dataset column (a
# list in order, each item maybe marked "A) 21" as AQuA writes them; a dict by letter; ARC's
# {"label": [...], "text": [...]}) or the problem's text: `\textbf{(A) }10 \qquad
# \textbf{(B) }12` (AMC), "(A) 10 (B) 12", lines "A) 10" / "A. 10".
_LETTERS = "ABCDEFGHIJ"
_CHOICE_WRAP = re.compile(
    r"\\(?:textbf|textrm|textnormal|textit|text|mathrm|mathbf|mbox)\s*\{([^{}]*)\}"
)
_CHOICE_SPACE = re.compile(r"\\q?quad(?![A-Za-z])|\\[ ,;:!]|~|\$|\\[()\[\]]")
_CHOICE_MARKS = [  # one style per list: "(A)", "A)" after a space, "A." / "A:" opening a line
    re.compile(r"\(\s*([A-J])\s*\)"),
    re.compile(r"(?:^|(?<=\s))([A-J])\)"),
    re.compile(r"^[ \t]*([A-J])[.:](?=\s)", re.M),
]
_MARKED_ITEM = re.compile(r"\s*\(?\s*([A-J])\s*[).:]\s*(.*)", re.DOTALL)
# How an answer names an option: "(C)", "C", "C)", "C.", "\textbf{(C)}\ 12", "(C) 12".
_CHOSEN = re.compile(
    r"(?:(?i:option|choice)\s*)?(?:\(\s*([A-J])\s*\)|([A-J])(?:\s*[).:]|$))\s*:?\s*(.*)",
    re.DOTALL,
)
_CHOICE_CHARS = 4000  # the end of a longer problem text is where its options are read


def _unwrap(s: str) -> str:
    s = _CHOICE_SPACE.sub(" ", s)
    for _ in range(2):  # \textbf{\mathrm{(A)}}
        s = _CHOICE_WRAP.sub(r"\1", s)
    return s


def _option_text(s: str) -> str:
    s = re.sub(r"(?:[\s,;.]|\b(?:or|and)\b)+$", "", s.strip())
    return s.strip()


@functools.lru_cache(maxsize=1024)
def _choices_in_text(text: str) -> tuple[tuple[str, str], ...] | None:
    """The last run of options A, B, C, ... in a problem's text (two or more, one marking
    style), each up to the next mark, the last up to the end of its line."""
    text = _unwrap(text[-_CHOICE_CHARS:])
    best: list = []
    for style in _CHOICE_MARKS:
        marks = list(style.finditer(text))
        for k in range(len(marks) - 1, -1, -1):  # the last run that starts at "A"
            if marks[k].group(1) != "A":
                continue
            run = [marks[k]]
            for m in marks[k + 1 :]:
                if m.group(1) != _LETTERS[len(run)]:
                    break
                run.append(m)
            if len(run) >= 2 and len(run) > len(best):
                best = run
            break
    if not best:
        return None
    ends = [m.start() for m in best[1:]] + [text.find("\n", best[-1].end()) % (len(text) + 1)]
    options = tuple((m.group(1), _option_text(text[m.end() : end])) for m, end in zip(best, ends))
    return options if all(value for _, value in options) else None


def choices_of(value) -> dict[str, str] | None:
    """A problem's options as letter -> text, from a dataset column or the problem's text (see
    above); None when there are none."""
    if value is None:
        return None
    if isinstance(value, str):
        found = _choices_in_text(value)
        return dict(found) if found else None
    if isinstance(value, dict):
        if isinstance(value.get("text"), (list, tuple)):  # ARC: {"label": [...], "text": [...]}
            labels = value.get("label") or _LETTERS[: len(value["text"])]
            value = dict(zip(labels, value["text"]))
        options = {str(k).strip(): str(v).strip() for k, v in value.items()}
        return options if options and all(k in _LETTERS for k in options) else None
    try:
        items = [str(v) for v in value][: len(_LETTERS)]
    except TypeError:
        return None
    if len(items) < 2:
        return None
    marked = [_MARKED_ITEM.fullmatch(v) for v in items]
    if all(m and m.group(1) == _LETTERS[i] for i, m in enumerate(marked)):
        return {m.group(1): m.group(2).strip() for m in marked}  # ["A)21", "B)21.5", ...]
    return {_LETTERS[i]: v.strip() for i, v in enumerate(items)}


_LOWER_LETTER = re.compile(r"(?i:option|choice)?\s*\(?\s*([a-j])\s*\)?\.?")


def _chosen(s: str) -> tuple[str, str | None] | None:
    """(letter, the value written after it or None) of an answer naming an option, else None."""
    m = _CHOSEN.fullmatch(_unwrap(s).strip())
    if m is None:
        return None
    value = _option_text(m.group(3))
    return m.group(1) or m.group(2), value or None


def _match_choice(pred: str, gold: str, choices: dict | None) -> bool | None:
    """The verdict when either side names an option, else None (compared as usual). With the
    options known, a letter stands for its option's value and a letter with a value must agree
    with them; without them, a letter matches the same letter and a letter with a value matches
    by its value."""
    p, g = _chosen(pred), _chosen(gold)
    if p is None and choices and (m := _LOWER_LETTER.fullmatch(_unwrap(pred).strip())):
        p = (m.group(1).upper(), None)  # "c", "(c)": with the options given, a letter
    if p is None and g is None:
        return None
    options = choices or {}
    (p_letter, p_value), (g_letter, g_value) = p or (None, pred), g or (None, gold)
    if p_letter in options:
        if p_value is not None and not _answers_match(p_value, options[p_letter]):
            return False  # "(B) 12" where (B) is 10: two different answers
        p_value = options[p_letter]
    elif p_letter and options:
        return p_value is None and p_letter == g_letter  # no such option: only the gold's letter
    if g_letter in options and g_value is None:
        g_value = options[g_letter]
    if p_letter and g_letter:
        return p_letter == g_letter
    if p_value is None:
        # A letter alone and no options to read it by: a symbol like any other ("E", "C" for a
        # constant), which a number never equals.
        return None
    if g_value is None:
        return False  # a value against a letter, without the options to read it by
    return _answers_match(p_value, g_value)


# ---------------------------------------------------------------------------- comparison
_DECIMAL = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{1,3})?|-?\d+/\d+")  # exponent <= 999
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}")
_EXPONENT = re.compile(r"\^\s*\{?\s*\(?\s*-?\s*(\d+)")
# Power towers: 9^{9^9}, 9^(9^9), 9^{9}^{9}, 9^99^9 (while a^2b^2 is fine).
_TOWER = re.compile(r"\^\s*(?:\{[^{}]*\^|\([^()]*\^|\{[^{}]*\}\s*\^|(?:\d+|\w|\\[A-Za-z]+)\s*\^)")
_FACTORIAL = re.compile(r"!(?!=)")  # "!=" is "not equal"
_CLOSING = {")": "(", "]": "[", "}": "{", "\\rfloor": "\\lfloor", "\\rceil": "\\lceil"}
_COMMAND = re.compile(r"\\[A-Za-z]+")
_INTEGER = re.compile(r"\d+")
# 6.02 \times 10^{23}, 6.02\cdot10^23, 10^{-3}: the exponent as in _DECIMAL (at most 999)
_SCIENTIFIC = re.compile(
    r"(?:(-?(?:\d+\.?\d*|\.\d+))\s*(?:\\times|\\cdot|\*|×|·)\s*)?"
    r"10\s*\^\s*(?:\{\s*([-+]?\d{1,3})\s*\}|([-+]?\d{1,3}))"
)
_SEQUENCE = re.compile(r"(\\\{|[(\[])?([^()\[\]{}]*,[^()\[\]{}]*)(\\\}|[)\]])?")
_ELLIPSIS = re.compile(r"\\dots(?![A-Za-z])")  # after _normalize, the one spelling of all
_PLAIN_DECIMAL = re.compile(r"-?\d*\.\d+")
_INFINITY = {"\\infty": float("inf"), "+\\infty": float("inf"), "-\\infty": float("-inf")}


def _as_number(s: str) -> Fraction | None:
    try:
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
        if m := _FRAC.fullmatch(s):
            return Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
        if m := _SCIENTIFIC.fullmatch(s):
            return Fraction(m.group(1) or 1) * Fraction(10) ** int(m.group(2) or m.group(3))
    except (ValueError, ZeroDivisionError):  # 1/0, over Python's int digit limit
        pass
    return None


def _same_number(a: Fraction, b: Fraction, text_a: str = "", text_b: str = "") -> bool:
    """Whether the answer `a` (as written: text_a) is the gold `b` (text_b): exactly, with two
    readings that keep one answer to at most one gold of each written precision:
    * floating-point noise: against a gold of at most FLOAT_DIGITS significant digits, an answer
      written as a decimal of more is read at FLOAT_DIGITS ("0.30000000000000004" is 0.3: one
      value);
    * a rounded gold: a gold written as a decimal of at least ROUNDED_DIGITS significant digits
      ("3.14159") may stand for a longer number, so an answer that rounds to it at its places
      is it (one gold per number of places).
    Nothing else: an integer or a fraction gold takes its exact value only (1000000000000.5 is
    neither 10^12 nor 10^12 + 1, 1e-13 is not 0, 0.333333 is not 1/3)."""
    if a == b:
        return True
    if _digits(text_b) <= FLOAT_DIGITS and (a := _denoised(a, text_a)) == b:
        return True  # a gold of a float's precision or coarser: the answer's noise digits drop
    return _rounded_as_written(a, b, text_b)


# significant digits of a decimal beyond which it is read as a float's printout (noise)
FLOAT_DIGITS = 15


def _denoised(x: Fraction, written: str) -> Fraction:
    """`x`, or, when written as a plain decimal of more than FLOAT_DIGITS significant digits,
    x rounded to FLOAT_DIGITS of them: one value, so it can equal at most one gold."""
    if not _PLAIN_DECIMAL.fullmatch(written) or x == 0 or _digits(written) <= FLOAT_DIGITS:
        return x
    whole, fraction = written.lstrip("-").split(".")
    whole = whole.lstrip("0")  # x's leading digit is at 10^exponent:
    exponent = len(whole) - 1 if whole else -(len(fraction) - len(fraction.lstrip("0"))) - 1
    scale = Fraction(10) ** (FLOAT_DIGITS - 1 - exponent)
    return Fraction(round(x * scale)) / scale


def _digits(written: str) -> int:
    """Significant digits of a number as written (0 for anything else)."""
    if not _DECIMAL.fullmatch(written) or "/" in written:
        return 0
    mantissa = written.lstrip("-").lower().split("e")[0].replace(".", "")
    return len(mantissa.lstrip("0"))


def _rounded_as_written(exact: Fraction, value: Fraction, written: str) -> bool:
    if not _PLAIN_DECIMAL.fullmatch(written):
        return False
    places = len(written) - written.index(".") - 1
    if len(written.replace("-", "").replace(".", "").lstrip("0")) < ROUNDED_DIGITS:
        return False  # "0.3" is not 1/3: too few digits to be a rounding of it
    scale = Fraction(10) ** places
    half_up = math.floor(abs(exact) * scale + Fraction(1, 2)) / scale  # 0.1234565 -> 0.123457
    return (half_up if exact > 0 else -half_up) == value


def _as_sequence(s: str) -> tuple[str, str, list, list] | None:
    r"""(open, close, items, their texts) of `\{1,2\}`, `[0,\infty)`, `(1, 2)` or `1, 2` with
    numeric items."""
    m = _SEQUENCE.fullmatch(s)
    if m is None:
        return None
    texts = [x.strip() for x in m.group(2).split(",")]
    items = [_INFINITY.get(x) or _as_number(x) for x in texts]
    return None if None in items else (m.group(1) or "", m.group(3) or "", items, texts)


def _same_item(a: tuple, i: int, b: tuple, j: int) -> bool:
    x, y = a[2][i], b[2][j]
    if isinstance(x, Fraction) and isinstance(y, Fraction):
        return _same_number(x, y, a[3][i], b[3][j])
    return x == y


def _same_sequence(a: tuple, b: tuple) -> bool | None:
    """Sets in any order; intervals and tuples item by item with the same brackets; else None."""
    if (a[0] == b[0] == "\\{" and a[1] == b[1] == "\\}") or not (a[0] + a[1] + b[0] + b[1]):
        # a bare list is a set too: every item of each side is an item of the other
        n, m = range(len(a[2])), range(len(b[2]))
        return all(any(_same_item(a, i, b, j) for j in m) for i in n) and all(
            any(_same_item(a, i, b, j) for i in n) for j in m
        )
    if not (a[0] and a[1] and b[0] and b[1]) or "\\{" in (a[0], b[0]):
        return None  # a set against a bracket, or an unbalanced side: math-verify decides
    if a[:2] != b[:2] or len(a[2]) != len(b[2]):
        return False  # [1,2) is not [1,2]
    return all(_same_item(a, i, b, i) for i in range(len(a[2])))


def _too_costly(s: str) -> bool:
    """Inputs sympy could spend minutes (or gigabytes) on: compared as text instead."""
    s = s.replace("**", "^")
    if len(s) > MAX_ANSWER_CHARS or _TOWER.search(s):
        return True
    if any(int(e) > MAX_EXPONENT for e in _EXPONENT.findall(s)):
        return True
    return any(_costly_factorial(s, m.start()) for m in _FACTORIAL.finditer(s))


def _factorial_operand(s: str, end: int) -> str:
    r"""What the factorial sign ending at `end` applies to: a number, a name (`n`, `\alpha`),
    a bracketed group (`(2n)`, `{n+1}`, `\lfloor n/2\rfloor`) or "" when there is none."""
    s = s[:end].rstrip()
    closing = next((c for c in _CLOSING if s.endswith(c)), None)
    if closing is None:
        m = re.search(r"(?:\d+|\\?[A-Za-z]+|!)$", s)
        return m.group(0) if m else ""
    opening, depth, i = _CLOSING[closing], 0, len(s)
    while i > 0:  # back to the matching opening bracket
        i -= 1
        if s.startswith(closing, i):
            depth += 1
        elif s.startswith(opening, i):
            depth -= 1
            if depth == 0:
                return s[i:]
    return ""


def _costly_factorial(s: str, end: int) -> bool:
    """A factorial sympy might evaluate to a huge integer: n! for n > MAX_FACTORIAL, a nested
    factorial ("3!!!", "(3!)!"), a factorial of a numeric expression ("(10^5)!"). Symbolic ones
    ("n!", "(2n)!", "(n-1)!") stay unevaluated in sympy, so they are compared; but sympy folds
    "n-n+999*999" to a number, so their numbers, multiplied, must not exceed MAX_FACTORIAL
    (which bounds any sum or product of them, too) and powers are not allowed."""
    operand = _factorial_operand(s, end)
    if not operand or "!" in operand:
        return True
    if operand.isdigit():
        return int(operand) > MAX_FACTORIAL
    if "^" in operand or not re.search("[A-Za-z]", _COMMAND.sub("", operand)):  # (10^5)!
        return True
    product = 1
    for n in _INTEGER.findall(operand):
        product *= max(int(n), 1)
        if product > MAX_FACTORIAL:
            return True
    return False


def _items(s: str) -> list[str]:
    """`s` split at its top-level commas, outside any brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += 1 if c in "([{" else -1 if c in ")]}" else 0
        if c == "," and depth == 0:
            items.append(s[start:i].strip())
            start = i + 1
    return items + [s[start:].strip()]


def _same_listing(pred: str, gold: str) -> bool:
    r"""Listings with an ellipsis ("1/2^3, 1/2^6, \dots"), item by item in order, the ellipsis in
    the same places; in the same brackets, if any. Anything else with an ellipsis is wrong."""
    brackets = [("\\{", "\\}"), ("(", ")"), ("[", "]"), ("", "")]
    left, right = next((o, c) for o, c in brackets if pred.startswith(o) and pred.endswith(c))
    if not (gold.startswith(left) and gold.endswith(right)):
        return False
    a = _items(pred[len(left) : len(pred) - len(right)])
    b = _items(gold[len(left) : len(gold) - len(right)])
    if len(a) != len(b) or len(a) < 2:
        return False
    for x, y in zip(a, b):
        if x == y == "\\dots":
            continue
        if _ELLIPSIS.search(x) or _ELLIPSIS.search(y) or not _answers_match(x, y):
            return False
    return True


def _chained_values(s: str) -> list[str] | None:
    """The values a chain of equalities states, outside braces: "x = 2+2 = 4" -> ["2+2", "4"]
    (its left side a variable), [] when that side is no variable; None for fewer than two "=".
    Each value is an answer: "x = 4 = 3" holds 4 and 3."""
    s, cuts, depth = s.strip(), [], 0
    for i, c in enumerate(s):
        depth += (c == "{") - (c == "}")
        if depth == 0 and c == "=" and _RELATION.match(s, i) and (i == 0 or s[i - 1] not in "<>!="):
            cuts.append(i)
    if len(cuts) < 2:
        return None
    parts = [s[a + 1 : b].strip() for a, b in zip(cuts, [*cuts[1:], len(s)])]
    return parts if _ASSIGN.fullmatch(s[: cuts[0] + 1].strip()) else []


def _equations_assign(s: str) -> bool:
    """Whether every equation in `s` (its parts between commas and "or"/"and") has a variable
    for its left side: "x = 2, y = 3" and "x = 2 \\text{ or } x = 3" do, "1 = 2" does not."""
    for part in _CANDIDATES.split(s):
        part = _outside_braces(part)
        if (m := _RELATION.search(part)) and not _ASSIGN.fullmatch(part[: m.end()].strip()):
            return False
    return True


_BRACED = re.compile(r"\{[^{}]*\}")


def _outside_braces(s: str) -> str:
    """`s` with what its braces hold left out: `\\sum_{k=1}^{n} k` -> `\\sum_{}^{} k`."""
    while (t := _BRACED.sub("{}", s)) != s and len(t) < len(s):
        s = t
    return s


def _squash(s: str) -> str:
    return "".join(s.split())


def answers_match(pred: str, gold: str, choices=None) -> bool:
    """Whether the extracted answer `pred` equals the gold answer (see the module docstring);
    `choices` as math_reward takes them. Never raises: a failure of the grader itself is
    logged (errors.failed) and is no match."""
    try:
        return _answers_match(pred, gold, choices_of(choices))
    except Exception as e:
        failed("math", e)
        return False


# Two numbers with only space between them: two values ("3 \quad 4"), which math-verify
# would add up as a mixed number (7); not a subscript or exponent before a number (`\log_2 8`).
_JUXTAPOSED = re.compile(r"(?<![\w^.])\d+(?:\.\d+)?\s+\d")


def _unbraced(s: str) -> str:
    return s.replace("{", "").replace("}", "")


def _answers_match(pred: str, gold: str, choices: dict | None = None) -> bool:
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return _squash(pred) == _squash(gold)
    if _qualified(pred, gold):
        return False  # "4 \text{ is not the answer}", "2 \lor 3" for one value, "\approx 4"
    if (verdict := _match_choice(pred, gold, choices)) is not None:
        return verdict
    pred, gold = _normalize(pred), _normalize(gold)
    if not pred or not gold:
        return False
    if "," in pred and "," not in gold:
        return False  # several values for one ("\{3, 6\}1", of which math-verify reads a 6)
    if _JUXTAPOSED.search(_unbraced(pred)) and not _JUXTAPOSED.search(_unbraced(gold)):
        return False
    if not _RELATION.search(_outside_braces(gold)):
        chains = [c for p in _CANDIDATES.split(pred) if (c := _chained_values(p)) is not None]
        if chains:  # a chain of equalities: every value it states is the gold ("x = 4 = 3")
            return all(c and all(_answers_match(v, gold, choices) for v in c) for c in chains)
        if not _equations_assign(pred):
            return False  # an equation whose left side is no variable ("1 = 2", "f(x) = 3")
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return _same_number(a, b, pred, gold)
    if _squash(pred) == _squash(gold):
        return True
    seq_a, seq_b = _as_sequence(pred), _as_sequence(gold)
    if seq_a and seq_b and (same := _same_sequence(seq_a, seq_b)) is not None:
        return same
    if seq_a and b is not None or seq_b and a is not None:
        return False  # a list is not a number: "1,2" is not 12
    if _ELLIPSIS.search(pred) or _ELLIPSIS.search(gold):
        return _same_listing(pred, gold)  # sympy cannot read "...": it takes \cdots for a symbol
    if _too_costly(pred) or _too_costly(gold):
        return False
    return _verify_bounded(gold, pred)


def score_math(completion: str, answer: str, choices=None) -> Graded:
    """The grader GRADERS["math"]: score 1.0 when the completion's final answer equals the
    gold answer, else 0.0. `choices`: the problem's options when it gives them (a dataset column
    or the problem's text: choices_of), so that a letter, its value or both score against a gold
    letter or value. Never raises: a failure of the grader itself scores 0 and is returned with
    the score (ibpo.rewards.errors)."""
    try:
        if not completion or answer is None:
            return Graded(0.0)
        options = choices_of(choices)
        pred = _final_answer(completion, options)
        return Graded(float(pred is not None and _answers_match(pred, str(answer), options)))
    except Exception as e:
        return Graded(0.0, failed("math", e))


def math_reward(completion: str, answer: str, choices=None) -> float:
    """score_math's score alone (a failure of the grader itself is logged and scores 0)."""
    return score_math(completion, answer, choices).score


# ---------------------------------------------------------------------------- math-verify
@functools.lru_cache(maxsize=2048)
def _parse(s: str) -> list:
    from math_verify import parse

    return parse(f"\\boxed{{{s}}}", parsing_timeout=None) or parse(s, parsing_timeout=None)


def _verify(gold: str, pred: str) -> bool:
    """math-verify without any time bound: call it only in a worker or on guarded input."""
    from math_verify import verify

    try:
        g, p = _parse(gold), _parse(pred)
        return bool(g and p and verify(g, p, timeout_seconds=None) and _parse_holds_all(pred, p))
    except Exception:  # a malformed expression (or MemoryError in a worker) is a wrong answer
        return False


# What a parse may have dropped: each number; each letter and symbol command (`\pi`, `\infty`,
# `\alpha`) outside a command's name, an environment's name, a \text{...} or the left side of an
# assignment (`x = 2, y = 3` reads as the values); each \text{...} (`\text{three} \to 4`).
_SKIPPED = re.compile(
    r"\\(?:begin|end|text[a-z]*|mathrm|operatorname|mbox)\s*\{[^{}]*\}|\\[A-Za-z]+"
    r"|[A-Za-z](?:_\{?\w+\}?)?\s*=(?!=)"
)
_SYMBOL_COMMAND = (
    r"\\(?:alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda"
    r"|mu|nu|xi|pi|varpi|rho|sigma|tau|upsilon|phi|varphi|chi|psi|omega|Gamma|Delta|Theta"
    r"|Lambda|Xi|Pi|Sigma|Upsilon|Phi|Psi|Omega|infty|emptyset)(?![A-Za-z])"
)
_LITERAL = re.compile(
    rf"(?P<text>\\(?:text[a-z]*|mathrm|mbox)\s*\{{[^{{}}]*\}})|(?P<command>{_SYMBOL_COMMAND})"
    r"|\d+(?:\.\d+)?|(?<![A-Za-z\\])[A-Za-z](?![A-Za-z])"
)
MAX_PROBES = 12  # literals missing from a parse that are tried; more: the parse is not trusted


def _parse_holds_all(s: str, parsed: list) -> bool:
    """Whether math-verify's parse of `s` kept all of it: every literal of `s` (above) appears
    in the parsed expression or changes it when replaced (a \\text{...}: when deleted). The
    parser drops what it cannot read and keeps the rest, so `3 \\to 4`, `3 \\\\ 4`, a `cases`
    row and `4 \\; (n \\neq 2)` would read as one value (4, 4, the last row's, 2); a mixed
    number `3\\frac12` reads as 7/2, which every digit of it changes."""
    exprs = [x for x in parsed if not isinstance(x, str)]
    if not exprs:
        return True  # compared as text
    numbers, names = set(), set()
    for e in exprs:
        for atom in getattr(e, "atoms", lambda: ())():
            if getattr(atom, "is_Number", False):
                with contextlib.suppress(ValueError, TypeError):
                    numbers.add(Fraction(str(atom)))
            else:
                names.add(str(atom).split("_")[0])  # x_1 holds x; pi, alpha
    skipped = [m.span() for m in _SKIPPED.finditer(s)]
    probes = 0
    for m in _LITERAL.finditer(s):
        lit = m.group(0)
        if m.group("text"):
            swap = ""
        elif m.group("command"):
            if lit[1:] in names:
                continue
            swap = "\\varkappa " if "\\zeta" in s else "\\zeta "
        elif any(a <= m.start() < b for a, b in skipped):
            continue
        elif lit[0].isdigit():
            if Fraction(lit) in numbers:
                continue
            swap = "7919" if lit != "7919" else "7907"
        else:
            if lit in names:
                continue
            swap = "\\varkappa " if "\\zeta" in s else "\\zeta "
        probes += 1
        if probes > MAX_PROBES:
            return False
        try:
            other = _parse.__wrapped__(s[: m.start()] + swap + s[m.end() :])
            same = [x for x in other if not isinstance(x, str)] == exprs
        except Exception:  # could not read it changed: it was not ignored
            same = False
        if same:
            return False
    return True


_BOOT = (
    "import importlib.util as u, sys\n"
    "s = u.spec_from_file_location('_ibpo_math_worker', sys.argv[1])\n"
    "m = u.module_from_spec(s); s.loader.exec_module(m); m._serve(int(sys.argv[2]))\n"
)


def _serve(cpu_s: int) -> None:
    """Worker loop: one JSON [gold, pred] per stdin line, one '1'/'0' per stdout line."""
    import resource
    import signal

    def cap(kind: int, soft: int) -> None:  # lower a soft limit, never above the hard one
        hard, inf = resource.getrlimit(kind)[1], resource.RLIM_INFINITY
        resource.setrlimit(kind, (soft if hard == inf else min(soft, hard), hard))

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    cap(resource.RLIMIT_AS, _WORKER_MEMORY)
    out = os.fdopen(os.dup(1), "wb")  # keep the pipe; stray prints go to stderr (devnull)
    os.dup2(2, 1)
    _parse("1")  # import sympy and math-verify before saying ready
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        gold, pred = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)
        # The kernel sends SIGXCPU (fatal) once this comparison has used cpu_s more seconds.
        cap(resource.RLIMIT_CPU, int(used.ru_utime + used.ru_stime) + cpu_s + 1)
        out.write(b"1\n" if _verify(gold, pred) else b"0\n")
        out.flush()


class _Worker:
    """One math-verify process, used by one thread at a time."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-c", _BOOT, os.path.abspath(__file__), str(WORKER_CPU_S)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        self._buf = b""
        if self._read_line(60.0) != b"ready":
            self.close()
            raise OSError("the math-verify worker exited before it was ready")

    def _read_line(self, timeout: float) -> bytes | None:
        """The next line from the worker, or None when it died or `timeout` passed."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def ask(self, gold: str, pred: str, timeout: float) -> bool | None:
        """The verdict; None when the comparison overran or killed the worker. Raises
        _WorkerGone when the worker was already dead (killed from outside while idle): the
        question never reached it."""
        try:
            self.proc.stdin.write(json.dumps([gold, pred]).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            raise _WorkerGone from None
        line = self._read_line(timeout)
        return None if line is None else line == b"1"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # unflushed bytes to a dead worker
                f.close()


class _WorkerGone(Exception):
    """A pooled worker died while idle (never because of the question now being asked)."""


class _Pool:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(_MAX_WORKERS)
        self.idle: list[_Worker] = []
        self.in_process = os.name != "posix"


_pool = _Pool()
if hasattr(os, "register_at_fork"):  # a forked child must not share its parent's pipes
    os.register_at_fork(after_in_child=lambda: globals().update(_pool=_Pool()))


@atexit.register
def _close_workers() -> None:
    with _pool.lock:
        while _pool.idle:
            _pool.idle.pop().close()


def _compare_in_worker(gold: str, pred: str, timeout: float) -> bool:
    pool = _pool
    with pool.slots:
        with pool.lock:
            worker = pool.idle.pop() if pool.idle else None
        if worker is None and not pool.in_process:
            try:
                worker = _Worker()
            except OSError as err:
                _log.warning("math grading in-process without a time bound: %s", err)
                pool.in_process = True
        if worker is None:
            return _verify(gold, pred)
        try:
            verdict = worker.ask(gold, pred, timeout)
        except _WorkerGone:  # ask a fresh worker instead: this question did not kill it
            worker.close()
            worker = _Worker()
            verdict = _ask_or_close(worker, gold, pred, timeout)
        except BaseException:
            worker.close()
            raise
        if verdict is None:  # overran or died: kill it, a stuck sympy call would burn CPU on
            worker.close()
            return False
        with pool.lock:
            pool.idle.append(worker)
        return verdict


def _ask_or_close(worker: _Worker, gold: str, pred: str, timeout: float) -> bool | None:
    try:
        return worker.ask(gold, pred, timeout)
    except BaseException:
        worker.close()
        raise


@functools.lru_cache(maxsize=4096)
def _verify_bounded(gold: str, pred: str) -> bool:
    return _compare_in_worker(gold, pred, VERIFY_TIMEOUT_S)
