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


def prefix_node_ids(tokens: list[list[int]], width: int, group_size: int) -> tuple[Tensor, int]:
    """Completion token ids of whole groups (host lists) -> (node id per token [n, width] on the
    host, -1 past a completion's end; the number of nodes).

    Two tokens get the same id iff they are in the same group at the same depth with identical
    completion prefixes (their own token included): the same token at the same context.
    """
    ids = torch.full((len(tokens), width), -1, dtype=torch.long, device="cpu")
    next_id = 0
    for g0 in range(0, len(tokens), group_size):
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; -1 = root
        for i in range(g0, g0 + group_size):
            parent, row = -1, []
            for tok in tokens[i][:width]:
                key = (parent, tok)
                node = children.get(key)
                if node is None:
                    node = children[key] = next_id
                    next_id += 1
                row.append(node)
                parent = node
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long, device="cpu")
    return ids, next_id


def cancellation_residual(
    coef: Tensor, adv: Tensor, tokens: list[list[int]], group_size: int, mask: Tensor | None = None
) -> dict[str, Tensor]:
    """Sums for one micro-batch: {'residual_num', 'residual_den', 'shared_tokens', 'tokens'},
    0-dim float64 tensors on coef's device. coef/adv [n, T]; tokens: each row's completion ids.
    `mask` [n, T]: the tokens that count (None: all of them); a token outside it (a tool's
    result in a multi-turn completion) is context for the trie, never a node's member.

    The trie is built on the host from the host token lists; the sums run where the coefficients
    are, so the step reads them once with its other statistics. Add them over micro-batches and
    divide (`residual = num / den`) for a step's figure.
    """
    ids, n_nodes = prefix_node_ids(tokens, coef.shape[1], group_size)
    flat = ids.flatten()
    pos = (flat >= 0).nonzero().squeeze(1)  # host: the completion tokens, row-major
    node, pos = flat[pos].to(coef.device), pos.to(coef.device)
    c = coef.detach().double().flatten()[pos]
    a = adv.detach().double().flatten()[pos]
    member = torch.ones_like(c) if mask is None else mask.detach().double().flatten()[pos]
    c, a = c * member, a * member
    zeros = torch.zeros(n_nodes, dtype=torch.double, device=coef.device)
    count = zeros.index_add(0, node, member)
    mean_c = zeros.index_add(0, node, c) / count.clamp_min(1)
    dev = zeros.index_add(0, node, (c - mean_c[node]) * a)
    mag = zeros.index_add(0, node, (c * a).abs())
    shared = (count >= 2).double()
    return {
        "residual_num": (dev.abs() * shared).sum(),
        "residual_den": (mag * shared).sum(),
        "shared_tokens": (count * shared).sum(),
        "tokens": count.sum(),
    }
