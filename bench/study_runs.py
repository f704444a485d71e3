"""Reading a study's runs: its run folders, on disk or packed (study_archive), into the records
the statistics and the report take, one per finished run, from the folders' files alone.

A run folder (<out>/runs/<arm>-s<seed>, <out>/sweep/...) holds study_run.json (arm, regime, seed,
command line) and train/ (the trainer's metrics.jsonl, summary.json, config.yaml). A record holds
its final and per-evaluation held-out accuracy, its per-step figures (STEP_KEYS), the compute it
spent on each axis (AXES) and the code it ran; with timed reruns of the runs (`--seconds-from`),
a run's step seconds are those of the rerun that reproduced it step for step (take_seconds).

It does not judge or compare runs (study_compare, study_stats) or write anything.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from study_archive import SKIPPED, packed_members
from study_grid import REGIME_ORDER

from ibpo.run.version import from_header


@dataclass(frozen=True)
class RunFolder:
    """One run's folder: the path the report names it by (<out>/runs/<arm>-s<seed>, as it was
    on disk) and its files, read there or, when `packed` holds the study's archive members
    ({path: bytes}), from those."""

    path: Path
    packed: Mapping[str, bytes] | None = None

    def text(self, name: str) -> str:
        """The text of the file `name` (a path inside the folder); OSError when it is not there.
        Packed text is read as Path.read_text reads a file (UTF-8, universal newlines)."""
        if self.packed is None:
            return (self.path / name).read_text()
        try:
            data = self.packed[(self.path / name).as_posix()]
        except KeyError:
            raise FileNotFoundError(f"{self.path / name} (packed)") from None
        return data.decode().replace("\r\n", "\n").replace("\r", "\n")

    def has(self, name: str) -> bool:
        if self.packed is None:
            return (self.path / name).is_file()
        return (self.path / name).as_posix() in self.packed


def study_runs(out: Path, packed: Path | None = None) -> list[RunFolder]:
    """Every run folder of the study at `out`, in path order: those packed in its archive under
    `packed` (study_archive), and those on disk, a folder on disk replacing the packed run of
    its name (a run added or rerun since the packing)."""
    members = packed_members(out, packed)
    found = {
        Path(name).parent: RunFolder(Path(name).parent, members)
        for name in members
        if name.endswith("/study_run.json") and Path(name).parent.parent.parent == Path(out)
    }
    found.update({meta.parent: RunFolder(meta.parent) for meta in out.glob("*/*/study_run.json")})
    return [found[path] for path in sorted(found)]


def copy_runs(out: Path, dest: Path, packed: Path | None = None) -> None:
    """The study's run folders, on disk or packed, copied under `dest` (replaced), which then
    holds them as `out` did (<dest>/runs/<arm>-s<seed>/...); what is never packed is left out."""
    shutil.rmtree(dest, ignore_errors=True)
    for run in study_runs(out, packed):
        target = dest / run.path.relative_to(out)
        if run.packed is None:
            shutil.copytree(run.path, target, ignore=shutil.ignore_patterns(*SKIPPED))
            continue
        for name, data in run.packed.items():
            if name.startswith(run.path.as_posix() + "/"):
                path = target / Path(name).relative_to(run.path)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)


def is_done(run: RunFolder | Path) -> bool:
    """summary.json is written before the final evaluation too: done means it holds that."""
    run = run if isinstance(run, RunFolder) else RunFolder(run)
    try:
        summary = json.loads(run.text("train/summary.json"))
    except (OSError, ValueError):
        return False
    return bool(summary.get("eval_after"))


def num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else 0.0


# The compute axes every comparison is also made at: (name in the report, what one step spends).
# decode: tokens generated (rollout completions, repair completions, dynamic sampling's extra
# rounds); tokens: those plus the prompt tokens the model ran in the rollouts and the repairs (a
# prompt run once for its G samples, or a prefix shared by several repair prompts, counts once);
# seconds: step_time (held-out evaluations and model loading left out).
AXES = {
    "steps": ("steps", lambda row: 1.0),
    "decode": ("decode tokens", lambda row: num(row.get("generated_tokens"))),
    "tokens": (
        "prompt + decode tokens",
        lambda row: sum(
            num(row.get(k))
            for k in ("generated_tokens", "rollout_prefill_tokens", "repair_prefill_tokens")
        ),
    ),
    "seconds": ("step seconds", lambda row: num(row.get("step_time"))),
}
STEP_KEYS = (
    "reward",
    "entropy",
    "kl",
    "residual",
    "repairs",
    "repair_success_rate",
    "repair_tokens",
    "truncated",
    "loss",
    "lifted_blame_fraction",  # logged by later versions of the step; None where absent
    "edited_token_fraction",
    "repairs_skipped",  # the repair spending rule's (later versions); None where absent
    "repair_cost_share",
    "repair_probe",
    "repair_running_success",  # the rule's running success rate after the step
    "time_repair",  # seconds of the repair phase and of the whole step, measured in one
    "step_time",  # process: their ratio holds on a busy machine where the seconds do not
)


def _rows(run: RunFolder) -> tuple[list[dict], list[dict]]:
    """(training rows, periodic evaluation rows) of metrics.jsonl, one per step (a resumed run
    may repeat steps: the last line wins)."""
    train, evals = {}, {}
    for line in run.text("train/metrics.jsonl").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        is_eval = all(k == "step" or k.startswith("eval_") for k in row)
        (evals if is_eval else train)[row["step"]] = row
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def compute_at(steps: list[dict], axis: str) -> dict[int, float]:
    """{step: the compute spent through that step} on one axis (AXES), step 0 included."""
    spent, total = {0: 0.0}, 0.0
    for row in steps:
        total += AXES[axis][1](row)
        spent[row["step"]] = total
    return spent


def spent_by(spent: dict[int, float], step: int) -> float:
    """The compute spent through `step`: that of the last logged step at or before it."""
    return spent[max(s for s in spent if s <= step)]


def on_axis(steps: list[dict], axis: str, curve: list) -> tuple[list, float]:
    """(the held-out accuracy curve against the compute spent on `axis`, the compute spent
    through the curve's last step) for a run's training rows and its (step, accuracy) curve."""
    spent = compute_at(steps, axis)
    return [(spent_by(spent, st), acc) for st, acc in curve], spent_by(spent, curve[-1][0])


def read_code(run: RunFolder, summary: dict) -> dict | None:
    """The code a run ran (commit, dirty tree): summary.json's, else config.yaml's first line;
    None for a run from before the trainer recorded it."""
    if isinstance(summary.get("code"), dict):
        return summary["code"]
    try:
        return from_header(run.text("train/config.yaml"))
    except OSError:
        return None


def read_run(run: RunFolder) -> dict:
    """One finished run's figures for study.json."""
    meta = json.loads(run.text("study_run.json"))
    summary = json.loads(run.text("train/summary.json"))
    steps, evals = _rows(run)
    before = (summary.get("eval_before") or {}).get("accuracy")
    after = summary["eval_after"]["accuracy"]
    curve = ([(0, before)] if before is not None else []) + [
        (e["step"], e["eval_accuracy"]) for e in evals
    ]
    curve.append((summary["steps"], after))
    cumulative, total = {0: 0.0}, 0.0
    for row in steps:
        total += row.get("generated_tokens") or 0.0
        cumulative[row["step"]] = total
    col = {k: [row.get(k) for row in steps] for k in STEP_KEYS}
    axes = {axis: on_axis(steps, axis, curve) for axis in AXES}
    return {
        **{k: meta[k] for k in ("arm", "regime", "seed", "command")},
        "dir": str(run.path),
        "n_eval": summary["eval_after"]["n"],
        "before": before,
        "after": after,
        "gain": None if before is None else after - before,
        "curve": curve,
        "token_curve": [(cumulative.get(s, total), acc) for s, acc in curve],
        **col,
        "generated_tokens": total,  # rollouts + repairs (+ dynamic sampling's extra rounds)
        "repair_tokens_total": sum(x or 0.0 for x in col["repair_tokens"]),
        "repair_success": pooled_repair_success(col["repairs"], col["repair_success_rate"]),
        "wall": summary.get("wall_seconds"),
        # held-out accuracy against each compute axis: (compute spent, accuracy) per evaluation
        "compute_curves": {a: axes[a][0] for a in AXES},
        "compute": {a: axes[a][1] for a in AXES},
        "rollout_prefill_tokens": sum(num(r.get("rollout_prefill_tokens")) for r in steps),
        "repair_prefill_tokens": sum(num(r.get("repair_prefill_tokens")) for r in steps),
        # the repair prompts' tokens (before shared prefixes; older runs logged only the prefill)
        "repair_prompt_tokens": sum(
            num(r.get("repair_prompt_tokens", r.get("repair_prefill_tokens"))) for r in steps
        ),
        # older runs did not log the rollouts' prompt tokens: their prompt + decode axis lacks them
        "rollout_prompts_recorded": all("rollout_prefill_tokens" in r for r in steps),
        "repair_prompts_recorded": all(
            "repair_prefill_tokens" in r for r in steps if num(r.get("repairs")) > 0
        ),
        "code": read_code(run, summary),
        "min_success": repair_floor(run),
    }


def repair_floor(run: RunFolder) -> float | None:
    """The run's `repair.min_success` (the spending rule's floor) from its saved config; None
    for runs of versions without the rule or without a saved config."""
    if not run.has("train/config.yaml"):
        return None
    repair = (yaml.safe_load(run.text("train/config.yaml")) or {}).get("repair") or {}
    return repair.get("min_success")


def pooled_repair_success(repairs: list, rates: list) -> float | None:
    """Successful repairs over attempted ones across a run's steps (None without repairs). Not
    the mean of the per-step rates, which weighs a step with 2 attempts like one with 16."""
    attempted = sum(n or 0.0 for n in repairs)
    if not attempted:
        return None
    return sum((n or 0.0) * (r or 0.0) for n, r in zip(repairs, rates)) / attempted


# what a timed run must repeat, step by step, to lend a run its step seconds (take_seconds)
REPRODUCED = ("loss", "reward", "repairs", "repair_tokens")


def take_seconds(record: dict, reruns: list[RunFolder]) -> None:
    """A run's step seconds from a timed run of it (a finished run folder, e.g. a rerun with one
    thread on an idle machine and no periodic evaluations): the first of `reruns` that took the
    same steps, the same number, the same loss, reward, repairs and repair tokens at every
    one (equal floats: the run reproduced). Loss and reward alone are not enough: repairs that
    all fail leave them as they were, so a run with more of them would pass for one with fewer.
    Without one the run has no step seconds (None), and is left out of comparisons on them."""
    record["seconds_from"] = None
    same = False
    for rerun in filter(is_done, reruns):
        steps = _rows(rerun)[0]
        same = all([r.get(k) for r in steps] == record[k] for k in REPRODUCED)
        if same:
            break
    if not same:
        record["compute"]["seconds"] = None
        record["compute_curves"]["seconds"] = None
        record["step_time"] = record["time_repair"] = None
        return
    seconds_curve, seconds = on_axis(steps, "seconds", record["curve"])
    record["compute_curves"]["seconds"], record["compute"]["seconds"] = seconds_curve, seconds
    record["step_time"] = [r.get("step_time") for r in steps]
    record["time_repair"] = [r.get("time_repair") for r in steps]
    record["seconds_from"] = str(rerun.path)


def collect(
    out: Path, seconds_from: list[Path] = (), packed: Path | None = None
) -> tuple[list[dict], list[str]]:
    """(every finished run of the study at `out`, the folders not finished) from the folders
    alone, on disk or packed under `packed` (study_runs); with `seconds_from` (study folders),
    each run's step seconds are those of the first timed run of it there that reproduced it
    (take_seconds)."""
    done, pending = [], []
    for run in study_runs(out, packed):
        (done if is_done(run) else pending).append(run)
    records = [read_run(run) for run in done]
    if seconds_from:
        timed = [{r.path: r for r in study_runs(f, packed)} for f in seconds_from]
        for record, run in zip(records, done):
            rel = run.path.relative_to(out)
            reruns = [t[f / rel] for t, f in zip(timed, seconds_from) if f / rel in t]
            take_seconds(record, reruns)
    order = {r: i for i, r in enumerate(REGIME_ORDER)}
    records.sort(key=lambda r: (order.get(r["regime"], 99), r["arm"], r["seed"]))
    return records, [str(run.path) for run in pending]


def by_arm(records: list[dict]) -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {}
    for r in records:
        arms.setdefault(r["arm"], []).append(r)
    return arms
