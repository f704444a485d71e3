"""Reward functions in TRL's convention, and the weighted set of them a run grades with.

A reward function is `fn(completions: list[str], **kwargs) -> list[float | None]`, one value per
completion, as TRL's GRPOTrainer calls it. The keyword arguments are every column of the
dataset by name (one entry per completion: a prompt's row repeated for each of its G
completions), `prompts` (the prompts as the dataset gives them: a string, or a chat's list of
{"role", "content"} messages) and `completion_ids` (the completion's token ids). `answer`
holds the gold answer as data.answer_column and data.answer_format read it, which is what the
built-in graders compare against. For a conversational prompt each completion is, as in TRL,
a one-message list `[{"role": "assistant", "content": text}]`. A completion reaches the
functions as graders must read it (rewards.math.as_graded: with "<think>" in front when the
prompt opened the think block). A function that accepts only some of these arguments should
take `**kwargs` for the rest, as TRL's do.

None means "this reward does not apply to that completion". The run's reward is TRL's weighted
sum over the functions that apply (`nansum` of weight x value), so a completion no function
applies to scores 0. Each function's mean over the completions it applies to is logged per
step as `rewards/<name>`.

`objective.reward` names the functions: a built-in (`math`, `code`: the graders of
ibpo.rewards.REWARDS, each `(text, gold) -> float`, wrapped here), an import path
`package.module:function`, or a list of them; `objective.reward_weights` gives one weight per
function (default 1 each). The Python API passes callables directly (ibpo.train).

A function that returns the wrong number of values, a value that is not a number, NaN or
infinity, or that raises, is a RewardError naming the function (for an exception, the index of
the first sample that raises on its own and the exception's last line; for a test the run's
sandbox policy refused, sandbox/policy.py, the refusal and its fix). `reward_workers` > 1
grades on a thread pool: the functions and, split into that many chunks, the completions run
concurrently (for remote verifiers, compilers and other slow rewards that wait rather than
compute).

Not here: what the values mean to the objective (step.py, repair.py) or the graders (math.py,
code.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ibpo.config import ConfigError
from ibpo.rewards import REWARDS
from ibpo.rewards.math import as_graded
from ibpo.sandbox.policy import Refused

RewardFn = Callable[..., list]


class RewardError(ConfigError):
    """A reward function misbehaved; the message names the function and what it did."""


def _text(completion) -> str:
    """A completion's text: the string, or the content of a conversational completion."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
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


def builtin(name: str) -> RewardFn:
    """The grader REWARDS[name] (`(text, gold) -> float`) as a reward function reading the
    `answer` column, and the problem's options (problem_choices) for a grader that takes
    `choices`. Looked up when called, so that a grader registered later is the one used."""

    def reward(completions: list, answer: list | None = None, prompts=None, **columns):
        grader = REWARDS[name]
        gold = answer if answer is not None else [None] * len(completions)
        if not takes_choices(grader):
            return [grader(_text(c), a) for c, a in zip(completions, gold)]
        choices = problem_choices(columns, prompts, len(completions))
        return [grader(_text(c), a, choices=o) for c, a, o in zip(completions, gold, choices)]

    reward.__name__ = name
    return reward


def import_reward(path: str) -> RewardFn:
    """`package.module:function` -> the function; ConfigError naming the fix when it is not
    there or not callable."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"objective.reward={path!r}: an import path is 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ModuleNotFoundError, or the module's own error while importing
        raise ConfigError(
            f"objective.reward={path!r}: cannot import module '{module_name}' "
            f"({type(e).__name__}: {e}). Fix: install it or put its folder on PYTHONPATH."
        ) from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(
            f"objective.reward={path!r}: module '{module_name}' has no function '{attr}'"
        )
    return fn


def reward_name(fn: RewardFn) -> str:
    """The name a function's metric is logged under (TRL's: the function's __name__)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def import_path(fn: RewardFn) -> str:
    """`module:qualname` of a function (what objective.reward records for one given in
    Python; a lambda or a nested function cannot be imported back, and says so in its name)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', reward_name(fn))}"


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0
    builtin: bool = False  # a built-in grader: reads the gold `answer`


class RewardSet:
    """The run's reward functions with their weights: `score` grades a batch of completions."""

    def __init__(self, rewards: Sequence[Reward], workers: int = 1):
        if not rewards:
            raise ConfigError("objective.reward names no reward function")
        names = [r.name for r in rewards]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(
                f"two reward functions are named {dup[0]!r}; their metrics would collide. "
                "Fix: give each function its own name"
            )
        self.rewards, self.workers = list(rewards), max(int(workers), 1)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @property
    def reads_answer(self) -> bool:
        """Whether a built-in grader needs each row's gold answer (data.answer_column)."""
        return any(r.builtin for r in self.rewards)

    def score(
        self, completions: list, columns: dict[str, list], prompts: list, completion_ids=None
    ) -> tuple[list[float], dict[str, list[float]]]:
        """-> (the weighted sum per completion, each function's values with NaN where it
        returned None). `columns`: name -> one value per completion."""
        n = len(completions)
        kwargs = dict(columns, prompts=prompts)
        if completion_ids is not None:
            kwargs["completion_ids"] = completion_ids
        chunks = _chunks(n, self.workers if self.workers > 1 else 1)
        jobs = [(r, lo, hi) for r in self.rewards for lo, hi in chunks]
        if self.workers > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                parts = list(pool.map(lambda j: _call(j[0], completions, kwargs, j[1], j[2]), jobs))
        else:
            parts = [_call(r, completions, kwargs, lo, hi) for r, lo, hi in jobs]
        per: dict[str, list[float]] = {r.name: [] for r in self.rewards}
        for (r, _, _), values in zip(jobs, parts):
            per[r.name].extend(values)
        total = [0.0] * n
        for r in self.rewards:
            for i, v in enumerate(per[r.name]):
                if not math.isnan(v):
                    total[i] += r.weight * v
        return total, per


