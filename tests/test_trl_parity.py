"""A TRL GRPOTrainer user's reward code and habits, unchanged: the reward functions of TRL's
documentation (written here from their signatures) and TRL's own `trl.rewards`, called by
keyword; completions no reward applies to (no advantage, a warning naming the row); the
correct/failed thresholds; async rewards awaited together; the reward timeout; prompts as the
dataset gives them; callbacks."""

import asyncio
import math
import re
import threading
import time

import pytest
import torch

from ibpo.algo.advantages import flat_groups, group_advantages
from ibpo.algo.counterfactual import plan_repairs
from ibpo.config import ConfigError, DataConfig
from ibpo.data import (
    Example,
    describe_prompts,
    load_splits,
    render_example,
    special_prefix,
)
from ibpo.recipe import load_config
from ibpo.rewards import calls
from ibpo.rewards.functions import RewardError, grade_completions, logged_metrics, reward_set
from ibpo.run.callbacks import CallbackError, Callbacks, RunControl, RunState
from ibpo.step_metrics import reward_summary
from tests.conftest import make_tokenizer

# --- the documented reward functions, called as TRL calls them --------------------------------


def test_a_reward_reading_only_the_completion_ids():
    def reward_func(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    grades = reward_set(reward_func).score(
        [" blue.", " in the sky."],
        {},
        ["The sky is", "The sun is"],
        [[6303, 13], [304, 279, 1, 13]],
    )
    assert grades.totals == [2.0, 4.0]


def test_a_reward_reading_the_completions_and_one_reading_a_column():
    def by_chars(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def reward_func(completions, ground_truth, **kwargs):
        matches = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        contents = [m.group(1) if m else "" for m in matches]
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    texts = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
    grades = reward_set([by_chars, reward_func]).score(
        texts, {"ground_truth": ["2", "5"]}, ["Solve 2x + 3 = 7.", "Solve 3x - 5 = 10."]
    )
    assert grades.per_function == {"by_chars": [27.0, 27.0], "reward_func": [1.0, 0.0]}


def test_a_conversational_format_reward():
    def format_reward_func(completions, **kwargs):
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        contents = [completion[0]["content"] for completion in completions]
        return [1.0 if re.match(pattern, c) else 0.0 for c in contents]

    chat = ({"role": "user", "content": "What is (1 + 2) * 4?"},)
    ex = Example("What is (1 + 2) * 4?", "", {"prompt": list(chat)}, chat)
    texts = ["<think>3 times 4</think><answer>12</answer>", "It is 12."]
    rs = reward_set(format_reward_func)
    assert grade_completions(rs, [ex, ex], ["r", "r"], texts, [[1], [2]]).totals == [1.0, 0.0]


def test_multi_task_rewards_and_a_row_none_applies_to(capsys):
    """TRL's multi-task example as documented: its coding reward tests task == "coding" while
    the rows say "code", so no reward applies to the code rows. TRL gives them no reward and
    no advantage and warns with the row; so does ibpo."""

    def math_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "math":
                rewards.append(1.0 if completion.strip() == str(eval(prompt[8:-1])) else -1.0)
            else:
                rewards.append(None)
        return rewards

    def coding_reward_func(prompts, completions, task, **kwargs):
        return [(1.0 if "return" in c else -1.0) if t == "coding" else None
                for c, t in zip(completions, task)]  # fmt: skip

    rows = [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
    ]
    examples = [Example(r["prompt"], "", r) for r in rows for _ in range(2)]
    rs = reward_set([math_reward_func, coding_reward_func])
    grades = grade_completions(rs, examples, ["p"] * 4, ["4", "5", "def f", "x"], [[1]] * 4)
    total, per = grades.totals, grades.per_function
    assert total[:2] == [1.0, -1.0] and all(math.isnan(t) for t in total[2:])
    assert all(math.isnan(v) for v in per["coding_reward_func"])
    err = capsys.readouterr().err
    assert "no reward function applies to completion 2 of 4" in err
    assert "'Write a function that returns the sum of two numbers.'" in err and "'code'" in err
    # -1 is below the failed threshold 0: one warning about the scale, naming the keys
    assert "reward.correct_threshold and reward.failed_threshold" in err
    # their advantage is 0 and they are not in their group's baseline
    adv = group_advantages(
        torch.tensor([total[:2] + [0.0, 1.0], [math.nan, 1.0, 0.0, math.nan]]), False
    )
    assert adv[1].tolist() == [0.0, 0.5, -0.5, 0.0]
    assert adv[0].tolist() == [0.75, -1.25, -0.25, 0.75]
    rs.score(["x"], {"task": ["code"]}, ["p"])  # warned once only
    assert "no reward function applies" not in capsys.readouterr().err


def test_trl_s_own_reward_functions_run_unchanged():
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

    overlong = get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)
    rs = reward_set([think_format_reward, accuracy_reward, overlong])
    assert rs.names == ["think_format_reward", "accuracy_reward", "soft_overlong_punishment_reward"]
    chat = ({"role": "user", "content": "1/3?"},)
    rows = [
        {"prompt": list(chat), "solution": r"\frac{1}{3}"},
        {"prompt": list(chat), "solution": "x"},
    ]
    examples = [Example("1/3?", "", row, chat) for row in rows]
    texts = [r"<think>so</think>My answer is \boxed{\frac{1}{3}}", "no"]
    grades = grade_completions(rs, examples, ["r", "r"], texts, [[1, 2], [1, 2, 3, 4]])
    per = grades.per_function
    assert per["think_format_reward"] == [1.0, 0.0]
    assert per["accuracy_reward"][0] == 1.0 and math.isnan(per["accuracy_reward"][1])
    assert per["soft_overlong_punishment_reward"] == [0.0, -1.0]
    # accuracy_reward logs columns of its own for the completions table
    assert grades.extra["gold_parsed"][1] == "[unparseable]"


def test_trainer_state_log_metric_and_log_extra():
    def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
        progress = trainer_state.global_step / trainer_state.max_steps
        log_metric("curriculum/progress", progress)
        log_extra("length", [len(c) for c in completions])
        return [progress] * len(completions)

    rs = reward_set(curriculum, workers=2)  # chunks: each call logs its own rows
    rs.trainer_state = RunState(global_step=3, max_steps=12)
    grades = rs.score(["a", "bb", "ccc"], {}, ["p"] * 3)
    assert grades.totals == [0.25] * 3
    assert grades.extra == {"length": [1, 2, 3]}
    assert grades.metrics == {"curriculum/progress": [0.25, 0.25]}  # one value per call
    assert logged_metrics([grades]) == {"curriculum/progress": 0.25}
    assert rs.score(["a"], {}, ["p"]).extra == {"length": [1]}  # each grading its own


def test_a_signature_that_cannot_be_called_is_named_with_its_fix():
    def wants_texts(texts, **kwargs):  # positional habit: TRL passes `completions` by keyword
        return [0.0] * len(texts)

    with pytest.raises(RewardError, match=r"needs argument 'texts', which is neither .* "
                       r"\(its columns: answer, level\)"):  # fmt: skip
        reward_set(wants_texts).score(["x"], {"answer": ["1"], "level": [2]}, ["p"])

    def wants_column(completions, ground_truth, **kwargs):
        return [0.0]

    with pytest.raises(RewardError, match="needs argument 'ground_truth'"):
        reward_set(wants_column).score(["x"], {"answer": ["1"]}, ["p"])


def test_a_prompt_column_arrives_as_prompts_only():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(kwargs, prompts=prompts)
        return [0.0]

    reward_set(spy).score(["x"], {"prompt": ["P"], "completion": ["C"], "task": ["t"]}, ["P"])
    assert seen["prompts"] == ["P"] and seen["task"] == ["t"]
    assert "prompt" not in seen and "completion" not in seen
    assert {"trainer_state", "log_extra", "log_metric", "completion_ids"} <= set(seen)


# --- async rewards and the reward timeout --------------------------------------------------


def test_async_rewards_are_awaited_together_and_beside_the_others():
    started = []

    async def waits_for_the_other(completions, name="a", **kwargs):
        started.append(name)
        while len(started) < 2:  # awaited one after the other, this never ends
            await asyncio.sleep(0.001)
        return [1.0] * len(completions)

    async def async_reward_func(prompts, completions, **kwargs):
        started.append("b")
        while len(started) < 2:
            await asyncio.sleep(0.001)
        return [1.0 if completion else 0.0 for completion in completions]

    def plain(completions, **kwargs):
        return [0.5] * len(completions)

    rs = reward_set([waits_for_the_other, async_reward_func, plain], timeout=10)
    grades = rs.score(["x", ""], {}, ["p", "p"])
    assert grades.per_function["async_reward_func"] == [1.0, 0.0]
    assert grades.totals == [2.5, 1.5] and grades.timeouts == 0


def test_a_reward_that_hangs_scores_zero_is_counted_and_the_run_goes_on(capsys, monkeypatch):
    release = threading.Event()

    def hangs(completions, **kwargs):
        release.wait(30)
        return [1.0] * len(completions)

    async def hangs_async(completions, **kwargs):
        await asyncio.sleep(30)
        return [1.0] * len(completions)

    def quick(completions, **kwargs):
        return [0.25] * len(completions)

    rs = reward_set([hangs, hangs_async, quick], timeout=0.2)
    t0 = time.monotonic()
    grades = rs.score(["x", "y"], {}, ["p", "p"])
    assert time.monotonic() - t0 < 5
    per = grades.per_function
    assert per["hangs"] == [0.0, 0.0] and per["hangs_async"] == [0.0, 0.0]
    assert grades.totals == [0.25, 0.25] and grades.timeouts == 2
    err = capsys.readouterr().err
    assert "reward function 'hangs' ran past reward.timeout=0.2 s" in err
    again = rs.score(["x", "y"], {}, ["p", "p"])
    assert again.timeouts == 2 and "ran past" not in capsys.readouterr().err  # warned once
    release.set()

    # an async function blocking its loop with synchronous code: the loop is given up on
    monkeypatch.setattr(calls, "GRACE_SECONDS", 0.1)

    async def blocks(completions, **kwargs):
        time.sleep(1.0)
        return [1.0] * len(completions)

    rs = reward_set([blocks, quick], timeout=0.1)
    grades = rs.score(["x"], {}, ["p"])
    assert grades.per_function["blocks"] == [0.0] and grades.timeouts == 1


def test_without_a_timeout_a_reward_runs_on_the_calling_thread():
    where = []

    def needs_main_thread(completions, **kwargs):  # math-verify's signal.alarm does
        where.append(threading.current_thread() is threading.main_thread())
        return [0.0] * len(completions)

    reward_set(needs_main_thread, timeout=None).score(["x"], {}, ["p"])
    reward_set(needs_main_thread, timeout=5).score(["x"], {}, ["p"])
    assert where == [True, False]


def test_a_raising_async_reward_names_the_sample_and_keeps_the_exception():
    async def verifier(completions, **kwargs):
        if "boom" in completions:
            raise ConnectionError("remote verifier\nrefused")
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as e:
        reward_set(verifier, timeout=5).score(["ok", "boom"], {}, ["p", "p"])
    assert str(e.value) == "reward function 'verifier' raised on sample 1: ConnectionError: refused"
    assert isinstance(e.value.__cause__, ConnectionError) and e.value.__cause__.__traceback__


# --- thresholds -----------------------------------------------------------------------------


def test_thresholds_are_config_keys_with_defaults_and_a_rule():
    rw = load_config().reward
    assert (rw.correct_threshold, rw.failed_threshold, rw.timeout) == (1.0, 0.0, 600.0)
    rs = reward_set("math", correct=rw.correct_threshold, failed=rw.failed_threshold)
    assert (rs.correct, rs.failed) == (1.0, 0.0)
    with pytest.raises(ConfigError, match="failed_threshold=1 must be below"):
        load_config(None, ["reward.failed_threshold=1", "reward.correct_threshold=1"])
    cfg = load_config(None, ["reward.timeout=null"])
    assert cfg.reward.timeout is None


def test_thresholds_decide_what_is_repaired_correct_and_accurate():
    import random

    rewards = torch.tensor([[-1.0, 1.0, 0.0, math.nan]])  # TRL's +-1 scale
    jobs = plan_repairs(rewards, 1, 4, "correct_first", random.Random(0), 1.0, -1.0)
    assert [(j.member, j.reference) for j in jobs] == [(0, 1)]  # 0 is not failed on this scale
    jobs = plan_repairs(rewards, 1, 4, "correct_first", random.Random(0))
    assert sorted(j.member for j in jobs) == [0, 2]  # the defaults: <= 0; NaN never
    mean, accuracy, unscored = reward_summary(rewards, 1.0)
    assert (mean, accuracy, unscored) == (0.0, 1 / 3, 0.25)
    assert reward_summary(rewards, 0.0)[1] == 2 / 3


def test_flat_groups_leave_out_completions_no_reward_applies_to():
    r = torch.tensor([[1.0, math.nan, 1.0], [math.nan] * 3, [0.0, 1.0, math.nan]])
    assert flat_groups(r).tolist() == [True, True, False]
    adv = group_advantages(r, True)
    assert (adv[:2] == 0).all() and adv[2, 2] == 0 and adv[2, 0] < 0 < adv[2, 1]


# --- your prompt is your prompt -----------------------------------------------------------


def test_user_prompts_are_asked_as_given_and_the_built_in_tasks_keep_their_template():
    tok = make_tokenizer()
    rows = [{"prompt": "name the colour of the sky:  ", "answer": "blue"}]
    user = load_config(None, {"data.dataset": "in-memory", "data.eval_size": 0}).data
    assert user.prompt_template is None
    (ex,), _ = load_splits(user, rows=rows)
    assert render_example(tok, ex, user) == "name the colour of the sky:  "  # not even stripped
    assert "as the dataset gives them" in describe_prompts(tok, user)
    builtin = load_config().data
    assert builtin.prompt_template == "{question}\nAnswer with just the number."
    assert render_example(tok, Example("1+1?", "2"), builtin) == (
        "<user>1+1?\nAnswer with just the number.\n<assistant>"
    )
    assert "(the built-in tasks)" in describe_prompts(tok, builtin)
    assert load_config().to_dict(recipe=True)["data"]["prompt_template"] is None  # inherited
    chat = load_config(None, {"data.dataset": "x.jsonl", "data.prompt_template": "{question}"})
    assert render_example(tok, ex, chat.data) == "<user>name the colour of the sky:\n<assistant>"
    with_system = load_config(None, {"data.dataset": "x.jsonl", "data.system_prompt": "S"}).data
    assert render_example(tok, ex, with_system) == (
        "<system>S\n<user>name the colour of the sky:\n<assistant>"
    )  # a system prompt needs a chat: the prompt is its user message, untemplated


def test_a_prompt_as_given_gets_the_bos_the_tokenizer_would_add():
    tok = make_tokenizer()
    assert special_prefix(tok) == ""
    from tokenizers.processors import TemplateProcessing

    bos = make_tokenizer()
    bos.add_special_tokens({"bos_token": "<s>"})
    bos._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos.convert_tokens_to_ids("<s>"))]
    )
    assert special_prefix(bos) == "<s>"
    cfg = DataConfig(dataset="rows.jsonl")
    assert render_example(bos, Example("the sky is", ""), cfg) == "<s>the sky is"


