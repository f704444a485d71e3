"""FSDP2 support: the places where the loop touches parameters outside one training forward.

Accelerate's FSDP2 (`fully_shard`, plugin `fsdp_version: 2`) leaves each process a shard of every
parameter (a DTensor); a sharded module's forward hooks gather its full parameters for the length
of that forward and free them after. That covers the update. Four things need more:

* generation calls the model once per new token: `gathered(model)` gathers every shard once (one
  root forward of one token, with resharding off) and keeps the full weights until the rollout is
  done. During generation a process holds its shards plus what a DDP replica holds (the planner
  counts it so); the update runs sharded. Gathering layer by layer per token instead would need
  every process to run the same number of forwards (they stop at their own EOS, repair different
  numbers of attempts): not offered;
* the log-prob path goes through the root forward even without grad (logprobs.completion_hidden):
  the root's hooks gather the parameters no decoder layer owns;
* the adapter is saved from full LoRA tensors, gathered on every process (LoRA is small; the
  4-bit base is never gathered for saving) and loaded back into the shards;
* optimizer state is saved whole (torch.distributed.checkpoint's full state dict, gathered on the
  main process) and scattered back into the shards on resume.
Without FSDP every function here is the single-process/DDP operation. Also here: the start-up
checks of the launch (which distributed types the loop runs under; a shared output folder).

Not here: wrapping the model (Accelerate's `prepare`, from the plugin in the Accelerate config);
FSDP1 and DeepSpeed, which `check_launch` refuses at start-up.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import gather_object
from torch import nn

from ibpo.config import Config, ConfigError


def is_fsdp(model: nn.Module) -> bool:
    """Whether the model is sharded by FSDP2: its parameters are DTensor shards, gathered only
    inside its modules' forwards, so nothing may read them directly."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(model, FSDPModule)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _reshards_after_forward(module: nn.Module) -> bool:
    """The module's current setting (FSDP2 exposes a setter only)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.8: one group per module
        groups = [getattr(state, "_fsdp_param_group", None)]
    return any(g is not None and g.post_forward_mesh_info is not None for g in groups)


@contextmanager
def gathered(model: nn.Module):
    """Generation under FSDP: full parameters on every process for the block, sharded again
    after. No collective runs inside it, so processes may generate different numbers of tokens
    and calls (early EOS, repairs, uneven evaluation shards) without waiting for each other."""
    if not is_fsdp(model):
        yield
        return
    modules = _fsdp_modules(model)
    # the root never reshards after its forward (FSDP's default for it, which Accelerate keeps)
    settings = [(m, m is not model and _reshards_after_forward(m)) for m in modules]
    model.set_reshard_after_forward(False)
    try:
        # One token through the root, on every process: the root is initialised as the root
        # (generation calls the model under it, whose hooks would otherwise claim that role) and
        # every unit gathers its parameters and keeps them.
        device = next(model.parameters()).device
        with torch.no_grad():
            model(
                input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                use_cache=False,
                logits_to_keep=1,
            )
        yield
    finally:
        for m, reshard in settings:
            m.set_reshard_after_forward(reshard, recurse=False)
        for m in modules:
            m.reshard()


def agreed_count(accelerator, n: int) -> int:
    """The largest `n` over the processes (every process calls it)."""
    if accelerator.num_processes == 1:
        return n
    found = torch.tensor([n], device=accelerator.device)
    return int(accelerator.reduce(found, "max").item())


def summed(accelerator, values: list[float]) -> list[float]:
    """Each value summed over the processes, the same result on every process (every process
    calls it, with as many values). float64, so counts of tokens stay exact."""
    if accelerator.num_processes == 1:
        return [float(v) for v in values]
    found = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(found, "sum").tolist()


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def save_adapter(accelerator, model: nn.Module, path: Path) -> None:
    """The PEFT adapter (adapter_config.json + weights) in `path`; every process must call it."""
    peft_model = accelerator.unwrap_model(model)
    state = None
    if is_fsdp(model):  # a collective: every process gathers, the main one writes
        state = {
            n: _full(p).detach().cpu() for n, p in peft_model.named_parameters() if p.requires_grad
        }
    if accelerator.is_main_process:
        # save_embedding_layers=False: the vocabulary is never resized, and "auto" would look
        # the base model up on the Hub at every save
        peft_model.save_pretrained(path, state_dict=state, save_embedding_layers=False)


def load_adapter(peft_model: nn.Module, path: Path) -> None:
    """The weights of a saved adapter into the model's LoRA parameters (sharded or not)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(Path(path) / "adapter_model.safetensors")
    if is_fsdp(peft_model):
        _load_sharded(peft_model, weights, path)
        return
    try:
        result = set_peft_model_state_dict(peft_model, weights)
    except RuntimeError as e:  # shape mismatch: another lora_r / target modules / base model
        raise _mismatch(path, str(e).splitlines()[0]) from None
    if result.unexpected_keys:
        raise _mismatch(path, f"weights this model lacks: {', '.join(result.unexpected_keys[:3])}")


