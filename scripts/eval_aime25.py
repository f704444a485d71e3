"""Evaluate a model, optionally with a LoRA adapter, on AIME 2025.

Data: opencompass/AIME2025, configs AIME2025-I + AIME2025-II, test split.
Graded with the training grader; reports avg@n, pass@k, maj@n, mean completion length and the
share truncated (published reasoning scores use 32k+ new tokens: see --max-new-tokens).

    python scripts/eval_aime25.py --adapter run/adapter --n 16
    python scripts/eval_aime25.py --data rows.jsonl --limit 20   # local rows, Hub schema

Results go to --output-dir (default outputs/eval/aime25-<model>[+<adapter>]):
samples.jsonl (a restarted run resumes from it), summary.json, results.md. Options: --help.
"""

import sys

from ibpo.evaluation.cli import main


def run(argv: list[str] | None = None) -> int:
    return main(argv, benchmark="aime25")


if __name__ == "__main__":
    sys.exit(run())
