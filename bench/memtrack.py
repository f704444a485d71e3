"""Peak live tensor bytes on CPU: the counterpart of torch.cuda.max_memory_allocated.

Used by the benchmarks (bench/bench_logprobs.py) and by the tests that check the memory planner
and the log-prob head against what really stays alive. It counts tensor storage as ops return it,
so it sees forward, checkpoint recomputation and backward alike; it does not see buffers a kernel
allocates and frees inside itself, nor the allocator's own overhead (RSS measures those).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created inside the block and alive at once: on the CPU, the
    counterpart of torch.cuda.max_memory_allocated. It sees every storage an op returns (in
    forward, checkpoint recomputation and backward alike), not a buffer that a kernel allocates
    and frees inside itself."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._alive.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in inputs and key not in self._alive:  # not a view, not out=
                self._alive.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, nbytes)
        return out
