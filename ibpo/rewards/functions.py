"""Reward functions in TRL's convention, the weighted set of them a run grades with, and the
one route by which completions are graded.

Names: a reward *function* is a callable (`RewardFunction` holds one with its name and
weight); a `RewardSet` is the weighted set a run grades with (passed around as `reward_fns`);
*rewards* are always values (a `Grades`' totals, the step's [B, G] tensor).

A reward function returns one value per completion (`list[float | None]`) and is called as
TRL's GRPOTrainer calls it, every argument by keyword:

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
       log_metric=..., **columns)

one entry per completion (a prompt's row repeated for each of its G completions). `prompts`
are the prompts as the dataset gives them (a string, or a chat's list of {"role", "content"}
messages); `completions` the texts, or for a conversational prompt one-message chats
`[{"role": "assistant", "content": text}]`, as graders must read them (rewards.math.text_to_grade:
with "<think>" in front when the prompt opened the think block); `completion_ids` their token
ids; `trainer_state` the run's state (global_step, max_steps, epoch: run/callbacks.RunState);
`log_metric(name, value)` adds a scalar to the grading's metrics (the step's, or the held-out
evaluation's as `eval_<name>`), `log_extra(column, values)` a column (one value per completion
of the call) to the step's completions table. Every dataset
column comes by name, except TRL's `prompt` (it is `prompts`) and `completion`; `answer` holds
the gold answer as data.answer_column and data.answer_format read it (what the built-in
graders compare against). A function that takes only some of these takes `**kwargs` for the
rest, as TRL's do; one that needs an argument nobody passes, or refuses one that is passed,
is an error naming it before its first call runs.

Each call gets values of its own (`_own` copies, at every depth): what a function changes in
its arguments (appending to a list inside a row's column) reaches no other call, no later step
and not the dataset's rows.

None means "this reward does not apply to that completion". A value may also be a grader's
`errors.Graded` (what the built-ins return, or what a function of yours passes on from
`score_math` / `score_code`): its score, and its failure, if the grader had one, returned with the
grading. The reward is TRL's weighted sum
over the functions that apply (`nansum` of weight x value); a completion no function applies
to has no reward (NaN, TRL's rule: left out of its group's baseline, no advantage), and a
warning names the first such row. Each function's mean over the completions it applies to is
logged per step as `rewards/<name>` (and TRL's `rewards/<name>/mean`, `/std`).

What the values mean is the set's thresholds (reward.correct_threshold, failed_threshold):
a weighted reward >= `correct` is a correct completion (held-out accuracy, a successful
repair, a preferred repair reference), <= `failed` a failed one (IBPO repairs it); the first
weighted reward outside [failed, correct] gets one warning saying so.

`async def` functions are awaited together on an event loop of their own while the others run
(rewards/calls.py); `workers` > 1 (a RewardSet built in Python; a run uses one) runs the
synchronous ones on a thread pool, each one's completions split into that many chunks.
`timeout` (reward.timeout) bounds every call: one that runs out of time scores 0 for its
completions, counted (`reward_timeouts`, one warning naming it), and the run goes on.

A grading returns `Grades`: the weighted totals, each function's values, the columns and
metrics the functions logged, the calls that ran out of time and the built-in graders' own
failures (which they return with their scores: errors.Graded), all of that grading's alone, so
gradings may run at once.
`grade_completions` is the route every grading takes (the step's rollouts and repairs, the
held-out evaluation, the benchmarks): problems, rendered prompts and completion texts in,
`Grades` out.

`reward.functions` names them: a built-in (`math`, `code`: the graders of
ibpo.rewards.GRADERS, each `(text, gold) -> Graded`, wrapped here), an import path
`package.module:function`, a reward model's Hub id or folder (rewards/models.py), or a list of
them; `reward.weights` gives one weight per function (default 1 each). The Python API passes
callables directly (ibpo.train), and a reward model as the pair (model, tokenizer).

A function that returns anything but one number (or None) per completion (a string, a dict,
the wrong count, NaN or infinity) or that raises is a RewardError naming the function (for an
exception: the first sample that raises on its own, the exception's last line, and the
exception itself chained, traceback and all, for the run folder; for a test the run's sandbox
policy refused, sandbox/policy.py, the refusal and its fix).

Not here: what the values do to the objective (step.py, advantages.py, repair.py), the graders
(math.py, code.py), how calls run concurrently and within their time (calls.py).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import math
import numbers
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ibpo.config import ConfigError, check_reward_weights
from ibpo.rewards import GRADERS
from ibpo.rewards.calls import EventLoop, Outcome, run_sync
from ibpo.rewards.errors import Graded, GraderFailure
from ibpo.rewards.math import text_to_grade
from ibpo.rewards.models import hub_reward_model, reward_model
from ibpo.sandbox.policy import Refused

# A reward function as its author writes it, in TRL's convention: called with the batch's
# prompts, completions and columns by name, returns one reward (or None) per completion.
RewardCallable = Callable[..., list]

# What every reward function is passed besides the dataset's columns (TRL's names).
ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# Columns not passed by their name: TRL passes the prompt as `prompts` and the completion as
# `completions`; a column named like one of the arguments would collide with it.
NOT_COLUMNS = frozenset({"prompt", "completion", *ARGUMENTS})
_SHOWN = 200  # characters of a prompt, completion or column shown in a warning


class RewardError(Exception):
    """A reward function failed while grading (it raised, returned what is not one number per
    completion, or could not take its arguments): the message names the function, what it did
    and the fix. Not a ConfigError: the run's configuration was read and checked; a run ends
    on it with status reward_failed (run/failures.py)."""


def _text(completion) -> str:
    """A completion's text: the string, or the content of a conversational completion; of a
    conversation with tool turns (rollout.tools), its last assistant turn: the final answer."""
    if isinstance(completion, list):
        turns = [m for m in completion if isinstance(m, dict)]
        if any(m.get("role") == "tool" for m in turns):
            said = [m for m in turns if m.get("role") == "assistant"]
            return str(said[-1].get("content", "")) if said else ""
        return "".join(str(m.get("content", "")) for m in turns)
    return completion


# Columns that hold a multiple-choice problem's options, in the order they are read.
CHOICE_COLUMNS = ("choices", "options")


@functools.lru_cache(maxsize=64)
def takes_choices(grader: Callable) -> bool:
    """Whether a grader reads a problem's options: it has a `choices` parameter (math_reward)."""
    try:
        return "choices" in inspect.signature(grader).parameters
    except (TypeError, ValueError):
        return False


