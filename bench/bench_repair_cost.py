"""The repair phase of the default run (`ibpo train`, the embedded demo), against itself.

    python bench/bench_repair_cost.py                       # 6 steps of the default run
    python bench/bench_repair_cost.py --steps 10 train.seed=1
    python bench/bench_repair_cost.py --smoke --model PATH  # tiny check (CI)

The run's own steps (the trainer's parts, `ibpo.step.rl_step`, every planned repair run:
repair.cost_share=1, repair.min_success=0) train as usual; at every step the repair phase of that
step (same rollout, same rewards, same planner state, same sampling stream) also runs under each
variant below, in an order that rotates from step to step. The step trains on the outcome of the
variant the configuration names (`--train-on`, default the first). Per variant and summed over
the steps:

    prompt      the repair prompts' tokens
    prefill     prompt tokens the model ran (a prefix shared by several prompts once)
    decode      tokens the repairs generated
    s prefill   seconds of the same prompts with one new token (the prompt forward)
    s generate  seconds of the generation (prompt forward + decoding)
    s decode    s generate - s prefill
    s grade     seconds of the rest of the repair phase (planning, prompts, grading, masks)
    s phase     s generate + s grade
    success     successful repairs / repairs

and each figure's ratio to the first variant's. The ratios are measured in one process on the same
inputs, so they hold on a machine busy with other work where the absolute seconds do not.

Variants (name: template, shared prefixes, reference selection):
    correct-first    the default template, shared prefixes on, correct references first (a
                     failed sibling is the reference where no sibling is correct): the default
                     before repair.reference_selection=correct_only
    correct-only     the default: a failed completion is repaired only against a correct sibling
    reference-first  as correct-first, the template the instruction, then the reference, then the
                     attempt
    unshared         correct-first, every prompt run whole (the cost before shared prefixes)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import build  # noqa: E402

from ibpo.config import DEFAULT_REPAIR_TEMPLATE  # noqa: E402

ATTEMPT_FIRST = DEFAULT_REPAIR_TEMPLATE
# the instruction, then the reference, then the attempt: every repair of a group shares the
# question and the instruction, and those that show the same reference share it too
REFERENCE_FIRST = (
    "{question}\n\n"
    "Below are two attempts at this problem. The second may contain a mistake. Repair it "
    "locally: keep every part of it that is right, change only what is wrong, and write the "
    "repaired second attempt in full.\n\n"
    "First attempt:\n{reference}\n\n"
    "Second attempt:\n{attempt}"
)
SMOKE = [
    "rollout.group_size=4",
    "train.prompts_per_step=2",
    "rollout.max_new_tokens=4",
    "model.quantization=none",
    "train.log_reference_kl=false",
    "objective.kl_coef=0.0",
    "reward.functions=tests.reward_module:parity",
]
FIGURES = ("prompt", "prefill", "decode", "s_prefill", "s_generate", "s_decode", "s_grade",
           "s_phase", "repairs", "successes", "repairs_correct_ref", "successes_correct_ref",
           "repairs_other_ref", "successes_other_ref")  # fmt: skip


def variants() -> dict[str, tuple[str, bool, str]]:
    return {
        "correct-first": (ATTEMPT_FIRST, True, "correct_first"),
        "correct-only": (ATTEMPT_FIRST, True, "correct_only"),
        "reference-first": (REFERENCE_FIRST, True, "correct_first"),
        "unshared": (ATTEMPT_FIRST, False, "correct_first"),
    }


class TimedGenerator:
    """A Generator that times its calls and, before each, the same prompts with one new token."""

    def __init__(self, generator, seconds: dict):
        self.generator, self.seconds = generator, seconds

    def __call__(self, tokenizer, prompts, num_samples, max_new_tokens, batch_size, **kw):
        with torch.random.fork_rng():  # the prompt forward alone draws nothing the real one sees
            t0 = time.perf_counter()
            self.generator(tokenizer, prompts, num_samples, 1, batch_size, **kw)
            self.seconds["s_prefill"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = self.generator(tokenizer, prompts, num_samples, max_new_tokens, batch_size, **kw)
        self.seconds["s_generate"] += time.perf_counter() - t0
        return out


def install(chosen: dict[str, tuple[str, bool, str]], train_on: str, totals: dict):
    """Wrap ibpo.step.run_repairs: each call runs every variant on the same inputs and returns the
    outcome of `train_on`, leaving the planner's rng as that variant left it."""
    import ibpo.step as step
    from ibpo.generation import hf_generator

    real = step.run_repairs
    turn = itertools.count()

    def measured(gen, examples, rollout, rewards, reward_fns, rep, rng, *args):
        model = gen.generator.args[0]  # hf_generator's partial: the policy
        names = list(chosen)
        k = next(turn) % len(names)
        result, after = None, None
        for name in names[k:] + names[:k]:
            template, share, selection = chosen[name]
            seconds = {"s_prefill": 0.0, "s_generate": 0.0}
            timed = TimedGenerator(hf_generator(model, share), seconds)
            plan = random.Random()
            plan.setstate(rng.getstate())
            with torch.random.fork_rng():  # every variant from the round's repair stream
                t0 = time.perf_counter()
                variant = replace(rep, template=template, reference_selection=selection)
                out = real(replace(gen, generator=timed), examples, rollout, rewards,
                           reward_fns, variant, plan, *args)  # fmt: skip
                wall = time.perf_counter() - t0 - seconds["s_prefill"]
            st, t = out.stats, totals[name]
            t["prompt"] += st["repair_prompt_tokens"]
            t["prefill"] += st["repair_prefill_tokens"]
            t["decode"] += st["repair_decode_tokens"]
            t["repairs"] += st["repairs"]
            t["successes"] += st["repair_successes"]
            t["s_prefill"] += seconds["s_prefill"]
            t["s_generate"] += seconds["s_generate"]
            t["s_decode"] += seconds["s_generate"] - seconds["s_prefill"]
            t["s_grade"] += wall - seconds["s_generate"]
            t["s_phase"] += wall
            for job, ok in zip(out.jobs, out.success):  # by the reference shown
                kind = "correct_ref" if rewards[job.group, job.reference] >= 1.0 else "other_ref"
                t[f"repairs_{kind}"] += 1
                t[f"successes_{kind}"] += float(ok)
            refs = {}
            for job in out.jobs:
                refs.setdefault(job.group, set()).add(job.reference)
            for group_refs in refs.values():
                key = f"groups_with_{len(group_refs)}_references"
                t[key] = t.get(key, 0.0) + 1
            if name == train_on:
                result, after = out, plan.getstate()
        rng.setstate(after)
        return result

    step.run_repairs = measured
    return real


