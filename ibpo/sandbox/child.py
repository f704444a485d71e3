"""The sandbox's child program (run.py runs it): these functions are sent as source text to
`python -S -c` and run there as a script, in a fresh interpreter inside the sandbox. They may use
only the standard library and each other, never module globals (there are none at run time).
Order matters: build the sandbox, drop privileges and set limits, only then run the code.

The job arrives on an inherited file descriptor (argv[1]) of an unnamed file, so no path in the
sandbox leads to it. A "check" test runs in two processes forked here: the solution's process
(everything the solution can touch) only answers calls of the entry point with values encoded
as tagged JSON; the harness's process runs the trusted test code against a proxy that decodes
those values, and alone holds the result channel. The harness's process is made non-dumpable
before the fork, so the solution's process (same uid, no capabilities) can neither ptrace it nor
open its /proc/<pid>/fd or /proc/<pid>/mem; every other descriptor is closed before the
solution runs, the test code reaches only the harness's process, through its own unnamed fd, and
the harness imports nothing from the working directory, which the solution may write.

Before any of the tested code runs, the child also shuts the system calls that reach what no
namespace contains, for itself and everything it starts: keyrings (after leaving the trainer's
session keyring for an empty one), io_uring and new namespaces (_child_syscalls). A check
test's harness whose solution's process was killed (its CPU limit) ends as a killed test is
reported, so the verdict is a timeout there too.

Not here: choosing the isolation, starting and timing the child, or judging its output
(run.py, verdict.py). Nothing here is called in the parent process.
"""


def _child_main():
    import _thread
    import ctypes
    import marshal
    import os
    import sys

    with os.fdopen(int(sys.argv[1]), "rb") as f:
        job = marshal.load(f)
    os.environ.pop("PWD", None)  # set by bwrap and sh: the environment is the parent's alone
    libc = ctypes.CDLL(None, use_errno=True)
    if job["mode"] == "namespaces":
        _child_sandbox(job, libc)
    _child_limit(job, libc)

    def exit_when_parent_dies(fd):
        while os.read(fd, 1):
            pass
        os.killpg(0, 9)
        os._exit(137)

    # Started only now: capabilities and the bounding set are per thread.
    _thread.start_new_thread(exit_when_parent_dies, (job["alive_fd"],))
    if job["kind"] == "check":
        _child_check(job, libc)
    _child_run(job)


def _child_die(what):
    import ctypes
    import os

    os.write(2, f"sandbox setup failed: {what}: {os.strerror(ctypes.get_errno())}\n".encode())
    os._exit(121)  # sandbox_verdict.SETUP_FAILED


