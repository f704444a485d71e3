"""What multi-turn rollouts with tool calls cost (generation/multiturn.py), on CPU: a tiny Qwen3
(random weights, the character tokenizer of tests/tool_script.py) whose even rows' first turn
is a scripted call of the sandboxed python tool (the rest sampled freely: the odd rows answer at
once, at their own lengths), decoded with HF
generate (rollout.decode=eager) and with the package's engine (rollout.decode=graph, eager
calls on CPU), beside the same rows decoded in one turn without tools.

Printed per variant (median wall seconds of --repeat calls, after one warm-up): the rounds
(generate calls per slice), decode row-steps (every row counts every step of its call:
Rollout.decode_slots), the tokens the policy wrote, the share of row-steps spent on rows that
had ended (idle), and the prompt tokens run (each round re-runs every live row's whole
context: the hf backend keeps no KV cache across rounds). The batch syncs at tool boundaries;
what that costs is read from the rollouts themselves: `steps` is the decode steps the sync
design ran (each round as long as its longest turn), `no stall` the steps a design in which a
row goes on as soon as its tool returns would need at best (the longest row's turns one after
another, tools taken as instant).

    python bench/bench_tool_rollouts.py [--rows 16] [--budget 120] [--repeat 3]
Not here: GPU timings (bench_decode.py), the sandbox's own cost (bench_graders.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ibpo.config import DataConfig  # noqa: E402
from ibpo.data.example import Example  # noqa: E402
from ibpo.generation import generate  # noqa: E402
from ibpo.generation.decode import DecodeEngine  # noqa: E402
from ibpo.generation.multiturn import ToolRollouts  # noqa: E402
from ibpo.tools import resolve_tools  # noqa: E402
from tests.tool_script import ScriptedTurns, call_text, tool_model, tool_tokenizer  # noqa: E402


class EvenRowsCall(ScriptedTurns):
    """The script's turns for the even rows of the first round only (every row is live then, at
    its index); later rounds hold the calling rows alone, in their second, free, turn."""

    first_rows: int | None = None

    def __call__(self, input_ids, scores):
        if self.first_rows is None:
            self.first_rows = len(input_ids)
        if len(input_ids) != self.first_rows:
            return scores
        odd = scores[1::2].clone()
        scores = super().__call__(input_ids, scores)
        scores[1::2] = odd
        return scores


def turn_lengths(mask: list[float]) -> list[int]:
    """A row's policy turns' lengths: the runs of 1 in its completion mask."""
    runs, n = [], 0
    for m in mask + [0.0]:
        if m:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    return runs


def steps(ro) -> tuple[int, int]:
    """(decode steps of the sync design, of a design where no row waits for another)."""
    turns = [turn_lengths(row) for row in ro.completion_mask.tolist()]
    rounds = max(len(t) for t in turns)
    sync = sum(max((t[k] for t in turns if len(t) > k), default=0) for k in range(rounds))
    return sync, max(sum(t) for t in turns)


def measure(fn, repeat: int):
    fn()  # warm-up
    times, out = [], None
    for k in range(repeat):
        torch.manual_seed(k)
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--budget", type=int, default=120)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = tool_tokenizer()
    model = tool_model(tok).eval()
    turns = [call_text("python", code="print(6*7)"), None]
    problem = Example(question="what is 6*7?", answer="42")
    rows = []
    for name, engine in (("tools, hf generate", None), ("tools, engine", DecodeEngine(model))):
        gen = ToolRollouts(model, resolve_tools(["python"]), 4, 4, 10.0, engine=engine)
        prompt = gen.render(tok, problem, DataConfig(prompt_template=None))

        def call(gen=gen, prompt=prompt):
            script = EvenRowsCall(tok, turns)
            return gen(tok, [prompt], args.rows, args.budget, args.rows, logits_processor=[script])

        rows.append((name, *measure(call, args.repeat)))
    text = tok.apply_chat_template([{"role": "user", "content": "what is 6*7?"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip

    def single():
        return generate(model, tok, [text], args.rows, args.budget, args.rows)

    rows.append(("one turn, no tools", *measure(single, args.repeat)))
    print(f"{args.rows} rows, {args.budget} tokens each at most, {torch.get_num_threads()} thread")
    print(f"{'variant':<22}{'s':>8}{'rounds':>7}{'row-steps':>11}{'policy tok':>12}"
          f"{'idle':>7}{'prompt tok':>12}{'steps':>7}{'no stall':>10}")  # fmt: skip
    for name, seconds, ro in rows:
        policy = sum(ro.host_policy_lengths())  # the tokens decoded; tool tokens are appended
        slots = ro.decode_slots or 0
        idle = 1 - policy / slots if slots else float("nan")
        traces = ro.tool_traces or [None]
        turns = max(1 if t is None else sum(m["role"] == "assistant" for m in t.messages)
                    for t in traces)  # fmt: skip
        print(f"{name:<22}{seconds:>8.2f}{turns:>7}{slots:>11}{policy:>12}{idle:>7.1%}"
              f"{ro.prefill_tokens or 0:>12}{steps(ro)[0]:>7}{steps(ro)[1]:>10}")  # fmt: skip


if __name__ == "__main__":
    main()
