"""The training examples a run takes, step after step, and where it stands (saved in checkpoints):

* PromptStream: a table of examples (read whole at start), endless, seeded, epoch-shuffled,
  each process reading its own shard;
* RowStream: rows streamed from an IterableDataset, each read as it is drawn and in the
  stream's own order (its shuffle, if any, told the pass by set_epoch), each process keeping
  every world-th row, pass after pass until train.steps ends the run.

Both run a `keep` check on each example as it is drawn (prompts.prompt_fits: the prompt rendered
and tokenized then, not every prompt at start): one that fails it is left out, the first said
in a line, all counted in `left_out`; a whole pass that keeps nothing is an error naming why.

Resuming: a PromptStream restores its epoch, position and order; a RowStream its pass and the
rows read in it, which it reads again from the stream's start and skips (exact when the stream
yields the same rows in the same order for that pass).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ibpo.config import ConfigError
from ibpo.data.example import Example

# A drawn example -> None (it is used) or why it is left out.
Keep = Callable[[Example], "str | None"]


class _LeftOut:
    """The examples a stream left out as drawn: counted, the first said."""

    left_out = 0

    def _leave_out(self, why: str) -> None:
        self.left_out += 1
        if self.left_out == 1:
            print(
                f"ibpo: left out a training problem as drawn: {why} (later ones are counted; "
                "the run's end says how many)",
                file=sys.stderr,
            )


class PromptStream(_LeftOut):
    """Endless, seeded, epoch-shuffled stream of examples; each process reads its own shard."""

    def __init__(
        self, examples: list[Example], seed: int, shuffle: bool, rank=0, world=1, keep=None
    ):
        if not examples:
            raise ConfigError("the training set is empty")
        self.examples = examples[rank::world] or examples
        self.seed, self.shuffle, self.keep = seed, shuffle, keep
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out, misses = [], 0
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            ex = self.examples[self._order[self.position]]
            self.position += 1
            why = self.keep(ex) if self.keep else None
            if why is None:
                out.append(ex)
                misses = 0
                continue
            self._leave_out(why)
            misses += 1
            if misses >= len(self.examples):
                raise ConfigError(f"every training problem is left out as drawn; the last: {why}")
        return out

    @property
    def progress(self) -> float:
        """Passes over this process's examples, fractional (TRL's epoch)."""
        return self.epoch + self.position / len(self._order)

    def state_dict(self) -> dict:
        """Where the stream stands (epoch, position, this epoch's order), for checkpoints."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "order": list(self._order),
            "left_out": self.left_out,
        }

    def load_state_dict(self, state: dict) -> None:
        if "order" not in state:
            raise ConfigError(
                "the checkpoint's run read its training rows as a stream (an IterableDataset). "
                "Fix: pass that stream again as dataset="
            )
        order = [int(i) for i in state["order"]]
        if sorted(order) != list(range(len(self.examples))):
            raise ConfigError(
                f"the checkpoint's data stream covers {len(order)} examples but this training "
                f"set (shard) has {len(self.examples)}: resume with the same data settings"
            )
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), order
        self.left_out = int(state.get("left_out", 0))


@dataclass
class StreamedRows:
    """Training rows given as a stream (splits.load_splits): the rows, their reader
    (rows.RowReader), how many rows at the start of a pass are held out and the held-out
    questions, which training leaves out wherever they come again."""

    rows: Any
    reader: Any
    skip_first: int
    exclude: set[str]


def training_stream(train, seed: int, rank: int = 0, world: int = 1, keep: Keep | None = None):
    """The stream a run draws from: a RowStream for StreamedRows, else a shuffled PromptStream."""
    if isinstance(train, StreamedRows):
        return RowStream(
            train.rows, train.reader, train.skip_first, train.exclude, rank, world, keep
        )
    return PromptStream(train, seed, shuffle=True, rank=rank, world=world, keep=keep)


class RowStream(_LeftOut):
    """Rows of an IterableDataset (any iterable that starts afresh on each iter()), read as they
    are drawn by `reader` (rows.RowReader); the first `skip_first` rows of every pass are the
    held-out ones, and a row whose question is in `exclude` (a held-out question) is left out.
    Row i of a pass belongs to process i % world."""

    def __init__(
        self, rows, reader, skip_first: int, exclude: set[str], rank=0, world=1, keep=None
    ):
        self.rows, self.reader, self.skip_first, self.exclude = rows, reader, skip_first, exclude
        self.rank, self.world, self.keep = rank, world, keep
        self.epoch, self.position = 0, 0  # the pass, and the rows read in it (every process's)
        self._it = None
        self._kept_in_pass = 0

    def _open(self):
        """The stream from the start of this pass, its rows already read skipped (a resume)."""
        if hasattr(self.rows, "set_epoch"):
            self.rows.set_epoch(self.epoch)
        it = iter(self.rows)
        for _ in range(self.position):
            next(it, None)
        return it

    def take(self, n: int) -> list[Example]:
        out: list[Example] = []
        while len(out) < n:
            if self._it is None:
                self._it = self._open()
            row = next(self._it, None)
            if row is None:  # the end of a pass
                self._next_pass()
                continue
            i = self.position
            self.position += 1
            if i < self.skip_first or i % self.world != self.rank:
                continue
            ex = self._example(row, i)
            if ex is not None:
                out.append(ex)
                self._kept_in_pass += 1
        return out

    def _example(self, row: dict, i: int) -> Example | None:
        ex = self.reader.example(row, i)
        if ex is None:  # unusable, left out (data.skip_unusable)
            self._leave_out(f"row {i}: {self.reader.last_skipped}")
            return None
        why = "it repeats a held-out question" if norm(ex.question) in self.exclude else None
        if why is None and self.keep is not None:
            why = self.keep(ex)
        if why is not None:
            self._leave_out(why)
            return None
        return ex

    def _next_pass(self) -> None:
        if not self._kept_in_pass:
            raise ConfigError(
                f"the training stream gave this process no usable row in a whole pass of "
                f"{self.position} rows (the first {self.skip_first} are held out; "
                f"{self.left_out} left out as drawn). Fix: pass more rows, or lower "
                "data.eval_size or data.max_prompt_tokens' demands"
            )
        self.epoch, self.position, self._it, self._kept_in_pass = self.epoch + 1, 0, None, 0

    @property
    def progress(self) -> float:
        """Passes over the stream completed (its length is not known)."""
        return float(self.epoch)

    def state_dict(self) -> dict:
        return {
            "stream": True,
            "epoch": self.epoch,
            "position": self.position,
            "left_out": self.left_out,
        }

    def load_state_dict(self, state: dict) -> None:
        if not state.get("stream"):
            raise ConfigError(
                "the checkpoint's run read its training rows as a table (a Dataset, a list or "
                "a file), not a stream. Fix: pass those rows again"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.left_out = int(state.get("left_out", 0))
        self._it, self._kept_in_pass = None, 1  # the pass began before the checkpoint


def norm(question: str) -> str:
    """A question with its whitespace runs as single spaces: how repeats are recognised."""
    return " ".join(question.split())
