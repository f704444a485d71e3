"""data.dataset read into training and held-out examples (`load_splits`).

Sources (`data.dataset`):
* `builtin:<name>`: the built-in tasks (tasks.py), with their own fixed held-out split;
* a local `.json` / `.jsonl` / `.parquet` file (read with `datasets`, after a check that makes a
  bad file one error naming the file, the line and the fix: files.py);
* anything else is a Hub dataset id for `datasets.load_dataset` (e.g. openai/gsm8k, subset main);
* rows given in Python (`load_splits(rows=...)`: a `datasets.Dataset` or a list of dicts), read as
  a file's are (data.dataset is then `in-memory`); a stream (a `datasets.IterableDataset`) is
  read as it is drawn (stream.RowStream), its held-out rows from eval_rows, data.eval.dataset
  or its first rows.

For a file or Hub source without the requested eval split, `eval_size` rows are carved out of the
training split (deterministically) and never trained on; data.eval names another source or
layout for the held-out rows. A training row that repeats a held-out question is dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from pathlib import Path

from ibpo.config import ConfigError, DataConfig
from ibpo.data.example import Example
from ibpo.data.files import one_line, read_json_records, read_parquet_file
from ibpo.data.rows import RowList, RowReader, rows_to_examples
from ibpo.data.stream import StreamedRows, norm
from ibpo.data.tasks import builtin_examples

# data.dataset of a run whose rows were given in Python (ibpo.train(dataset=...))
IN_MEMORY = "in-memory"


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
                f"data file '{source}' could not be loaded as a table ({one_line(e)}). "
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
) -> tuple[list[Example] | StreamedRows, list[Example]]:
    """(train examples, held-out eval examples, at most cfg.eval_size of them); for rows given
    as a stream, StreamedRows in place of the training examples. `rows`: the training rows
    given in Python (a `datasets.Dataset`, a list of dicts, or a stream: a
    `datasets.IterableDataset`), read as a local file's are (the held-out rows carved out of
    them unless data.eval.dataset names a source); `eval_rows`: held-out rows given in Python,
    read with data.eval's layout (data.eval.dataset is then `in-memory`), nothing carved out
    of training. `need_answer`: whether a built-in
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
    if rows is not None and is_stream(rows):
        return _stream_splits(rows, cfg, need_answer, eval_rows)
    if eval_rows is not None:
        if rows is not None:
            train = rows_to_examples(_row_table(rows, "dataset"), cfg, IN_MEMORY, need_answer)
        elif cfg.dataset.startswith("builtin:"):
            train = builtin_examples(cfg.dataset.split(":", 1)[1], "train")
        else:
            train = rows_to_examples(_source_rows(cfg), cfg, cfg.dataset, need_answer)
        table = _row_table(eval_rows, "eval_dataset", cfg.eval_size)
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


def is_stream(rows) -> bool:
    """Rows given in Python without a length: a datasets.IterableDataset (or any iterable)."""
    return (
        hasattr(rows, "__iter__")
        and not hasattr(rows, "__len__")
        and not isinstance(rows, (str, bytes, dict))
    )


def _row_table(rows, what: str, limit: int | None = None):
    """Rows given in Python (`what`: the argument's name) as rows_to_examples reads them; of a
    stream, its first `limit` rows."""
    if is_stream(rows) and limit is not None:
        rows = list(itertools.islice(rows, limit))
    if isinstance(rows, list):
        rows = RowList(rows)
    elif not hasattr(rows, "column_names"):
        raise ConfigError(
            f"{what} is a {type(rows).__name__}. Fix: pass a datasets.Dataset or a list of dicts"
        )
    if len(rows) == 0:
        raise ConfigError(f"the {what} given in Python has no rows")
    return rows


def _stream_splits(rows, cfg: DataConfig, need_answer: bool, eval_rows):
    """Training rows streamed (read as drawn: stream.RowStream) and the held-out examples: from
    eval_dataset=, else data.eval.dataset's, else the stream's first rows (data.eval_size usable
    ones, held out of every pass)."""
    if iter(rows) is rows:
        raise ConfigError(
            f"dataset= is a {type(rows).__name__}, which can be read once; a run reads its stream "
            "pass after pass. Fix: pass datasets.IterableDataset.from_generator(fn) (or "
            "Dataset.to_iterable_dataset())"
        )
    reader = RowReader(rows, cfg, IN_MEMORY, need_answer, streamed=True)
    skip, held = 0, []
    if eval_rows is not None:
        table = _row_table(eval_rows, "eval_dataset", cfg.eval_size)
        held = rows_to_examples(table, eval_layout(cfg), f"{IN_MEMORY} eval", need_answer)
    elif cfg.eval["dataset"] is not None and cfg.eval_size:
        ev = cfg.eval
        table = _load_rows(ev["dataset"], ev["split"], ev["subset"])
        if table is None:
            raise ConfigError(
                f"data.eval.dataset '{ev['dataset']}' has no split '{ev['split']}'. "
                "Fix: set data.eval.split to one it has."
            )
        held = rows_to_examples(table, eval_layout(cfg), ev["dataset"], need_answer)
    elif cfg.eval_size:
        for skip, row in enumerate(rows, 1):
            ex = reader.example(row, skip - 1)
            held += [ex] if ex is not None else []
            if len(held) == cfg.eval_size:
                break
        else:
            raise ConfigError(
                f"data.eval_size={cfg.eval_size} leaves nothing to train on (the stream has "
                f"{skip} rows). Fix: lower data.eval_size, or pass eval_dataset="
            )
    held = held[: cfg.eval_size]
    return StreamedRows(rows, reader, skip, {norm(ex.question) for ex in held}), held


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