# --- callbacks ------------------------------------------------------------------------------


class _Acc:
    num_processes = 1


def test_callbacks_hooks_flags_and_errors():
    from transformers import TrainerCallback

    seen = []

    class StopAtTwo(TrainerCallback):  # a TRL user's callback, as written for GRPOTrainer
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((state.global_step, kwargs["metrics"]["reward"], "model" in kwargs))
            if state.global_step >= 2:
                control.should_training_stop = True
            return control

    class Saver:  # any object with some hooks; a returned control counts too
        def on_log(self, args, state, control, logs=None, **kwargs):
            return RunControl(should_save=True)

    state = RunState(max_steps=5)
    cbs = Callbacks([StopAtTwo, Saver()], args="cfg", state=state)  # a class is instantiated
    cbs.objects = {"model": object()}
    for step in (1, 2):
        state.global_step = step
        cbs.call("on_step_end", metrics={"reward": 0.5})
        cbs.call("on_log", logs={})
        stop, save, evaluate = cbs.take(_Acc())
        assert (stop, save, evaluate) == (step == 2, True, False)
    assert seen == [(1, 0.5, True), (2, 0.5, True)]
    with pytest.raises(ConfigError, match="has none of the hooks"):
        Callbacks([object()], None, state)

    class Broken:
        def on_step_begin(self, args, state, control, **kwargs):
            raise KeyError("oops")

    with pytest.raises(CallbackError, match=r"callback Broken.on_step_begin raised: KeyError"):
        Callbacks([Broken()], None, state).call("on_step_begin")


