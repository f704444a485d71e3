"""Sample G completions per prompt with HF `generate`; build the padded tensors the loss needs.

Prompts are left-padded to one length P so that completions start at the same column; the policy
is put in eval mode (dropout off, KV cache on, no gradient checkpointing) and restored afterwards.
Completions are right-padded to T; a completion's mask covers its tokens up to and including the
first EOS. Large rollouts are generated in slices of `batch_size` sequences. The G copies of a
prompt share one prompt forward (`prefill`): its KV cache is computed once and repeated.
Distinct prompts that begin alike (a group's repair prompts, held-out questions under one chat
preamble) share the forward of their common prefix the same way (`plan_shared_prefixes`,
`shared_prefix_inputs`; generate's `share_prefixes`), wherever that computes fewer token slots.

Callers that generate (scoring, repairs, evaluation) take a `Generator`: `hf_generator(model)`
here, or a vLLM engine's (vllm_rollout.py); both return the same `Rollout`.

Behaviour log-probs: a sampled rollout carries, for each completion token, its log-probability
under the distribution it was actually drawn from (`Rollout.logprobs`), so the update can check
that rollouts came from the policy it trains (step.py) and correct for the difference
(objectives.importance_weights). Here the sampling transforms (temperature, then top-k, then
top-p) run as the last logits processor of `generate`, `SampledLogprobs`, which keeps
log_softmax of the very scores transformers samples from (generate's own warpers stay off). They
are the sampler's numbers: its kernels, KV cache, dtype and, on CPU, the dequantised base with the
adapter folded in. Greedy calls (evaluation) report none.

Sampling streams: a step draws its completions from random streams of its own, seeded from the
run's seed, the process, the step, the phase (rollout or repair) and the round
(`SamplingStreams`), and leaves the process's streams as they were. What a step samples then
depends on the policy and on nothing else that drew random numbers before it: two runs that
differ only in what they do with their samples (IBPO and DFPO, an ablation and its full method)
draw from the same uniforms at every step, and a resumed run samples as an uninterrupted one.

Not here: grading, advantages, or any gradient computation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import transformers
from packaging.version import Version
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
        )


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
    )


def set_kv_cache(model: nn.Module, kind: str) -> None:
    """The KV cache of every later generate() call (rollouts, repairs, evaluation), set on the
    model's generation config: `dynamic` (what a run uses, whatever cache the model's own
    generation config names) grows per token; `static` pre-allocates the cache once per call at
    its final length (no torch.cat regrowth, fixed shapes). No torch.compile of the decoding step:
    transformers does not compile bitsandbytes 4-bit models, and an uncompiled static cache is
    what this is about."""
    config = unwrap(model).generation_config
    config.cache_implementation = None if kind == "dynamic" else "static"
    config.disable_compile = True


# Logit processing a model's own generation_config can switch on beyond what is asked for here
# (a repetition penalty, min_p, no_repeat_ngram_size...): all off, so that rollouts come from the
# policy's distribution at the configured temperature / top-p / top-k, the one the update trains,
# and the vllm backend (which ignores them) samples the same way.
NEUTRAL_PROCESSING = (
    "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "min_p",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "sequence_bias", "bad_words_ids",
    "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "exponential_decay_length_penalty", "guidance_scale",
)  # fmt: skip


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


def top_k_filter(scores: Tensor, k: int) -> Tensor:
    """[n, V] -> [n, V]: scores outside each row's k largest set to -inf (ties at the k-th kept)."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = scores.topk(k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_filter(scores: Tensor, p: float) -> Tensor:
    """[n, V] -> [n, V]: keep each row's smallest set of most likely tokens whose probability
    reaches p (the nucleus; at least one token), the rest set to -inf."""
    if p >= 1.0:
        return scores
    ordered, order = scores.sort(-1, descending=True)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
    drop = before >= p
    drop[..., 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(-1, order, ordered)


def draw(scores: Tensor, lse: Tensor) -> Tensor:
    """One token per row from softmax(scores), [n, V] -> [n, 1], by inverting the cumulative
    distribution at one uniform draw per row. The cumulative sum is in float64, so a token's
    interval is its probability to ~1e-16 (in float32 a token below ~6e-8 would get an interval of
    0 or 6e-8). Only tokens of non-zero probability can come out: the draw u is kept strictly
    below the total, and the first index whose cumulative sum exceeds u has p > 0. Costs one
    uniform per row where torch.multinomial draws an exponential per vocabulary entry."""
    cdf = (scores - lse).double().exp_().cumsum_(-1)  # [n, V]
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)


