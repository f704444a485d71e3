"""A dataset's rows read as examples (`rows_to_examples`), the same for a local file, a Hub
dataset and rows given in Python (`RowList`).

Columns as RL datasets store them: `question_column` / `answer_column` may be dotted paths into
struct columns (`reward_model.ground_truth`). A question column holding a chat (a list of
{"role", "content"} messages: TRL's conversational `prompt`, verl-format sets' prompt) is a
conversation: rendered whole through the chat template (system message and earlier turns
kept), its last user message the question repairs quote; a chat in the answer column gives
its last user message. With question_column left at "question", a dataset without that column
but with TRL's `prompt` reads `prompt`. Every column of a row travels with its example
(`Example.columns`) to the reward functions (rewards/functions.py). A row without a question or
answer is an error that names the row (or, with data.skip_unusable, is left out).

Gold answers (`gold_answer`) as data.answer_format reads them: as given, after gsm8k's `####`, the
last \\boxed{}; `answer_format: code_tests` turns a test-case column of the PrimeIntellect /
open-r1 verifiable-coding-problems kind ({"language", "test_cases": [{"input", "output", "type":
stdin_stdout | function_call, "fn_name"}]}) into the code reward's JSON test spec.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from ibpo.config import ConfigError, DataConfig
from ibpo.data.example import Example
from ibpo.rewards.code import livecodebench_spec
from ibpo.rewards.math import last_boxed


def gold_answer(value: Any, answer_format: str) -> str | None:
    if value is None:
        return None
    if answer_format == "code_tests":
        return code_tests_spec(value)
    text = str(value).strip()
    if answer_format == "gsm8k":
        if "####" not in text:
            return None
        text = text.split("####")[-1].strip().replace(",", "")
    elif answer_format == "boxed":
        text = last_boxed(text) or ""
    return text or None


def code_tests_spec(info: Any) -> str | None:
    """A verifiable-coding-problems test column (a dict, or its JSON text) -> the code reward's
    JSON spec; None when there is nothing to run (no tests, not Python, mixed test kinds).
    function_call inputs hold the argument list as JSON, outputs the returned value as JSON."""
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except json.JSONDecodeError:
            return None
    if not isinstance(info, dict) or str(info.get("language", "python")).lower() != "python":
        return None
    cases = info.get("test_cases") or []
    if isinstance(cases, dict):  # a Sequence-of-struct feature reads as a dict of lists
        cases = [dict(zip(cases, values)) for values in zip(*cases.values())]
    kinds = {c.get("type") or "stdin_stdout" for c in cases}
    if not cases or len(kinds) > 1 or not kinds <= {"stdin_stdout", "function_call"}:
        return None
    fn_name = cases[0].get("fn_name") if kinds == {"function_call"} else None
    if kinds == {"function_call"} and not fn_name:
        return None
    return livecodebench_spec([_code_test(c, fn_name) for c in cases], fn_name=fn_name)


def _code_test(case: dict, fn_name: str | None) -> dict:
    """One {"input", "output"} test; a function call's JSON argument list becomes the list the
    code reward calls fn_name(*args) with (other text stays one JSON value per line)."""
    given = case["input"]
    if fn_name and isinstance(given, str):
        try:
            parsed = json.loads(given)
            given = parsed if isinstance(parsed, list) else given
        except json.JSONDecodeError:
            pass
    return {"input": given, "output": case["output"]}


def column_value(row: dict, path: str, chat_as_text: bool = True) -> Any:
    """row[path], where 'a.b' reads field b of struct column a; a chat (list of role/content
    messages) gives the content of its last user message (`chat_as_text`, else the chat).
    KeyError names a missing field."""
    value: Any = row
    for key in [path] if path in row else path.split("."):  # a column named "a.b" wins
        if not isinstance(value, dict) or key not in value:
            raise KeyError(key)
        value = value[key]
    if chat_as_text and is_chat(value):
        return last_user_message(value)
    return value


def is_chat(value: Any) -> bool:
    """A conversational prompt: a non-empty list of {"role", "content"} messages."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def last_user_message(messages: list) -> str | None:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else None


class RowList:
    """A list of row dicts read as rows_to_examples reads a `datasets.Dataset` (no Arrow: the
    rows keep their Python values, whatever their types)."""

    def __init__(self, rows: list[dict]):
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ConfigError(
                    f"the dataset's row {i} is a {type(row).__name__}, not a dict. Fix: pass a "
                    "datasets.Dataset or a list of dicts (one per row, column -> value)"
                )
        self.rows = rows
        self.column_names = list(dict.fromkeys(k for row in rows for k in row))

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def rows_to_examples(rows, cfg: DataConfig, source: str, need_answer: bool = True) -> list[Example]:
    """Rows -> examples. `need_answer=False` (no built-in grader reads the gold answer): a row
    without one keeps an empty answer. A question_column left at "question" reads TRL's
    `prompt` column in a dataset that has no `question`."""
    reader = RowReader(rows, cfg, source, need_answer)
    out = [ex for i, row in enumerate(rows) if (ex := reader.example(row, i)) is not None]
    reader.report(len(out))
    return out


