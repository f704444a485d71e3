"""Memory-bounded completion-token log-probs (and entropy) from hidden states.

A causal LM's forward returns logits for every position: [N, L, V] in fp32 is 2.5 GB for 4,096
tokens at Qwen3's vocabulary of 151,936, and autograd keeps several such copies. Here the decoder
runs once, the hidden states of the positions that predict completion tokens are gathered (prompt
and padding positions never reach the head), and lm_head runs over chunks of at most
`chunk_tokens` rows, so the largest buffer is one fp32 [chunk, V] block whatever the length:

* fused (the default, `fused_head_logprobs`): one autograd Function per chunk computes the fp32
  logits in place into log-prob, entropy and, when a gradient is wanted, the gradient direction
  d logp / d hidden = (W[target] - sum_v p_v W_v) / T, an [M, H] tensor. Only that is kept for
  backward, which is then a multiplication: no [chunk, V] tensor is recomputed or stored, and the
  head costs two matmuls per chunk instead of three.
* checkpointed (`checkpointed_head_logprobs`): each chunk under activation checkpointing, which
  recomputes the chunk's logits in backward. Used when the fused path does not apply: the head is
  trained (its gradient needs the probabilities again), it is not a plain nn.Linear (a PEFT LoRA
  wrapper, a bitsandbytes 4-bit layer), it has hooks (FSDP, offloading), or autocast is on.

Position ids follow `generate` (cumulative sum of the attention mask), so log-probs of a left-padded
rollout match the distribution it was sampled from. The log-probs are those of softmax(logits / T)
for the sampling temperature T; logits are rounded as head(hidden).float() rounds them. Entropy is
always detached. This module does not decide *which* model (policy or reference): callers wrap it
in `disable_adapter()` for the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ibpo.distributed import is_fsdp

# Temporaries beside the fp32 [chunk, V] buffer cover 1/ROW_BLOCKS of its rows at a time: exp()
# of a block, and for bf16/fp16 heads the head's output before the upcast and the probabilities
# cast back for the matmul. One chunk then needs (4 + 4 / ROW_BLOCKS) bytes per [chunk, V] entry.
ROW_BLOCKS = 16


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT / Accelerate wrappers (LoRA layers stay injected)."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_supported(base: nn.Module) -> None:
    cfg = base.config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise NotImplementedError(
                f"models with config.{attr} are not supported by the chunked log-prob path"
            )


# --- fused: one autograd Function per chunk ----------------------------------------------------


def fused_head_supported(head: nn.Module) -> bool:
    """Whether head(x) is exactly F.linear(x, head.weight, head.bias) on plain tensors."""
    weight = getattr(head, "weight", None)
    return (
        type(head).forward is nn.Linear.forward  # not bnb Linear4bit/8bitLt, not a LoRA wrapper
        and type(weight) in (nn.Parameter, Tensor)  # not Params4bit, not a DTensor shard
        and weight.dtype.is_floating_point
        and not (head._forward_hooks or head._forward_pre_hooks)  # FSDP2 hooks
        # accelerate's offload/dispatch hooks replace the instance's forward instead
        and "forward" not in vars(head)
        and not hasattr(head, "_hf_hook")
    )


def _row_blocks(rows: int) -> list[slice]:
    step = max(1, -(-rows // ROW_BLOCKS))
    return [slice(s, s + step) for s in range(0, rows, step)]


def _fp32_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """[M, H] -> [M, V] fp32, the one [M, V] buffer; values as F.linear(...).float()."""
    if hidden.dtype == torch.float32:
        return F.linear(hidden, weight, bias)
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0], dtype=torch.float32)
    for rows in _row_blocks(hidden.shape[0]):
        logits[rows] = F.linear(hidden[rows], weight, bias)
    return logits


def _times_weight(probs: Tensor, weight: Tensor) -> Tensor:
    """[M, V] fp32 @ [V, H] in the head's dtype (as autograd would), result in fp32."""
    if weight.dtype == torch.float32:
        return probs @ weight
    out = probs.new_empty(probs.shape[0], weight.shape[1])
    for rows in _row_blocks(probs.shape[0]):
        out[rows] = probs[rows].to(weight.dtype) @ weight
    return out