def run(cfg, steps: int, chosen: dict, train_on: str) -> dict:
    import ibpo.step as step
    from ibpo.step import rl_step
    from ibpo.step_parts import StepParts

    r = build(cfg)
    parts = StepParts(r.model, r.optimizer, r.scheduler, r.stream, r.rng)
    totals = {name: dict.fromkeys(FIGURES, 0.0) for name in chosen}
    real = install(chosen, train_on, totals)
    try:
        for t in range(steps):
            m = rl_step(parts, r.tokenizer, r.accelerator, cfg, r.objective, step=t)
            print(f"step {t + 1}: reward {m['reward']:.3f}, repairs {m['repairs']:.0f}", flush=True)
    finally:
        step.run_repairs = real
    return totals


def table(totals: dict, steps: int) -> str:
    base = next(iter(totals.values()))
    head = "| variant | " + " | ".join(FIGURES[:8]) + " | success |"
    lines = [head, "|---" * 10 + "|"]
    for name, t in totals.items():
        cells = [f"{t[k] / steps:.0f}" if not k.startswith("s_") else f"{t[k] / steps:.2f}"
                 for k in FIGURES[:8]]  # fmt: skip
        rate = t["successes"] / t["repairs"] if t["repairs"] else 0.0
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {rate:.3f} |")
    ratio = ["| ratio to the first |"]
    for name, t in list(totals.items())[1:]:
        cells = [f"{t[k] / base[k]:.2f}" if base[k] else "-" for k in FIGURES[:8]]
        ratio.append(f"| {name} / {next(iter(totals))} | " + " | ".join(cells) + " | |")
    return "\n".join(lines + ["", "per step; ratios of the sums:"] + ratio[1:])


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="section.key=value, as for ibpo train")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variants", default="correct-first,correct-only,reference-first,unshared")
    p.add_argument("--train-on", default=None, help="the variant the steps train on (first)")
    p.add_argument("--model", default=None, help="model.name (default: the embedded model)")
    p.add_argument("--smoke", action="store_true", help="2 tiny steps (needs --model)")
    ns = p.parse_intermixed_args(argv)
    if ns.smoke and not ns.model:
        p.error("--smoke needs --model")
    return ns


def main(argv: list[str] | None = None) -> int:
    from ibpo.recipe import load_config

    ns = parse(argv)
    overrides = (SMOKE if ns.smoke else []) + list(ns.overrides)
    overrides += ["repair.cost_share=1", "repair.min_success=0"]  # every planned repair runs
    if ns.model:
        overrides.append(f"model.name={ns.model}")
    cfg = load_config(None, overrides)
    every = variants()
    names = [v.strip() for v in ns.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; variants: {list(every)}")
    chosen = {name: every[name] for name in names}
    train_on = ns.train_on or names[0]
    steps = 2 if ns.smoke else ns.steps
    with contextlib.redirect_stdout(sys.stderr):
        totals = run(cfg, steps, chosen, train_on)
    print(table(totals, steps))
    print(json.dumps({"steps": steps, "overrides": overrides, "train_on": train_on,
                      "variants": totals}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
