"""Held-out evaluation: generate, grade with the training graders, report accuracy.

Greedy decoding by default (one completion per problem), so the before/after numbers of a run are
deterministic. With several processes each evaluates its shard and the counts are summed.

Not here: benchmark loading or pass@k (the per-benchmark evaluation scripts build on this).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ibpo.config import DataConfig
from ibpo.data import Example, render_prompt
from ibpo.rollout import generate


def evaluate_accuracy(
    model: nn.Module,
    tokenizer,
    examples: list[Example],
    data_cfg: DataConfig,
    reward_fn: Callable[[str, str], float],
    max_new_tokens: int,
    batch_size: int,
    accelerator=None,
) -> dict[str, float]:
    """Greedy accuracy and mean completion length on `examples` -> {accuracy, n, mean_length}."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    shard = examples[rank::world]
    correct = tokens = 0.0
    for s in range(0, len(shard), batch_size):
        batch = shard[s : s + batch_size]
        prompts = [render_prompt(tokenizer, ex.question, data_cfg) for ex in batch]
        out = generate(model, tokenizer, prompts, 1, max_new_tokens, batch_size, do_sample=False)
        correct += sum(reward_fn(t, ex.answer) == 1.0 for t, ex in zip(out.texts, batch))
        tokens += out.completion_mask.sum().item()
    totals = torch.tensor([correct, tokens, float(len(shard))])
    if accelerator is not None and world > 1:
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    n = int(totals[2].item())
    return {
        "accuracy": totals[0].item() / max(n, 1),
        "n": n,
        "mean_length": totals[1].item() / max(n, 1),
    }
