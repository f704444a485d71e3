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

from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

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
    # slices after the first sample from streams of their own (streams.py), so that
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


def hf_generator(model: nn.Module, share_prefixes: bool = True) -> Generator:
    """The policy's own generate() as a Generator (rollout.backend=hf); `share_prefixes`: prompts
    that begin alike run their common prefix once (off only to compare against it)."""
    return partial(generate, model, share_prefixes=share_prefixes)