def reward_means(per: dict[str, list[float]]) -> dict[str, float]:
    """`rewards/<name>`: each function's mean over the completions it applied to (NaN when it
    applied to none)."""
    out = {}
    for name, values in per.items():
        seen = [v for v in values if not math.isnan(v)]
        out[f"rewards/{name}"] = sum(seen) / len(seen) if seen else math.nan
    return out


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    size = -(-n // k) if n else 1
    return [(lo, min(lo + size, n)) for lo in range(0, max(n, 1), size)]


def _call(r: Reward, completions: list, kwargs: dict, lo: int, hi: int) -> list[float]:
    """One function on completions[lo:hi] -> its checked values (NaN for None)."""
    part = {k: v[lo:hi] if isinstance(v, list) else v for k, v in kwargs.items()}
    try:
        out = r.fn(completions[lo:hi], **part)
    except Refused as e:  # the run's sandbox policy, not the function: its message has the fix
        raise RewardError(f"reward function {r.name!r} ran tested code: {e}") from e
    except Exception as e:
        raise RewardError(_raised(r, completions[lo:hi], part, e, lo)) from e
    return _checked(r, out, hi - lo, lo)


def _raised(r: Reward, completions: list, kwargs: dict, e: Exception, offset: int) -> str:
    """The message for a function that raised: the first sample that raises on its own."""
    for i in range(len(completions)):
        one = {k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            r.fn(completions[i : i + 1], **one)
        except Exception as inner:
            return f"reward function {r.name!r} raised on sample {offset + i}: {_last_line(inner)}"
    return (
        f"reward function {r.name!r} raised on a batch of {len(completions)} completions "
        f"(each alone passes): {_last_line(e)}"
    )


def _last_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def _checked(r: Reward, out, n: int, offset: int) -> list[float]:
    fix = "Fix: return one float (or None: does not apply) per completion"
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
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
    spec: str | list[str] | RewardFn | Sequence,
    weights: Sequence[float] | None = None,
    workers: int = 1,
) -> RewardSet:
    """Names (built-in or import path) and/or callables -> a RewardSet; weights one per
    function (None: 1 each)."""
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    fns = []
    for item in items:
        if callable(item):
            fns.append((reward_name(item), item, False))
        elif item in REWARDS:
            fns.append((item, builtin(item), True))
        elif isinstance(item, str) and ":" in item:
            fn = import_reward(item)
            fns.append((reward_name(fn), fn, False))
        else:
            raise ConfigError(
                f"objective.reward={item!r}; choose a built-in ({', '.join(REWARDS)}) or an "
                "import path 'package.module:function'"
            )
    if weights is not None and len(weights) != len(fns):
        raise ConfigError(
            f"objective.reward_weights has {len(weights)} weights for {len(fns)} reward "
            "functions. Fix: give one weight per function"
        )
    for name, fn, _ in fns:
        _check_signature(name, fn)
    ws = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    return RewardSet([Reward(n, f, w, b) for (n, f, b), w in zip(fns, ws)], workers)


def _check_signature(name: str, fn: RewardFn) -> None:
    """A function that cannot take the completions as its first argument fails now, not at
    the first step."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: judged when called
        return
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigError(
            f"reward function {name!r} takes no positional argument; TRL's convention is "
            "fn(completions, **kwargs) -> list[float | None]"
        )


def run_reward_set(objective, reward_funcs=None) -> RewardSet:
    """The run's reward functions: `reward_funcs` (given in Python) or those objective.reward
    names, with objective.reward_weights and objective.reward_workers (an ObjectiveConfig)."""
    spec = objective.reward if reward_funcs is None else reward_funcs
    return reward_set(spec, objective.reward_weights, objective.reward_workers)


def grade(rewards: RewardSet, examples: list, rendered: list[str], texts: list[str], ids=None):
    """Grade completions: `examples[n]` (data.Example) is the problem completion n answers and
    `rendered[n]` the prompt it continued. -> RewardSet.score's (totals, per-function values).
    Kwargs as the module docstring says: the rows' columns, `answer`, `prompts` as the dataset
    gives them, and for a conversation the completions as one-message chats."""
    graded = [as_graded(p, t) for p, t in zip(rendered, texts)]
    completions = [
        [{"role": "assistant", "content": t}] if ex.messages is not None else t
        for ex, t in zip(examples, graded)
    ]
    names = list(dict.fromkeys(k for ex in examples for k in ex.columns))
    columns = {k: [ex.columns.get(k) for ex in examples] for k in names}
    columns["answer"] = [ex.answer for ex in examples]
    prompts = [
        [dict(m) for m in ex.messages] if ex.messages is not None else ex.question
        for ex in examples
    ]
    return rewards.score(completions, columns, prompts, ids)
