"""Run untrusted generated Python against test cases, one throwaway sandbox per test.

Test kinds: "stdin" (feed `input`, compare stdout with `expected` via
`sandbox_verdict.stdout_matches`), "call" (call `fn_name(*input)`, a method of `class Solution`
when the code defines one, and compare the JSON-encoded return value with `expected`) and
"script" (passes when the program runs to its end, e.g. HumanEval's `check(entry_point)`).
Statuses: passed, failed (wrong answer, assertion), timeout, error (exception, crash, output
limit, exit code), skipped (stop_on_first_failure).

Each test runs in a fresh interpreter (`python -S -s -B`: no site-packages; an environment built
from scratch: no tokens, no PYTHONPATH) with rlimits on CPU time, address space, open files,
file size (caps stdout/stderr) and processes, plus a wall-clock timer; a pipe tells the child
when this process dies, so no sandbox outlives a crashed trainer. `isolation_mode()`:

* "namespaces" (util-linux `unshare` works): network namespace (no network at all), PID
  namespace (every process the test started dies with it), IPC namespace, and a mount namespace
  in which every mount is read-only, the invoking user's home is covered by an empty tmpfs (the
  interpreter's prefix is bound back), and the working directory is a private size-capped
  tmpfs. As root the child then becomes a uid of its own per worker slot (so RLIMIT_NPROC counts
  only its processes); otherwise a user namespace is used and every capability is dropped
  (RLIMIT_NPROC then counts per namespace).
* "socket-patch" (no usable namespaces, e.g. a container without CAP_SYS_ADMIN): sockets are
  replaced by a stub, the process group is killed at the end, RLIMIT_NPROC counts the user's
  processes. Files outside the working directory are protected only by permissions: as root the
  child still moves to a slot uid when the interpreter is world-readable, else it stays root
  and neither files nor the process count are protected (a warning is logged).

Cost: about 35 ms of CPU per test (interpreter start ~20 ms; unshare, ctypes, mounts ~15 ms).
Limits: the sandbox protects the machine, not the grade from a program written to forge it
(the result channel is written from inside the same interpreter as the tested code).

Not here: judging a finished test's output (verdict.py), grading policy and test specs
(rewards/code.py), languages other than Python.
"""

from __future__ import annotations

import inspect
import logging
import marshal
import math
import os
import pwd
import queue
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any

from ibpo.sandbox.child import FUNCTIONS
from ibpo.sandbox.verdict import classify

log = logging.getLogger(__name__)

STATUSES = ("passed", "failed", "timeout", "error", "skipped")
_MAX_SLOTS = max(1, min(os.cpu_count() or 1, 64))
_SLOTS: queue.Queue[int] = queue.Queue()
for _i in range(_MAX_SLOTS):
    _SLOTS.put(_i)
_USERNS = os.geteuid() != 0  # root drops to a slot uid instead of mapping itself in a user ns


@dataclass(frozen=True)
class Limits:
    # CPU seconds per test, interpreter start included. The kernel kills at the next whole
    # second (RLIMIT_CPU); a test that ends above time_s still counts as a timeout.
    time_s: float = 2.0
    memory_mb: int = 1024  # address space of each process
    max_output_bytes: int = 8 << 20  # stdout / stderr / any written file
    max_processes: int = 8  # processes + threads alive at once (the test itself counts)
    scratch_mb: int = 64  # size of the private working directory (namespaces mode)

    @property
    def wall_s(self) -> float:
        # Generous against a busy machine; CPU time is the fair limit.
        return 2 * self.time_s + 1


@dataclass(frozen=True)
class TestCase:
    __test__ = False  # not a pytest class

    kind: str  # "stdin" | "call" | "script"
    input: Any = ""  # stdin text | list of call arguments | unused
    expected: Any = None  # expected stdout text | expected return value | unused
    fn_name: str | None = None  # "call" only


@dataclass
class TestResult:
    __test__ = False

    status: str  # one of STATUSES
    reason: str = ""
    seconds: float = 0.0  # CPU seconds of the test (0 when skipped)
    isolation: str = ""