def _exp_(shifted: Tensor) -> Tensor:
    """shifted = l - top [M, V] becomes exp(shifted) in place; returns sum_v e_v shifted_v [M, 1].

    Block by block of rows: exp(shifted) and shifted coexist only in a small buffer, and the sum
    is a batched dot product (no [M, V] product, no log, the block stays in cache).
    """
    dot = shifted.new_empty(shifted.shape[0], 1)
    blocks = _row_blocks(shifted.shape[0])
    buf = shifted.new_empty(blocks[0].stop - blocks[0].start, shifted.shape[1])
    for rows in blocks:
        s = shifted[rows]
        e = torch.exp(s, out=buf[: s.shape[0]])
        dot[rows] = torch.bmm(e.unsqueeze(1), s.unsqueeze(2)).squeeze(-1)
        s.copy_(e)
    return dot


class _HeadLogProb(torch.autograd.Function):
    """hidden [M, H] -> (log softmax(head(hidden) / T)[target] [M], entropy [M], detached).

    With l = logits / T, top = max_v l, e = exp(l - top), z = sum_v e:
      logp = l_t - top - log z,  entropy = log z - sum_v e_v (l_v - top) / z,
      d logp / d hidden = ((z - e_t) W_t - sum_{v != t} e_v W_v) / (z T).
    The gradient keeps the target's own term out of the matmul: when p_t is near 1 both parts are
    small and neither is the difference of two nearly equal numbers (in bf16 the rounding error of
    sum_v p_v W_v alone can exceed W_t - E_p[W]). All of it is computed in place in the one logits
    buffer; backward only scales the saved [M, H] direction by the incoming gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, need_grad):
        logits = _fp32_logits(hidden, weight, bias)
        if temperature != 1.0:
            logits.div_(temperature)
        t = targets.unsqueeze(-1)
        top = logits.amax(-1, keepdim=True)
        target_l = logits.gather(-1, t) - top  # [M, 1]
        e_dot_l = _exp_(logits.sub_(top))  # the logits are gone from here on
        e = logits
        e_t = target_l.exp()
        e.scatter_(-1, t, 0.0)  # the target's own term is added back exactly below
        rest = e.sum(-1, keepdim=True)  # z - e_t, without cancellation
        z = rest + e_t
        if need_grad:
            w_t = weight[targets].float()
            ctx.save_for_backward((rest * w_t - _times_weight(e, weight)) / (z * temperature))
            ctx.hidden_dtype = hidden.dtype
        entropy = (z.log() - e_dot_l / z).squeeze(-1)
        ctx.mark_non_differentiable(entropy)
        return (target_l - z.log()).squeeze(-1), entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        (direction,) = ctx.saved_tensors
        grad_hidden = (grad_logp.unsqueeze(-1) * direction).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None


def fused_head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """hidden [M, H], targets [M] -> (logp [M], entropy [M]); gradients reach `hidden` only."""
    if not fused_head_supported(head):
        raise TypeError(f"the fused log-prob path needs a plain nn.Linear head, not {type(head)}")
    if torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters()):
        raise ValueError("the fused log-prob path does not train lm_head: use the checkpointed one")
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _by_chunks(
        lambda h, t: _HeadLogProb.apply(h, head.weight, head.bias, t, temperature, need_grad),
        hidden,
        targets,
        chunk_tokens,
    )


def _by_chunks(fn, hidden: Tensor, targets: Tensor, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """fn(hidden rows, target rows) -> (logp, entropy) over chunks of rows, concatenated."""
    logps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_tokens):
        lp, ent = fn(hidden[s : s + chunk_tokens], targets[s : s + chunk_tokens])
        logps.append(lp)
        ents.append(ent.detach())
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


# --- checkpointed: the general fallback ----------------------------------------------------------


def _chunk_logp(
    head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """hidden [M, H], targets [M] -> (log pi(target) [M], entropy [M] (detached))."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def checkpointed_head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """As `fused_head_logprobs` for any head module (its own parameters get gradients too)."""
    use_ckpt = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )

    def chunk(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        if use_ckpt:  # backward recomputes this chunk's logits instead of keeping them
            return checkpoint(_chunk_logp, head, h, t, temperature, use_reentrant=False)
        return _chunk_logp(head, h, t, temperature)

    return _by_chunks(chunk, hidden, targets, chunk_tokens)


def head_logprobs(
    head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """The fused path where it applies, else the checkpointed one (see the module docstring)."""
    trains_head = torch.is_grad_enabled() and any(p.requires_grad for p in head.parameters())
    autocast = torch.is_autocast_enabled(hidden.device.type)
    if trains_head or autocast or not fused_head_supported(head):
        return checkpointed_head_logprobs(head, hidden, targets, chunk_tokens, temperature)
    return fused_head_logprobs(head, hidden, targets, chunk_tokens, temperature)


# --- from token ids -------------------------------------------------------------------------------


def position_ids_from(attention_mask: Tensor) -> Tensor:
    """Position ids of left-padded rows as generate counts them: the real tokens 0, 1, 2, ...
    (padding gets 0; it is masked out anyway)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def completion_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int
) -> Tensor:
    """Decoder hidden states at the positions that predict completion tokens: [N, T, H]."""
    position_ids = position_ids_from(attention_mask)
    hidden = _decoder_hidden(model, input_ids, attention_mask, position_ids)
    return hidden[:, prompt_len - 1 : -1]


