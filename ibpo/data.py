"""Problems with verifiable answers: built-in generators, local files and Hub datasets; prompts.

Sources (`data.dataset`):
* `builtin:<name>`: offline generators (see BUILTINS) with a fixed held-out split: a problem is
  held out when a stable hash of its text says so, whatever the seed, so train and eval never meet.
* a local `.json` / `.jsonl` / `.parquet` file (read with `datasets`, after a check here that
  makes a bad file one error naming the file, the line and the fix);
* anything else is a Hub dataset id for `datasets.load_dataset` (e.g. openai/gsm8k, subset main).

For a file or Hub source without the requested eval split, `eval_size` rows are carved out of the
training split (deterministically) and never trained on. A row without a question or answer is an
error that names the row. Prompts (`render_example`): a string prompt of your data is asked as
given (data.prompt_template null, as TRL: the text itself, after the tokenizer's own leading
special tokens); with a template (the built-in tasks resolve to theirs) the templated question is
the user message through the tokenizer's chat template (Qwen3 thinking on/off via
`enable_thinking`); a conversation goes through the chat template whole.

Columns as RL datasets store them: `question_column` / `answer_column` may be dotted paths into
struct columns (`reward_model.ground_truth`). A question column holding a chat (a list of
{"role", "content"} messages: TRL's conversational `prompt`, verl-format sets' prompt) is a
conversation: rendered whole through the chat template (system message and earlier turns
kept), its last user message the question repairs quote; a chat in the answer column gives
its last user message. With question_column left at "question", a dataset without that column
but with TRL's `prompt` reads `prompt`. Every column of a row travels with its example
(`Example.columns`) to the reward functions (rewards/functions.py); rows given in Python
(`load_splits(rows=...)`: a `datasets.Dataset` or a list of dicts) are read as a file's are.
`answer_format: code_tests` turns a test-case column of the PrimeIntellect / open-r1
verifiable-coding-problems kind ({"language", "test_cases": [{"input", "output", "type":
stdin_stdout | function_call, "fn_name"}]}) into the code reward's JSON test spec.

Not here: tokenisation for the model (generation/) and grading (rewards/).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ibpo.config import BUILTIN_PROMPT_TEMPLATE, ConfigError, DataConfig
from ibpo.rewards.code import livecodebench_spec
from ibpo.rewards.math import last_boxed

# data.dataset of a run whose rows were given in Python (ibpo.train(dataset=...))
IN_MEMORY = "in-memory"


@dataclass(frozen=True)
class Example:
    """One problem: its question (a chat's last user message), its gold answer (what the
    built-in graders compare against, "" when no built-in grader needs one), every column of
    its row (what reward functions receive) and, for a conversational prompt, the whole chat."""

    question: str
    answer: str
    columns: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    messages: tuple | None = field(default=None, compare=False, hash=False, repr=False)
    # a string prompt exactly as the dataset gives it (`question` is it stripped); None: same
    given: str | None = field(default=None, compare=False, hash=False, repr=False)


# --- built-in generators -------------------------------------------------------------------------

_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Eva", "Finn", "Gia", "Hugo", "Iris", "Jon"]
_THINGS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards"]


def _arithmetic() -> list[Example]:
    out = [Example(f"What is {a} + {b}?", str(a + b)) for a in range(21) for b in range(21)]
    out += [Example(f"What is {a} - {b}?", str(a - b)) for a in range(21) for b in range(a + 1)]
    out += [Example(f"What is {a} * {b}?", str(a * b)) for a in range(2, 13) for b in range(2, 13)]
    return out


def _word() -> list[Example]:
    out = []
    for name in _NAMES:
        for thing in _THINGS:
            for a in range(3, 15, 2):
                for b in range(2, 9, 3):
                    out.append(
                        Example(
                            f"{name} has {a} {thing} and gets {b} more. "
                            f"How many {thing} does {name} have now?",
                            str(a + b),
                        )
                    )
                    out.append(
                        Example(
                            f"{name} has {a + b} {thing} and gives away {b}. "
                            f"How many {thing} are left?",
                            str(a),
                        )
                    )
    return out


BUILTINS = {
    "arithmetic": _arithmetic,  # +, -, * on small numbers (1,246 problems)
    "word": _word,  # one-step word problems (960)
    "mixed": lambda: _arithmetic() + _word(),
}


def _held_out(question: str) -> bool:
    return hashlib.sha256(question.encode()).digest()[0] < 52  # ~20% of problems


def builtin_examples(name: str, split: str) -> list[Example]:
    if name not in BUILTINS:
        raise ConfigError(f"data.dataset=builtin:{name}; built-ins are: {', '.join(BUILTINS)}")
    eval_split = split in ("test", "eval", "validation")
    return [
        Example(ex.question, ex.answer, {"question": ex.question, "answer": ex.answer})
        for ex in BUILTINS[name]()
        if _held_out(ex.question) == eval_split
    ]


# --- files and Hub -------------------------------------------------------------------------------


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


def _is_file_source(source: str) -> bool:
    return Path(source).suffix in (".json", ".jsonl", ".parquet")


def _load_rows(source: str, split: str, subset: str | None):
    """A `datasets.Dataset`, or None when the split does not exist."""
    import datasets

    path = Path(source)
    if _is_file_source(source):
        if path.suffix == ".parquet":
            return read_parquet_file(path, source)
        read_json_records(path, source)  # a bad file: one ConfigError naming file, line and fix
        try:
            return datasets.load_dataset("json", data_files={"train": str(path)}, split="train")
        except Exception as e:  # rows JSON reads but Arrow cannot (a column of mixed types)
            raise ConfigError(
                f"data file '{source}' could not be loaded as a table ({_one_line(e)}). "
                "Fix: give each field one JSON type in every row."
            ) from None
    try:
        return datasets.load_dataset(source, subset, split=split)
    except ValueError as e:
        if "split" in str(e).lower():
            return None
        raise ConfigError(f"could not load dataset '{source}' ({subset=}, {split=}): {e}") from None
    except Exception as e:  # network, missing dataset, offline mode
        raise ConfigError(
            f"could not load dataset '{source}' ({subset=}, {split=}): {e}\n  Fix: check the id and"
            " network (HF_HUB_OFFLINE=1 allows only cached datasets), or use a local .jsonl file."
        ) from None


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


def rows_to_examples(rows, cfg: DataConfig, source: str, need_answer: bool = True) -> list[Example]:
    """Rows -> examples. `need_answer=False` (no built-in grader reads the gold answer): a row
    without one keeps an empty answer. A question_column left at "question" reads TRL's
    `prompt` column in a dataset that has no `question`."""
    cols = list(rows.column_names)
    if cfg.question_column == "question" and "question" not in cols and "prompt" in cols:
        cfg = dataclasses.replace(cfg, question_column="prompt")
    needed = (cfg.question_column, cfg.answer_column) if need_answer else (cfg.question_column,)
    for col in needed:
        if col not in cols and col.split(".")[0] not in cols:
            raise ConfigError(
                f"dataset '{source}' has no column '{col.split('.')[0]}'; its columns are: "
                f"{', '.join(cols)}. Set data.question_column / data.answer_column (a dotted "
                "path reads a field of a struct column)."
            )
    out, skipped = [], []
    for i, row in enumerate(rows):
        try:
            out.append(_example(row, cfg, source, i, need_answer))
        except ConfigError as e:
            if not cfg.skip_unusable:
                raise ConfigError(
                    f"{e}\n  (data.skip_unusable=true leaves such rows out)"
                ) from None
            skipped.append(str(e))
    if skipped and not out:
        first = skipped[0].removeprefix(f"dataset '{source}', ")
        raise ConfigError(
            f"dataset '{source}': none of its {len(skipped)} rows is usable; the first: {first}. "
            "Fix: check data.question_column, data.answer_column and data.answer_format "
            "against the file's rows."
        )
    if skipped:
        print(
            f"ibpo: {source}: left out {len(skipped)} of {len(skipped) + len(out)} rows "
            f"(data.skip_unusable); the first: {skipped[0]}",
            file=sys.stderr,
        )
    return out


def _example(row: dict, cfg: DataConfig, source: str, i: int, need_answer: bool) -> Example:
    prompt = _field(row, cfg.question_column, source, i, chat_as_text=False)
    messages = None
    if is_chat(prompt):  # a conversation: rendered whole; its last user message is the question
        messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
        q = last_user_message(prompt)
    else:
        q = prompt
    try:
        raw = _field(row, cfg.answer_column, source, i)
    except ConfigError:
        if need_answer:
            raise
        raw = None
    a = gold_answer(raw, cfg.answer_format)
    if q is None or not str(q).strip():
        raise ConfigError(f"dataset '{source}', row {i}: empty '{cfg.question_column}'")
    if a is None and need_answer:
        raise ConfigError(
            f"dataset '{source}', row {i}: no answer in '{cfg.answer_column}' "
            f"(answer_format={cfg.answer_format}): {str(raw)[:80]!r}"
        )
    given = q if isinstance(q, str) and messages is None and q != q.strip() else None
    return Example(str(q).strip(), a or "", dict(row), messages, given)


def _field(row: dict, path: str, source: str, i: int, chat_as_text: bool = True) -> Any:
    try:
        return column_value(row, path, chat_as_text)
    except KeyError as e:
        raise ConfigError(f"dataset '{source}', row {i}: '{path}' has no field {e}") from None


def eval_layout(cfg: DataConfig) -> DataConfig:
    """The data settings that read the held-out rows: data.eval's columns and answer format
    (resolved: training's where the recipe gives none)."""
    ev = cfg.eval
    return dataclasses.replace(
        cfg,
        question_column=ev["question_column"],
        answer_column=ev["answer_column"],
        answer_format=ev["answer_format"],
    )


def load_splits(
    cfg: DataConfig, seed: int = 0, rows=None, need_answer: bool = True, eval_rows=None
) -> tuple[list[Example], list[Example]]:
    """(train examples, held-out eval examples, at most cfg.eval_size of them). `rows`: the
    training rows given in Python (a `datasets.Dataset` or a list of dicts), read as a local
    file's are (the held-out rows carved out of them unless data.eval.dataset names a source);
    `eval_rows`: held-out rows given in Python, read with data.eval's layout (data.eval.dataset
    is then `in-memory`), nothing carved out of training. `need_answer`: whether a built-in
    grader reads the gold answers (rows_to_examples)."""
    if rows is None and cfg.dataset == IN_MEMORY:
        raise ConfigError(
            "this run's rows were given in Python (data.dataset=in-memory). Fix: pass them "
            "again, ibpo.train(..., dataset=rows), or set data.dataset to a file or Hub id"
        )
    if eval_rows is None and cfg.eval["dataset"] == IN_MEMORY:
        raise ConfigError(
            "this run's held-out rows were given in Python (data.eval.dataset=in-memory). Fix: "
            "pass them again, ibpo.train(..., eval_dataset=rows), or set data.eval.dataset"
        )
    if eval_rows is not None:
        if rows is not None:
            train = rows_to_examples(_row_table(rows, "dataset"), cfg, IN_MEMORY, need_answer)
        elif cfg.dataset.startswith("builtin:"):
            train = builtin_examples(cfg.dataset.split(":", 1)[1], "train")
        else:
            train = rows_to_examples(_source_rows(cfg), cfg, cfg.dataset, need_answer)
        table = _row_table(eval_rows, "eval_dataset")
        held = rows_to_examples(table, eval_layout(cfg), f"{IN_MEMORY} eval", need_answer)
        return _without_held_out(train, held[: cfg.eval_size])
    if rows is not None:
        return _in_memory_splits(rows, cfg, need_answer)
    if cfg.dataset.startswith("builtin:"):
        name = cfg.dataset.split(":", 1)[1]
        train = builtin_examples(name, "train")
        held = builtin_examples(name, "test")
        random.Random(1234).shuffle(held)  # fixed, seed-independent eval set
        return train, held[: cfg.eval_size]
    train = rows_to_examples(_source_rows(cfg), cfg, cfg.dataset, need_answer)
    return _held_out_split(train, cfg, need_answer)


def _source_rows(cfg: DataConfig):
    """data.dataset's training split (a file or a Hub dataset)."""
    rows = _load_rows(cfg.dataset, cfg.split, cfg.subset)
    if rows is None:
        raise ConfigError(
            f"dataset '{cfg.dataset}' has no split '{cfg.split}'. "
            "Fix: set data.split to one it has (often 'train')."
        )
    return rows


def _row_table(rows, what: str):
    """Rows given in Python (`what`: the argument's name) as rows_to_examples reads them."""
    if isinstance(rows, list):
        rows = RowList(rows)
    elif not hasattr(rows, "column_names"):
        raise ConfigError(
            f"{what} is a {type(rows).__name__}. Fix: pass a datasets.Dataset or a list of dicts"
        )
    if len(rows) == 0:
        raise ConfigError(f"the {what} given in Python has no rows")
    return rows


def _in_memory_splits(rows, cfg: DataConfig, need_answer: bool):
    train = rows_to_examples(_row_table(rows, "dataset"), cfg, IN_MEMORY, need_answer)
    return _held_out_split(train, cfg, need_answer, in_memory=True)


def _held_out_split(train: list[Example], cfg: DataConfig, need_answer: bool, in_memory=False):
    """The held-out rows of a file, Hub or in-memory source: data.eval's split of its dataset
    (null: the training source), else eval_size rows carved out of training."""
    ev = cfg.eval
    named = ev["dataset"]  # None: the training source, which is carved where it has no split
    eval_source = named or cfg.dataset
    eval_rows = None
    own_split = not (in_memory or _is_file_source(cfg.dataset))
    if cfg.eval_size and (named or own_split):
        eval_rows = _load_rows(eval_source, ev["split"], ev["subset"])
        if eval_rows is None and named:  # never carve a named eval set out of training
            raise ConfigError(
                f"data.eval.dataset '{named}' has no split '{ev['split']}'. "
                "Fix: set data.eval.split to one it has."
            )
    if eval_rows is not None:
        held = rows_to_examples(eval_rows, eval_layout(cfg), eval_source, need_answer)
        return _without_held_out(train, held[: cfg.eval_size])
    if cfg.eval_size >= len(train):
        raise ConfigError(
            f"data.eval_size={cfg.eval_size} leaves nothing to train on ({len(train)} rows). "
            "Fix: lower data.eval_size"
        )
    order = list(range(len(train)))
    random.Random(1234).shuffle(order)
    held_idx = set(order[: cfg.eval_size])
    held = [train[i] for i in order[: cfg.eval_size]]
    return _without_held_out([ex for i, ex in enumerate(train) if i not in held_idx], held)


def _without_held_out(train: list[Example], held: list[Example]):
    """Training examples whose question is also a held-out one are dropped (datasets repeat
    problems, and a carve by row would leave copies of held-out ones in training)."""
    seen = {" ".join(ex.question.split()) for ex in held}
    kept = [ex for ex in train if " ".join(ex.question.split()) not in seen]
    if len(kept) < len(train):
        print(
            f"ibpo: dropped {len(train) - len(kept)} training rows that repeat a held-out question",
            file=sys.stderr,
        )
    if not kept:
        raise ConfigError(
            "every training row repeats a held-out question: lower data.eval_size "
            "or use another data.eval.dataset"
        )
    return kept, held


# --- reading local files (shared with ibpo.evaluation.benchmarks) ----------------------------

_JSON_KINDS = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), "number")


