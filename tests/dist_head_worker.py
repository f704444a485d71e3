"""Worker for tests/test_plan.py (the live FSDP head), run by `torchrun --nproc_per_node N` on
CPU (gloo) with the FSDP_* variables of recipes/accelerate/fsdp_qlora_2gpu.yaml:

    python tests/dist_head_worker.py MODEL_DIR OUT

It wraps the tiny policy with Accelerate's FSDP2, runs one training forward of the log-prob path
(logprobs.completion_logprobs, with grad) and records, per rank, in OUT/head-rank<r>.json: whether
the model is FSDP-wrapped, whether the live lm_head passes `fused_head_supported` (before and after
the root forward), and which head function the live path called. The planner's own answer for
sharding=fsdp is compared by the test, not here (the planner does not need a process group).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.dist_worker import cpu_fsdp, make_policy


def main(argv: list[str]) -> None:
    cpu_fsdp()
    from accelerate import Accelerator

    import ibpo.logprobs as logprobs
    from ibpo.distributed import is_fsdp, leave

    model_dir, out = argv[0], Path(argv[1])
    acc = Accelerator()
    from ibpo.trainer import build_optimizer

    cfg, model, _ = make_policy(model_dir, "ibpo", acc.device)
    # FSDP2 under Accelerate prepares a model only together with its optimizer
    model, _ = acc.prepare(model, build_optimizer(model, cfg, acc.device))
    head = logprobs.unwrap(model).get_output_embeddings()
    found = {
        "fsdp": is_fsdp(model),
        "fused_before": logprobs.fused_head_supported(head),
        "hooks": bool(head._forward_hooks or head._forward_pre_hooks),
        "weight_type": type(head.weight).__name__,
    }
    called = []
    for name in ("fused_head_logprobs", "checkpointed_head_logprobs"):
        real = getattr(logprobs, name)
        setattr(
            logprobs,
            name,
            lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k),
        )
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    cmask = torch.ones(2, 4)
    model.train()
    logp, _ = logprobs.completion_logprobs(model, ids, mask, 5, cmask)
    found["fused_after"] = logprobs.fused_head_supported(head)
    found["called"] = called
    logp.sum().backward()
    (out / f"head-rank{acc.process_index}.json").write_text(json.dumps(found))
    leave(0)  # without the C++ teardown that can abort a finished process (distributed.py)


if __name__ == "__main__":
    main(sys.argv[1:])
