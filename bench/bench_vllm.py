"""The vllm rollout backend on a real engine: checks the CPU tests cannot make, and its speed.

The tests drive rollout.backend=vllm through a stand-in for vLLM's offline API
(tests/fake_vllm). This script runs the real one, beside the policy as the trainer does, on a
Qwen3 architecture built from its config with random weights (bench_gpu.py's: no download),
loaded as 4-bit NF4 + LoRA, with a random non-zero adapter. It reports:
  * adapter_served: the engine's greedy completions differ from the base model's (hf backend
    with the adapter disabled) and agree with the policy's own at least as often;
  * same_after_wake: the same adapter after a sleep / wake cycle gives the same greedy
    completions as before it (a vLLM release has been reported to drop LoRA on wake-up);
  * greedy agreement with the policy's own generate() (share of identical completions and mean
    common prefix): different kernels, so near-ties may flip - reported, not required;
  * sampled rollout tokens/s of each backend (G completions of B prompts; random weights almost
    never stop early) and the vLLM phase's overhead (wake, adapter save, sleep);
  * GPU memory in use while the engine generates and while it sleeps, beside `ibpo plan`'s
    generation and training phases for the same settings.
One JSON line at the end (also written to --out).

On a CUDA machine with vLLM (pip install 'ibpo[vllm]'):
  python bench/bench_vllm.py --arch 1.7b --new-tokens 1024 --out bench_vllm.json
CPU smoke run through the tests' stand-in (a tiny model, seconds):
  PYTHONPATH=tests/fake_vllm python bench/bench_vllm.py --smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import ARCHS, build_base  # noqa: E402

from ibpo.data import render_prompt  # noqa: E402
from ibpo.generation import VLLMEngine, generate  # noqa: E402
from ibpo.modeling import load_policy  # noqa: E402
from ibpo.plan import fit as plan  # noqa: E402
from ibpo.recipe import load_config  # noqa: E402


def build_model_dir(arch: dict, root: Path, device: torch.device) -> Path:
    """A random-weight checkpoint of `arch` on disk, once: vLLM loads its model from a folder
    (bench_gpu builds on the device and never writes one)."""
    path = root / f"qwen3-h{arch['hidden_size']}-l{arch['num_hidden_layers']}"
    if (path / "config.json").is_file():
        return path
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tok = build_base(arch, "none", dtype, device)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path


def gpu_used_gb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return round((total - free) / 2**30, 2)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean length of the shared leading tokens of two [N, T] completion batches."""
    T = min(a.shape[1], b.shape[1])
    same = (a[:, :T] == b[:, :T]).long().cumprod(1)
    return same.sum(1).float().mean().item()


def greedy_checks(engine, model, tok, prompts, tokens: int) -> dict:
    greedy = dict(num_samples=1, max_new_tokens=tokens, batch_size=len(prompts), do_sample=False)
    with engine.serving(model) as gen:
        before = gen(tok, prompts, **greedy)
    with engine.serving(model) as gen:  # slept and woke up in between, the same adapter
        after = gen(tok, prompts, **greedy)
    own = generate(model, tok, prompts, **greedy)
    with model.disable_adapter():
        base = generate(model, tok, prompts, **greedy)
    agree = [a == b for a, b in zip(before.texts, own.texts)]
    like_base = [a == b for a, b in zip(before.texts, base.texts)]
    return {
        "same_after_wake": before.texts == after.texts,
        "adapter_served": sum(agree) >= sum(like_base)
        and own.texts != base.texts
        and before.texts != base.texts,
        "greedy_identical_share": sum(agree) / len(agree),
        "greedy_common_prefix_tokens": common_prefix(before.completion_ids, own.completion_ids),
        "greedy_identical_to_base_share": sum(like_base) / len(like_base),
    }


def timed(fn) -> tuple[object, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="1.7b", choices=sorted(ARCHS))
    p.add_argument("--prompts", type=int, default=4, help="B")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--check-tokens", type=int, default=64, help="greedy checks' length")
    p.add_argument("--quantization", default="nf4", choices=["nf4", "none"])
    p.add_argument("--smoke", action="store_true", help="tiny model, few tokens (CPU)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.smoke:
        args.arch, args.prompts, args.group_size = "tiny", 2, 2
        args.new_tokens, args.check_tokens, args.quantization = 8, 6, "none"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = Path(tempfile.mkdtemp(prefix="ibpo-bench-vllm-"))
    try:
        result = run(args, build_model_dir(ARCHS[args.arch], root, device), device)
    finally:  # a random-weight checkpoint: GBs for the real sizes
        shutil.rmtree(root, ignore_errors=True)
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


def run(args, path: Path, device: torch.device) -> dict:
    B, G, T = args.prompts, args.group_size, args.new_tokens
    cfg = load_config(
        None,
        [
            f"model.name={path}",
            f"model.quantization={args.quantization}",
            "rollout.backend=vllm",
            f"rollout.group_size={G}",
            f"train.prompts_per_step={B}",
            f"rollout.max_new_tokens={T}",
            f"rollout.eval_max_new_tokens={T}",
            f"rollout.generation_batch_size={B * G}",
            "data.max_prompt_tokens=64",
            "data.eval_size=0",
            "repair.enabled=false",
        ],
    )
    model, tok = load_policy(cfg.model, device)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a random adapter that changes the outputs (LoRA B starts at zero)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    prompts = [render_prompt(tok, f"What is {i} + {2 * i}?", cfg.data) for i in range(B)]
    engine, t_start = timed(lambda: VLLMEngine.start(cfg, model, tok))
    result = {
        "arch": args.arch,
        "quantization": args.quantization,
        "device": str(device),
        "B": B,
        "G": G,
        "new_tokens": T,
        "engine_start_s": round(t_start, 1),
    }
    result.update(greedy_checks(engine, model, tok, prompts, args.check_tokens))

    torch.manual_seed(0)
    inside = {}

    def vllm_phase():
        with engine.serving(model) as gen:
            inside["used_gb"] = gpu_used_gb(device)
            ro, inside["t"] = timed(lambda: gen(tok, prompts, G, T, B * G))
            inside["used_after_gb"] = gpu_used_gb(device)
        return ro

    ro_v, t_phase = timed(vllm_phase)
    asleep_gb = gpu_used_gb(device)
    ro_h, t_hf = timed(lambda: generate(model, tok, prompts, G, T, B * G))
    n_v, n_h = ro_v.completion_mask.sum().item(), ro_h.completion_mask.sum().item()
    shape_plan = plan.estimate(str(path), cfg, 1, 24.0).phases
    result.update(
        vllm_tokens_per_s=round(n_v / inside["t"], 1),
        hf_tokens_per_s=round(n_h / t_hf, 1),
        vllm_speedup=round((n_v / inside["t"]) / (n_h / t_hf), 2),
        vllm_phase_overhead_s=round(t_phase - inside["t"], 2),
        gpu_used_awake_gb=inside["used_after_gb"],
        gpu_used_asleep_gb=asleep_gb,
        plan_generation_gb=round(sum(shape_plan["generation"].values()), 2),
        plan_training_gb=round(sum(shape_plan["training"].values()), 2),
    )
    engine.close()
    return result


if __name__ == "__main__":
    main()
