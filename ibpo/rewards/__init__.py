"""The built-in graders by name (`GRADERS`). Training rewards and evaluation use the same graders.

A grader takes (completion text, gold answer) and returns an `errors.Graded`: a score in [0, 1]
and, when the grader itself failed on the completion, that failure (one with a `choices`
parameter also gets the problem's multiple-choice options); functions.py wraps each as a reward
function in TRL's convention. The built-in ones never raise for a completion: their own
failures score 0 and are returned with the score (errors.py). A grader registered here that
returns a bare number gives a score with no failure. `math_reward` and `code_reward` are the
built-ins' scores alone, as floats.
"""

from collections.abc import Callable

from ibpo.rewards.code import code_reward, score_code
from ibpo.rewards.errors import Graded
from ibpo.rewards.math import extract_answer, math_reward, score_math

GRADERS: dict[str, Callable[..., Graded]] = {"math": score_math, "code": score_code}

__all__ = [
    "GRADERS",
    "Graded",
    "code_reward",
    "extract_answer",
    "math_reward",
    "score_code",
    "score_math",
]
