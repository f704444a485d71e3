"""Grader failures, counted instead of raised: a grader's own failure is reward 0, never a stop.

The built-in graders (math_reward, answers_match, grade_code / code_reward) catch every
exception of their own internals for any completion (a RecursionError on a deeply nested value,
an OSError starting a sandbox, a bug), call `record(kind, exc)` and return reward 0 with the
reason. The counts are per process and thread-safe: the step reads and resets them once per
step (`take()`, its `grader_errors` metric); the first failure of each kind is logged once,
with its traceback, the later ones only counted. `graded(fn, completion, answer)` tells the
caller which grading of this thread failed, for per-sample records (evaluation).

Not here: errors in the gold answers themselves (a malformed code test spec raises ValueError
with the fix: it is the dataset's, not the completion's), grading itself (math.py, code.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

_log = logging.getLogger("ibpo.rewards")
_lock = threading.Lock()
_counts: dict[str, int] = {}
_logged: set[str] = set()
_local = threading.local()
MAX_REASON_CHARS = 300


def record(kind: str, exc: BaseException) -> str:
    """Count one failure of grader `kind` (e.g. "math", "code"); -> the reason, bounded."""
    try:
        detail = str(exc)
    except Exception:  # a str() that fails (or is huge) says nothing more than the type
        detail = ""
    reason = f"grader error ({kind}): {type(exc).__name__}: {detail}"[:MAX_REASON_CHARS]
    with _lock:
        _counts[kind] = _counts.get(kind, 0) + 1
        first = kind not in _logged
        _logged.add(kind)
    _local.last = reason
    if first:
        _log.warning(
            "%s (scored 0; counted in the step's grader_errors, later ones not logged)",
            reason,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
    return reason


def take() -> dict[str, int]:
    """The failures by kind since the last take(), and reset them."""
    with _lock:
        out = dict(_counts)
        _counts.clear()
    return out


def peek() -> dict[str, int]:
    """The failures by kind since the last take(), left in place."""
    with _lock:
        return dict(_counts)


def graded(fn: Callable[[str, str], float], completion: str, answer: str) -> tuple[float, str]:
    """fn(completion, answer) and the reason when that grading failed in the grader ("" else)."""
    _local.last = ""
    reward = fn(completion, answer)
    return reward, getattr(_local, "last", "")
