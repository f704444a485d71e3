"""The built-in tasks (`data.dataset: builtin:<name>`): offline generators of small arithmetic and
word problems (see BUILTINS) with a fixed held-out split: a problem is held out when a stable hash
of its text says so, whatever the seed, so train and eval never meet."""

from __future__ import annotations

import hashlib

from ibpo.config import ConfigError
from ibpo.data.example import Example

_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Eva", "Finn", "Gia", "Hugo", "Iris", "Jon"]
_THINGS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards"]


def _arithmetic() -> list[Example]:
    out = [Example(f"What is {a} + {b}?", str(a + b)) for a in range(21) for b in range(21)]
    out += [Example(f"What is {a} - {b}?", str(a - b)) for a in range(21) for b in range(a + 1)]
    out += [Example(f"What is {a} * {b}?", str(a * b)) for a in range(2, 13) for b in range(2, 13)]
    return out


def _word() -> list[Example]:
    out = []
    for name in _NAMES:
        for thing in _THINGS:
            for a in range(3, 15, 2):
                for b in range(2, 9, 3):
                    out.append(
                        Example(
                            f"{name} has {a} {thing} and gets {b} more. "
                            f"How many {thing} does {name} have now?",
                            str(a + b),
                        )
                    )
                    out.append(
                        Example(
                            f"{name} has {a + b} {thing} and gives away {b}. "
                            f"How many {thing} are left?",
                            str(a),
                        )
                    )
    return out


BUILTINS = {
    "arithmetic": _arithmetic,  # +, -, * on small numbers (1,246 problems)
    "word": _word,  # one-step word problems (960)
    "mixed": lambda: _arithmetic() + _word(),
}


def _held_out(question: str) -> bool:
    return hashlib.sha256(question.encode()).digest()[0] < 52  # ~20% of problems


def builtin_examples(name: str, split: str) -> list[Example]:
    if name not in BUILTINS:
        raise ConfigError(f"data.dataset=builtin:{name}; built-ins are: {', '.join(BUILTINS)}")
    eval_split = split in ("test", "eval", "validation")
    return [
        Example(ex.question, ex.answer, {"question": ex.question, "answer": ex.answer})
        for ex in BUILTINS[name]()
        if _held_out(ex.question) == eval_split
    ]
