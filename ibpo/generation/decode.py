"""The package's own decode engine (rollout.decode=graph): one decoding step of the policy written
as a function over a static KV cache, replayed as a CUDA graph on CUDA and called as it is on CPU.

Why not HF `generate`: its decoding step of a QLoRA policy is bound by launching kernels from
Python (every PEFT LoRA branch, every mask and cache update), its SDPA path repeats the KV heads of
a grouped-query model whenever rows are padded, its dynamic cache copies itself every step, and
transformers never compiles a bitsandbytes model. Here:

* the step calls **the policy's own modules** (the NF4 base through bitsandbytes, the PEFT LoRA
  layers, the model's norms and MLPs; on CPU whatever `modeling.dequantized_base` patched in), so
  the rollout policy is exactly the trained one: no second copy, no sync;
* keys and values live in a **static cache** of the engine's own, [rows, kv heads, capacity,
  head dim] per layer, written at one column per step; attention reads only up to the current
  **bucket** (a multiple of `bucket` columns: a bucket change is a new slice of the same buffers,
  never a copy) and never repeats KV heads (SDPA's `enable_gqa`); which columns a row attends to
  is a boolean mask (left padding, and the gap between a shared prefix and a prompt's rest);
* **sampling and the behaviour log-prob run inside the step** on the device, with the same
  transforms and the same `draw` as generation.sampling, so the same random stream gives the same
  tokens as the eager path; EOS and the token budget are a done mask, and the host asks whether
  every row is done only every `check_every` steps (each step on CPU, where asking is free);
* on CUDA the step is **captured once per (rows, bucket)** as a CUDA graph and replayed; a capture
  that fails turns the engine off for the rest of the phase, with the reason logged, and the call
  decodes through HF generate (the eager path) instead.

The prompt's cache (all but its last token) comes from the model's own forward, built by hf.py
as before (a group's prompt once, shared prefixes once) and copied into the static cache; the last
prompt token is the first token the step runs. Supported: decoder-only Llama-family models
(llama, mistral without a sliding window, qwen2, qwen3) whose rotary frequencies do not depend on
the length; anything else decodes with HF generate, with one log line saying why.

Not here: the prompt forwards (prefixes.py), the Rollout (rollout.py), grading.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from ibpo.distributed import is_fsdp
from ibpo.generation.sampling import draw, top_k_filter, top_p_filter
from ibpo.logprobs import unwrap
from ibpo.sizes import DECODE_BUCKET

log = logging.getLogger(__name__)

# model types whose decoder layer is (input norm, attention with q/k/v/o projections and optional
# per-head q/k norms, post-attention norm, MLP) with rotary positions: the step below
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# rotary variants whose inverse frequencies are fixed (the others rescale with the length)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
# cache columns per bucket: attention reads whole buckets; on CUDA each bucket is one captured
# graph per row count, so the bucket is coarser there (sizes.DECODE_BUCKET, which the planner
# counts)
BUCKET_CUDA, BUCKET_CPU = DECODE_BUCKET, 64
# steps between the host's "is every row done?" reads on CUDA (each read waits for the device)
CHECK_EVERY_CUDA = 8


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the engine cannot decode `model` (None: it can)."""
    if is_fsdp(model):
        return "FSDP-sharded weights are gathered for HF generate only"
    base = unwrap(model)
    config = base.config
    text = getattr(config, "get_text_config", lambda: config)()
    kind = getattr(text, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model type '{kind}' is not one the engine supports ({', '.join(SUPPORTED_TYPES)})"
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(base, "lm_head") or not hasattr(inner, "rotary_emb"):
        return "the model does not have the Llama-family layout (model.layers, lm_head, rotary_emb)"
    layer_types = getattr(text, "layer_types", None) or []
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    if any(t != "full_attention" for t in layer_types) or (not layer_types and sliding):
        return "the model has sliding-window attention layers"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE or not hasattr(inner.rotary_emb, "inv_freq"):
        return f"its rotary embedding '{rope}' changes with the length"
    for attr in ("final_logit_softcapping", "attn_logit_softcapping", "logit_scale"):
        if getattr(text, attr, None) not in (None, 1.0):
            return f"config.{attr} is set"
    if getattr(text, "pretraining_tp", 1) not in (None, 1):
        return "config.pretraining_tp > 1"
    return None


@dataclass(frozen=True)
class Sampling:
    """How a call picks its tokens: greedy (do_sample False) or sampled at a temperature with
    top-k / top-p, exactly as generation.sampling.SampledLogprobs does."""

    do_sample: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class DecodeEngine:
    """Decodes for one model through one generation phase (a rollout, its repairs, an
    evaluation), one call (a generate() slice) at a time: `load` builds the call's static cache
    from its prompt cache, `decode` runs it and frees the cache and its graphs. Nothing is kept
    between calls: the next call's prompt forward then never shares the card with this call's
    cache (the planner's generation phases count one or the other), at the price of capturing
    each call's graphs anew (`capture_seconds` adds up what that cost)."""

    def __init__(self, model: nn.Module, capture: bool | None = None):
        base = unwrap(model)
        self.inner, self.lm_head = base.model, base.lm_head
        self.layers = list(self.inner.layers)
        rope = self.inner.rotary_emb
        self.inv_freq = rope.inv_freq
        self.rope_scaling = float(getattr(rope, "attention_scaling", 1.0))
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        text = getattr(base.config, "get_text_config", lambda: base.config)()
        self.kv_heads = text.num_key_value_heads
        self.device = next(p for p in model.parameters()).device
        cuda = self.device.type == "cuda"
        self.capture = cuda if capture is None else capture
        self.bucket = BUCKET_CUDA if cuda else BUCKET_CPU
        self.check_every = CHECK_EVERY_CUDA if cuda else 1
        self.disabled: str | None = None  # why the engine stopped decoding (capture failed)
        self.capture_seconds = 0.0  # spent capturing graphs (warm-up runs included)
        self.calls = 0  # calls decoded to the end
        self._state: _State | None = None
        self._call: tuple[Tensor, int] | None = None  # the loaded call's (ids, max_new_tokens)

    # --- the step ------------------------------------------------------------------------
    def _forward(self, s: _State, width: int) -> None:
        """One token per row through the model: s.tokens at s.positions, written to cache column
        s.column; attention over the first `width` columns. Logits -> s.logits (float32)."""
        n = s.tokens.shape[0]
        x = self.inner.embed_tokens(s.tokens.view(n, 1))  # [n, 1, H]
        freqs = s.positions.view(n, 1, 1).float() * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), -1)  # [n, 1, d]
        cos = (emb.cos() * self.rope_scaling).to(x.dtype)
        sin = (emb.sin() * self.rope_scaling).to(x.dtype)
        s.valid.index_fill_(1, s.column, True)
        mask = s.valid[:, None, None, :width]  # [n, 1, 1, width]
        for layer, k_cache, v_cache in zip(self.layers, s.keys, s.values):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, 1, -1, self.head_dim)
            k = attn.k_proj(h).view(n, 1, -1, self.head_dim)
            v = attn.v_proj(h).view(n, 1, -1, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, heads, 1, d]
            q = q * cos.unsqueeze(1) + _rotate_half(q) * sin.unsqueeze(1)
            k = k * cos.unsqueeze(1) + _rotate_half(k) * sin.unsqueeze(1)
            k_cache.index_copy_(2, s.column, k)
            v_cache.index_copy_(2, s.column, v)
            out = nn.functional.scaled_dot_product_attention(
                q,
                k_cache[:, :, :width],
                v_cache[:, :, :width],
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=True,
            )
            x = x + attn.o_proj(out.transpose(1, 2).reshape(n, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        s.logits.copy_(self.lm_head(self.inner.norm(x))[:, 0].float())

    def _advance(self, s: _State, scores: Tensor) -> None:
        """Pick each row's token from its processed scores, record it and its log-prob, mark the
        rows that ended and move every row one column on. Device ops only (capturable)."""
        if s.sampling.do_sample:
            p = s.sampling
            scores = scores / p.temperature if p.temperature != 1.0 else scores
            scores = top_p_filter(top_k_filter(scores, p.top_k), p.top_p)
            lse = scores.logsumexp(-1, keepdim=True)
            token = draw(scores, lse).view(-1)
            s.logprobs.index_copy_(1, s.step, (scores.gather(1, token.view(-1, 1)) - lse))
        else:
            token = scores.argmax(-1)
        token = torch.where(s.done, s.pad, token)
        ended = torch.isin(token, s.eos) & ~s.done
        s.ends.masked_fill_(ended, 0).add_(torch.where(ended, s.step, 0))
        s.done.logical_or_(ended)
        s.out.index_copy_(1, s.step, token.view(-1, 1))
        s.tokens.copy_(token)
        s.positions.add_(1)
        s.column.add_(1)
        s.step.add_(1)

    def _suppress_eos(self, s: _State, scores: Tensor) -> Tensor:
        """HF's min_new_tokens: EOS impossible before that many tokens (bench_decode uses it to
        decode every row to full length)."""
        early = (s.step < s.min_new).view(1, 1) & s.eos_columns
        return scores.masked_fill(early, float("-inf"))

    def _whole_step(self, s: _State, width: int) -> None:
        self._forward(s, width)
        self._advance(s, self._suppress_eos(s, s.logits) if s.min_new_tokens else s.logits)

    # --- running it ------------------------------------------------------------------------
    def load(
        self,
        ids: Tensor,
        mask: Tensor,
        cache,
        *,
        max_new_tokens: int,
        eos: list[int],
        pad_id: int,
        sampling: Sampling,
        min_new_tokens: int = 0,
    ) -> None:
        """A call's prompt: ids, mask [n, W] (the inputs HF generate would get) and the HF cache
        of their first W - 1 columns (None when W == 1), copied into the static cache. A call of
        its own so that the caller's prompt cache is freed before decoding starts."""
        n, width = ids.shape
        capacity = -(-(width + max_new_tokens) // self.bucket) * self.bucket
        dtype = self.inner.embed_tokens.weight.dtype
        if cache is not None:
            dtype = cache.layers[0].keys.dtype
        self.release()
        self._state = _State.allocate(self, ids, mask, cache, capacity, dtype)
        self._state.constants(eos, pad_id, sampling, min_new_tokens)
        self._call = (ids, max_new_tokens)

    def decode(self, processors=()) -> tuple[Tensor, Tensor | None] | None:
        """Decode the loaded call -> (new tokens [n, t], their behaviour log-probs [n, t] or None
        for greedy), t = the steps until every row ended (as HF generate returns them: pad after
        a row's EOS). `processors`: logits processors run on the host before the pick (as HF
        generate's). None: capturing the step failed and the engine is off; decode this call
        with HF generate."""
        try:
            return None if self.disabled else self._decode(processors)
        finally:
            self.release()

    def _decode(self, processors) -> tuple[Tensor, Tensor | None] | None:
        s = self._state
        ids, max_new_tokens = self._call
        steps = 0
        for k in range(max_new_tokens):
            width = self._bucket(ids.shape[1] + k)
            if processors:
                self._run(("forward", width), partial(self._forward, s, width))
                scores = s.logits
                if s.min_new_tokens:
                    scores = self._suppress_eos(s, scores)
                context = torch.cat([ids, s.out[:, :k]], 1)
                for processor in processors:
                    scores = processor(context, scores)
                self._advance(s, scores)
            else:
                self._run(("step", width), partial(self._whole_step, s, width))
            if self.disabled:
                return None
            steps = k + 1
            if steps % self.check_every == 0 or steps == max_new_tokens:
                if bool(s.done.all()):
                    break
        # HF generate stops at the first step after which every row has ended: trim to that
        if bool(s.done.all()):
            steps = int(s.ends.max()) + 1
        logprobs = s.logprobs[:, :steps].clone() if s.sampling.do_sample else None
        self.calls += 1
        return s.out[:, :steps].clone(), logprobs

    def _bucket(self, columns: int) -> int:
        """Columns attention reads when `columns` are in use: a whole number of buckets, at most
        the capacity."""
        b = self.bucket
        return min(-(-columns // b) * b, self._state.capacity)

    def _run(self, key, fn) -> None:
        """fn() once: eagerly, or as the CUDA graph captured for `key` (captured on first use)."""
        if not self.capture:
            fn()
            return
        graphs = self._state.graphs
        graph = graphs.get(key)
        if graph is None:
            start = time.perf_counter()
            try:
                graph = self._state.capture(fn)
            except Exception as e:  # noqa: BLE001 - any capture failure: this phase decodes eagerly
                self.disabled = f"capturing the decode step failed: {type(e).__name__}: {e}"
                log.warning(
                    "ibpo: rollout.decode=graph: %s; this phase decodes with HF generate "
                    "(rollout.decode=eager)",
                    self.disabled[:300],
                )
                return
            graphs[key] = graph
            self.capture_seconds += time.perf_counter() - start
        graph.replay()

    def release(self) -> None:
        """Free the static cache and the captured graphs (decode does, after each call)."""
        self._state = None
        self._call = None


@dataclass(eq=False)
class _State:
    """The engine's buffers for `rows` rows: the static cache, the step's inputs and outputs, and
    the captured graphs that read and write them."""

    rows: int
    capacity: int
    keys: list[Tensor]  # per layer [rows, kv heads, capacity, d]
    values: list[Tensor]
    valid: Tensor  # [rows, capacity] bool: columns a row attends to
    tokens: Tensor  # [rows] the token each row runs next
    positions: Tensor  # [rows] its position id
    column: Tensor  # [1] the cache column it is written to
    step: Tensor  # [1] tokens decoded so far
    done: Tensor  # [rows] bool: ended (EOS)
    ends: Tensor  # [rows] the step at which a row ended
    logits: Tensor  # [rows, V] float32
    out: Tensor  # [rows, max_new] decoded tokens
    logprobs: Tensor  # [rows, max_new] float32 behaviour log-probs
    graphs: dict
    pool: object = None
    # the call's constants (constants())
    sampling: Sampling | None = None
    pad: Tensor | None = None
    eos: Tensor | None = None
    eos_columns: Tensor | None = None  # [1, V] bool
    min_new: Tensor | None = None
    min_new_tokens: int = 0

    @staticmethod
    def allocate(engine: DecodeEngine, ids, mask, cache, capacity: int, dtype) -> _State:
        """The buffers of one call, its prompt loaded: the cache of its first W - 1 columns
        copied in layer by layer, each layer of the HF cache freed once copied (the caller gave
        it up), so that the two are never both whole; its last token is the next input."""
        dev, (rows, width) = engine.device, ids.shape
        shape = (rows, engine.kv_heads, capacity, engine.head_dim)
        keys, values = [], []
        for i in range(len(engine.layers)):
            keys.append(torch.zeros(shape, dtype=dtype, device=dev))
            values.append(torch.zeros(shape, dtype=dtype, device=dev))
            if cache is not None:
                layer = cache.layers[i]
                keys[i][:, :, : width - 1].copy_(layer.keys)
                values[i][:, :, : width - 1].copy_(layer.values)
                layer.keys = layer.values = None
        valid = torch.zeros(rows, capacity, dtype=torch.bool, device=dev)
        valid[:, : width - 1] = mask[:, :-1].bool()
        vocab = engine.lm_head.weight.shape[0]
        long = dict(dtype=torch.long, device=dev)
        return _State(
            rows=rows,
            capacity=capacity,
            keys=keys,
            values=values,
            valid=valid,
            tokens=ids[:, -1].clone(),
            positions=mask.long().sum(-1) - 1,  # generate's: cumulative sum of the mask - 1
            column=torch.full((1,), width - 1, **long),
            step=torch.zeros(1, **long),
            done=torch.zeros(rows, dtype=torch.bool, device=dev),
            ends=torch.zeros(rows, **long),
            logits=torch.zeros(rows, vocab, dtype=torch.float32, device=dev),
            out=torch.zeros(rows, capacity, **long),
            logprobs=torch.zeros(rows, capacity, dtype=torch.float32, device=dev),
            graphs={},
        )

    def constants(self, eos: list[int], pad_id: int, sampling: Sampling, min_new: int) -> None:
        """The call's constants, as device tensors the step (and its graphs) read."""
        dev = self.tokens.device
        self.sampling = sampling
        self.out.fill_(pad_id)
        self.pad = torch.tensor(pad_id, device=dev)
        self.eos = torch.tensor(eos, dtype=torch.long, device=dev)
        self.eos_columns = torch.zeros(1, self.logits.shape[1], dtype=torch.bool, device=dev)
        self.eos_columns[0, self.eos] = True
        self.min_new_tokens = min_new
        self.min_new = torch.tensor(min_new, device=dev)

    def capture(self, fn) -> torch.cuda.CUDAGraph:
        """fn captured as a CUDA graph. CUDA wants an eager run on a side stream first; it writes
        the very buffers the real step writes next, so the step's small state and the random
        generator are put back afterwards and the real step redoes its work."""
        small = (self.tokens, self.positions, self.column, self.step, self.done, self.ends)
        saved = [t.clone() for t in small]
        rng = torch.cuda.get_rng_state(self.tokens.device)
        side = torch.cuda.Stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream(self.tokens.device))
        with torch.cuda.stream(side):
            fn()
            for t, v in zip(small, saved):
                t.copy_(v)
        torch.cuda.current_stream(self.tokens.device).wait_stream(side)
        torch.cuda.set_rng_state(rng, self.tokens.device)
        if self.pool is None:  # one memory pool for every graph of these buffers
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph
