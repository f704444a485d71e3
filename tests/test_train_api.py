"""`ibpo.train` and your own rewards end to end on the tiny Qwen3 (CPU): (a) from Python with
an in-memory dataset and a reward reading an extra column, (b) from YAML with
reward.functions=module:function through the CLI; in both, IBPO's repairs and the held-out
evaluation are graded by that reward. A reward that raises mid-run ends the run with a
checkpoint, and the run resumes from it. The README's Python example runs as written (slow)."""

import json
import os
import re
from pathlib import Path

import pytest
import yaml

import ibpo
import ibpo.evaluation.evaluate as evaluate_mod
import ibpo.repair as repair_mod
from ibpo.cli import main as cli_main
from ibpo.config import ConfigError
from tests import reward_module

# one intra-op thread (conftest.one_thread), the real model's example included: on a busy
# machine a second thread stalls every op
pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


def _settings(model_dir, out, steps=2, eval_size=2):
    return {
        "model.name": model_dir,
        "model.quantization": "none",
        "train.steps": steps,
        "train.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 8,
        "rollout.eval_max_new_tokens": 4,
        "data.eval_size": eval_size,
        "repair.max_repairs_per_group": 1,
        "repair.template": "{question}|{attempt}|{reference}",
        "train.log_reference_kl": False,
        "run.save_every": 1,
        "run.output_dir": str(out),
    }


ROWS = [{"question": f"what is {i} + {j}?", "answer": str(i + j), "shift": (i * j) % 2}
        for i in range(4) for j in range(3)]  # fmt: skip


@pytest.fixture
def graded(monkeypatch):
    """The completions repairs and the held-out evaluation hand to the reward functions."""
    seen = {"repair": [], "eval": []}
    for where, module in (("repair", repair_mod), ("eval", evaluate_mod)):
        real = module.grade_completions

        def spy(reward_fns, examples, rendered, texts, *rest, _real=real, _where=where):
            seen[_where].append(list(texts))
            return _real(reward_fns, examples, rendered, texts, *rest)  # ids, tools as given

        monkeypatch.setattr(module, "grade_completions", spy)
    reward_module.CALLS.clear()
    return seen


def _graded_by_the_reward(texts: list[str]) -> bool:
    return any(call["completions"] == texts for call in reward_module.CALLS)


def test_python_api_with_rows_in_memory_and_a_reward_reading_a_column(
    tiny_model_dir, tmp_path, graded
):
    shifts = []

    def shifted(completions, shift, **kwargs):
        shifts.append(list(shift))
        return reward_module.parity(completions, shift=shift, **kwargs)

    out = tmp_path / "run"
    result = ibpo.train(
        overrides=_settings(tiny_model_dir, out), dataset=ROWS, reward_funcs=shifted
    )
    assert result.status == "completed" and result.summary["steps"] == 2
    assert result.adapter == out / "adapter" and (out / "adapter").is_dir()
    assert result.output_dir == out and result.summary["dataset"] == "in-memory"
    # the extra column reached the reward, one entry per completion (a row repeated G times)
    assert shifts and all(s in (0, 1) for call in shifts for s in call)
    assert any(len(call) == 8 and call[0:4] == [call[0]] * 4 for call in shifts)
    # the repairs were graded by it: every repair batch is one of its calls
    assert graded["repair"] and all(_graded_by_the_reward(t) for t in graded["repair"])
    # and the held-out evaluation, before and after
    assert len(graded["eval"]) == 2 and all(_graded_by_the_reward(t) for t in graded["eval"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= m["rewards/shifted"] <= 1.0 for m in lines if "step_time" in m)
    saved = (out / "config.yaml").read_text()
    assert "test_python_api_with_rows_in_memory_and_a_reward_reading_a_column" in saved


def test_yaml_names_a_reward_by_import_path(tiny_model_dir, tmp_path, graded, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "objective:\n  name: ibpo\n  reward: tests.reward_module:parity\n"
        f"data:\n  dataset: {data}\n"
    )
    args = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in
            _settings(tiny_model_dir, tmp_path / "run").items()]  # fmt: skip
    assert cli_main(["train", str(recipe), *args]) == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert said[-1].startswith("ibpo: ibpo on ") and "[completed]" in said[-1]
    assert not any(line.startswith("{") for line in said)  # the summary is in summary.json
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    calls = reward_module.CALLS
    assert calls and all({"shift", "answer", "completion_ids"} <= c["keys"] for c in calls)
    assert graded["repair"] and all(_graded_by_the_reward(t) for t in graded["repair"])
    assert graded["eval"] and all(_graded_by_the_reward(t) for t in graded["eval"])


