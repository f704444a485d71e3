"""Tools a policy calls during its rollouts (tool-integrated reasoning).

  schema.py  a tool = a plain callable described by its signature and docstring (the JSON
             schema chat templates take, as TRL and transformers build it): Tool, as_tool,
             resolve_tools (rollout.tools' names and the callables ibpo.train(tools=) gets)
  python.py  the built-in `python` tool: the model's code run in the package's sandbox with the
             code reward's limits, its stdout and stderr returned
  calls.py   tool calls read from a turn's text in the chat template's format (Qwen3's
             `<tool_call>{json}</tool_call>`), run concurrently, every failure turned into an
             error message for the model (ToolCall, ToolResult, parse_tool_calls, run_calls)

Not here: the multi-turn rollout that decodes, calls and appends results
(generation/multiturn.py), the masks of the loss (step.py reads the rollout's), grading.
"""

from ibpo.tools.calls import ToolCall, ToolResult, parse_tool_calls, run_calls
from ibpo.tools.schema import Tool, as_tool, resolve_tools

__all__ = [
    "Tool",
    "ToolCall",
    "ToolResult",
    "as_tool",
    "parse_tool_calls",
    "resolve_tools",
    "run_calls",
]
