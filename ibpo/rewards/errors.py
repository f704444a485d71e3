"""Grader failures, returned with the score instead of raised: a grader's own failure is
reward 0, never a stop.

The built-in graders (math.score_math, code.score_code) catch every exception of their own
internals for any completion (a RecursionError on a deeply nested value, an OSError starting a
sandbox, a bug) and return `Graded(0.0, GraderFailure(kind, reason))`: the score with the
failure that gave it. The grading that called them (functions.RewardSet.score) places each
failure at its completion and reward function and returns them with its scores
(functions.Grades.failures): the step logs their count as `grader_errors`, the held-out
evaluation as `eval_grader_errors`, a benchmark keeps each sample's reason. The first failure
of each kind is also logged once per process, with its traceback (`failed`).

Not here: errors in the gold answers themselves (a malformed code test spec raises ValueError
with the fix: it is the dataset's, not the completion's), grading itself (math.py, code.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

_log = logging.getLogger("ibpo.rewards")
_lock = threading.Lock()
_logged: set[str] = set()  # kinds whose first failure was logged (a log, not a count)
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class GraderFailure:
    """One grader's own failure on one completion, scored 0."""

    kind: str  # the grader: "math", "code"
    reason: str  # "grader error (<kind>): <exception>", bounded
    index: int | None = None  # the completion within its grading (None: not placed yet)
    function: str | None = None  # the reward function that called the grader


@dataclass(frozen=True)
class Graded:
    """What a grader of GRADERS returns for one completion: its score (in [0, 1]) and, when
    the grader itself failed on it (the score is then 0), that failure. A reward function may
    return one as a value (functions.py)."""

    score: float
    failure: GraderFailure | None = None


def failed(kind: str, exc: BaseException) -> GraderFailure:
    """The failure of grader `kind` (e.g. "math", "code") on `exc`, its reason bounded; the
    first of each kind in this process is logged with its traceback."""
    try:
        detail = str(exc)
    except Exception:  # a str() that fails (or is huge) says nothing more than the type
        detail = ""
    reason = f"grader error ({kind}): {type(exc).__name__}: {detail}"[:MAX_REASON_CHARS]
    with _lock:
        first = kind not in _logged
        _logged.add(kind)
    if first:
        _log.warning(
            "%s (scored 0; counted in the grading's grader errors, later ones not logged)",
            reason,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
    return GraderFailure(kind, reason)
