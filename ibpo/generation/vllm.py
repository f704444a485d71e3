"""Generation on vLLM (rollout.backend=vllm): rollouts, repairs and held-out answers from a vLLM
engine beside the policy, which keeps training with HF + PEFT exactly as with the hf backend.

* The engine loads the same base model. For a QLoRA policy it quantises it the same way
  (bitsandbytes NF4 with double quantisation, 64-weight blocks: the same codes as the policy's
  base); the LoRA adapter is served as a LoRA request, never merged into 4-bit weights (a merge
  into a quantised base rounds most of the update away, and every later merge starts from the
  rounded weights). vLLM 0.28 dropped bitsandbytes: the `vllm` extra pins an earlier release.
* Before each generation phase the adapter is saved in PEFT format under a new directory and a
  new LoRA id, so the engine can never serve a stale cached copy; the previous one is deleted.
* Between phases the engine sleeps (level 1: weights to host memory, KV cache dropped) so that the
  update has the GPU.
* Its KV cache is a fixed budget (sizes.vllm_budget: one generation batch at full length), so
  memory is planned, not "90% of the card".
* It runs in the training process, not in vLLM's default child process, which would exit on the
  first Ctrl-C or SIGTERM instead of letting the trainer finish the step and save.
* Token ids in, token ids out: the Rollout is built from the same left-padded prompt tensors as
  the hf backend's (rollout.encode_prompts, rollout.assemble), the completion ending at its first
  EOS. Sampling seeds are drawn from torch's RNG inside the step's sampling stream
  (streams.SamplingStreams), so a resumed run draws the same seeds; only the sampling settings
  asked for apply (as in hf.generate, not the model's own defaults).

vLLM samples with its own kernels, so its sampling distribution differs slightly from the
policy's in the update (the usual mismatch of vLLM rollouts). Behaviour log-probs: the engine is
started with logprobs_mode="processed_logprobs" and each sampled request asks for logprobs=0, so
every completion token comes with its log-prob after temperature, top-k and top-p, the
distribution vLLM drew it from (the hf backend's `Rollout.logprobs`, sampling.py). The step
measures the mismatch against the trainer's log-probs and can correct for it
(objective.behavior_policy, objective.importance_sampling).

Not here: several processes (one engine per GPU beside DDP/FSDP replicas is refused by
distributed.check_launch: use the hf backend there), or full fine-tuning (the policy is always a
LoRA adapter).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ibpo.config import Config, ConfigError
from ibpo.generation.rollout import Generator, Rollout, assemble, encode_prompts, eos_ids
from ibpo.modeling import compute_dtype, resolve_model_path
from ibpo.sizes import (
    VLLM_BATCHED_TOKENS,
    VLLM_OVERHEAD_BYTES,
    ModelShape,
    vllm_budget,
    vllm_slot_rank,
)


def import_vllm():
    """(the vllm module, LoRARequest), or a ConfigError naming the install."""
    try:
        import vllm
        from vllm.lora.request import LoRARequest
    except ImportError:
        raise ConfigError(
            "the vllm backend needs vLLM: pip install 'ibpo[vllm]' (CUDA machines); or use the "
            "hf backend (rollout.backend=hf, --backend hf for evaluation)"
        ) from None
    return vllm, LoRARequest


def engine_kwargs(vllm, quantization: str, lora_rank: int | None) -> dict:
    """LLM() arguments shared by training and evaluation: the NF4 base of a QLoRA adapter and a
    LoRA slot large enough for it."""
    kwargs: dict = {}
    if quantization == "nf4":
        try:
            methods = importlib.import_module("vllm.model_executor.layers.quantization")
            methods = methods.QUANTIZATION_METHODS
        except (ImportError, AttributeError):
            methods = None  # cannot tell: let vLLM decide
        if methods is not None and "bitsandbytes" not in methods:
            raise ConfigError(
                f"vLLM {getattr(vllm, '__version__', '?')} cannot quantise with bitsandbytes "
                "(removed in vLLM 0.28), so it cannot serve the NF4 base the adapter was trained "
                "on. Fix: pip install 'ibpo[vllm]' (it pins vllm<0.28), or use the hf backend."
            )
        kwargs["quantization"] = "bitsandbytes"
    if lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=vllm_slot_rank(lora_rank), max_loras=1)
    # sampled tokens' log-probs after temperature / top-k / top-p: the sampling distribution
    kwargs["logprobs_mode"] = "processed_logprobs"
    return kwargs


def sampled_logprobs(completion) -> torch.Tensor:
    """[1, t] float32: a vLLM completion's log-prob of each of its tokens (the engine reports, per
    position, a mapping from token id to a Logprob that always holds the sampled token)."""
    steps = completion.logprobs
    if steps is None or len(steps) != len(completion.token_ids):
        raise RuntimeError(
            "the vLLM engine returned no log-prob per sampled token: SamplingParams(logprobs=0) "
            "and logprobs_mode='processed_logprobs' need vLLM >= 0.11 (pip install 'ibpo[vllm]')"
        )
    values = [step[token].logprob for step, token in zip(steps, completion.token_ids)]
    return torch.tensor([values], dtype=torch.float32, device="cpu")


class VLLMEngine:
    """A vLLM engine that generates with the policy's current adapter (see the module doc)."""

    def __init__(self, llm, lora_request, eos: list[int], device: torch.device):
        self.llm, self._lora_request, self.eos, self.device = llm, lora_request, eos, device
        self.asleep = False
        self.workdir = Path(tempfile.mkdtemp(prefix="ibpo-vllm-adapters-"))
        # the saved adapters go with the engine, however the run ends
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.workdir, True)
        self._ids = itertools.count(1)  # LoRA ids must be > 0 and unique per adapter version
        self._served: Path | None = None

    @classmethod
    def start(cls, cfg: Config, model: nn.Module, tokenizer) -> VLLMEngine:
        """Start vLLM for this run's policy (a PEFT model) and put it to sleep until needed."""
        vllm, lora_request = import_vllm()
        mc = cfg.model
        base_config = getattr(model, "module", model).config
        shape = ModelShape.from_dict(base_config.to_dict())
        device = next(model.parameters()).device
        dtype = compute_dtype(mc.dtype, device)
        positions = getattr(base_config, "max_position_embeddings", None)
        length, kv_bytes = vllm_budget(shape, cfg, dtype.itemsize, positions)
        kwargs = engine_kwargs(vllm, mc.quantization, mc.lora_r)
        kwargs["enable_sleep_mode"] = True
        if torch.cuda.is_available():
            # vLLM refuses to start unless this fraction of the card is free (less what it sets
            # up first); what it takes is set by its weights and the KV budget below
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            kwargs["gpu_memory_utilization"] = max(0.01, (free - VLLM_OVERHEAD_BYTES) / total)
        # the engine in this process, not a child: a child shares the terminal's process group
        # and exits on the first Ctrl-C / SIGTERM, which the trainer answers by finishing the
        # step and saving (failures.GracefulStop), generation included
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            llm = vllm.LLM(
                model=resolve_model_path(mc.name),
                revision=mc.revision,
                seed=cfg.train.seed,
                dtype=str(dtype).removeprefix("torch."),
                max_model_len=length,
                kv_cache_memory_bytes=kv_bytes,
                max_num_seqs=cfg.rollout.generation_batch_size,
                max_num_batched_tokens=VLLM_BATCHED_TOKENS,
                **kwargs,
            )
        except (ValueError, RuntimeError) as e:  # vLLM's own advice names knobs set here
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ConfigError(
                f"vLLM did not start: {first}\n  Fix: check the fit with `ibpo plan RECIPE "
                f"rollout.backend=vllm`; lower rollout.generation_batch_size (the engine's KV "
                f"cache holds one such batch: {kv_bytes / 2**30:.2f} GiB now), or use "
                "rollout.backend=hf."
            ) from e
        engine = cls(llm, lora_request, eos_ids(tokenizer, model), device)
        engine.sleep()
        return engine

    def sleep(self) -> None:
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            if torch.cuda.is_available():
                # the engine allocates outside torch's caching allocator (its own pool, for
                # sleeping): blocks the update freed but torch still holds are out of its reach
                torch.cuda.empty_cache()
            self.llm.wake_up()
            self.asleep = False

    @contextmanager
    def serving(self, model: nn.Module) -> Iterator[Generator]:
        """A Generator (rollout.py) on the engine, awake and serving `model`'s adapter as it is
        now; asleep again afterwards."""
        self.wake()
        try:
            yield partial(self.generate, self._sync(model))
        except BaseException:
            with contextlib.suppress(Exception):  # the engine may be what failed: the original
                self.sleep()  # exception (a Ctrl-C, say) is what the caller must see
            raise
        self.sleep()

    def _sync(self, model: nn.Module):
        """The adapter as it is now, saved where the engine can load it, as a LoRA request."""
        version = next(self._ids)
        path = self.workdir / f"adapter-{version}"
        # PEFT format; save_embedding_layers=False: the vocabulary is never resized here, and
        # "auto" would look the base model up on the Hub at every save
        getattr(model, "module", model).save_pretrained(path, save_embedding_layers=False)
        previous, self._served = self._served, path
        if previous is not None:  # the engine loaded it already; the new id replaces it
            shutil.rmtree(previous, ignore_errors=True)
        return self._lora_request(f"policy-{version}", version, str(path))

    @torch.no_grad()
    def generate(
        self,
        lora,
        tokenizer,
        prompts: list[str],
        num_samples: int,
        max_new_tokens: int,
        batch_size: int,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> Rollout:
        """hf.generate's contract (rollout.Generator). `batch_size` is not used: vLLM schedules
        sequences within its KV-cache budget."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: generate inside engine.serving(model)")
        vllm, _ = import_vllm()
        # the hf backend's prompt tensors (the Rollout keeps them); vLLM gets each prompt's
        # tokens once, unpadded
        prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, num_samples, self.device)
        rows = [
            ids[m.bool()].tolist()
            for ids, m in zip(prompt_ids[::num_samples].cpu(), prompt_mask[::num_samples].cpu())
        ]
        # vLLM seeds sample j of a request with seed + j: requests get disjoint seed ranges
        n = num_samples if do_sample else 1  # greedy samples are all the same (vLLM wants n=1)
        sampling = [{"temperature": 0.0}] * len(rows)
        if do_sample:  # greedy calls (evaluation) leave torch's RNG alone, as generate() does
            seed = int(torch.randint(0, 2**31 - len(rows) * n, ()).item())
            sampling = [
                dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + i * n)
                for i in range(len(rows))
            ]
        # detokenize=False: the texts come from rollout.assemble, as for the hf backend
        # logprobs=0: each sampled token's own log-prob (and no alternatives)
        logprobs = 0 if do_sample else None
        params = [
            vllm.SamplingParams(
                n=n,
                max_tokens=max_new_tokens,
                stop_token_ids=self.eos,
                detokenize=False,
                logprobs=logprobs,
                **kw,
            )
            for kw in sampling
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": r} for r in rows], params, lora_request=lora, use_tqdm=False
        )
        # token ids end with the EOS / stop token that ended a completion (vLLM keeps it)
        samples = [
            c
            for out in outputs
            for c in sorted(out.outputs, key=lambda c: c.index) * (num_samples // n)
        ]
        completions = [
            torch.tensor([list(c.token_ids)], dtype=torch.long, device="cpu") for c in samples
        ]
        behaviour = [sampled_logprobs(c) for c in samples] if do_sample else None
        return assemble(prompt_ids, prompt_mask, completions, tokenizer, self.eos, behaviour)

    def close(self) -> None:
        """Shut the engine down (its process and GPU memory) and delete the saved adapters."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if hasattr(core, "shutdown"):
            core.shutdown()
        self._cleanup()
        self.llm = None
