"""Bad data files are one ConfigError naming the file (and the line, and a fix), not a traceback:
training files (ibpo.data) and `ibpo eval --data` files (ibpo.evaluation.benchmarks)."""

import builtins
import json
import os

import pytest

from ibpo.config import ConfigError, DataConfig
from ibpo.data import load_splits
from ibpo.evaluation.benchmarks import BENCHMARKS, load_problems

ROW = {"question": "What is 1 + 1?", "answer": "2"}


def _lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _good_lines(n: int = 4) -> list[str]:
    return [json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(n)]


def _train_error(path, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_splits(DataConfig(dataset=str(path), eval_size=kw.pop("eval_size", 0), **kw))
    message = str(e.value)
    assert str(path) in message and "Fix:" in message and "\n" not in message, message
    return message


# --- training files --------------------------------------------------------------------------


def test_a_malformed_jsonl_line_is_named(tmp_path):
    lines = _good_lines()
    lines.insert(2, '{"question": "What is 2 + 2?", "answer": "4"')  # line 3: no closing brace
    message = _train_error(_lines(tmp_path / "train.jsonl", lines))
    assert "line 3" in message and "not valid JSON" in message


def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    message = _train_error(_lines(tmp_path / "train.jsonl", [*_good_lines(2), "[1, 2]"]))
    assert "line 3" in message and "not a JSON object" in message


def test_a_pretty_printed_json_error_names_its_line(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(
        '[\n  {"question": "q", "answer": "1"},\n  {"question": "r" "answer": "2"}\n]\n'
    )
    assert "line 3" in _train_error(path)


def test_an_empty_file_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("")
    assert "is empty" in _train_error(path)
    path.write_text("\n  \n")
    assert "is empty" in _train_error(path)


def test_an_empty_json_list_is_named(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[]")
    assert "no rows" in _train_error(path)


def test_rows_of_which_none_is_usable_are_named(tmp_path):
    rows = [json.dumps({"question": f"q{i}", "answer": None}) for i in range(3)]
    path = _lines(tmp_path / "train.jsonl", rows)
    message = _train_error(path, skip_unusable=True)
    assert "none of its 3 rows" in message and "row 0: no answer" in message


def test_a_directory_given_as_a_file_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.mkdir()
    assert "is a directory" in _train_error(path)


def test_a_file_without_read_permission_is_named(tmp_path, monkeypatch):
    path = tmp_path / "train.jsonl"
    _lines(path, _good_lines())
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anyway: refuse the way the OS would
        real_open = builtins.open

        def refusing_open(file, *args, **kwargs):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", refusing_open)
    try:
        assert "Permission denied" in _train_error(path)
    finally:
        path.chmod(0o644)


def test_a_utf16_file_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(_good_lines()) + "\n", encoding="utf-16")
    message = _train_error(path)
    assert "UTF-16" in message and "UTF-8" in message


def test_latin1_bytes_are_named_with_their_line(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = _good_lines(2) + [json.dumps({"question": "Café?", "answer": "1"}, ensure_ascii=False)]
    path.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    message = _train_error(path)
    assert "line 3" in message and "not UTF-8" in message


def test_a_parquet_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text("\n".join(_good_lines()))
    assert "not a Parquet file" in _train_error(path)


def test_a_json_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("question,answer\nWhat is 1 + 1?,2\n")
    assert "line 1" in _train_error(path)


def test_a_json_list_of_non_objects_is_named(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([ROW, 3, ROW]))
    assert "item 1" in _train_error(path)


def test_valid_layouts_still_load(tmp_path):
    """What loaded before still loads: JSON Lines (with a BOM, CRLF, blank lines, a line holding
    U+2028), a JSON list, pretty-printed objects one after another, JSON Lines named .json,
    and parquet."""
    import datasets

    rows = [{"question": f"What is {i} + 1?\u2028", "answer": str(i + 1)} for i in range(4)]
    jsonl = tmp_path / "a.jsonl"
    text = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n\r\n"
    jsonl.write_bytes(b"\xef\xbb\xbf" + text.encode())
    as_list = tmp_path / "b.json"
    as_list.write_text(json.dumps(rows, indent=2))
    pretty = tmp_path / "c.jsonl"
    pretty.write_text("\n".join(json.dumps(r, indent=2) for r in rows))
    lines_json = tmp_path / "d.json"
    lines_json.write_text("\n".join(json.dumps(r) for r in rows))
    parquet = tmp_path / "e.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    for path in (jsonl, as_list, pretty, lines_json, parquet):
        train, _ = load_splits(DataConfig(dataset=str(path), eval_size=0))
        assert [e.answer for e in train] == ["1", "2", "3", "4"], path


def test_the_train_cli_prints_one_error_line(tmp_path, capsys):
    from ibpo.cli import main

    bad = _lines(tmp_path / "bad.jsonl", [*_good_lines(4), "{oops"])
    args = ["train", f"data.dataset={bad}", "model.name=no/such-model", "data.eval_size=0"]
    assert main([*args, f"run.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ibpo: error:"), err
    assert "bad.jsonl" in err[0] and "line 5" in err[0]


# --- `ibpo eval --data` files ----------------------------------------------------------------


def _eval_error(path) -> str:
    with pytest.raises(ConfigError) as e:
        load_problems(BENCHMARKS["gsm8k"], data=str(path))
    message = str(e.value)
    assert str(path) in message and "Fix:" in message and "\n" not in message, message
    return message


def test_a_malformed_eval_jsonl_line_is_named(tmp_path):
    good = json.dumps({"question": "q", "answer": "so\n#### 2"})
    path = _lines(tmp_path / "gsm8k.jsonl", [good, good.replace("q", "r"), '{"question": '])
    assert "line 3" in _eval_error(path)


def test_bad_eval_files_are_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "is empty" in _eval_error(empty)
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    assert "is a directory" in _eval_error(folder)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(
        json.dumps({"question": "é", "answer": "#### 1"}, ensure_ascii=False).encode("latin-1")
    )
    assert "not UTF-8" in _eval_error(latin)
    fake = tmp_path / "fake.parquet"
    fake.write_text("{}")
    assert "not a Parquet file" in _eval_error(fake)
    scalars = tmp_path / "scalars.json"
    scalars.write_text("[1, 2]")
    assert "item 0" in _eval_error(scalars)


def test_the_eval_cli_prints_one_error_line(tmp_path, capsys):
    from ibpo.cli import main

    bad = _lines(tmp_path / "bad.jsonl", ['{"question": "q", "answer": "#### 1"}', "nope"])
    assert main(["eval", "gsm8k", "--data", bad, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eval: error:"), err
    assert "bad.jsonl" in err[0] and "line 2" in err[0]