def _decoder_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor
) -> Tensor:
    """The decoder's last hidden states [rows, L, H] (attention_mask 2-D, or a prepared 4-D)."""
    base = unwrap(model)
    _check_supported(base)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    if (hasattr(model, "module") and torch.is_grad_enabled()) or is_fsdp(model):
        # A distributed wrapper (DDP) arms its gradient all-reduce in its own forward: calling the
        # decoder underneath would leave every process with its own gradient; FSDP's root forward
        # also gathers the parameters no decoder layer owns. Go through it (logits of one position
        # only) and take the decoder's output from a hook: asking for output_hidden_states would
        # keep every layer's output alive to the end of the forward, which gradient checkpointing
        # and activation offloading exist to avoid.
        found = []
        hook = base.get_decoder().register_forward_hook(lambda m, args, out: found.append(out))
        try:
            model(**kwargs, logits_to_keep=1)
        finally:
            hook.remove()
        out = found[-1]
    else:
        out = base.get_decoder()(**kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# --- shared prompts: a group's prompt computed once ------------------------------------------

# The dense [L, L] masks of one packed forward stay under this many bytes (bool, all groups).
SHARED_PROMPT_MASK_BYTES = 64 * 2**20


def _layer_costs(config) -> tuple[float, float] | None:
    """FLOPs per token of one layer's linear maps and per (query, key) pair of its attention, for
    a dense decoder with full attention; None for anything else (sliding windows, MoE, unknown
    shapes), which then never packs."""
    if getattr(config, "use_sliding_window", False) or any(
        kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])
    ):
        return None
    if getattr(config, "sliding_window", None) and not hasattr(config, "use_sliding_window"):
        return None  # Mistral-style: a window whenever one is set
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        return None
    try:
        h, heads = config.hidden_size, config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        d = getattr(config, "head_dim", None) or h // heads
        inter = config.intermediate_size
    except AttributeError:
        return None
    linear = 2 * (2 * h * heads * d + 2 * h * kv * d + 3 * h * inter)
    return float(linear), float(4 * heads * d)