def _child_sandbox(job, libc):
    """The test's root (namespaces mode), as bwrap builds it: a tmpfs holding read-only binds of
    what job["view"] lists, a fresh /proc, a minimal /dev and a size-capped /tmp, moved over /
    and entered by chroot, so that no path leads to any other file of the host."""
    import ctypes
    import os

    nosuid, nodev, noexec, bind, move, rec = 2, 4, 8, 4096, 8192, 16384

    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            _child_die(f"mount {dst}")

    os.umask(0o022)
    root = os.getcwd()  # the working directory: private to this mount namespace
    mount("tmpfs", root, "tmpfs", nosuid | nodev, "size=1m,mode=755")
    for entry in job["view"]:
        kind, path = entry[0], root + entry[-1]
        if kind == "symlink":
            os.symlink(entry[1], path)
        elif kind == "bind" and not os.path.isdir(entry[1]):  # a file: mounted on an empty one
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
        else:
            os.makedirs(path, exist_ok=True)
        if kind == "bind":
            mount(entry[1], path, None, bind | rec)
        elif kind == "empty":  # over a bound folder; read-only with the rest, below
            mount("tmpfs", path, "tmpfs", nosuid | nodev | noexec, "size=4k,mode=755")
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", nosuid | nodev | noexec)
    os.mkdir(root + "/dev")
    mount("tmpfs", root + "/dev", "tmpfs", nosuid | noexec, "size=64k,mode=755")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        if os.path.exists("/dev/" + name):
            os.close(os.open(f"{root}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
            mount("/dev/" + name, f"{root}/dev/{name}", None, bind)
    for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        os.symlink("/proc/self/fd" + target, f"{root}/dev/{name}")
    os.mkdir(root + "/tmp")
    os.chdir(root)
    mount(".", "/", None, move)  # the host's root now lies under ours, out of every path
    if libc.chroot(b".") != 0:
        _child_die("chroot")
    os.chdir("/")
    # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, {MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID})
    attr = (ctypes.c_uint64 * 4)(1 | 2, 0, 0, 0)
    c = ctypes
    if libc.syscall(c.c_long(442), c.c_int(-100), b"/", c.c_uint(0x8000), attr, c.c_size_t(32)):
        _child_die("read-only remount")
    owner = max(job["uid"], 0)
    opts = f"size={job['scratch_mb']}m,mode=700,uid={owner},gid={owner}"
    mount("tmpfs", "/tmp", "tmpfs", nosuid | nodev, opts)
    os.chdir("/tmp")


def _child_limit(job, libc):
    """Block sockets when there is no netns, drop every privilege, set the rlimits."""
    import ctypes
    import os

    isolated = job["mode"] != "socket-patch"
    if not isolated:
        import _socket
        import socket  # imported before leaving root: the stdlib may be unreadable afterwards

        class NoNetwork:
            def __init__(self, *args, **kwargs):
                raise PermissionError("network access is disabled in the sandbox")

        socket.socket = socket.SocketType = _socket.socket = NoNetwork
    if job["uid"] >= 0 or isolated:
        for cap in range(64):  # empty the bounding set: no later exec can regain a capability
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP; EINVAL past the last cap
                break
    if job["uid"] >= 0:  # root: become a uid of our own (clears all capabilities)
        if not isolated:
            os.chown(".", job["uid"], job["uid"])
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    elif isolated and libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()):
        _child_die("capset")
    if isolated:
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL again: setuid cleared it
        with open("/proc/self/status") as f:
            if any(ln.startswith("CapEff:") and int(ln.split()[1], 16) for ln in f):
                _child_die("capabilities remain")
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: setuid binaries stay powerless
        _child_die("no_new_privs")
    _child_syscalls(libc)  # after no_new_privs, which an unprivileged filter needs
    for res, val in job["rlimits"]:
        if libc.setrlimit(res, (ctypes.c_ulong * 2)(val, val)) != 0:
            _child_die(f"setrlimit {res}")


def _child_syscalls(libc):
    """System calls no test needs and that reach what no namespace contains, shut for this
    process and everything it starts by a seccomp filter (which no later call can lift):
    * the keyring calls (add_key, request_key, keyctl) fail with ENOSYS, as in a kernel without
      keys: keyrings belong to no namespace, so a test's keys would reach the next test of its
      slot uid and outlive the trainer. Before the filter the child joins a new, empty session
      keyring, so that it no longer possesses the trainer's (whose keys /proc/keys would list);
    * io_uring (setup, enter, register) fails with ENOSYS: a large kernel surface of its own;
    * new namespaces fail with EPERM: unshare and setns always, clone with a CLONE_NEW* flag, and
      clone3 (whose flags a filter cannot read) with ENOSYS, so that the C library falls back to
      clone. A user namespace of its own would hold every capability inside (CAP_SYS_ADMIN,
      CAP_NET_ADMIN: the route of nf_tables-class privilege escalations).
    A system-call ABI not listed here fails every call."""
    import ctypes
    import os

    # audit arch -> (add_key, request_key, keyctl, unshare, setns, clone, clone3, clone's flags
    # argument offset in seccomp_data); io_uring is 425-427 everywhere; x32 sets bit 30 of
    # x86_64's numbers
    abis = {
        0xC000003E: (248, 249, 250, 272, 308, 56, 435, 16),  # x86_64 (and x32)
        0x40000003: (286, 287, 288, 310, 346, 120, 435, 16),  # i386
        0xC00000B7: (217, 218, 219, 97, 268, 220, 435, 16),  # aarch64
        0x40000028: (309, 310, 311, 337, 375, 120, 435, 16),  # arm
        0xC00000F3: (217, 218, 219, 97, 268, 220, 435, 16),  # riscv64
        0xC0000102: (217, 218, 219, 97, 268, 220, 435, 16),  # loongarch64
        0xC0000015: (269, 270, 271, 282, 350, 120, 435, 16),  # ppc64le
        0x80000015: (269, 270, 271, 282, 350, 120, 435, 20),  # ppc64: big-endian low word
        0x80000016: (278, 279, 280, 303, 339, 120, 435, 28),  # s390x: flags second, big-endian
    }
    native = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "riscv64": 0xC00000F3,
              "loongarch64": 0xC0000102, "ppc64le": 0xC0000015, "ppc64": 0x80000015,
              "s390x": 0x80000016}  # fmt: skip
    arch = native.get(os.uname().machine)
    if arch is None:
        ctypes.set_errno(38)
        _child_die(f"no system-call filter for {os.uname().machine}")
    # KEYCTL_JOIN_SESSION_KEYRING (1) with no name: a new anonymous session keyring
    if libc.syscall(ctypes.c_long(abis[arch][2]), ctypes.c_long(1), None) < 0:
        if ctypes.get_errno() not in (38, 1):  # ENOSYS (no keys here) or EPERM: nothing held
            _child_die("join an empty session keyring")
    ld, jeq, jset, ret, and_ = 0x20, 0x15, 0x45, 0x06, 0x54  # BPF_LD|W|ABS, JMP|JEQ|K, ...
    allow, enosys, eperm = 0x7FFF0000, 0x00050000 | 38, 0x00050000 | 1
    new_ns = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
    prog, labels, fixups = [], {}, []  # fixups: (index, true label, false label)

    def op(code, k, t=None, f=None):
        if t is not None or f is not None:
            fixups.append((len(prog), t, f))
        prog.append([code, 0, 0, k])

    op(ld, 4)  # seccomp_data.arch
    for i, a in enumerate(abis):
        op(jeq, a, f"abi{i}", None)
    op(ret, enosys)  # an ABI not listed: no system call at all
    for i, nrs in enumerate(abis.values()):
        add_key, request_key, keyctl, unshare, setns, clone, clone3, flags = nrs
        labels[f"abi{i}"] = len(prog)
        op(ld, 0)  # seccomp_data.nr
        op(and_, 0xBFFFFFFF)
        for nr in (add_key, request_key, keyctl, 425, 426, 427, clone3):
            op(jeq, nr, f"enosys{i}", None)
        for nr in (unshare, setns):
            op(jeq, nr, f"eperm{i}", None)
        op(jeq, clone, f"clone{i}", None)
        op(ret, allow)
        labels[f"clone{i}"] = len(prog)
        op(ld, flags)  # the low word of clone's flags
        op(jset, new_ns, f"eperm{i}", None)
        op(ret, allow)
        labels[f"eperm{i}"] = len(prog)
        op(ret, eperm)
        labels[f"enosys{i}"] = len(prog)
        op(ret, enosys)
    for at, t, f in fixups:  # jumps are relative to the next instruction
        prog[at][1] = 0 if t is None else labels[t] - at - 1
        prog[at][2] = 0 if f is None else labels[f] - at - 1
        if not (0 <= prog[at][1] < 256 and 0 <= prog[at][2] < 256):
            _child_die("system-call filter: a jump out of range")

    class Insn(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint32),
        ]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    insns = (Insn * len(prog))(*(Insn(*x) for x in prog))
    fprog = Prog(len(prog), insns)
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        _child_die("system-call filter (seccomp)")


