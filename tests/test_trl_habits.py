"""More of a TRL GRPOTrainer user's habits: functools.partial rewards and their names, reward
calls that cannot change each other's arguments, `messages` that end with the assistant's
answer, IterableDataset training sets (streamed, held-out rows, resume), training prompts
measured as drawn, a resume from Python that names the rows to pass again and leaves a run's
files alone when it fails, the first Ctrl-C during a hung reward call; and end to end, a
GRPOConfig with a callback written for TRL."""

import dataclasses
import functools
import json
import os
import signal
import threading
import time
import warnings

import pytest
import yaml

import ibpo
import ibpo.data.prompts as prompts_mod
from ibpo.config import ConfigError, DataConfig
from ibpo.data import Example, RowStream, load_splits, render_example, training_stream
from ibpo.recipe import load_config
from ibpo.rewards import calls
from ibpo.rewards.functions import grade_completions, import_path, reward_set
from ibpo.run import checkpoint as ckpt
from ibpo.run.failures import GracefulStop
from tests import reward_module
from tests.conftest import make_tokenizer
from tests.test_train_api import ROWS, _settings

# --- names -------------------------------------------------------------------------------------


def shorter_than(completions, limit, **kwargs):
    return [float(len(c) < limit) for c in completions]


def test_a_partial_records_the_function_it_wraps_and_that_it_cannot_be_imported_back():
    brief = functools.partial(shorter_than, limit=3)
    assert reward_set([brief]).names == ["shorter_than"]
    assert import_path(brief) == f"{__name__}:shorter_than.<partial>"  # never imports back bare
    assert import_path(shorter_than) == f"{__name__}:shorter_than"


# --- isolation -------------------------------------------------------------------------------


def test_each_reward_call_gets_values_no_earlier_call_could_change():
    seen = []

    def meddles(completions, tags, prompts, completion_ids, **kwargs):
        seen.append(([list(t) for t in tags], [m[0]["content"] for m in prompts]))
        for t, p, ids in zip(tags, prompts, completion_ids):
            t.append("meddled")
            p[0]["content"] = "changed"
            ids.append(-1)
        completions[0][0]["content"] = "changed"
        return [0.0] * len(completions)

    def reads(completions, tags, prompts, completion_ids, **kwargs):
        seen.append(([list(t) for t in tags], [m[0]["content"] for m in prompts]))
        assert completions[0][0]["content"] in "xy" and completion_ids[0] in ([1], [2])
        return [0.0] * len(completions)

    chat = ({"role": "user", "content": "q"},)
    ex = Example("q", "", {"tags": ["a"], "prompt": list(chat)}, chat)
    rs = reward_set([meddles, reads], workers=2)  # also each chunk's call
    for _ in range(2):  # and a later grading
        grade_completions(rs, [ex, ex], ["r", "r"], ["x", "y"], [[1], [2]])
    assert all(call == ([["a"]], ["q"]) for call in seen) and len(seen) == 8
    assert ex.columns["tags"] == ["a"] and ex.messages[0]["content"] == "q"  # the row itself


# --- messages that end with the answer -----------------------------------------------------------


def test_messages_ending_with_the_answer_are_asked_without_it_also_streamed(capsys):
    def turns(q, a):
        return [{"role": "system", "content": "be brief"}, {"role": "user", "content": q},
                {"role": "assistant", "content": a}]  # fmt: skip

    cfg = DataConfig(dataset="in-memory", question_column="messages", eval_size=0)
    rows = [{"messages": turns("what is 2+3?", "5")}, {"messages": turns("what is 1+1?", "2")}]
    train, _ = load_splits(cfg, rows=rows)
    err = capsys.readouterr().err
    assert "2 conversations in 'messages' end in the assistant's reply" in err
    ex = train[0]
    assert [m["role"] for m in ex.messages] == ["system", "user"] and ex.answer == "5"
    text = render_example(make_tokenizer(), ex, cfg)
    assert text == "<system>be brief\n<user>what is 2+3?\n<assistant>"  # no answer shown
    # with an answer column, that is the gold answer; the last turn is still not shown
    rows = [{"messages": turns("what is 2+3?", "it is 5"), "answer": "5"}]
    (ex,), _ = load_splits(cfg, rows=rows)
    assert ex.answer == "5" and len(ex.messages) == 2
    # a stream of them says so at its first
    stream = _iterable([{"messages": turns(f"what is {i}+1?", str(i + 1))} for i in range(3)])
    train, _ = load_splits(cfg, rows=stream)
    assert [ex.answer for ex in training_stream(train, 0).take(3)] == ["1", "2", "3"]
    assert "the conversations in 'messages' end in the assistant's reply" in capsys.readouterr().err


