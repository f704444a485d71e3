"""Tool calls: read from a turn's text, run concurrently, every failure an error message.

Format: the one Qwen2.5/Qwen3 (and Hermes-style) chat templates teach, one JSON object per call
between tags, any number of calls per turn:

    <tool_call>
    {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    </tool_call>

(`arguments` may also be a JSON string of the object, or be named `parameters`.)

Nothing a tool or the model does stops a run: a call whose JSON does not parse, one naming no
known tool, arguments the function refuses, a tool that raises, one that returns something
other than text (str; numbers, lists, dicts and None are given as JSON), one that does not
return within the time limit: each becomes a result saying so, marked as an error (counted per
step), as TRL gives the model its tool's exception. Results longer than MAX_RESULT_CHARS keep
their beginning and say how much was cut.

Calls run on daemon threads, at most `workers` at once: a Python function cannot be killed, so
one that hangs is abandoned at its time limit (its thread stays until it returns, no longer
counted against `workers`, and cannot keep the process from exiting). The built-in python tool
runs its program in the sandbox, which kills it at its own limit.

Not here: tool schemas (schema.py), the sandbox (python.py), the rollout loop
(generation/multiturn.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ibpo.sandbox.policy import Refused

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
# The most characters of one result the model reads back: enough for a traceback or a table,
# bounded so that one call cannot fill the completion's token budget
MAX_RESULT_CHARS = 4000


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # why the call could not be read (then name/arguments are empty)


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str  # what the model reads as the tool's turn
    error: bool  # the call failed (unreadable, unknown tool, raised, timed out, not text)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in one assistant turn's text, in order; a tag left open at the turn's end is a
    call that could not be read."""
    calls = [_read(body) for body in _CALL.findall(text)]
    tail = text[text.rfind(CLOSE) + len(CLOSE) :] if CLOSE in text else text
    if OPEN in tail:
        calls.append(ToolCall("", {}, f"a {OPEN} without its {CLOSE}"))
    return calls


def _read(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a tool call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, "the tool call's arguments are not a JSON object")
    return ToolCall(obj["name"], args)


def as_text(value: Any) -> str | None:
    """A tool's return value as the text the model reads; None when it is not text."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float, list, dict)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            return None
    return None


def truncated(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters not shown]"


class _Job:
    def __init__(self, call: ToolCall, fn):
        self.call, self.fn = call, fn
        self.done = threading.Event()
        self.started: float | None = None
        self.value: Any = None
        self.raised: BaseException | None = None


def run_calls(
    calls: Sequence[ToolCall], tools: Mapping[str, Any], workers: int, timeout: float
) -> list[ToolResult]:
    """Run calls (of any rows) concurrently, at most `workers` at once, each for at most
    `timeout` seconds from its start -> one result per call, in order. `tools`: name -> Tool.
    Only the sandbox refusing to run (a training run's sandbox policy: the setup's fault, not
    the model's) raises."""
    results: list[ToolResult | None] = [None] * len(calls)
    jobs: list[tuple[int, _Job]] = []
    for i, call in enumerate(calls):
        tool = tools.get(call.name)
        if call.error is not None:
            results[i] = ToolResult(call.name, f"Error: {call.error}", True)
        elif tool is None:
            known = ", ".join(tools) or "none"
            message = f"Error: there is no tool named {call.name!r} (the tools: {known})"
            results[i] = ToolResult(call.name, message, True)
        else:
            jobs.append((i, _Job(call, tool.fn)))
    slots = threading.BoundedSemaphore(max(1, workers))
    released = threading.Lock()
    for _, job in jobs:
        threading.Thread(target=_work, args=(job, slots, released), daemon=True).start()
    for i, job in jobs:
        results[i] = _wait(job, timeout, slots, released)
    return results  # type: ignore[return-value]


def _work(job: _Job, slots: threading.BoundedSemaphore, released: threading.Lock) -> None:
    slots.acquire()
    job.started = time.monotonic()
    try:
        job.value = job.fn(**job.call.arguments)
    except BaseException as e:  # noqa: BLE001 - the model reads it
        job.raised = e
    finally:
        with released:  # a job abandoned at its time limit already gave its slot back
            if not job.done.is_set():
                job.done.set()
                slots.release()


def _wait(job: _Job, timeout: float, slots, released) -> ToolResult:
    name = job.call.name
    while not job.done.wait(0.01):
        if job.started is not None and time.monotonic() - job.started > timeout:
            with released:
                if not job.done.is_set():  # abandoned: its slot goes to the next call
                    job.done.set()
                    slots.release()
                    message = f"Error: tool {name!r} did not return within {timeout:g} s"
                    return ToolResult(name, message, True)
    if isinstance(job.raised, Refused):
        raise job.raised
    if job.raised is not None:
        e = job.raised
        detail = f"{type(e).__name__}: {e}".rstrip(": ")
        return ToolResult(name, truncated(f"Error: tool {name!r} raised {detail}"), True)
    text = as_text(job.value)
    if text is None:
        kind = type(job.value).__name__
        return ToolResult(name, f"Error: tool {name!r} returned a {kind}, not text", True)
    return ToolResult(name, truncated(text), False)
