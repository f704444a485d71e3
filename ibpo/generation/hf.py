"""Generation with the policy's own HF `generate` (rollout.backend=hf): `generate`, and
`hf_generator`, the Generator (rollout.py) that scoring, repairs and evaluation call.

The policy is put in eval mode (dropout off, KV cache on, no gradient checkpointing) and restored
afterwards. Large rollouts are generated in slices of `batch_size` sequences. The G copies of a
prompt share one prompt forward, and distinct prompts that begin alike share the forward of their
common prefix (prefixes.py; generate's `share_prefixes`). When sampling, generate itself decodes
greedily and ibpo's last logits processor applies the sampling transforms, draws the token and
records its log-prob (sampling.py); the slices after the first draw from streams of their own
(streams.py). `set_kv_cache`: the KV cache of every later call.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

from ibpo.generation.decode import DecodeEngine, Sampling, unsupported_reason
from ibpo.generation.prefixes import (
    CACHE_KWARG,
    plan_shared_prefixes,
    prefill,
    shared_prefix_inputs,
    shares_prefill,
    shares_prefixes,
)
from ibpo.generation.rollout import Generator, Rollout, assemble, encode_prompts, eos_ids
from ibpo.generation.sampling import SampledLogprobs
from ibpo.generation.streams import sampling_stream, stream_position
from ibpo.logprobs import unwrap

log = logging.getLogger(__name__)


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


def generate_kwargs(model: nn.Module, tokenizer, max_new_tokens: int, eos: list[int]) -> dict:
    """The keyword arguments of every HF generate() call of the package: greedy for generate
    itself (SampledLogprobs draws when sampling), the model's own extra logit processing off,
    one sequence per sample, no lock-step decoding."""
    return dict(
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
    engine: DecodeEngine | None = None,
) -> Rollout:
    """`num_samples` completions of each prompt, grouped prompt-major: N = len(prompts) * G.
    `logits_processor`: extra processing after the model's (e.g. evaluation's per-row seeded
    sampling over greedy decoding). A sampled rollout carries its behaviour log-probs.
    `engine`: decode with the package's engine (decode.py) from the same prompt cache; None, or an
    engine that turned itself off, decodes with HF generate."""
    device = next(p for p in model.parameters()).device
    # the host copies give each row's real ids (prefix sharing plans on them) without a read
    # from the device
    host_ids, host_mask = encode_prompts(tokenizer, prompts, num_samples, "cpu")
    prompt_ids, prompt_mask = host_ids.to(device), host_mask.to(device)
    eos = eos_ids(tokenizer, model)
    kwargs = generate_kwargs(model, tokenizer, max_new_tokens, eos)
    was_training = model.training
    model.eval()
    # DistributedDataParallel has no .generate; the PEFT model under it does (adapter included)
    gen_model = getattr(model, "module", model)
    pieces, logprobs = [], []
    computed = 0  # prompt tokens the model ran: repeated and shared prefixes count once
    # slices after the first sample from streams of their own (streams.py), so that
    # what a slice draws does not depend on how long the slices before it decoded
    key = stream_position(device) if do_sample else None
    try:
        for k, s in enumerate(range(0, prompt_ids.shape[0], batch_size)):
            # transformers sizes a static cache to the longest generate() call so far (to spare
            # recompilation); each call here gets its own length (a repair prompt is ~3x longer)
            vars(unwrap(model)).pop("_previous_max_cache_length", None)
            processors = list(logits_processor or [])
            ids, mask = prompt_ids[s : s + batch_size], prompt_mask[s : s + batch_size]
            host = host_ids[s : s + batch_size], host_mask[s : s + batch_size]
            inputs, ran = _prompt_inputs(
                gen_model, tokenizer, ids, mask, host, num_samples, share_prefixes
            )
            computed += ran
            with sampling_stream(device, key, k) if key and k else nullcontext():
                sampling = Sampling(do_sample, temperature, top_k, top_p)
                piece, sampled = _decode(gen_model, inputs, kwargs, engine, sampling, processors)
            pieces.append(piece)
            if sampled is not None:
                logprobs.append(sampled)
    finally:
        model.train(was_training)
    slots = sum(p.shape[0] * p.shape[1] for p in pieces)  # each slice ran all its rows
    return assemble(
        prompt_ids, prompt_mask, pieces, tokenizer, eos, logprobs or None, computed, slots
    )


def _prompt_inputs(
    model, tokenizer, ids, mask, host: tuple, num_samples: int, share_prefixes: bool
) -> tuple[dict, int]:
    """One slice's generate inputs with the prompt cache it can share (a group's prompt run
    once: prefill; prefixes distinct prompts share: prefixes.py), and the prompt tokens the
    model runs for it. `host`: the slice's ids and mask on the host (no read from the device)."""
    inputs = dict(input_ids=ids, attention_mask=mask)
    width = ids.shape[1]  # left-padded: a row's real ids are its last ones
    real = [row[width - int(m) :] for row, m in zip(host[0].tolist(), host[1].sum(-1))]
    if shares_prefill(model, ids.shape, num_samples):
        inputs[CACHE_KWARG] = prefill(model, ids, mask, num_samples)
        return inputs, sum(len(r) - 1 for r in real[::num_samples]) + len(real)
    if share_prefixes and num_samples == 1 and shares_prefixes(model):
        runs = plan_shared_prefixes(real)
        if runs is not None:
            plan = shared_prefix_inputs(model, real, runs, tokenizer.pad_token_id, ids.device)
            shared = dict(input_ids=plan.input_ids, attention_mask=plan.attention_mask)
            shared[CACHE_KWARG] = plan.cache
            return shared, plan.computed_tokens
    return inputs, sum(len(r) for r in real)


