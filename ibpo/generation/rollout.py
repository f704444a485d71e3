"""A rollout: N sampled completions with their prompts, in the padded tensors the loss needs, and
what every generation backend builds one from.

Prompts are left-padded to one length P so that completions start at the same column
(`encode_prompts`); completions are right-padded to T, and a completion's mask covers its tokens up
to and including the first EOS (`assemble`). Callers that generate (scoring, repairs, evaluation)
take a `Generator`: `hf_generator(model)` (hf.py), or a vLLM engine's (vllm.py); both return a
`Rollout` made by `assemble`.

Not here: how completions are generated or sampled, grading, advantages, or any gradient
computation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ibpo.logprobs import unwrap


@dataclass(kw_only=True)
class Rollout:
    """N sampled completions with their prompts, built by keyword (assemble, select,
    concat_rollouts); `select` and `concat_rollouts` carry every field."""

    input_ids: Tensor  # [N, P + T] prompt (left-padded) + completion (right-padded)
    attention_mask: Tensor  # [N, P + T]
    completion_mask: Tensor  # [N, T] float: 1 on completion tokens incl. the first EOS
    prompt_len: int  # P
    texts: list[str]  # N decoded completions (special tokens removed)
    truncated: Tensor  # [N] bool: hit max_new_tokens without EOS
    # Host copies, read once where the rollout is made (decoding reads the ids anyway): the
    # completion ids up to their length, each prompt's real length and whether the completion was
    # cut off. Everything downstream
    # (grading, repairs, micro-batch plans, the cancellation trie, counts in the metrics) reads
    # these instead of the device tensors, so the stages between rollout and loss never wait on
    # the GPU. None: computed from the tensors on first use (one read).
    tokens: list[list[int]] | None = None
    prompt_lengths: list[int] | None = None
    cut_off: list[bool] | None = None  # host copy of `truncated`
    # [N, T] float32 on the device: log-prob of each completion token under the distribution the
    # backend sampled it from (0 past the completion); None for greedy decoding or a backend that
    # does not report them
    logprobs: Tensor | None = None
    # prompt tokens the backend ran through the model (a prompt repeated G times, or a prefix that
    # rows share, counts once); None: not reported (the sum of host_prompt_lengths is the bound).
    # Work done, not a property of rows: a selection keeps its rollout's, a concatenation sums
    prefill_tokens: int | None = None
    # row-steps the backend decoded: each call's rows x its steps, a row counting every step of
    # its call, ended or not (decode_idle_share in the step's metrics); None: not reported.
    # Work done, like prefill_tokens
    decode_slots: int | None = None
    # Tool rollouts (multiturn.py): completion_mask is 1 on the tokens the policy wrote only, 0
    # on the tool turns between them (which attention_mask keeps: later turns read them), so
    # the loss, KL, entropy, mismatch and cancellation statistics see the policy's tokens alone
    # and `logprobs` is 0 on tool tokens. `policy_lengths`: each row's count of those (host);
    # `tool_traces`: each row's conversation, calls and errors (multiturn.ToolTrace). None for a
    # rollout without tools, whose completion is all the policy's.
    policy_lengths: list[int] | None = None
    tool_traces: list | None = None

    def host_policy_lengths(self) -> list[int]:
        """[N] tokens each completion's policy wrote (what the loss trains on; host)."""
        return self.lengths if self.policy_lengths is None else self.policy_lengths

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def host_tokens(self) -> list[list[int]]:
        """[N] completion token ids, each up to and including its first EOS."""
        if self.tokens is None:
            lengths = self.completion_mask.sum(-1).long().tolist()
            self.tokens = [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths)]
        return self.tokens

    @property
    def lengths(self) -> list[int]:
        """[N] completion lengths (host)."""
        return [len(t) for t in self.host_tokens()]

    def host_truncated(self) -> list[bool]:
        if self.cut_off is None:
            self.cut_off = self.truncated.tolist()
        return self.cut_off

    def host_prompt_lengths(self) -> list[int]:
        """[N] real (unpadded) prompt lengths (host)."""
        if self.prompt_lengths is None:
            self.prompt_lengths = self.attention_mask[:, : self.prompt_len].sum(-1).tolist()
        return self.prompt_lengths

    @property
    def completion_ids(self) -> Tensor:  # [N, T]
        return self.input_ids[:, self.prompt_len :]

    def select(self, rows: list[int]) -> Rollout:
        """The rollout's rows `rows`, in that order (prefill_tokens: the whole rollout's)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
        tokens, prompts, cut = self.host_tokens(), self.host_prompt_lengths(), self.host_truncated()
        return Rollout(
            input_ids=self.input_ids[idx],
            attention_mask=self.attention_mask[idx],
            completion_mask=self.completion_mask[idx],
            prompt_len=self.prompt_len,
            texts=[self.texts[i] for i in rows],
            truncated=self.truncated[idx],
            tokens=[tokens[i] for i in rows],
            prompt_lengths=[prompts[i] for i in rows],
            cut_off=[cut[i] for i in rows],
            logprobs=None if self.logprobs is None else self.logprobs[idx],
            prefill_tokens=self.prefill_tokens,
            decode_slots=self.decode_slots,
            policy_lengths=_pick(self.policy_lengths, rows),
            tool_traces=_pick(self.tool_traces, rows),
        )


def _pick(values: list | None, rows: list[int]) -> list | None:
    return None if values is None else [values[i] for i in rows]


def concat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts of different prompt/completion widths: prompts re-padded on the left,
    completions on the right (position ids come from the attention mask, so nothing shifts).
    Behaviour log-probs and prefill_tokens only where every rollout has them."""
    P = max(r.prompt_len for r in rollouts)
    T = max(r.completion_mask.shape[1] for r in rollouts)
    pad = nn.functional.pad
    ids, att, cmask, logprobs = [], [], [], []
    for r in rollouts:
        left, right = P - r.prompt_len, T - r.completion_mask.shape[1]
        ids.append(pad(r.input_ids, (left, right), value=pad_id))
        att.append(pad(r.attention_mask, (left, right), value=0))
        cmask.append(pad(r.completion_mask, (0, right), value=0.0))
        if r.logprobs is not None:
            logprobs.append(pad(r.logprobs, (0, right), value=0.0))
    prefill = [r.prefill_tokens for r in rollouts]
    slots = [r.decode_slots for r in rollouts]
    return Rollout(
        input_ids=torch.cat(ids),
        attention_mask=torch.cat(att),
        completion_mask=torch.cat(cmask),
        prompt_len=P,
        texts=[t for r in rollouts for t in r.texts],
        truncated=torch.cat([r.truncated for r in rollouts]),
        tokens=[t for r in rollouts for t in r.host_tokens()],
        prompt_lengths=[n for r in rollouts for n in r.host_prompt_lengths()],
        cut_off=[c for r in rollouts for c in r.host_truncated()],
        logprobs=torch.cat(logprobs) if len(logprobs) == len(rollouts) else None,
        prefill_tokens=None if None in prefill else sum(prefill),
        decode_slots=None if None in slots else sum(slots),
        policy_lengths=_joined([r.policy_lengths for r in rollouts]),
        tool_traces=_joined([r.tool_traces for r in rollouts]),
    )


