"""Rollout-vs-trainer mismatch of each CPU generation path, on the embedded SmolLM2-135M.

    python bench/bench_mismatch.py                 # 3 steps per path
    python bench/bench_mismatch.py --steps 5 train.learning_rate=1e-3
    python bench/bench_mismatch.py --smoke --model PATH   # tiny 1-step check (CI)

Each path trains the default demo recipe for a few steps (`ibpo.trainer.run_recipe`, no held-out
evaluation) and reads the per-step mismatch metrics (ibpo/algo/mismatch.py) from metrics.jsonl:

    fp32            model.quantization=none: generate() and the update on the same fp32 weights
    nf4 folded      4-bit NF4 base, generate() on the dequantised base with the adapter folded in
                    (the CPU default), the update on the dequantised
                    base with the adapter unfolded
    nf4             4-bit NF4 base, generate() and the update on bitsandbytes' 4-bit layers
                    (the dequantised copy turned off, as for a base too large for it)
    nf4 dropped     as "nf4 folded", but generation runs with the adapter disabled: what a
                    generation path that ignores the LoRA looks like (the alarm's case)

Step 1 generates before any update (LoRA B = 0), so a dropped adapter shows from step 2 on.
Prints a table (max over steps of each figure, and the KL of each step), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

PATHS = {
    "fp32": ["model.quantization=none"],
    "nf4 folded": ["model.quantization=nf4"],
    "nf4": ["model.quantization=nf4"],  # with the dequantised copy off (run_path)
    "nf4 dropped": ["model.quantization=nf4"],
}
FIGURES = ("mismatch_kl", "mismatch_abs_mean", "mismatch_abs_max", "mismatch_share")


@contextmanager
def adapter_dropped():
    """Generation with the adapter disabled (rollouts from the bare base)."""
    import ibpo.step as step
    from ibpo.modeling import reference_mode

    real = step.generating

    @contextmanager
    def without_adapter(model, *args, **kwargs):  # step.generating's arguments, as given
        with real(model, *args, **kwargs) as generate, reference_mode(model):
            yield generate

    step.generating = without_adapter
    try:
        yield
    finally:
        step.generating = real


def run_path(name: str, overrides: list[str], steps: int, out: Path) -> list[dict]:
    from ibpo.recipe import load_config
    from ibpo.trainer import run_recipe

    cfg = load_config(
        None,
        [
            *PATHS[name],
            "data.eval_size=0",
            f"train.steps={steps}",
            f"run.output_dir={out}",
            *overrides,
        ],
    )
    import ibpo.modeling as modeling
    import ibpo.run.alarm as alarm

    limit, warn = modeling.AUTO_DEQUANTIZE_MAX_BYTES, alarm.WARN_KL
    alarm.WARN_KL = 0.0  # measured here, not warned about
    if name == "nf4":  # bitsandbytes' own 4-bit path, no dequantised copy
        modeling.AUTO_DEQUANTIZE_MAX_BYTES = -1
    try:
        if name.endswith("dropped"):
            with adapter_dropped():
                run_recipe(cfg)
        else:
            run_recipe(cfg)
    finally:
        modeling.AUTO_DEQUANTIZE_MAX_BYTES, alarm.WARN_KL = limit, warn
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "mismatch_kl" in r]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="section.key=value for every path")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--paths", default=",".join(PATHS), help="comma-separated, from: " + ", ".join(PATHS)
    )
    p.add_argument("--smoke", action="store_true", help="1 step, tiny shapes (CI)")
    p.add_argument("--model", help="model.name for every path (default: the embedded model)")
    a = p.parse_args(argv)
    overrides = list(a.overrides)
    if a.model:
        overrides.append(f"model.name={a.model}")
    if a.smoke:
        a.steps = 1
        overrides += [
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            "rollout.max_new_tokens=4",
        ]
    names = [n.strip() for n in a.paths.split(",") if n.strip()]
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        print(f"unknown path(s) {unknown}; choose from: {', '.join(PATHS)}", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="ibpo-mismatch-") as tmp:
        for i, name in enumerate(names):
            rows = run_path(name, overrides, a.steps, Path(tmp) / f"path-{i}")
            results[name] = {
                "max": {k: max(r[k] for r in rows) for k in FIGURES},
                "kl_per_step": [r["mismatch_kl"] for r in rows],
            }
    print(
        f"{'path':<14} {'KL max':>10} {'mean|d| max':>12} {'max|d|':>9} {'share>2x':>9}  KL by step"
    )
    for name, r in results.items():
        m = r["max"]
        steps = " ".join(f"{x:.2e}" for x in r["kl_per_step"])
        print(
            f"{name:<14} {m['mismatch_kl']:>10.2e} {m['mismatch_abs_mean']:>12.2e} "
            f"{m['mismatch_abs_max']:>9.3f} {m['mismatch_share']:>9.2%}  {steps}"
        )
    print(json.dumps({"steps": a.steps, "overrides": overrides, "paths": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
