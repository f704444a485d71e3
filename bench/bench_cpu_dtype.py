"""Greedy generation time of the embedded model per compute dtype (why `auto` is fp32 on CPU).

Usage: HF_HUB_OFFLINE=1 python bench/bench_cpu_dtype.py [--sequences 64] [--new-tokens 16]
Prints seconds per dtype and the bf16 / fp32 ratio, both measured in this run.
"""

import argparse
import time

import torch

from ibpo.config import DataConfig, ModelConfig
from ibpo.data import builtin_examples, render_prompt
from ibpo.generation import generate
from ibpo.modeling import load_policy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--quantization", default="nf4")
    args = ap.parse_args()
    examples = builtin_examples("arithmetic", "test")[: args.sequences]
    times = {}
    for dtype in ("float32", "bfloat16"):
        cfg = ModelConfig(quantization=args.quantization, dtype=dtype)
        model, tok = load_policy(cfg, torch.device("cpu"))
        prompts = [render_prompt(tok, ex.question, DataConfig()) for ex in examples]
        start = time.perf_counter()
        generate(model, tok, prompts, 1, args.new_tokens, len(prompts), do_sample=False)
        times[dtype] = time.perf_counter() - start
        print(f"{dtype}: {times[dtype]:.1f} s for {len(prompts)} x {args.new_tokens} tokens")
    print(f"bf16 / fp32 time ratio: {times['bfloat16'] / times['float32']:.2f}")


if __name__ == "__main__":
    main()
