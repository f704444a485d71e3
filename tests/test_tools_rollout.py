"""Multi-turn rollouts with tool calls on a tiny Qwen3, its turns scripted by a logits
processor (tests/tool_script.py): the conversation, the policy-token mask and what each
consumer of it sees, the behaviour log-probs against one forward over the whole conversation,
rewards reading the conversation, bad tool input, and a training run that resumes mid-run."""

import logging

import pytest
import torch

from ibpo.algo.advantages import token_advantages
from ibpo.algo.cancellation import cancellation_residual
from ibpo.batching import micro_batches
from ibpo.config import DataConfig
from ibpo.data.example import Example
from ibpo.generation.multiturn import ToolRollouts, tool_columns
from ibpo.logprobs import completion_logprobs
from ibpo.recipe import load_config, resolve_params
from ibpo.rewards.functions import builtin, grade_completions, reward_set
from ibpo.step import micro_batch_loss, repairs_enabled
from ibpo.step_parts import ScoredBatch
from ibpo.tools import resolve_tools
from tests.tool_script import ScriptedTurns, call_text, tool_model, tool_tokenizer

# tiny models: one intra-op thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

PROBLEM = Example(question="what is 6*7?", answer="42")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def boom(x: int) -> str:
    """Fail.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool broke")


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tool_model(tok).eval()


def rollout(model, tok, turns, G=2, budget=90, max_calls=4, tools=("python",), fns=None, seed=0):
    gen = ToolRollouts(model, resolve_tools(list(tools), fns), max_calls, 4, 10.0)
    prompt = gen.render(tok, PROBLEM, DataConfig(prompt_template=None))
    torch.manual_seed(seed)
    out = gen(tok, [prompt], G, budget, 8, logits_processor=[ScriptedTurns(tok, turns)])
    return out, prompt


def test_a_call_runs_and_its_result_is_a_tool_turn_the_policy_reads(model, tok):
    call = call_text("python", code="print(6*7)")
    ro, prompt = rollout(model, tok, [call, "the answer is 42"])
    assert "<system>tools: python<eos>" in prompt  # the template described the tool
    for i in range(2):
        trace = ro.tool_traces[i]
        assert (trace.calls, trace.errors) == (1, 0)
        assert trace.messages == [
            {
                "role": "assistant",
                "content": call,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "python", "arguments": {"code": "print(6*7)"}},
                    }
                ],
            },
            {"role": "tool", "name": "python", "content": "42"},
            {"role": "assistant", "content": "the answer is 42"},
        ]
        ids, mask = ro.tokens[i], ro.completion_mask[i].tolist()
        n = len(ids)
        policy = [t for t, m in zip(ids, mask) if m]
        tool = [t for t, m in zip(ids, mask[:n]) if not m]
        # the policy wrote its two turns, each closed by its EOS; the tool turn is the template's
        assert tok.decode(policy) == call + "<eos>the answer is 42<eos>"
        assert tok.decode(tool) == "\n<tool>42<eos><assistant>"
        assert mask[n:] == [0.0] * (len(mask) - n)
        assert ro.attention_mask[i, ro.prompt_len :].tolist() == [1] * n + [0] * (len(mask) - n)
        assert ro.policy_lengths[i] == len(policy) and not ro.host_truncated()[i]
        # behaviour log-probs: the forced tokens were drawn with probability 1, tool tokens 0
        assert ro.logprobs[i].abs().max().item() == 0.0


def test_behaviour_logprobs_match_one_forward_over_the_conversation(model, tok):
    """The second turn is sampled freely after the tool's turn: its log-probs as decoding
    drew them equal the trainer's single forward over prompt + turn + tool turn + turn."""
    ro, _ = rollout(model, tok, [call_text("python", code="print(6*7)"), None], G=3, budget=90)
    lp, _ = completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask
    )
    first = len(tok(call_text("python", code="print(6*7)"))["input_ids"]) + 1  # + its EOS
    free = ro.completion_mask.clone()
    free[:, :first] = 0  # the scripted turn was forced: its draws had probability 1
    tool_len = len(tok("\n<tool>42<eos><assistant>")["input_ids"])
    assert free.sum(-1).min() > 0 and (ro.completion_mask[:, first : first + tool_len] == 0).all()
    assert torch.allclose(lp * free, ro.logprobs * free, atol=1e-5)
    assert (ro.logprobs[ro.completion_mask == 0] == 0).all()
    assert (lp[ro.completion_mask == 0] == 0).all()


