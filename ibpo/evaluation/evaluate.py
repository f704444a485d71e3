"""Evaluation: generate, grade with the training graders, report avg@n / pass@k / maj@n.

Both entry points grade as a training step does, by rewards.functions.grade_completions: the
same verdicts on the same completions, grader failures included (scored 0 and reported).

Two entry points:
* `evaluate_accuracy`: greedy held-out accuracy used by the trainer before and after a run
  (deterministic; with several processes each evaluates its shard and the counts are summed).
* `run_benchmark` (driven by evaluation/cli.py's `main`, the eval scripts' entry point): one
  benchmark (benchmarks.py) for a base model with an optional LoRA adapter, n samples per
  problem. Every graded sample is appended to <output-dir>/samples.jsonl as soon as
  its batch finishes, so a killed run resumes where it stopped (a half-written last line is
  dropped). summary.json and results.md (one markdown row) are rewritten at the end. Generation
  uses HF `generate` (generation/hf.py) or, with --backend vllm, vLLM with the adapter as a LoRA
  request.

Sampling seeds: sample i of problem p is drawn with its own seed, `sample_seed(--seed, p, i)` (a
SHA-256 of the three, never Python's salted hash), whatever else shares its batch: vLLM gets it
as the request's `seed` (one request per sample), HF `generate` as one torch.Generator per row
that draws the Gumbel noise of that row's tokens (cli.SeededSampling: temperature and top-p as
HF's own warpers, then the Gumbel-max trick, which samples exactly softmax(filtered logits)). So
a sample is a function of (problem, sample index, seed): growing --n adds new samples, a resumed
run draws only the missing ones with their own seeds, and --batch-size changes nothing but
speed. The one exception is floating point: another batch (other prompts, other padding) can
move logits in their last bits, which on a GPU can flip a near-tied token and the rest of
that completion; on the same batches the draw is exact. The run fingerprint says which seeding
made the samples (`sample_seeds`), so a folder of samples drawn before this scheme is refused
instead of mixed.

pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), computed as a
product so it never forms huge binomials. A sample counts as correct when its reward is 1.0;
avg@n is the mean reward. maj@n (math only) votes over extracted final answers in two ways:
`maj@n` is the usual convention (Qwen's math eval, lighteval): a vote per sample on the answer
string (stripped), a sample without an answer voting "", ties to the earliest, the winning string
graded; `maj@n_grader` groups answers the grader calls equal (`\\dfrac{1}{2}`, `0.5`) and lets
unanswered samples abstain, which is more generous and, the grader's equality not being transitive,
depends on the samples' order. Summaries written before `maj@n_grader` existed hold the grader
vote under `maj@n`. For code there is no answer to vote on, so both are null.

Not here: benchmark schemas and prompts (benchmarks.py), model loading (modeling.py), or
data-parallel evaluation across several GPUs (run one process per benchmark instead).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from ibpo.config import ConfigError, DataConfig
from ibpo.data import Example, render_example, render_prompt
from ibpo.generation import Generator
from ibpo.generation.multiturn import ToolRollouts, tool_columns
from ibpo.rewards.functions import Grades, RewardSet, grade_completions, logged_metrics
from ibpo.rewards.math import answers_match, text_to_grade

# (prompts, one sampling seed per prompt) -> (completion text, length in tokens, hit
# max_new_tokens) per prompt; the completion for a prompt must depend only on it and its seed
Sampler = Callable[[list[str], list[int]], list[tuple[str, int, bool]]]

# the run fingerprint's name for how samples are seeded (see the module docstring)
SAMPLE_SEEDS = "sha256(seed, problem_id, sample)"


def sample_seed(seed: int, problem_id: str, index: int) -> int:
    """The sampling seed of sample `index` of a problem: 63 bits of SHA-256, stable across
    processes, machines and batchings."""
    digest = hashlib.sha256(f"{seed}\0{problem_id}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def evaluate_accuracy(
    generator: Generator,
    tokenizer,
    examples: list[Example],
    data_cfg: DataConfig,
    reward_fns: RewardSet,
    max_new_tokens: int,
    batch_size: int,
    accelerator=None,
) -> dict:
    """Greedy accuracy and mean completion length on `examples` (a run with tools: answered
    with them, as its rollouts are) -> {accuracy, n, mean_length,
    grader_errors, metrics}. A completion is correct when the run's weighted reward
    (rewards/functions.py) reaches its correct threshold (reward.correct_threshold); one no
    reward applies to is not. `grader_errors`: the graders' own failures (scored 0), over all
    processes; `metrics` (when they logged any): the mean of what the reward functions logged
    (log_metric) on this process."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    shard = examples[rank::world]
    correct = tokens = 0.0
    gradings = []
    for s in range(0, len(shard), batch_size):
        batch = shard[s : s + batch_size]
        if isinstance(generator, ToolRollouts):  # answers with the run's tools, as rollouts do
            prompts = [generator.render(tokenizer, ex, data_cfg) for ex in batch]
        else:
            prompts = [render_example(tokenizer, ex, data_cfg) for ex in batch]
        out = generator(tokenizer, prompts, 1, max_new_tokens, batch_size, do_sample=False)
        tools = tool_columns(out.tool_traces)
        grades = grade_completions(reward_fns, batch, prompts, out.texts, out.host_tokens(), tools)
        correct += sum(t >= reward_fns.correct for t in grades.totals)
        tokens += float(sum(out.lengths))
        gradings.append(grades)
    logged = logged_metrics(gradings)
    failed = float(sum(len(g.failures) for g in gradings))
    totals = torch.tensor([correct, tokens, float(len(shard)), failed], device="cpu")
    if accelerator is not None and world > 1:
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    n = int(totals[2].item())
    result = {
        "accuracy": totals[0].item() / max(n, 1),
        "n": n,
        "mean_length": totals[1].item() / max(n, 1),
        "grader_errors": int(totals[3].item()),
    }
    if logged:
        result["metrics"] = logged
    return result


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


