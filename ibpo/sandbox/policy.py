"""Which sandboxes this process lets tests run in, and which they ran in.

A process-wide policy that the runner enforces itself at the start of every test (run.py), so it
holds whatever called the runner: the built-in code reward, a user's reward function that calls
`grade_code`, `code_reward` or `run_tests`, an evaluation inside a training run, any thread. A
training run installs one for its whole duration (`enforced`): the isolation modes it accepts and
whether a test needs a memory bound over all of its processes (a memory cgroup). A test the
policy forbids is not started: `Refused` (a ConfigError: the run's setup, not the completion's
fault) names the fix, and the graders pass it on rather than scoring 0.

Every test started while a policy is in force is counted in that policy's `Record` by isolation
mode and memory bound, so a run states the sandboxes it actually used (summary.json's
`isolation`), not the one it expected.

Not here: what each mode and bound contains (run.py, memory.py), which policy a training run asks
for (rewards/code.py, reward.sandbox).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ibpo.config import ConfigError


class Refused(ConfigError):
    """A test the sandbox will not start: its mode or memory bound is refused here."""


@dataclass(frozen=True)
class Policy:
    modes: tuple[str, ...]  # isolation modes a test may run in
    total_memory: bool  # a test needs a memory bound over all its processes (cgroup)
    mode_fix: str = ""  # how to get an accepted mode, said when one is refused
    memory_fix: str = ""  # how to get a memory cgroup, said when its absence is refused


@dataclass
class Record:
    """Tests started under a policy: isolation mode -> count, memory bound -> count."""

    modes: dict[str, int] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)

    def isolation(self) -> str | None:
        """The modes tests ran in, in the order first used ("bwrap"; "bwrap, namespaces"), or
        None when no test ran."""
        return ", ".join(self.modes) or None

    def merge(self, other: Record) -> None:
        for mine, theirs in ((self.modes, other.modes), (self.memory, other.memory)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n


_lock = threading.Lock()
_active: list[tuple[Policy, Record]] = []  # innermost last


@contextmanager
def enforced(policy: Policy) -> Iterator[Record]:
    """`policy` in force for this process (every thread) until the block ends; yields the Record
    of the tests started meanwhile. Nested policies: the innermost decides and records."""
    entry = (policy, Record())
    with _lock:
        _active.append(entry)
    try:
        yield entry[1]
    finally:
        with _lock:
            _active.remove(entry)


def refusal(mode: str, grouped: bool, policy: Policy | None = None) -> str | None:
    """Why `policy` (default: the one in force) refuses a test in `mode`, with (grouped) or
    without a memory cgroup; None when it accepts it."""
    if policy is None:
        with _lock:
            if not _active:
                return None
            policy = _active[-1][0]
    if mode not in policy.modes:
        return (
            f"the sandbox's {mode} mode does not contain the programs it runs (they see the "
            f"host's files and can forge verdicts), and this run accepts only "
            f"{' or '.join(policy.modes)}. {policy.mode_fix}"
        ).strip()
    if policy.total_memory and not grouped:
        return (
            "no memory cgroup is writable here, so nothing bounds a test's memory over all its "
            "processes (memfd and shared memory, pipe and socket buffers escape each process's "
            f"address-space limit). {policy.memory_fix}"
        ).strip()
    return None


def admit(mode: str, grouped: bool, memory: str) -> None:
    """Before a test starts: raise Refused when the policy in force forbids it, else count it."""
    with _lock:
        if not _active:
            return
        policy, record = _active[-1]
        why = refusal(mode, grouped, policy)
        if why is None:
            record.modes[mode] = record.modes.get(mode, 0) + 1
            record.memory[memory] = record.memory.get(memory, 0) + 1
    if why is not None:
        raise Refused(why)