def shared_prompt_packing(
    model: nn.Module, rows: int, prompt_len: int, width: int, group_size: int
) -> bool:
    """Whether `completion_hidden` should run each group as one packed row (see below): only with
    SDPA attention (it takes the boolean mask as it is) on a dense full-attention decoder, when the
    estimated FLOPs of the packed rows are lower and their masks stay under
    SHARED_PROMPT_MASK_BYTES. Flash-attention kernels take no such mask: never with them."""
    if group_size < 2 or rows % group_size or prompt_len < 1:
        return False
    config = unwrap(model).config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    costs = _layer_costs(config)
    if costs is None:
        return False
    linear, pair = costs
    g, p, t = group_size, prompt_len, width
    packed_len = p + g * t
    if (rows // g) * packed_len**2 > SHARED_PROMPT_MASK_BYTES:
        return False
    separate = g * (p + t) * linear + g * (p + t) ** 2 * pair
    packed = packed_len * linear + packed_len**2 * pair
    return packed < separate


def pack_shared_prompts(
    input_ids: Tensor, attention_mask: Tensor, prompt_len: int, group_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One row per group: [prompt, completion 1, ..., completion G], L = P + G * T columns.

    The G members of a group share their prompt token for token (they were sampled from it), so
    the decoder computes it once instead of G times. The 4-D boolean mask [B', 1, L, L] lets each
    completion attend to the prompt and, causally, to its own tokens only; position ids are the
    unpacked rows' own, so every completion token sees exactly the context and positions it has
    in its own row, and its log-prob is the same computation. Every query also attends to itself,
    so a left-padding position is never a row with nothing to attend (NaN in SDPA). -> (ids
    [B', L], mask, position ids [B', L], index [G, T] of the positions whose hidden states predict
    each member's completion tokens)."""
    n, width = input_ids.shape
    g, p = group_size, prompt_len
    t, groups, device = width - p, n // group_size, input_ids.device
    positions = position_ids_from(attention_mask)

    def packed(x: Tensor) -> Tensor:
        x = x.view(groups, g, width)
        return torch.cat([x[:, 0, :p], x[:, :, p:].reshape(groups, g * t)], dim=1)

    ids, valid, pos = packed(input_ids), packed(attention_mask).bool(), packed(positions)
    length = p + g * t
    block = torch.cat(
        [
            torch.zeros(p, dtype=torch.long, device=device),
            torch.arange(1, g + 1, device=device).repeat_interleave(t),
        ]
    )  # [L]: 0 for the prompt, i for member i's completion
    idx = torch.arange(length, device=device)
    allowed = (idx[None, :] <= idx[:, None]) & (
        (block[None, :] == 0) | (block[None, :] == block[:, None])
    )  # [L query, L key]
    mask = (allowed[None] & valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=device)
    starts = p + t * torch.arange(g, device=device)  # [G]: each completion's first column
    index = torch.cat(
        [
            torch.full((g, 1), p - 1, dtype=torch.long, device=device),
            starts[:, None] + torch.arange(t - 1, device=device)[None, :],
        ],
        dim=1,
    )  # [G, T]: the last prompt position, then the member's own positions
    return ids, mask[:, None], pos, index


def packed_completion_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, group_size: int
) -> Tensor:
    """`completion_hidden` with each group's prompt computed once: [N, T, H]."""
    ids, mask, pos, index = pack_shared_prompts(input_ids, attention_mask, prompt_len, group_size)
    hidden = _decoder_hidden(model, ids, mask, pos)  # [B', L, H]
    groups, g, t = ids.shape[0], index.shape[0], index.shape[1]
    return hidden[:, index.reshape(-1)].reshape(groups * g, t, hidden.shape[-1])


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    completion_mask: Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    group_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of completion tokens, [N, T] each (zero where mask is 0).

    input_ids/attention_mask: [N, P + T], prompts left-padded to P, completions right-padded to T.
    Gradients flow to the log-probs when grad is enabled; entropies are always detached.
    `group_size` > 1 says the rows are whole groups of that many consecutive rows with one
    prompt each: where `shared_prompt_packing` finds it cheaper, each prompt is computed once.
    """
    width = input_ids.shape[1] - prompt_len
    if shared_prompt_packing(model, input_ids.shape[0], prompt_len, width, group_size):
        hidden = packed_completion_hidden(model, input_ids, attention_mask, prompt_len, group_size)
    else:
        hidden = completion_hidden(model, input_ids, attention_mask, prompt_len)
    head = unwrap(model).get_output_embeddings()
    sel = completion_mask.bool()
    # [M, H] and [M]: completion positions only
    logps, ents = head_logprobs(
        head, hidden[sel], input_ids[:, prompt_len:][sel], chunk_tokens, temperature
    )
    zeros = hidden.new_zeros(sel.shape, dtype=torch.float32)
    return zeros.masked_scatter(sel, logps), zeros.masked_scatter(sel, ents.detach())


def naive_completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    completion_mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """Reference implementation through full [N, L, V] logits; for tests and benchmarks only."""
    position_ids = position_ids_from(attention_mask)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, prompt_len:].unsqueeze(-1))
    return logp.squeeze(-1) * completion_mask