def _open_checked(path: Path, source: str, what: str):
    """The file opened for binary reading; ConfigError when it is missing, a folder or not
    readable."""
    if path.is_dir():
        raise ConfigError(
            f"{what} '{source}' is a directory, not a file. "
            "Fix: name a .jsonl, .json or .parquet file inside it."
        )
    if not path.exists():
        raise ConfigError(f"{what} '{source}' not found. Fix: check the path.")
    try:
        return open(path, "rb")
    except OSError as e:
        raise ConfigError(
            f"{what} '{source}' cannot be read ({e.strerror or e}). "
            "Fix: make it readable (chmod u+r) or copy it somewhere readable."
        ) from None


def check_parquet_file(path: Path, source: str, what: str = "data file") -> None:
    """ConfigError naming the file unless it is a readable, non-empty file with Parquet's
    PAR1 magic at both ends."""
    with _open_checked(path, source, what) as f:
        head = f.read(4)
        size = f.seek(0, 2)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if size == 0:
        raise ConfigError(f"{what} '{source}' is empty. Fix: write the Parquet file again.")
    if size < 12 or head != b"PAR1" or tail != b"PAR1":
        raise ConfigError(
            f"{what} '{source}' is not a Parquet file (no PAR1 magic bytes). Fix: write it with "
            "pandas/pyarrow/datasets .to_parquet, or give it the suffix of what it holds "
            "(.jsonl: one JSON object per line, .json: a JSON list of objects)."
        )


