"""The rollouts' prompt tokens of study runs that did not log them, rebuilt; then the study report.

    python bench/rollout_prompts.py docs/study/crn11 /tmp/crn11-prompts

Runs from before the step logged `rollout_prefill_tokens` cannot be compared at equal prompt +
decode tokens (bench/study.py leaves that axis out for them). Their prompts are known: a run's
seed fixes its prompt stream, so each step's prompts are rebuilt from the run's own settings
(its command line in study_run.json) and the model's tokenizer, and counted as generate()
counts them when a group's prompt is prefilled once for its G samples: (L - 1) + G per prompt of
L tokens. The counts go into a copy of the study's run folders (the given folders are never
changed; packed runs, studies/<name>.tar.xz, are read from their archive), and the copy gets
the study report. Per run it prints the rebuilt tokens (total, the least and the most in a step).

It assumes what held for those runs: the hf backend, groups whole in one generate() call
(rollout.generation_batch_size a multiple of G), no dynamic sampling's extra rounds (a round
the step drew again is not in the stream's record), one process. Not a measurement of the run:
the counting is today's code, applied to the prompts the run drew.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rebuilt_counts(command: str, tokenizer) -> dict[int, int]:
    """{step: prompt tokens the rollout ran} for the run of this `ibpo train` command line."""
    from ibpo.data import PromptStream, drop_long_prompts, load_splits, render_example
    from ibpo.generation.rollout import encode_prompts
    from ibpo.recipe import REMOVED, load_config

    # a key today's schema removed (train.eval_before...) is dropped: none of them shapes the
    # prompt stream, and load_config refuses them
    overrides = [
        a
        for a in command.split()
        if "=" in a and "." in a.split("=")[0] and a.split("=")[0] not in REMOVED
    ]
    cfg = load_config(None, overrides)
    if cfg.rollout.dynamic_sampling or cfg.rollout.backend != "hf":
        raise SystemExit(f"{command}: dynamic sampling or another backend: not rebuilt here")
    train, _ = load_splits(cfg.data, cfg.train.seed)
    train, _ = drop_long_prompts(train, tokenizer, cfg.data, "training")
    stream = PromptStream(train, cfg.train.seed, shuffle=True)
    B, G = cfg.train.prompts_per_step, cfg.rollout.group_size
    counts = {}
    for step in range(1, cfg.train.steps + 1):
        prompts = [render_example(tokenizer, ex, cfg.data) for ex in stream.take(B)]
        _, mask = encode_prompts(tokenizer, prompts, 1, "cpu")
        counts[step] = sum(int(n) - 1 for n in mask.sum(-1)) + B * G
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", type=Path, help="a study's --out (its runs/ folders)")
    p.add_argument("copy", type=Path, help="where the copy with rebuilt counts goes (replaced)")
    p.add_argument("--tokenizer", default=None, help="default: the runs' model (model.name)")
    p.add_argument("--packed", type=Path, default=Path("studies"), help="packed studies' folder")
    ns = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from study_report import report
    from study_runs import copy_runs

    from ibpo.modeling import load_tokenizer, resolve_model_path
    from ibpo.recipe import load_config

    copy_runs(ns.study, ns.copy, ns.packed)
    tokenizers = {}
    for meta in sorted(ns.copy.glob("*/*/study_run.json")):
        command = json.loads(meta.read_text())["command"]
        name = ns.tokenizer or load_config(None, [a for a in command.split() if "=" in a and
                                                  a.startswith("model.")]).model.name  # fmt: skip
        if name not in tokenizers:
            tokenizers[name] = load_tokenizer(resolve_model_path(name))
        counts = rebuilt_counts(command, tokenizers[name])
        path = meta.parent / "train" / "metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        for row in rows:
            if "generated_tokens" in row:  # a training line, not an evaluation's
                row["rollout_prefill_tokens"] = float(counts[row["step"]])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        spread = f"{min(counts.values())}-{max(counts.values())}"
        print(f"{meta.parent.name}: {sum(counts.values())} rebuilt ({spread} a step)")
    print(report(ns.copy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