@cache
def isolation_mode() -> str:
    """'namespaces' when this machine lets us build the full sandbox, else 'socket-patch'."""
    if sys.platform == "linux" and shutil.which("unshare"):
        probe = _run_one("pass", TestCase("script"), Limits(time_s=10), "namespaces")
        if probe.status == "passed":
            return "namespaces"
        log.warning("sandbox: namespaces unavailable (%s); using socket-patch", probe.reason)
    if not _drops_to_slot_uid("socket-patch") and os.geteuid() == 0:
        log.warning("sandbox: tests will run as root with no file or process-count protection")
    return "socket-patch"


def run_tests(
    code: str,
    tests: Sequence[TestCase],
    limits: Limits = Limits(),
    workers: int | None = None,
    stop_on_first_failure: bool = False,
) -> list[TestResult]:
    """Run `code` against each test in its own sandbox; results in test order.

    At most `workers` (default and cap: CPU count) sandboxes run at once, across all threads of
    this process. With stop_on_first_failure, tests not yet started after a failure are skipped.
    """
    for t in tests:
        _validate(t)
    mode = isolation_mode()
    stop = threading.Event()

    def one(i: int) -> TestResult:
        if stop.is_set():
            return TestResult("skipped", f"test {i}: not run after an earlier failure", 0.0, mode)
        r = _run_one(code, tests[i], limits, mode)
        r.reason = f"test {i}: {r.reason}" if r.reason else ""
        if r.status != "passed" and stop_on_first_failure:
            stop.set()
        return r

    n = max(1, min(workers or _MAX_SLOTS, _MAX_SLOTS, len(tests)))
    if n == 1:
        return [one(i) for i in range(len(tests))]
    with ThreadPoolExecutor(n, thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, range(len(tests))))


def _validate(t: TestCase) -> None:
    ok = {
        "stdin": isinstance(t.input, str) and isinstance(t.expected, str),
        "call": isinstance(t.input, (list, tuple)) and bool(t.fn_name),
        "script": True,
    }.get(t.kind)
    if not ok:
        raise ValueError(
            f"bad test case {t!r}: kind 'stdin' needs str input and expected, 'call' needs a "
            "list of arguments and fn_name, 'script' needs nothing"
        )


def _run_one(code: str, test: TestCase, limits: Limits, mode: str) -> TestResult:
    slot = _SLOTS.get()  # blocks while every slot is busy: the global bound on parallelism
    workdir = tempfile.mkdtemp(prefix="ibpo-sandbox-")
    try:
        return _execute(code, test, limits, mode, slot, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        _SLOTS.put(slot)


def _execute(code: str, test: TestCase, limits: Limits, mode: str, slot: int, wd: str):
    path = lambda name: os.path.join(wd, name)
    with open(path("stdin"), "w", encoding="utf-8") as f:
        f.write(test.input if test.kind == "stdin" else "")
    # The child watches `alive`: it reads EOF only when this process dies before the test ends,
    # and then kills itself (and its namespace), so nothing outlives a crashed trainer.
    alive, keep_alive = os.pipe()
    try:
        with (
            open(path("stdin"), "rb") as fin,
            open(path("stdout"), "wb") as fout,
            open(path("stderr"), "wb") as ferr,
            open(path("result"), "wb") as fres,
        ):
            job = _job(code, test, limits, mode, slot, wd, (fres.fileno(), alive))
            with open(path("job.bin"), "wb") as f:
                marshal.dump(job, f)
            try:
                proc = subprocess.Popen(
                    _command(mode),
                    cwd=wd,
                    env=_child_env(wd),
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    pass_fds=(fres.fileno(), alive),
                    start_new_session=True,  # our own process group, killed as a whole
                )
            finally:
                os.close(alive)
            status, cpu, wall_killed = _wait(proc, limits.wall_s)
    finally:
        os.close(keep_alive)
    cap = limits.max_output_bytes
    out, err, res = (_read_capped(path(n), cap) for n in ("stdout", "stderr", "result"))
    st, reason = classify(test, limits, status, cpu, wall_killed, out, err, res)
    return TestResult(st, reason, round(cpu, 4), mode)


def _job(code, test, limits, mode, slot, wd, fds) -> dict:
    rl = [
        (resource.RLIMIT_CPU, max(1, math.ceil(limits.time_s))),  # soft = hard: SIGKILL
        (resource.RLIMIT_AS, limits.memory_mb << 20),
        (resource.RLIMIT_FSIZE, limits.max_output_bytes + 1),
        (resource.RLIMIT_NOFILE, 256),
        (resource.RLIMIT_CORE, 0),
    ]
    nproc = limits.max_processes + 1  # + the child's watcher thread
    if mode != "namespaces" and os.geteuid() != 0:
        nproc += _count_own_processes()  # without a namespace the count is per user
    rl.append((resource.RLIMIT_NPROC, nproc))
    ns = mode == "namespaces"
    return {
        "kind": test.kind,
        "code": code,
        "fn_name": test.fn_name or "",
        "args": list(test.input) if test.kind == "call" else [],
        "namespaces": ns,
        "uid": _slot_uid(slot) if _drops_to_slot_uid(mode) else -1,
        "hide": _homes_to_hide(wd) if ns else [],
        "scratch_mb": limits.scratch_mb,
        "rlimits": rl,
        "res_fd": fds[0],
        "alive_fd": fds[1],
    }


def _command(mode: str) -> list[str]:
    child = [os.path.realpath(sys.executable), "-S", "-s", "-B", "-c", _child_source()]
    if mode != "namespaces":
        return child
    ns = ["unshare", "--net", "--pid", "--ipc", "--mount-proc", "--kill-child"]
    return ns + (["--map-root-user"] if _USERNS else []) + child


@cache
def _child_source() -> str:
    return "\n".join(inspect.getsource(f) for f in FUNCTIONS) + "\n_child_main()\n"


def _child_env(wd: str) -> dict[str, str]:
    # Built from scratch: nothing of the parent's environment (tokens, paths) reaches the child.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": wd,
        "TMPDIR": wd,
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _drops_to_slot_uid(mode: str) -> bool:
    # Root always leaves root. Without namespaces that is possible only when the interpreter's
    # files are world-readable (typical containers), since nothing re-exposes them then.
    if os.geteuid() != 0:
        return False
    return (mode == "namespaces" and not _USERNS) or _world_readable(sys.base_prefix)


@cache
def _world_readable(path: str) -> bool:
    path = os.path.realpath(path)
    parts = [path, *_parents(path)]
    try:
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in parts) and bool(
            os.stat(path).st_mode & stat.S_IROTH
        )
    except OSError:
        return False


