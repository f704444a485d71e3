"""Evaluation: generate, grade with the training graders, report avg@n / pass@k / maj@n.

Two entry points:
* `evaluate_accuracy`: greedy held-out accuracy used by the trainer before and after a run
  (deterministic; with several processes each evaluates its shard and the counts are summed).
* `main`: one benchmark (ibpo/benchmarks.py) for a base model with an optional LoRA adapter, n
  samples per problem. Every graded sample is appended to <output-dir>/samples.jsonl as soon as
  its batch finishes, so a killed run resumes where it stopped (a half-written last line is
  dropped; the rest is drawn afresh from --seed, so it differs from an uninterrupted run's
  draw). summary.json and results.md (one markdown row) are rewritten at the end. Generation
  uses HF `generate` (rollout.py) or, with --backend vllm, vLLM with the adapter as a LoRA request.

pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), computed as a
product so it never forms huge binomials. A sample counts as correct when its reward is 1.0;
avg@n is the mean reward. maj@n (math only) votes over extracted final answers; for code there is
no answer to vote on, so it is reported as null.

Not here: benchmark schemas and prompts (benchmarks.py), model loading (modeling.py), or
data-parallel evaluation across several GPUs (run one process per benchmark instead).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import torch

from ibpo.config import ConfigError, DataConfig
from ibpo.data import Example, render_prompt
from ibpo.rollout import Generator, generate

# (prompts) -> one (completion text, length in tokens, hit max_new_tokens) per prompt
Sampler = Callable[[list[str]], list[tuple[str, int, bool]]]


def evaluate_accuracy(
    generator: Generator,
    tokenizer,
    examples: list[Example],
    data_cfg: DataConfig,
    reward_fn: Callable[[str, str], float],
    max_new_tokens: int,
    batch_size: int,
    accelerator=None,
) -> dict[str, float]:
    """Greedy accuracy and mean completion length on `examples` -> {accuracy, n, mean_length}."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    shard = examples[rank::world]
    correct = tokens = 0.0
    for s in range(0, len(shard), batch_size):
        batch = shard[s : s + batch_size]
        prompts = [render_prompt(tokenizer, ex.question, data_cfg) for ex in batch]
        out = generator(tokenizer, prompts, 1, max_new_tokens, batch_size, do_sample=False)
        correct += sum(reward_fn(t, ex.answer) == 1.0 for t, ex in zip(out.texts, batch))
        tokens += out.completion_mask.sum().item()
    totals = torch.tensor([correct, tokens, float(len(shard))])
    if accelerator is not None and world > 1:
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    n = int(totals[2].item())
    return {
        "accuracy": totals[0].item() / max(n, 1),
        "n": n,
        "mean_length": totals[1].item() / max(n, 1),
    }


# --- metrics -------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got {n=} {c=} {k=}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks + ([n] if ks[-1] != n else [])


def _vote_key(answer: str) -> str:
    """Equal numbers vote together ("0.5", "1/2"); other answers by their text without spaces."""
    s = answer.strip().strip("$").replace(" ", "")
    try:
        return str(Fraction(s.replace(",", "")))
    except (ValueError, ZeroDivisionError):
        return s


