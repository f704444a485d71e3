"""Running reward calls: on this thread, on worker threads or awaited on an event loop, each
within a time limit.

* `run_sync(calls, workers, timeout)`: zero-argument calls (a reward function bound to its
  arguments) -> one `Outcome` each: what it returned, what it raised, or that it ran out of
  time. With no time limit and one worker they run here, one after another (a function that
  uses signal.alarm, as math-verify's default timeouts do, needs the main thread); with a time
  limit each runs on a daemon thread that is abandoned when its time is up (a thread cannot be
  stopped; its late result is ignored, and a daemon thread never holds the process at exit).
  Every call runs in a copy of the caller's context (contextvars), on whichever thread: what
  the caller's context holds (a context variable a reward function's caller set) reaches it.
* `EventLoop`: one asyncio loop on a daemon thread of its own, on which the coroutines of
  `async def` rewards are awaited together (`asyncio.gather`), each within the time limit (a
  coroutine that runs out of time is cancelled). A loop of its own, not `asyncio.run`: in a
  notebook the main thread already runs a loop, inside which asyncio.run refuses to start.

* `waiting()`: whether the main thread is waiting on reward calls (or running one) now. A stop
  asked then (the run's signal handler, run/failures.GracefulStop) cannot wait for a call that
  may never return: the handler raises `Interrupted` there, the calls are abandoned (a thread
  as when its time is up, a coroutine cancelled) and the run saves and ends at once.

Not here: which calls to make and what their values mean (functions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import Any

# A loop blocked by synchronous code inside an `async def` cannot cancel anything: the caller
# stops waiting this long after the time limit and starts a fresh loop for the next calls.
GRACE_SECONDS = 5.0


class Interrupted(BaseException):
    """A stop was asked while the main thread waited on reward calls, which are abandoned. A
    BaseException, as KeyboardInterrupt is: a reward's own `except Exception` does not take
    it."""


_waiting = 0  # how deep the main thread is in reward calls (signal handlers run on it)


@contextlib.contextmanager
def _waits():
    global _waiting
    main = threading.current_thread() is threading.main_thread()
    _waiting += main
    try:
        yield
    finally:
        _waiting -= main


def waiting() -> bool:
    """Whether the main thread is waiting on reward calls, or running one, now."""
    return _waiting > 0


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def _outcome(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(value=call())
    except Exception as e:  # the caller names the function and keeps the traceback
        return Outcome(error=e)


def run_sync(
    calls: list[Callable[[], Any]], workers: int = 1, timeout: float | None = None
) -> list[Outcome]:
    """Each call's Outcome, in order; at most `workers` at once, each within `timeout` seconds
    (None: no limit)."""
    with _waits():
        return _run_sync([_in_context(c) for c in calls], workers, timeout)


def _run_sync(calls: list[Callable[[], Any]], workers: int, timeout: float | None) -> list[Outcome]:
    if timeout is None:
        if workers <= 1 or len(calls) <= 1:
            return [_outcome(c) for c in calls]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(_outcome, calls))
    out: list[Outcome] = []
    for start in range(0, len(calls), max(workers, 1)):
        out.extend(_on_threads(calls[start : start + max(workers, 1)], timeout))
    return out


def _in_context(call: Callable[[], Any]) -> Callable[[], Any]:
    """The call, to run in a copy of the caller's context as it is now (one copy per call: a
    context cannot be entered by two threads at once)."""
    return partial(contextvars.copy_context().run, call)


def _on_threads(calls: list[Callable[[], Any]], timeout: float) -> list[Outcome]:
    """Calls started together on daemon threads, each given until the same deadline."""
    boxes: list[list[Outcome]] = [[] for _ in calls]
    threads = [
        threading.Thread(target=lambda c=c, b=b: b.append(_outcome(c)), daemon=True)
        for c, b in zip(calls, boxes)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    return [b[0] if b else Outcome(timed_out=True) for b in boxes]


class EventLoop:
    """An asyncio loop on its own daemon thread, started on first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True).start()
                self._loop = loop
            return self._loop

    def start(self, awaitables: list[Awaitable], timeout: float | None) -> Future:
        """Await them together on the loop, each within `timeout`; -> a future of their
        Outcomes (`collect` reads it)."""

        async def one(aw: Awaitable) -> Outcome:
            try:
                return Outcome(value=await asyncio.wait_for(aw, timeout))
            except asyncio.TimeoutError:
                return Outcome(timed_out=True)
            except Exception as e:
                return Outcome(error=e)

        async def every() -> list[Outcome]:
            return list(await asyncio.gather(*(one(aw) for aw in awaitables)))

        return asyncio.run_coroutine_threadsafe(every(), self._running())

    def collect(self, future: Future, n: int, timeout: float | None) -> list[Outcome]:
        """The Outcomes of `start`'s future. Should the loop itself be stuck past the time limit
        (blocking code inside a coroutine), all n count as timed out and the next calls get a
        fresh loop."""
        try:
            with _waits():
                return future.result(None if timeout is None else timeout + GRACE_SECONDS)
        except Interrupted:
            future.cancel()  # the coroutines are cancelled on the loop
            raise
        except FutureTimeout:
            future.cancel()
            with self._lock:
                self._loop = None  # abandoned with its thread; a daemon, so never waited for
            return [Outcome(timed_out=True) for _ in range(n)]

    def run(self, awaitables: list[Awaitable], timeout: float | None) -> list[Outcome]:
        return self.collect(self.start(awaitables, timeout), len(awaitables), timeout)
