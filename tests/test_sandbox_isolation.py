"""No socket file of the host reachable from inside, in every isolation mode that has a filesystem
view of its own; a memory cap over all of a test's processes, stated in every result."""

import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ibpo.sandbox import memory
from ibpo.sandbox import run as sandbox
from ibpo.sandbox.cases import Limits, TestCase
from tests.conftest import alive, sandbox_modes

FS_MODES = sandbox_modes(("bwrap", "namespaces"))  # socket-patch shares the host's files
MODE = sandbox.isolation_mode()
SOCKET_DIRS = [d for d in (tempfile.gettempdir(), "/dev/shm", "/run") if os.access(d, os.W_OK)]


@pytest.fixture(params=SOCKET_DIRS)
def host_socket(request):
    path = os.path.join(request.param, f"ibpo-host-{uuid.uuid4().hex[:12]}.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)  # any uid may connect: only the filesystem view can stop it
    server.listen(1)
    server.setblocking(False)
    yield path, server
    server.close()
    os.unlink(path)


@pytest.mark.parametrize("mode", FS_MODES)
def test_host_unix_sockets_are_unreachable(mode, host_socket):
    path, server = host_socket
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        f"    s.connect({path!r})\n"
        "    print('connected')\n"
        "except OSError:\n"
        "    print('blocked')\n"
    )
    r = sandbox._run_one(code, TestCase("stdin", "", "blocked"), Limits(time_s=1), mode)
    assert r.status == "passed", r.reason
    assert r.isolation == mode
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody knocked


def test_bwrap_is_preferred_where_it_works():
    if not sandbox.mode_works("bwrap"):
        pytest.skip("bubblewrap is not installed or cannot build a sandbox here")
    assert sandbox.isolation_mode() == "bwrap"


FORKED_HOLDERS = (
    "import os, time\n"
    "kids = []\n"
    "for i in range(6):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        x = b'x' * (60 << 20)  # written, so resident\n"
    "        time.sleep(0.5)\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "ok = all(os.waitpid(k, 0)[1] == 0 for k in kids)\n"
    "print('held' if ok else 'killed')\n"
)


def test_memory_cap_covers_every_process_of_a_test():
    """Six children of 60 MB each under a 200 MB cap: the sum is what counts."""
    if memory.memory_mode() == "per-process":
        pytest.skip("no writable memory cgroup here: only the per-process bound applies")
    limits = Limits(time_s=3, memory_mb=200, max_processes=8)
    r = sandbox._run_one(FORKED_HOLDERS, TestCase("stdin", "", "held"), limits, MODE)
    assert r.status == "error" and "memory limit 200 MB for the whole test" in r.reason
    assert r.memory == f"{memory.memory_mode()}: 200 MB for the whole test"
    small = Limits(time_s=3, memory_mb=600, max_processes=8)
    code = FORKED_HOLDERS.replace("60 << 20", "10 << 20")
    assert sandbox._run_one(code, TestCase("stdin", "", "held"), small, MODE).status == ("passed")


def test_without_cgroups_the_weaker_bound_is_stated(monkeypatch):
    monkeypatch.setattr(memory, "_probe", lambda: ("per-process", ""))
    r = sandbox._run_one("pass", TestCase("script"), Limits(memory_mb=100, max_processes=4), MODE)
    assert r.status == "passed"
    assert r.memory == (
        "per-process: 100 MB of address space in each of up to 6 processes; no bound on the "
        "whole test (memfd, shared memory and kernel buffers are outside it)"
    )


# Writes 300 MB into memfds and unmaps nothing: no address space holds these pages.
MEMFD_HOLDER = (
    "import os\n"
    "fds = []\n"
    "for i in range(60):\n"
    "    fd = os.memfd_create(f'm{i}')\n"
    "    os.write(fd, b'x' * (5 << 20))\n"
    "    fds.append(fd)\n"
    "print('held')\n"
)