def problem_choices(columns: dict, prompts: list | None, n: int) -> list:
    """Each completion's problem options as a grader's `choices` takes them: the row's
    `choices` / `options` column where it has one, else the problem's text (its question, or a
    conversation's last user message), where options written out are found."""
    out = []
    for i in range(n):
        value = None
        for name in CHOICE_COLUMNS:
            column = columns.get(name)
            if isinstance(column, list) and i < len(column) and column[i] is not None:
                value = column[i]
                break
        if value is None and prompts is not None and i < len(prompts):
            value = _problem_text(prompts[i])
        out.append(value)
    return out


def _problem_text(prompt) -> str | None:
    """A prompt as the dataset gives it -> the problem's text (a chat: its last user message)."""
    if not isinstance(prompt, list):
        return prompt if isinstance(prompt, str) else None
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else None


def builtin(name: str) -> RewardCallable:
    """The grader GRADERS[name] (`(text, gold) -> Graded`) as a function called as reward
    functions are, reading the `answer` column, and the problem's options (problem_choices) for
    a grader that takes `choices`; it returns each completion's Graded (score and the grader's
    failure, if it had one). Looked up when called, so that a grader registered later is the
    one used."""

    def reward(completions: list, answer: list | None = None, prompts=None, **columns):
        grader = GRADERS[name]
        gold = answer if answer is not None else [None] * len(completions)
        options = {}
        if takes_choices(grader):
            options = {"choices": problem_choices(columns, prompts, len(completions))}
        return [
            grader(_text(c), a, **{k: v[i] for k, v in options.items()})
            for i, (c, a) in enumerate(zip(completions, gold))
        ]

    reward.__name__ = name
    return reward