# --- streams -------------------------------------------------------------------------------------


def _iterable(rows):
    import datasets

    return datasets.Dataset.from_list(rows).to_iterable_dataset()


def _questions(examples):
    return [ex.question for ex in examples]


def test_an_iterable_dataset_is_streamed_with_held_out_rows_first_and_resumes():
    import datasets

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(7)] + [
        {"question": "q1", "answer": "1"}  # repeats a held-out question
    ]
    cfg = load_config(None, {"data.dataset": "in-memory", "data.eval_size": 2}).data
    train, held = load_splits(cfg, rows=_iterable(rows))
    assert _questions(held) == ["q0", "q1"]
    stream = training_stream(train, seed=0)
    assert isinstance(stream, RowStream)
    assert _questions(stream.take(3)) == ["q2", "q3", "q4"]  # the stream's own order
    state = stream.state_dict()
    rest = _questions(stream.take(5))
    assert rest == ["q5", "q6", "q2", "q3", "q4"]  # q1 again is left out; a second pass
    assert stream.progress == 1.0 and stream.left_out == 1
    resumed = training_stream(load_splits(cfg, rows=_iterable(rows))[0], seed=0)
    resumed.load_state_dict(state)
    assert _questions(resumed.take(5)) == rest  # goes on where the checkpoint stood
    # two processes: each keeps every other row
    ranks = [training_stream(train, 0, rank, 2).take(3) for rank in (0, 1)]
    assert [_questions(r) for r in ranks] == [["q2", "q4", "q6"], ["q3", "q5", "q3"]]
    # held-out rows from eval_dataset= (a stream too: its first data.eval_size rows)
    gen = datasets.IterableDataset.from_generator(lambda: iter(rows[:4]))
    train, held = load_splits(cfg, rows=gen, eval_rows=_iterable(rows[4:]))
    assert _questions(held) == ["q4", "q5"]
    assert _questions(training_stream(train, 0).take(4)) == ["q0", "q1", "q2", "q3"]
    with pytest.raises(ConfigError, match="data.eval_size=9 leaves nothing to train on"):
        load_splits(dataclasses.replace(cfg, eval_size=9), rows=_iterable(rows))
    with pytest.raises(ConfigError, match="which can be read once.*from_generator"):
        load_splits(cfg, rows=(r for r in rows))
    with pytest.raises(ConfigError, match="read its training rows as a stream"):
        training_stream([Example("q", "1")], 0).load_state_dict(state)


def test_training_prompts_are_measured_as_drawn():
    examples = [Example("x" * n, "1") for n in (3, 40, 5, 2)]
    drawn = []

    def fits(ex):
        drawn.append(ex.question)
        return None if len(ex.question) < 10 else "too long"

    stream = training_stream(examples, seed=1, keep=fits)
    assert drawn == []  # nothing measured before it is drawn
    got = stream.take(2)
    assert len(got) == 2 and all(len(ex.question) < 10 for ex in got)
    assert len(drawn) == 2 + stream.left_out
    with pytest.raises(ConfigError, match="every training problem is left out as drawn"):
        training_stream(examples, 1, keep=lambda ex: "too long").take(1)
    tok = make_tokenizer()
    check = prompts_mod.prompt_fits(tok, DataConfig(dataset="rows.jsonl", max_prompt_tokens=4))
    assert check(Example("abcd", "1")) is None
    assert "its prompt has 5 tokens, over data.max_prompt_tokens=4" in check(Example("abcde", "1"))


