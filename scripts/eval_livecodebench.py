"""Evaluate a model, optionally with a LoRA adapter, on LiveCodeBench (code generation, lite).

Data: livecodebench/code_generation_lite; --subset is the release tag
(default v6; also release_v5, v5_v6, ...).
Graded in the sandbox with the training grader; reports avg@n, pass@k (maj@n is for math
only), mean completion length and the share truncated.

    python scripts/eval_livecodebench.py --model Qwen/Qwen3-1.7B --subset release_v5
    python scripts/eval_livecodebench.py --model Qwen/Qwen3-1.7B --subset release_v6 \
        --start-date 2024-10-01 --end-date 2025-02-01   # a contest-date window, as published
    python scripts/eval_livecodebench.py --data rows.jsonl --limit 20   # local rows, Hub schema

Results go to --output-dir (default outputs/eval/livecodebench-<model>[+<adapter>]):
samples.jsonl (a restarted run resumes from it), summary.json, results.md. Options: --help.
"""

import sys

from ibpo.evaluation.cli import main


def run(argv: list[str] | None = None) -> int:
    return main(argv, benchmark="livecodebench")


if __name__ == "__main__":
    sys.exit(run())
