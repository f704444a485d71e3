r"""Math answer grading: extract the final answer, then verify it with math-verify.

Extraction comes first because verifying a whole completion can match a restated expression
("9 + 7 = 26" would be scored correct for 16). Order: Qwen3 `<think>...</think>` blocks are
dropped; then the last `\boxed{...}`; else an "Answer: ..." / "answer is ..." / "#### ..." line;
else the last number in the text. Numbers are compared exactly when both sides are plain numbers
(fast path); anything else goes to math-verify with its signal-based timeouts off, so grading is
safe in threads.

Not here: code execution (sandbox), format rewards, or dataset-specific answer parsing (data.py).
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

# We turn math-verify's signal timeouts off on purpose (thread safety); silence its reminder.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_ANSWER_LINE = re.compile(
    r"(?:final answer|answer)\s*(?:is|:)?\s*[:=]?\s*(.+)|####\s*(.+)", re.IGNORECASE
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_PLAIN = re.compile(r"^-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?$")


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} (or \fbox{...}), with nested braces handled."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def strip_thinking(text: str) -> str:
    return _THINK.sub("", text)


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when it gives none."""
    text = strip_thinking(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        m = _ANSWER_LINE.search(line)
        if m:
            ans = (m.group(1) or m.group(2)).strip().rstrip(".").strip()
            nums = _NUMBER.findall(ans)
            # "The answer is 12 apples" -> 12; keep LaTeX-ish answers whole
            if nums and not any(c in ans for c in "\\^{}"):
                return nums[0]
            if ans:
                return ans
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _as_number(text: str) -> Fraction | None:
    s = text.strip().replace(",", "").rstrip(".").strip("$ ")
    if not _PLAIN.match(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(pred: str, gold: str) -> bool:
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return a == b
    from math_verify import parse, verify

    def _parse(s: str):
        return parse(f"\\boxed{{{s}}}", parsing_timeout=None) or parse(s, parsing_timeout=None)

    try:
        gold_p, pred_p = _parse(gold), _parse(pred)
        return bool(gold_p and pred_p and verify(gold_p, pred_p, timeout_seconds=None))
    except Exception:  # a malformed expression is a wrong answer, never a crash
        return False


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the gold answer, else 0.0."""
    pred = extract_answer(completion)
    return float(pred is not None and answers_match(pred, answer))