def _mismatch(path, detail: str) -> ConfigError:
    return ConfigError(
        f"the adapter in '{path}' does not fit this model ({detail}); resume with "
        "the model.* settings the run started with"
    )


def _load_sharded(peft_model: nn.Module, weights: dict, path) -> None:
    """PEFT stores LoRA weights without the adapter name ('lora_A.weight' for the parameter
    'lora_A.default.weight'); match them to the trainable parameters and scatter into shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    tag = f".{peft_model.active_adapter}"
    trained = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    names = {n.replace(tag, ""): (n, p) for n, p in trained}
    if set(names) != set(weights):
        odd = sorted(set(names) ^ set(weights))
        raise _mismatch(path, f"weights differ: {', '.join(odd[:3])}")
    for key, (_, p) in names.items():
        if tuple(weights[key].shape) != tuple(p.shape):
            raise _mismatch(path, f"{key}: {tuple(weights[key].shape)} vs {tuple(p.shape)}")
    full = {n: weights[key].to(p.dtype) for key, (n, p) in names.items()}
    set_model_state_dict(
        peft_model, full, options=StateDictOptions(full_state_dict=True, strict=False)
    )


def _plain(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer


def optimizer_state(model: nn.Module, optimizer) -> dict:
    """What to save on the main process; under FSDP a collective (the full state, gathered)."""
    if not is_fsdp(model):
        return optimizer.state_dict()
    if not _plain(optimizer).state:
        # No optimizer step yet (a checkpoint before the first step, or after skipped ones).
        # get_optimizer_state_dict would first run a zero-gradient step to create the state,
        # on the live optimizer too: its step count would become 1, shifting AdamW's bias
        # correction for the rest of the run and after resume. Nothing to save instead; the
        # same on every process (they step together), so the collective is skipped by all.
        return {"state": {}, "param_groups": []}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, _plain(optimizer), options=options)


def load_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    """The inverse of optimizer_state; every process calls it with the same full state."""
    if not is_fsdp(model):
        optimizer.load_state_dict(state)
        return
    if not state["state"]:  # saved before any step: a fresh optimizer is what was saved
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model,
        _plain(optimizer),
        optim_state_dict=state,
        options=StateDictOptions(full_state_dict=True),
    )


def launch_kind(accelerator) -> str:
    """Accelerate's distributed type by name: NO, MULTI_GPU, MULTI_CPU, FSDP, DEEPSPEED, ..."""
    return str(accelerator.distributed_type).rsplit(".", 1)[-1].upper()


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def check_launch(accelerator, cfg: Config) -> None:
    """The loop is verified under one process, DDP and FSDP2 (tests/test_distributed.py). FSDP1
    and DeepSpeed wrap parameters in ways generation and checkpointing here do not handle: refuse
    them with the way forward rather than fail deep inside a step."""
    kind = launch_kind(accelerator)
    if kind == "FSDP" and not accelerator.is_fsdp2:
        raise ConfigError(
            "the training loop runs under FSDP2 only. Fix: set fsdp_version: 2 in the Accelerate "
            "config (recipes/accelerate/fsdp_qlora_2gpu.yaml does)."
        )
    if kind == "FSDP" and cfg.train.optimizer == "adamw_8bit":
        raise ConfigError(
            "bitsandbytes' paged 8-bit AdamW does not take FSDP's sharded parameters. Fix: "
            "train.optimizer=adamw (or auto)."
        )
    if cfg.rollout.backend == "vllm" and accelerator.num_processes > 1:
        raise ConfigError(
            "rollout.backend=vllm runs one vLLM engine beside one policy: launch a single process "
            "(recipes/accelerate/single_gpu.yaml), or set rollout.backend=hf under DDP/FSDP."
        )
    if kind in ("DEEPSPEED", "MEGATRON_LM"):
        raise ConfigError(
            f"the training loop runs on one process, with DDP or FSDP2, not under {kind}. Fix: "
            "launch with recipes/accelerate/ddp_2gpu.yaml or fsdp_qlora_2gpu.yaml (check the fit "
            "with `ibpo plan RECIPE --gpus 2 [--sharding fsdp]`)."
        )
    # Accelerate's mixed precision autocasts the wrapped model's forward: the path DDP and FSDP
    # take, while one process calls the decoder directly (logprobs.completion_hidden). The same
    # recipe would compute in another precision on 1 and on 2 GPUs, so precision has one switch.
    mixed = str(getattr(accelerator, "mixed_precision", "no") or "no")
    if mixed != "no":
        raise ConfigError(
            f"the Accelerate config sets mixed_precision: {mixed}; ibpo computes in model.dtype "
            '(the 4-bit base\'s compute dtype) on every path. Fix: set mixed_precision: "no" in '
            "the Accelerate config (or launch with --mixed_precision no), and choose the "
            f"precision with model.dtype (e.g. model.dtype={_DTYPE_NAMES.get(mixed, 'bfloat16')})."
        )