def vote_clusters(answers: list[str | None]) -> list[int | None]:
    """For each extracted answer, the index of the first answer equal to it under the grader's
    comparison (`\\dfrac{1}{2}`, `0.5` and `1/2` vote together; None: no answer)."""

    firsts: dict[str, int] = {}  # an answer's text without spaces -> its cluster
    heads: list[int] = []  # the first answer of each cluster, compared against
    out: list[int | None] = []
    for i, a in enumerate(answers):
        if a is None:
            out.append(None)
            continue
        key = "".join(a.split())
        if key not in firsts:
            firsts[key] = next((h for h in heads if answers_match(a, answers[h])), i)
            if firsts[key] == i:
                heads.append(i)
        out.append(firsts[key])
    return out


def majority_correct(answers: list[str | None], rewards: list[float], mode: str = "text") -> float:
    """1.0 when the majority answer (earliest on ties) is a correct one.
    mode "text": one vote per sample on its stripped answer string, a missing answer voting "".
    mode "grader": votes grouped by the grader's equality (vote_clusters), no answer abstaining."""
    if mode == "text":
        votes = ["" if a is None else a.strip() for a in answers]
        counts = Counter(votes)
        if not counts:
            return 0.0
        top = max(counts.values())
        winner = next(i for i, v in enumerate(votes) if counts[v] == top)  # earliest on ties
        return float(votes[winner] != "" and rewards[winner] >= 1.0)
    if mode != "grader":
        raise ValueError(f"maj@n vote mode must be text or grader, got {mode!r}")
    clusters = vote_clusters(answers)
    counts = Counter(c for c in clusters if c is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    winner = min(c for c, k in counts.items() if k == top)  # a cluster is its first answer
    return float(rewards[winner] >= 1.0)


def summarize(problems, records: dict, n: int, vote: bool) -> dict:
    """avg@n, pass@k, maj@n and maj@n_grader (when `vote`), mean length over problems x samples
    0..n-1; with tools, the calls a sample made on average and the calls that failed."""
    rows = [[records[(p.id, i)] for i in range(n)] for p in problems]
    rewards = [[r["reward"] for r in rs] for rs in rows]
    flat = [r for rs in rows for r in rs]
    out = {"problems": len(problems), "n": n, f"avg@{n}": _mean([r["reward"] for r in flat])}
    correct = [sum(x >= 1.0 for x in rs) for rs in rewards]
    for k in pass_ks(n):
        out[f"pass@{k}"] = _mean([pass_at_k(n, c, k) for c in correct])
    for key, mode in ((f"maj@{n}", "text"), (f"maj@{n}_grader", "grader")):
        maj = [
            majority_correct([r["extracted"] for r in rs], rw, mode)
            for rs, rw in zip(rows, rewards)
        ]
        out[key] = _mean(maj) if vote else None
    out["mean_length"] = _mean([r["length"] for r in flat])
    out["truncated"] = _mean([float(r["truncated"]) for r in flat])
    out["grader_errors"] = sum(bool(r.get("grader_error")) for r in flat)
    if any("tool_calls" in r for r in flat):  # --tools: calls per problem (mean over samples)
        out["tool_calls_per_problem"] = _mean([r.get("tool_calls", 0) for r in flat])
        out["tool_errors"] = sum(r.get("tool_errors", 0) for r in flat)
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
            if "sample_seeds" in diff and old.get("sample_seeds") is None:
                raise ConfigError(
                    f"{out_dir} holds samples drawn before each sample had its own seed (a "
                    "resumed or extended run of those repeated earlier samples).\n"
                    "  Fix: pass another --output-dir, or --overwrite to start again."
                )
            detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"{out_dir} holds samples of a different run ({detail}).\n"
                "  Fix: pass another --output-dir, or --overwrite to start again."
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(fingerprint, indent=2) + "\n")