def read_parquet_file(path: Path, source: str, what: str = "data file"):
    """A checked .parquet file as a `datasets.Dataset` with at least one row."""
    import datasets

    check_parquet_file(path, source, what)
    try:
        rows = datasets.load_dataset("parquet", data_files={"train": str(path)}, split="train")
    except Exception as e:  # a damaged file: pyarrow's own words, on one line
        raise ConfigError(
            f"{what} '{source}' could not be read as Parquet ({_one_line(e)}). "
            "Fix: write the Parquet file again."
        ) from None
    if len(rows) == 0:
        raise ConfigError(f"{what} '{source}' has no rows. Fix: give it at least one row.")
    return rows


def _one_line(e: BaseException) -> str:
    """An exception (or the one it wraps: datasets' DatasetGenerationError) on one line."""
    inner = e.__cause__ or e.__context__ or e
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def read_json_records(path: Path, source: str, what: str = "data file") -> list[dict]:
    """The rows of a local JSON file, read here so that a bad file is one ConfigError naming the
    file, the line and the fix. Layouts (those `datasets`' json loader reads): JSON Lines (one
    object per line), a JSON list of objects, or JSON objects one after another (pretty-printed
    across lines, or a single object). UTF-8, with or without a byte-order mark."""
    with _open_checked(path, source, what) as f:
        text = _utf8_text(f.read(), source, what)
    if not text.strip():
        raise ConfigError(
            f"{what} '{source}' is empty. Fix: give it rows, one JSON object per line "
            '({"question": ..., "answer": ...}).'
        )
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{what} '{source}', line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})."
                " Fix: repair it there; the file must be a JSON list of objects (or JSON Lines)."
            ) from None
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise ConfigError(
                    f"{what} '{source}': item {i} of its JSON list is not an object (a "
                    f"{_kind(record)}). Fix: make each item one row object "
                    '({"question": ..., "answer": ...}).'
                )
        return _some_rows(records, source, what)
    records, bad = _json_lines(text)
    if bad is not None:  # not JSON Lines; maybe objects spread over several lines each
        records, bad_seq = _json_values(text)
        if bad_seq is not None:
            line, e = bad if bad[0] > _first_line(text) else (bad_seq.lineno, bad_seq)
            layout = (
                "a .json file holds a JSON list of row objects or one object per line"
                if path.suffix == ".json"
                else "each line of a JSON Lines file holds one complete JSON object"
            )
            raise ConfigError(
                f"{what} '{source}', line {line}: not valid JSON ({e.msg}, column {e.colno}). "
                f"Fix: repair or delete line {line}; {layout}."
            )
    for line, record in records:
        if not isinstance(record, dict):
            raise ConfigError(
                f"{what} '{source}', line {line}: not a JSON object (a {_kind(record)}). "
                'Fix: make each line one row object ({"question": ..., "answer": ...}).'
            )
    return _some_rows([record for _, record in records], source, what)


