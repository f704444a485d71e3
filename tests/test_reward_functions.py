"""Reward functions in TRL's convention (ibpo/rewards/functions.py): the built-ins wrapped, the
weighted sum with None ignored, the columns and prompts they receive, one named error per bad
reward, concurrency; conversational prompts rendered whole (ibpo/data/)."""

import math
import threading

import pytest

from ibpo.config import ConfigError, DataConfig
from ibpo.data import Example, load_splits, render_example, rows_to_examples
from ibpo.recipe import load_config
from ibpo.repair import repair_prompt
from ibpo.rewards import GRADERS
from ibpo.rewards.functions import RewardError, grade_completions, reward_set, reward_stats
from ibpo.rewards.math import math_reward
from tests.conftest import make_tokenizer


def test_the_builtin_math_reward_is_the_grader_reading_the_answer_column():
    texts = ["The answer is 5", "4", "so 12", ""]
    gold = ["5", "5", "12", "3"]
    rs = reward_set("math")
    grades = rs.score(texts, {"answer": gold}, ["q"] * 4)
    total, per = grades.totals, grades.per_function
    assert total == [math_reward(t, a) for t, a in zip(texts, gold)] == [1.0, 0.0, 1.0, 0.0]
    assert per == {"math": total} and rs.reads_answer


def test_none_does_not_apply_and_the_weighted_sum_ignores_it():
    def a(completions, **_):
        return [1.0, None, 0.5, None]

    def b(completions, **_):
        return [None, 0.25, 1.0, None]

    rs = reward_set([a, b], weights=[2.0, 4.0])
    grades = rs.score(["w", "x", "y", "z"], {}, ["p"] * 4)
    total, per = grades.totals, grades.per_function
    assert total[:3] == [2.0, 1.0, 5.0]  # TRL: nansum of weight x value
    assert math.isnan(total[3])  # none applies: no reward at all (TRL), not a 0
    assert math.isnan(per["a"][1]) and per["b"][1] == 0.25
    stats = reward_stats(per)
    assert stats["rewards/a"] == stats["rewards/a/mean"] == 0.75 and stats["rewards/b"] == 0.625
    assert stats["rewards/a/std"] == pytest.approx(math.sqrt(0.125))  # Bessel's, as TRL
    assert not rs.reads_answer


def test_functions_receive_every_column_the_prompts_and_the_completion_ids():
    seen = {}

    def spy(completions, prompts, completion_ids, answer, level, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, answer=answer, level=level, rest=kwargs)
        return [0.0] * len(completions)

    rows = [
        Example("q0", "1", {"question": "q0", "answer": "#### 1", "level": 3, "meta": {"k": 1}}),
        Example("q1", "2", {"question": "q1", "answer": "#### 2", "level": 5, "meta": {"k": 2}}),
    ]
    each = [rows[0], rows[0], rows[1], rows[1]]  # G = 2
    grade_completions(
        reward_set(spy), each, ["P0"] * 2 + ["P1"] * 2, ["a", "b", "c", "d"], [[1], [2], [3], [4]]
    )
    assert seen["prompts"] == ["q0", "q0", "q1", "q1"]  # as the dataset gives them
    assert seen["answer"] == ["1", "1", "2", "2"]  # the gold answer as answer_format reads it
    assert seen["level"] == [3, 3, 5, 5] and seen["rest"]["meta"][2] == {"k": 2}
    assert seen["ids"] == [[1], [2], [3], [4]]


def test_a_conversation_reaches_rewards_as_messages():
    chat = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    )
    ex = Example("2+2?", "4", {"prompt": list(chat)}, chat)
    got = {}

    def spy(completions, prompts, **_):
        got.update(c=completions, p=prompts)
        return [1.0]

    grade_completions(reward_set(spy), [ex], ["rendered"], ["4"])
    assert got["c"] == [[{"role": "assistant", "content": "4"}]]  # TRL's conversational form
    assert got["p"] == [list(chat)]
    grades = grade_completions(reward_set("math"), [ex], ["rendered"], ["The answer is 4"])
    assert grades.totals == [1.0]  # the built-ins read a conversational completion's text