def test_a_reward_that_raises_mid_run_ends_it_with_a_checkpoint(tiny_model_dir, tmp_path):
    calls = []

    def flaky(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) >= 2:  # from step 2 on (and when asked again, sample by sample)
            raise ConnectionError("verifier unreachable\nconnection refused")
        return [float(len(c) % 2) for c in completions]

    out = tmp_path / "run"
    settings = {**_settings(tiny_model_dir, out, steps=3, eval_size=0), "objective.name": "grpo"}
    result = ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=flaky)
    s = result.summary
    assert s["status"] == "reward_failed" and s["exit_code"] == 6 and s["steps"] == 1
    assert s["message"].startswith(
        "reward function 'flaky' raised on sample 0: ConnectionError: connection refused "
        f"(traceback: {out / 'errors.log'}) (step 2)"
    )
    # the whole exception is kept in the run folder: its traceback, its first line too
    log = (out / "errors.log").read_text()
    assert "Traceback (most recent call last)" in log and "in flaky" in log
    assert "ConnectionError: verifier unreachable\nconnection refused" in log
    assert Path(s["checkpoint"]).name == "step-1" and "run.resume_from=latest" in s["message"]
    # nothing lost: the fixed function resumes from the checkpoint to the end
    settings["run.resume_from"] = "latest"
    again = ibpo.train(
        overrides=settings, dataset=ROWS, reward_funcs=lambda completions, **k: [0.5] * 8
    )
    assert again.status == "completed" and again.summary["steps"] == 3


def test_trainer_state_logs_metric_names_a_completions_table_and_a_callback_that_stops(
    tiny_model_dir, tmp_path
):
    """A TRL user's habits from Python: a reward reading trainer_state, logging a metric and
    a table column; TRL's metric names; a callback stopping the run; the table resumes."""
    from transformers import TrainerCallback

    steps_seen, ends = [], []

    def staged(prompts, completions, shift, trainer_state, log_metric, log_extra, **kwargs):
        steps_seen.append((trainer_state.global_step, trainer_state.max_steps))
        log_metric("stage", float(trainer_state.global_step))
        log_extra("chars", [len(c) for c in completions])
        return [float((len(c) + s) % 2) for c, s in zip(completions, shift)]

    class StopAfterTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append((state.global_step, kwargs["metrics"]))
            control.should_training_stop = state.global_step == 2

    out = tmp_path / "run"
    settings = {**_settings(tiny_model_dir, out, steps=4), "objective.name": "grpo"}
    result = ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=staged,
                        callbacks=[StopAfterTwo()])  # fmt: skip
    s = result.summary
    assert s["status"] == "stopped" and s["exit_code"] == 0 and s["steps"] == 2
    assert s["eval_after"]["n"] == 2 and s["prompt_template"] is None  # the prompts as given
    # rollouts of steps 1 and 2 saw the steps done before them
    assert {step for step, _ in steps_seen} >= {0, 1} and all(m == 4 for _, m in steps_seen)
    assert [step for step, _ in ends] == [1, 2]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step_lines = [m for m in lines if "step_time" in m]
    trl_names = {"rewards/staged/mean", "rewards/staged/std", "reward", "reward_std",
                 "frac_reward_zero_std", "completions/mean_length",
                 "completions/clipped_ratio"}  # fmt: skip
    assert all(trl_names | {"stage", "rewards/staged", "reward_timeouts", "unscored"} <= set(m)
               for m in step_lines)  # fmt: skip
    assert trl_names <= set(ends[0][1]) and step_lines[0]["reward_timeouts"] == 0
    table = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [1] * 8 + [2] * 8  # B * G completions a step
    row = table[0]
    assert row["prompt"] in {r["question"] for r in ROWS} and row["extra"]["chars"] >= 0
    assert row["rewards"]["staged"] == row["reward"] and "advantage" in row
    assert [r["group"] for r in table[:8]] == [0] * 4 + [1] * 4
    # resumed from step 2 with more steps: the table goes on from there
    settings.update({"run.resume_from": "latest", "train.steps": 3})
    again = ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=staged)
    assert again.status == "completed" and again.summary["steps"] == 3
    table = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [1] * 8 + [2] * 8 + [3] * 8


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"<!-- python-example -->\n```python\n(.*?)```", text, re.S)
    return block


@pytest.mark.slow
def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    result = scope["result"]
    assert result.status == "completed" and result.adapter.is_dir()
    lines = (result.output_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if "step_time" in x]
    assert steps and all("rewards/math" in m and "rewards/brief" in m for m in steps)


def test_a_config_and_a_mapping_of_overrides_load_as_a_recipe_and_key_value_pairs_do():
    from ibpo.config import ConfigError
    from ibpo.recipe import load_config

    base = load_config(None, ["objective.name=grpo", "train.steps=7"])
    cfg = load_config(
        base, {"objective.name": "dapo", "repair.template": "{question}:{attempt}:{reference}"}
    )
    assert cfg.train.steps == 7 and cfg.objective.name == "dapo"
    assert cfg.rollout.dynamic_sampling  # inherited afresh from the new objective, not grpo's
    assert cfg.repair.template == "{question}:{attempt}:{reference}"  # as given, not YAML text
    with pytest.raises(ConfigError, match="unknown key 'train.stepz'"):
        load_config(None, {"train.stepz": 1})
    with pytest.raises(ConfigError, match="dataset= takes rows"):
        ibpo.train(dataset="rows.jsonl")