def _some_rows(records: list, source: str, what: str) -> list:
    if not records:
        raise ConfigError(f"{what} '{source}' has no rows. Fix: give it at least one row object.")
    return records


def _utf8_text(data: bytes, source: str, what: str) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in data[:4096]:
        raise ConfigError(
            f"{what} '{source}' is UTF-16 (or UTF-32) text, not UTF-8. Fix: save it as UTF-8, "
            "e.g. iconv -f UTF-16 -t UTF-8 IN > OUT."
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"{what} '{source}', line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at "
            f"offset {e.start}). Fix: save the file as UTF-8, e.g. iconv -f latin1 -t UTF-8 "
            "IN > OUT (with the file's real encoding)."
        ) from None


def _first_line(text: str) -> int:
    return next(i for i, line in enumerate(text.split("\n"), 1) if line.strip())


def _json_lines(text: str):
    """([(line number, value)], None), or (parsed so far, (first bad line, JSONDecodeError)).
    Lines end at \\n only: U+2028 and friends may stand unescaped inside JSON strings."""
    records = []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                return records, (n, e)
    return records, None


def _json_values(text: str):
    """JSON values one after another, separated by whitespace: ([(line, value)], None), or
    (parsed so far, JSONDecodeError)."""
    decoder, records, pos, line, counted = json.JSONDecoder(), [], 0, 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos == len(text):
            return records, None
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return records, e
        line, counted = line + text.count("\n", counted, pos), pos
        records.append((line, value))
        pos = end