def test_memfd_pages_count_against_the_whole_test_s_cap():
    """Without a cgroup these pages escape every per-process limit (hence the weaker bound
    and the training refusal); with one they count like any other memory."""
    if memory.memory_mode() == "per-process":
        pytest.skip("no writable memory cgroup here: the per-process bound is stated instead")
    limits = Limits(time_s=3, memory_mb=200, max_output_bytes=8 << 20)
    r = sandbox._run_one(MEMFD_HOLDER, TestCase("stdin", "", "held"), limits, MODE)
    assert r.status == "error" and "memory limit 200 MB for the whole test" in r.reason
    small = MEMFD_HOLDER.replace("range(60)", "range(4)")
    assert sandbox._run_one(small, TestCase("stdin", "", "held"), limits, MODE).status == "passed"


@pytest.mark.parametrize("mode", FS_MODES)
def test_scratch_space_is_capped_and_homes_are_hidden(mode, tmp_path, monkeypatch):
    fill = "i = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 10 ** 6)\n    i += 1\n"
    r = sandbox._run_one(fill, TestCase("script"), Limits(time_s=2, scratch_mb=8), mode)
    assert r.status == "error" and "No space left" in r.reason
    home = tmp_path / "home"
    home.mkdir()
    (home / "token").write_text("hf_secret")
    for p in (tmp_path, home, home / "token"):
        p.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    token = str(home / "token")
    code = f"try:\n    print(open({token!r}).read())\nexcept OSError:\n    print('hidden')\n"
    r = sandbox._run_one(code, TestCase("stdin", "", "hidden"), Limits(time_s=1), mode)
    assert r.status == "passed", r.reason


# What bwrap shows at the top of the sandbox's root; every isolating mode shows no more.
BWRAP_TOP = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp"}


@pytest.fixture
def planted():
    """Readable files outside any sandbox: in the project folder and its fixtures (benchmarks
    with their answers), in a home, in /var/tmp and /tmp. Other top-level folders (/opt,
    /home, /srv, /var) must not even be listed."""
    project = Path(__file__).resolve().parents[1]
    name = f"ibpo-planted-{uuid.uuid4().hex[:12]}"
    dirs = [project, project / "tests" / "fixtures", Path("/var/tmp"), Path(tempfile.gettempdir())]
    dirs += [Path(d) for d in ("/root", os.path.expanduser("~"))]  # /opt, /home: the listing
    paths = []
    for d in dict.fromkeys(dirs):
        try:
            (d / name).write_text("the answer is 42")
            (d / name).chmod(0o644)
            paths.append(str(d / name))
        except OSError:
            pass  # not writable here: one fewer place to prove
    assert len(paths) >= 3
    yield paths
    for p in paths:
        os.unlink(p)


@pytest.mark.parametrize("mode", FS_MODES)
def test_no_host_file_is_visible(mode, planted):
    prefix_top = os.path.realpath(sys.base_prefix).split("/")[1]  # the interpreter's, bound in
    allowed = sorted(BWRAP_TOP | {prefix_top})
    code = (
        "import os\n"
        "found = []\n"
        f"for p in {planted!r}:\n"
        "    if os.path.exists(p):\n"
        "        found.append(p)\n"
        "    try:\n"
        "        found.append(open(p).read())\n"
        "    except OSError:\n"
        "        pass\n"
        f"found += sorted(set(os.listdir('/')) - set({allowed!r}))\n"
        "print(' '.join(found) or 'nothing')\n"
    )
    r = sandbox._run_one(code, TestCase("stdin", "", "nothing"), Limits(time_s=2), mode)
    assert r.status == "passed", r.reason


ALL_MODES = sandbox_modes()


def _daemon(tag: str) -> str:
    # Leaves the test's session and process group, renamed so the host can find it.
    return (
        "import ctypes, os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        ctypes.CDLL(None).prctl(15, b{tag!r}, 0, 0, 0)\n"
        "        time.sleep(30)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
    )