PRINTS_1 = "```python\nprint(1)\n```"
PRINTS_1_SPEC = json.dumps({"tests": [{"input": "", "output": "1"}]})


def _runs_code(modes):
    """A reward of the user's that runs tested code itself, in each of `modes` (None: the
    sandbox's default); the completions' text does not matter here."""
    from ibpo.rewards.code import grade_code

    def runs_code(completions, **kwargs):
        scores = [grade_code(PRINTS_1, PRINTS_1_SPEC, mode=m)["reward"] for m in modes]
        return [min(scores)] * len(completions)

    return runs_code


def test_tested_code_a_user_s_reward_runs_is_held_to_the_run_s_sandbox_policy(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Not only the reward named `code`: socket-patch is refused wherever tested code runs
    during training, and summary.json names the modes tests actually ran in."""
    from ibpo.sandbox import memory
    from ibpo.sandbox import run as sandbox

    if os.geteuid() == 0:  # as root socket-patch runs as a slot uid (else it is refused anyway)
        monkeypatch.setattr(sandbox, "_world_readable", lambda path: True)
    settings = {**_settings(tiny_model_dir, tmp_path / "b", steps=1, eval_size=0)}
    settings["objective.name"] = "grpo"
    if memory.memory_mode() == "per-process":  # refused for that first (tested in test_trainer)
        settings["reward.sandbox"] = "allow_per_process_memory"
    refused = _runs_code([None, "socket-patch"])
    s = ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=refused).summary
    assert s["status"] == "reward_failed" and s["steps"] == 0
    assert s["message"].startswith(
        "reward function 'runs_code' ran tested code: the sandbox's socket-patch mode does not "
        "contain the programs it runs"
    )
    assert "reward.sandbox=allow_socket_patch" in s["message"]

    settings["run.output_dir"] = str(tmp_path / "c")
    settings["reward.sandbox"] = "allow_socket_patch"
    s = ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=refused).summary
    assert s["status"] == "completed"
    assert s["isolation"] == ", ".join(dict.fromkeys([sandbox.isolation_mode(), "socket-patch"]))


def test_a_lora_config_and_held_out_rows_from_python(tiny_model_dir, tmp_path):
    """TRL's peft_config= and eval_dataset=: the LoraConfig is the adapter's (rsLoRA, DoRA,
    modules_to_save), the held-out rows are evaluated, nothing carved out of training."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True,
                      use_dora=True, modules_to_save=["lm_head"])  # fmt: skip
    held = [{"question": f"what is {i} * 2?", "answer": str(2 * i)} for i in range(3)]
    out = tmp_path / "run"
    settings = {**_settings(tiny_model_dir, out, steps=1, eval_size=5), "objective.name": "grpo"}
    result = ibpo.train(
        overrides=settings,
        dataset=ROWS,
        reward_funcs=reward_module.parity,
        eval_dataset=held,
        peft_config=lora,
    )
    assert result.status == "completed"
    assert result.summary["eval_before"]["n"] == 3 == result.summary["eval_after"]["n"]
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["use_rslora"], saved["use_dora"]) == (
        4, 8, True, True,
    )  # fmt: skip
    assert saved["modules_to_save"] == ["lm_head"]
    assert sorted(saved["target_modules"]) == ["q_proj", "v_proj"]
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["model"]["lora_r"] == 4
    assert recorded["data"]["eval"]["dataset"] == "in-memory"
    with pytest.raises(ConfigError, match="peft_config= is a dict; ibpo trains LoRA adapters"):
        ibpo.train(overrides=settings, dataset=ROWS, peft_config={"r": 4})
    with pytest.raises(ConfigError, match="held-out rows were given in Python"):
        ibpo.train(overrides={**settings, "data.eval.dataset": "in-memory"}, dataset=ROWS)


def test_a_resume_without_the_rows_says_to_pass_them_and_changes_no_file(tiny_model_dir, tmp_path):
    """A run trained on rows passed as dataset= resumes only with them: without them one clear
    error, with other rows the checkpoint's stream refuses them; either way the run's files
    (its config.yaml first) are as the finished run left them."""
    out = tmp_path / "run"
    settings = {**_settings(tiny_model_dir, out, steps=1, eval_size=0), "objective.name": "grpo"}
    reward = lambda completions, **k: [float(len(c) % 2) for c in completions]  # noqa: E731
    assert ibpo.train(overrides=settings, dataset=ROWS, reward_funcs=reward).status == "completed"
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = {**settings, "run.resume_from": "latest", "train.steps": 2}
    with pytest.raises(ConfigError, match=r"trained on rows passed as dataset=.*same rows"):
        ibpo.train(overrides=again, reward_funcs=reward)
    with pytest.raises(ConfigError, match="resume with the same data settings"):
        ibpo.train(overrides=again, dataset=ROWS[:5], reward_funcs=reward)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    resumed = ibpo.train(overrides=again, dataset=ROWS, reward_funcs=reward)
    assert resumed.status == "completed" and resumed.summary["steps"] == 2
