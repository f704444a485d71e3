"""The default `ibpo train` (the embedded CPU demo) over several seeds: wall time, held-out accuracy
before and after, entropy and KL, as a new user would see them.

    HF_HUB_OFFLINE=1 python bench/bench_demo.py                      # seeds 0, 1, 2
    HF_HUB_OFFLINE=1 python bench/bench_demo.py --seeds 0,1,2,3,4 train.learning_rate=2e-4
    HF_HUB_OFFLINE=1 python bench/bench_demo.py --smoke --model PATH   # tiny check (CI)

Each seed runs `ibpo train train.seed=S [overrides]` in a fresh process, exactly as README command 1
runs it (the embedded model must already be cached: a first run converts it, and that time is not
the demo's), and is timed from process start to exit. Its summary.json and metrics.jsonl give:
accuracy before/after (greedy, on the held-out set), entropy of the first step and the mean of the
last three steps, KL to the reference at the end, and the wall time. The printed table ends with
the range over seeds, then one JSON line with every figure. The default output of every run is
kept in <out>/seed-S/stdout.txt and stderr.txt (`--out`, default a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_seed(seed: int, overrides: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "ibpo.cli",
        "train",
        f"train.seed={seed}",
        f"run.output_dir={out / 'run'}",
        *overrides,
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (out / "stdout.txt").write_text(done.stdout)
    (out / "stderr.txt").write_text(done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    summary = json.loads((out / "run" / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "entropy" in r]
    last = steps[-3:]
    return {
        "seed": seed,
        "wall_s": round(wall, 1),
        "before": summary["eval_before"]["accuracy"],
        "after": summary["eval_after"]["accuracy"],
        "n": summary["eval_after"]["n"],
        "entropy_first": steps[0]["entropy"],
        "entropy_last3": sum(r["entropy"] for r in last) / len(last),
        "kl_last": steps[-1].get("kl"),
        "reward_first": steps[0]["reward"],
        "reward_last3": sum(r["reward"] for r in last) / len(last),
        "stderr_lines": len([x for x in done.stderr.splitlines() if x.strip()]),
        # a step's mean time and its phases, the peak memory, and the worst step's mismatch
        # and cancellation residual
        **{k: _mean(steps, k) for k in STEP_TIMES},
        "peak_memory_gb": max(r.get("peak_memory_gb", 0.0) for r in steps),
        "mismatch_kl_max": max(r.get("mismatch_kl", 0.0) for r in steps),
        "residual_max": max(r.get("residual", 0.0) for r in steps),
    }


STEP_TIMES = ("step_time", "time_generate", "time_repair", "time_frozen_logprobs", "time_update")


def _mean(steps: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in steps) / len(steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", help="keep each run here (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="2 steps, tiny shapes (CI)")
    p.add_argument("--model", help="model.name (default: the embedded model)")
    a = p.parse_args(argv)
    overrides = list(a.overrides)
    if a.model:
        overrides.append(f"model.name={a.model}")
    if a.smoke:
        overrides += [
            "train.steps=2",
            "data.eval_size=4",
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            "rollout.max_new_tokens=4",
            "rollout.eval_max_new_tokens=4",
        ]
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="ibpo-demo-") as tmp:
        root = Path(a.out or tmp)
        results = [run_seed(s, overrides, root / f"seed-{s}") for s in seeds]
    print(
        f"{'seed':>4} {'wall s':>7} {'before':>7} {'after':>6} {'gain':>6} "
        f"{'H first':>8} {'H last3':>8} {'H ratio':>8} {'KL end':>7} {'stderr':>6}"
    )
    for r in results:
        kl = "-" if r["kl_last"] is None else f"{r['kl_last']:.3f}"
        print(
            f"{r['seed']:>4} {r['wall_s']:>7.0f} {r['before']:>7.2f} {r['after']:>6.2f} "
            f"{r['after'] - r['before']:>+6.2f} {r['entropy_first']:>8.2f} "
            f"{r['entropy_last3']:>8.2f} {r['entropy_last3'] / r['entropy_first']:>8.2f} "
            f"{kl:>7} {r['stderr_lines']:>6}"
        )

    def span(key):
        values = [f(r) for r in results for f in [key]]
        return f"{min(values):.2f} to {max(values):.2f}"

    print(
        f"range over {len(results)} seeds: gain {span(lambda r: r['after'] - r['before'])}, "
        f"after {span(lambda r: r['after'])}, entropy ratio "
        f"{span(lambda r: r['entropy_last3'] / r['entropy_first'])}, wall "
        f"{min(r['wall_s'] for r in results):.0f} to {max(r['wall_s'] for r in results):.0f} s"
    )
    print(
        f"per step, mean: {span(lambda r: r['step_time'])} s (generate "
        f"{span(lambda r: r['time_generate'])}, repairs {span(lambda r: r['time_repair'])}, "
        f"frozen log-probs {span(lambda r: r['time_frozen_logprobs'])}, update "
        f"{span(lambda r: r['time_update'])}); peak memory "
        f"{span(lambda r: r['peak_memory_gb'])} GB; worst mismatch KL "
        f"{max(r['mismatch_kl_max'] for r in results):.1e}; worst residual "
        f"{max(r['residual_max'] for r in results):.1e}"
    )
    print(json.dumps({"overrides": overrides, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
