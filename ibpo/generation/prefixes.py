"""The prompt forwards generate() shares between rows. The G copies of a prompt share one prompt
forward (`prefill`): its KV cache is computed once and repeated. Distinct prompts that begin
alike (a group's repair prompts, held-out questions under one chat preamble) share the forward
of their common prefix the same way (`plan_shared_prefixes`, `shared_prefix_inputs`), wherever
that computes fewer token slots. Either way generate() is handed the KV cache of every prompt
but its last token (under CACHE_KWARG) and builds on it the cache it would have built itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn

from ibpo.logprobs import unwrap

# generate()'s name for a cache it is handed (transformers 5.24 renamed past_key_values)
CACHE_KWARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def shares_prefill(model: nn.Module, shape: torch.Size, num_samples: int) -> bool:
    """Whether a generate() call over `shape` = [rows, P] prompt ids, whole groups of
    `num_samples` copies of a prompt, can take its prompts' cache from `prefill`: only with the
    dynamic cache (a static one is allocated by generate itself) and a prompt of 2+ tokens."""
    rows, width = shape
    config = unwrap(model).generation_config
    return (
        num_samples > 1
        and rows % num_samples == 0
        and width >= 2
        and getattr(config, "cache_implementation", None) is None
    )


def prefill(model: nn.Module, ids: Tensor, mask: Tensor, num_samples: int):
    """The KV cache of every prompt but its last token, computed once per group and repeated to
    its `num_samples` rows: generate() then starts from the last prompt token, and the prompt's
    forward costs 1/G of what it does on G identical rows. Position ids are generate's own
    (cumulative sum of the mask, 1 on padding), so the cache is what generate would build."""
    unique, unique_mask = ids[::num_samples, :-1], mask[::num_samples, :-1]
    positions = unique_mask.long().cumsum(-1) - 1
    positions.masked_fill_(unique_mask == 0, 1)
    out = model(
        input_ids=unique,
        attention_mask=unique_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    cache.batch_repeat_interleave(num_samples)
    return cache


# A run of rows shares its prefix only where the prefix is at least this long: a shorter one saves
# less than the extra forward costs.
MIN_SHARED_PREFIX = 8


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _runs(rows: list[list[int]], min_len: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive rows and the prefix each shares, maximising the prompt tokens not
    recomputed, the sum of (rows - 1) x L (dynamic programming over the row order, O(N^2))."""
    n = len(rows)
    lcp = [_common_prefix(rows[i], rows[i + 1]) for i in range(n - 1)]
    best = [0] * (n + 1)  # best[j]: tokens saved on rows[:j]
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (start of the last run, its L)
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], (j - 1, 0)  # row j-1 alone
        shared = len(rows[j - 1]) - 1
        for i in range(j - 2, -1, -1):  # the run rows[i:j]
            shared = min(shared, lcp[i], len(rows[i]) - 1)
            if shared < min_len:
                break
            gain = best[i] + (j - i - 1) * shared
            if gain > best[j]:
                best[j], cut[j] = gain, (i, shared)
    runs, j = [], n
    while j > 0:
        i, shared = cut[j]
        runs.append((i, j, shared))
        j = i
    return runs[::-1]


def padded_cost(rows: list[list[int]], runs: list[tuple[int, int, int]] | None) -> int:
    """Token slots a dense batch computes, padding included: N x the longest prompt without
    sharing (runs None); with it, the prefix batch (runs that share x their longest prefix) plus
    the rest of every row (N x the longest rest)."""
    if runs is None:
        return len(rows) * max(len(r) for r in rows)
    shared = [length for _, _, length in runs if length > 0]
    rest = max(len(rows[i]) - length for a, b, length in runs for i in range(a, b))
    return len(shared) * max(shared, default=0) + len(rows) * rest


def plan_shared_prefixes(
    rows: list[list[int]], min_len: int = MIN_SHARED_PREFIX
) -> list[tuple[int, int, int]] | None:
    """rows: the real prompt ids of one generate() call -> (start, end, L) per run of consecutive
    rows, covering every row in order: rows[start:end] share their first L tokens (L = 0: the run
    shares nothing), or None when sharing would not compute fewer token slots than the plain
    left-padded batch. L stays below each row's length, so every row keeps a token for
    generate() to start from. A row that shares with no neighbour either runs whole with the
    rests (L = 0) or puts all but its last token in the prefix batch, whichever pads less: a long
    lone row would otherwise keep every row's rest as long as itself."""
    runs = _runs(rows, min_len)
    if not any(length for _, _, length in runs):
        return None
    alone = [(a, b, len(rows[a]) - 1 if b - a == 1 else length) for a, b, length in runs]
    plan = min((runs, alone), key=lambda r: padded_cost(rows, r))
    return plan if padded_cost(rows, plan) < padded_cost(rows, None) else None


