"""Peak memory and time of the completion log-prob path: full logits vs the chunked lm_head.

    python bench/bench_logprobs.py             # memory at vocab 151,936 x 4,096 tokens, speed
    python bench/bench_logprobs.py --smoke     # tiny sizes, seconds (CI)
    python bench/bench_logprobs.py --only speed --repeats 5
    (on a CUDA machine the GPU is used, in bf16 unless --dtype says otherwise; --cpu keeps the CPU)

Memory: forward + backward of sum(w * logp) into the LoRA adapters of a small Qwen3 built from a
config, whose lm_head dominates (2 layers, hidden 128, Qwen3's vocabulary of 151,936; gradient
checkpointing and LoRA as `load_policy` sets them up): 4 sequences of 1,024 completion tokens
after 16-token prompts, one prompt left-padded, one completion ending early (mask zeros),
per-token weights w like advantages. Variants:
    naive       `naive_completion_logprobs`: the model's full [N, L, V] logits, fp32 log_softmax
    checkpoint  lm_head in chunks of --chunk tokens, each under activation checkpointing
                (`checkpointed_head_logprobs`, the fallback path of `completion_logprobs`)
    fused       `completion_logprobs` as the trainer calls it (`fused_head_logprobs`)
Peak memory is what the call adds at its peak to what was allocated before it (model, inputs).
"peak MiB", the figure the target is about, counts tensors, as the planner (ibpo.plan.fit) does:
  * CUDA: torch.cuda.max_memory_allocated after a reset, minus memory_allocated at that moment.
  * CPU: the same quantity, tracked: every tensor storage an op creates is counted from the op
    that returns it until it is freed (`LiveTensorBytes`, a TorchDispatchMode).
"RSS MiB" (CPU) is what the machine had to provide: each variant runs in a fresh process; after
building the model and a small warm-up run, the resident-set high-water mark is reset (Linux
/proc/self/clear_refs) and the figure is VmHWM afterwards minus VmRSS at the reset. On top of the
tensors it counts what the allocators hold: glibc keeps the heap pages of freed decoder
activations (60-90 MiB here, for every variant alike) while it mmaps large tensors and unmaps
them on free, so that fixed part weighs most in the smallest figure.
Correctness: max |difference| from naive of the log-probs and of the LoRA gradients.

Speed: forward + backward of the head alone (hidden states in, their gradient out) at
SmolLM2-135M's size (hidden 576, vocabulary 49,152, 1,024 tokens, one chunk), median of
--repeats runs after one warm-up; and the forward alone without grad (old / reference log-probs).
On a shared CPU, run with OMP_NUM_THREADS set to the cores that are free.

Prints the tables, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import re
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.memtrack, run uninstalled

from bench.memtrack import LiveTensorBytes  # noqa: E402
from ibpo.logprobs import (  # noqa: E402
    checkpointed_head_logprobs,
    completion_hidden,
    completion_logprobs,
    fused_head_logprobs,
    fused_head_supported,
    naive_completion_logprobs,
    unwrap,
)

MEMORY = dict(vocab=151_936, hidden=128, sequences=4, tokens=1024, prompt=16, chunk=1024)
SPEED = dict(vocab=49_152, hidden=576, tokens=1024, chunk=1024)
SMOKE_MEMORY = dict(vocab=4096, hidden=32, sequences=2, tokens=64, prompt=8, chunk=32)
SMOKE_SPEED = dict(vocab=4096, hidden=64, tokens=128, chunk=128)
TARGET = 0.10  # the chunked path's peak as a fraction of naive's
VARIANTS = ("naive", "checkpoint", "fused")


# --- the three ways to get completion log-probs ---------------------------------------------------


def checkpoint_logprobs(model, ids, att, prompt_len, mask, chunk, temperature):
    """`completion_logprobs` with the checkpointed head forced (the previous default)."""
    hidden = completion_hidden(model, ids, att, prompt_len)
    sel = mask.bool()
    head = unwrap(model).get_output_embeddings()
    logp, _ = checkpointed_head_logprobs(
        head, hidden[sel], ids[:, prompt_len:][sel], chunk, temperature
    )
    return hidden.new_zeros(mask.shape, dtype=torch.float32).masked_scatter(sel, logp)


def variant_logprobs(variant, model, batch, chunk, temperature):
    ids, att, P, mask = batch["ids"], batch["att"], batch["prompt"], batch["mask"]
    if variant == "naive":
        return naive_completion_logprobs(model, ids, att, P, mask, temperature)
    if variant == "checkpoint":
        return checkpoint_logprobs(model, ids, att, P, mask, chunk, temperature)
    # the fused path must be the one `completion_logprobs` takes here, or the row would lie
    assert fused_head_supported(unwrap(model).get_output_embeddings())
    return completion_logprobs(model, ids, att, P, mask, chunk, temperature)[0]


def build_model(vocab: int, hidden: int, dtype: torch.dtype, device: torch.device):
    """A 2-layer Qwen3 with random weights, set up as `ibpo.modeling.load_policy` sets up the
    policy: frozen base, gradient checkpointing, LoRA on every linear layer but lm_head."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero, so that gradients reach both LoRA factors
            nn.init.normal_(p, std=0.02)
    return model.train()  # checkpointing acts in train mode only, as in the trainer


