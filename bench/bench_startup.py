"""Start-up on a 100,000-row dataset: the seconds from `ibpo.train(...)` to the first step and the
memory the process holds then, for rows given in Python (a datasets.Dataset, and the same rows
streamed as an IterableDataset) and for a local .jsonl file.

    HF_HUB_OFFLINE=1 python bench/bench_startup.py               # 100,000 rows, each case once
    HF_HUB_OFFLINE=1 python bench/bench_startup.py --rows 20000 --cases dataset,file

Each case runs in a fresh process: a tiny Qwen3 built from a config (random weights, so the
model's own load is small) with the embedded SmolLM2-135M-Instruct tokenizer and its chat
template (the embedded model must be cached: `ibpo train` once), the prompts asked through a
template as the recipes ask theirs, one training step. Printed per case: `startup_s` (the call
to the callbacks' on_train_begin: data, model, held-out evaluation of 8 problems), `step_s` (the
first step), `rss_before_mb` (the process with its rows built, before the call), `rss_start_mb`
(at on_train_begin) and `peak_rss_mb` (the process's peak by then), then one JSON line with
every figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("dataset", "iterable", "file")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_rows(n: int) -> list[dict]:
    return [
        {
            "question": f"Ana has {i % 97} apples and buys {i % 13} bags of {i % 7 + 2} apples "
            f"each. She gives away {i % 5} apples. How many apples does she have now? (#{i})",
            "answer": str(i % 97 + (i % 13) * (i % 7 + 2) - i % 5),
            "source": f"synthetic-{i % 3}",
        }
        for i in range(n)
    ]


def prepare(folder: Path, rows: int) -> tuple[Path, Path]:
    """A tiny Qwen3 with the embedded tokenizer, and the rows as a .jsonl file."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from ibpo.embedded import embedded_model_path

    tok_dir = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model_dir = folder / "model"
    Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, model_dir / name)
    data = folder / "rows.jsonl"
    with open(data, "w") as f:
        for row in make_rows(rows):
            f.write(json.dumps(row) + "\n")
    return model_dir, data


def child(case: str, model_dir: str, data: str, rows: int, out: str) -> dict:
    """One case in this process -> its figures."""
    import datasets

    import ibpo

    given = None
    overrides = {
        "model.name": model_dir, "model.quantization": "none", "train.steps": 1,
        "train.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 4,
        "rollout.eval_max_new_tokens": 4, "data.eval_size": 8, "objective.name": "grpo",
        "data.prompt_template": "{question}\nPut the answer in \\boxed{}.",
        "train.log_reference_kl": False, "run.output_dir": out, "run.save_every": 0,
    }  # fmt: skip
    if case == "file":
        overrides["data.dataset"] = data
    else:
        given = datasets.Dataset.from_list(make_rows(rows))
        if case == "iterable":
            given = given.to_iterable_dataset()
    marks: dict[str, float] = {}

    class Clock:
        def on_train_begin(self, args, state, control, **kwargs):
            marks.update(begin=time.perf_counter(), rss_start=rss_mb(), peak=peak_mb())

        def on_step_end(self, args, state, control, **kwargs):
            marks["step"] = time.perf_counter()

    before = rss_mb()
    t0 = time.perf_counter()
    result = ibpo.train(overrides=overrides, dataset=given, callbacks=[Clock()])
    assert result.status == "completed", result.summary
    return {
        "case": case,
        "rows": rows,
        "startup_s": round(marks["begin"] - t0, 2),
        "step_s": round(marks["step"] - marks["begin"], 2),
        "rss_before_mb": round(before),
        "rss_start_mb": round(marks["rss_start"]),
        "peak_rss_mb": round(marks["peak"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--child", nargs=4, metavar=("CASE", "MODEL", "DATA", "OUT"))
    args = p.parse_args(argv)
    if args.child:
        case, model_dir, data, out = args.child
        print(json.dumps(child(case, model_dir, data, args.rows, out)))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = prepare(Path(tmp), args.rows)
        for case in args.cases.split(","):
            cmd = [sys.executable, __file__, "--rows", str(args.rows), "--child", case,
                   str(model_dir), str(data), str(Path(tmp) / f"run-{case}")]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{case}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = results[-1]
            print(
                f"{case:9s} rows {r['rows']:>7,}  start-up {r['startup_s']:6.2f} s  first step "
                f"{r['step_s']:5.2f} s  RSS before {r['rss_before_mb']:5d} MB, at start "
                f"{r['rss_start_mb']:5d} MB, peak {r['peak_rss_mb']:5d} MB"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