# --- Ctrl-C in a hung reward call ------------------------------------------------------------


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_signal_while_a_reward_call_hangs_stops_the_wait_at_once(timeout):
    """With a time limit the call hangs on a worker thread while this thread waits; without
    one, on this thread: either way the first SIGINT ends the wait."""
    release = threading.Event()

    def hangs(completions, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(60)
        return [1.0] * len(completions)

    rs = reward_set(hangs, timeout=timeout)
    t0 = time.monotonic()
    with GracefulStop() as stop, pytest.raises(calls.Interrupted):
        rs.score(["x"], {}, ["p"])
    release.set()
    assert time.monotonic() - t0 < 10 and stop.signum == signal.SIGINT
    assert not calls.waiting()


# --- end to end ----------------------------------------------------------------------------------


def test_a_grpo_config_and_a_callback_written_for_trl(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback
    from trl import GRPOConfig

    seen = {}

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["args"] = (args.output_dir, args.logging_steps, args.max_steps,
                            args.num_generations, args.learning_rate, args.loss_type)  # fmt: skip

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.setdefault("logs", []).append((logs["learning_rate"], logs["epoch"]))

    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(output_dir=str(out), bf16=False, num_generations=4,
                          max_completion_length=8, max_steps=2,
                          learning_rate=1e-3, loss_type="grpo", logging_steps=5, seed=3,
                          save_steps=1, lr_scheduler_type="constant")  # fmt: skip
    settings = {k: v for k, v in _settings(tiny_model_dir, out).items()
                if not k.startswith(("run.", "train.steps", "rollout.group_size",
                                     "rollout.max_new_tokens"))}  # fmt: skip
    result = ibpo.train(args, settings, dataset=ROWS, reward_funcs=reward_module.parity,
                        callbacks=[Watch])  # fmt: skip
    assert result.status == "completed" and result.output_dir == out
    assert seen["args"] == (str(out), 1, 2, 4, 1e-3, "grpo")
    assert [lr for lr, _ in seen["logs"]] == [1e-3, 1e-3]
    epochs = [e for _, e in seen["logs"]]  # 2 of the 10 training rows a step
    assert epochs == pytest.approx([0.2, 0.4])
    recorded = yaml.safe_load((out / "config.yaml").read_text())  # ibpo's keys
    assert (recorded["rollout"]["group_size"], recorded["train"]["prompts_per_step"]) == (4, 2)
    assert (recorded["objective"]["name"], recorded["train"]["seed"]) == ("grpo", 3)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["learning_rate"] for m in lines if "step_time" in m] == [1e-3, 1e-3]


def _files(folder):
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


def test_a_stream_trains_resumes_and_a_failed_resume_leaves_the_run_alone(tiny_model_dir, tmp_path):
    drawn = []

    def parity(prompts, completions, **kwargs):
        drawn.append(prompts[::4])  # each group's prompt once
        return reward_module.parity(completions, prompts, **kwargs)

    out = tmp_path / "run"
    settings = {**_settings(tiny_model_dir, out, steps=2), "objective.name": "grpo"}
    result = ibpo.train(overrides=settings, dataset=_iterable(ROWS), reward_funcs=parity)
    assert result.status == "completed" and result.summary["eval_before"]["n"] == 2
    held = [r["question"] for r in ROWS[:2]]
    trained = [q for call in drawn for q in call if q not in held]
    assert trained[:4] == [r["question"] for r in ROWS[2:6]]  # in the stream's order
    # a resume without the rows: one line naming the fix, before anything loads
    before = _files(out)
    settings.update({"run.resume_from": "latest", "train.steps": 3})
    with pytest.raises(ConfigError, match="was trained on rows passed as dataset=, and they "
                       "were not passed again. Fix: pass the same rows"):  # fmt: skip
        ibpo.train(overrides=settings, reward_funcs=parity)
    # other rows than the run's: refused once the checkpoint is read, and nothing rewritten
    with pytest.raises(ConfigError, match="read its training rows as a stream"):
        ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=parity)
    assert _files(out) == before
    drawn.clear()
    again = ibpo.train(overrides=settings, dataset=_iterable(ROWS), reward_funcs=parity)
    assert again.status == "completed" and again.summary["steps"] == 3
    assert [q for call in drawn for q in call if q not in held][:2] == [
        r["question"] for r in ROWS[6:8]
    ]  # the third step's prompts are the stream's next rows


def test_the_first_ctrl_c_in_a_hung_reward_call_stops_the_run_at_once(tiny_model_dir, tmp_path):
    release, calls_made = threading.Event(), []

    def hangs_in_step_2(completions, **kwargs):
        calls_made.append(1)
        if len(calls_made) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            release.wait(120)
        return [float(len(c) % 2) for c in completions]

    out = tmp_path / "run"
    settings = {**_settings(tiny_model_dir, out, steps=3, eval_size=0), "objective.name": "grpo",
                "run.save_every": 0}  # fmt: skip
    handler, t0 = signal.getsignal(signal.SIGINT), time.monotonic()
    result = ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=hangs_in_step_2)
    release.set()
    s = result.summary
    assert time.monotonic() - t0 < 60
    assert (s["status"], s["exit_code"], s["steps"]) == ("interrupted", 130, 1)
    assert "interrupted in step 2's reward calls, which were abandoned" in s["message"]
    assert ckpt.latest_checkpoint(out / "checkpoints").name == "step-1"  # kept, as it stood
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert signal.getsignal(signal.SIGINT) == handler  # restored
