"""Reward functions by name. Training rewards and evaluation use the same graders.

A reward function takes (completion text, gold answer) and returns a float in [0, 1] (a grader
with a `choices` parameter also gets the problem's multiple-choice options: functions.py). The
built-in ones never raise for a completion: their own failures score 0 and are counted (errors).
"""

from collections.abc import Callable

from ibpo.rewards.code import code_reward
from ibpo.rewards.math import extract_answer, math_reward

REWARDS: dict[str, Callable[[str, str], float]] = {"math": math_reward, "code": code_reward}

__all__ = ["REWARDS", "code_reward", "extract_answer", "math_reward"]