# --- prompts and the training stream ---------------------------------------------------------


def drop_long_prompts(examples: list[Example], tokenizer, cfg: DataConfig, what: str):
    """Keep the examples whose rendered prompt has at most data.max_prompt_tokens tokens.

    Memory (and `ibpo plan`) assume that bound; cutting a problem statement would change the
    problem, so a longer prompt is left out, and the count is reported. -> (kept, dropped)."""
    if not examples:
        return examples, 0
    texts = [render_example(tokenizer, e, cfg) for e in examples]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    kept = [e for e, n in zip(examples, lengths) if n <= cfg.max_prompt_tokens]
    if not kept:
        raise ConfigError(
            f"every {what} prompt is longer than data.max_prompt_tokens={cfg.max_prompt_tokens} "
            f"(shortest: {min(lengths)} tokens). Fix: raise data.max_prompt_tokens."
        )
    return kept, len(examples) - len(kept)


def prompt_template(cfg: DataConfig) -> str | None:
    """The template a string prompt is asked with: data.prompt_template; where it is None, the
    built-in tasks' (a DataConfig not passed through config.resolve), else None: the prompt
    as given."""
    if cfg.prompt_template is not None:
        return cfg.prompt_template
    return BUILTIN_PROMPT_TEMPLATE if cfg.dataset.startswith("builtin:") else None


