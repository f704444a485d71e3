"""No socket file of the host reachable from inside, in every isolation mode that has a filesystem
view of its own; a memory cap over all of a test's processes, stated in every result."""

import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ibpo.sandbox import memory
from ibpo.sandbox import run as sandbox
from ibpo.sandbox.run import Limits, TestCase
from tests.conftest import alive

FS_MODES = [
    pytest.param(
        m,
        marks=pytest.mark.skipif(not sandbox.mode_works(m), reason=f"no {m} sandbox here"),
    )
    for m in ("bwrap", "namespaces")  # socket-patch shares the host's filesystem by design
]
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


def test_without_cgroups_the_sum_bound_is_stated(monkeypatch):
    monkeypatch.setattr(memory, "_probe", lambda: ("per-process", ""))
    r = sandbox._run_one(
        "pass", TestCase("script"), Limits(memory_mb=100, max_processes=4), "socket-patch"
    )
    assert r.status == "passed"
    assert r.memory == "per-process: 100 MB each, at most 600 MB in all"


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


ALL_MODES = [
    pytest.param(m, marks=pytest.mark.skipif(not sandbox.mode_works(m), reason=f"no {m} here"))
    for m in sandbox.MODES
]


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


@pytest.mark.skipif(os.geteuid() != 0, reason="slot uids need root")
def test_socket_patch_slot_uid_leaves_nothing_for_the_next_test(monkeypatch):
    """Without a cgroup, a slot uid's leftovers die by uid, so they never count against the
    slot's next test's process limit."""
    monkeypatch.setattr(sandbox, "_world_readable", lambda path: True)
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