def majority_correct(answers: list[str | None], rewards: list[float]) -> float:
    """1.0 when the most frequent extracted answer (earliest on ties) is a correct one."""
    keys = [None if a is None else _vote_key(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == top)
    return float(rewards[keys.index(winner)] >= 1.0)


def summarize(problems, records: dict, n: int, vote: bool) -> dict:
    """avg@n, pass@k, maj@n (when `vote`), mean length over problems x samples 0..n-1."""
    rows = [[records[(p.id, i)] for i in range(n)] for p in problems]
    rewards = [[r["reward"] for r in rs] for rs in rows]
    flat = [r for rs in rows for r in rs]
    out = {"problems": len(problems), "n": n, f"avg@{n}": _mean([r["reward"] for r in flat])}
    correct = [sum(x >= 1.0 for x in rs) for rs in rewards]
    for k in pass_ks(n):
        out[f"pass@{k}"] = _mean([pass_at_k(n, c, k) for c in correct])
    maj = [majority_correct([r["extracted"] for r in rs], rw) for rs, rw in zip(rows, rewards)]
    out[f"maj@{n}"] = _mean(maj) if vote else None
    out["mean_length"] = _mean([r["length"] for r in flat])
    out["truncated"] = _mean([float(r["truncated"]) for r in flat])
    return out


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# --- resumable per-sample file -------------------------------------------------------------------


def read_samples(path: Path) -> dict[tuple[str, int], dict]:
    """Finished samples by (problem id, sample index). A last line cut short by a kill is
    removed from the file, so appending continues on a clean line."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    out = {}
    for i, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out[(rec["problem_id"], rec["sample"])] = rec
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(
                f"{path}, line {i} is not a sample record; fix or delete it"
            ) from None
    return out


def append_samples(path: Path, records: list[dict]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def check_run(out_dir: Path, fingerprint: dict, overwrite: bool) -> None:
    """Samples in `out_dir` must come from the same settings (n and --limit may differ)."""
    run_file, samples = out_dir / "run.json", out_dir / "samples.jsonl"
    if overwrite:
        samples.unlink(missing_ok=True)
    elif samples.exists() and run_file.exists():
        old = json.loads(run_file.read_text())
        diff = {k: (old.get(k), v) for k, v in fingerprint.items() if old.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"{out_dir} holds samples of a different run ({detail}).\n"
                "  Fix: pass another --output-dir, or --overwrite to start again."
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(fingerprint, indent=2) + "\n")


# --- the benchmark loop --------------------------------------------------------------------------


def run_benchmark(
    problems, n: int, out_dir: Path, build_sampler: Callable[[], tuple[Sampler, object]],
    grade: Callable[[str, str], float], extract: Callable[[str], str | None],
    enable_thinking: bool | None, batch_size: int, progress: bool = True,
) -> dict:  # fmt: skip
    """Generate the missing (problem, sample) pairs chunk by chunk; -> all records by key.
    Grading runs in threads: code grading waits on sandbox subprocesses, not on Python."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    path = out_dir / "samples.jsonl"
    records = read_samples(path)
    todo = [(p, i) for p in problems for i in range(n) if (p.id, i) not in records]
    if not todo:
        return records
    sample, tokenizer = build_sampler()
    cfg = DataConfig(prompt_template="{question}", enable_thinking=enable_thinking)
    rendered = {p.id: render_prompt(tokenizer, p.prompt, cfg) for p, _ in todo}
    total = len(problems) * n
    bar = tqdm(total=total, initial=total - len(todo), unit="sample", disable=not progress)
    pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
    for s in range(0, len(todo), batch_size):
        chunk = todo[s : s + batch_size]
        outs = sample([rendered[p.id] for p, _ in chunk])
        rewards = pool.map(grade, [o[0] for o in outs], [p.gold for p, _ in chunk])
        new = [
            {"problem_id": p.id, "sample": i, "completion": text, "extracted": extract(text),
             "reward": float(r), "length": length, "truncated": bool(cut)}
            for (p, i), (text, length, cut), r in zip(chunk, outs, rewards)
        ]  # fmt: skip
        append_samples(path, new)
        records.update({(r["problem_id"], r["sample"]): r for r in new})
        bar.update(len(chunk))
        bar.set_postfix(reward=f"{_mean([r['reward'] for r in new]):.3f}")
    bar.close()
    pool.shutdown()
    return records


def hf_sampler(args) -> tuple[Sampler, object]:
    from ibpo.modeling import load_for_inference

    model, tok = load_for_inference(
        args.model, args.adapter, args.quantization, args.dtype, revision=args.model_revision
    )

    def sample(prompts: list[str]) -> list[tuple[str, int, bool]]:
        ro = generate(
            model, tok, prompts, 1, args.max_new_tokens, args.batch_size,
            do_sample=args.temperature > 0, temperature=args.temperature, top_p=args.top_p,
        )  # fmt: skip
        lengths = ro.completion_mask.sum(-1).long().tolist()
        return list(zip(ro.texts, lengths, ro.truncated.tolist()))

    return sample, tok


def vllm_sampler(args) -> tuple[Sampler, object]:
    """vLLM with the adapter as a LoRA request (never merged into a quantised base)."""
    from ibpo.modeling import load_tokenizer, resolve_model_path
    from ibpo.vllm_rollout import engine_kwargs, import_vllm

    vllm, LoRARequest = import_vllm()
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path, args.model_revision)
    lora, rank = None, None
    if args.adapter:
        adapter = Path(args.adapter)
        if not adapter.is_dir():
            from huggingface_hub import snapshot_download

            adapter = Path(snapshot_download(args.adapter))
        rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
        lora = LoRARequest("adapter", 1, str(adapter))
    kwargs = engine_kwargs(vllm, args.quantization, rank)
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    llm = vllm.LLM(model=path, revision=args.model_revision, seed=args.seed, dtype=args.dtype,
                   **kwargs)  # fmt: skip
    top_p = args.top_p if args.temperature > 0 else 1.0
    params = vllm.SamplingParams(
        temperature=args.temperature, top_p=top_p, max_tokens=args.max_new_tokens
    )

    def sample(prompts: list[str]) -> list[tuple[str, int, bool]]:
        # token ids, not text: the chat template already holds any BOS the model needs
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, lora_request=lora)
        done = [o.outputs[0] for o in outs]
        return [(o.text, len(o.token_ids), o.finish_reason == "length") for o in done]

    return sample, tok