def as_given(cfg: DataConfig) -> bool:
    """A string prompt is the model's text itself (TRL's standard format): no template and no
    system prompt, which only a chat can hold."""
    return prompt_template(cfg) is None and not cfg.system_prompt


def render_prompt(tokenizer, question: str, cfg: DataConfig) -> str:
    """The text the model continues for a string prompt: the prompt as given, after the special
    tokens the tokenizer puts in front of a text (a BOS), as TRL tokenizes it (`as_given`);
    else the chat template applied to the templated question."""
    if as_given(cfg):
        return special_prefix(tokenizer) + question
    return render_user_message(tokenizer, user_message(question, cfg), cfg)


def special_prefix(tokenizer) -> str:
    """The text of the special tokens `tokenizer` adds in front of a text (a Llama tokenizer's
    BOS; "" for most), which rollouts, tokenizing rendered prompts without them, need written."""
    cached = getattr(tokenizer, "_ibpo_special_prefix", None)
    if cached is not None:
        return cached
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    starts = [k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain]
    prefix = tokenizer.decode(full[: starts[0]]) if starts and starts[0] > 0 else ""
    try:
        tokenizer._ibpo_special_prefix = prefix
    except AttributeError:  # a tokenizer that takes no new attributes: computed each time
        pass
    return prefix