def make_batch(vocab, sequences, tokens, prompt, device, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sequences, prompt + tokens), generator=g)
    att = torch.ones_like(ids)
    att[0, : prompt // 2], ids[0, : prompt // 2] = 0, 0  # a left-padded prompt
    mask = torch.ones(sequences, tokens)
    mask[-1, tokens - tokens // 4 :] = 0  # a completion that ended early
    weights = torch.randn(sequences, tokens, generator=g)
    batch = dict(ids=ids, att=att, mask=mask, weights=weights)
    return {k: v.to(device) for k, v in batch.items()} | {"prompt": prompt}


# --- peak memory --------------------------------------------------------------------------------


def _proc_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@contextlib.contextmanager
def peak_memory(device: torch.device, tensors: bool) -> Iterator[dict]:
    """Bytes the block adds at its peak: "tensors" (allocated; CUDA's statistics, else tracked)
    and on the CPU "rss" (resident-set high-water mark minus the resident set at the start)."""
    found: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield found
        torch.cuda.synchronize(device)
        found["tensors"] = torch.cuda.max_memory_allocated(device) - base
        return
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS
    base = _proc_kib("VmRSS")
    with LiveTensorBytes() if tensors else contextlib.nullcontext() as live:
        yield found
    found["rss"] = (_proc_kib("VmHWM") - base) * 1024
    found["tensors"] = live.peak if tensors else None


def measure(variant: str, sizes: dict, dtype, device, temperature: float) -> dict:
    """Peak bytes, seconds, log-probs and LoRA gradients of one forward + backward."""
    model = build_model(sizes["vocab"], sizes["hidden"], dtype, device)
    batch = make_batch(sizes["vocab"], sizes["sequences"], sizes["tokens"], sizes["prompt"], device)
    warm = make_batch(sizes["vocab"], 1, 8, sizes["prompt"], device, seed=1)
    for b in (warm, batch):  # the first run, small, only loads kernels and thread pools
        model.zero_grad(set_to_none=True)
        gc.collect()
        start = time.perf_counter()
        with peak_memory(device, tensors=b is batch) as peak:
            logp = variant_logprobs(variant, model, b, sizes["chunk"], temperature)
            (logp * b["weights"] * b["mask"]).sum().backward()
        seconds = time.perf_counter() - start
    grads = {
        n: p.grad.float().cpu().numpy() for n, p in model.named_parameters() if p.requires_grad
    }
    return dict(peak, seconds=seconds, logp=logp.detach().float().cpu().numpy(), grads=grads)


def _child(conn, *args) -> None:
    try:
        conn.send(measure(*args))
    except BaseException as e:  # the parent reports it
        conn.send(e)
    conn.close()


def measure_isolated(*args) -> dict:
    """`measure` in a fresh CPU process: own allocator, own high-water mark.

    Children come from a fork server that has imported the libraries but never computed, so
    they start in a second and without the OpenMP state of a process that has (a fork of one
    can hang in its first parallel region).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "peft", "transformers", "ibpo.logprobs"])
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, *args))
    proc.start()
    child.close()
    result = parent.recv()
    proc.join()
    if isinstance(result, BaseException):
        raise result
    return result


def memory_table(sizes: dict, dtype, device, temperature: float) -> tuple[str, dict]:
    results = {}
    for v in VARIANTS:
        args = (v, sizes, dtype, device, temperature)
        results[v] = measure(*args) if device.type == "cuda" else measure_isolated(*args)
    naive = results["naive"]
    rows, summary = [], {}
    for v, r in results.items():
        ratio = r["tensors"] / naive["tensors"]
        rss = r.get("rss")
        rss_ratio = rss / naive["rss"] if rss is not None else None
        dlogp = float(abs(r["logp"] - naive["logp"]).max())
        dgrad = max(float(abs(g - naive["grads"][n]).max()) for n, g in r["grads"].items())
        met = "-" if v == "naive" else ("yes" if ratio <= TARGET else "no")
        rss_cells = f"{rss / 2**20:,.0f} | {rss_ratio:.3f}" if rss is not None else "- | -"
        rows.append(
            f"| {v} | {r['tensors'] / 2**20:,.0f} | {ratio:.3f} | {met} | {rss_cells} "
            f"| {r['seconds']:.2f} | {dlogp:.1e} | {dgrad:.1e} |"
        )
        summary[v] = dict(
            peak_mib=r["tensors"] / 2**20,
            ratio=ratio,
            rss_mib=rss / 2**20 if rss is not None else None,
            rss_ratio=rss_ratio,
            seconds=r["seconds"],
            max_abs_dlogp=dlogp,
            max_abs_dgrad=dgrad,
        )
    head = [
        f"| variant | peak MiB | / naive | <= {TARGET:.0%} | RSS MiB | / naive | time s "
        "| max abs dlogp | max abs dgrad |",
        "|---|---:|---:|:-:|---:|---:|---:|---:|---:|",
    ]
    return "\n".join(head + rows), summary


# --- speed of the head alone ----------------------------------------------------------------------


def naive_head_logprobs(head, hidden, targets, chunk, temperature):
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), None


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def speed_table(sizes: dict, dtype, device, temperature: float, repeats: int) -> tuple[str, dict]:
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(sizes["hidden"], sizes["vocab"], bias=False)
    nn.init.normal_(head.weight, std=0.02, generator=g)
    head = head.to(device, dtype).requires_grad_(False)
    hidden = torch.randn(sizes["tokens"], sizes["hidden"], generator=g).to(device, dtype)
    targets = torch.randint(0, sizes["vocab"], (sizes["tokens"],), generator=g).to(device)
    weights = torch.randn(sizes["tokens"], generator=g).to(device)
    fns = dict(
        naive=naive_head_logprobs, checkpoint=checkpointed_head_logprobs, fused=fused_head_logprobs
    )
    results = {}
    for name, fn in fns.items():
        h = hidden.clone().requires_grad_()

        def train_step(fn=fn, h=h):
            h.grad = None
            (fn(head, h, targets, sizes["chunk"], temperature)[0] * weights).sum().backward()

        def frozen(fn=fn):
            with torch.no_grad():
                fn(head, hidden, targets, sizes["chunk"], temperature)

        times = [_timed(train_step, device) for _ in range(repeats + 1)][1:]
        no_grad = [_timed(frozen, device) for _ in range(repeats + 1)][1:]
        results[name] = dict(
            seconds=statistics.median(times),
            seconds_all=times,
            no_grad_seconds=statistics.median(no_grad),
            grad=h.grad.float(),
        )
    rows = [
        "| variant | fwd+bwd s | fwd no-grad s | time / checkpoint's | max abs dgrad vs naive |",
        "|---|---:|---:|---:|---:|",
    ]
    old, naive_grad = results["checkpoint"]["seconds"], results["naive"]["grad"]
    for name, r in results.items():
        r["max_abs_dgrad"] = float((r["grad"] - naive_grad).abs().max())
        rows.append(
            f"| {name} | {r['seconds']:.3f} | {r['no_grad_seconds']:.3f} "
            f"| {r['seconds'] / old:.2f} | {r['max_abs_dgrad']:.1e} |"
        )
    for r in results.values():
        del r["grad"]
    return "\n".join(rows), results


# --- main -----------------------------------------------------------------------------------------


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds), for CI")
    p.add_argument("--only", choices=["memory", "speed"], help="run one of the two sections")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is there")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bf16 on CUDA")
    p.add_argument("--chunk", type=int, help="chunk_tokens (default 1,024)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3, help="timed speed runs (median)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not ns.cpu else "cpu")
    if device.type == "cpu" and not Path("/proc/self/clear_refs").exists():
        print("error: CPU peak memory needs Linux (/proc/self/clear_refs)", file=sys.stderr)
        return 2
    dtype = getattr(torch, ns.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    memory, speed = (SMOKE_MEMORY, SMOKE_SPEED) if ns.smoke else (MEMORY, SPEED)
    if ns.chunk:
        memory, speed = memory | {"chunk": ns.chunk}, speed | {"chunk": ns.chunk}
    out = dict(
        device=device.type,
        dtype=str(dtype),
        threads=torch.get_num_threads(),
        temperature=ns.temperature,
        memory_sizes=memory,
        speed_sizes=speed,
    )
    if ns.only != "speed":
        table, out["memory"] = memory_table(memory, dtype, device, ns.temperature)
        m = memory
        print(
            f"peak memory of forward + backward, {m['sequences']} x {m['tokens']} completion "
            f"tokens, vocab {m['vocab']:,}, chunk {m['chunk']}, {device.type} {dtype}, "
            f"{out['threads']} threads"
        )
        print(table)
        fused = out["memory"]["fused"]["ratio"]
        print(
            f"target fused <= {TARGET:.0%} of naive: {'met' if fused <= TARGET else 'NOT met'} "
            f"({fused:.1%})\n"
        )
    if ns.only != "memory":
        table, out["speed"] = speed_table(speed, dtype, device, ns.temperature, ns.repeats)
        s = speed
        print(
            f"lm_head log-probs alone: {s['tokens']} tokens, hidden {s['hidden']}, vocab "
            f"{s['vocab']:,}, chunk {s['chunk']}, median of {ns.repeats}"
        )
        print(table)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