def _child_entry(job, g):
    name, sol = job["fn_name"], g.get("Solution")
    if isinstance(sol, type) and hasattr(sol, name):
        return getattr(sol(), name)
    if callable(g.get(name)):
        return g[name]
    raise NameError(f"no function or Solution method named {name!r}")


def _child_call(job, g):
    import json

    value = _child_entry(job, g)(*job["args"])
    try:
        return "V " + json.dumps(value)  # tuples become lists, as in the expected JSON
    except (TypeError, ValueError):
        return "R " + repr(value)[:200]


def _child_encode(v):
    """Plain data as JSON: lists stay lists, every JSON object is a tag (tuple, dict, set,
    frozenset, bytes, complex). Subclasses of built-ins become their built-in value."""
    if v is None or v is True or v is False:
        return v
    for base, conv in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(v, base):
            return conv(v)
    if isinstance(v, list):
        return [_child_encode(x) for x in list.__iter__(v)]
    if isinstance(v, tuple):
        return {"t": [_child_encode(x) for x in tuple.__iter__(v)]}
    if isinstance(v, dict):
        return {"d": [[_child_encode(k), _child_encode(x)] for k, x in dict.items(v)]}
    for tag, base in (("s", set), ("f", frozenset)):
        if isinstance(v, base):
            return {tag: [_child_encode(x) for x in base.__iter__(v)]}
    if isinstance(v, bytes):
        return {"b": bytes.hex(v)}
    if isinstance(v, complex):
        return {"c": [complex.real.__get__(v), complex.imag.__get__(v)]}
    raise TypeError(f"a value of type {type(v).__name__} cannot cross to the test harness")


