"""Evaluate a model, optionally with a LoRA adapter, on GSM8K.

Data: openai/gsm8k, config main, test split; gold answer after '####'.
Graded with the training grader; reports avg@n, pass@k, maj@n, mean completion length and the
share truncated (published reasoning scores use 32k+ new tokens: see --max-new-tokens).

    python scripts/eval_gsm8k.py --adapter run/adapter --n 1 --temperature 0
    python scripts/eval_gsm8k.py --data rows.jsonl --limit 20   # local rows, Hub schema

Results go to --output-dir (default outputs/eval/gsm8k-<model>[+<adapter>]):
samples.jsonl (a restarted run resumes from it), summary.json, results.md. Options: --help.
"""

import sys

from ibpo.evaluation.cli import main


def run(argv: list[str] | None = None) -> int:
    return main(argv, benchmark="gsm8k")


if __name__ == "__main__":
    sys.exit(run())