# --- command line --------------------------------------------------------------------------------


def _slug(name: str) -> str:
    return Path(name.rstrip("/")).name or name.replace("/", "_")


def default_output_dir(benchmark: str, model: str, adapter: str | None) -> Path:
    slug = _slug(model) + (f"+{_slug(adapter)}" if adapter else "")
    return Path("outputs") / "eval" / f"{benchmark}-{slug}"


def build_parser(benchmark: str | None = None) -> argparse.ArgumentParser:
    from ibpo.benchmarks import BENCHMARKS
    from ibpo.embedded import EMBEDDED_NAME

    p = argparse.ArgumentParser(
        prog=f"eval_{benchmark}.py" if benchmark else "ibpo-eval",
        description=f"Evaluate a model (+ LoRA adapter) on {benchmark or 'a benchmark'}: "
        "avg@n, pass@k, maj@n, mean completion length.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    if benchmark is None:
        p.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    add = p.add_argument
    add("--model", default=EMBEDDED_NAME, help="Hub id, local folder, or the embedded default")
    add("--model-revision", help="model commit/branch on the Hub")
    add("--adapter", help="LoRA adapter: local folder or Hub id (loaded on top, never merged)")
    add("--quantization", choices=["nf4", "none"], default="none",
        help="nf4: 4-bit base as in QLoRA training; none: the base in --dtype")  # fmt: skip
    add("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    add("--backend", choices=["hf", "vllm"], default="hf")
    add("--max-model-len", type=int,
        help="vllm: the longest prompt + completion it accepts (default: the model's limit, whose "
        "KV cache may not fit a small card)")  # fmt: skip
    add("--data", help="local .jsonl/.json/.parquet with rows in the benchmark's Hub schema")
    add("--revision", help="dataset commit SHA (overrides the pinned one)")
    add("--subset", help="dataset config; LiveCodeBench: release tag (release_v5, v6, v5_v6)")
    add("--n", type=int, default=4, help="samples per problem")
    add("--temperature", type=float, default=0.6, help="0 = greedy")
    add("--top-p", type=float, default=0.95)
    add("--max-new-tokens", type=int, default=1024)
    think = p.add_mutually_exclusive_group()
    on_off = dict(dest="enable_thinking", action="store_const")
    think.add_argument(
        "--enable-thinking", const=True, help="Qwen3 templates: thinking on", **on_off
    )
    think.add_argument("--no-thinking", const=False, help="Qwen3 templates: thinking off", **on_off)
    add("--batch-size", type=int, default=16, help="sequences per generate call (and per save)")
    add("--limit", type=int, help="evaluate only the first LIMIT problems")
    add("--seed", type=int, default=0)
    add("--output-dir", help="default: outputs/eval/<benchmark>-<model>[+<adapter>]")
    add("--overwrite", action="store_true", help="discard samples already in --output-dir")
    add("--no-progress", dest="progress", action="store_false")
    return p


def evaluate(args) -> dict:
    """Run one benchmark from parsed arguments; -> the summary (also written to disk)."""
    from ibpo.benchmarks import BENCHMARKS, grader, load_problems

    bench = BENCHMARKS[args.benchmark]
    grade, extract = grader(bench)
    if args.n < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ConfigError("--n, --batch-size and --max-new-tokens must be >= 1")
    start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    problems = load_problems(bench, args.data, args.revision, args.subset, args.limit)
    out_dir = Path(args.output_dir or default_output_dir(bench.name, args.model, args.adapter))
    fingerprint = {
        "benchmark": bench.name, "data": args.data or bench.dataset,
        "revision": None if args.data else args.revision or bench.revision,
        "subset": args.subset, "model": args.model, "model_revision": args.model_revision,
        "adapter": args.adapter, "quantization": args.quantization, "dtype": args.dtype,
        "backend": args.backend, "temperature": args.temperature, "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens, "enable_thinking": args.enable_thinking,
    }  # fmt: skip
    check_run(out_dir, fingerprint, args.overwrite)
    builder = vllm_sampler if args.backend == "vllm" else hf_sampler
    records = run_benchmark(
        problems, args.n, out_dir, lambda: builder(args), grade, extract,
        args.enable_thinking, args.batch_size, args.progress,
    )  # fmt: skip
    metrics = summarize(problems, records, args.n, vote=bench.reward == "math")
    wall = round(time.time() - start, 1)
    summary = {**fingerprint, "seed": args.seed, **metrics, "wall_seconds": wall}
    summary["output_dir"] = str(out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown_row(summary, header=True))
    return summary


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown_row(s: dict, header: bool = False) -> str:
    n = s["n"]
    cols = ["benchmark", "model", "adapter", "n", f"avg@{n}", "pass@1", f"pass@{n}", f"maj@{n}",
            "mean len"]  # fmt: skip
    adapter = _slug(s["adapter"]) if s["adapter"] else "-"
    vals = [s["benchmark"], _slug(s["model"]), adapter, n, s[f"avg@{n}"], s["pass@1"],
            s[f"pass@{n}"], s[f"maj@{n}"], f"{s['mean_length']:.0f}"]  # fmt: skip
    row = "| " + " | ".join(_cell(v) for v in vals) + " |\n"
    if not header:
        return row
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + row


def main(argv: list[str] | None = None, benchmark: str | None = None) -> int:
    """`eval_<benchmark>.py [options]`: prints the markdown row and the output folder."""
    args = build_parser(benchmark).parse_args(argv)
    if benchmark is not None:
        args.benchmark = benchmark
    try:
        summary = evaluate(args)
    except (ConfigError, RuntimeError) as e:
        if not isinstance(e, ConfigError) and "embedded default model" not in str(e):
            raise
        print(f"eval: error: {e}", file=sys.stderr)
        return 2
    print(markdown_row(summary, header=True), end="")
    print(f"samples.jsonl, summary.json and results.md in {summary['output_dir']}")
    return 0
