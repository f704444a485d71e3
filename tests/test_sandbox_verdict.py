"""Verdicts the tested code cannot forge, and the "check" kind's harness in a process of its own.

Forgers write a passing record to every descriptor they hold or can reach (their own, those of
the calling frames' job, those of other processes through /proc) and exit 0. Always-equal
objects and their relatives (overridden comparisons, subclasses of built-ins, patched builtins
and exits) return from the entry point of a check test. Each runs in every isolation mode this
machine has.
"""

import pytest

from ibpo.sandbox import run as sandbox
from ibpo.sandbox.cases import Limits, TestCase
from ibpo.sandbox.run import run_tests
from ibpo.sandbox.verdict import classify
from tests.conftest import sandbox_modes

FAST = Limits(time_s=1)

MODES = sandbox_modes()

FORGE_OWN_FDS = (
    "import os\n"
    "for fd in range(3, 256):\n"
    "    try:\n"
    "        os.write(fd, b'D\\n')\n"
    "    except OSError:\n"
    "        pass\n"
    "os._exit(0)\n"
)
FORGE_FRAMES = (
    "import os, sys\n"
    "f = sys._getframe()\n"
    "while f is not None:\n"
    "    job = f.f_locals.get('job')\n"
    "    if isinstance(job, dict) and 'res_fd' in job:\n"
    "        try:\n"
    "            os.write(job['res_fd'], b'D\\n')\n"
    "        except OSError:\n"
    "            pass\n"
    "        os._exit(0)\n"
    "    f = f.f_back\n"
)
FORGE_PROC = (
    "import os\n"
    "for p in os.listdir('/proc'):\n"
    "    if not p.isdigit():\n"
    "        continue\n"
    "    try:\n"
    "        fds = os.listdir(f'/proc/{p}/fd')\n"
    "    except OSError:\n"
    "        continue\n"
    "    for fd in fds:\n"
    "        try:\n"
    "            with open(f'/proc/{p}/fd/{fd}', 'ab') as w:\n"
    "                w.write(b'D\\n')\n"
    "        except OSError:\n"
    "            pass\n"
    "os._exit(0)\n"
)
CHECK = "def check(candidate):\n    assert candidate(2, 3) == 6\n    assert candidate(0, 9) == 0\n"
CHECK_NUMERIC = (
    "import math\n"
    "def check(candidate):\n"
    "    assert isinstance(candidate(2, 3), int)\n"
    "    assert abs(candidate(2, 3) - 6) < 1e-9\n"
    "    assert math.isclose(candidate(0, 9), 0)\n"
)
ALWAYS_EQUAL = (
    "class E:\n"
    "    __eq__ = lambda s, o: True\n"
    "    __ne__ = lambda s, o: False\n"
    "    __bool__ = lambda s: True\n"
    "    __hash__ = lambda s: 0\n"
    "    def __del__(self):\n"
    "        pass\n"
    "def mul(a, b):\n"
    "    return E()\n"
)
RELATIVES = {
    "always-equal": ALWAYS_EQUAL,
    "int-subclass": (
        "class I(int):\n"
        "    __eq__ = lambda s, o: True\n"
        "    __ne__ = lambda s, o: False\n"
        "    __hash__ = int.__hash__\n"
        "def mul(a, b):\n"
        "    return I(1)\n"
    ),
    "list-subclass": (
        "class L(list):\n    __eq__ = lambda s, o: True\ndef mul(a, b):\n    return L()\n"
    ),
    "patched-builtins-and-exits": (
        "import builtins, math, os, sys\n"
        "builtins.isinstance = lambda *a: True\n"
        "builtins.abs = lambda x: 0\n"
        "math.isclose = lambda *a, **k: True\n"
        "builtins.AssertionError = type('Quiet', (Exception,), {})\n"
        "sys.exit = os._exit = lambda *a: None\n"
        "sys.excepthook = lambda *a: None\n"
        "def mul(a, b):\n"
        "    return 7\n"
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("forger", [FORGE_OWN_FDS, FORGE_FRAMES, FORGE_PROC])
def test_forged_verdicts_fail_in_every_kind(mode, forger):
    if forger is FORGE_PROC and mode == "socket-patch":
        # Without a PID namespace it would write into every process of the host it can open.
        pytest.skip("socket-patch mode shares the host's processes: never run this forger there")
    tests = [
        TestCase("stdin", "", "6"),
        TestCase("call", [2, 3], 6, "mul"),
        TestCase("check", CHECK, fn_name="mul"),
    ]
    for t in tests:
        r = sandbox._run_one(forger, t, FAST, mode)
        assert r.status != "passed", (t.kind, r)
        assert r.isolation == mode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(RELATIVES))
def test_always_equal_objects_and_relatives_fail_check_and_call(mode, name):
    code = RELATIVES[name]
    harness = CHECK_NUMERIC if name.startswith("patched") else CHECK
    # The exploit is real: the in-process (script) harness passes it.
    script = sandbox._run_one(code + harness + "check(mul)\n", TestCase("script"), FAST, mode)
    assert script.status == "passed", script
    for t in (TestCase("check", harness, fn_name="mul"), TestCase("call", [2, 3], 6, "mul")):
        r = sandbox._run_one(code, t, FAST, mode)
        assert r.status in ("failed", "error"), (t.kind, r)
    honest = "def mul(a, b):\n    return a * b\n"
    r = sandbox._run_one(honest, TestCase("check", harness, fn_name="mul"), FAST, mode)
    assert r.status == "passed", r


def test_check_kind_passes_plain_data_faithfully():
    harness = (
        "import math\n"
        "def helper(x):\n"
        "    return x + 1\n"
        "def check(candidate):\n"
        "    assert candidate((1, 2)) == ((1, 2), [1, 2])\n"
        "    assert candidate({1: 'a'}) == ({1: 'a'}, [1])\n"
        "    assert candidate({3, 4}) == ({3, 4}, [3, 4])\n"
        "    assert math.isnan(candidate(float('nan'))[0])\n"
        "    assert candidate(b'x', k=2) == ((b'x', 2), [b'x', 2])\n"
        "    assert candidate(helper(1j)) == ((1 + 1j), [1 + 1j])\n"
        "    try:\n"
        "        candidate(None)\n"
        "    except ValueError as e:\n"
        "        assert 'no None' in str(e)\n"
        "    else:\n"
        "        assert False\n"
    )
    code = (
        "def echo(x, k=None):\n"
        "    if x is None:\n"
        "        raise ValueError('no None')\n"
        "    out = (x, k) if k is not None else x\n"
        "    return out, sorted(x) if isinstance(x, (set, dict, tuple)) else [x, k] if k else [x]\n"
    )
    r = run_tests(code, [TestCase("check", harness, fn_name="echo")], FAST)[0]
    assert r.status == "passed", r.reason


def test_check_kind_reports_failures_and_errors():
    def one(code, harness=CHECK):
        return run_tests(code, [TestCase("check", harness, fn_name="mul")], FAST)[0]

    r = one("def mul(a, b):\n    return a + b\n")
    assert r.status == "failed" and "AssertionError" in r.reason
    r = one("def mul(a, b):\n    return object()\n")
    assert r.status == "error" and "cannot cross to the test harness" in r.reason
    r = one("def mul(:\n")
    assert r.status == "error" and "SyntaxError" in r.reason
    r = one("def other():\n    pass\n")
    assert r.status == "error" and "NameError" in r.reason
    r = one("def mul(a, b):\n    while True:\n        pass\n")
    assert r.status == "timeout"


def test_the_tests_are_out_of_the_solution_s_reach():
    """The solution's process holds neither the test code nor its expected values."""
    code = (
        "import gc, sys\n"
        "def holds_test(values, test):\n"
        "    return any(type(v) is str and v is not test and test in v for v in values)\n"
        "def mul(a, b):\n"
        "    test = 'candidate(' + '2, 3)'  # not in the solution's own source\n"
        "    seen = False\n"
        "    for o in gc.get_objects():\n"
        "        seq = type(o) in (list, tuple)\n"
        "        values = o.values() if type(o) is dict else o if seq else ()\n"
        "        seen |= holds_test(values, test)\n"
        "    f = sys._getframe().f_back\n"
        "    while f is not None:\n"
        "        seen |= holds_test([*f.f_locals.values(), *f.f_code.co_consts], test)\n"
        "        f = f.f_back\n"
        "    return 0 if seen else a * b\n"
    )
    r = run_tests(code, [TestCase("check", CHECK, fn_name="mul")], FAST)[0]
    assert r.status == "passed", r.reason


@pytest.mark.parametrize("mode", MODES)
def test_modules_planted_in_the_working_directory_do_not_reach_the_harness(mode):
    """The solution may write its scratch directory; the harness imports only the stdlib."""
    plant = (
        "import os\n"
        "for fd in range(3, 256):\n"
        "    try:\n"
        "        os.write(fd, b'D\\n')\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    )
    code = f"open('fractions.py', 'w').write({plant!r})\ndef mul(a, b):\n    return 0\n"
    harness = "import fractions\n" + CHECK
    r = sandbox._run_one(code, TestCase("check", harness, fn_name="mul"), FAST, mode)
    assert r.status == "failed", r


KILLED = 9  # a wait status: killed by SIGKILL
EXITED = lambda code: code << 8  # noqa: E731  (a wait status: exited with `code`)


@pytest.mark.parametrize(
    "status, err",
    [
        (KILLED, b""),  # socket-patch: the child itself
        (EXITED(137), b""),  # bwrap, and a check test's harness whose solution was killed
        (EXITED(1), b"unshare: sigprocmask unblock failed: Invalid argument\n"),  # unshare 2.38
    ],
)
def test_a_test_killed_at_the_cpu_limit_is_a_timeout_whatever_our_clock_reads(status, err):
    """RLIMIT_CPU kills on the kernel's clock; the CPU time read back may be well below it."""
    test, limits = TestCase("script"), Limits()  # the default: 2 s
    for cpu in (1.0, 1.62, 1.99):
        assert classify(test, limits, status, cpu, False, b"", err, b"") == (
            "timeout",
            "time limit 2s",
        )
    # killed early, or after reporting its end: not the time limit
    assert classify(test, limits, status, 0.2, False, b"", err, b"")[0] == "error"
    assert classify(test, limits, status, 1.9, False, b"", err, b"D\n")[0] != "timeout"


def test_a_plain_exit_near_the_limit_stays_what_it_was():
    test, limits = TestCase("script"), Limits()
    assert classify(test, limits, EXITED(1), 1.9, False, b"", b"", b"") == ("error", "exit code 1")
    assert classify(test, limits, KILLED, 0.1, False, b"", b"", b"") == (
        "error",
        "killed by SIGKILL",
    )
    assert classify(test, limits, EXITED(137), 0.1, False, b"", b"", b"") == (
        "error",
        "killed by SIGKILL",
    )


CAP = 8 << 20  # Limits' default max_output_bytes


@pytest.mark.parametrize(
    "kind, out, res, verdict",
    [
        ("call", b"", b"V [" + b"0, " * (CAP // 3 - 2) + b"0]\n", "failed"),  # a forged value
        ("call", b"", b"\n" * (CAP - 4) + b"V 6\n", "passed"),  # newlines before the record
        ("check", b"", b"\n" * (CAP - 3) + b"D\n", "passed"),
        ("stdin", b"\n" * (CAP - 4) + b"6\n", b"D\n", "failed"),  # newlines, then the answer
        ("stdin", b"6" + b" " * (CAP - 4) + b"6\n", b"D\n", "failed"),  # spaces in one line
    ],
)
def test_what_a_test_sends_back_is_read_within_a_bounded_memory(kind, out, res, verdict):
    """The channels are read at most max_output_bytes each; then the trainer holds no more than
    a few copies of that (the bound: 4 x the cap), never the objects a parse would make of it
    (an 8 MB record parsed as JSON took 221 MB, 8 MB of newlines split 129 MB)."""
    import tracemalloc

    from ibpo.sandbox.cases import Limits, TestCase

    test = {
        "call": TestCase("call", [2, 3], 6, fn_name="mul"),
        "check": TestCase("check", CHECK, fn_name="mul"),
        "stdin": TestCase("stdin", "", "6\n"),
    }[kind]
    tracemalloc.start()
    try:
        status, reason = classify(test, Limits(), 0, 0.1, False, out, b"", res)  # exit 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * CAP, peak
    assert status == verdict, reason