@pytest.mark.parametrize(
    "returns, message",
    [
        ([1.0], "reward function 'bad' returned 1 values for 2 completions. Fix: return a"),
        ("0.5", "reward function 'bad' returned a str ('0.5'), not a list. Fix: return a list"),
        ({"a": 1.0}, "reward function 'bad' returned a dict ({'a': 1.0}), not a list."),
        ([1.0, float("nan")], "reward function 'bad' returned nan for sample 1. Fix: return a"),
        ([float("inf"), 0.0], "reward function 'bad' returned inf for sample 0. Fix: return a"),
        ([1.0, "0.5"], "reward function 'bad' returned '0.5' (str) for sample 1, not a number."),
        ([True, 0.0], "reward function 'bad' returned True (bool) for sample 0, not a number."),
        (0.5, "reward function 'bad' returned a float, not a list."),
    ],
)
def test_each_bad_return_is_one_error_naming_the_function(returns, message):
    def bad(completions, **_):
        return returns

    with pytest.raises(RewardError) as e:
        reward_set(bad).score(["x", "y"], {}, ["p", "p"])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_an_exception_names_the_function_the_sample_and_its_last_line():
    def verifier(completions, **_):
        for c in completions:
            if c == "boom":
                raise ValueError("while checking\nthe program crashed: exit 3")
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as e:
        reward_set(verifier).score(["ok", "fine", "boom"], {}, ["p"] * 3)
    assert str(e.value) == (
        "reward function 'verifier' raised on sample 2: ValueError: the program crashed: exit 3"
    )
    assert not isinstance(e.value, ConfigError)  # a reward failing, not the configuration


def test_names_import_paths_and_weights_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod'"):
        reward_set("no_such_mod:f")
    with pytest.raises(ConfigError, match="module 'tests.reward_module' has no function 'nope'"):
        reward_set("tests.reward_module:nope")
    with pytest.raises(ConfigError, match="3 weights for 2 reward functions"):
        reward_set(["math", "tests.reward_module:parity"], weights=[1, 2, 3])
    with pytest.raises(ConfigError, match="two reward functions are named 'math'"):
        reward_set(["math", "math"])
    with pytest.raises(ConfigError, match="positional-only parameter"):
        reward_set(lambda c, /, **kw: [])

    def no_kwargs(completions):
        return []

    with pytest.raises(ConfigError, match="does not take 'prompts', 'completion_ids', "):
        reward_set(no_kwargs)
    with pytest.raises(ConfigError, match=r"reward.functions='nope'; choose one of: math, code"):
        load_config(None, ["reward.functions=nope"])
    with pytest.raises(ConfigError, match="reward.weights has 1 weights for 2"):
        load_config(None, ["reward.functions=[math, 'tests.reward_module:parity']",
                           "reward.weights=[1.0]"])  # fmt: skip
    cfg = load_config(None, ["reward.functions=[math, 'tests.reward_module:parity']"])
    assert reward_set(cfg.reward.functions).names == ["math", "parity"]


def test_reward_workers_run_the_functions_concurrently_with_the_same_result():
    barrier = threading.Barrier(2, timeout=10)  # serial calls would wait here for ever

    def slow_a(completions, **_):
        barrier.wait()
        return [float(len(c)) for c in completions]

    def slow_b(completions, **_):
        barrier.wait()
        return [None if c == "b" else 1.0 for c in completions]

    texts = ["a", "bb", "b", "cccc"]
    grades = reward_set([slow_a, slow_b], workers=2).score(texts, {}, ["p"] * 4)
    assert grades.totals == [2.0, 3.0, 1.0, 5.0]
    barrier = threading.Barrier(2, timeout=0.5)  # the control: one at a time, never met
    with pytest.raises(RewardError, match="BrokenBarrierError"):
        reward_set([slow_a, slow_b], workers=1).score(["a"], {}, ["p"])