def _assert_gone(tag: str) -> None:
    deadline = time.monotonic() + 2
    while alive(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive(tag)
    for pid in left:  # never leave one behind, even when the check fails
        os.kill(pid, 9)
    assert not left, f"{len(left)} process(es) outlived the test"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_no_process_outlives_its_test(mode):
    if mode == "socket-patch" and memory.memory_mode() == "per-process":
        if not sandbox._drops_to_slot_uid(mode):
            pytest.skip(
                "socket-patch without a memory cgroup or a slot uid: no way to find a "
                "daemon that left the test's session (docs/evaluation.md)"
            )
    tag = f"ibpo{uuid.uuid4().hex[:10]}"
    r = sandbox._run_one(_daemon(tag), TestCase("script"), Limits(time_s=2), mode)
    assert r.status == "passed", r.reason
    _assert_gone(tag)


def _cgroup_escaper(tag: str) -> str:
    # A daemon that also tries to move itself out of its memory cgroup, to the root of every
    # hierarchy and to the trainer's own group, before it sleeps.
    return _daemon(tag).replace(
        "        time.sleep(30)\n",
        "        me = str(os.getpid())\n"
        "        for line in open('/proc/self/cgroup'):\n"
        "            _, ctrl, path = line.rstrip().split(':', 2)\n"
        "            base = '/sys/fs/cgroup' + ('/' + ctrl if ctrl else '')\n"
        "            for d in (base, base + os.path.dirname(path)):\n"
        "                try:\n"
        "                    open(d + '/cgroup.procs', 'w').write(me)\n"
        "                except OSError:\n"
        "                    pass\n"
        "        time.sleep(30)\n",
    )


def test_socket_patch_as_root_contains_a_daemon_that_leaves_its_cgroup(slot_uid_socket_patch):
    """Socket-patch as root runs tests as a slot uid, which cannot move out of its memory
    cgroup, and whose every process dies at the end (where a test would stay root, the mode is
    refused: test_sandbox.py)."""
    tag = f"ibpo{uuid.uuid4().hex[:10]}"
    r = sandbox._run_one(_cgroup_escaper(tag), TestCase("script"), Limits(time_s=2), "socket-patch")
    assert r.status == "passed", r.reason
    _assert_gone(tag)


@pytest.mark.parametrize("mode", FS_MODES)
def test_a_daemon_that_leaves_its_cgroup_dies_with_its_namespace(mode):
    tag = f"ibpo{uuid.uuid4().hex[:10]}"
    r = sandbox._run_one(_cgroup_escaper(tag), TestCase("script"), Limits(time_s=2), mode)
    assert r.status == "passed", r.reason
    _assert_gone(tag)


def test_socket_patch_slot_uid_leaves_nothing_for_the_next_test(slot_uid_socket_patch, monkeypatch):
    """Without a cgroup, a slot uid's leftovers die by uid, so they never count against the
    slot's next test's process limit."""
    monkeypatch.setattr(memory, "_probe", lambda: ("per-process", ""))
    tag = f"ibpo{uuid.uuid4().hex[:10]}"
    r = sandbox._run_one(_daemon(tag), TestCase("script"), Limits(time_s=2), "socket-patch")
    assert r.status == "passed", r.reason
    _assert_gone(tag)
    forks = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for n in range(3):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(1)\n"
        "            os._exit(0)\n"
        "except OSError:\n"
        "    n = -1\n"
        "print(n)\n"
    )
    limits = Limits(time_s=2, max_processes=4)
    r = sandbox._run_one(forks, TestCase("stdin", "", "2"), limits, "socket-patch")
    assert r.status == "passed", r.reason


@pytest.fixture
def etc_secret():
    """A world-readable credential in /etc, as a pip.conf or netrc with a token would be."""
    path = Path("/etc") / f"ibpo-planted-{uuid.uuid4().hex[:12]}.conf"
    try:
        path.write_text("[global]\nindex-url = https://user:hf_secret@example.invalid/simple\n")
    except OSError:
        pytest.skip("/etc is not writable here: no credential to plant")
    path.chmod(0o644)
    yield str(path)
    path.unlink()