class RowReader:
    """Reads a dataset's rows one at a time as examples (`example`), the same for a table read
    whole (`report` then says what was left out or changed) and for a stream read as it is
    drawn (`streamed`: said at the first occurrence): the columns checked once (TRL's `prompt`
    read where `question` is missing), an unusable row an error naming it (or, with
    data.skip_unusable, counted and left out), a conversation ending in the assistant's reply
    cut there (the reply the answer where the row has no answer column)."""

    def __init__(
        self, rows, cfg: DataConfig, source: str, need_answer: bool = True, streamed=False
    ):
        cols = list(getattr(rows, "column_names", None) or _first_row_columns(rows))
        if cfg.question_column == "question" and "question" not in cols and "prompt" in cols:
            cfg = dataclasses.replace(cfg, question_column="prompt")
        self.cfg, self.source, self.need_answer, self.streamed = cfg, source, need_answer, streamed
        needed = (cfg.question_column, cfg.answer_column) if need_answer else (cfg.question_column,)
        first = next(iter(rows), None)
        if isinstance(first, dict) and ends_in_reply(first, cfg.question_column):
            needed = (cfg.question_column,)  # the conversations' replies may be the answers
        for col in needed:
            if col in cols or col.split(".")[0] in cols:
                continue
            raise ConfigError(
                f"dataset '{source}' has no column '{col.split('.')[0]}'; its columns are: "
                f"{', '.join(cols)}. Set data.question_column / data.answer_column (a dotted "
                "path reads a field of a struct column)."
            )
        self.skipped, self.first_skipped, self.last_skipped = 0, "", ""  # data.skip_unusable
        self.replies = 0  # conversations whose trailing reply was left out of the prompt

    def example(self, row: dict, i: int) -> Example | None:
        """Row i as an Example; None for an unusable row left out (data.skip_unusable)."""
        try:
            return self._example(row, i)
        except ConfigError as e:
            if not self.cfg.skip_unusable:
                raise ConfigError(
                    f"{e}\n  (data.skip_unusable=true leaves such rows out)"
                ) from None
            self.skipped += 1
            self.last_skipped = str(e)
            self.first_skipped = self.first_skipped or self.last_skipped
            return None

    def report(self, kept: int) -> None:
        """What reading left out or changed, once all rows are read (`kept` examples)."""
        source, skipped = self.source, self.skipped
        if skipped and not kept:
            first = self.first_skipped.removeprefix(f"dataset '{source}', ")
            raise ConfigError(
                f"dataset '{source}': none of its {skipped} rows is usable; the first: "
                f"{first}. Fix: check data.question_column, data.answer_column and "
                "data.answer_format against the file's rows."
            )
        if self.replies:
            self._say_replies(str(self.replies))
        if skipped:
            print(
                f"ibpo: {source}: left out {skipped} of {skipped + kept} rows "
                f"(data.skip_unusable); the first: {self.first_skipped}",
                file=sys.stderr,
            )

    def _say_replies(self, how_many: str) -> None:
        print(
            f"ibpo: {self.source}: {how_many} conversations in '{self.cfg.question_column}' end "
            "in the assistant's reply: it is left out of the prompt (and is the answer where the "
            f"row has no '{self.cfg.answer_column}'), as TRL reads a whole chat",
            file=sys.stderr,
        )

    def _example(self, row: dict, i: int) -> Example:
        cfg, source = self.cfg, self.source
        prompt = _field(row, cfg.question_column, source, i, chat_as_text=False)
        messages, reply = None, None
        if is_chat(prompt):  # a conversation: rendered whole; its last user message the question
            prompt, reply = _without_reply(prompt)
            messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
            q = last_user_message(prompt)
            self.replies += reply is not None
            if self.streamed and reply is not None and self.replies == 1:
                self._say_replies("the")
        else:
            q = prompt
        try:
            raw = _field(row, cfg.answer_column, source, i)
        except ConfigError:
            if self.need_answer and reply is None:
                raise
            raw = reply  # the conversation's own last reply is its answer, as TRL reads it
        a = gold_answer(raw, cfg.answer_format)
        if q is None or not str(q).strip():
            raise ConfigError(f"dataset '{source}', row {i}: empty '{cfg.question_column}'")
        if a is None and self.need_answer:
            raise ConfigError(
                f"dataset '{source}', row {i}: no answer in '{cfg.answer_column}' "
                f"(answer_format={cfg.answer_format}): {str(raw)[:80]!r}"
            )
        given = q if isinstance(q, str) and messages is None and q != q.strip() else None
        return Example(str(q).strip(), a or "", dict(row), messages, given)


def _first_row_columns(rows) -> list[str]:
    """The columns of a stream whose features are not declared: its first row's."""
    row = next(iter(rows), None)
    return list(row) if isinstance(row, dict) else []


def _without_reply(messages: list) -> tuple[list, str | None]:
    """A conversation that ends in the assistant's reply (a whole chat, not a prompt): the
    turns before it, and the reply's content (TRL's prompt-only conversion); else as it is."""
    if len(messages) > 1 and messages[-1]["role"] == "assistant":
        return list(messages[:-1]), str(messages[-1]["content"])
    return list(messages), None


def ends_in_reply(row: dict, column: str) -> bool:
    """Whether a row's conversation ends in the assistant's reply (then dropped from its
    prompt)."""
    value = row.get(column.split(".")[0])
    return is_chat(value) and len(value) > 1 and value[-1]["role"] == "assistant"


def _field(row: dict, path: str, source: str, i: int, chat_as_text: bool = True) -> Any:
    try:
        return column_value(row, path, chat_as_text)
    except KeyError as e:
        raise ConfigError(f"dataset '{source}', row {i}: '{path}' has no field {e}") from None