# --- the benchmark loop --------------------------------------------------------------------------


def run_benchmark(
    problems,
    n: int,
    out_dir: Path,
    build_sampler: Callable[[], tuple[Sampler, object]],
    reward_fns: RewardSet,
    extract: Callable[[str], str | None],
    enable_thinking: bool | None,
    batch_size: int,
    progress: bool = True,
    seed: int = 0,
) -> dict:
    """Generate the missing (problem, sample) pairs chunk by chunk, each with its own seed
    (sample_seed(seed, problem id, sample)), and grade them with `reward_fns` (the benchmark's
    grader: benchmarks.reward_fns) as a training step grades; -> all records by key."""
    from tqdm.auto import tqdm

    path = out_dir / "samples.jsonl"
    records = read_samples(path)
    todo = [(p, i) for p in problems for i in range(n) if (p.id, i) not in records]
    if not todo:
        return records
    sample, tokenizer = build_sampler()
    cfg = DataConfig(prompt_template="{question}", enable_thinking=enable_thinking)
    # a sampler with tools renders its own prompts (they describe the tools)
    render = getattr(sample, "render", None)
    rendered = {
        p.id: render(p.prompt) if render else render_prompt(tokenizer, p.prompt, cfg)
        for p, _ in todo
    }
    total = len(problems) * n
    bar = tqdm(total=total, initial=total - len(todo), unit="sample", disable=not progress)
    for s in range(0, len(todo), batch_size):
        chunk = todo[s : s + batch_size]
        seeds = [sample_seed(seed, p.id, i) for p, i in chunk]
        outs = sample([rendered[p.id] for p, _ in chunk], seeds)
        prompts = [rendered[p.id] for p, _ in chunk]
        texts = [out[0] for out in outs]  # with tools: the last assistant turn
        grades = grade_completions(reward_fns, [as_example(p) for p, _ in chunk], prompts, texts)
        answered = [extract(text_to_grade(p, t)) for p, t in zip(prompts, texts)]
        new = _sample_records(chunk, outs, answered, grades)
        append_samples(path, new)
        records.update({(r["problem_id"], r["sample"]): r for r in new})
        bar.update(len(chunk))
        bar.set_postfix(reward=f"{_mean([r['reward'] for r in new]):.3f}")
    bar.close()
    return records


def _sample_records(chunk: list, outs: list, answered: list, grades: Grades) -> list[dict]:
    """samples.jsonl's records of one chunk of (problem, sample) pairs: what the sampler gave
    (text, length, truncated; a tool sampler's conversation and calls), the answer extracted,
    the reward and the grader's own failure where it had one."""
    return [
        {
            "problem_id": p.id,
            "sample": i,
            "completion": out[0],
            "extracted": a,
            "reward": float(r),
            "length": out[1],
            "truncated": bool(out[2]),
            **({"grader_error": why} if why else {}),  # the grader's own failure: scored 0
            **(out[3] if len(out) > 3 else {}),  # a tool sampler's conversation and calls
        }
        for (p, i), out, a, r, why in zip(
            chunk, outs, answered, grades.totals, grades.failure_reasons()
        )
    ]


def as_example(problem) -> Example:
    """A benchmark Problem as the training data's Example: its user message is the problem's
    text (where a grader finds written-out options), its gold the answer graders compare
    against."""
    return Example(problem.prompt.strip(), problem.gold, given=problem.prompt)