@pytest.mark.parametrize("mode", FS_MODES)
def test_etc_shows_only_what_the_interpreter_needs(mode, etc_secret):
    # Everything the stdlib's extension modules load (shared libraries found through the
    # loader's cache) still works; nothing else of /etc is there.
    code = (
        "import ctypes, ssl, sqlite3, lzma, bz2, zlib, hashlib, decimal, zoneinfo, os\n"
        "ctypes.CDLL(None)\n"
        f"for p in [{etc_secret!r}, '/etc/pip.conf', '/etc/netrc', '/etc/passwd']:\n"
        "    try:\n"
        "        print(open(p).read())\n"
        "    except OSError:\n"
        "        pass\n"
        "print(sorted(os.listdir('/etc')))\n"
    )
    shown = sorted(n for n in sandbox.ETC_ALLOWED if os.path.lexists(f"/etc/{n}"))
    r = sandbox._run_one(code, TestCase("stdin", "", f"{shown}\n"), Limits(time_s=3), mode)
    assert r.status == "passed", r.reason


def _keyring_calls() -> tuple[int, int]:
    """(add_key, keyctl) system call numbers of this machine's native ABI."""
    nrs = {"x86_64": (248, 250), "aarch64": (217, 219), "riscv64": (217, 219)}
    if os.uname().machine not in nrs:
        pytest.skip(f"no keyring call numbers known here for {os.uname().machine}")
    return nrs[os.uname().machine]


def _store_keys(add_key: int, keyctl: int) -> str:
    # A key in every keyring a test could reach: thread, process, session, user, user session,
    # persistent; "ENOSYS" for each call that the kernel turned down as unknown.
    return (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "c = ctypes.c_long\n"
        "out = []\n"
        f"persistent = libc.syscall(c({keyctl}), c(22), c(-1), c(-3))\n"
        "rings = [-1, -2, -3, -4, -5] + ([persistent] if persistent >= 0 else [])\n"
        "for ring in rings:\n"
        f"    r = libc.syscall(c({add_key}), b'user', b'ibpo-left-behind', b'42', c(2), c(ring))\n"
        "    out.append('stored' if r >= 0 else os.strerror(ctypes.get_errno()))\n"
        "print(sorted(set(out)))\n"
    )


def _slot_keys() -> dict[int, int]:
    """Keys held by this process's slot uids (the kernel's count per uid)."""
    uids = {sandbox._slot_uid(s) for s in range(sandbox._MAX_SLOTS)}
    with open("/proc/key-users") as f:
        rows = [ln.split() for ln in f]
    return {int(r[0].rstrip(":")): int(r[1]) for r in rows if int(r[0].rstrip(":")) in uids}


KEY_MODES = [*FS_MODES, pytest.param("slot-uid socket-patch")]


@pytest.mark.parametrize("mode", KEY_MODES)
def test_keyrings_are_out_of_every_test_s_reach(mode, request):
    """No keyring is namespaced: a test's keys would reach the next test of its slot uid and
    outlive the trainer, and its session keyring would be the trainer's. So a test can store
    none anywhere, and no slot uid holds a key afterwards."""
    if mode != "bwrap" and mode != "namespaces":
        mode = request.getfixturevalue("slot_uid_socket_patch")
    if not os.path.exists("/proc/key-users"):
        pytest.skip("this kernel has no keyrings")
    code = _store_keys(*_keyring_calls())
    want = "['Function not implemented']\n"
    before = _slot_keys()
    r = sandbox._run_one(code, TestCase("stdin", "", want), Limits(time_s=2), mode)
    assert r.status == "passed", r.reason

    # the empty session keyring the test joined is freed by the kernel's key collector, which
    # runs as soon as the test's last process is gone (asynchronously: wait for it)
    def added() -> dict[int, int]:  # keys a slot uid holds beyond what it held before
        now = _slot_keys()  # (a key of an earlier test may still be collected meanwhile)
        return {u: n - before.get(u, 0) for u, n in now.items() if n > before.get(u, 0)}

    for _ in range(300):
        if not added():
            break
        time.sleep(0.01)
    assert added() == {}