def shares_prefixes(model: nn.Module) -> bool:
    """Whether generate() may give rows that begin alike one forward of their common prefix: the
    rows' padding then sits between that prefix and the rest, which the causal mask and position
    ids (both from the attention mask) see through, but a sliding attention window (it counts
    cache slots, padding included) and flash-attention's packed batches would not. So: full
    attention in every layer, sdpa or eager, and the dynamic cache."""
    config = unwrap(model).config
    text = getattr(config, "get_text_config", lambda: config)()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return False
    elif getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return False
    generation = unwrap(model).generation_config
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager") and (
        getattr(generation, "cache_implementation", None) is None
    )


@dataclass
class SharedPrefixes:
    """generate()'s inputs for rows that share prefixes: ids and mask [N, Q + S] (each row's
    shared prefix right-aligned in the first Q columns, the rest of its prompt right-aligned in
    the last S), the KV cache of all but the last column and the prompt tokens actually computed."""

    input_ids: Tensor
    attention_mask: Tensor
    cache: object
    computed_tokens: int


def _positions(mask: Tensor) -> Tensor:
    """generate()'s position ids: the cumulative sum of the mask, 1 on padding."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill_(mask == 0, 1)


def shared_prefix_inputs(
    model: nn.Module, rows: list[list[int]], runs: list[tuple[int, int, int]], pad_id: int, device
) -> SharedPrefixes:
    """One forward of each shared prefix (all prefixes batched), its cache repeated to its run's
    rows, then one forward of every row's remaining prompt tokens but the last on top: the cache
    generate() would have built for the same prompts, at the cost of their distinct tokens."""
    shared = [length for _, _, length in runs if length > 0]
    Q = max(shared)
    prefix_rows = [rows[start][:length] for start, _, length in runs if length > 0]
    owner, k = [], 0  # row -> its run's row in the prefix batch (0 for a row that shares nothing)
    for start, end, length in runs:
        owner += [k if length > 0 else 0] * (end - start)
        k += length > 0
    lengths = [length for start, end, length in runs for _ in range(start, end)]
    rests = [row[length:] for row, length in zip(rows, lengths)]
    S = max(len(r) for r in rests)

    def pad_left(seq: list[int], width: int) -> tuple[list[int], list[int]]:
        return [pad_id] * (width - len(seq)) + seq, [0] * (width - len(seq)) + [1] * len(seq)

    pre = [pad_left(r, Q) for r in prefix_rows]
    pre_ids = torch.tensor([p[0] for p in pre], dtype=torch.long, device=device)
    pre_mask = torch.tensor([p[1] for p in pre], dtype=torch.long, device=device)
    out = model(
        input_ids=pre_ids,
        attention_mask=pre_mask,
        position_ids=_positions(pre_mask),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    cache.batch_select_indices(torch.tensor(owner, dtype=torch.long, device=device))
    ids, mask = [], []
    for row, length, rest in zip(rows, lengths, rests):
        a_ids, a_mask = pad_left(row[:length], Q)
        b_ids, b_mask = pad_left(rest, S)
        ids.append(a_ids + b_ids)
        mask.append(a_mask + b_mask)
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    mask_t = torch.tensor(mask, dtype=torch.long, device=device)
    if S > 1:  # the rest of each prompt but its last token
        out = model(
            input_ids=ids_t[:, Q:-1],
            attention_mask=mask_t[:, :-1],
            position_ids=_positions(mask_t)[:, Q:-1],
            use_cache=True,
            logits_to_keep=1,
            **{CACHE_KWARG: cache},
        )
        cache = getattr(out, "cache", None) or out.past_key_values
    computed = sum(len(r) for r in prefix_rows) + sum(len(r) for r in rests)
    return SharedPrefixes(ids_t, mask_t, cache, computed)
