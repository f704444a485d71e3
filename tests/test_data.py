import json

import pytest

from ibpo.config import ConfigError, DataConfig
from ibpo.data import (
    Example,
    PromptStream,
    builtin_examples,
    load_splits,
    render_prompt,
    user_message,
)
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
    cfg = DataConfig(
        dataset=str(path),
        question_column="q",
        answer_column="sol",
        answer_format="gsm8k",
        eval_size=4,
    )
    train, held = load_splits(cfg)
    assert len(train) == 8 and len(held) == 4
    assert not {e.question for e in train} & {e.question for e in held}
    assert {e.answer for e in train + held} == {str(i + 1) for i in range(998, 1010)}


def test_bad_rows_and_columns_are_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"question": "1+1?", "answer": "2"})
        + "\n"
        + json.dumps({"question": "2+2?", "answer": None})
        + "\n"
    )
    with pytest.raises(ConfigError, match="row 1: no answer"):
        load_splits(DataConfig(dataset=str(path), eval_size=0))
    with pytest.raises(ConfigError, match="no column 'problem'.*question, answer"):
        load_splits(DataConfig(dataset=str(path), question_column="problem", eval_size=0))
    with pytest.raises(ConfigError, match="not found"):
        load_splits(DataConfig(dataset=str(tmp_path / "missing.jsonl")))


def test_boxed_answer_format(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps(
            [{"problem": f"p{i}", "solution": "so \\boxed{\\frac{1}{2}}."} for i in range(3)]
        )
    )
    cfg = DataConfig(
        dataset=str(path),
        question_column="problem",
        answer_column="solution",
        answer_format="boxed",
        eval_size=1,
    )
    train, _ = load_splits(cfg)
    assert train[0].answer == "\\frac{1}{2}"


def test_prompt_templates_may_hold_literal_braces():
    cfg = DataConfig(prompt_template="{question}\nPut the answer within \\boxed{}. {x}")
    assert user_message("What is {1}?", cfg) == "What is {1}?\nPut the answer within \\boxed{}. {x}"


def test_training_rows_repeating_a_held_out_question_are_dropped(tmp_path, capsys):
    rows = [{"question": f"q{i % 10}", "answer": str(i % 10)} for i in range(50)]  # 5 copies each
    train, held = load_splits(DataConfig(dataset=_jsonl(tmp_path / "d.jsonl", rows), eval_size=3))
    assert len(held) == 3 and not {e.question for e in train} & {e.question for e in held}
    assert len(train) == 50 - 3 * 5 and "dropped 12 training rows" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="every training row repeats"):
        load_splits(DataConfig(dataset=_jsonl(tmp_path / "e.jsonl", rows[:1] * 4), eval_size=1))


def test_unusable_rows_are_an_error_unless_skipped_and_counted(tmp_path, capsys):
    rows = [
        {"question": "1+1?", "answer": "2"},
        {"question": "2+2?", "answer": None},
        {"question": " ", "answer": "3"},
        {"question": "3+3?", "answer": "6"},
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match="row 1: no answer(.|\n)*data.skip_unusable=true"):
        load_splits(DataConfig(dataset=path, eval_size=0))
    train, _ = load_splits(DataConfig(dataset=path, eval_size=0, skip_unusable=True))
    assert [e.question for e in train] == ["1+1?", "3+3?"]
    assert "left out 2 of 4 rows" in capsys.readouterr().err


def test_a_missing_training_split_is_named(tmp_path, monkeypatch):
    import ibpo.data.splits as splits

    monkeypatch.setattr(splits, "_load_rows", lambda src, split, subset: None)
    with pytest.raises(ConfigError, match="has no split 'trian'.*data.split"):
        load_splits(DataConfig(dataset="org/set", split="trian", eval_size=0))


def test_a_template_that_thinks_by_default_gets_a_note_unless_the_recipe_says():
    from ibpo.data import thinking_note

    tok = make_tokenizer()
    assert thinking_note(tok, DataConfig(), 24) is None  # a template without the switch
    tok.chat_template = "{% if enable_thinking is defined %}{% endif %}" + tok.chat_template
    assert "max_new_tokens=24" in thinking_note(tok, DataConfig(), 24)
    assert thinking_note(tok, DataConfig(enable_thinking=False), 24) is None


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


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)


def test_dotted_answer_path_and_chat_question(tmp_path):
    """BytedTsinghua-SIA/DAPO-Math-17k's schema (verl format): the prompt is a chat, the answer
    a field of the reward_model struct."""
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_INSTRUCTION + f"What is {i} squared?", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(i * i), "style": "rule-lean"},
            "extra_info": {"index": f"id-{i}"},
        }
        for i in range(2, 8)
    ]
    path = _jsonl(tmp_path / "dapo.jsonl", rows)
    cfg = DataConfig(
        dataset=path,
        question_column="prompt",
        prompt_template="{question}",
        answer_column="reward_model.ground_truth",
        eval_size=2,
    )
    train, held = load_splits(cfg)
    got = {e.question: e.answer for e in train + held}
    assert got == {
        DAPO_INSTRUCTION.strip() + f"\n\nWhat is {i} squared?": str(i * i) for i in range(2, 8)
    }
    with pytest.raises(ConfigError, match="row 0: 'reward_model.answer' has no field 'answer'"):
        load_splits(
            DataConfig(
                dataset=path,
                question_column="prompt",
                eval_size=0,
                answer_column="reward_model.answer",
            )
        )
    with pytest.raises(ConfigError, match="no column 'reward'"):
        load_splits(
            DataConfig(
                dataset=path,
                question_column="prompt",
                eval_size=0,
                answer_column="reward.ground_truth",
            )
        )