@pytest.mark.parametrize("mode", KEY_MODES)
def test_a_test_possesses_none_of_the_trainer_s_keys(mode, request):
    """The trainer's session keyring is inherited by what it starts; a test joins an empty one
    first, so /proc/keys (which lists the keys a process possesses or owns) shows none of the
    trainer's."""
    if mode != "bwrap" and mode != "namespaces":
        mode = request.getfixturevalue("slot_uid_socket_patch")
    if not os.path.exists("/proc/keys"):
        pytest.skip("this kernel has no keyrings")
    add_key, keyctl = _keyring_calls()
    libc = ctypes.CDLL(None, use_errno=True)
    name = f"ibpo-trainer-{os.getpid()}".encode()
    key = libc.syscall(ctypes.c_long(add_key), b"user", name, b"secret", ctypes.c_long(6),
                       ctypes.c_long(-3))  # fmt: skip
    if key < 0:
        pytest.skip(f"cannot add a key here: {os.strerror(ctypes.get_errno())}")
    try:
        with open("/proc/keys") as f:
            assert name.decode() in f.read()  # the trainer itself sees it
        code = f"print({name.decode()!r} in open('/proc/keys').read())\n"
        r = sandbox._run_one(code, TestCase("stdin", "", "False\n"), Limits(time_s=2), mode)
        assert r.status == "passed", r.reason
    finally:  # KEYCTL_UNLINK (9) from the session keyring
        unlink = (ctypes.c_long(x) for x in (keyctl, 9, key, -3))
        libc.syscall(*unlink)


# x86_64 machine code for keyctl(KEYCTL_GET_KEYRING_ID, session, create) through the i386 ABI
# (int 0x80) and the x32 ABI (bit 30 set): a filter that knew only the native numbers would let
# these through. Returns the call's result (eax).
I386_KEYCTL = bytes.fromhex("53b82001000031dbb9fdffffffba01000000cd805bc3")
X32_KEYCTL = bytes.fromhex("b8fa00004031ffbefdffffffba010000000f05c3")
RUN_MACHINE_CODE = (
    "import ctypes, mmap\n"
    "def run(code):\n"
    "    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "    m.write(code)\n"
    "    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
    "    return ctypes.CFUNCTYPE(ctypes.c_int)(addr)()\n"
)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 machine code")
@pytest.mark.parametrize("mode", FS_MODES)
@pytest.mark.parametrize("abi", ["i386", "x32"])
def test_keyrings_stay_out_of_reach_through_the_other_abis(mode, abi, tmp_path):
    code = RUN_MACHINE_CODE + f"print(run({I386_KEYCTL if abi == 'i386' else X32_KEYCTL!r}))\n"
    script = tmp_path / "abi.py"
    script.write_text(code)
    # Outside any sandbox the call works, or the kernel lacks that ABI and nothing is to prove.
    host = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if host.returncode != 0 or int(host.stdout) < 0:
        pytest.skip(f"this kernel runs no {abi} system calls ({host.stdout.strip() or 'crash'})")
    r = sandbox._run_one(code, TestCase("stdin", "", "-38\n"), Limits(time_s=2), mode)  # ENOSYS
    assert r.status == "passed", r.reason


# Each attempt prints its errno's name, or "ok" when the kernel let it through.
KERNEL_SURFACE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
c = ctypes.c_long
NR = {"x86_64": dict(unshare=272, setns=308, clone=56),
      "aarch64": dict(unshare=97, setns=268, clone=220),
      "riscv64": dict(unshare=97, setns=268, clone=220)}[os.uname().machine]
