"""The evaluation command line: `scripts/eval_<benchmark>.py` and `ibpo eval` parse their options
here, build a sampler (HF `generate`, or vLLM with the adapter as a LoRA request), run the
benchmark (evaluation.run_benchmark) and write summary.json and results.md. Either sampler draws
each (problem, sample) from its own seed (evaluate.py's docstring: vLLM's per-request seed, or
SeededSampling's per-row generator for HF).

Not here: metrics, the resumable sample file and the generation loop (evaluate.py), benchmark
schemas and prompts (benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from ibpo.config import ConfigError
from ibpo.embedded import EMBEDDED_NAME
from ibpo.evaluation.adapter import fill_from_adapter
from ibpo.evaluation.benchmarks import BENCHMARKS, grader, load_problems, reward_fns
from ibpo.evaluation.evaluate import (
    SAMPLE_SEEDS,
    Sampler,
    check_run,
    run_benchmark,
    summarize,
)
from ibpo.generation import decode_engine, engine_kwargs, generate, import_vllm
from ibpo.generation.multiturn import ToolRollouts
from ibpo.modeling import load_for_inference, load_tokenizer, resolve_model_path
from ibpo.quiet import quiet_third_party
from ibpo.rewards.functions import RewardError
from ibpo.tools import resolve_tools


class SeededSampling:
    """A logits processor that makes greedy decoding sample, each row from its own seed: HF's
    temperature and top-p warpers, then Gumbel noise from the row's torch.Generator (one draw of
    vocabulary size per step), so argmax samples softmax(filtered logits / T) exactly as HF's
    multinomial does, but a row's tokens depend only on its logits and its seed, not on which or
    how many other rows share the batch (HF's sampling draws every row from one global stream)."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, device):
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        self.gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        vocab, dev = scores.shape[-1], scores.device
        u = torch.stack([torch.rand(vocab, generator=g, device=dev) for g in self.gens])
        return scores - torch.log(-torch.log(u))  # + Gumbel(0, 1); u = 0 never wins


def hf_sampler(args) -> tuple[Sampler, object]:
    """generation.generate, one call per chunk (run_benchmark's chunks hold --batch-size prompts):
    greedy decoding over SeededSampling's noisy logits, so that each completion is a sample that
    depends on its own seed only (greedy proper at temperature 0)."""

    model, tok = load_for_inference(
        args.model, args.adapter, args.quantization, args.dtype, revision=args.model_revision
    )
    device = next(p for p in model.parameters()).device
    engine = decode_engine(model, getattr(args, "decode", "auto"))
    if getattr(args, "tools", None):
        return tool_sampler(args, model, tok, engine), tok

    def sample(prompts: list[str], seeds: list[int]) -> list[tuple[str, int, bool]]:
        from transformers import LogitsProcessorList

        processor = None
        if args.temperature > 0:
            seeded = SeededSampling(seeds, args.temperature, args.top_p, device)
            processor = LogitsProcessorList([seeded])
        ro = generate(
            model,
            tok,
            prompts,
            1,
            args.max_new_tokens,
            len(prompts),
            do_sample=False,
            logits_processor=processor,
            engine=engine,
        )
        return list(zip(ro.texts, ro.lengths, ro.host_truncated()))

    return sample, tok


def tool_sampler(args, model, tok, engine) -> Sampler:
    """hf_sampler's with --tools: multi-turn answers (generation/multiturn.py) whose calls run
    as in training (the python tool in the sandbox), the prompt describing the tools
    (`sample.render`). Each row gives its last assistant turn (what graders read), its length
    (every turn's tokens), whether it was cut off, and its conversation and call counts."""
    chat = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}
    tools = resolve_tools(args.tools)
    gen = ToolRollouts(model, tools, args.max_tool_calls, 8, 30.0, chat, engine=engine)
    device = next(p for p in model.parameters()).device

    def sample(prompts: list[str], seeds: list[int]) -> list[tuple]:
        processor = None
        if args.temperature > 0:
            processor = [SeededSampling(seeds, args.temperature, args.top_p, device)]
        ro = gen(tok, prompts, 1, args.max_new_tokens, len(prompts), do_sample=False,
                 logits_processor=processor)  # fmt: skip
        out = []
        for trace, n, cut in zip(ro.tool_traces, ro.lengths, ro.host_truncated()):
            said = [m["content"] for m in trace.messages if m["role"] == "assistant"]
            extra = {"conversation": trace.messages, "tool_calls": trace.calls,
                     "tool_errors": trace.errors}  # fmt: skip
            out.append((said[-1] if said else "", n, cut, extra))
        return out

    def render(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        return tok.apply_chat_template(messages, tools=gen.schemas, add_generation_prompt=True,
                                       tokenize=False, **chat)  # fmt: skip

    sample.render = render
    return sample


def vllm_sampler(args) -> tuple[Sampler, object]:
    """vLLM with the adapter as a LoRA request (never merged into a quantised base)."""

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
    llm = vllm.LLM(
        model=path, revision=args.model_revision, seed=args.seed, dtype=args.dtype, **kwargs
    )
    top_p = args.top_p if args.temperature > 0 else 1.0

    def sample(prompts: list[str], seeds: list[int]) -> list[tuple[str, int, bool]]:
        # token ids, not text: the chat template already holds any BOS the model needs
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        # one request per sample (n=1), seeded with its own seed: vLLM draws a seeded request
        # from its own generator, whatever else is in the batch
        params = [
            vllm.SamplingParams(
                temperature=args.temperature,
                top_p=top_p,
                max_tokens=args.max_new_tokens,
                seed=s if args.temperature > 0 else None,
            )
            for s in seeds
        ]
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

    p = argparse.ArgumentParser(
        prog=f"eval_{benchmark}.py" if benchmark else "ibpo-eval",
        description=f"Evaluate a model (+ LoRA adapter) on {benchmark or 'a benchmark'}: "
        "avg@n, pass@k, maj@n, mean completion length.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    if benchmark is None:
        p.add_argument("--benchmark", required=True, choices=sorted(BENCHMARKS))
    add = p.add_argument
    add(
        "--model",
        help="Hub id or local folder (default: the base the --adapter was trained on, else the "
        f"embedded {EMBEDDED_NAME})",
    )
    add("--model-revision", help="model commit/branch on the Hub")
    add("--adapter", help="LoRA adapter: local folder or Hub id (loaded on top, never merged)")
    add(
        "--quantization",
        choices=["nf4", "none"],
        help="nf4: 4-bit base as in QLoRA training; none: the base in --dtype (default: as the "
        "--adapter's run recipe records, else none)",
    )
    add("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    add("--backend", choices=["hf", "vllm"], default="hf")
    add(
        "--decode",
        choices=["auto", "graph", "eager"],
        default="auto",
        help="hf: graph = the package's decode engine (CUDA graphs on CUDA), eager = HF generate, "
        "auto = graph on CUDA, eager on CPU (as rollout.decode)",
    )
    add(
        "--max-model-len",
        type=int,
        help="vllm: the longest prompt + completion it accepts (default: the model's limit, whose "
        "KV cache may not fit a small card)",
    )
    add("--data", help="local .jsonl/.json/.parquet with rows in the benchmark's Hub schema")
    add("--revision", help="dataset commit SHA (overrides the pinned one)")
    add("--subset", help="dataset config; LiveCodeBench: release tag (release_v5, v6, v5_v6)")
    add(
        "--start-date",
        help="LiveCodeBench: only problems whose contest_date is on or after this "
        "YYYY-MM-DD (published scores use date windows, not release tags)",
    )
    add("--end-date", help="LiveCodeBench: only problems whose contest_date is on or before this")
    add("--n", type=int, default=4, help="samples per problem")
    add("--temperature", type=float, default=0.6, help="0 = greedy")
    add("--top-p", type=float, default=0.95)
    add(
        "--max-new-tokens",
        type=int,
        default=1024,
        help="published reasoning scores use 32k+ with thinking on: a completion cut off "
        "mid-thought scores 0 (the 'truncated' column)",
    )
    think = p.add_mutually_exclusive_group()
    on_off = dict(dest="enable_thinking", action="store_const")
    think.add_argument(
        "--enable-thinking", const=True, help="Qwen3 templates: thinking on", **on_off
    )
    think.add_argument("--no-thinking", const=False, help="Qwen3 templates: thinking off", **on_off)
    add("--batch-size", type=int, default=16, help="sequences per generate call (and per save)")
    add(
        "--tools",
        nargs="+",
        metavar="TOOL",
        help="hf: tools the model may call, as rollout.tools names them (python: its code run "
        "in the sandbox); summary.json reports tool calls per problem (docs/tools.md)",
    )
    add("--max-tool-calls", type=int, default=4, help="with --tools: calls per completion")
    add("--limit", type=int, help="evaluate only the first LIMIT problems")
    add(
        "--seed",
        type=int,
        default=0,
        help="sample i of problem p is drawn with its own seed, a hash of (seed, p, i): resuming, "
        "growing --n or another --batch-size give the same samples",
    )
    add("--output-dir", help="default: outputs/eval/<benchmark>-<model>[+<adapter>]")
    add("--overwrite", action="store_true", help="discard samples already in --output-dir")
    add("--no-progress", dest="progress", action="store_false")
    return p


def evaluate(args) -> dict:
    """Run one benchmark from parsed arguments; -> the summary (also written to disk)."""

    bench = BENCHMARKS[args.benchmark]
    _, extract = grader(bench)
    for note in fill_from_adapter(args):  # --model/--quantization not given: the adapter's
        print(f"eval: {note}", file=sys.stderr)
    args.model = args.model or EMBEDDED_NAME
    if args.n < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ConfigError("--n, --batch-size and --max-new-tokens must be >= 1")
    start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    problems = load_problems(
        bench, args.data, args.revision, args.subset, args.limit, (args.start_date, args.end_date)
    )
    out_dir = Path(args.output_dir or default_output_dir(bench.name, args.model, args.adapter))
    fingerprint = _fingerprint(args, bench)
    check_run(out_dir, fingerprint, args.overwrite)
    builder = vllm_sampler if args.backend == "vllm" else hf_sampler
    records = run_benchmark(
        problems,
        args.n,
        out_dir,
        lambda: builder(args),
        reward_fns(bench),
        extract,
        args.enable_thinking,
        args.batch_size,
        args.progress,
        seed=args.seed,
    )
    metrics = summarize(problems, records, args.n, vote=bench.reward == "math")
    wall = round(time.time() - start, 1)
    summary = {**fingerprint, **metrics, "wall_seconds": wall}
    summary["output_dir"] = str(out_dir)
    if args.adapter and Path(args.adapter).is_dir():  # how `ibpo push` finds this evaluation
        summary["adapter_path"] = str(Path(args.adapter).resolve())
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown_row(summary, header=True))
    return summary


def _fingerprint(args, bench) -> dict:
    """The settings an evaluation's samples come from (check_run: the samples already in its
    output folder must share them; summary.json opens with them)."""
    fingerprint = {
        "benchmark": bench.name,
        "data": args.data or bench.dataset,
        "revision": None if args.data else args.revision or bench.revision,
        "subset": args.subset,
        "model": args.model,
        "model_revision": args.model_revision,
        "adapter": args.adapter,
        "quantization": args.quantization,
        "dtype": args.dtype,
        "backend": args.backend,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
        "enable_thinking": args.enable_thinking,
        "seed": args.seed,
        "start_date": args.start_date,
        "end_date": args.end_date,
    }
    if args.tools:  # a run without tools keeps its fingerprint: earlier folders still match
        if args.backend != "hf":
            raise ConfigError("--tools runs with --backend hf (multi-turn rollouts)")
        fingerprint.update(tools=list(args.tools), max_tool_calls=args.max_tool_calls)
    if args.temperature > 0:  # greedy samples need no seeds: earlier greedy folders still match
        fingerprint["sample_seeds"] = SAMPLE_SEEDS
    return fingerprint


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown_row(s: dict, header: bool = False) -> str:
    n = s["n"]
    adapter = _slug(s["adapter"]) if s["adapter"] else "-"
    cells = {
        "benchmark": s["benchmark"],
        "model": _slug(s["model"]),
        "adapter": adapter,
        "n": n,
        f"avg@{n}": s[f"avg@{n}"],
        "pass@1": s["pass@1"],
        f"pass@{n}": s[f"pass@{n}"],
        f"maj@{n}": s[f"maj@{n}"],
        "mean len": f"{s['mean_length']:.0f}",
    }
    if "truncated" in s:  # summaries written before the column existed lack it
        cells["truncated"] = s["truncated"]
    cols, vals = list(cells), list(cells.values())  # with n = 1, pass@1 and pass@n are one
    row = "| " + " | ".join(_cell(v) for v in vals) + " |\n"
    if not header:
        return row
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + row


def main(argv: list[str] | None = None, benchmark: str | None = None) -> int:
    """`eval_<benchmark>.py [options]`: prints the markdown row and the output folder."""
    quiet_third_party()  # known harmless third-party noise (ibpo/quiet.py); -W shows it
    args = build_parser(benchmark).parse_args(argv)
    if benchmark is not None:
        args.benchmark = benchmark
    try:
        summary = evaluate(args)
    except (ConfigError, RewardError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "embedded default model" not in str(e):
            raise
        print(f"eval: error: {e}", file=sys.stderr)
        return 2
    print(markdown_row(summary, header=True), end="")
    if summary["truncated"] > 0.05:
        print(
            f"warning: {summary['truncated']:.0%} of the completions hit --max-new-tokens "
            f"({summary['max_new_tokens']}) and were graded unfinished; published scores "
            "use far longer generations",
            file=sys.stderr,
        )
    if summary.get("grader_errors"):
        print(
            f"warning: the grader itself failed on {summary['grader_errors']} samples (scored 0; "
            "each record's grader_error says why)",
            file=sys.stderr,
        )
    print(f"samples.jsonl, summary.json and results.md in {summary['output_dir']}")
    return 0
