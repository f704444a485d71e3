"""Generating completions (rollouts, repairs, held-out answers), on either backend.

  rollout.py   the Rollout (prompts and completions in the tensors the loss needs),
               concat_rollouts, the Generator contract every backend keeps, and what a backend
               builds a Rollout from (encode_prompts, eos_ids, assemble)
  hf.py        the policy's own HF generate (rollout.backend=hf): generate, hf_generator,
               set_kv_cache
  decode.py    the package's decode engine (rollout.decode=graph): a static KV cache in length
               buckets, sampling inside the step, CUDA graphs on CUDA: DecodeEngine
  prefixes.py  the prompt forwards rows share: a group's prompt run once (prefill), a prefix that
               distinct prompts share (plan_shared_prefixes, shared_prefix_inputs), CACHE_KWARG
  sampling.py  how the hf backend samples: temperature, top-k, top-p, the draw, the behaviour
               log-probs (SampledLogprobs)
  streams.py   the random streams a step samples from (SamplingStreams)
  vllm.py      the vLLM backend (rollout.backend=vllm): VLLMEngine
  multiturn.py rollouts that call tools (rollout.tools): ToolRollouts, whose completion mask
               holds the policy's tokens only, and each row's conversation (ToolTrace)

Not here: grading, advantages, or any gradient computation.
"""

from ibpo.generation.decode import DecodeEngine
from ibpo.generation.hf import decode_engine, generate, hf_generator, set_kv_cache
from ibpo.generation.rollout import Generator, Rollout, concat_rollouts
from ibpo.generation.streams import SamplingStreams
from ibpo.generation.vllm import VLLMEngine, engine_kwargs, import_vllm

__all__ = [
    "DecodeEngine",
    "Generator",
    "Rollout",
    "SamplingStreams",
    "VLLMEngine",
    "concat_rollouts",
    "decode_engine",
    "engine_kwargs",
    "generate",
    "hf_generator",
    "import_vllm",
    "set_kv_cache",
]