def call(nr, *args):
    r = libc.syscall(c(nr), *[c(a) for a in args])
    if r == 0 and nr == NR["clone"]:
        os._exit(0)  # the new process, if it ever existed
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
out = {
    "unshare(NEWUSER)": call(NR["unshare"], 0x10000000),
    "unshare(NEWNET)": call(NR["unshare"], 0x40000000),
    "clone(NEWUSER)": call(NR["clone"], 0x10000000 | 17, 0, 0, 0, 0),
    "clone3": call(435, 0, 0),
    "setns": call(NR["setns"], os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "io_uring_setup": call(425, 8, ctypes.addressof(ctypes.create_string_buffer(120))),
    "io_uring_enter": call(426, 0, 0, 0, 0, 0),
    "io_uring_register": call(427, 0, 0, 0, 0),
}
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = "ok" if os.waitpid(pid, 0)[1] >> 8 == 7 else "broken"
pid = os.fork()
if pid == 0:
    os.execv("/bin/sh", ["sh", "-c", "exit 3"])
out["exec"] = "ok" if os.waitpid(pid, 0)[1] >> 8 == 3 else "broken"
for k, v in out.items():
    print(k, v)
"""
KERNEL_SURFACE_SHUT = (
    "unshare(NEWUSER) EPERM\nunshare(NEWNET) EPERM\nclone(NEWUSER) EPERM\nclone3 ENOSYS\n"
    "setns EPERM\nio_uring_setup ENOSYS\nio_uring_enter ENOSYS\nio_uring_register ENOSYS\n"
    "fork ok\nexec ok\n"
)


@pytest.mark.skipif(
    os.uname().machine not in ("x86_64", "aarch64", "riscv64"), reason="system-call numbers"
)
@pytest.mark.parametrize("mode", KEY_MODES)
def test_no_test_makes_namespaces_or_uses_io_uring(mode, request):
    """A user namespace of a test's own would hold CAP_SYS_ADMIN and CAP_NET_ADMIN inside (the
    route of nf_tables-class escalations), and io_uring is a kernel surface of its own: both are
    shut in every mode, root or not, while fork and subprocesses keep working."""
    if mode != "bwrap" and mode != "namespaces":
        mode = request.getfixturevalue("slot_uid_socket_patch")
    case = TestCase("stdin", "", KERNEL_SURFACE_SHUT)
    r = sandbox._run_one(KERNEL_SURFACE, case, Limits(time_s=5), mode)
    assert r.status == "passed", r.reason


@pytest.mark.parametrize("mode", FS_MODES)
def test_the_interpreter_s_prefix_shows_only_what_it_runs_on(mode, tmp_path):
    """Configuration a user keeps in the interpreter's prefix (conda's .condarc, pip.conf, etc/)
    and the base interpreter's site-packages stay out of sight; the standard library works."""
    prefix = os.path.realpath(sys.base_prefix)
    if prefix.startswith("/usr/") or not os.access(prefix, os.W_OK):
        pytest.skip(f"the interpreter's prefix {prefix} is a system folder or not writable here")
    site = sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"]
    token = f"ibpo-planted-{uuid.uuid4().hex}"
    planted = [os.path.join(prefix, ".condarc"), os.path.join(prefix, "pip.conf"),
               os.path.join(site, "ibpo_planted.txt")]  # fmt: skip
    fresh = [p for p in planted if not os.path.exists(p)]
    if len(fresh) < len(planted):
        pytest.skip("a file of that name is already in the prefix")
    try:
        for p in fresh:
            Path(p).write_text(f"token: {token}\n")
        code = (
            "import json, ctypes, decimal, os\n"
            f"for p in {planted!r}:\n"
            "    print(os.path.exists(p))\n"
            "print(sorted(os.listdir(os.path.dirname(" + repr(planted[2]) + "))))\n"
        )
        case = TestCase("stdin", "", "False\nFalse\nFalse\n[]\n")
        r = sandbox._run_one(code, case, Limits(time_s=3), mode)
        assert r.status == "passed", r.reason
    finally:
        for p in fresh:
            with contextlib.suppress(OSError):
                os.remove(p)
