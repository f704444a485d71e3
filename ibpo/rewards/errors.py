"""Grader failures, reported with the grading instead of raised: a grader's own failure is
reward 0, never a stop.

The built-in graders (math_reward, answers_match, grade_code / code_reward) catch every
exception of their own internals for any completion (a RecursionError on a deeply nested value,
an OSError starting a sandbox, a bug), call `record(kind, exc)` and return reward 0 with the
reason. `record` adds a `GraderFailure` to the failures being collected in the caller's context
(`collecting()`, a context variable: each grading collects its own, however many run at once,
and worker threads that run in a copy of the grading's context add to it); `sample(i)` says
which completion of a call is being graded. The grading returns them with its score
(functions.Grades.failures): the step logs their count as `grader_errors`, the held-out
evaluation as `eval_grader_errors`, a benchmark keeps each sample's reason. The first failure of
each kind is also logged once per process, with its traceback; a failure outside any
`collecting()` (a grader called directly) is only logged.

Not here: errors in the gold answers themselves (a malformed code test spec raises ValueError
with the fix: it is the dataset's, not the completion's), grading itself (math.py, code.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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
    index: int | None = None  # the completion within its grading (None: not said)
    function: str | None = None  # the reward function that called the grader


_failures: ContextVar[list[GraderFailure] | None] = ContextVar("grader_failures", default=None)
_sample: ContextVar[int | None] = ContextVar("grader_sample", default=None)


@contextmanager
def collecting() -> Iterator[list[GraderFailure]]:
    """The failures recorded in this context until the block ends (nested: the innermost
    block's list only)."""
    caught: list[GraderFailure] = []
    token = _failures.set(caught)
    try:
        yield caught
    finally:
        _failures.reset(token)


@contextmanager
def sample(index: int) -> Iterator[None]:
    """Failures recorded in the block are completion `index`'s."""
    token = _sample.set(index)
    try:
        yield
    finally:
        _sample.reset(token)


def record(kind: str, exc: BaseException) -> str:
    """One failure of grader `kind` (e.g. "math", "code"), added to the failures being
    collected; -> the reason, bounded."""
    try:
        detail = str(exc)
    except Exception:  # a str() that fails (or is huge) says nothing more than the type
        detail = ""
    reason = f"grader error ({kind}): {type(exc).__name__}: {detail}"[:MAX_REASON_CHARS]
    caught = _failures.get()
    if caught is not None:
        caught.append(GraderFailure(kind, reason, _sample.get()))
    with _lock:
        first = kind not in _logged
        _logged.add(kind)
    if first:
        _log.warning(
            "%s (scored 0; counted in the grading's grader errors, later ones not logged)",
            reason,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
    return reason