def _child_decode(v):
    """The inverse of _child_encode; builds built-in objects only."""
    if isinstance(v, list):
        return [_child_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    (tag, x), *rest = v.items() if len(v) == 1 else [(None, None)]
    if tag == "t":
        return tuple(_child_decode(i) for i in x)
    if tag == "d":
        return {_child_decode(k): _child_decode(i) for k, i in x}
    if tag in ("s", "f"):
        return (set if tag == "s" else frozenset)(_child_decode(i) for i in x)
    if tag == "b":
        return bytes.fromhex(x)
    if tag == "c":
        return complex(float(x[0]), float(x[1]))
    raise ValueError("malformed value from the solution's process")


def _child_send(fd, obj):
    import json
    import os

    data = json.dumps(obj).encode()
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data) :]


def _child_recv(fd, cap):
    import json
    import os

    def exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the solution's process ended")
            buf += chunk
        return buf

    n = int.from_bytes(exactly(8), "little")
    if n > cap:
        raise OverflowError(f"a value of {n} bytes from the solution is over the output limit")
    return json.loads(exactly(n))


def _child_serve(job, rfd, wfd):
    """The solution's process: run the code, then answer each call of the entry point."""
    import builtins
    import os
    import sys

    builtins.exit = builtins.quit = sys.exit  # normally added by site, which -S skips
    sys.argv = ["solution.py"]
    g = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(job["code"], "solution.py", "exec"), g)
        fn = _child_entry(job, g)
    except BaseException as e:
        _child_send(wfd, {"err": [type(e).__name__, str(e)[:300]]})
        raise
    _child_send(wfd, {"ok": None})
    while True:
        try:
            args, kwargs = _child_decode(_child_recv(rfd, 1 << 40))
        except EOFError:
            os._exit(0)
        try:
            reply = {"ok": _child_encode(fn(*args, **kwargs))}
        except BaseException as e:  # the harness decides what an exception means
            reply = {"err": [type(e).__name__, str(e)[:300]]}
        _child_send(wfd, reply)


def _child_reply(reply):
    """A reply of the solution's process (untrusted JSON) as a value, or the exception to raise."""
    import builtins

    if not (isinstance(reply, dict) and len(reply) == 1 and ("ok" in reply or "err" in reply)):
        raise ValueError("malformed reply from the solution's process")
    if "ok" in reply:
        return _child_decode(reply["ok"])
    name, msg = (list(reply["err"]) + ["", ""])[:2]
    cls = getattr(builtins, str(name), None)
    # The harness may test for the class a solution raises (`except ValueError`), so it keeps
    # its class, but for the ones Python's own protocols read as a signal: a StopIteration out
    # of a call inside map(), filter(), zip() or iter(f, sentinel) ends that iteration as if it
    # were exhausted, so `all(map(...))` would hold and `any(map(...))` fail without a single
    # answer checked. Those arrive as RuntimeError, as PEP 479 turns them inside generators.
    signals = (StopIteration, StopAsyncIteration)
    if not (isinstance(cls, type) and issubclass(cls, Exception)) or issubclass(cls, signals):
        cls = RuntimeError
    raise cls(f"{name}: {msg}" if cls is RuntimeError else str(msg))


