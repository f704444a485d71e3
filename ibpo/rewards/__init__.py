"""Reward functions by name. Training rewards and evaluation use the same graders.

A reward function takes (completion text, gold answer) and returns a float in [0, 1].
"""

from collections.abc import Callable

from ibpo.rewards.math import extract_answer, math_reward

REWARDS: dict[str, Callable[[str, str], float]] = {"math": math_reward}

__all__ = ["REWARDS", "extract_answer", "math_reward"]
