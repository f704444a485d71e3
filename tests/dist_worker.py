"""Worker for tests/test_distributed.py, run by `torchrun --nproc_per_node 2` on CPU (gloo).

    python tests/dist_worker.py update MODEL_DIR OUT   # update_policy on fixed rollouts
    python tests/dist_worker.py train MODEL_DIR OUT [k=v ...]   # a whole `train()` run
    python tests/dist_worker.py resume MODEL_DIR OUT [k=v ...]  # 3 steps vs 2 + resumed 1

With the FSDP_* variables `accelerate launch` derives from an FSDP config in the environment, the
processes run FSDP2 instead of DDP (see `cpu_fsdp`).

`update` builds the same fixed scored batch on every process (BATCH_GROUPS groups), gives each
process its own share of the groups (unevenly: 1 and 3, as dynamic sampling can leave them) and
runs the real update_policy through Accelerate's DDP (or FSDP); each rank saves its LoRA weights
to OUT/<objective>-rank<r>.pt.
The test runs the same update in one process on all the groups and compares.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

GROUP_SIZE, BATCH_GROUPS = 4, 4
FSDP = os.environ.get("ACCELERATE_USE_FSDP") == "true"  # set by the test from an FSDP config
OBJECTIVES = ("ibpo", "dapo", "grpo")  # group transform, token_mean, seq_mean


def fixed_batch(tok, rows_of_groups: list[int]):
    """Deterministic prompts, completions of varied lengths and rewards; the chosen groups."""
    from ibpo.algo.advantages import group_advantages, token_advantages
    from ibpo.generation import Rollout
    from ibpo.step_parts import ScoredBatch

    rng = random.Random(7)
    chars = "0123456789+-*=?:. abcdefghijklmnopqrstuvwxyz"
    prompts, completions, rewards = [], [], []
    for g in range(BATCH_GROUPS):
        prompt = f"what is {g} + {g * 3}?" + " please" * (g % 3)
        for _ in range(GROUP_SIZE):
            prompts.append(prompt)
            completions.append("".join(rng.choice(chars) for _ in range(rng.randint(2, 12))))
            rewards.append(float(rng.random() < 0.5))
    rows = [g * GROUP_SIZE + i for g in rows_of_groups for i in range(GROUP_SIZE)]
    prompts = [prompts[i] for i in rows]
    completions = [completions[i] for i in rows]
    r = torch.tensor([rewards[i] for i in rows]).view(-1, GROUP_SIZE)
    r[:, 0], r[:, 1] = 1.0, 0.0  # every group carries signal
    pad = tok.pad_token_id
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    c_ids = [tok(c, add_special_tokens=False)["input_ids"] for c in completions]
    P, T = max(map(len, p_ids)), max(map(len, c_ids))
    ids = [[pad] * (P - len(p)) + p + c + [pad] * (T - len(c)) for p, c in zip(p_ids, c_ids)]
    att = [
        [0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
        for p, c in zip(p_ids, c_ids)
    ]
    cmask = torch.tensor([[1.0] * len(c) + [0.0] * (T - len(c)) for c in c_ids])
    ro = Rollout(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(att),
        completion_mask=cmask,
        prompt_len=P,
        texts=completions,
        truncated=torch.zeros(len(rows), dtype=torch.bool),
    )
    seq_adv = group_advantages(r, True).flatten()
    return ScoredBatch(ro, r, seq_adv, token_advantages(seq_adv, cmask, None, 0.0))


def lora_state(model) -> dict[str, torch.Tensor]:
    """Full LoRA tensors (gathered from FSDP shards: a collective under FSDP)."""
    from torch.distributed.tensor import DTensor

    model = getattr(model, "module", model)
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
        if "lora_" in n
    }


def cpu_fsdp() -> None:
    """Accelerate turns FSDP on only for accelerator devices: on CPU its state falls back to
    MULTI_CPU (gloo) and ignores the FSDP_* variables. FSDP2 itself (fully_shard, DTensor
    collectives) runs on CPU over gloo, so switch the state to FSDP after construction, with the
    plugin built from those variables as on a GPU machine; everything after that (prepare,
    no_sync, clipping, the loop) is the unmodified GPU code path."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class CpuFsdpAccelerator(accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.distributed_type == DistributedType.MULTI_CPU:
                # both shared states: a later AcceleratorState() copies the partial one over
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                self.state.distributed_type = DistributedType.FSDP
                self.state.fsdp_plugin = FullyShardedDataParallelPlugin()

    accelerate.Accelerator = CpuFsdpAccelerator


