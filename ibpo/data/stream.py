"""PromptStream: the training examples a run takes, step after step: endless, seeded,
epoch-shuffled, each process reading its own shard, and where it stands saved in checkpoints."""

from __future__ import annotations

import random

from ibpo.config import ConfigError
from ibpo.data.example import Example


class PromptStream:
    """Endless, seeded, epoch-shuffled stream of examples; each process reads its own shard."""

    def __init__(self, examples: list[Example], seed: int, shuffle: bool, rank=0, world=1):
        if not examples:
            raise ConfigError("the training set is empty")
        self.examples = examples[rank::world] or examples
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        """Where the stream stands (epoch, position, this epoch's order), for checkpoints."""
        return {"epoch": self.epoch, "position": self.position, "order": list(self._order)}

    def load_state_dict(self, state: dict) -> None:
        order = [int(i) for i in state["order"]]
        if sorted(order) != list(range(len(self.examples))):
            raise ConfigError(
                f"the checkpoint's data stream covers {len(order)} examples but this training "
                f"set (shard) has {len(self.examples)}: resume with the same data settings"
            )
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), order
