"""What a sandboxed test is: its kind, input and expected answer (`TestCase`), and the limits it
runs under (`Limits`). Running a test (run.py) and judging how it ended (verdict.py) both read
them; neither is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    # CPU seconds per test, interpreter start included. The kernel kills at the next whole
    # second (RLIMIT_CPU); a test that ends above time_s still counts as a timeout.
    time_s: float = 2.0
    memory_mb: int = 1024  # all processes of the test (cgroups), else each one (memory.py)
    max_output_bytes: int = 8 << 20  # stdout / stderr / any written file
    max_processes: int = 8  # processes + threads alive at once (the test itself counts)
    scratch_mb: int = 64  # size of the private working directory (bwrap, namespaces)

    @property
    def cpu_limit_s(self) -> int:
        # What the kernel enforces (RLIMIT_CPU): whole seconds
        return max(1, math.ceil(self.time_s))

    @property
    def wall_s(self) -> float:
        # Generous against a busy machine; CPU time is the fair limit.
        return 2 * self.time_s + 1


@dataclass(frozen=True)
class TestCase:
    __test__ = False  # not a pytest class

    kind: str  # "stdin" | "call" | "check" | "script"
    input: Any = ""  # stdin text | list of call arguments | test code | unused
    expected: Any = None  # expected stdout text | expected return value | unused | unused
    fn_name: str | None = None  # "call": the function; "check": the entry point
