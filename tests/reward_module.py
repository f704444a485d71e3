"""Reward functions that tests name by import path (reward.functions=tests.reward_module:...).

Each call is recorded in CALLS (completions and the keyword arguments' names and prompts), so
that a test can tell which completions, rollouts, repairs or held-out ones, were graded."""

CALLS: list[dict] = []


def parity(completions, prompts, **kwargs):
    """About half right on a random model: the parity of the completion's characters, shifted
    by the row's `shift` column when the dataset has one."""
    CALLS.append({"completions": list(completions), "prompts": list(prompts), "keys": set(kwargs)})
    shifts = kwargs.get("shift") or [0] * len(completions)
    return [float((sum(map(ord, c)) + s) % 2) for c, s in zip(completions, shifts)]