def check_shared_output(accelerator, out: Path) -> None:
    """Checkpoints hold every process's state in one folder: with several machines, output_dir
    must be a filesystem they all mount (the main process has just written config.yaml there)."""
    if accelerator.num_processes == 1:
        return
    accelerator.wait_for_everyone()
    missing = torch.tensor([float(not (out / "config.yaml").is_file())], device=accelerator.device)
    if accelerator.reduce(missing, "sum").item():
        raise ConfigError(
            f"run.output_dir={out} is not shared by all processes (a machine does not see the "
            "main process's files). Fix: put output_dir on a filesystem every machine mounts."
        )


# --- the end of a multi-process run ------------------------------------------------------------
# On CPU (gloo), a process of a DDP run that returns normally can abort after its last line: a C++
# thread of torch.distributed is still joinable when static destructors run after the interpreter
# has finalised ("terminate called without an active exception", SIGABRT). The launcher then reports
# a failed run although every step succeeded. Destroying the process group first does not prevent it
# (bench/bench_ddp_exit.py: 13 aborts in 60 two-process DDP runs with it, 19 in 60 without); leaving
# without the C++ teardown does (0 in 40). So the `ibpo train` process of a run every process ended
# together runs its exit handlers, destroys the group and leaves with os._exit. A process that ends
# alone (out of memory, a failed reward) exits normally: the others may still be inside a collective
# with it. Not at the end of train(): a later train() in the same process reuses Accelerate's per-
# process state and its group.
_ended_together = False


def ended_together(accelerator, together: bool) -> None:
    """Record whether this run's processes all reached its end (after their last collective)."""
    global _ended_together
    _ended_together = together and accelerator.num_processes > 1


def leave(code: int) -> None:
    """Exit now with `code`: exit handlers run, output is flushed, the process group (if any) is
    destroyed, and the process leaves without the interpreter's and C++'s teardown."""
    atexit._run_exitfuncs()
    logging.shutdown()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_if_ended_together(code: int) -> None:
    """`leave(code)` when the last run was multi-process and every process reached its end."""
    if _ended_together:
        leave(code)


# Rates over tokens: across processes they are weighted by each process's trained tokens; the
# other rates (reward, accuracy, lengths...) by its sequences, since dynamic sampling and the
# no-signal fallback leave processes with different numbers of groups.
TOKEN_RATES = frozenset({
    "entropy", "kl", "clip_fraction", "gate_fraction", "residual", "shared_token_fraction",
    "mismatch_kl", "mismatch_abs_mean", "mismatch_share", "is_weight_mean", "is_capped_fraction",
})  # fmt: skip
MAXIMA = ("step_time", "peak_memory_gb", "device_memory_used_gb", "mismatch_abs_max",
          "mismatch_worst_sequence")  # fmt: skip
SUMS = ("tokens_per_second", "generated_tokens", "repairs", "repair_tokens", "trained_tokens",
        "trained_sequences", "dropped_groups", "rollout_prefill_tokens", "repair_prefill_tokens",
        "repair_prompt_tokens", "repair_decode_tokens", "reward_timeouts", "grader_errors",
        "repairs_skipped", "repair_successes", "decode_slot_steps",
        "decode_slot_tokens")  # fmt: skip


def gather_metrics(accelerator, m: dict[str, float]) -> dict[str, float]:
    """One step's metrics over all processes: times and peak memory are the slowest/largest
    process's, counts add up, rates are weighted means (TOKEN_RATES by trained tokens, the
    others by trained sequences)."""
    if accelerator.num_processes == 1:
        return m
    every = gather_object([m])
    out = {}
    # every process's keys: a metric a reward function logged (log_metric) on some processes only
    for key in dict.fromkeys(k for d in every for k in d):
        rows = [d for d in every if key in d]
        values = [d[key] for d in rows]
        if key.startswith("time_") or key in MAXIMA:
            out[key] = max(values)
        elif key in SUMS:
            out[key] = sum(values)
        else:
            weight = "trained_tokens" if key in TOKEN_RATES else "trained_sequences"
            w = [d.get(weight, 1.0) for d in rows]
            out[key] = sum(v * x for v, x in zip(values, w)) / max(sum(w), 1.0)
    return out