def _child_check(job, libc):
    """A check test: fork the solution's process, run the trusted harness against a proxy."""
    import builtins
    import json  # noqa: F401  (imported once, before the fork: both processes use it)
    import os
    import sys
    import time
    import traceback

    # Non-dumpable before the fork, so no moment exists when the solution could attach.
    if libc.prctl(4, 0, 0, 0, 0) != 0 or libc.prctl(3, 0, 0, 0, 0) != 0:  # PR_[SG]ET_DUMPABLE
        _child_die("non-dumpable")
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        lo, hi = sorted((req_r, rep_w))
        os.closerange(3, lo)  # the result channel, the harness, the job: all out of reach
        os.closerange(lo + 1, hi)
        os.closerange(hi + 1, 1 << 16)
        try:
            _child_serve(job, req_r, rep_w)
        finally:
            os._exit(1)
    os.close(req_r)
    os.close(rep_w)
    # The working directory is the solution's to write: the harness imports nothing from it.
    cwd = os.path.realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != cwd]
    with os.fdopen(job["harness_fd"], "rb") as f:
        harness = f.read().decode()

    def candidate(*args, **kwargs):
        _child_send(req_w, _child_encode([list(args), kwargs]))
        return _child_reply(_child_recv(rep_r, job["max_bytes"]))

    status, ended = "D", False
    try:
        _child_reply(_child_recv(rep_r, job["max_bytes"]))  # the solution loaded, or why not
        g = {"__name__": "harness", "__builtins__": builtins}
        exec(compile(harness, "test.py", "exec"), g)
        g[job["fn_name"]] = candidate  # the prompt's helpers call the solution, not the stub
        g["check"](candidate)
    except BaseException as e:
        status = f"E {type(e).__name__}: {e}".rstrip(": ").replace("\n", " ")[:300]
        ended = isinstance(e, EOFError)  # the solution's process closed its end: it is exiting
        traceback.print_exc()
    # Reaped, so that its CPU time counts in ours. When it ended by itself, how: a SIGKILL then
    # came from the kernel (its CPU limit), and this process ends as a killed test is reported
    # (exit code 137, no record), so the verdict names it as it would for a one-process test.
    st = None
    for _ in range(200 if ended else 0):
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        st = None
        time.sleep(0.001)
    if st is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    elif os.WIFSIGNALED(st) and os.WTERMSIG(st) == 9:
        os._exit(137)
    os.write(job["res_fd"], (status + "\n").encode("utf-8", "replace"))
    os._exit(0 if status == "D" else 1)


def _child_run(job):
    """Run the untrusted code; one status line goes to the result fd (D = reached the end)."""
    import builtins
    import os
    import sys

    kind = job["kind"]
    builtins.exit = builtins.quit = sys.exit  # normally added by site, which -S skips
    sys.argv = ["solution.py"]
    # Only a stdin program runs as __main__: HumanEval-style script tests (and call tests) do
    # not run the solution's own `if __name__ == "__main__":` demo, as their harnesses do not.
    g = {"__name__": "__main__" if kind == "stdin" else "solution", "__builtins__": builtins}
    status = "D"
    try:
        exec(compile(job["code"], "solution.py", "exec"), g)
        if kind == "call":
            status = _child_call(job, g)
    except SystemExit as e:
        if not (kind == "stdin" and e.code in (None, 0)):
            status = f"X {e.code}"[:200]
    except BaseException as e:
        try:
            import traceback

            traceback.print_exc()
            status = f"E {type(e).__name__}: {e}".rstrip(": ")
        except BaseException:
            status = f"E {type(e).__name__}"
    try:
        sys.stdout.flush()
        sys.__stdout__.flush()
    except BaseException as e:
        status = f"E {type(e).__name__}: {e}"
    line = status if status[0] in "VD" else status.replace("\n", " ")[:300]
    try:
        os.write(job["res_fd"], (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass
    os._exit(0 if status[0] in "VRD" else 1)


# What run.py sends, in this order, followed by a call of _child_main().
FUNCTIONS = (
    *(_child_die, _child_sandbox, _child_limit, _child_syscalls, _child_entry, _child_call),
    _child_encode,
    *(_child_decode, _child_send, _child_recv, _child_serve, _child_reply, _child_check),
    *(_child_run, _child_main),
)