def describe_prompts(tokenizer, cfg: DataConfig) -> str:
    """The line a run prints saying how it asks its problems."""
    template = prompt_template(cfg)
    if getattr(tokenizer, "chat_template", None):
        chat = "a conversation through the model's chat template"
    else:
        chat = "a conversation's messages one after another (the model has no chat template)"
    if as_given(cfg):
        return (
            "ibpo: prompts as the dataset gives them (data.prompt_template=null, as TRL does): a "
            f"string prompt as its text, {chat}. data.prompt_template='{{question}}' asks a "
            "string prompt as a chat message instead"
        )
    builtin = cfg.dataset.startswith("builtin:") and template == BUILTIN_PROMPT_TEMPLATE
    system = " after data.system_prompt" if cfg.system_prompt else ""
    return (
        f"ibpo: prompts: data.prompt_template {template!r}"
        f"{' (the built-in tasks)' if builtin else ''} as the user message{system}; {chat}"
    )


def thinking_note(tokenizer, cfg: DataConfig, max_new_tokens: int) -> str | None:
    """A note when the chat template thinks unless told not to (Qwen3's) and the recipe does not
    say: long thoughts are then cut off at max_new_tokens and score nothing."""
    template = getattr(tokenizer, "chat_template", None)
    if cfg.enable_thinking is not None or "enable_thinking" not in str(template or ""):
        return None
    return (
        "ibpo: note: this chat template thinks by default (data.enable_thinking is unset); "
        f"thoughts longer than rollout.max_new_tokens={max_new_tokens} are cut off and score 0. "
        "Set data.enable_thinking=false (or true to say so)."
    )


def user_message(question: str, cfg: DataConfig) -> str:
    """The question in data.prompt_template (the question itself without one)."""
    template = prompt_template(cfg)
    # not str.format: templates hold literal braces ("put your answer within \\boxed{}")
    return question if template is None else template.replace("{question}", question)


def render_user_message(tokenizer, user: str, cfg: DataConfig) -> str:
    """Chat template (system prompt, thinking switch) around one user message."""
    if not getattr(tokenizer, "chat_template", None):
        return user
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": user})
    return render_messages(tokenizer, messages, cfg)


def prompt_messages(ex: Example, cfg: DataConfig) -> list[dict]:
    """The chat a problem is asked as: a conversational prompt whole (data.system_prompt in
    front when it has no system message of its own; data.prompt_template is not applied, the
    chat is the prompt), else data.system_prompt and the templated question."""
    if ex.messages is not None:
        messages = [dict(m) for m in ex.messages]
        if cfg.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        return messages
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": user_message(ex.question, cfg)})
    return messages


def render_messages(tokenizer, messages: list[dict], cfg: DataConfig) -> str:
    """A chat through the chat template (thinking switch, generation prompt); without a
    template, its messages' contents one after another."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n".join(str(m["content"]) for m in messages)
    extra = {} if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **extra
    )


def render_example(tokenizer, ex: Example, cfg: DataConfig) -> str:
    """The text the model continues for a problem: its whole chat, or render_prompt (of the
    prompt exactly as the dataset gives it, when it is asked as given)."""
    if ex.messages is None:
        text = ex.given if ex.given is not None and as_given(cfg) else ex.question
        return render_prompt(tokenizer, text, cfg)
    return render_messages(tokenizer, prompt_messages(ex, cfg), cfg)


class PromptStream:
    """Endless, seeded, epoch-shuffled stream of examples; each process reads its own shard."""

    def __init__(self, examples: list[Example], seed: int, shuffle: bool, rank=0, world=1):
        if not examples:
            raise ConfigError("the training set is empty")
        self.examples = examples[rank::world] or examples
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        """Where the stream stands (epoch, position, this epoch's order), for checkpoints."""
        return {"epoch": self.epoch, "position": self.position, "order": list(self._order)}

    def load_state_dict(self, state: dict) -> None:
        order = [int(i) for i in state["order"]]
        if sorted(order) != list(range(len(self.examples))):
            raise ConfigError(
                f"the checkpoint's data stream covers {len(order)} examples but this training "
                f"set (shard) has {len(self.examples)}: resume with the same data settings"
            )
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), order
