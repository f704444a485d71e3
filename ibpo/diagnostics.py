r"""Cancellation diagnostics (IBPO.md Part 1): how far a step is from exchangeable coefficients.

Within a group every member shares the prompt, so two members emit the same token at the same
context exactly when their completions agree up to and including that token. A prefix trie over
the completion token ids of each group finds those (context, token) nodes; for a node shared by a
set S of members, with c_i the detached coefficient the objective applied (surrogate coefficient
times the aggregation's per-token weight) and A_i the token advantage,

    residual(node) = | sum_{i in S} (c_i - mean_S c) A_i |   relative to   sum_{i in S} |c_i A_i|.

It is zero whenever shared tokens get equal coefficients, whatever the advantages (a subset's own
credit mean_S(c) * sum_S A_i is allowed to survive). The step's residual is the ratio of the sums
over all shared nodes, so nodes weigh by how much gradient they carry. Computed in float64.

Not here: any change to the gradient; this module only measures.
"""

from __future__ import annotations

import torch
from torch import Tensor


def prefix_node_ids(tokens: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """tokens/mask [n, T] (whole groups) -> node id per token [n, T] (-1 off the mask).

    Two tokens get the same id iff they are in the same group at the same depth with identical
    completion prefixes (their own token included): the same token at the same context.
    """
    ids = torch.full(tokens.shape, -1, dtype=torch.long)
    rows, lengths = tokens.tolist(), mask.sum(-1).long().tolist()
    next_id = 0
    for g0 in range(0, len(rows), group_size):
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; -1 = root
        for i in range(g0, g0 + group_size):
            parent = -1
            for t in range(lengths[i]):
                key = (parent, rows[i][t])
                node = children.get(key)
                if node is None:
                    node = children[key] = next_id
                    next_id += 1
                ids[i, t] = parent = node
    return ids


def cancellation_residual(
    coef: Tensor, adv: Tensor, tokens: Tensor, mask: Tensor, group_size: int
) -> dict[str, float]:
    """Sums for one micro-batch: {'residual_num', 'residual_den', 'shared_tokens', 'tokens'}.

    Add the sums over micro-batches and divide (`residual = num / den`) for a step's figure.
    """
    ids = prefix_node_ids(tokens.cpu(), mask.cpu(), group_size)
    on = ids >= 0
    node = ids[on]
    c = coef.detach().cpu().double()[on]
    a = adv.detach().cpu().double()[on]
    n_nodes = int(node.max().item()) + 1 if node.numel() else 0
    count = torch.zeros(n_nodes, dtype=torch.double).index_add_(0, node, torch.ones_like(c))
    mean_c = torch.zeros(n_nodes, dtype=torch.double).index_add_(0, node, c) / count.clamp_min(1)
    dev = torch.zeros(n_nodes, dtype=torch.double).index_add_(0, node, (c - mean_c[node]) * a)
    mag = torch.zeros(n_nodes, dtype=torch.double).index_add_(0, node, (c * a).abs())
    shared = count >= 2
    return {
        "residual_num": dev[shared].abs().sum().item(),
        "residual_den": mag[shared].sum().item(),
        "shared_tokens": count[shared].sum().item(),
        "tokens": float(node.numel()),
    }