def test_loss_kl_mismatch_and_cancellation_see_only_the_policys_tokens(model, tok):
    """What the tool turn holds (behaviour and reference log-probs there) changes nothing the
    update computes; the cancellation statistic counts the policy's tokens only."""
    G = 2
    ro, _ = rollout(model, tok, [call_text("python", code="print(6*7)"), None], G=G, budget=90)
    cfg = load_config(
        None,
        [
            "objective.name=grpo",
            "objective.kl_coef=0.1",
            "objective.importance_sampling=truncate",
            f"rollout.group_size={G}",
        ],
    )
    objective = resolve_params(cfg.objective)
    seq_adv = torch.tensor([1.0, -1.0])
    adv = token_advantages(seq_adv, ro.completion_mask, None, 1.0)
    (mb,) = micro_batches(ro, G, 1)
    tool = (ro.completion_mask == 0).float()
    ref = -torch.rand(ro.completion_mask.shape)
    results = []
    for garble in (0.0, 50.0):
        batch = ScoredBatch(ro, torch.tensor([[1.0, 0.0]]), seq_adv, adv)
        ro.logprobs = ro.logprobs + garble * tool
        loss, info, coef, a = micro_batch_loss(
            model, mb, batch, old=None, ref=mb.take(ref + garble * tool), norm=10.0, cfg=cfg,
            objective=objective,
        )  # fmt: skip
        cancel = cancellation_residual(coef, a, mb.tokens, G, mb.completion_mask)
        results.append((loss.item(), {k: float(v) for k, v in info.items()}, cancel))
    (l0, i0, c0), (l1, i1, c1) = results
    assert l0 == pytest.approx(l1, abs=1e-6)
    for key in ("kl", "mismatch_kl", "is_weight_mean", "entropy"):
        assert i0[key] == pytest.approx(i1[key], abs=1e-6), key
    assert float(c0["tokens"]) == sum(ro.policy_lengths)  # tool tokens are no trie members
    assert float(c0["tokens"]) < sum(ro.lengths)
    # the normaliser of token_mean counts the policy's tokens (step.global_normaliser's input)
    assert ro.host_policy_lengths() == ro.completion_mask.sum(-1).long().tolist()


def test_repairs_are_off_for_tool_rollouts_with_one_line(caplog):
    cfg = load_config(None, ["objective.name=ibpo", "rollout.tools=[python]"])
    objective = resolve_params(cfg.objective)
    assert cfg.repair.enabled  # IBPO repairs, but not rollouts that call tools
    with caplog.at_level(logging.WARNING, logger="ibpo.step"):
        assert repairs_enabled(cfg, objective) is False
        assert repairs_enabled(cfg, objective) is False
    said = [r.message for r in caplog.records if "repairs are off" in r.message]
    assert len(said) <= 1  # once per process (an earlier test may have said it)
    plain = load_config(None, ["objective.name=ibpo"])
    assert repairs_enabled(plain, resolve_params(plain.objective)) is True


