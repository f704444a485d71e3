import json

import pytest

from ibpo.config import ConfigError, DataConfig
from ibpo.data import PromptStream, builtin_examples, load_splits, render_prompt
from tests.conftest import make_tokenizer


def test_builtin_split_is_fixed_and_disjoint():
    for name in ("arithmetic", "word"):
        train = builtin_examples(name, "train")
        test = builtin_examples(name, "test")
        assert len(test) >= 150
        assert not {e.question for e in train} & {e.question for e in test}
    a = load_splits(DataConfig(eval_size=120), seed=0)[1]
    b = load_splits(DataConfig(eval_size=120), seed=7)[1]
    assert a == b and len(a) == 120


def test_local_jsonl_with_column_mapping_and_gsm8k_answers(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"q": f"What is {i} + 1?", "sol": f"{i} + 1 = {i + 1}\n#### {i + 1:,}"}
        for i in range(998, 1010)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(dataset=str(path), question_column="q", answer_column="sol",
                     answer_format="gsm8k", eval_size=4)  # fmt: skip
    train, held = load_splits(cfg)
    assert len(train) == 8 and len(held) == 4
    assert not {e.question for e in train} & {e.question for e in held}
    assert {e.answer for e in train + held} == {str(i + 1) for i in range(998, 1010)}


def test_bad_rows_and_columns_are_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"question": "2+2?", "answer": None}) + "\n")  # fmt: skip
    with pytest.raises(ConfigError, match="row 1: no answer"):
        load_splits(DataConfig(dataset=str(path), eval_size=0))
    with pytest.raises(ConfigError, match="no column 'problem'.*question, answer"):
        load_splits(DataConfig(dataset=str(path), question_column="problem", eval_size=0))
    with pytest.raises(ConfigError, match="not found"):
        load_splits(DataConfig(dataset=str(tmp_path / "missing.jsonl")))


def test_boxed_answer_format(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}."}] * 3))
    cfg = DataConfig(dataset=str(path), question_column="problem", answer_column="solution",
                     answer_format="boxed", eval_size=1)  # fmt: skip
    train, _ = load_splits(cfg)
    assert train[0].answer == "\\frac{1}{2}"


def test_render_prompt_uses_chat_template():
    tok = make_tokenizer()
    text = render_prompt(tok, "What is 2 + 2?", DataConfig(system_prompt="be brief"))
    assert (
        text == "<system>be brief\n<user>What is 2 + 2?\nAnswer with just the number.\n<assistant>"
    )


def test_prompt_stream_is_seeded_and_sharded():
    exs = builtin_examples("arithmetic", "train")[:10]
    a = PromptStream(exs, seed=3, shuffle=True).take(25)
    b = PromptStream(exs, seed=3, shuffle=True).take(25)
    assert a == b and set(a[:10]) == set(exs)  # each epoch visits every example once
    r0 = PromptStream(exs, 0, False, rank=0, world=2).take(5)
    r1 = PromptStream(exs, 0, False, rank=1, world=2).take(5)
    assert not set(r0) & set(r1)