class SampledLogprobs:
    """The last logits processor of a sampled `generate`: applies temperature, top-k and top-p
    (generate's own are off), draws each row's token itself (`draw`) and records log-probs of the
    drawn tokens under the processed scores.

    It returns 0 at the drawn token and -inf elsewhere, and generate runs greedy, so the token
    taken is the one drawn here from softmax of the processed scores: log_softmax of those at the
    drawn token is exactly the sampling distribution's log-prob. The drawn token is only known at
    the next call (the last column of input_ids), so the previous call's scores and
    log-normaliser are kept until then (one [n, V] tensor); `finish` reads the last token from the
    output."""

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.previous: tuple[Tensor, Tensor] | None = None  # scores [n, V], logsumexp [n, 1]
        self.columns: list[Tensor] = []  # [n] per generated token

    def _record(self, tokens: Tensor) -> None:
        scores, lse = self.previous
        self.columns.append((scores.gather(1, tokens.view(-1, 1)) - lse).squeeze(1))

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.previous is not None:
            self._record(input_ids[:, -1])
        scores = scores / self.temperature if self.temperature != 1.0 else scores
        scores = top_p_filter(top_k_filter(scores, self.top_k), self.top_p)
        lse = scores.logsumexp(-1, keepdim=True)
        self.previous = (scores, lse)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, draw(scores, lse), 0.0)

    def finish(self, completions: Tensor) -> Tensor:
        """completions [n, t] as generate returned them -> their log-probs [n, t] (float32)."""
        if self.previous is not None:
            self._record(completions[:, -1])
            self.previous = None
        if len(self.columns) != completions.shape[1]:
            raise RuntimeError(
                f"recorded {len(self.columns)} log-probs for {completions.shape[1]} generated "
                "tokens: another logits processor ran after ibpo's sampling transforms"
            )
        return torch.stack(self.columns, 1).float()


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


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer,
    prompts: list[str],
    num_samples: int,
    max_new_tokens: int,
    batch_size: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    logits_processor=None,
    share_prefixes: bool = True,
) -> Rollout:
    """`num_samples` completions of each prompt, grouped prompt-major: N = len(prompts) * G.
    `logits_processor`: extra processing after the model's (e.g. evaluation's per-row seeded
    sampling over greedy decoding). A sampled rollout carries its behaviour log-probs."""
    device = next(p for p in model.parameters()).device
    # the host copies give each row's real ids (prefix sharing plans on them) without a read
    # from the device
    host_ids, host_mask = encode_prompts(tokenizer, prompts, num_samples, "cpu")
    prompt_ids, prompt_mask = host_ids.to(device), host_mask.to(device)
    eos = eos_ids(tokenizer, model)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        use_cache=True,
        # transformers would keep processes decoding in lock-step under FSDP (an all-reduce per
        # token); the trainer generates on gathered weights (distributed.gathered), so each
        # process stops when its own sequences are done and may make its own number of calls
        synced_gpus=False,
        # None = off (an explicit None overrides the model's generation_config); only the fields
        # this transformers version knows, others would be taken for model inputs
        **{k: None for k in NEUTRAL_PROCESSING if hasattr(unwrap(model).generation_config, k)},
        # one sequence per sample: a num_beams from the model's config would run beam search
        **{
            k: 1
            for k in ("num_beams", "num_beam_groups")
            if hasattr(unwrap(model).generation_config, k)
        },
        # always greedy for generate: when sampling, SampledLogprobs applies temperature, top-k
        # and top-p and draws the token itself (generate's own warpers stay off)
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    was_training = model.training
    model.eval()
    # DistributedDataParallel has no .generate; the PEFT model under it does (adapter included)
    gen_model = getattr(model, "module", model)
    pieces, logprobs = [], []
    computed = 0  # prompt tokens the model ran: repeated and shared prefixes count once
    # slices after the first sample from streams of their own (sampling streams, below), so that
    # what a slice draws does not depend on how long the slices before it decoded
    key = stream_position(device) if do_sample else None
    try:
        for k, s in enumerate(range(0, prompt_ids.shape[0], batch_size)):
            # transformers sizes a static cache to the longest generate() call so far (to spare
            # recompilation); each call here gets its own length (a repair prompt is ~3x longer)
            vars(unwrap(model)).pop("_previous_max_cache_length", None)
            processors = list(logits_processor or [])
            recorder = SampledLogprobs(temperature, top_k, top_p) if do_sample else None
            ids, mask = prompt_ids[s : s + batch_size], prompt_mask[s : s + batch_size]
            inputs = dict(input_ids=ids, attention_mask=mask)
            width = ids.shape[1]  # left-padded: a row's real ids are its last ones
            host = zip(host_ids[s : s + batch_size].tolist(), host_mask[s : s + batch_size].sum(-1))
            real = [row[width - int(m) :] for row, m in host]
            if shares_prefill(gen_model, ids.shape, num_samples):
                inputs[CACHE_KWARG] = prefill(gen_model, ids, mask, num_samples)
                computed += sum(len(r) - 1 for r in real[::num_samples]) + len(real)
            elif share_prefixes and num_samples == 1 and shares_prefixes(gen_model):
                runs = plan_shared_prefixes(real)
                if runs is not None:
                    plan = shared_prefix_inputs(
                        gen_model, real, runs, tokenizer.pad_token_id, device
                    )
                    inputs = dict(input_ids=plan.input_ids, attention_mask=plan.attention_mask)
                    inputs[CACHE_KWARG] = plan.cache
                    computed += plan.computed_tokens
                else:
                    computed += sum(len(r) for r in real)
            else:
                computed += sum(len(r) for r in real)
            with sampling_stream(device, key, k) if key and k else nullcontext():
                out = gen_model.generate(
                    logits_processor=processors + ([recorder] if recorder else []),
                    **inputs,
                    **kwargs,
                )
            pieces.append(out[:, inputs["input_ids"].shape[1] :])
            if recorder is not None:
                logprobs.append(recorder.finish(pieces[-1]))
    finally:
        model.train(was_training)
    return assemble(prompt_ids, prompt_mask, pieces, tokenizer, eos, logprobs or None, computed)


