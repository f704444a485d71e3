"""A finished sandboxed test's verdict: its exit status and output turned into (status, reason).

The child (child.py) reports on a result channel, one record per line, the last one counting:
"D" (the program, or a check test's harness, ran to its end), "V <json>" (a call test's return
value), "R <repr>" (a return value that is not JSON), "E <exception>" and "X <code>" (an exit
before the end). Limits are judged before the answer: over the CPU or wall-clock limit is a
timeout whatever was printed, and so is a test the kernel killed at its CPU limit, whatever CPU
time is read back (the kernel's clock runs ahead of it). Stdin tests pass on exit status 0 and a
matching stdout (`stdout_matches`); call tests compare the decoded JSON value with the expected
one, which never entered the sandbox; a check test passes on its harness's "D", a channel only
the harness holds. Only in a script test can the tested code write a passing record (run.py's
threat model).

Not here: running the test (sandbox.py), grading policy (rewards/code.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
from typing import Any

from ibpo.sandbox.cases import Limits, TestCase

SETUP_FAILED = 121  # exit code of the child when it could not build its sandbox (child.py)


MAX_REASON_CHARS = 300  # a verdict's reason, whatever the tested program printed or returned


def _short(value: Any, n: int = 80) -> str:
    """`value` (a string, or plain data decoded from the child) shown in at most n characters
    and a few levels of nesting: the value may be nested a thousand levels deep or hold a
    number of a million digits."""
    s = repr(value[: n + 1]) if isinstance(value, str) else _plain(value, 4, n + 1)
    return s if len(s) <= n else s[: n - 3] + "..."


def _plain(v: Any, depth: int, n: int) -> str:
    # JSON-like; never recurses deeper than `depth`, never renders more than about n characters.
    if isinstance(v, (list, tuple, dict)):
        if depth <= 0:
            return "[...]" if not isinstance(v, dict) else "{...}"
        items = list(v.items() if isinstance(v, dict) else v)
        parts, used = [], 0
        for item in items:
            if used > n:
                parts.append("...")
                break
            if isinstance(v, dict):
                part = f"{_plain(item[0], depth - 1, n)}: {_plain(item[1], depth - 1, n)}"
            else:
                part = _plain(item, depth - 1, n)
            parts.append(part)
            used += len(part) + 2
        body = ", ".join(parts)
        return "{" + body + "}" if isinstance(v, dict) else "[" + body + "]"
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 3 * n:
        return f"<integer of about {int(v.bit_length() * 0.30103)} digits>"
    try:
        return (
            json.dumps(v)[:n] if isinstance(v, (str, int, float, bool, type(None))) else repr(v)[:n]
        )
    except (TypeError, ValueError, RecursionError):
        return f"<{type(v).__name__}>"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:  # real-time signals (SIGRTMIN+k) have no name in signal.Signals
        return f"signal {num}"


def _last_line(err: bytes) -> str:
    lines = [ln.strip() for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
    return _short(lines[-1], 200).strip("'\"") if lines else ""


def classify(
    test: TestCase,
    limits: Limits,
    status: int,
    cpu: float,
    wall_killed: bool,
    out: bytes,
    err: bytes,
    res: bytes,
) -> tuple[str, str]:
    """(status, reason) of one finished test: its wait status, CPU seconds, whether the wall
    clock killed it, and its capped stdout, stderr and result channel. The reason is at most
    MAX_REASON_CHARS long."""
    st, reason = _classify(test, limits, status, cpu, wall_killed, out, err, res)
    return st, reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def _killed(status: int, err: bytes) -> bool:
    """Whether the test ended by a SIGKILL (none of ours: the wall-clock kill is judged apart):
    as its wait status says, as bwrap and a check test's harness report a killed child (exit
    code 137), or as util-linux 2.38's unshare does (exit code 1, failing to pass it on)."""
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status) == signal.SIGKILL
    code = os.WEXITSTATUS(status)
    return code == 128 + signal.SIGKILL or (code == 1 and b"sigprocmask unblock failed" in err)


def _last_record(res: bytes) -> str:
    """The result channel's last line, decoded: found from the end, so that megabytes of lines
    before it (a test may write anything there) are never split or decoded."""
    body = res.rstrip(b"\r\n")
    start = max(body.rfind(b"\n"), body.rfind(b"\r")) + 1
    return body[start:].decode("utf-8", "replace")