def import_reward(path: str) -> RewardCallable:
    """`package.module:function` -> the function; ConfigError naming the fix when it is not
    there or not callable."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward.functions={path!r}: an import path is 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ModuleNotFoundError, or the module's own error while importing
        raise ConfigError(
            f"reward.functions={path!r}: cannot import module '{module_name}' "
            f"({type(e).__name__}: {e}). Fix: install it or put its folder on PYTHONPATH."
        ) from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(
            f"reward.functions={path!r}: module '{module_name}' has no function '{attr}'"
        )
    return fn


def _own(values: list) -> list:
    """A copy of a slice of a column (or of the prompts, completions, completion ids) that no
    other call shares: deep, but for values deepcopy cannot copy, which are passed as they are."""
    flat = (str, int, float, bool, type(None))
    if all(isinstance(v, flat) for v in values):  # texts, answers: nothing to change in place
        return list(values)
    if all(isinstance(v, list) and all(isinstance(x, flat) for x in v) for v in values):
        return [list(v) for v in values]  # token ids: as fast as a copy gets
    try:
        return copy.deepcopy(values)
    except Exception:  # noqa: BLE001 - an object deepcopy refuses: shared, as TRL shares all
        return [copy.copy(v) if isinstance(v, (list, dict, set)) else v for v in values]


def reward_name(fn: RewardCallable) -> str:
    """The name a function's metric is logged under (TRL's: the function's __name__; a
    functools.partial without a __name__ of its own: the wrapped function's)."""
    inner = fn
    while isinstance(inner, functools.partial) and not getattr(inner, "__name__", None):
        inner = inner.func
    return getattr(inner, "__name__", None) or type(inner).__name__


def _unwrapped(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def import_path(fn: RewardCallable) -> str:
    """`module:qualname` of a function (what reward.functions records for one given in
    Python; a lambda, a nested function or a functools.partial, `module:qualname.<partial>`,
    cannot be imported back, and says so in its name)."""
    inner = _unwrapped(fn)
    path = f"{getattr(inner, '__module__', '?')}:{getattr(inner, '__qualname__', reward_name(fn))}"
    return path + ".<partial>" if inner is not fn else path


def is_async_callable(fn) -> bool:
    """An `async def` function, a partial of one, or an object whose __call__ is one."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    return callable(fn) and not inspect.isroutine(fn) and inspect.iscoroutinefunction(fn.__call__)


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: judged when called
        return None


@dataclass(frozen=True)
class RewardFunction:
    """One function of a RewardSet: its name (metrics `rewards/<name>`), the callable and its
    weight in the total."""

    name: str
    fn: RewardCallable
    weight: float = 1.0
    builtin: bool = False  # a built-in grader: reads the gold `answer`

    @functools.cached_property
    def is_async(self) -> bool:
        return is_async_callable(self.fn)

    @functools.cached_property
    def signature(self) -> inspect.Signature | None:
        return _signature(self.fn)


class _TimedOut(Exception):
    """An awaitable a synchronous function returned ran out of time."""


@dataclass
class Grades:
    """What one grading of n completions gave: the weighted reward of each (NaN: no function
    applies), each function's values (NaN: it returned None), the columns the functions logged
    (log_extra: one value per completion), the values they logged by metric name (log_metric),
    the calls that ran out of time and the graders' own failures (each scored 0)."""

    totals: list[float]
    per_function: dict[str, list[float]]
    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    timeouts: int = 0
    failures: list[GraderFailure] = field(default_factory=list)

    def failure_reasons(self) -> list[str]:
        """Each completion's grader failures, joined ("" where its grading did not fail)."""
        out = [""] * len(self.totals)
        for f in self.failures:
            if f.index is not None and 0 <= f.index < len(out):
                out[f.index] = f"{out[f.index]}; {f.reason}" if out[f.index] else f.reason
        return out


def logged_metrics(gradings: Sequence[Grades]) -> dict[str, float]:
    """The mean of each metric the functions logged (log_metric) over several gradings (one
    step's, one evaluation's)."""
    logged: dict[str, list[float]] = {}
    for g in gradings:
        for name, values in g.metrics.items():
            logged.setdefault(name, []).extend(values)
    return {name: sum(v) / len(v) for name, v in logged.items() if v}


class _Grading:
    """What the functions leave during one grading of n completions (log_extra, log_metric)."""

    def __init__(self, n: int):
        self.n = n
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}
        self.lock = threading.Lock()


