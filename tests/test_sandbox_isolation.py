"""No socket file of the host reachable from inside, in every isolation mode that has a filesystem
view of its own; a memory cap over all of a test's processes, stated in every result."""

import os
import socket
import tempfile
import uuid

import pytest

from ibpo.sandbox import memory
from ibpo.sandbox import run as sandbox
from ibpo.sandbox.run import Limits, TestCase

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
