"""Sampling streams: a step draws its completions from random streams of its own, seeded from the
run's seed, the process, the step, the phase (rollout or repair) and the round
(`SamplingStreams`), and leaves the process's streams as they were. What a step samples then
depends on the policy and on nothing else that drew random numbers before it: two runs that
differ only in what they do with their samples (IBPO and DFPO, an ablation and its full method)
draw from the same uniforms at every step, and a resumed run samples as an uninterrupted one.
Within one generate() call, the slices after the first draw from streams of their own
(`stream_position`, `sampling_stream`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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