def _code_row(problem: str, cases: list[dict]) -> dict:
    """A row of open-r1/verifiable-coding-problems-python(-10k), PrimeIntellect's format."""
    return {
        "problem": problem,
        "gold_standard_solution": "```python\n...\n```",
        "source": "codeforces",
        "in_source_id": "1000A",
        "verification_info": {"language": "python", "test_cases": cases},
    }


def test_code_tests_answers_grade_end_to_end(tmp_path):
    from ibpo.rewards import GRADERS

    stdin = [
        {"fn_name": None, "input": f"{a} {b}\n", "output": f"{a + b}\n", "type": "stdin_stdout"}
        for a, b in [(1, 2), (40, 2)]
    ]
    call = [
        {
            "fn_name": "add",
            "input": json.dumps([a, b]),
            "output": json.dumps(a + b),
            "type": "function_call",
        }
        for a, b in [(1, 2), (-5, 5)]
    ]
    path = _jsonl(
        tmp_path / "code.jsonl",
        [_code_row("Read a and b; print a + b.", stdin), _code_row("Write add(a, b).", call)],
    )
    cfg = DataConfig(
        dataset=path,
        question_column="problem",
        answer_column="verification_info",
        answer_format="code_tests",
        eval_size=0,
    )
    by_question = {e.question: e.answer for e in load_splits(cfg)[0]}
    stdin_spec, call_spec = (
        by_question["Read a and b; print a + b."],
        by_question["Write add(a, b)."],
    )

    def reward(text, spec):
        return GRADERS["code"](text, spec).score

    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    assert (reward(right, stdin_spec), reward(wrong, stdin_spec)) == (1.0, 0.0)
    right = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert (reward(right, call_spec), reward(wrong, call_spec)) == (1.0, 0.0)


def test_code_tests_rows_without_runnable_tests_are_named(tmp_path):
    mixed = [
        {"fn_name": None, "input": "1\n", "output": "1\n", "type": "stdin_stdout"},
        {"fn_name": "f", "input": "[1]", "output": "1", "type": "function_call"},
    ]
    rows = [_code_row("ok", mixed[:1]), _code_row("mixed", mixed), _code_row("none", [])]
    path = _jsonl(tmp_path / "code.jsonl", rows)
    cfg = DataConfig(
        dataset=path,
        question_column="problem",
        answer_column="verification_info",
        answer_format="code_tests",
        eval_size=0,
    )
    with pytest.raises(ConfigError, match="row 1: no answer in 'verification_info'"):
        load_splits(cfg)


def test_long_prompts_are_left_out_and_counted():
    from ibpo.data import drop_long_prompts, render_prompt
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    cfg = DataConfig(prompt_template="{question}")
    examples = [
        Example("1+1?", "2"),
        Example("what is " + "1+" * 40 + "1?", "41"),
        Example("2+2?", "4"),
    ]
    short = len(tok(render_prompt(tok, "1+1?", cfg), add_special_tokens=False)["input_ids"])
    cfg.max_prompt_tokens = short + 2
    kept, dropped = drop_long_prompts(examples, tok, cfg, "training")
    assert kept == [examples[0], examples[2]] and dropped == 1
    cfg.max_prompt_tokens = 10_000
    assert drop_long_prompts(examples, tok, cfg, "training") == (examples, 0)
    cfg.max_prompt_tokens = 3
    with pytest.raises(ConfigError, match="raise data.max_prompt_tokens"):
        drop_long_prompts(examples, tok, cfg, "training")


def test_eval_dataset_with_its_own_columns_and_answer_format(tmp_path):
    train = _jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": f"{i} + 1?", "solution": str(i + 1)} for i in range(5)],
    )
    rows = [
        {"problem": "Half of 8?", "answer": "4", "solution": "so \\boxed{4}"},
        {"problem": "3 squared?", "answer": "9", "solution": "it is \\boxed{9}"},
    ]
    held = _jsonl(tmp_path / "math500.jsonl", rows)
    from ibpo.recipe import load_config

    base = {
        "data.dataset": str(train),
        "data.question_column": "prompt",
        "data.answer_column": "solution",
        "data.eval_size": 5,
    }
    own = {"question_column": "problem", "answer_column": "solution", "answer_format": "boxed"}
    cfg = load_config(None, {**base, "data.eval": {"dataset": str(held), **own}})
    tr, ev = load_splits(cfg.data)
    assert [e.question for e in tr] == [f"{i} + 1?" for i in range(5)]  # nothing carved out
    assert [(e.question, e.answer) for e in ev] == [("Half of 8?", "4"), ("3 squared?", "9")]
    with pytest.raises(ConfigError, match="no column 'prompt'"):  # training's columns by default
        load_splits(load_config(None, {**base, "data.eval.dataset": str(held)}).data)
    with pytest.raises(ConfigError, match="data.eval.answer_format='latex'"):
        load_config(None, ["data.eval.answer_format=latex"])


def test_a_named_eval_dataset_without_the_split_is_an_error(tmp_path, monkeypatch):
    import ibpo.data.splits as splits

    train = _jsonl(tmp_path / "train.jsonl", [{"question": "1+1?", "answer": "2"}] * 3)
    real = splits._load_rows
    # a Hub dataset without the requested split (what _load_rows reports as None)
    monkeypatch.setattr(
        splits,
        "_load_rows",
        lambda src, split, subset: None if src == "org/evalset" else real(src, split, subset),
    )
    from ibpo.recipe import load_config

    held_out = {"dataset": "org/evalset", "split": "validation"}
    cfg = load_config(None, {"data.dataset": train, "data.eval": held_out, "data.eval_size": 2})
    cfg = cfg.data
    with pytest.raises(ConfigError, match="has no split 'validation'"):
        load_splits(cfg)  # never a silent carve-out of the training rows
