"""A memory cap for a whole test, every process it starts: one memory cgroup per worker slot.

`memory_mode()`:

* "cgroup-v2": this process's cgroup (unified hierarchy) has the memory controller enabled for
  its children and is writable; each slot gets a child group with memory.max = the test's
  memory_mb and memory.swap.max = 0.
* "cgroup-v1": the v1 memory hierarchy is writable (root); each slot gets a group under this
  process's own with memory.limit_in_bytes (and memory.memsw.limit_in_bytes where swap is
  accounted) = memory_mb.
* "per-process": neither; only RLIMIT_AS binds: memory_mb of address space in each of the
  test's processes (max_processes + 2: those it may start, plus the sandbox's own). That is no
  bound on the whole test: pages held outside any address space (a memfd or shared-memory
  file written and unmapped, SysV segments and message queues, pipe and socket buffers, the
  scratch tmpfs) are not counted, so one test can hold gigabytes. Results say so, and a
  training run refuses it unless asked (policy.py, rewards/code.py).

A test is born in its group: the sandbox command is prefixed with `sh -c 'echo 0 >
cgroup.procs; exec ...'`, so every descendant starts inside it and nothing runs before the cap
binds. When the cap is reached the kernel OOM-kills inside the group only; `oom_kills` tells the
verdict so. The group also finds every process of a test when it ends: `kill_all` ends those
that left its session (the only way to find them in socket-patch mode as root). Groups are
removed when this process exits.

Not here: the per-process rlimits (child.py), running and judging a test (run.py, verdict.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import threading
import time
from functools import cache

log = logging.getLogger(__name__)

_ROOT = "/sys/fs/cgroup"
_WRAP = 'echo 0 > "$0" && exec "$@"'  # "0": the writing shell itself, then its exec
_made: dict[tuple[str, int], str] = {}
_limits: dict[str, str] = {}  # group -> the cap last written there
_lock = threading.Lock()


def memory_mode() -> str:
    """'cgroup-v2', 'cgroup-v1' or 'per-process' (see the module docstring)."""
    return _probe()[0]


def describe(memory_mb: int, max_processes: int, grouped: bool = True) -> str:
    """The memory bound in force for a test, as stated in each result; grouped=False: the test
    ran outside a group."""
    mode = memory_mode() if grouped else "per-process"
    if mode == "per-process":
        return (
            f"per-process: {memory_mb} MB of address space in each of up to "
            f"{max_processes + 2} processes; no bound on the whole test (memfd, shared memory "
            "and kernel buffers are outside it)"
        )
    return f"{mode}: {memory_mb} MB for the whole test"


def prepare(slot: int, memory_mb: int) -> str | None:
    """The group for a slot's next test, its cap set; None without cgroups, or when the group
    cannot be set up (the test then runs with the per-process bound only, stated so)."""
    mode, base = _probe()
    if mode == "per-process":
        return None
    try:
        return _prepare(mode, _group(slot, base), memory_mb)
    except OSError as e:
        log.warning("sandbox: memory cgroup unusable (%s); per-process bound only", e)
        return None


def _prepare(mode: str, group: str, memory_mb: int) -> str:
    limit = str(memory_mb << 20)
    if _limits.get(group) == limit:
        return group
    if mode == "cgroup-v2":
        _write(group, "memory.max", limit)
        _write(group, "memory.swap.max", "0", missing_ok=True)
    else:
        # memsw must stay >= limit: raise it first, lower it last.
        _write(group, "memory.memsw.limit_in_bytes", "-1", missing_ok=True)
        _write(group, "memory.limit_in_bytes", limit)
        _write(group, "memory.memsw.limit_in_bytes", limit, missing_ok=True)
    _limits[group] = limit
    return group


def wrap(group: str | None, command: list[str]) -> list[str]:
    """`command`, started inside `group`."""
    if group is None:
        return command
    return ["/bin/sh", "-c", _WRAP, os.path.join(group, "cgroup.procs"), *command]


def kill_all(group: str | None) -> int:
    """SIGKILL every process still in the group once its test has ended (a daemon that left the
    test's session and process group); -> how many were signalled. cgroup v2 kills the group
    at once (cgroup.kill); v1 is read and signalled until empty, so a process forked meanwhile
    is caught by the next round."""
    if group is None:
        return 0
    if memory_mode() == "cgroup-v2" and os.path.exists(os.path.join(group, "cgroup.kill")):
        n = len(_read(os.path.join(group, "cgroup.procs")).split())
        if n:
            _write(group, "cgroup.kill", "1", missing_ok=True)
        return n
    killed = 0
    for _ in range(1000):
        pids = [int(p) for p in _read(os.path.join(group, "cgroup.procs")).split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.001)  # let the killed leave the group
    return killed


def oom_kills(group: str | None) -> int:
    """How many processes the kernel has OOM-killed in the group so far."""
    if group is None:
        return 0
    name = "memory.events" if memory_mode() == "cgroup-v2" else "memory.oom_control"
    try:
        with open(os.path.join(group, name)) as f:
            fields = dict(ln.split() for ln in f if len(ln.split()) == 2)
        return int(fields.get("oom_kill", 0))
    except (OSError, ValueError):
        return 0


@cache
def _probe() -> tuple[str, str]:
    for mode, base in _candidates():
        _sweep(base)
        try:
            group = _group(0, base)
            _probe_mode(mode, group)
            return mode, base
        except (OSError, subprocess.SubprocessError) as e:
            log.info("sandbox: %s memory cgroups unusable at %s: %s", mode, base, e)
    return "per-process", ""


def _probe_mode(mode: str, group: str) -> None:
    want = os.path.basename(group)
    out = subprocess.run(wrap(group, ["cat", "/proc/self/cgroup"]), capture_output=True, timeout=10)
    if want not in out.stdout.decode():
        raise OSError(f"a process started there lands elsewhere: {out.stderr.decode()[:200]}")
    ctrl = "memory.max" if mode == "cgroup-v2" else "memory.limit_in_bytes"
    if not os.path.exists(os.path.join(group, ctrl)):
        raise OSError(f"no {ctrl}")


def _candidates() -> list[tuple[str, str]]:
    """(mode, directory holding the slot groups), most preferred first."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    except OSError:
        return []
    out = []
    for hid, controllers, path in (ln for ln in lines if len(ln) == 3):
        if hid == "0" and os.path.exists(f"{_ROOT}/cgroup.controllers"):
            base = _ROOT + path.rstrip("/")
            if "memory" in _read(os.path.join(base, "cgroup.subtree_control")).split():
                out.insert(0, ("cgroup-v2", base))
        elif "memory" in controllers.split(","):
            base = f"{_ROOT}/memory{path.rstrip('/')}"
            out.append(("cgroup-v1", base if os.path.isdir(base) else f"{_ROOT}/memory"))
    return out


def _sweep(base: str) -> None:
    """Remove the groups of sandboxing processes that died without cleaning up (SIGKILL)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith("ibpo-sandbox-")]
    except OSError:
        return
    for name in names:
        pid = name.split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(base, name))  # fails, harmlessly, while still in use
            except OSError:
                pass


def _group(slot: int, base: str) -> str:
    with _lock:
        if (base, slot) not in _made:
            group = os.path.join(base, f"ibpo-sandbox-{os.getpid()}-{slot}")
            os.makedirs(group, exist_ok=True)
            _made[base, slot] = group
        return _made[base, slot]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(group: str, name: str, value: str, missing_ok: bool = False) -> None:
    try:
        with open(os.path.join(group, name), "w") as f:
            f.write(value)
    except OSError:
        if not missing_ok:
            raise


@atexit.register
def _remove_groups() -> None:
    for group in _made.values():
        try:
            os.rmdir(group)
        except OSError:
            pass