def test_rewards_see_the_conversation_and_the_tool_columns(model, tok):
    ro, prompt = rollout(
        model, tok, [call_text("add", a=6, b=7), call_text("boom", x=1), "the answer is 13"],
        tools=(), fns=[add, boom], budget=300,
    )  # fmt: skip
    seen = {}

    def spy(completions, tool_calls, tool_errors, **kwargs):
        seen.update(completions=completions, calls=tool_calls, errors=tool_errors)
        return [0.5] * len(completions)

    spy_set = reward_set(spy)
    each = [PROBLEM] * ro.num_sequences
    grades = grade_completions(
        spy_set, each, [prompt] * 2, ro.texts, ro.host_tokens(), tool_columns(ro.tool_traces)
    )
    assert grades.totals == [0.5, 0.5]
    assert seen["calls"] == [2, 2] and seen["errors"] == [1, 1]
    chat = seen["completions"][0]
    assert [m["role"] for m in chat] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert chat[1]["content"] == "13"
    assert chat[3]["content"] == "Error: tool 'boom' raised RuntimeError: the tool broke"
    # a reward for the final answer reads the last assistant turn, not the tools' results
    math = reward_set(builtin("math"))
    wrong = Example(question="what is 6+7?", answer="14")  # the tool's 13 is not the answer
    g = grade_completions(
        math, [wrong] * 2, [prompt] * 2, ro.texts, ro.host_tokens(), tool_columns(ro.tool_traces)
    )
    assert g.totals == [0.0, 0.0]
    g = grade_completions(
        math, each, [prompt] * 2, ro.texts, ro.host_tokens(), tool_columns(ro.tool_traces)
    )
    assert g.totals == [0.0, 0.0]  # "the answer is 13" against 42


def test_bad_calls_in_a_rollout_are_errors_the_model_reads_and_the_call_limit_ends_it(model, tok):
    bad = '<tool_call>{"name":"add","arguments":{"a":1,}</tool_call>'
    ro, _ = rollout(
        model, tok, [bad, call_text("add", a=1, b=2), call_text("add", a=2, b=2), "x"],
        G=1, max_calls=2, tools=(), fns=[add], budget=400,
    )  # fmt: skip
    trace = ro.tool_traces[0]
    tool_turns = [m["content"] for m in trace.messages if m["role"] == "tool"]
    assert tool_turns[0].startswith("Error: the tool call is not valid JSON")
    assert "tool_calls" not in trace.messages[0]  # an unreadable call is text, not a call
    assert tool_turns[1] == "3"
    # the third turn's call is past max_tool_calls=2: the completion ends there
    assert (trace.calls, trace.errors) == (2, 1) and len(tool_turns) == 2
    assert trace.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 2}
    assert not ro.host_truncated()[0]


def test_the_token_budget_cuts_a_tool_turn_and_counts_tool_tokens(model, tok):
    call = call_text("add", a=1, b=2)
    n_call = len(tok(call)["input_ids"]) + 1
    ro, _ = rollout(model, tok, [call, "done"], G=1, tools=(), fns=[add], budget=n_call + 3)
    assert ro.lengths == [n_call + 3] and ro.host_truncated() == [True]
    assert ro.policy_lengths == [n_call]  # the rest is the tool turn, cut at the budget


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tiny-tool-qwen3")
    tool_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


class _Scripted(ToolRollouts):
    """ToolRollouts whose rows' first turn is a scripted python call (the rest sampled)."""

    def __call__(self, tokenizer, *args, **kwargs):
        script = ScriptedTurns(tokenizer, [call_text("python", code="print(6*7)"), None])
        kwargs["logits_processor"] = [*(kwargs.get("logits_processor") or []), script]
        return super().__call__(tokenizer, *args, **kwargs)


def _train(model_dir, out, steps, monkeypatch, resume=False):
    """ibpo.train with the python tool, each rollout's first turn a scripted call."""
    import ibpo
    from ibpo import step as step_mod

    monkeypatch.setattr(step_mod, "ToolRollouts", _Scripted)
    settings = {
        "model.name": model_dir,
        "model.quantization": "none",
        "train.steps": steps,
        "train.prompts_per_step": 1,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 70,
        "rollout.eval_max_new_tokens": 70,
        "data.eval_size": 2,  # answered with the tools too: odd_answer checks
        "train.log_reference_kl": False,
        "run.save_every": 1,
        "run.output_dir": str(out),
        **({"run.resume_from": "latest"} if resume else {}),
    }
    rows = [{"question": f"what is {i}*7?", "answer": str(i * 7)} for i in range(6)]
    return ibpo.train(overrides=settings, dataset=rows, reward_funcs=odd_answer, tools=["python"])


def odd_answer(completions, tool_calls, **kwargs):
    """A reward with signal on the tiny model: the parity of the final turn's length, read
    from the conversation the rollout's completions are."""
    assert all(c[1]["role"] == "tool" and c[1]["content"] == "42" for c in completions)
    return [float(len(c[-1]["content"]) % 2) for c in completions]


