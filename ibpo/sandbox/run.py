"""Run untrusted generated Python against test cases, one throwaway sandbox per test.

Test kinds:

* "stdin": feed `input`, compare stdout with `expected` (`verdict.stdout_matches`).
* "call": call `fn_name(*input)` (a method of `class Solution` when the code defines one) and
  compare the JSON-encoded return value with `expected`.
* "check": `input` is trusted test code defining `check(candidate)` (HumanEval's harness, with
  the prompt's helpers); it runs in a process of its own against a proxy of the solution's
  `fn_name`. Arguments and return values cross as plain data (tagged JSON: lists, tuples,
  dicts, sets, str, int, float, bool, None, bytes, complex; subclasses of built-ins become their
  built-in value; anything else is an error), so every comparison is made on the harness's own
  objects, with its own builtins.
* "script": the whole program (solution and tests) runs in one interpreter and passes when it
  reaches its end, as in the official HumanEval harness. For evaluation comparable with that
  harness only: the tested code can forge this verdict (see Threat model).

Statuses: passed, failed (wrong answer, assertion), timeout, error (exception, crash, output
or memory limit, exit code), skipped (stop_on_first_failure).

Threat model: the tested code runs in the child's interpreter and can do anything Python and
libc allow there: read or patch all memory (ctypes), walk every frame (sys._getframe, gc),
open /proc/self, write any descriptor it holds, exit with any status. What it cannot change is
what this process observes itself: the wait status, CPU time, and the files it reads back
through its own descriptors (unnamed files, so no path leads to them). Hence:

* stdin: passed needs exit status 0 and the expected stdout. A record the program writes
  itself on the result channel can only make the test fail.
* call: the parent compares the reported value with `expected`, which never enters the
  sandbox; writing a forged value is the same as returning it.
* check: the harness's process alone holds the result channel and the test code; it never runs
  the solution's code and sees only decoded plain data, and it is non-dumpable, so the
  solution's process (same uid, no capabilities) cannot ptrace it or open its
  /proc/<pid>/{fd,mem}. Always-equal objects, overridden __eq__/__bool__/__hash__, patched
  builtins (isinstance, abs, math.isclose, AssertionError), sys.exit/os._exit and __del__
  tricks all stay in the solution's process.
* script: forgeable by design (the harness shares the interpreter with the solution).

Residual limits: in "socket-patch" mode without root the child runs as the trainer's own uid:
it can then reach the trainer's memory and descriptors, and a check test's harness, so no
verdict is safe there. As root it runs as a slot uid, which cannot; where that uid could not
read the interpreter (not world-readable) the child would stay root, so the mode is refused
there for every caller (uncontained). A check test
shows the solution none of the test code or expected values, but the solution still sees its
prompt and the arguments it is called with.

Each test runs in a fresh interpreter (`python -S -s -B`: no site-packages; an environment built
from scratch: no tokens, no PYTHONPATH) with rlimits on CPU time, address space, open files,
file size (caps stdout/stderr) and processes, plus a wall-clock timer; a pipe tells the child
when this process dies, so no sandbox outlives a crashed trainer. The keyring system calls fail
(child.py: keyrings belong to no namespace). The memory cap covers every process of the test
where cgroups allow, else only each one's address space (memory.py); every result states it
(`memory`). A process-wide policy (policy.py: a training run's) may refuse a mode or a test
without a whole-test memory bound, here, whatever called. `isolation_mode()`, the first that
works, stated in every result (`isolation`):

* "bwrap" (bubblewrap installed): new PID, network, IPC, UTS and cgroup namespaces; a root
  filesystem holding only read-only binds of /usr, /bin, /sbin, /lib*, of ETC_ALLOWED in /etc
  and of what the interpreter needs of its prefix, a fresh /proc and /dev, and a size-capped
  private /tmp as working directory, so no socket file of the host exists inside. As root the
  child then becomes a uid of its own per worker slot; otherwise bwrap's user namespace holds
  it, no capabilities.
* "namespaces" (util-linux `unshare` works): network, PID and IPC namespaces and a mount
  namespace in which the child builds the same view as bwrap's (_view: a tmpfs root holding
  read-only binds of the system directories and the interpreter, a fresh /proc, a minimal
  /dev and a size-capped private /tmp, moved over / and entered by chroot, every mount
  read-only but /tmp), so no other file or socket of the host has a path inside. As root the
  child becomes a slot uid (so RLIMIT_NPROC counts only its processes); otherwise a user
  namespace is used and every capability is dropped (RLIMIT_NPROC then counts per namespace).
* "socket-patch" (no usable namespaces, e.g. a container without CAP_SYS_ADMIN): sockets are
  replaced by a stub, RLIMIT_NPROC counts the user's processes. At the end the process group
  is killed, then every process left in the test's memory cgroup, and with a slot uid every
  process of that uid (which cannot leave its cgroup; without root or a writable cgroup a
  daemon in a session of its own escapes). Files outside the working directory are protected
  only by permissions. Not a sandbox for RL-written code: training refuses it unless asked
  (rewards/code.py, training_policy).

Cost (bench/bench_graders.py, 2 shared cores): a stdin, call or script test takes 12-18 ms of
CPU in the child and ~1.5 ms here, in every mode; a check test 21-22 ms (two processes). Starting a
test inside a cgroup-v1 memory group adds ~2 ms of CPU and 5-15 ms of wall time.

Not here: judging a finished test's output (verdict.py), the program run inside (child.py),
memory cgroups (memory.py), grading policy and test specs (rewards/code.py), other languages.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import marshal
import os
import queue
import resource
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

from ibpo.sandbox import memory, policy
from ibpo.sandbox.cases import Limits, TestCase
from ibpo.sandbox.child import FUNCTIONS
from ibpo.sandbox.verdict import classify

log = logging.getLogger(__name__)

STATUSES = ("passed", "failed", "timeout", "error", "skipped")
MODES = ("bwrap", "namespaces", "socket-patch")  # most isolated first
_MAX_SLOTS = max(1, min(os.cpu_count() or 1, 64))
_SLOTS: queue.Queue[int] = queue.Queue()
for _i in range(_MAX_SLOTS):
    _SLOTS.put(_i)
_USERNS = os.geteuid() != 0  # root drops to a slot uid instead of mapping itself in a user ns


@dataclass
class TestResult:
    __test__ = False

    status: str  # one of STATUSES
    reason: str = ""
    seconds: float = 0.0  # CPU seconds of the test (0 when skipped)
    isolation: str = ""  # one of MODES
    memory: str = ""  # the memory bound in force (memory.describe)


@cache
def isolation_mode() -> str:
    """The most isolated of MODES that works on this machine (see the module docstring)."""
    for mode in MODES[:-1]:
        if mode_works(mode):
            return mode
    log.warning("sandbox: no bwrap or namespaces; using socket-patch")
    if uncontained("socket-patch"):
        log.warning("sandbox: %s", uncontained("socket-patch"))
    return "socket-patch"


@cache
def mode_works(mode: str) -> bool:
    """Whether a sandbox in this isolation mode can be built here (a probe run) and contains
    what it runs well enough to be used at all (_uncontained)."""
    tool = {"bwrap": "bwrap", "namespaces": "unshare"}.get(mode)
    if tool and not (sys.platform == "linux" and shutil.which(tool)):
        return False
    if uncontained(mode):
        log.info("sandbox: %s mode refused: %s", mode, uncontained(mode))
        return False
    probe = _run_one("pass", TestCase("script"), Limits(time_s=10), mode, probe=True)
    if probe.status != "passed":
        log.info("sandbox: %s mode unavailable: %s", mode, probe.reason)
    return probe.status == "passed"


def uncontained(mode: str) -> str | None:
    """Why no test may run in `mode` here, whoever asks (policy or not); None when it may.
    Socket-patch as root stays root when the interpreter is not world-readable (a slot uid
    could not load it): the test could then do anything root can, e.g. move a daemon out of
    its memory cgroup and out of every kill, so it is refused."""
    if mode != "socket-patch" or os.geteuid() != 0 or _drops_to_slot_uid(mode):
        return None
    prefix = os.path.realpath(sys.base_prefix)
    return (
        f"socket-patch mode as root runs tests as a uid of their own, which cannot read the "
        f"interpreter here ({prefix} or a folder above it is not world-readable), and a test "
        "left as root is not contained. Fix: install bubblewrap (`bwrap --version` must work), "
        f"or make the interpreter world-readable (chmod o+rX on {prefix} and the folders above)"
    )


def run_tests(
    code: str,
    tests: Sequence[TestCase],
    limits: Limits = Limits(),
    workers: int | None = None,
    stop_on_first_failure: bool = False,
    mode: str | None = None,
) -> list[TestResult]:
    """Run `code` against each test in its own sandbox; results in test order.

    At most `workers` (default and cap: CPU count) sandboxes run at once, across all threads of
    this process. With stop_on_first_failure, tests not yet started after a failure are skipped.
    `mode`: one of MODES that works here (default: isolation_mode()), for comparing modes.
    """
    for t in tests:
        _validate(t)
    mode = mode or isolation_mode()
    stop = threading.Event()

    def one(i: int) -> TestResult:
        if stop.is_set():
            why = f"test {i}: not run after an earlier failure"
            return TestResult(
                "skipped", why, 0.0, mode, memory.describe(limits.memory_mb, limits.max_processes)
            )
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


@dataclass
class ProgramRun:
    """A program run as a script (run_program): its verdict and what it printed."""

    result: TestResult
    stdout: str
    stderr: str


def run_program(code: str, limits: Limits = Limits(), mode: str | None = None) -> ProgramRun:
    """Run `code` once as a script in its own sandbox (the isolation, limits and policy of every
    test) and keep what it printed, decoded as UTF-8 (invalid bytes replaced): the tool a
    policy calls during its rollouts (ibpo/tools/python.py). `result.status` is passed when
    the program reached its end, timeout when it ran out of time, error otherwise."""
    mode = mode or isolation_mode()
    outputs: list[tuple[bytes, bytes]] = []
    result = _run_one(code, TestCase("script"), limits, mode, outputs=outputs)
    out, err = outputs[0] if outputs else (b"", b"")
    return ProgramRun(result, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _validate(t: TestCase) -> None:
    ok = {
        "stdin": isinstance(t.input, str) and isinstance(t.expected, str),
        "call": isinstance(t.input, (list, tuple)) and bool(t.fn_name),
        "check": isinstance(t.input, str) and bool(t.fn_name),
        "script": True,
    }.get(t.kind)
    if not ok:
        raise ValueError(
            f"bad test case {t!r}: kind 'stdin' needs str input and expected, 'call' needs a "
            "list of arguments and fn_name, 'check' test code and fn_name, 'script' nothing"
        )


def _run_one(
    code: str, test: TestCase, limits: Limits, mode: str, probe: bool = False, outputs=None
) -> TestResult:
    """One test in its own sandbox. `probe`: mode_works's trusted program, which the policy in
    force neither refuses nor counts. `outputs`: a list that gets the test's (stdout, stderr),
    capped at limits.max_output_bytes (run_program)."""
    # the policy's word on the mode first (its memory bound is judged once the test's group is
    # set up: policy.admit), then whether the mode can contain a test here at all
    why = (None if probe else policy.refusal(mode, grouped=True)) or uncontained(mode)
    if why:
        raise policy.Refused(why)
    slot = _SLOTS.get()  # blocks while every slot is busy: the global bound on parallelism
    workdir = tempfile.mkdtemp(prefix="ibpo-sandbox-")
    try:
        return _execute(code, test, limits, mode, slot, workdir, probe, outputs)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        _SLOTS.put(slot)


def _execute(code, test, limits, mode, slot, wd, probe, outputs=None) -> TestResult:
    group = memory.prepare(slot, limits.memory_mb)
    bound = memory.describe(limits.memory_mb, limits.max_processes, group is not None)
    if not probe:  # the process's policy (a training run's), whoever called: may refuse
        policy.admit(mode, group is not None, bound)
    # Unnamed files, read back through this process's descriptors: no path inside or outside
    # the sandbox leads to them, so none can be swapped for another file.
    names = ("stdin", "stdout", "stderr", "result", "job", "harness")
    with contextlib.ExitStack() as stack:
        f = {n: stack.enter_context(tempfile.TemporaryFile(dir=wd)) for n in names}
        _fill(f["stdin"], test.input if test.kind == "stdin" else "")
        _fill(f["harness"], test.input if test.kind == "check" else "")
        # The child watches `alive`: it reads EOF only when this process dies before the test
        # ends, and then kills itself (and its namespace), so nothing outlives a crashed trainer.
        alive, keep_alive = os.pipe()
        stack.callback(os.close, keep_alive)
        fds = {n: f[n].fileno() for n in ("result", "job", "harness")} | {"alive": alive}
        job = _job(code, test, limits, mode, slot, wd, fds)
        marshal.dump(job, f["job"])
        f["job"].seek(0)
        oom_before = memory.oom_kills(group)
        try:
            proc = subprocess.Popen(
                memory.wrap(group, _command(mode, limits, fds["job"])),
                cwd=wd,
                env=_child_env(wd if mode == "socket-patch" else "/tmp"),
                stdin=f["stdin"],
                stdout=f["stdout"],
                stderr=f["stderr"],
                pass_fds=tuple(fds.values()),
                start_new_session=True,  # our own process group, killed as a whole
            )
        finally:
            os.close(alive)
        status, cpu, wall_killed = _wait(proc, limits.wall_s)
        _end_leftovers(group, job["uid"], mode)
        cap = limits.max_output_bytes
        out, err, res = (_read_back(f[n], cap) for n in ("stdout", "stderr", "result"))
    if outputs is not None:
        outputs.append((out[:cap], err[:cap]))
    st, reason = classify(test, limits, status, cpu, wall_killed, out, err, res)
    if st != "passed" and memory.oom_kills(group) > oom_before:
        st, reason = "error", f"memory limit {limits.memory_mb} MB for the whole test exceeded"
    return TestResult(st, reason, round(cpu, 4), mode, bound)


def _end_leftovers(group: str | None, uid: int, mode: str) -> None:
    """Kill what a test left running. A PID namespace (bwrap, namespaces) already ended with its
    first process; in socket-patch mode a daemon in a session of its own escapes the process
    group kill, so every process left in the test's memory group dies, and with a slot uid
    every process of that uid (which would count against the slot's next test's RLIMIT_NPROC)."""
    memory.kill_all(group)
    if mode == "socket-patch" and uid >= 0:
        # kill(-1) as the slot uid reaches exactly that uid's processes, whatever their session.
        kill = shutil.which("kill", path="/usr/bin:/bin") or "kill"
        try:
            subprocess.run(
                [kill, "-KILL", "-1"],
                user=uid,
                group=uid,
                extra_groups=[],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError) as e:  # the verdict stands; logged
            log.warning("sandbox: could not end slot uid %d's leftover processes: %s", uid, e)
        # The killed stay zombies until init reaps them, and count against RLIMIT_NPROC until
        # then: the slot is handed on only once they are gone.
        deadline = time.monotonic() + 2
        while _count_processes(uid) and time.monotonic() < deadline:
            time.sleep(0.005)


def _fill(f, text: str) -> None:
    f.write(text.encode("utf-8"))
    f.flush()
    f.seek(0)


def _job(code, test, limits, mode, slot, wd, fds) -> dict:
    rl = [
        (resource.RLIMIT_CPU, limits.cpu_limit_s),  # soft = hard: SIGKILL
        (resource.RLIMIT_AS, limits.memory_mb << 20),
        (resource.RLIMIT_FSIZE, limits.max_output_bytes + 1),
        (resource.RLIMIT_NOFILE, 256),
        (resource.RLIMIT_CORE, 0),
    ]
    # + the child's watcher thread, + the solution's process of a check test
    nproc = limits.max_processes + 1 + (test.kind == "check")
    if mode == "socket-patch" and os.geteuid() != 0:
        nproc += _count_processes(os.getuid())  # without a namespace the count is per user
    rl.append((resource.RLIMIT_NPROC, nproc))
    return {
        "kind": test.kind,
        "code": code,
        "fn_name": test.fn_name or "",
        "args": list(test.input) if test.kind == "call" else [],
        "mode": mode,
        "uid": _slot_uid(slot) if _drops_to_slot_uid(mode) else -1,
        "view": [list(v) for v in _view()] if mode == "namespaces" else [],
        "scratch_mb": limits.scratch_mb,
        "max_bytes": limits.max_output_bytes,
        "rlimits": rl,
        "res_fd": fds["result"],
        "alive_fd": fds["alive"],
        "harness_fd": fds["harness"],
    }


def _command(mode: str, limits: Limits, job_fd: int) -> list[str]:
    exe = os.path.realpath(sys.executable)
    child = [exe, "-S", "-s", "-B", "-c", _child_source(), str(job_fd)]
    if mode == "bwrap":
        return _bwrap(limits) + child
    if mode != "namespaces":
        return child
    ns = ["unshare", "--net", "--pid", "--ipc", "--mount-proc", "--kill-child"]
    return ns + (["--map-root-user"] if _USERNS else []) + child


def _bwrap(limits: Limits) -> list[str]:
    if os.geteuid() == 0:
        # No user namespace: the child leaves root for a slot uid itself (setuid needs these).
        ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
        ns += ["--unshare-cgroup-try"] + [a for c in _SETID for a in ("--cap-add", c)]
    else:
        ns = ["--unshare-all", "--unshare-user", "--disable-userns"]
    # --as-pid-1: no reaper of bwrap's own between the child and us, so wait4 counts the
    # child's CPU time; the child is the namespace's init, and the test ends with it.
    opts = ["--as-pid-1", "--die-with-parent", "--new-session"]
    return ["bwrap", *ns, *opts, *_bwrap_root()] + [
        *("--proc", "/proc", "--dev", "/dev"),
        *("--size", str(limits.scratch_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"),
        *("--chdir", "/tmp"),
    ]


_SETID = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


@cache
def _bwrap_root() -> tuple[str, ...]:
    """bwrap's arguments for the test's filesystem view (_view)."""
    out: list[str] = []
    for kind, *paths in _view():
        if kind == "symlink":
            out += ["--symlink", *paths]
        elif kind == "dir":  # bwrap would copy the host's modes (e.g. root's 0700 home)
            out += ["--perms", "0755", "--dir", paths[0]]
        elif kind == "empty":  # an empty, read-only folder over what the bind above shows
            out += ["--size", "4096", "--tmpfs", paths[0], "--remount-ro", paths[0]]
        else:
            out += ["--ro-bind", paths[0], paths[0]]
    return tuple(out)


# What a test sees of the host's /etc: only what the interpreter and its shared libraries read
# (the dynamic loader's cache of library paths). Everything else there (pip.conf and netrc with
# tokens, the package manager's credentials, host names, users) stays out of sight.
ETC_ALLOWED = ("ld.so.cache",)


@cache
def _view() -> tuple[tuple[str, ...], ...]:
    """What a test sees of the host besides a fresh /proc, a minimal /dev and a private /tmp, in
    bwrap and namespaces modes alike: read-only binds of the system directories, of the files
    of /etc in ETC_ALLOWED and of what the interpreter needs of its prefix (_interpreter_view),
    with traversable parents, nothing
    else (no homes, no project, no /opt, /var, /run or /srv, so no socket file of the host
    either). Entries: ("bind", path) of a folder or a file, ("symlink", target, path),
    ("dir", path), ("empty", path): an empty folder over one a bind shows."""
    out: list[tuple[str, ...]] = []
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            out.append(("symlink", os.readlink(d), d))
        elif os.path.isdir(d):
            out.append(("bind", d))
    out.append(("dir", "/etc"))
    for name in ETC_ALLOWED:
        path = os.path.join("/etc", name)
        if os.path.islink(path):
            out.append(("symlink", os.readlink(path), path))
        elif os.path.isfile(path):
            out.append(("bind", path))
    out += _interpreter_view()
    return tuple(out)


def _interpreter_view() -> list[tuple[str, ...]]:
    """What the interpreter needs of its prefix when that lies outside the system directories
    (pyenv, conda, a self-built Python): the executable, the library folders (the standard
    library, its extension modules and the shared libraries they load), and nothing else of
    the prefix, whose top holds configuration a user may have put a token in (.condarc,
    pip.conf, etc/). The standard library's site-packages shows empty: the child runs with -S,
    so it imports nothing from there, and its files are the user's, not the interpreter's."""
    exe = os.path.realpath(sys.executable)
    # the base interpreter's paths (a virtual environment's own site-packages is not bound)
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    libs = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib")}
    libs |= {os.path.realpath(d) for d in (sysconfig.get_config_var("LIBDIR"),) if d}
    system = ("/usr/", "/bin/", "/sbin/", "/lib")
    wanted = sorted(p for p in {exe, *libs} if os.path.exists(p) and not p.startswith(system))
    out: list[tuple[str, ...]] = []
    for p in wanted:
        if any(p.startswith(q + "/") for q in wanted if q != p):
            continue  # inside a folder bound already (the stdlib inside LIBDIR)
        out += [("dir", parent) for parent in reversed(_parents(p)[:-1])]
        out.append(("bind", p))
    site = {os.path.realpath(paths[k]) for k in ("purelib", "platlib")}
    out += [("empty", d) for d in sorted(site) if os.path.isdir(d) and not d.startswith(system)]
    return list(dict.fromkeys(out))  # parents shared by two paths: once


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
    if mode == "bwrap":
        return True
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


def _count_processes(uid: int) -> int:
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


def _read_back(f, cap: int) -> bytes:
    f.seek(0)
    return f.read(cap + 1)
