"""The built-in graders by name (`GRADERS`). Training rewards and evaluation use the same graders.

A grader takes (completion text, gold answer) and returns a float in [0, 1] (one with a
`choices` parameter also gets the problem's multiple-choice options); functions.py wraps each
as a reward function in TRL's convention. The built-in ones never raise for a completion: their
own failures score 0 and are reported with the grading that met them (errors.py).
"""

from collections.abc import Callable

from ibpo.rewards.code import code_reward
from ibpo.rewards.math import extract_answer, math_reward

GRADERS: dict[str, Callable[[str, str], float]] = {"math": math_reward, "code": code_reward}

__all__ = ["GRADERS", "code_reward", "extract_answer", "math_reward"]
