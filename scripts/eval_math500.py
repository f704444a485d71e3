"""Evaluate a model, optionally with a LoRA adapter, on MATH-500.

Data: HuggingFaceH4/MATH-500, test split (pinned revision).
Graded with the training grader; reports avg@n, pass@k, maj@n, mean completion length and the
share truncated (published reasoning scores use 32k+ new tokens: see --max-new-tokens).

    python scripts/eval_math500.py --adapter run/adapter --n 8
    python scripts/eval_math500.py --data rows.jsonl --limit 20   # local rows, Hub schema

Results go to --output-dir (default outputs/eval/math500-<model>[+<adapter>]):
samples.jsonl (a restarted run resumes from it), summary.json, results.md. Options: --help.
"""

import sys

from ibpo.evaluation.cli import main


def run(argv: list[str] | None = None) -> int:
    return main(argv, benchmark="math500")


if __name__ == "__main__":
    sys.exit(run())
