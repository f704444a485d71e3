"""Tools without a model: schemas from signatures and docstrings, tool calls read from text,
calls run concurrently with every failure an error message, and the sandboxed python tool."""

import time

import pytest

from ibpo.config import ConfigError
from ibpo.tools import ToolCall, as_tool, parse_tool_calls, resolve_tools, run_calls
from ibpo.tools.calls import MAX_RESULT_CHARS


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to upper-case.
    """
    return text.upper()


def test_a_tool_is_described_by_its_signature_and_docstring():
    tool = as_tool(add)
    fn = tool.schema["function"]
    assert tool.name == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first number.",
    }
    assert fn["parameters"]["required"] == ["a", "b"]


def test_a_tool_that_cannot_be_described_is_refused_naming_the_fix():
    def bare(x):
        return x

    with pytest.raises(ConfigError, match="type hints and a Google-style docstring"):
        as_tool(bare)


def test_rollout_tools_names_resolve_and_clash():
    tools = resolve_tools(["python", "tests.test_tools:add"])
    assert list(tools) == ["python", "add"]
    assert tools["add"].fn is add
    assert "code" in tools["python"].schema["function"]["parameters"]["properties"]
    # callables given in Python replace the names
    assert list(resolve_tools(["python"], [shout])) == ["shout"]
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        resolve_tools([], [add, add])
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        resolve_tools(["no_such_module:fn"])
    with pytest.raises(ConfigError, match="neither a built-in tool"):
        resolve_tools(["calculator"])


def test_tool_calls_are_read_in_qwen3s_format():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        '</tool_call>\n<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}'
        '</tool_call><tool_call>{"name": "add", "parameters": {"a": 1, "b": 1}}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert calls == [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("shout", {"text": "hi"}),
        ToolCall("add", {"a": 1, "b": 1}),
    ]
    assert parse_tool_calls("no call here, <tool_response> is not one") == []


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", 'a JSON object {"name"'),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "arguments are not a JSON"),
        ('<tool_call>{"name": "add", "arguments": {}', "without its </tool_call>"),
    ],
)
def test_malformed_calls_become_errors(text, error):
    (call,) = parse_tool_calls(text)
    assert error in call.error
    (result,) = run_calls([call], resolve_tools([], [add]), workers=1, timeout=5)
    assert result.error and result.content.startswith("Error: ") and error in result.content


def test_every_failure_of_a_tool_is_an_error_message_for_the_model():
    def boom(x: int) -> str:
        """Raise.

        Args:
            x: Anything.
        """
        raise ValueError(f"bad x {x}")

    def thing(x: int) -> object:
        """Return an object.

        Args:
            x: Anything.
        """
        return object()

    def long(n: int) -> str:
        """A long text.

        Args:
            n: Its length.
        """
        return "y" * n

    tools = resolve_tools([], [add, boom, thing, long])
    calls = [
        ToolCall("add", {"a": 2, "b": 40}),
        ToolCall("boom", {"x": 3}),
        ToolCall("thing", {"x": 1}),
        ToolCall("add", {"a": 1}),  # a missing argument
        ToolCall("nope", {}),
        ToolCall("long", {"n": MAX_RESULT_CHARS + 123}),
    ]
    r = run_calls(calls, tools, workers=2, timeout=5)
    assert (r[0].content, r[0].error) == ("42", False)  # a number comes back as JSON text
    assert r[1].error and r[1].content == "Error: tool 'boom' raised ValueError: bad x 3"
    assert r[2].error and "returned a object, not text" in r[2].content
    assert r[3].error and "missing 1 required positional argument: 'b'" in r[3].content
    assert r[4].error and "no tool named 'nope'" in r[4].content and "add, boom" in r[4].content
    assert not r[5].error and r[5].content.startswith("y" * MAX_RESULT_CHARS)
    assert r[5].content.endswith("[... 123 more characters not shown]")


def test_a_hanging_tool_is_abandoned_at_its_time_limit_and_others_still_run():
    def hang(s: float) -> str:
        """Sleep.

        Args:
            s: Seconds.
        """
        time.sleep(s)
        return "woke"

    tools = resolve_tools([], [hang, add])
    # one worker: the hung call gives its slot back at its limit, so the next call runs
    calls = [ToolCall("hang", {"s": 30.0}), ToolCall("add", {"a": 1, "b": 2})]
    t0 = time.monotonic()
    r = run_calls(calls, tools, workers=1, timeout=0.5)
    took = time.monotonic() - t0
    assert r[0].error and "did not return within 0.5 s" in r[0].content
    assert (r[1].content, r[1].error) == ("3", False)
    assert took < 5


def test_calls_run_concurrently_up_to_the_workers():
    def nap(s: float) -> str:
        """Sleep.

        Args:
            s: Seconds.
        """
        time.sleep(s)
        return "ok"

    tools = resolve_tools([], [nap])
    t0 = time.monotonic()
    r = run_calls([ToolCall("nap", {"s": 0.4})] * 4, tools, workers=4, timeout=10)
    assert [x.content for x in r] == ["ok"] * 4
    assert time.monotonic() - t0 < 1.2  # 4 x 0.4 s one after another would take 1.6 s


def test_the_python_tool_runs_code_in_the_sandbox_with_the_code_rewards_limits():
    from ibpo.sandbox.cases import Limits
    from ibpo.tools.python import LIMITS, python

    assert (LIMITS.time_s, LIMITS.memory_mb) == (Limits().time_s, Limits().memory_mb)
    assert python("print(6 * 7)") == "42"
    assert python("x = 1") == "(no output)"
    out = python("print('before')\n1 / 0")
    assert out.startswith("before\nstderr:\nTraceback") and "ZeroDivisionError" in out
    assert "_child_run" not in out  # the sandbox's own frame is not shown
    t0 = time.monotonic()
    assert "stopped: time limit" in python("while True:\n    pass")
    assert time.monotonic() - t0 < 2 * LIMITS.wall_s
    net = python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert "OSError" in net and "42" not in net  # no network: the connection fails
    files = python("print(open('/etc/hostname').read())")
    assert "FileNotFoundError" in files or "PermissionError" in files  # no host files
    mem = python("x = bytearray(4 << 30)\nprint('allocated')")
    assert "allocated" not in mem and ("MemoryError" in mem or "Error" in mem)
