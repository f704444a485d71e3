"""Example: one problem with its verifiable answer, the unit every other module of ibpo.data
makes, renders or streams."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One problem: its question (a chat's last user message), its gold answer (what the
    built-in graders compare against, "" when no built-in grader needs one), every column of
    its row (what reward functions receive) and, for a conversational prompt, the whole chat."""

    question: str
    answer: str
    columns: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    messages: tuple | None = field(default=None, compare=False, hash=False, repr=False)
    # a string prompt exactly as the dataset gives it (`question` is it stripped); None: same
    given: str | None = field(default=None, compare=False, hash=False, repr=False)