def _lines(run):
    import json

    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_tools_trains_logs_its_calls_and_resumes_mid_run_exactly(
    tool_model_dir, tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    ref = _train(tool_model_dir, tmp_path / "ref", 2, monkeypatch)
    assert ref.status == "completed" and ref.summary["steps"] == 2
    assert ref.summary["eval_after"] is not None  # held out with the tools (odd_answer checks)
    metrics = _lines(tmp_path / "ref")
    assert [m["tool_calls"] for m in metrics] == [2.0, 2.0]  # one call per completion
    assert all(m["tool_errors"] == 0.0 and m["tool_tokens"] > 0 for m in metrics)
    assert all("repairs" not in m or m["repairs"] == 0 for m in metrics)  # ibpo: repairs off
    # stopped after step 1, then resumed from its checkpoint: the same adapter and metrics
    first = _train(tool_model_dir, tmp_path / "run", 1, monkeypatch)
    assert first.status == "completed"
    again = _train(tool_model_dir, tmp_path / "run", 2, monkeypatch, resume=True)
    assert again.status == "completed" and again.summary["steps"] == 2
    got = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    want = load_file(tmp_path / "ref" / "adapter" / "adapter_model.safetensors")
    assert any(want[k].abs().sum() > 0 for k in want if "lora_B" in k)  # it did learn
    assert all(torch.equal(got[k], want[k]) for k in want)
    resumed = _lines(tmp_path / "run")
    assert [m["loss"] for m in resumed] == [m["loss"] for m in metrics]


def test_the_decode_engine_gives_the_tool_rollouts_hf_generate_gives(model, tok):
    """rollout.decode=graph with tools: each turn decoded by the package's engine (eager on
    CPU) from the whole context, the same tokens, conversation and behaviour log-probs."""
    from ibpo.generation.decode import DecodeEngine

    turns = [call_text("python", code="print(6*7)"), None]
    out = {}
    for name, engine in (("hf", None), ("engine", DecodeEngine(model))):
        gen = ToolRollouts(model, resolve_tools(["python"]), 4, 4, 10.0, engine=engine)
        prompt = gen.render(tok, PROBLEM, DataConfig(prompt_template=None))
        torch.manual_seed(5)
        out[name] = gen(tok, [prompt], 3, 90, 8, logits_processor=[ScriptedTurns(tok, turns)])
    hf, eng = out["hf"], out["engine"]
    assert hf.tokens == eng.tokens and torch.equal(hf.completion_mask, eng.completion_mask)
    assert [t.messages for t in hf.tool_traces] == [t.messages for t in eng.tool_traces]
    assert torch.allclose(hf.logprobs, eng.logprobs, atol=1e-4)
    assert eng.tool_traces[0].calls == 1


def test_the_math_evaluation_scripts_take_tools_and_report_calls_per_problem(
    tool_model_dir, tmp_path, monkeypatch
):
    import json
    import runpy
    from pathlib import Path

    from ibpo.evaluation import cli as eval_cli

    monkeypatch.setattr(eval_cli, "ToolRollouts", _Scripted)  # each answer's first turn calls
    root = Path(__file__).resolve().parents[1]
    script = runpy.run_path(str(root / "scripts" / "eval_math500.py"), run_name="eval_script")
    out = tmp_path / "eval"
    args = [
        *("--model", tool_model_dir, "--quantization", "none", "--tools", "python"),
        *("--data", str(root / "tests/fixtures/benchmarks/math500.jsonl"), "--limit", "2"),
        *("--n", "2", "--max-new-tokens", "80", "--output-dir", str(out), "--no-progress"),
    ]  # fmt: skip
    assert script["run"](args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tools"] == ["python"] and summary["max_tool_calls"] == 4
    assert summary["tool_calls_per_problem"] == 1.0 and summary["tool_errors"] == 0
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:
        chat = s["conversation"]
        assert chat[1] == {"role": "tool", "name": "python", "content": "42"}
        assert s["completion"] == chat[-1]["content"]  # what was graded: the last turn
        assert s["length"] > len(chat[0]["content"])  # every turn's tokens