def _classify(test, limits, status, cpu, wall_killed, out, err, res) -> tuple[str, str]:
    cap = limits.max_output_bytes
    records = bool(res.strip(b"\r\n"))  # the channel holds a record
    last = _last_record(res) if records else ""
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == SETUP_FAILED and not records:
        return "error", _last_line(err) or "sandbox setup failed"
    killed = not records and _killed(status, err)
    # The kernel's CPU limit (RLIMIT_CPU, whole seconds) runs on its own clock, which can run
    # ahead of the CPU time read here: a loop it kills at 2 s may read 1.8 s. So a test killed
    # without a word after half of that limit or more ran out of time too.
    if cpu > limits.time_s or (killed and cpu >= limits.cpu_limit_s / 2):
        return "timeout", f"time limit {limits.time_s:g}s"
    if wall_killed:
        return "timeout", f"wall-clock limit {limits.wall_s:g}s"
    if os.WIFSIGNALED(status):
        return "error", f"killed by {_signal_name(os.WTERMSIG(status))}"
    if killed:
        return "error", "killed by SIGKILL"
    if len(out) > cap or len(err) > cap or len(res) > cap or "File too large" in last:
        return "error", f"output limit {cap} bytes exceeded"
    if last.startswith("E "):
        failed = test.kind in ("script", "check") and last.startswith("E AssertionError")
        return ("failed" if failed else "error"), last[2:]
    code = os.WEXITSTATUS(status)
    if last.startswith("X ") or code != 0:
        detail = f": {_last_line(err)}" if _last_line(err) else ""
        early = " before the end" if last.startswith("X ") else ""
        return "error", f"exit code {last[2:] if early else code}{early}{detail}"
    return _compare(test, out, last)


def _compare(test: TestCase, out: bytes, last: str) -> tuple[str, str]:
    if test.kind in ("script", "check"):
        return ("passed", "") if last == "D" else ("failed", "program stopped before the end")
    if test.kind == "stdin":
        if last != "D":
            return "failed", "program stopped before the end"
        got = out.decode("utf-8", "replace")
        if stdout_matches(got, test.expected):
            return "passed", ""
        return "failed", f"wrong answer: expected {_short(test.expected)} got {_short(got)}"
    if last.startswith("V "):
        if len(last) > _room(test.expected):  # parsed, it could not be the expected value
            return "failed", f"wrong answer: a return value of {len(last)} characters"
        try:  # written by the child: untrusted, may be anything
            got = json.loads(last[2:])
        except (ValueError, RecursionError):
            return "error", "unreadable return value"
        try:
            same = got == test.expected
        except RecursionError:  # both nested past the interpreter's limit: not comparable
            return "error", "return value nested too deeply to compare"
        if same:
            return "passed", ""
        return "failed", f"wrong answer: expected {_short(test.expected)} got {_short(got)}"
    if last.startswith("R "):
        return "failed", f"wrong answer: expected {_short(test.expected)} got {last[2:][:200]}"
    return "error", "no return value reported"


# What a test sends back is parsed only within this much of the expected answer's own size: an
# equal answer is never longer than ROOM_FACTOR x the expected's JSON or text (`true` for 1,
# `1.0` for 1) plus ROOM_BYTES, and anything longer is a wrong answer without being parsed, so
# a forged megabyte record costs the trainer its bytes read and no more.
ROOM_FACTOR, ROOM_BYTES = 4, 1024


def _room(expected) -> int:
    """The most characters (or bytes) an answer equal to `expected` can take, written out."""
    size = len(expected) if isinstance(expected, str) else len(json.dumps(expected, default=repr))
    return ROOM_FACTOR * size + ROOM_BYTES


def stdout_matches(got: str, expected: str) -> bool:
    """Line-by-line comparison ignoring trailing whitespace, blank trailing lines, and spacing
    between tokens; tokens with a decimal point or exponent compare as floats within 1e-6.
    Within the expected's size: the output is split into lines and tokens only as far as the
    expected has them (a megabyte of newlines or spaces is a mismatch, never a list)."""
    e = _lines(expected)
    body = got.replace("\r\n", "\n").rstrip()
    if body.count("\n") + 1 != max(len(e), 1) and (e or body):
        return False
    g = _lines(got)
    if len(g) != len(e):
        return False
    for a, b in zip(g, e):
        if a == b:
            continue
        want = b.split()
        if not _tokens_match(a.split(None, len(want)), want):
            return False
    return True


def _lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _tokens_match(got: list[str], exp: list[str]) -> bool:
    if len(got) != len(exp):
        return False
    for a, b in zip(got, exp):
        if a == b:
            continue
        if not any(c in b for c in ".eE"):
            return False
        try:
            if not math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6):
                return False
        except ValueError:
            return False
    return True
