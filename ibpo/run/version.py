"""Which code a run ran: the git commit of the ibpo package and whether its tree was dirty.

`code_version()` -> {"version": ibpo's version, "commit": the hex sha or "unknown", "dirty": True,
False or "unknown"}, taken once when a run starts (a resumed run records the code that resumed
it). The package's own folder decides: it must be tracked in a git work tree (a package
installed from a wheel, or a virtual environment inside some other repository, has no commit of
its own and records "unknown"). Dirty means a tracked file of the repository differs from the
commit, or an untracked file (not ignored) sits inside the package: files a study writes
elsewhere in the tree, such as its run folders, do not make it dirty. No git on the machine, a
git that fails or hangs: "unknown", never an error (a run must not fail over its label).

In config.yaml it is a comment line (`header`, read back by `from_header`): the file stays a
recipe that `ibpo train` runs as it is.

Not here: writing it (the trainer puts it in summary.json and config.yaml), showing it
(report.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

UNKNOWN = "unknown"
PACKAGE = Path(__file__).resolve().parents[1]  # the ibpo package's folder


def _git(cwd: Path, *args: str) -> str | None:
    """stdout of one git command in `cwd`, or None when it cannot say (no git, not a repository,
    an error or a 10 s timeout)."""
    # no index lock: several runs of a study may ask at once while another git command runs
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def code_version(package: Path | None = None) -> dict:
    """The commit the package folder (ibpo's own by default) was checked out at and whether its
    tree was dirty."""
    package = Path(package or PACKAGE)
    # the package's version: `ibpo` is always loaded before any of its modules (an import of
    # it here would be an edge to its lazy API, and a cycle)
    released = getattr(sys.modules.get("ibpo"), "__version__", UNKNOWN)
    unknown = {"version": released, "commit": UNKNOWN, "dirty": UNKNOWN}
    if not package.is_dir():
        return unknown
    # tracked here: a package folder that is untracked or ignored (site-packages in a venv kept
    # inside another project's repository) belongs to no commit of that repository
    tracked = _git(package, "ls-files", "--", "__init__.py")
    commit = _git(package, "rev-parse", "--verify", "HEAD")
    if not tracked or not commit or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit.strip()):
        return unknown
    changed = _git(package, "status", "--porcelain", "--untracked-files=no", "--", ":/")
    untracked = _git(package, "status", "--porcelain", "--untracked-files=all", "--", ".")
    if changed is None or untracked is None:
        return {**unknown, "commit": commit.strip()}
    dirty = bool(changed.strip()) or any(line.startswith("??") for line in untracked.splitlines())
    return {**unknown, "commit": commit.strip(), "dirty": dirty}


def describe(version: dict | None) -> str:
    """One line for people: 'ibpo 0.1.0, commit 1a2b3c4d5e6f (clean)', '... (dirty tree)'."""
    if not version:
        return "not recorded (a run from before ibpo recorded it)"
    name = f"ibpo {version.get('version', '?')}"
    if version.get("commit", UNKNOWN) == UNKNOWN:
        return f"{name}, commit unknown (not a git checkout, or git unavailable)"
    state = {True: "dirty tree", False: "clean"}.get(version.get("dirty"), "tree state unknown")
    return f"{name}, commit {version['commit'][:12]} ({state})"


HEADER = "# code: "  # config.yaml's first line


def header(version: dict) -> str:
    """config.yaml's first line: a YAML comment holding the version as JSON."""
    return HEADER + json.dumps(version, sort_keys=True) + "\n"


def from_header(text: str) -> dict | None:
    """The version in a config.yaml's first line; None for a file without one (an older run)."""
    first = text.split("\n", 1)[0]
    if not first.startswith(HEADER):
        return None
    try:
        version = json.loads(first[len(HEADER) :])
    except ValueError:
        return None
    return version if isinstance(version, dict) else None