def assemble(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    pieces: list[Tensor],
    tokenizer,
    eos: list[int],
    logprobs: list[Tensor] | None = None,
    prefill_tokens: int | None = None,
) -> Rollout:
    """Left-padded prompts [N, P] + completion slices (each [n, t], right-padded, EOS kept) and,
    when the backend reports them, the slices' behaviour log-probs (each [n, t]) and the prompt
    tokens it ran (Rollout.prefill_tokens)."""
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
    )


# (tokenizer, prompts, num_samples, max_new_tokens, batch_size, *, do_sample, temperature, top_p,
#  top_k) -> Rollout: generate() with the model bound, or another backend with the same contract
Generator = Callable[..., Rollout]


def hf_generator(model: nn.Module, share_prefixes: bool = True) -> Generator:
    """The policy's own generate() as a Generator (rollout.backend=hf); `share_prefixes`: prompts
    that begin alike run their common prefix once (off only to compare against it)."""
    return partial(generate, model, share_prefixes=share_prefixes)


# --- sampling streams ----------------------------------------------------------------------------


def stream_seed(*key: int | str) -> int:
    """A 63-bit seed from a key (run seed, process, step, phase, round), the same in every
    Python process and on every platform (unlike hash())."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _own_generator(device: torch.device):
    """(device module, index) of `device`'s own generator; None for the CPU and meta."""
    if device.type in ("cpu", "meta"):
        return None
    module = torch.get_device_module(device.type)
    current = getattr(module, "current_device", lambda: 0)  # mps: one device, no current_device
    return module, device.index if device.index is not None else current()


def stream_position(device: torch.device) -> str:
    """Where the CPU's and `device`'s generators stand, read without drawing: a key for the
    streams of a generate call's later slices. It moves whenever either generator has drawn, so
    two calls never share those streams."""
    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8)
    module, index = _own_generator(device) or (None, None)
    if module is not None:
        digest.update(module.get_rng_state(index).cpu().numpy().tobytes())
    return digest.hexdigest()


@contextmanager
def sampling_stream(device: torch.device, *key: int | str) -> Iterator[None]:
    """Run a block on the CPU's and `device`'s generators seeded from `key`, then put the
    process's own states back. A device without a generator (meta) has nothing to fork."""
    seed = stream_seed(*key)
    module, index = _own_generator(device) or (None, None)
    forked = [] if module is None else [index]
    with torch.random.fork_rng(
        devices=forked, device_type="cpu" if module is None else device.type
    ):
        torch.random.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)  # this device's generator only
        elif module is not None:
            module.manual_seed(seed)
        yield


@dataclass(frozen=True)
class SamplingStreams:
    """One step's sampling streams: `streams(phase, round)` is a context in which generation
    draws from the stream of (seed, process, step, phase, round). Each dynamic-sampling round
    and the repairs get their own, so a round's completions do not depend on how many random
    numbers an earlier round or a repair drew."""

    device: torch.device
    seed: int
    process: int
    step: int

    def __call__(self, phase: str, round_: int = 0):
        return sampling_stream(self.device, self.seed, self.process, self.step, phase, round_)