def _joined(parts: list[list | None]) -> list | None:
    """Per-row host lists of several rollouts, joined; None when no rollout has them (a
    rollout without tools: policy lengths are its lengths, and it has no traces)."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("rollouts with and without tool calls cannot be joined")
    return [x for p in parts for x in p]


# (tokenizer, prompts, num_samples, max_new_tokens, batch_size, *, do_sample, temperature, top_p,
#  top_k) -> Rollout: hf.generate with the model bound, or another backend with the same contract
Generator = Callable[..., Rollout]


def eos_ids(tokenizer, model: nn.Module) -> list[int]:
    ids = {tokenizer.eos_token_id}
    # the transformers model's own stop ids (a DDP wrapper would hide its generation_config)
    gen_eos = getattr(getattr(unwrap(model), "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def completion_mask_from(tokens: Tensor, eos: list[int]) -> tuple[Tensor, Tensor]:
    """tokens [N, T] -> (mask [N, T] up to and including the first EOS, truncated [N])."""
    is_eos = torch.isin(tokens, torch.tensor(eos, device=tokens.device))
    seen_before = (is_eos.cumsum(-1) - is_eos.long()) > 0  # an EOS strictly before this position
    mask = (~seen_before).float()
    return mask, ~is_eos.any(-1)


def encode_prompts(
    tokenizer, prompts: list[str], num_samples: int, device
) -> tuple[Tensor, Tensor]:
    """Prompt ids and mask [N, P], left-padded, each prompt repeated `num_samples` times. No
    special tokens are added: the chat template already holds any BOS the model needs."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids = enc["input_ids"].repeat_interleave(num_samples, 0).to(device)
    return ids, enc["attention_mask"].repeat_interleave(num_samples, 0).to(device)


def assemble(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    pieces: list[Tensor],
    tokenizer,
    eos: list[int],
    logprobs: list[Tensor] | None = None,
    prefill_tokens: int | None = None,
    decode_slots: int | None = None,
) -> Rollout:
    """Left-padded prompts [N, P] + completion slices (each [n, t], right-padded, EOS kept) and,
    when the backend reports them, the slices' behaviour log-probs (each [n, t]), the prompt
    tokens it ran (Rollout.prefill_tokens) and its row-steps (Rollout.decode_slots)."""
    width = max(p.shape[1] for p in pieces)
    pad = nn.functional.pad
    completions = torch.cat(
        [pad(p, (0, width - p.shape[1]), value=tokenizer.pad_token_id) for p in pieces]
    ).to(prompt_ids.device)
    mask, truncated = completion_mask_from(completions, eos)
    behaviour = None
    if logprobs is not None:
        behaviour = torch.cat([pad(lp, (0, width - lp.shape[1])) for lp in logprobs])
        # where(), not a product: a padding position may hold -inf (a token top-p filtered out)
        behaviour = torch.where(mask > 0, behaviour.to(mask.device, torch.float32), 0.0)
    input_ids = torch.cat([prompt_ids, completions], 1)
    attention_mask = torch.cat([prompt_mask, mask.long()], 1)
    lengths = mask.sum(-1).long().tolist()
    tokens = [row[:n] for row, n in zip(completions.tolist(), lengths)]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in tokens]
    prompt_lengths = prompt_mask.sum(-1).tolist()
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=mask,
        prompt_len=prompt_ids.shape[1],
        texts=texts,
        truncated=truncated,
        tokens=tokens,
        prompt_lengths=prompt_lengths,
        cut_off=truncated.tolist(),
        logprobs=behaviour,
        prefill_tokens=prefill_tokens,
        decode_slots=decode_slots,
    )
