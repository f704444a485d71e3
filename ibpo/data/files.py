"""Local data files read with errors that name the file, the line and the fix, rather than a
traceback from deep inside `datasets` or pyarrow: JSON (JSON Lines, a JSON list of objects, or
objects one after another; UTF-8) and Parquet. Training data (splits.py) and `ibpo eval --data`
files (ibpo.evaluation.benchmarks) both read through here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ibpo.config import ConfigError

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
            f"{what} '{source}' could not be read as Parquet ({one_line(e)}). "
            "Fix: write the Parquet file again."
        ) from None
    if len(rows) == 0:
        raise ConfigError(f"{what} '{source}' has no rows. Fix: give it at least one row.")
    return rows


def one_line(e: BaseException) -> str:
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
