"""The sandbox's child program (sandbox.py runs it): these functions are sent as source text to
`python -S -c` and run there as a script, in a fresh interpreter inside the sandbox. They may use
only the standard library and each other, never module globals (there are none at run time).
Order matters: build the sandbox, drop privileges and set limits, only then run the code.

Not here: choosing the isolation, starting and timing the child, or judging its output
(sandbox.py). Nothing here is called in the parent process.
"""


def _child_main():
    import _thread
    import ctypes
    import marshal
    import os

    with open("job.bin", "rb") as f:  # read before the working directory is covered
        job = marshal.load(f)
    libc = ctypes.CDLL(None, use_errno=True)
    if job["namespaces"]:
        _child_sandbox(job, libc)
    _child_limit(job, libc)

    def exit_when_parent_dies(fd):
        while os.read(fd, 1):
            pass
        os.killpg(0, 9)
        os._exit(137)

    # Started only now: capabilities and the bounding set are per thread.
    _thread.start_new_thread(exit_when_parent_dies, (job["alive_fd"],))
    _child_run(job)


def _child_die(what):
    import ctypes
    import os

    os.write(2, f"sandbox setup failed: {what}: {os.strerror(ctypes.get_errno())}\n".encode())
    os._exit(121)  # sandbox_verdict.SETUP_FAILED


def _child_sandbox(job, libc):
    """Hide home directories, make every mount read-only, give the test a private tmpfs."""
    import ctypes
    import os
    import sys

    nosuid_nodev, bind_rec = 2 | 4, 4096 | 16384

    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            _child_die(f"mount {dst}")

    cwd = os.getcwd()
    os.umask(0o022)
    prefixes = {sys.base_prefix, sys.base_exec_prefix}  # the interpreter must stay importable
    for home in job["hide"]:
        keep = sorted(p for p in prefixes if p.startswith(home.rstrip("/") + "/"))
        fds = [os.open(p, os.O_PATH) for p in keep]  # still reachable once the home is covered
        mount("tmpfs", home, "tmpfs", nosuid_nodev, "size=1m,mode=755")
        for p, fd in zip(keep, fds):
            os.makedirs(p, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", p, None, bind_rec)
            os.close(fd)
    # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, {MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID})
    attr = (ctypes.c_uint64 * 4)(1 | 2, 0, 0, 0)
    c = ctypes
    if libc.syscall(c.c_long(442), c.c_int(-100), b"/", c.c_uint(0x8000), attr, c.c_size_t(32)):
        _child_die("read-only remount")
    owner = max(job["uid"], 0)
    opts = f"size={job['scratch_mb']}m,mode=700,uid={owner},gid={owner}"
    mount("tmpfs", cwd, "tmpfs", nosuid_nodev, opts)
    os.chdir(cwd)  # enter the new tmpfs; the parent's files stay underneath, out of reach


def _child_limit(job, libc):
    """Block sockets when there is no netns, drop every privilege, set the rlimits."""
    import ctypes
    import os

    if not job["namespaces"]:
        import _socket
        import socket  # imported before leaving root: the stdlib may be unreadable afterwards

        class NoNetwork:
            def __init__(self, *args, **kwargs):
                raise PermissionError("network access is disabled in the sandbox")

        socket.socket = socket.SocketType = _socket.socket = NoNetwork
    if job["uid"] >= 0 or job["namespaces"]:
        for cap in range(64):  # empty the bounding set: no later exec can regain a capability
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP; EINVAL past the last cap
                break
    if job["uid"] >= 0:  # root: become a uid of our own (clears all capabilities)
        if not job["namespaces"]:
            os.chown(".", job["uid"], job["uid"])
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    elif job["namespaces"] and libc.capset(
        (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
    ):
        _child_die("capset")
    if job["namespaces"]:
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL again: setuid cleared it
        with open("/proc/self/status") as f:
            if any(ln.startswith("CapEff:") and int(ln.split()[1], 16) for ln in f):
                _child_die("capabilities remain")
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: setuid binaries stay powerless
        _child_die("no_new_privs")
    for res, val in job["rlimits"]:
        if libc.setrlimit(res, (ctypes.c_ulong * 2)(val, val)) != 0:
            _child_die(f"setrlimit {res}")


def _child_call(job, g):
    import json

    name, sol = job["fn_name"], g.get("Solution")
    if isinstance(sol, type) and hasattr(sol, name):
        fn = getattr(sol(), name)
    elif callable(g.get(name)):
        fn = g[name]
    else:
        raise NameError(f"no function or Solution method named {name!r}")
    value = fn(*job["args"])
    try:
        return "V " + json.dumps(value)  # tuples become lists, as in the expected JSON
    except (TypeError, ValueError):
        return "R " + repr(value)[:200]


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


# What sandbox.py sends, in this order, followed by a call of _child_main().
FUNCTIONS = (_child_die, _child_sandbox, _child_limit, _child_call, _child_run, _child_main)