# --- reward models ----------------------------------------------------------------------------


def _tiny_classifier(tok):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, num_labels=1, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForSequenceClassification(cfg).eval()


def test_a_reward_model_scores_prompt_and_completion_as_trl_does(tmp_path):
    tok = make_tokenizer()
    model = _tiny_classifier(tok)
    prompts, texts = ["what is 1+1?", "what is 2+2?"], ["2", "5 or so"]
    with torch.inference_mode():
        expected = [
            model(**tok(p + c, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
            for p, c in zip(prompts, texts)
        ]
    rs = reward_set([(model, tok)])  # the pair, as TRL's reward model + processing class
    per = rs.score(texts, {}, prompts).per_function
    (name,) = rs.names
    assert per[name] == pytest.approx(expected, abs=1e-5)  # padded in a batch: the same scores
    with pytest.raises(ConfigError, match=r"a torch module \(a reward model\) without its "):
        reward_set(model)
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    by_path = reward_set(str(tmp_path / "rm"))  # a folder (or Hub id), loaded when first called
    assert by_path.names == ["rm"]
    assert by_path.score(texts, {}, prompts).per_function["rm"] == pytest.approx(expected, abs=1e-5)
    cfg = load_config(None, ["reward.functions=[math, org/reward-model]"])
    assert cfg.reward.functions == ["math", "org/reward-model"]


def test_a_lora_config_is_recorded_and_dora_turns_the_cpu_fold_off():
    from peft import LoraConfig

    from ibpo.api import _lora_settings
    from ibpo.config import ModelConfig
    from ibpo.modeling import use_dequantized_base

    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, use_dora=True,
                      target_modules={"v_proj", "q_proj"})  # fmt: skip
    settings = _lora_settings(lora)
    assert settings == {
        "model.lora_r": 8, "model.lora_alpha": 16, "model.lora_target_modules": ["q_proj", "v_proj"]
    }  # fmt: skip
    m = load_config(None, settings).model
    assert (m.lora_r, m.lora_alpha, m.lora_target_modules) == (8, 16, ["q_proj", "v_proj"])

    class DoraLayer(torch.nn.Module):  # what PEFT's LoRA layer holds for a DoRA adapter
        lora_variant = {"default": object()}

    model = torch.nn.Sequential(DoraLayer())
    assert not use_dequantized_base(ModelConfig(quantization="nf4"), torch.device("cpu"), model)


# --- names and isolation ----------------------------------------------------------------------


def test_a_partial_is_named_by_the_function_it_wraps_and_two_say_how_to_part_them():
    import functools

    def within(completions, limit, **kwargs):
        return [float(len(c) <= limit) for c in completions]

    short = functools.partial(within, limit=3)
    assert reward_set(short).functions[0].name == "within"  # TRL's name for it
    short.__name__ = "short"
    assert reward_set(short).functions[0].name == "short"
    with pytest.raises(ConfigError, match=r"named 'within'.*__name__"):
        reward_set([functools.partial(within, limit=3), functools.partial(within, limit=9)])


def test_no_call_sees_what_an_earlier_call_changed_in_place():
    """A reward that appends to a list a row holds (or to a completion's messages) changes
    nothing the next function, the next chunk or the next step gets."""
    seen = []

    def greedy(completions, tags, **kwargs):
        seen.append([list(t) for t in tags])
        for t in tags:
            t.append("mine")  # in place
        for c in completions:
            c[0]["content"] += "!"
        return [1.0] * len(completions)

    def other(completions, tags, **kwargs):
        seen.append([list(t) for t in tags])
        return [float(c[0]["content"].endswith("!")) for c in completions]

    rows = {"tags": [["a"], ["b"]]}
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    fns = reward_set([greedy, other], workers=2)
    for _ in range(2):  # two steps over the same rows
        grades = fns.score(completions, rows, ["q1", "q2"])
        assert grades.per_function["other"] == [0.0, 0.0]
    assert all(s in ([["a"], ["b"]], [["a"]], [["b"]]) for s in seen), seen
    assert rows == {"tags": [["a"], ["b"]]} and completions[0][0]["content"] == "4"


def test_a_whole_chat_ending_in_the_reply_asks_the_conversation_before_it(capsys):
    """Rows whose `messages` end in the assistant's answer (a chat dataset): the reply is left
    out of the prompt and, without an answer column, is the answer, as TRL's prompt-only
    conversion reads them; one line says so."""
    rows = [
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": f"what is {i} + 1?"},
                      {"role": "assistant", "content": str(i + 1)}]}
        for i in range(3)
    ]  # fmt: skip
    from ibpo.data.rows import RowList, rows_to_examples

    cfg = DataConfig(question_column="messages")
    examples = rows_to_examples(RowList(rows), cfg, "rows")
    assert [ex.answer for ex in examples] == ["1", "2", "3"]
    assert [m["role"] for m in examples[0].messages] == ["system", "user"]
    assert examples[2].question == "what is 2 + 1?"
    said = capsys.readouterr().err
    assert "3 conversations in 'messages' end in the assistant's reply" in said
    # with an answer column of its own, that one is the answer and the reply is still left out
    with_answer = [{**r, "answer": "x"} for r in rows]
    examples = rows_to_examples(RowList(with_answer), cfg, "rows")
    assert [ex.answer for ex in examples] == ["x"] * 3 and len(examples[0].messages) == 2
