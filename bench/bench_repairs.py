"""Repairability bench: how often the policy repairs its own failures, and how locally.

For the embedded model (SmolLM2-135M-Instruct, fp32 on CPU) or any --model, on held-out problems
of builtin:mixed: sample G completions per problem, grade them, then run the repairs of
ibpo/repair.py on the same groups under each variant (repair budget, reference selection, K,
template), over several seeds. Per variant it prints the repair success rate with a 95% Wilson
interval, the locality (share of the attempt's tokens its most local successful repair kept, i.e.
1 - the edited fraction), and the repair phase's prefill / decode tokens and seconds. A template
that succeeds by rewriting from scratch shows a low locality beside its success.

Templates (all user turns, as repair.template):
  default          today's repair.template (keep what is right, change only what is wrong)
  reference_first  the instruction, then the reference, then the attempt (as `head`, with the
                   two swapped): a group's repairs share the question and the instruction,
                   those that show the same reference share it too; only the attempt is each
                   prompt's own
  terse            a short instruction with the same three fields
  rewrite          asks for a fresh solution: the from-scratch baseline that locality must expose
  head             today's instruction and fields, the instruction before the attempts: the
                   question and instruction are then a prefix every repair of a group shares
                   (generate's share_prefixes runs it once), so only the two attempts are each
                   prompt's own

Beside each variant's own figures: its success against the default's on the same failed
completions (paired: those both repaired; `better` / `worse` count the completions only one of
the two repaired successfully, with an exact two-sided sign test on them), and the success of
repairs that showed a correct reference apart from those that showed another failed one.

`--replay DIR` instead replays the repair spending rule (ibpo/algo/spending.py) over the
per-step repair logs (metrics.jsonl: repairs, repair_success_rate) of every IBPO run under DIR,
for each floor and probe interval of `--floors` and `--probes`: a step the rule would spend on
takes the recorded step's repairs and successes, a skipped one takes none. It prints the share of
steps that repaired, of the repairs run and of the successful repairs kept. A replay, not a
rerun: a run that skipped repairs would have trained, and sampled, otherwise after the first skip.

Not here: training, or choosing a default (docs/repairs.md records what a measurement chose).

    python bench/bench_repairs.py                 # embedded model, default grid
    python bench/bench_repairs.py --model DIR --seeds 0 1 2
    python bench/bench_repairs.py --quick --model TINY_DIR   # smoke run
    tar -xJf studies/crn11.tar.xz                                 # the 11-seed study's runs, then
    python bench/bench_repairs.py --replay docs/study/crn11/runs   # the spending rule, replayed
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ibpo.algo.spending import SKIP, SpendingState, decide, observe
from ibpo.config import DEFAULT_REPAIR_TEMPLATE, DataConfig, RepairConfig
from ibpo.data import builtin_examples, render_prompt
from ibpo.generation import hf_generator
from ibpo.repair import RepairGeneration, run_repairs
from ibpo.rewards.functions import grade_completions, reward_set

TEMPLATES = {
    "default": DEFAULT_REPAIR_TEMPLATE,
    "terse": (
        "{question}\n\nAttempt:\n{attempt}\n\nReference:\n{reference}\n\n"
        "Fix the attempt's mistake with the smallest change and write it out in full."
    ),
    "reference_first": (
        "{question}\n\n"
        "Below are two attempts at this problem. The second may contain a mistake. Repair it "
        "locally: keep every part of it that is right, change only what is wrong, and write the "
        "repaired second attempt in full.\n\n"
        "First attempt:\n{reference}\n\n"
        "Second attempt:\n{attempt}"
    ),
    "head": (
        "{question}\n\nBelow are two attempts at this problem. The first may contain a mistake. "
        "Repair it locally: keep every part of it that is right, change only what is wrong, and "
        "write the repaired first attempt in full.\n\nFirst attempt:\n{attempt}\n\n"
        "Second attempt:\n{reference}"
    ),
    "rewrite": (
        "{question}\n\nA worked solution:\n{reference}\n\n"
        "Solve the problem from scratch. (Earlier attempt, for reference: {attempt})"
    ),
}


def variants(budget: int, quick: bool) -> list[tuple[str, RepairConfig, int, bool]]:
    """(name, repair config, max_new_tokens, shared prefixes) per variant; the first is today's
    default. `unshared` is the default with generate's share_prefixes=False: the same repairs, the
    cost without the sharing, measured in the same run."""
    base = RepairConfig(enabled=True)
    out = [(f"default budget={budget}", base, budget, True)]
    if quick:
        return out + [("template=terse", replace(base, template=TEMPLATES["terse"]), budget, True)]
    out.append(("unshared", base, budget, False))
    out.append((f"budget={budget // 2}", base, budget // 2, True))
    out.append(("reference=random", replace(base, reference_selection="random"), budget, True))
    out.append(("K=3", replace(base, references=2), budget, True))
    for name in ("reference_first", "terse", "head", "rewrite"):
        out.append((f"template={name}", replace(base, template=TEMPLATES[name]), budget, True))
    return out


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (0, 1 with no trials)."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def load(model_dir: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir is None:
        from ibpo.embedded import embedded_model_path

        model_dir = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


def bench(ns: argparse.Namespace) -> dict:
    model, tok = load(ns.model)
    generators = {share: hf_generator(model, share) for share in (True, False)}
    reward_fns = reward_set("math")
    generator = generators[True]
    data = DataConfig(dataset="builtin:mixed")
    problems = builtin_examples("mixed", "test")
    sampling = dict(temperature=1.0, top_p=1.0)
    gen = dict(sampling, batch_size=ns.batch_size)
    chosen = variants(ns.budget, ns.quick)
    if ns.variants:
        wanted = [v.strip() for v in ns.variants.split(",") if v.strip()]
        unknown = sorted(set(wanted) - {v[0] for v in chosen})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; variants: {[v[0] for v in chosen]}")
        chosen = [v for v in chosen if v[0] in wanted]
    totals = {name: dict(repairs=0, hits=0.0, kept=[], prompt=0.0, prefill=0.0, decode=0.0, s=0.0,
                         members={}, by_ref=[0, 0, 0, 0])
              for name, *_ in chosen}  # fmt: skip
    for seed in ns.seeds:
        pick = random.Random(seed).sample(problems, min(ns.problems, len(problems)))
        prompts = [render_prompt(tok, ex.question, data) for ex in pick]
        torch.manual_seed(seed)
        rollout = generator(tok, prompts, ns.group_size, ns.budget, ns.batch_size, **sampling)
        per = [n // ns.group_size for n in range(len(rollout.texts))]  # completion -> problem
        examples, rendered = [pick[b] for b in per], [prompts[b] for b in per]
        grades = grade_completions(reward_fns, examples, rendered, rollout.texts)
        rewards = torch.tensor(grades.totals, device="cpu").view(len(pick), ns.group_size)
        for name, rep, budget, share in chosen:
            torch.manual_seed(seed + 1)
            t0 = time.perf_counter()
            repair_gen = RepairGeneration(generators[share], tok, data, budget, **gen)
            out = run_repairs(
                repair_gen, pick, rollout, rewards, reward_fns, rep, random.Random(seed)
            )  # fmt: skip
            t = totals[name]
            st = out.stats
            t["repairs"] += int(st["repairs"])
            t["hits"] += st["repair_success_rate"] * st["repairs"]
            if st["repair_success_rate"] > 0:
                t["kept"].append(1.0 - st["edited_token_fraction"])
            t["prompt"] += st["repair_prompt_tokens"]
            t["prefill"] += st["repair_prefill_tokens"]
            t["decode"] += st["repair_decode_tokens"]
            t["s"] += time.perf_counter() - t0
            for job, ok in zip(out.jobs, out.success):
                key = (seed, job.group, job.member)  # a failed completion: did any repair work
                t["members"][key] = t["members"].get(key, False) or ok
                k = 0 if rewards[job.group, job.reference] >= 1.0 else 2
                t["by_ref"][k] += 1
                t["by_ref"][k + 1] += int(ok)
    first = totals[chosen[0][0]]["members"]
    return {
        name: {**summarise(t, len(ns.seeds)), **paired(first, t["members"]), **by_ref(t)}
        for name, t in totals.items()
    }


def paired(base: dict, other: dict) -> dict:
    """The variant against the first on the failed completions both repaired: how many only
    the variant repaired (better), only the first (worse), and the exact two-sided sign test."""
    both = base.keys() & other.keys()
    better = sum(1 for k in both if other[k] and not base[k])
    worse = sum(1 for k in both if base[k] and not other[k])
    n = better + worse
    tail = sum(math.comb(n, i) for i in range(min(better, worse) + 1)) / 2**n if n else 1.0
    return {"paired": len(both), "better": better, "worse": worse, "sign_p": min(1.0, 2 * tail)}


def by_ref(t: dict) -> dict:
    """Success of the repairs that showed a correct reference, and of those that showed another
    failed completion (no correct sibling: correct_first falls back to a failed one)."""
    n_ok, hit_ok, n_other, hit_other = t["by_ref"]
    return {
        "correct_reference": [n_ok, hit_ok / n_ok if n_ok else None],
        "other_reference": [n_other, hit_other / n_other if n_other else None],
    }


def summarise(t: dict, seeds: int) -> dict:
    hits = round(t["hits"])
    lo, hi = wilson(hits, t["repairs"])
    return {
        "repairs": t["repairs"],
        "success": hits / t["repairs"] if t["repairs"] else 0.0,
        "ci95": [lo, hi],
        # mean over seeds with a success of the kept share of successfully repaired attempts
        "locality": sum(t["kept"]) / len(t["kept"]) if t["kept"] else None,
        # the repair prompts' tokens, and those the model ran (a shared prefix once)
        "prompt_tokens_per_seed": t["prompt"] / seeds,
        "prefill_tokens_per_seed": t["prefill"] / seeds,
        "decode_tokens_per_seed": t["decode"] / seeds,
        "seconds_per_seed": t["s"] / seeds,
    }


def table(results: dict) -> str:
    lines = [
        "| variant | repairs | success [95% CI] | vs first: better / worse (p) | kept | edited "
        "| prompt | prefill | decode | s | success: correct ref / other ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        loc = r["locality"]
        kept = "-" if loc is None else f"{loc:.2f}"
        edited = "-" if loc is None else f"{1 - loc:.2f}"
        refs = " / ".join(
            "-" if rate is None else f"{rate:.3f} of {n}"
            for n, rate in (r["correct_reference"], r["other_reference"])
        )
        lines.append(
            f"| {name} | {r['repairs']} | {r['success']:.3f} [{r['ci95'][0]:.3f}, "
            f"{r['ci95'][1]:.3f}] | {r['better']} / {r['worse']} ({r['sign_p']:.2f}) "
            f"| {kept} | {edited} | {r['prompt_tokens_per_seed']:.0f} | "
            f"{r['prefill_tokens_per_seed']:.0f} | "
            f"{r['decode_tokens_per_seed']:.0f} | {r['seconds_per_seed']:.1f} | {refs} |"
        )
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a local model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--problems", type=int, default=8, help="held-out problems per seed")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--budget", type=int, default=64, help="rollout and repair max_new_tokens")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--variants", help="comma-separated variant names to run (default: all)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 2 problems, 2 variants")
    p.add_argument("--replay", help="replay the spending rule over the runs under this folder")
    p.add_argument("--floors", default="0,0.05,0.1,0.15,0.2", help="replay: repair.min_success")
    p.add_argument("--probes", default="3,5,10", help="replay: repair.probe_every")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.seeds, ns.problems, ns.group_size, ns.budget = [0], 2, 2, 4
    return ns


def recorded_repairs(root: Path) -> dict[str, list[tuple[float, float]]]:
    """Per IBPO run under `root` (a folder holding metrics.jsonl, at any depth): each step's
    (repairs run, successful repairs); runs that never repaired are left out."""
    runs = {}
    for metrics in sorted(root.rglob("metrics.jsonl")):
        steps = {}
        for line in metrics.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "repairs" in row:
                n = row["repairs"]
                steps[row["step"]] = (n, round(n * row.get("repair_success_rate", 0.0)))
        if any(n for n, _ in steps.values()):
            runs[str(metrics.parent.relative_to(root))] = [steps[k] for k in sorted(steps)]
    return runs


def replay(runs: dict, floor: float, probe_every: int) -> dict:
    """The rule over recorded steps: shares of steps, repairs and successes it would keep."""
    kept = {"steps": 0, "repairs": 0.0, "successes": 0.0}
    total = {"steps": 0, "repairs": 0.0, "successes": 0.0}
    for steps in runs.values():
        state = SpendingState()
        for n, hits in steps:
            mode = decide(state, floor, probe_every)
            ran, ok = (0.0, 0.0) if mode == SKIP else (n, hits)
            state = observe(state, mode, ran, ok, 0.0, 0.0, 0.0)
            for d, (a, b) in ((kept, (ran, ok)), (total, (n, hits))):
                d["steps"] += int(a > 0) if d is kept else int(n > 0)
                d["repairs"] += a
                d["successes"] += b
    share = {k: kept[k] / total[k] if total[k] else 0.0 for k in kept}

    def rate(d: dict) -> float:
        return d["successes"] / d["repairs"] if d["repairs"] else 0.0

    return {"floor": floor, "probe_every": probe_every, **share, "success_kept": rate(kept),
            "success_all": rate(total)}  # fmt: skip


def replay_table(rows: list[dict], runs: int) -> str:
    lines = [
        f"Replayed over {runs} runs: shares kept of the steps that repaired, of the repairs and of "
        "the successful repairs; success of the repairs kept (of all)",
        "| floor | probe every | steps | repairs | successes | success kept (all) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['floor']:g} | {r['probe_every']} | {r['steps']:.2f} | {r['repairs']:.2f} "
            f"| {r['successes']:.2f} | {r['success_kept']:.3f} ({r['success_all']:.3f}) |"
        )
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    if ns.replay:
        runs = recorded_repairs(Path(ns.replay))
        if not runs:
            raise SystemExit(f"no run under {ns.replay} logged repairs")
        rows = [replay(runs, f, p) for f in _floats(ns.floors) for p in _ints(ns.probes)]
        print(replay_table(rows, len(runs)))
        print(json.dumps({"replay": ns.replay, "runs": len(runs), "rows": rows}))
        return 0
    results = bench(ns)
    print(table(results))
    print(json.dumps({"seeds": ns.seeds, "problems": ns.problems, "variants": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