def test_in_memory_rows_keep_every_column_and_trl_prompt_reads_as_the_question():
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "shift": i} for i in range(6)]
    cfg = DataConfig(eval_size=2)
    train, held = load_splits(cfg, rows=rows)
    assert len(train) == 4 and len(held) == 2
    assert {ex.question for ex in train + held} == {r["prompt"] for r in rows}
    assert all(ex.columns["shift"] == int(ex.answer) - 1 for ex in train + held)
    # no built-in grader: no answer column needed
    (ex,) = load_splits(DataConfig(eval_size=0), rows=[{"prompt": "hi"}], need_answer=False)[0]
    assert ex.answer == "" and ex.columns == {"prompt": "hi"}
    with pytest.raises(ConfigError, match="no column 'answer'"):
        load_splits(DataConfig(eval_size=0), rows=[{"prompt": "hi"}])
    with pytest.raises(ConfigError, match="row 1 is a str, not a dict"):
        load_splits(DataConfig(eval_size=0), rows=[{"prompt": "hi"}, "oops"])


def test_a_conversation_is_rendered_whole_through_the_chat_template():
    tok = make_tokenizer()
    chat = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "what is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 2+2?"},
    ]

    class Rows(list):
        column_names = ["prompt", "answer"]

    (ex,) = rows_to_examples(Rows([{"prompt": chat, "answer": "4"}]), DataConfig(), "mem")
    assert ex.question == "and 2+2?"
    text = render_example(tok, ex, DataConfig())
    assert text == (
        "<system>sys\n<user>what is 1+1?\n<assistant>2\n<user>and 2+2?\n<assistant>"
    )  # every turn, no prompt_template around the chat
    # a repair keeps the earlier turns and asks in place of the last user message
    rep = load_config(None, ["repair.template='{question}|{attempt}|{reference}'"]).repair
    asked = repair_prompt(tok, ex, "5", "4", rep, DataConfig())
    assert asked == "<system>sys\n<user>what is 1+1?\n<assistant>2\n<user>and 2+2?|5|4\n<assistant>"
    # a plain question: the prompt template and system prompt as before
    plain = Example("1+1?", "2")
    cfg = DataConfig(system_prompt="S")
    assert (
        render_example(tok, plain, cfg)
        == "<system>S\n<user>1+1?\nAnswer with just the number.\n<assistant>"
    )


def test_a_registered_grader_is_looked_up_when_called(monkeypatch):
    rs = reward_set("math")
    monkeypatch.setitem(GRADERS, "math", lambda text, answer: 0.5)
    assert rs.score(["x"], {"answer": ["1"]}, ["p"]).totals == [0.5]


def test_the_math_reward_reads_a_problems_options_from_its_column_or_text(monkeypatch):
    amc = r"How many? $\textbf{(A)}\ 8 \qquad\textbf{(B)}\ 10 \qquad\textbf{(C)}\ 12$"
    rows = [
        Example(amc, "C", {"question": amc}),  # options in the problem's text
        Example("How many?", "12", {"question": "How many?", "choices": ["8", "10", "12"]}),
        Example("How many?", "C", {"question": "How many?", "options": ["A)8", "B)10", "C)12"]}),
        Example("What is 3 * 4?", "12", {"question": "What is 3 * 4?"}),  # no options
    ]
    texts = [r"\boxed{\textbf{(C)}\ 12}", r"\boxed{C}", r"\boxed{12}", r"\boxed{C}"]
    grades = grade_completions(reward_set("math"), rows, ["P"] * 4, texts)
    assert grades.totals == [1.0, 1.0, 1.0, 0.0]
    wrong = [r"\boxed{(B) 12}", r"\boxed{B}", r"\boxed{10}", r"\boxed{12}"]
    assert grade_completions(reward_set("math"), rows, ["P"] * 4, wrong).totals == [
        0.0,
        0.0,
        0.0,
        1.0,
    ]
    # a conversation: the options in its last user message
    chat = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": amc})
    row = Example(amc, "12", {"prompt": list(chat)}, chat)
    assert grade_completions(reward_set("math"), [row], ["P"], [r"\boxed{C}"]).totals == [1.0]
    # a grader without a `choices` parameter is called as before
    seen = []
    monkeypatch.setitem(GRADERS, "math", lambda text, answer: seen.append((text, answer)) or 0.0)
    reward_set("math").score(["x"], {"answer": ["1"], "choices": [["8", "10"]]}, ["p"])
    assert seen == [("x", "1")]