class RewardSet:
    """The run's reward functions (`functions`) with their weights and thresholds: `score`
    grades a batch of completions -> Grades. Also what the functions see: `trainer_state` (the
    trainer sets it). A grading keeps what it produces in its Grades, so several may run at
    once; the set keeps only its warnings (each once) and its event loop."""

    def __init__(
        self,
        functions: Sequence[RewardFunction],
        workers: int = 1,
        timeout: float | None = None,
        correct: float = 1.0,
        failed: float = 0.0,
        trainer_state: Any = None,
    ):
        if not functions:
            raise ConfigError("reward.functions names no reward function")
        names = [r.name for r in functions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(
                f"two reward functions are named {dup[0]!r}; their metrics would collide. "
                "Fix: give each function its own name: def it under another name, or set "
                f"`fn.__name__ = '{dup[0]}_2'` (two functools.partial of one function are both "
                "named after it)"
            )
        self.functions, self.workers = list(functions), max(int(workers), 1)
        self.timeout = None if timeout is None or timeout <= 0 else float(timeout)
        self.correct, self.failed = float(correct), float(failed)
        self.trainer_state = trainer_state
        self._lock = threading.Lock()
        self._loop = EventLoop()
        self._warned: set[str] = set()
        self._bindable: set = set()

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.functions]

    @property
    def reads_answer(self) -> bool:
        """Whether a built-in grader needs each row's gold answer (data.answer_column)."""
        return any(r.builtin for r in self.functions)

    # --- what the functions leave -----------------------------------------------------------

    def _log_metric(self, grading: _Grading, name: str, value: float) -> None:
        try:
            value = float(value)
        except (TypeError, ValueError):
            self._warn_once(
                f"metric:{name}",
                f"log_metric({name!r}, {value!r}): not a number, not logged. Fix: pass a float",
            )
            return
        with grading.lock:
            grading.metrics.setdefault(str(name), []).append(value)

    def _log_extra(self, grading: _Grading, lo: int, hi: int, column: str, values) -> None:
        """log_extra of a call on completions[lo:hi]: its values take their rows' places."""
        values = list(values)
        if len(values) != hi - lo:
            self._warn_once(
                f"extra:{column}",
                f"log_extra({column!r}, ...) got {len(values)} values for a call on {hi - lo} "
                "completions; the column is not logged. Fix: one value per completion",
            )
            return
        with grading.lock:
            grading.extra.setdefault(str(column), [None] * grading.n)[lo:hi] = values

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        print(f"ibpo: warning: {message}", file=sys.stderr)

    # --- grading ----------------------------------------------------------------------------

    def score(
        self, completions: list, columns: dict[str, list], prompts: list, completion_ids=None
    ) -> Grades:
        """Every function called on the completions, as TRL calls them -> Grades. `columns`:
        name -> one value per completion."""
        n = len(completions)
        grading = _Grading(n)
        base = {k: v for k, v in columns.items() if k not in NOT_COLUMNS}
        base.update(
            prompts=list(prompts),
            completions=list(completions),
            completion_ids=completion_ids,
            trainer_state=self.trainer_state,
        )
        sync = [r for r in self.functions if not r.is_async]
        concurrent = [r for r in self.functions if r.is_async]
        pending = None
        if concurrent:  # started first: awaited on the loop while the others run
            coros = [r.fn(**self._kwargs(r, base, 0, n, grading)) for r in concurrent]
            pending = self._loop.start(coros, self.timeout)
        chunks = _chunks(n, self.workers)
        jobs = [(r, lo, hi) for r in sync for lo, hi in chunks]
        calls = [self._call(r, self._kwargs(r, base, lo, hi, grading)) for r, lo, hi in jobs]
        outcomes = run_sync(calls, self.workers, self.timeout)
        if concurrent:
            jobs += [(r, 0, n) for r in concurrent]
            outcomes += self._loop.collect(pending, len(concurrent), self.timeout)
        grades = Grades([], {r.name: [math.nan] * n for r in self.functions})
        for (r, lo, hi), outcome in zip(jobs, outcomes):
            grades.per_function[r.name][lo:hi] = self._values(r, outcome, base, lo, hi, grades)
        for i in range(n):
            applied = [(r.weight, grades.per_function[r.name][i]) for r in self.functions]
            applied = [w * v for w, v in applied if not math.isnan(v)]
            grades.totals.append(sum(applied) if applied else math.nan)
        self._check_total(grades.totals, base)
        grades.extra, grades.metrics = grading.extra, grading.metrics
        return grades

    def _kwargs(self, r: RewardFunction, base: dict, lo: int, hi: int, grading: _Grading) -> dict:
        """The keyword arguments of r's call on completions[lo:hi]; what it logs goes to
        `grading`."""
        # each call gets values of its own: a function that changes a value in place (appends
        # to a list a row holds) changes nothing another call, or a later step, sees
        kw = {k: _own(v[lo:hi]) if isinstance(v, list) else v for k, v in base.items()}
        kw["log_extra"] = functools.partial(self._log_extra, grading, lo, hi)
        kw["log_metric"] = functools.partial(self._log_metric, grading)
        self._check_arguments(r, kw)
        return kw

    def _call(self, r: RewardFunction, kw: dict) -> Callable[[], Any]:
        """A synchronous function's call -> its value; an awaitable it returns is awaited on
        the loop."""

        def call():
            out = r.fn(**kw)
            if inspect.isawaitable(out):
                (done,) = self._loop.run([out], self.timeout)
                if done.timed_out:
                    raise _TimedOut
                if done.error is not None:
                    raise done.error
                out = done.value
            return out

        return call

    def _check_arguments(self, r: RewardFunction, kw: dict) -> None:
        """The arguments must bind: a parameter nobody passes, or a passed one that the
        function does not take (and no **kwargs), is named before anything runs."""
        key = (r.name, frozenset(kw))
        if r.signature is None or key in self._bindable:
            return
        params = list(r.signature.parameters.values())
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        missing = [p.name for p in named if p.default is p.empty and p.name not in kw]
        missing += [p.name for p in params if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
        if missing:
            columns = sorted(k for k in kw if k not in ARGUMENTS)
            raise RewardError(
                f"reward function {r.name!r} needs argument {missing[0]!r}, which is neither "
                f"one of TRL's arguments ({', '.join(ARGUMENTS)}) nor a column of the dataset "
                f"(its columns: {', '.join(columns) or 'none'}). Every argument is passed by "
                "keyword, as TRL does. Fix: name the parameter after what it reads (e.g. "
                "completions), or give it a default"
            )
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            extra = [k for k in kw if k not in {p.name for p in named}]
            if extra:
                raise RewardError(
                    f"reward function {r.name!r} does not take {', '.join(map(repr, extra))}, "
                    "which every reward function is passed by keyword (TRL's convention). Fix: "
                    "add **kwargs to its signature"
                )
        self._bindable.add(key)

    def _values(
        self, r: RewardFunction, o: Outcome, base: dict, lo: int, hi: int, grades: Grades
    ) -> list[float]:
        """One call's values on completions[lo:hi]; its timeout, or the failures a built-in
        grader returned, go to `grades`."""
        if o.timed_out or isinstance(o.error, _TimedOut):
            grades.timeouts += 1
            self._warn_once(
                f"timeout:{r.name}",
                f"reward function {r.name!r} ran past reward.timeout="
                f"{self.timeout:g} s on {hi - lo} completions: they score 0 and the run goes "
                "on (counted in the step's reward_timeouts; later ones are not reported). Fix: "
                "make the reward faster, or raise reward.timeout",
            )
            return [0.0] * (hi - lo)
        if isinstance(o.error, Refused):  # the run's sandbox policy, not the function: the fix
            raise RewardError(f"reward function {r.name!r} ran tested code: {o.error}") from o.error
        if o.error is not None:
            message, error = self._raised(r, base, lo, hi, o.error)
            raise RewardError(message) from error
        value = o.value
        if isinstance(value, list) and any(isinstance(g, Graded) for g in value):
            # a grader's Graded (a built-in's, or one a function of the user's passed on): its
            # score, and its failure placed at its completion and function
            grades.failures += [
                replace(g.failure, index=lo + i, function=r.name)
                for i, g in enumerate(value)
                if isinstance(g, Graded) and g.failure is not None
            ]
            value = [g.score if isinstance(g, Graded) else g for g in value]
        return _checked(r, value, hi - lo, lo)

    def _raised(self, r: RewardFunction, base: dict, lo: int, hi: int, e: BaseException):
        """(The message, the exception) for a function that raised on completions[lo:hi]:
        the first sample that raises on its own, found by calling it one sample at a time."""
        for i in range(lo, hi):
            kw = self._kwargs(r, base, i, i + 1, _Grading(hi))  # what it logs: not kept
            if r.is_async:
                (o,) = self._loop.run([r.fn(**kw)], self.timeout)
            else:
                (o,) = run_sync([self._call(r, kw)], 1, self.timeout)
            if o.timed_out or isinstance(o.error, _TimedOut):
                break
            if o.error is not None:
                return (
                    f"reward function {r.name!r} raised on sample {i}: {_last_line(o.error)}",
                    o.error,
                )
        return (
            f"reward function {r.name!r} raised on a batch of {hi - lo} completions "
            f"(each alone passes): {_last_line(e)}"
        ), e

    def _check_total(self, total: list[float], base: dict) -> None:
        """The warnings about the weighted rewards: a completion no function applied to (its
        row named), and rewards outside the scale the thresholds assume. Once each."""
        unscored = [i for i, t in enumerate(total) if math.isnan(t)]
        if unscored and "unscored" not in self._warned:
            i = unscored[0]
            columns = {
                k: _short(v[i])
                for k, v in base.items()
                if isinstance(v, list) and k != "completion_ids"
            }
            self._warn_once(
                "unscored",
                f"no reward function applies to completion {i} of {len(total)} (every one "
                "returned None): it gets no advantage and is left out of its group's baseline, "
                f"as in TRL; later ones are counted (the step's `unscored`), not reported. Its "
                f"row: {columns}",
            )
        scored = [t for t in total if not math.isnan(t)]
        if scored and "range" not in self._warned:
            low, high = min(scored), max(scored)
            if low < self.failed or high > self.correct:
                self._warn_once(
                    "range",
                    f"weighted rewards reach {low:g}..{high:g}, outside [{self.failed:g}, "
                    f"{self.correct:g}]: a completion counts as correct at >= "
                    f"{self.correct:g} (held-out accuracy, a successful repair) and as failed at "
                    f"<= {self.failed:g} (IBPO repairs it). If your rewards' scale is another, "
                    "set reward.correct_threshold and reward.failed_threshold to it",
                )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _opened(rendered: str, chat: list[dict]) -> list[dict]:
    """A tool conversation as graders read it: text_to_grade on its first assistant turn."""
    chat = [dict(m) for m in chat]
    if chat and chat[0].get("role") == "assistant":
        chat[0]["content"] = text_to_grade(rendered, chat[0].get("content", ""))
    return chat


def reward_stats(per: dict[str, list[float]]) -> dict[str, float]:
    """Each function's mean over the completions it applied to, as `rewards/<name>` and TRL's
    `rewards/<name>/mean`, and their standard deviation (Bessel's, as TRL) as
    `rewards/<name>/std`; NaN where it applied to none (std: to fewer than two)."""
    out = {}
    for name, values in per.items():
        seen = [v for v in values if not math.isnan(v)]
        mean = sum(seen) / len(seen) if seen else math.nan
        std = (
            math.sqrt(sum((v - mean) ** 2 for v in seen) / (len(seen) - 1))
            if len(seen) > 1
            else math.nan
        )
        out.update({f"rewards/{name}": mean, f"rewards/{name}/mean": mean})
        out[f"rewards/{name}/std"] = std
    return out


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    size = -(-n // k) if n else 1
    return [(lo, min(lo + size, n)) for lo in range(0, max(n, 1), size)]


def _last_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _checked(r: RewardFunction, out, n: int, offset: int) -> list[float]:
    fix = "Fix: return a list of one float (or None: does not apply) per completion"
    if isinstance(out, (str, bytes, Mapping)):
        raise RewardError(
            f"reward function {r.name!r} returned a {type(out).__name__} ({_short(out)}), not "
            f"a list. {fix}"
        )
    if not isinstance(out, Sequence):
        try:
            out = list(out)  # a tensor or an array
        except TypeError:
            raise RewardError(
                f"reward function {r.name!r} returned a {type(out).__name__}, not a list. {fix}"
            ) from None
    if len(out) != n:
        raise RewardError(
            f"reward function {r.name!r} returned {len(out)} values for {n} completions. {fix}"
        )
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
            continue
        if hasattr(v, "item") and not isinstance(v, numbers.Number):
            v = v.item()  # a 0-dim tensor or a numpy scalar
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RewardError(
                f"reward function {r.name!r} returned {v!r} ({type(v).__name__}) for sample "
                f"{offset + i}, not a number. {fix}"
            )
        if not math.isfinite(v):
            raise RewardError(
                f"reward function {r.name!r} returned {v} for sample {offset + i}. Fix: return "
                "a finite number (None when the reward does not apply)"
            )
        values.append(float(v))
    return values


def reward_set(
    spec: str | list[str] | RewardCallable | Sequence,
    weights: Sequence[float] | None = None,
    workers: int = 1,
    timeout: float | None = None,
    correct: float = 1.0,
    failed: float = 0.0,
) -> RewardSet:
    """Names (built-in or import path) and/or callables -> a RewardSet; weights one per
    function (None: 1 each); the other arguments are RewardSet's."""
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    fns = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and _is_module(item[0]):
            fn = reward_model(*item)  # (a sequence-classification model, its tokenizer)
            fns.append((reward_name(fn), fn, False))
            continue
        if _is_module(item):
            raise ConfigError(
                f"reward {type(item).__name__} is a torch module (a reward model) without its "
                "tokenizer. Fix: pass the pair (model, tokenizer), or "
                "ibpo.rewards.models.reward_model(model, tokenizer)"
            )
        if callable(item):
            fns.append((reward_name(item), item, False))
        elif item in GRADERS:
            fns.append((item, builtin(item), True))
        elif isinstance(item, str) and ":" in item:
            fn = import_reward(item)
            fns.append((reward_name(fn), fn, False))
        elif isinstance(item, str) and "/" in item:  # a reward model's Hub id or folder
            fn = hub_reward_model(item)
            fns.append((reward_name(fn), fn, False))
        else:
            raise ConfigError(
                f"reward.functions={item!r}; choose a built-in ({', '.join(GRADERS)}), an "
                "import path 'package.module:function' or a reward model's Hub id or folder"
            )
    check_reward_weights(weights, len(fns))
    for name, fn, _ in fns:
        _check_signature(name, fn)
    ws = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    functions = [RewardFunction(n, f, w, b) for (n, f, b), w in zip(fns, ws)]
    return RewardSet(functions, workers, timeout, correct, failed)


def _is_module(item) -> bool:
    """A torch.nn.Module, told without importing torch."""
    return any(
        c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(item).__mro__
    )


def _check_signature(name: str, fn: RewardCallable) -> None:
    """What fails now rather than at the first step: a function that cannot be called by
    keyword, or that refuses one of TRL's arguments (no **kwargs to take it)."""
    sig = _signature(fn)
    if sig is None:
        return
    params = list(sig.parameters.values())
    if any(p.kind == p.POSITIONAL_ONLY and p.default is p.empty for p in params):
        raise ConfigError(
            f"reward function {name!r} has a positional-only parameter; every argument is "
            "passed by keyword, as TRL does: fn(completions, **kwargs) -> list[float | None]"
        )
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    taken = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    refused = [a for a in ARGUMENTS if a not in taken]
    if refused:
        raise ConfigError(
            f"reward function {name!r} does not take {', '.join(map(repr, refused))}, which "
            "every reward function is passed by keyword (TRL's convention). Fix: add **kwargs "
            "to its signature"
        )


def run_reward_set(reward, reward_funcs=None) -> RewardSet:
    """The run's reward functions: `reward_funcs` (given in Python) or those reward.functions
    names, with reward.weights, timeout, correct_threshold and failed_threshold (the reward
    section, a RewardConfig), one worker."""
    spec = reward.functions if reward_funcs is None else reward_funcs
    return reward_set(
        spec, reward.weights, 1, reward.timeout, reward.correct_threshold, reward.failed_threshold
    )


def grade_completions(
    reward_fns: RewardSet,
    examples: list,
    rendered: list[str],
    texts: list[str],
    ids=None,
    tools: dict[str, list] | None = None,
) -> Grades:
    """Grade completions, the one route of the step, the repairs, the held-out evaluation and
    the benchmarks: `examples[n]` (data.Example) is the problem completion n answers,
    `rendered[n]` the prompt it continued and `texts[n]` its text (`ids[n]` its token ids).
    The functions get what the module docstring says: the rows' columns, `answer`, `prompts`
    as the dataset gives them, and each completion as graders must read it (text_to_grade;
    for a conversation as a one-message chat). `tools`: for rollouts that called tools
    (generation.multiturn.tool_columns), each completion's conversation (its assistant and
    tool turns, which the functions get as completions, as TRL passes them) and the columns
    `tool_calls` and `tool_errors` (calls made, calls that failed)."""
    to_grade = [text_to_grade(p, t) for p, t in zip(rendered, texts)]
    completions: list = [
        [{"role": "assistant", "content": t}] if ex.messages is not None else t
        for ex, t in zip(examples, to_grade)
    ]
    names = list(dict.fromkeys(k for ex in examples for k in ex.columns))
    columns = {k: [ex.columns.get(k) for ex in examples] for k in names}
    columns["answer"] = [ex.answer for ex in examples]
    if tools is not None:
        completions = [_opened(p, chat) for p, chat in zip(rendered, tools["conversations"])]
        columns.update({k: v for k, v in tools.items() if k != "conversations"})
    prompts = [
        [dict(m) for m in ex.messages]
        if ex.messages is not None
        else (ex.question if ex.given is None else ex.given)
        for ex in examples
    ]
    return reward_fns.score(completions, columns, prompts, ids)
