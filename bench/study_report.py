"""The study's report: study.json (every finished run's record, each comparison's figures),
study.md (per arm, the paired differences, the same at equal compute, what each run spent, the
repairs and whether the edit mask acted, the seeds the design would need, the sweep, the code and
command lines the runs ran; with `against`, that study's spreads and differences beside these)
and the figures (study_plots), rebuilt from the run folders alone.

The text is a function of the records: the same runs, packed or on disk, give the same bytes. It
does not run, read or judge runs itself (study_runs reads them, study_compare judges pairs).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from collections import Counter
from pathlib import Path

from study_compare import (
    FRACTIONS,
    at_each_axis,
    compare,
    first_difference,
    significant,
    verdict,
)
from study_grid import COMPARISONS, SWEEP
from study_plots import mean_curve, plot, plot_sweep
from study_runs import AXES, by_arm, collect, num, pooled_repair_success
from study_stats import (
    BOOTSTRAP_REPS,
    BOOTSTRAP_SEED,
    f_test_greater,
    mean_ci,
    mean_known,
    paired_stats,
    sd,
    seeds_for_half_width,
    seeds_for_power,
)

from ibpo.run.version import describe


def _f(x, fmt: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{fmt}}"


def _ci(values: list[float], fmt: str = "+.3f") -> str:
    mean, low, high = mean_ci(values)
    return f"{_f(mean, fmt)} [{_f(low, fmt)}, {_f(high, fmt)}]"


def arm_table(arms: dict[str, list[dict]]) -> str:
    lines = [
        "| arm | regime | seeds | final held-out acc. [95% CI] | held-out acc. per evaluation "
        "| gain [95% CI] | generated tokens | repair success (runs' range) | final entropy "
        "| mean KL | mean residual | truncated, step 1 -> 20 | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        gains = [r["gain"] for r in runs if r["gain"] is not None]
        after = _ci([r["after"] for r in runs], ".3f")
        lines.append(
            f"| {name} | {runs[0]['regime']} | {len(runs)} | {after} "
            f"| {' -> '.join(f'{y:.3f}' for y in mean_curve(runs, 'curve')[1])} "
            f"| {_ci(gains) if gains else 'n/a'} "
            f"| {mean_known(r['generated_tokens'] for r in runs):,.0f} "
            f"| {_repair_success(runs)} "
            f"| {_f(mean_known(r['entropy'][-1] for r in runs if r['entropy']))} "
            f"| {_f(mean_known(mean_known(r['kl']) for r in runs), '.4f')} "
            f"| {_f(mean_known(mean_known(r['residual']) for r in runs), '.4f')} "
            f"| {_truncated(runs)} "
            f"| {_f(mean_known(r['wall'] for r in runs), '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def _wall_line(runs: list[dict]) -> str:
    """How long the runs took: minutes per run (each its own process) and their sum in hours."""
    walls = sorted(r["wall"] / 60 for r in runs if r.get("wall") is not None)
    if not walls:
        return ""
    return (
        f"Wall time per run: {walls[0]:.1f}-{walls[-1]:.1f} min, median "
        f"{statistics.median(walls):.1f}; {sum(walls) / 60:.1f} hours in all.\n"
    )


def _repair_success(runs: list[dict]) -> str:
    """The mean over seeds of each run's pooled repair success, and the runs' lowest and highest."""
    rates = [r["repair_success"] for r in runs if r.get("repair_success") is not None]
    if not rates:
        return "n/a"
    return f"{mean_known(rates):.3f} ({min(rates):.3f}-{max(rates):.3f})"


def _truncated(runs: list[dict]) -> str:
    """Share of training completions cut at the token limit, first step -> last, over seeds."""
    cols = [r["truncated"] for r in runs if r.get("truncated") and None not in r["truncated"]]
    if not cols:
        return "n/a"
    return f"{mean_known(c[0] for c in cols):.1%} -> {mean_known(c[-1] for c in cols):.1%}"


def sentence(label: str, c: dict) -> str:
    """One plain sentence: the difference, its intervals and whether it is significant."""
    n, (low, high), (t_low, t_high) = len(c["seeds"]), c["bootstrap_ci"], c["t_ci"]
    floor = min(1.0, 2 / 2**n)  # the sign test's smallest p: every seed on one side
    return (
        f"**{label}**: mean difference {c['mean']:+.3f} over {n} seeds ({c['wins']} higher, "
        f"{c['losses']} lower, {c['ties']} tied); paired t 95% CI [{_f(t_low, '+.3f')}, "
        f"{_f(t_high, '+.3f')}], so it is {'' if significant(c) else 'not '}significant at 0.05; "
        f"sign test p = {c['sign_p']:.3f} (its floor with {n} seeds: {floor:.4f}); bootstrap "
        f"95% CI [{low:+.3f}, {high:+.3f}]."
    )


def comparisons_md(comps: list[tuple[str, dict]]) -> str:
    if not comps:
        return "No comparison has finished runs in both arms yet.\n"
    lines = [
        "| comparison | seeds | mean diff. | paired t 95% CI | bootstrap 95% CI "
        "| higher / lower / tied | sign p | significant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, c in comps:
        lo, hi = c["bootstrap_ci"]
        t_lo, t_hi = c["t_ci"]
        lines.append(
            f"| {label} | {len(c['seeds'])} | {c['mean']:+.3f} "
            f"| [{_f(t_lo, '+.3f')}, {_f(t_hi, '+.3f')}] | [{lo:+.3f}, {hi:+.3f}] "
            f"| {c['wins']} / {c['losses']} / {c['ties']} | {c['sign_p']:.3f} "
            f"| {'yes' if significant(c) else 'no'} |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(f"* {sentence(lb, c)}" for lb, c in comps) + "\n"


def equal_compute_md(
    comps: list[tuple[str, dict[str, dict]]], missing: list[tuple[str, str, str]] = ()
) -> str:
    """Every comparison at equal steps, decode tokens, prompt + decode tokens and step
    seconds: the paired figures at each pair's common budget, why a comparison is missing on
    an axis (`missing`: label, axis, reason), then the mean difference along the way, then the
    comparisons whose verdict depends on the axis."""
    if not comps:
        return "No comparison has finished runs in both arms yet.\n"
    lines = [
        "| comparison | at equal | seeds | a / b compute spent (mean, range) "
        "| compared at (mean per pair) | mean diff. | paired t 95% CI | bootstrap 95% CI "
        "| higher / lower / tied | sign p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, by_axis in comps:
        for axis, c in by_axis.items():
            name = AXES[axis][0]
            (t_lo, t_hi), (lo, hi), r = c["t_ci"], c["bootstrap_ci"], c["ratios"]
            lines.append(
                f"| {label} | {name} | {len(c['seeds'])} "
                f"| {statistics.fmean(r):.2f}x ({min(r):.2f}-{max(r):.2f}) "
                f"| {_budget(statistics.fmean(c['budgets']), axis)} | {c['mean']:+.3f} "
                f"| [{_f(t_lo, '+.3f')}, {_f(t_hi, '+.3f')}] | [{lo:+.3f}, {hi:+.3f}] "
                f"| {c['wins']} / {c['losses']} / {c['ties']} | {c['sign_p']:.3f} "
                f"| {verdict(c)} |"
            )
    lines += [f"\n{label}, not at equal {AXES[axis][0]}: {why}." for label, axis, why in missing]
    head = " | ".join(f"{f:.0%}" for f in FRACTIONS)
    lines += [
        "\nAlong the way: the mean difference [paired t 95% CI] at fractions of each pair's "
        "common budget.\n",
        f"| comparison | at equal | {head} |",
        "|---|---|" + "---|" * len(FRACTIONS),
    ]
    for label, by_axis in comps:
        for axis, c in by_axis.items():
            cells = [
                _ci_of(c["along"][str(f)]) if str(f) in c["along"] else "n/a" for f in FRACTIONS
            ]
            lines.append(f"| {label} | {AXES[axis][0]} | {' | '.join(cells)} |")
    differ = [
        f"* **{label}**: "
        + "; ".join(f"{verdict(c)} at equal {AXES[axis][0]}" for axis, c in by_axis.items())
        for label, by_axis in comps
        if len({verdict(c) for c in by_axis.values()}) > 1
    ]
    lines.append("")
    if differ:
        lines += ["Verdicts that depend on what is held equal:\n", *differ]
    else:
        lines.append("No verdict depends on what is held equal.")
    return "\n".join(lines) + "\n"


def _budget(x: float, axis: str) -> str:
    return f"{x:,.1f} s" if axis == "seconds" else f"{x:,.0f} {AXES[axis][0].split()[-1]}"


def _ci_of(c: dict) -> str:
    t_lo, t_hi = c["t_ci"]
    return f"{c['mean']:+.3f} [{_f(t_lo, '+.3f')}, {_f(t_hi, '+.3f')}]"


def compute_md(arms: dict[str, list[dict]]) -> str:
    """What each arm spent per run: mean over its runs (lowest-highest). Prompt tokens run: those
    the model computed (a prompt run once for its G samples, a shared prefix once); the repair
    prompts' own tokens beside them."""
    lines = [
        "| arm | runs | steps | decode tokens | rollout prompt tokens run | repair prompt tokens "
        "| of which run | prompt + decode tokens run | step seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(values: list, fmt: str = ",.0f") -> str:
        known = [v for v in values if v is not None]  # step seconds from no rerun: None
        if not known:
            return "n/a"
        text = f"{statistics.fmean(known):{fmt}} ({min(known):{fmt}}-{max(known):{fmt}})"
        return text if len(known) == len(values) else f"{text}, {len(known)} runs"

    for name, runs in arms.items():
        if not all(r.get("compute") for r in runs):
            continue
        spent = {a: [r["compute"][a] for r in runs] for a in AXES}
        recorded = all(r["rollout_prompts_recorded"] for r in runs)
        rollout = cell([r["rollout_prefill_tokens"] for r in runs]) if recorded else "not logged"
        repaired = all(r["repair_prompts_recorded"] for r in runs)
        prompts = cell([r["repair_prompt_tokens"] for r in runs]) if repaired else "not logged"
        ran = cell([r["repair_prefill_tokens"] for r in runs]) if repaired else "not logged"
        both = cell(spent["tokens"]) if recorded and repaired else "n/a"
        lines.append(
            f"| {name} | {len(runs)} | {cell(spent['steps'])} | {cell(spent['decode'])} "
            f"| {rollout} | {prompts} | {ran} | {both} "
            f"| {cell(spent['seconds'], ',.1f')} |"
        )
    return "\n".join(lines) + "\n"


def code_md(records: list[dict]) -> str:
    """Which code the runs ran: each commit (and tree state) with its runs."""
    seen: dict[str, list[str]] = {}
    for r in records:
        seen.setdefault(describe(r.get("code")), []).append(f"{r['arm']}-s{r['seed']}")
    lines = ["| code | runs |", "|---|---|"]
    lines += [f"| {code} | {len(runs)}: {' '.join(runs)} |" for code, runs in seen.items()]
    return "\n".join(lines) + "\n"


def tokens_md(arms: dict[str, list[dict]]) -> str:
    """Accuracy against generated tokens: the budget each arm really spent."""
    ref = (
        mean_known(r["generated_tokens"] for r in arms.get("on-dfpo", []))
        if "on-dfpo" in arms
        else None
    )
    lines = [
        "| arm | generated tokens per run | x on-dfpo | repair tokens | final acc. | gain "
        "| gain per 100k tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        tokens = mean_known(r["generated_tokens"] for r in runs)
        gain = mean_known(r["gain"] for r in runs)
        ratio = tokens / ref if ref else math.nan
        lines.append(
            f"| {name} | {tokens:,.0f} | {_f(ratio, '.2f')} "
            f"| {mean_known(r['repair_tokens_total'] for r in runs):,.0f} "
            f"| {_f(mean_known(r['after'] for r in runs))} | {_f(gain, '+.3f')} "
            f"| {_f(gain / tokens * 1e5 if tokens else math.nan, '+.3f')} |"
        )
    return "\n".join(lines) + "\n"


def mask_md(arms: dict[str, list[dict]]) -> str:
    """Did Part 2's edit mask act? Per seed: the steps with a successful repair in `on-ibpo`, and
    the first step at which it and shaping only (the same run with the mask off) part."""
    ibpo = {r["seed"]: r for r in arms.get("on-ibpo", [])}
    shaping = {r["seed"]: r for r in arms.get("ablation-shaping-only", [])}
    seeds = sorted(set(ibpo) & set(shaping))
    if not seeds:
        return "Needs finished `on-ibpo` and `ablation-shaping-only` runs of one seed.\n"
    lines = [
        "| seed | steps with a successful repair | first step where ibpo and shaping only differ "
        "| final acc. ibpo | final acc. shaping only |",
        "|---|---|---|---|---|",
    ]
    for seed in seeds:
        a, b = ibpo[seed], shaping[seed]
        ok = sum(1 for x in a.get("repair_success_rate") or [] if x)
        step = first_difference(a, b)
        lines.append(
            f"| {seed} | {ok} of {len(a.get('reward') or [])} "
            f"| {'never: the mask did not act' if step is None else step} "
            f"| {_f(a['after'])} | {_f(b['after'])} |"
        )
    return "\n".join(lines) + "\n"


def repairs_md(arms: dict[str, list[dict]]) -> str:
    """Per run of an arm that repairs: repair success (pooled), locality (the share of an
    attempt's tokens its most local successful repair kept, mean over the steps with a success)
    and the mask's action (steps where it lowered some blame; the share of completion tokens
    whose blame it lowered, mean over steps); what the repairs cost: their share of the step's
    generated tokens (mean over steps) and of its seconds (the run's repair seconds over its
    step seconds)."""
    lines = [
        "| arm | seed | repairs | skipped | success | steps with a success | locality (kept) "
        "| steps the mask acted | lifted blame (mean share) | cost share | seconds share "
        "| final acc. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        for r in runs:
            attempted = sum(x or 0.0 for x in r.get("repairs") or [])
            if not attempted:
                continue
            rates = r.get("repair_success_rate") or []
            edited = r.get("edited_token_fraction") or []
            kept = [1.0 - e for ok, e in zip(rates, edited) if ok and e is not None]
            lifted = [x for x in r.get("lifted_blame_fraction") or [] if x is not None]
            acted = sum(1 for x in lifted if x > 0)
            skipped = [x for x in r.get("repairs_skipped") or [] if x is not None]
            share = [x for x in r.get("repair_cost_share") or [] if x is not None]
            timed = [
                (rep, step)
                for rep, step in zip(r.get("time_repair") or [], r.get("step_time") or [])
                if rep is not None and step
            ]
            seconds = sum(t[0] for t in timed) / sum(t[1] for t in timed) if timed else None
            lines.append(
                f"| {name} | {r['seed']} | {attempted:.0f} "
                f"| {f'{sum(skipped):.0f}' if skipped else 'n/a'} | {_f(r['repair_success'])} "
                f"| {sum(1 for x in rates if x)} of {len(rates)} "
                f"| {_f(statistics.fmean(kept)) if kept else '-'} "
                f"| {acted if lifted else 'n/a'} of {len(lifted) if lifted else len(rates)} "
                f"| {_f(statistics.fmean(lifted), '.4f') if lifted else 'n/a'} "
                f"| {_f(statistics.fmean(share), '.2f') if share else 'n/a'} "
                f"| {'n/a' if seconds is None else _f(seconds, '.2f')} "
                f"| {_f(r['after'])} |"
            )
    if len(lines) == 2:
        return "No finished run repaired.\n"
    return "\n".join(lines) + "\n" + spending_md(arms)


def spending_md(arms: dict[str, list[dict]]) -> str:
    """What the repair spending rule did, per arm that ran it, summed over its runs: repairs
    run and skipped, their success, the steps that repaired; with a floor, how many of those
    were probes and the steps after which the running success rate was under the run's floor
    (without one, only the budget skipped repairs)."""
    lines = []
    for name, runs in arms.items():
        # runs of versions with the rule (they log what it skipped) that planned repairs
        ruled = [
            r
            for r in runs
            if any(x is not None for x in r.get("repairs_skipped") or [])
            and any(num(x) > 0 for k in ("repairs", "repairs_skipped") for x in r[k] or [])
        ]
        if not ruled:
            continue
        steps = sum(len(r["repairs"]) for r in ruled)
        ran = sum(num(x) for r in ruled for x in r["repairs"])
        skipped = sum(num(x) for r in ruled for x in r["repairs_skipped"])
        rate = pooled_repair_success(
            [n for r in ruled for n in r["repairs"]],
            [p for r in ruled for p in r["repair_success_rate"]],
        )
        ok = (rate or 0.0) * ran
        repaired = sum(1 for r in ruled for x in r["repairs"] if num(x) > 0)
        planned = ran + skipped
        floors = sorted({r.get("min_success") or 0.0 for r in ruled})
        line = (
            f"* {name}, {len(ruled)} runs, {steps} steps (floor {', '.join(map(str, floors))}): "
            f"{ran:.0f} repairs ran and {skipped:.0f} were skipped "
            f"({_f(skipped / planned if planned else None, '.0%')} of those planned); "
            f"{ok:.0f} of the {ran:.0f} succeeded ({_f(ok / ran if ran else None, '.0%')}). "
            f"Repairs ran at {repaired} steps"
        )
        if all(r.get("min_success") for r in ruled):
            probes = sum(1 for r in ruled for x in r.get("repair_probe") or [] if num(x) > 0)
            under = sum(
                1
                for r in ruled
                for x in r.get("repair_running_success") or []
                if x is not None and x < r["min_success"]
            )
            line += (
                f", {probes} of them probes; the running success rate was under the floor "
                f"after {under} of the {steps} steps."
            )
        elif not any(r.get("min_success") for r in ruled):
            line += "; with no floor, only the budget skipped repairs."
        else:
            line += "; some runs had no floor, so probes and steps under it are not counted."
        lines.append(line)
    if not lines:
        return ""
    return "\nThe repair spending rule, summed over each arm's runs:\n\n" + "\n".join(lines) + "\n"


_THREADS = re.compile(r"(?:^|\s)OMP_NUM_THREADS=(\d+)(?:\s|$)")


def run_threads(record: dict) -> int | None:
    """The OMP_NUM_THREADS a run's process had (its command line), None when not recorded."""
    m = _THREADS.search(record.get("command") or "")
    return int(m.group(1)) if m else None


def mixed_threads(records: list[dict]) -> str:
    """A warning for the top of the report when the runs computed at different thread counts
    (a matmul's summation order follows its threads, so the same run at 1 and 2 threads can
    end elsewhere: their differences are then partly the threads'), naming each count's runs;
    "" when every run had the same."""
    counts: dict[int | None, dict[str, list[int]]] = {}
    for r in records:
        counts.setdefault(run_threads(r), {}).setdefault(r["arm"], []).append(r["seed"])
    if len(counts) < 2:
        return ""
    parts = []
    for n, arms in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        who = "; ".join(f"{arm} seeds {seed_ranges(sorted(seeds))}" for arm, seeds in arms.items())
        parts.append(f"{'unrecorded' if n is None else n} thread{'s' * (n != 1)}: {who}")
    return (
        "**Warning: these runs computed at different thread counts** (OMP_NUM_THREADS), which "
        "changes what a run computes, not only its seconds: rerun them at one count before "
        "reading a difference between arms. " + " | ".join(parts) + "\n"
    )


def commands_md(records: list[dict]) -> str:
    """The command lines, compactly: the part every run shares, then each arm's own overrides;
    study.json keeps every run's exact line."""
    if not records:
        return ""
    split = [shlex.split(r["command"]) for r in records]
    shared = [t for t in split[0] if all(t in other for other in split[1:])]
    per_run = ("train.seed=", "run.output_dir=", "run.resume_from=")
    shared = [t for t in shared if not t.startswith(per_run)]
    lines = ["Every run is one process:\n", "```bash", shlex.join(shared) + " \\"]
    lines.append(
        "    <arm's overrides> train.seed=<seed> "
        "run.output_dir=<out>/<runs|sweep>/<arm>-s<seed>/train run.resume_from=latest"
    )
    lines += ["```\n", "| arm | its overrides |", "|---|---|"]
    by_arm: dict[str, list[tuple[int, list[str]]]] = {}
    for r, tokens in zip(records, split):
        own = [t for t in tokens if t not in shared and not t.startswith(per_run)]
        by_arm.setdefault(r["arm"], []).append((r["seed"], own))
    for arm, runs in by_arm.items():
        common = [t for t in runs[0][1] if all(t in own for _, own in runs[1:])]
        varying: dict[str, list[int]] = {}  # an override some of the arm's runs had
        for seed, own in runs:
            for t in own:
                if t not in common:
                    varying.setdefault(t, []).append(seed)
        cell = f"`{shlex.join(common)}`"
        if varying:
            cell += "; by seed: " + ", ".join(
                f"`{t}` (seeds {seed_ranges(seeds)})" for t, seeds in sorted(varying.items())
            )
        lines.append(f"| {arm} | {cell} |")
    return "\n".join(lines) + "\n"


def seed_ranges(seeds: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    for seed in sorted(set(seeds)):
        if out and seed == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{seed}"
        else:
            out.append(str(seed))
    return ", ".join(out)


def spread_md(arms: dict[str, list[dict]], comps: list[tuple[str, dict]]) -> str:
    """What the design can resolve: the spread over seeds per arm, and per comparison the
    seeds a paired t 95% interval of half-width 0.05 would need at that spread (the fewest n
    with t(0.975, n - 1) sd / sqrt(n) <= 0.05) and those the paired t-test needs to find a true
    difference of 0.05 with 80% power."""
    lines = [
        "| arm or comparison | sd over seeds | seeds for a +-0.05 t-interval "
        "| seeds for 80% power at 0.05 | training reward gap, steps 2+ "
        "| steps with equal training reward, per seed |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        lines.append(f"| {name} (final acc.) | {_f(sd([r['after'] for r in runs]))} | | | | |")
    for label, c in comps:
        spread = sd(c["diffs"])
        equal = " ".join(map(str, c.get("equal_reward_steps", [])))
        lines.append(
            f"| {label} | {_f(spread)} | {_f(seeds_for_half_width(spread), '.0f')} "
            f"| {_f(seeds_for_power(spread), '.0f')} | {_f(c.get('reward_gap'))} | {equal} |"
        )
    return "\n".join(lines) + "\n"


def sweep_md(arms: dict[str, list[dict]]) -> str:
    lines = [
        "| arm | seed | before | after | gain | min held-out acc. | final entropy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        for r in runs:
            lines.append(
                f"| {name} | {r['seed']} | {_f(r['before'])} | {_f(r['after'])} "
                f"| {_f(r['gain'], '+.3f')} | {_f(min(acc for _, acc in r['curve']))} "
                f"| {_f(r['entropy'][-1] if r['entropy'] else None)} |"
            )
    return "\n".join(lines) + "\n"


EQUAL_COMPUTE_NOTE = (
    "Each comparison again, holding steps, decode tokens (rollout and repair completions, "
    "dynamic sampling's extra rounds), prompt + decode tokens (with the prompt tokens the "
    "model ran in rollouts and repairs: a prompt run once for its G samples, or a prefix "
    "shared by several repair prompts, counts once) or step seconds (the sum of step times; "
    "evaluations and loading left out; they depend on what else the machine ran) equal. Per "
    "seed, both runs are read at the largest budget both reached: the run that spent less at "
    "its final evaluation, the other on the straight line between its two evaluations around "
    "that budget (its held-out accuracy curve against compute spent, linearly interpolated; "
    "step 0 is the accuracy before training, at compute 0). The paired differences are then "
    "judged as above. a / b compute spent: per seed, what run a spent over what run b spent "
    "by the end.\n"
)


def _seconds_note(runs: list[dict]) -> str:
    """Where the step seconds come from, when they come from timed runs (take_seconds)."""
    if not any("seconds_from" in r for r in runs):
        return ""
    # the study folder each run's timed run came from (<folder>/runs/<arm>-s<seed>)
    folders = Counter(
        str(Path(r["seconds_from"]).parents[1]) for r in runs if r.get("seconds_from")
    )
    per = ", ".join(f"{n} from {folder}" for folder, n in sorted(folders.items()))
    taken = sum(folders.values())
    return (
        f"\nStep seconds here are those of timed runs ({per or 'none found'}): {taken} of "
        f"{len(runs)} runs have a timed run that took the same steps (the same loss, reward, "
        "repairs and repair tokens at every step), and its step seconds replace the run's own; "
        "the other runs are left out of the comparisons at equal step seconds and of the "
        "seconds figures.\n"
    )


def build_report(records: list[dict], pending: list[str]) -> tuple[dict, str]:
    """(study.json's content, study.md's text) from the finished runs."""
    main_runs = [r for r in records if r["regime"] != SWEEP]
    arms, sweep = by_arm(main_runs), by_arm([r for r in records if r["regime"] == SWEEP])
    comps = [(lb, c) for lb, a, b in COMPARISONS if (c := compare(arms, a, b))]
    equal, missing = at_each_axis(arms)
    before = sorted({r["before"] for r in records if r["before"] is not None})
    n_eval = sorted({r["n_eval"] for r in records})
    md = ["# IBPO study\n"]
    md.append(
        f"Held-out problems per evaluation: {', '.join(map(str, n_eval)) or 'n/a'} (greedy); "
        f"accuracy before training: {', '.join(f'{b:.3f}' for b in before) or 'n/a'}. "
        "Intervals over seeds are 95% t-intervals of the mean; paired differences are of the "
        "final held-out accuracy, seed by seed, judged by their paired t 95% interval (a "
        "difference is significant at 0.05 when it excludes 0), with an exact two-sided sign "
        f"test and a percentile bootstrap ({BOOTSTRAP_REPS:,} resamples, RNG seed "
        f"{BOOTSTRAP_SEED}) beside it.\n"
    )
    if mixed := mixed_threads(main_runs):
        md.append(mixed)
    if pending:
        md.append(
            f"**{len(pending)} runs are not finished** and are left out: "
            + ", ".join(Path(p).name for p in pending)
            + "\n"
        )
    if arms:
        md += [
            "## Per arm\n",
            "Means over seeds. Repair success: successful repairs over attempted ones, pooled over"
            " a run's steps. Entropy: the last step's; KL (to the reference) and the cancellation"
            " residual: means over steps; truncated: the share of training completions cut at the"
            " token limit.\n",
            arm_table(arms),
            _wall_line(main_runs),
        ]
        md += ["## Paired differences\n", comparisons_md(comps)]
        md += ["## At equal compute\n", EQUAL_COMPUTE_NOTE + _seconds_note(main_runs)]
        md += [equal_compute_md(equal, missing)]
        md += ["## Compute per run\n", compute_md(arms)]
        md += ["## Accuracy against generated tokens\n", tokens_md(arms)]
        md += ["## Repairs per run\n", repairs_md(arms)]
        md += ["## Did the edit mask act?\n", mask_md(arms)]
        md += ["## What the design can resolve\n", spread_md(arms, comps)]
        md.append(
            "![held-out accuracy per step and per generated token](accuracy.png)\n\n"
            "![entropy and KL to the reference per step](dynamics.png)\n"
        )
    if sweep:
        md += ["## Learning-rate sweep\n", sweep_md(sweep), "![sweep](sweep.png)\n"]
    md += ["## Code\n", code_md(records)] if records else []
    md += ["## Command lines\n", commands_md(records)]
    data = {"runs": main_runs, "sweep": [r for r in records if r["regime"] == SWEEP]}
    data["comparisons"] = [{"label": lb, **c} for lb, c in comps]
    data["equal_compute"] = [{"label": lb, **c} for lb, by in equal for c in by.values()]
    data["pending"] = pending
    return data, "\n".join(md)


def against_md(here: list[dict], there: list[dict], name: str) -> str:
    """The spread of each comparison's paired differences here and in another study (`there`,
    its study.json comparisons): were the pairs tighter here? A one-sided F-test of the two
    variances (5 pairs each side can only show a large ratio)."""
    other = {c["label"]: c for c in there}
    lines = [
        f"Paired differences here against {name}.\n",
        "| comparison | mean diff. here | there | sd here | sd there | variance ratio "
        "(there / here) | one-sided F-test p | training reward gap here | there |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in here:
        o = other.get(c["label"])
        if o is None:
            continue
        a, b = sd(c["diffs"]), sd(o["diffs"])
        p = f_test_greater(b, len(o["diffs"]), a, len(c["diffs"]))
        lines.append(
            f"| {c['label']} | {c['mean']:+.3f} | {o['mean']:+.3f} | {_f(a)} | {_f(b)} "
            f"| {_f((b / a) ** 2, '.2f')} | {_f(p, '.2f')} | {_f(c.get('reward_gap'))} "
            f"| {_f(o.get('reward_gap'))} |"
        )
    return "\n".join(lines) + "\n"


def between_md(here: dict, there: dict, name: str) -> str:
    """Each comparison's paired differences here minus there, seed by seed (the seeds both
    studies have): a study that changed arm a and kept arm b's very runs (the same final
    accuracy and training rewards at every seed) measures arm a against its other version."""
    runs = [{(r["arm"], r["seed"]): r for r in d["runs"]} for d in (here, there)]
    other = {c["label"]: c for c in there["comparisons"]}
    lines = [
        f"Seed by seed, each paired difference here minus the same one in {name}.\n",
        "| comparison | seeds | arm b's runs the same | mean | paired t 95% CI "
        "| higher / lower / tied | sign p | significant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in here["comparisons"]:
        o = other.get(c["label"])
        if o is None:
            continue
        d_here, d_there = dict(zip(c["seeds"], c["diffs"])), dict(zip(o["seeds"], o["diffs"]))
        seeds = sorted(set(d_here) & set(d_there))
        if len(seeds) < 2:
            continue
        st = paired_stats([d_here[s] - d_there[s] for s in seeds])
        same = all(
            (x := runs[0].get((c["b"], s))) is not None
            and (y := runs[1].get((c["b"], s))) is not None
            and (x["after"], x["reward"]) == (y["after"], y["reward"])
            for s in seeds
        )
        lo, hi = st["t_ci"]
        lines.append(
            f"| {c['label']} | {len(seeds)} | {'yes' if same else 'no'} | {st['mean']:+.3f} "
            f"| [{_f(lo, '+.3f')}, {_f(hi, '+.3f')}] | {st['wins']} / {st['losses']} / "
            f"{st['ties']} | {st['sign_p']:.3f} | {'yes' if significant(st) else 'no'} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 3 else ""


def report_text(
    out: Path,
    against: Path | None = None,
    seconds_from: list[Path] = (),
    packed: Path | None = None,
) -> tuple[dict, str]:
    """(study.json's content, study.md's text) of the study at `out`, as `report` writes them."""
    data, md = build_report(*collect(out, seconds_from, packed))
    if against is not None:
        other = build_report(*collect(against, packed=packed))[0]
        md += "\n## Against another study\n\n" + against_md(
            data["comparisons"], other["comparisons"], str(against)
        )
        md += "\n" + between_md(data, other, str(against))
    return data, md


def report(
    out: Path,
    against: Path | None = None,
    seconds_from: list[Path] = (),
    packed: Path | None = None,
) -> str:
    """Rebuild study.json, study.md and the plots in `out` from its finished run folders, on
    disk or packed under `packed` (and, with `against`, a section comparing its paired spreads
    with that study's; with `seconds_from`, the step seconds of timed runs there,
    take_seconds)."""
    data, md = report_text(out, against, seconds_from, packed)
    (out / "study.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "study.md").write_text(md)
    main_arms = by_arm(data["runs"])
    if main_arms:
        plot(main_arms, out)
    if data["sweep"]:
        plot_sweep(by_arm(data["sweep"]), out / "sweep.png")
    return md