def _parents(path: str) -> list[str]:
    out = []
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        out.append(path)
    return out


def _slot_uid(slot: int) -> int:
    # A uid no account uses, distinct per worker slot and per parent process, so each test's
    # RLIMIT_NPROC counts only its own processes.
    return 1_500_000_000 + (os.getpid() % 100_000) * 64 + slot


def _homes_to_hide(wd: str) -> list[str]:
    under = lambda p, root: (p + "/").startswith(root.rstrip("/") + "/")
    homes = {os.path.expanduser("~"), pwd.getpwuid(os.getuid()).pw_dir}
    out: list[str] = []
    for h in sorted(os.path.realpath(h) for h in homes if h and os.path.isdir(h)):
        # Not "/", not a home holding our working directory, not one inside a hidden home.
        if h != "/" and not under(os.path.realpath(wd), h) and not any(under(h, o) for o in out):
            out.append(h)
    return out


def _count_own_processes() -> int:
    uid = os.getuid()
    n = 0
    for p in os.listdir("/proc"):
        try:
            n += p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid
        except OSError:
            pass
    return n


def _wait(proc: subprocess.Popen, wall_s: float) -> tuple[int, float, bool]:
    """Wait for the child; kill it at the wall limit. Returns (status, CPU seconds, killed)."""
    lock = threading.Lock()
    state = {"reaped": False, "killed": False}

    def kill(pg: bool) -> None:
        with lock:  # never signal a pid that may already have been reused
            if state["reaped"]:
                return
            state["killed"] = True
            # Kill unshare's child (PID 1 of the test's namespace) first: unshare then reaps it
            # only after the kernel has killed everything in the namespace. The process group
            # is the fallback (socket-patch mode, or unshare not exiting).
            for pid in [] if pg else _children(proc.pid):
                _kill(pid)
            if pg or not _children(proc.pid):
                _killpg(proc.pid)
            else:
                backup = threading.Timer(1.0, kill, (True,))
                backup.daemon = True
                backup.start()

    timer = threading.Timer(wall_s, kill, (False,))
    timer.daemon = True
    timer.start()
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    finally:
        timer.cancel()
        with lock:
            state["reaped"] = True
            _killpg(proc.pid)  # stragglers left in the group (socket-patch mode)
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return status, ru.ru_utime + ru.ru_stime, state["killed"]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: str, cap: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(cap + 1)