def _decode(model, inputs: dict, kwargs: dict, engine, sampling: Sampling, processors: list):
    """One slice's completion tokens [n, t] and, when sampled, their behaviour log-probs (None
    when greedy): the package's engine where it decodes, else HF generate."""
    if engine is not None:
        decoded = engine_decode(engine, model, inputs, kwargs, sampling, processors)
        if decoded is not None:
            return decoded
    recorder = None
    if sampling.do_sample:
        recorder = SampledLogprobs(sampling.temperature, sampling.top_k, sampling.top_p)
    out = model.generate(
        logits_processor=processors + ([recorder] if recorder else []), **inputs, **kwargs
    )
    piece = out[:, inputs["input_ids"].shape[1] :]
    return piece, (recorder.finish(piece) if recorder is not None else None)


def engine_decode(engine: DecodeEngine, model, inputs: dict, kwargs: dict, sampling, processors):
    """One slice through the engine: the cache of all but the last prompt column (hf.py's own,
    taken out of `inputs` so that it is freed once copied, or one forward here) -> (tokens,
    log-probs) as DecodeEngine.decode returns them; None when the engine is off (the caller
    decodes with HF generate, from the prompt alone if its cache was taken)."""
    if engine.disabled:
        return None
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    if CACHE_KWARG not in inputs and ids.shape[1] > 1:
        inputs[CACHE_KWARG] = prefill(model, ids, mask, 1)
    config = unwrap(model).generation_config
    engine.load(
        ids,
        mask,
        inputs.pop(CACHE_KWARG, None),
        max_new_tokens=kwargs["max_new_tokens"],
        eos=kwargs["eos_token_id"],
        pad_id=kwargs["pad_token_id"],
        sampling=sampling,
        min_new_tokens=getattr(config, "min_new_tokens", None) or 0,
    )
    return engine.decode(processors)


_SAID: set[str] = set()


def decode_engine(model: nn.Module, mode: str) -> DecodeEngine | None:
    """The engine for rollout.decode=`mode`: graph, or auto on CUDA -> a DecodeEngine; eager, auto
    on CPU, and graph where the engine cannot run this model (one log line saying why) -> None
    (HF generate decodes)."""
    if mode == "auto":
        device = next(p for p in model.parameters()).device
        mode = "graph" if device.type == "cuda" else "eager"
    if mode == "eager":
        return None
    reason = unsupported_reason(model)
    if reason is None and getattr(unwrap(model).generation_config, "min_length", 0):
        reason = "the model's generation_config sets min_length"
    if reason is not None:
        if reason not in _SAID:  # once per reason and process, not once per phase
            _SAID.add(reason)
            log.warning(
                "ibpo: rollout.decode=graph: %s; decoding with HF generate (rollout.decode=eager)",
                reason,
            )
        return None
    return DecodeEngine(model)


def hf_generator(
    model: nn.Module, share_prefixes: bool = True, engine: DecodeEngine | None = None
) -> Generator:
    """The policy's own generate() as a Generator (rollout.backend=hf); `share_prefixes`: prompts
    that begin alike run their common prefix once (off only to compare against it); `engine`:
    decode with it (decode_engine; its owner releases it when the phase ends)."""
    return partial(generate, model, share_prefixes=share_prefixes, engine=engine)
