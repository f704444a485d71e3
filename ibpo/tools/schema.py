"""A tool: a plain Python callable, described to the model by its signature and docstring.

As in TRL (`GRPOTrainer(tools=[fn])`) and transformers' chat templates (`tools=[fn]`), a tool is
a function with type hints and a Google-style docstring (a description, then `Args:` with one
line per parameter); its JSON schema is transformers' `get_json_schema` of it, and the chat
template renders that schema into the prompt. The model calls it by name with JSON arguments;
it returns text (calls.py says what happens when it does not).

`rollout.tools` names the tools of a run: `python` (the built-in, python.py) or import paths
`package.module:function`; `ibpo.train(tools=[fn, ...])` passes callables, which the run's
config records by their import path.

Not here: parsing or running calls (calls.py), the sandbox (ibpo/sandbox/).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from ibpo.config import ConfigError
from ibpo.tools.python import python


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


BUILTIN = {"python": python}


def as_tool(fn: Callable[..., Any]) -> Tool:
    """A callable -> a Tool; ConfigError naming the fix when its signature or docstring cannot
    describe it (a parameter without a type hint or a line under `Args:`, no docstring)."""
    if isinstance(fn, Tool):
        return fn
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ConfigError(
            f"tool {name!r} cannot be described to the model: {e}. Fix: give it type hints and "
            "a Google-style docstring (a description line, then 'Args:' with '    name: what "
            "it is' for every parameter), as TRL's tools= and transformers' chat templates need"
        ) from None
    return Tool(schema["function"]["name"], fn, schema)


def import_tool(path: str) -> Callable[..., Any]:
    """`package.module:function` -> the function; ConfigError naming the fix otherwise."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            f"rollout.tools: {path!r} is neither a built-in tool ({', '.join(BUILTIN)}) nor an "
            "import path 'package.module:function'"
        )
    try:
        fn: Any = importlib.import_module(module_name)
    except Exception as e:  # ModuleNotFoundError, or the module's own error while importing
        raise ConfigError(
            f"rollout.tools: cannot import module '{module_name}' ({type(e).__name__}: {e}). "
            "Fix: install it or put its folder on PYTHONPATH, or pass the function as "
            "ibpo.train(tools=[...])"
        ) from None
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(f"rollout.tools: module '{module_name}' has no function '{attr}'")
    return fn


def resolve_tools(
    names: Sequence[str], given: Sequence[Callable[..., Any] | str] | None = None
) -> dict[str, Tool]:
    """The run's tools by name: `given` (ibpo.train's tools=: callables, or names as in
    rollout.tools) when passed, else rollout.tools' `names`. Two tools of one name are an
    error (the model calls them by name)."""
    items = list(names) if given is None else list(given)
    tools: dict[str, Tool] = {}
    for item in items:
        fn = item
        if isinstance(item, str):
            fn = BUILTIN[item] if item in BUILTIN else import_tool(item)
        tool = as_tool(fn)
        if tool.name in tools:
            raise ConfigError(
                f"two tools are named {tool.name!r}: the model calls tools by name. Fix: give "
                "each function its own name"
            )
        tools[tool.name] = tool
    return tools
