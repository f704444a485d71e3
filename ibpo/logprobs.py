"""Memory-bounded completion-token log-probs (and entropy) from hidden states.

A causal LM's forward returns logits for every position: [N, L, V] in fp32 is 2.5 GB for 4,096
tokens at Qwen3's vocabulary of 151,936. Here the decoder runs once, the hidden states of the
positions that predict completion tokens are gathered (prompt and padding positions never reach
the head), and lm_head + logsumexp run over chunks of at most `chunk_tokens` rows. Each chunk is
wrapped in activation checkpointing, so the backward pass recomputes one chunk's logits at a time
instead of keeping them all: peak memory is one chunk of [chunk_tokens, V] regardless of length.

Position ids follow `generate` (cumulative sum of the attention mask), so log-probs of a left-padded
rollout match the distribution it was sampled from. The log-probs are those of softmax(logits / T)
for the sampling temperature T. This module does not decide *which* model (policy or reference):
callers wrap it in `disable_adapter()` for the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT / Accelerate wrappers (LoRA layers stay injected)."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_supported(base: nn.Module) -> None:
    cfg = base.config
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, attr, None) not in (None, 1.0):
            raise NotImplementedError(
                f"models with config.{attr} are not supported by the chunked log-prob path"
            )


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


def completion_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int
) -> Tensor:
    """Decoder hidden states at the positions that predict completion tokens: [N, T, H]."""
    base = unwrap(model)
    _check_supported(base)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    out = base.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, prompt_len - 1 : -1]


def completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    completion_mask: Tensor,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of completion tokens, [N, T] each (zero where mask is 0).

    input_ids/attention_mask: [N, P + T], prompts left-padded to P, completions right-padded to T.
    Gradients flow to the log-probs when grad is enabled; entropies are always detached.
    """
    hidden = completion_hidden(model, input_ids, attention_mask, prompt_len)
    head = unwrap(model).get_output_embeddings()
    sel = completion_mask.bool()
    h_sel = hidden[sel]  # [M, H]: completion positions only
    t_sel = input_ids[:, prompt_len:][sel]  # [M]
    use_ckpt = torch.is_grad_enabled() and h_sel.requires_grad
    logps, ents = [], []
    for s in range(0, h_sel.shape[0], chunk_tokens):
        args = (head, h_sel[s : s + chunk_tokens], t_sel[s : s + chunk_tokens], temperature)
        lp, ent = (
            checkpoint(_chunk_logp, *args, use_reentrant=False) if use_ckpt else _chunk_logp(*args)
        )
        logps.append(lp)
        ents.append(ent)
    n, t = completion_mask.shape
    logp = hidden.new_zeros(n, t, dtype=torch.float32)
    entropy = hidden.new_zeros(n, t, dtype=torch.float32)
    if logps:
        logp = logp.masked_scatter(sel, torch.cat(logps))
        entropy = entropy.masked_scatter(sel, torch.cat(ents).detach())
    return logp, entropy


def naive_completion_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    completion_mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """Reference implementation through full [N, L, V] logits; for tests and benchmarks only."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, prompt_len:].unsqueeze(-1))
    return logp.squeeze(-1) * completion_mask
