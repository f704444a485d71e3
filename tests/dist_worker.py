"""Worker for tests/test_distributed.py, run by `torchrun --nproc_per_node 2` on CPU (gloo).

    python tests/dist_worker.py update MODEL_DIR OUT   # update_policy on fixed rollouts
    python tests/dist_worker.py train MODEL_DIR OUT [k=v ...]   # a whole `train()` run

`update` builds the same fixed scored batch on every process (BATCH_GROUPS groups), gives each
process its own half of the groups (as the prompt stream's shards do) and runs the real
update_policy through Accelerate's DDP; each rank saves its LoRA weights to
OUT/<objective>-rank<r>.pt.
The test runs the same update in one process on all the groups and compares.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

GROUP_SIZE, BATCH_GROUPS = 4, 4
OBJECTIVES = ("ibpo", "dapo", "grpo")  # group transform, token_mean, seq_mean


def fixed_batch(tok, rows_of_groups: list[int]):
    """Deterministic prompts, completions of varied lengths and rewards; the chosen groups."""
    from ibpo.advantages import group_advantages, token_advantages
    from ibpo.rollout import Rollout
    from ibpo.scoring import ScoredBatch

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
    att = [[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (T - len(c))
           for p, c in zip(p_ids, c_ids)]  # fmt: skip
    cmask = torch.tensor([[1.0] * len(c) + [0.0] * (T - len(c)) for c in c_ids])
    ro = Rollout(torch.tensor(ids), torch.tensor(att), cmask, P, completions,
                 torch.zeros(len(rows), dtype=torch.bool))  # fmt: skip
    seq_adv = group_advantages(r, True).flatten()
    return ScoredBatch(ro, r, seq_adv, token_advantages(seq_adv, cmask, None, 0.0))


def lora_state(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def make_policy(model_dir: str, objective: str, device):
    """The tiny policy with a seeded, non-zero adapter (every LoRA matrix gets a gradient)."""
    from ibpo.config import load_config
    from ibpo.modeling import load_policy

    cfg = load_config(None, [f"model.name={model_dir}", "model.quantization=none",
                             f"objective.name={objective}", f"rollout.group_size={GROUP_SIZE}",
                             "train.updates_per_rollout=2", "train.learning_rate=0.01",
                             "train.micro_batch_groups=1", "train.log_reference_kl=false",
                             "rollout.max_new_tokens=12"])  # fmt: skip
    torch.manual_seed(0)
    model, tok = load_policy(cfg.model, device)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(2))
    return cfg, model, tok


def run_update(model_dir: str, objective: str, groups: list[int], accelerator):
    """Two updates (off-policy on the second) of update_policy on the fixed batch's groups."""
    from ibpo.objectives import resolve_params
    from ibpo.trainer import build_optimizer, update_policy

    cfg, model, tok = make_policy(model_dir, objective, accelerator.device)
    opt = build_optimizer(model, cfg, accelerator.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    batch = fixed_batch(tok, groups)
    update_policy(model, opt, sched, accelerator, batch, cfg, resolve_params(cfg.objective))
    return lora_state(model)


def main(argv: list[str]) -> None:
    from accelerate import Accelerator

    mode, model_dir, out = argv[0], argv[1], Path(argv[2])
    if mode == "update":
        acc = Accelerator()
        half = BATCH_GROUPS // acc.num_processes
        mine = list(range(acc.process_index * half, (acc.process_index + 1) * half))
        for objective in OBJECTIVES:
            state = run_update(model_dir, objective, mine, acc)
            torch.save(state, out / f"{objective}-rank{acc.process_index}.pt")
        return
    import ibpo.trainer as trainer
    from ibpo.config import load_config

    seen = {}
    step = trainer.rl_step

    def spy(model, *args, **kwargs):  # keep a handle on the live (DDP-wrapped) policy
        seen["model"] = model
        return step(model, *args, **kwargs)

    trainer.rl_step = spy
    summary = trainer.train(load_config(None, [f"model.name={model_dir}", *argv[3:]]))
    rank = int(os.environ.get("RANK", "0"))
    state = {"lora": lora_state(seen["model"]), "summary": summary}
    torch.save(state, out / f"train-rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