def test_two_concurrent_gradings_each_keep_exactly_their_own_grader_failures(monkeypatch):
    """Grader failures travel with the grading that met them (a context variable, copied into
    the reward workers' threads), never through a count shared by the process: two gradings
    running at once, each on worker threads, each report exactly theirs, at their indices."""
    from ibpo.rewards import math as grader

    real = grader._normalize
    both_running = threading.Barrier(2, timeout=10)  # each grading waits for the other

    def flaky(s):
        if s.startswith("9"):  # a failure of the grader itself on every gold starting with 9
            raise RecursionError(f"deep {s}")
        return real(s)

    def meet(completions, **_):
        if "\\boxed{2}" in completions:  # once per grading (its first chunk)
            both_running.wait()
        return [None] * len(completions)

    monkeypatch.setattr(grader, "_normalize", flaky)
    fns = reward_set(["math", meet], workers=2)
    runs = {
        "a": (["\\boxed{91}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"], ["91", "2", "3", "4"]),
        "b": (["\\boxed{1}", "\\boxed{2}", "\\boxed{93}", "\\boxed{94}"], ["1", "2", "93", "94"]),
    }
    out = {}

    def grade(name):
        texts, gold = runs[name]
        out[name] = fns.score(texts, {"answer": gold}, ["p"] * 4)

    threads = [threading.Thread(target=grade, args=(name,)) for name in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a, b = out["a"], out["b"]
    assert a.totals == [0.0, 1.0, 1.0, 1.0] and b.totals == [1.0, 1.0, 0.0, 0.0]
    assert [(f.index, f.function, f.kind) for f in a.failures] == [(0, "math", "math")]
    assert sorted(f.index for f in b.failures) == [2, 3]
    assert all("deep 9" in f.reason for f in a.failures + b.failures)
    assert a.failure_reasons()[1:] == ["", "", ""] and b.failure_reasons()[:2] == ["", ""]
    assert "deep 91" in a.failure_reasons()[0] and "deep 94" in b.failure_reasons()[3]
    assert fns.score(["\\boxed{3}"], {"answer": ["3"]}, ["p"]).failures == []  # none left over


def test_a_user_function_that_returns_a_graders_graded_has_its_failures_counted(monkeypatch):
    """docs/rewards.md's pattern: a function of the user's calls score_math and returns its
    Graded (here with a value of its own); the grader's own failure scores 0 and is reported at
    its completion, under the user's function. math_reward's float drops the failure (it is
    only logged): a function returning those reports none."""
    from ibpo.rewards import math as grader
    from ibpo.rewards.errors import Graded

    real = grader._normalize

    def flaky(s):
        if s.startswith("9"):
            raise RecursionError(f"deep {s}")
        return real(s)

    def boxed(completions, answer, **kwargs):
        scores = []
        for text, gold in zip(completions, answer):
            graded = grader.score_math(text, gold)
            scores.append(Graded(graded.score / 2, graded.failure))
        return scores

    def unnamed(completions, answer, **kwargs):
        return [grader.math_reward(t, g) for t, g in zip(completions, answer)]

    monkeypatch.setattr(grader, "_normalize", flaky)
    texts, gold = ["\\boxed{1}", "\\boxed{95}", "\\boxed{3}"], ["1", "95", "3"]
    got = reward_set(boxed).score(texts, {"answer": gold}, ["p"] * 3)
    assert got.totals == [0.5, 0.0, 0.5]
    assert [(f.index, f.function, f.kind) for f in got.failures] == [(1, "boxed", "math")]
    assert "deep 95" in got.failure_reasons()[1]
    plain = reward_set(unnamed).score(texts, {"answer": gold}, ["p"] * 3)
    assert plain.totals == [1.0, 0.0, 1.0]
    assert plain.failures == []
