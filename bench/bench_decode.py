"""Where a decoding step's time goes: one step of the trainer's generation phase (step.generating)
measured on random Qwen3 weights, through HF generate (rollout.decode=eager) and the package's
decode engine (rollout.decode=graph, generation/decode.py: CUDA graphs on CUDA), with the 4-bit
base and without, with the LoRA adapter and without, at two batch sizes.

A variant's seconds per step come from two calls that differ only in their new tokens (SHORT and
LONG, every completion forced to full length): (t_long - t_short) / (LONG - SHORT), so the
prompt's prefill and the call's fixed costs drop out (the engine's graphs are captured in a
warm-up call before them). Every ratio printed is against the first variant, measured in the
same run:
  nf4 + LoRA, batch B, eager     the rollout through HF generate (B = 4 prompts x 8)
  nf4 + LoRA, batch B, graph     the same rows through the engine
  nf4 + LoRA, batch B/4, ...     a quarter of the rows (the repairs' batch), both paths
  nf4, adapter disabled          PEFT's share (the reference model's path)
  bf16 + LoRA                    bitsandbytes' share (a bf16 base: 16 GiB for the 8B, no cap)
  bf16, adapter disabled         neither: the plain model under HF generate
Each variant also reports the KL between the log-probs its LONG call sampled with and the
trainer's (algo/mismatch.py). Each variant's figures are written to --out as soon as it is
measured; --budget-s stops before a variant whose planned seconds no longer fit (it says so).

On a CUDA machine (bitsandbytes from .whl/, see scripts/gpu_check.py):
  PYTHONPATH=/tmp/site python3 bench/bench_decode.py --out $OUT/bench_decode.json
CPU smoke test (tiny Qwen3, seconds): python bench/bench_decode.py --smoke
Not here: memory (bench_gpu.py), vLLM (bench_vllm.py), torch.compile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gpu import ARCHS, RECIPE, _free, build_base  # noqa: E402

from ibpo import step  # noqa: E402
from ibpo.algo.mismatch import mismatch_stats  # noqa: E402
from ibpo.data import render_prompt  # noqa: E402
from ibpo.logprobs import completion_logprobs, unwrap  # noqa: E402
from ibpo.modeling import compute_dtype, load_policy  # noqa: E402
from ibpo.recipe import load_config  # noqa: E402

GROUP = 8  # completions per prompt, as the recipes sample them
SHORT, LONG = 16, 80  # new tokens of the two calls whose difference is timed


def variants(batch: int) -> list[dict]:
    """What is measured, in order; the first is the baseline of every ratio. `decode` is
    rollout.decode: eager = HF generate, graph = the package's engine (generation/decode.py)."""
    small = max(batch // 4, GROUP)

    def v(name, quantization, adapter, rows, decode):
        return dict(name=name, quantization=quantization, adapter=adapter, batch=rows,
                    decode=decode)  # fmt: skip

    return [
        v(f"nf4 + LoRA, batch {batch}, eager", "nf4", True, batch, "eager"),
        v(f"nf4 + LoRA, batch {batch}, graph", "nf4", True, batch, "graph"),
        v(f"nf4 + LoRA, batch {small}, eager", "nf4", True, small, "eager"),
        v(f"nf4 + LoRA, batch {small}, graph", "nf4", True, small, "graph"),
        v(f"nf4, adapter disabled, batch {batch}, eager", "nf4", False, batch, "eager"),
        v(f"bf16 + LoRA, batch {batch}, eager", "none", True, batch, "eager"),
        v(f"bf16, adapter disabled, batch {batch}, eager", "none", False, batch, "eager"),
    ]


def timed_call(generate, tok, prompts, new_tokens: int, model, device):
    """(seconds, rollout) of one sampled generate() call of len(prompts) x GROUP rows at full
    length."""
    unwrap(model).generation_config.min_new_tokens = new_tokens
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    ro = generate(tok, prompts, GROUP, new_tokens, len(prompts) * GROUP, do_sample=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, ro


def mismatch_kl(model, ro) -> float:
    """KL between the log-probs the rollout was sampled with and the trainer's for its tokens
    (algo/mismatch.py; EOS was suppressed for both, as the calls decode to full length)."""
    trainer, _ = completion_logprobs(
        model, ro.input_ids, ro.attention_mask, ro.prompt_len, ro.completion_mask, 2048
    )
    return float(mismatch_stats(trainer, ro.logprobs, ro.completion_mask)["mismatch_kl"])


def measure(model, tok, cfg, device, v: dict, prompt_chars: int, lengths=(SHORT, LONG)) -> dict:
    """One variant: a warm-up call (at full length for the engine, so that every bucket's graph
    is captured before the timed calls), then `lengths` new tokens (SHORT and LONG); seconds per
    decoding step and the LONG call's rollout-vs-trainer mismatch."""
    question = ("what is 12 + 34 * 5 - 6 ? " * (prompt_chars // 20 + 1))[:prompt_chars]
    prompts = [render_prompt(tok, question, cfg.data)] * max(v["batch"] // GROUP, 1)
    off = contextlib.nullcontext() if v["adapter"] else model.disable_adapter()
    warm = lengths[1] if v["decode"] == "graph" else 4
    with off, step.generating(model, cfg, device) as generate:
        engine = getattr(generate, "keywords", {}).get("engine")
        timed_call(generate, tok, prompts, warm, model, device)  # kernels, allocator, graphs
        short, _ = timed_call(generate, tok, prompts, lengths[0], model, device)
        long, ro = timed_call(generate, tok, prompts, lengths[1], model, device)
        kl = mismatch_kl(model, ro)
        fallback = engine.disabled if engine is not None else None
    if v["decode"] == "graph" and (engine is None or fallback):
        raise RuntimeError(f"the engine did not decode: {fallback or 'unsupported model'}")
    per_step = float(f"{max(long - short, 1e-9) / (lengths[1] - lengths[0]):.4g}")
    rows = len(prompts) * GROUP
    return {
        **v,
        "rows": rows,
        "short_s": round(short, 3),
        "long_s": round(long, 3),
        "step_s": per_step,  # 4 significant figures; tokens_per_s is computed from this value
        "tokens_per_s": round(rows / per_step, 1),
        "mismatch_kl": float(f"{kl:.4g}"),
    }


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    arch_name = "tiny" if args.smoke else args.size
    arch = ARCHS[arch_name]
    out = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": f"qwen3-{arch_name}",
        "layers": arch["num_hidden_layers"],
        "variants": [],
    }
    t0 = time.perf_counter()
    todo = variants(args.batch)
    for quantization in ("nf4", "none"):
        mine = [v for v in todo if v["quantization"] == quantization]
        over = [f"model.name=random-qwen3-{arch_name}", f"model.quantization={quantization}",
                "data.max_prompt_tokens=4096"]  # fmt: skip
        cfg = load_config(RECIPE, over)
        spent = time.perf_counter() - t0
        done = [r for r in out["variants"] if "step_s" in r]
        planned = sum(r["short_s"] + r["long_s"] for r in done) / max(len(done), 1) * 1.5
        if done and spent + planned * len(mine) > args.budget_s:
            why = f"skipped: {spent:.0f} s of --budget-s {args.budget_s:g} spent, "
            why += f"about {planned:.0f} s each"
            out["variants"] += [{**v, "status": why} for v in mine]
            continue
        dtype = compute_dtype(cfg.model.dtype, device)
        model, tok = load_policy(
            cfg.model, device, base=build_base(arch, quantization, dtype, device)
        )
        for v in mine:
            try:
                lengths = (4, 20) if args.smoke else (SHORT, LONG)
                mine_cfg = load_config(RECIPE, [*over, f"rollout.decode={v['decode']}"])
                row = measure(model, tok, mine_cfg, device, v, args.prompt_chars, lengths)
                out["variants"].append({**row, "status": "ok"})
            except Exception as e:  # noqa: BLE001 - recorded, the next variant runs
                out["variants"].append({**v, "status": f"failed: {type(e).__name__}: {e}"[:500]})
            save(out, args.out)
        del model
        _free()
    base = out["variants"][0].get("step_s")
    for r in out["variants"]:
        if base and "step_s" in r:
            r["vs_first"] = round(r["step_s"] / base, 3)
            r["ms_per_layer_step"] = round(1e3 * r["step_s"] / out["layers"], 3)
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    save(out, args.out)
    return out


def save(out: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="8b", choices=sorted(set(ARCHS) - {"tiny"}))
    ap.add_argument("--batch", type=int, default=32, help="rows of the baseline (4 x 8)")
    ap.add_argument("--prompt-chars", type=int, default=480, help="~ prompt tokens")
    ap.add_argument("--budget-s", type=float, default=170)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny Qwen3 on CPU")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_chars = 16, 24
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        sys.exit("bench_decode: no CUDA device (--smoke runs a tiny model on CPU)")
    out = run(args)
    for r in out["variants"]:
        if "step_s" in r:
            print(f"{r['name']:<44} {1e3 * r['step_s']:8.2f} ms/step  "
                  f"{r['ms_per_layer_step']:6.3f} ms/layer  {r['tokens_per_s']:9.1f} tok/s  "
                  f"x{r['vs_first']:.2f}  KL {r['mismatch_kl']:.3g}")  # fmt: skip
        else:
            print(f"{r['name']:<44} {r['status']}")
    return out


if __name__ == "__main__":
    main()