def make_policy(model_dir: str, objective: str, device):
    """The tiny policy with a seeded, non-zero adapter (every LoRA matrix gets a gradient)."""
    from ibpo.modeling import load_policy
    from ibpo.recipe import load_config

    cfg = load_config(
        None,
        [
            f"model.name={model_dir}",
            "model.quantization=none",
            f"objective.name={objective}",
            f"rollout.group_size={GROUP_SIZE}",
            "train.updates_per_rollout=2",
            "train.learning_rate=0.01",
            "train.micro_batch_groups=1",
            "train.log_reference_kl=false",
            "objective.kl_coef=0.0",  # no reference forward, as log_reference_kl=false says
            "rollout.max_new_tokens=12",
        ],
    )
    torch.manual_seed(0)
    model, tok = load_policy(cfg.model, device)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(2))
    return cfg, model, tok


def run_update(model_dir: str, objective: str, groups: list[int], accelerator):
    """Two updates (off-policy on the second) of update_policy on the fixed batch's groups."""
    from ibpo.distributed import is_fsdp, load_optimizer_state, optimizer_state
    from ibpo.recipe import resolve_params
    from ibpo.step import update_policy
    from ibpo.trainer import build_optimizer

    cfg, model, tok = make_policy(model_dir, objective, accelerator.device)
    opt = build_optimizer(model, cfg, accelerator.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    assert is_fsdp(model) == FSDP, type(model)  # the wrapping the test asked for
    # a checkpoint before any step, saved and restored, must leave the optimizer as it was (a
    # step count moved to 1 would change AdamW's bias correction and so the result)
    load_optimizer_state(model, opt, optimizer_state(model, opt))
    batch = fixed_batch(tok, groups)
    update_policy(model, opt, sched, accelerator, batch, cfg, resolve_params(cfg.objective))
    return lora_state(model)


def check_gathering(model_dir: str, accelerator) -> dict:
    """Under FSDP: whether a decoder weight is sharded before, inside and after `gathered`, and
    the greedy tokens generated inside it (the test compares them with one unsharded process).
    The processes generate different numbers of calls: `gathered` runs no collective inside."""
    from torch.distributed.tensor import DTensor

    from ibpo.distributed import gathered
    from ibpo.generation import generate
    from ibpo.trainer import build_optimizer

    cfg, model, tok = make_policy(model_dir, "ibpo", accelerator.device)
    model, _ = accelerator.prepare(model, build_optimizer(model, cfg, accelerator.device))
    weight = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    found = {"before": isinstance(weight, DTensor)}
    with gathered(model):
        w = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
        found["inside"] = isinstance(w, DTensor)
        prompts = ["what is 2 + 3?", "hello"]
        tokens = generate(model, tok, prompts, 2, 6, 8, do_sample=False).input_ids
        for _ in range(accelerator.process_index):  # uneven: process 1 generates once more
            generate(model, tok, prompts[:1], 1, 3, 8, do_sample=False)
    w = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    found["after"] = isinstance(w, DTensor)
    return {"sharded": found, "tokens": tokens}


def main(argv: list[str]) -> None:
    if FSDP:
        cpu_fsdp()
    from accelerate import Accelerator

    from ibpo.distributed import launch_kind, leave, leave_if_ended_together

    mode, model_dir, out = argv[0], argv[1], Path(argv[2])
    if mode == "update":
        for objective in OBJECTIVES:
            acc = Accelerator()  # one per model, as in training (FSDP clipping looks models up)
            # uneven on purpose: 1 group (1 micro-batch) here, 3 there; every process must still
            # run as many forwards and backwards
            mine = [0] if acc.process_index == 0 else list(range(1, BATCH_GROUPS))
            state = run_update(model_dir, objective, mine, acc)
            torch.save(state, out / f"{objective}-rank{acc.process_index}.pt")
        if launch_kind(acc) == "FSDP":
            acc = Accelerator()
            torch.save(check_gathering(model_dir, acc), out / f"gather-rank{acc.process_index}.pt")
        leave(0)  # without the C++ teardown that can abort a finished process (distributed.py)
    rank = int(os.environ.get("RANK", "0"))
    if mode == "oom":  # process 1 runs out of memory in step 2's update; the CLI's exit code
        sys.exit(run_oom(model_dir, argv[3:], rank))
    if mode == "train":
        torch.save(run_train(model_dir, argv[3:]), out / f"train-rank{rank}.pt")
        leave_if_ended_together(0)  # as `ibpo train` does
        return
    # mode == "resume": a 3-step run, and a 2-step run resumed from its checkpoint for step 3
    full = run_train(model_dir, [*argv[3:], "train.steps=3", f"run.output_dir={out / 'full'}"])
    part = [*argv[3:], f"run.output_dir={out / 'part'}"]
    run_train(model_dir, [*part, "train.steps=2"])
    resumed = run_train(model_dir, [*part, "train.steps=3", "run.resume_from=latest"])
    torch.save({"full": full, "resumed": resumed}, out / f"resume-rank{rank}.pt")
    leave_if_ended_together(0)  # as `ibpo train` does


def run_oom(model_dir: str, overrides: list[str], rank: int) -> int:
    import ibpo.step as step
    from ibpo.cli import main as cli_main

    update, calls = step.update_policy, []

    def failing(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return update(*args, **kwargs)

    step.update_policy = failing
    return cli_main(["train", f"model.name={model_dir}", *overrides])


def run_train(model_dir: str, overrides: list[str]) -> dict:
    """A whole `train()`; its summary and the live policy's full LoRA tensors after it.
    `--bnb-kernels` among the overrides: a 4-bit base computes with bitsandbytes' kernels, as
    under FSDP, never with a dequantised copy."""
    import ibpo.modeling as modeling
    import ibpo.step as step
    import ibpo.trainer as trainer
    from ibpo.distributed import is_fsdp
    from ibpo.recipe import load_config
    from ibpo.repair_budget import REPAIR_TOTALS
    from ibpo.rewards import GRADERS

    # deterministic in the text and about half right on the random tiny model: real advantages
    GRADERS["parity"] = lambda text, answer: float(sum(map(ord, text)) % 2)
    seen = {}
    real_step = trainer.rl_step

    def spy(parts, *args, **kwargs):  # keep a handle on the live (wrapped) policy
        seen["model"] = parts.model
        # the random streams each process samples from at its first step
        seen.setdefault("rng", (torch.get_rng_state(), parts.rng.getstate()))
        assert is_fsdp(parts.model) == FSDP, type(parts.model)  # the wrapping the test asked for
        return real_step(parts, *args, **kwargs)

    real_observe = step.observe_repairs
    rule = []  # per step: the decision, this process's own repair totals, the history after it

    def observe(accelerator, history, mode, stats):
        after = real_observe(accelerator, history, mode, stats)
        local = [stats.get(k, 0.0) for k in REPAIR_TOTALS]
        rule.append({"mode": mode, "local": local, "state": after.state_dict()})
        return after

    if "--bnb-kernels" in overrides:
        overrides = [o for o in overrides if o != "--bnb-kernels"]
        modeling.AUTO_DEQUANTIZE_MAX_BYTES = -1
    trainer.rl_step, step.observe_repairs = spy, observe
    try:
        summary = trainer.run_recipe(load_config(None, [f"model.name={model_dir}", *overrides]))
    finally:
        trainer.rl_step, step.observe_repairs = real_step, real_observe
    base = getattr(seen["model"], "module", seen["model"]).get_base_model()
    w = base.model.layers[0].self_attn.q_proj.base_layer.weight  # 4-bit codes under nf4
    local = w.to_local() if hasattr(w, "to_local") else w
    shard = {"type": type(local).__name__, "local": local.numel(), "full": w.numel()}
    return {
        "lora": lora_state(seen["model"]),
        "summary": summary,
        "q_proj_weight": shard,
        "torch_rng": seen["rng"][0],
        "repair_rng": seen["rng"][1],
        "repair_rule": rule,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
