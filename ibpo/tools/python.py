"""The built-in `python` tool: the model's program run in the package's sandbox.

It runs with the code reward's limits (sandbox.cases.Limits' defaults, as rewards/code.py grades
with: CPU time, memory over all processes, output size, process count), no network and no host
files (the isolation of every sandboxed test), and under the run's sandbox policy
(reward.sandbox, enforced by the sandbox itself). A loop is killed at the time limit.
The model gets back what the program printed, stdout then stderr (a traceback is on stderr),
and a line saying why it stopped when it did not reach its end; `calls.py` truncates a long
result and says so.

Not here: what isolates the program (ibpo/sandbox/), parsing or scheduling calls (calls.py).
"""

from __future__ import annotations

import re

from ibpo.sandbox.cases import Limits
from ibpo.sandbox.run import run_program

# the code reward's limits (rewards/code.py grades with Limits' defaults unless a test spec
# sets its own), with printed output bounded well below a test's: the model reads it back
LIMITS = Limits(max_output_bytes=1 << 20)


# the sandbox's own frame in a traceback (its child runs the program): not the model's business
_HARNESS_FRAME = re.compile(r'^  File "<string>", line \d+, in _child_run\n', re.M)


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed (stdout, then stderr).

    Args:
        code: The complete Python program to run; print the values you want to see.
    """
    run = run_program(code, LIMITS)
    parts = [run.stdout.rstrip("\n")] if run.stdout.strip() else []
    if run.stderr.strip():
        parts.append("stderr:\n" + _HARNESS_FRAME.sub("", run.stderr).rstrip("\n"))
    status, reason = run.result.status, run.result.reason.removeprefix("test 0: ")
    if status == "timeout":
        parts.append(f"Error: the program was stopped: {reason}")
    elif status == "error" and not run.stderr.strip():
        parts.append(f"Error: {reason}")
    return "\n".join(parts) if parts else "(no output)"
