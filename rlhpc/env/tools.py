"""Tools: declared by an environment, shown to the policy through the chat template, called by the policy in text.

A tool is a name, a description, a JSON-schema of its arguments and a Python callable returning text. The policy
calls tools in the Qwen3/Hermes format, one or more blocks of

    <tool_call>
    {"name": "read_file", "arguments": {"path": "calc.py"}}
    </tool_call>

(the parser is pluggable: `env.tool_parser`). A malformed call, an unknown tool, bad arguments or a tool that raises
becomes an error message to the policy (role "tool") and a counted metric, never a crash.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

from rlhpc.env.base import Environment, Reply, Task

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


@dataclass
class Tool:
    name: str
    description: str
    # JSON schema of the arguments object: {"type": "object", "properties": {...}, "required": [...]}.
    parameters: Dict[str, Any]
    fn: Callable[..., Any]

    def schema(self) -> Dict[str, Any]:
        """The OpenAI/Hugging Face function schema that chat templates render (`tools=`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check(self, arguments: Any) -> None:
        """Raises ToolCallError when `arguments` do not fit the schema (required keys, unknown keys, basic types)."""
        if not isinstance(arguments, dict):
            raise ToolCallError(f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}")
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolCallError(f"{self.name} needs the argument(s) {', '.join(missing)}")
        unknown = [k for k in arguments if k not in props]
        if unknown:
            raise ToolCallError(f"{self.name} has no argument(s) {', '.join(unknown)} (it takes {', '.join(props) or 'none'})")
        for key, value in arguments.items():
            want = _JSON_TYPES.get(props[key].get("type", ""))
            if want and (not isinstance(value, want) or (isinstance(value, bool) and want is not bool)):
                raise ToolCallError(f"argument {key} of {self.name} must be a {props[key]['type']}")


@dataclass
class ToolCall:
    name: str
    arguments: Any


class ToolCallError(ValueError):
    """A tool call the policy wrote that cannot be executed; the message goes back to the policy."""


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_hermes(text: str) -> List[ToolCall]:
    """Tool calls in the Qwen3/Hermes format; raises ToolCallError on a block that is not a valid call."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError as e:
            raise ToolCallError(f"a <tool_call> block is not valid JSON ({e.msg} at position {e.pos})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError('a <tool_call> block must be {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ToolCallError(f"the arguments of {obj['name']} are not valid JSON") from None
        calls.append(ToolCall(obj["name"], args))
    return calls


PARSERS: Dict[str, Callable[[str], List[ToolCall]]] = {"hermes": parse_hermes}


def parser(name: str) -> Callable[[str], List[ToolCall]]:
    """The parser `env.tool_parser` names: a registered name or "package.module:function"."""
    if name in PARSERS:
        return PARSERS[name]
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"config key `env.tool_parser`: {name!r} is neither one of {', '.join(PARSERS)} nor an "
                         f"importable 'package.module:function' ({e})") from None


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raises TimeoutError in the block after `seconds` (main thread only: elsewhere the pool's timeout applies)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):  # noqa: ARG001
        raise TimeoutError(f"took longer than {seconds:g}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class ToolEnvironment(Environment):
    """A multi-turn environment whose policy calls tools until it answers without one.

    Each turn: the tool calls in the policy's text run in order and their results (or errors) go back as "tool"
    messages; a turn without a tool call is the final answer and ends the episode; `score` then rewards it (default:
    `reward(task, final answer)`). Subclasses write `tools()` (tool functions may take the episode's `state` as a
    keyword argument, for per-episode resources such as a work folder) and `reward` or `score`.
    """

    max_turns = 4
    # Seconds one tool call may take before its result is an error (main thread of a pool process only).
    tool_timeout_s: float = 10.0

    def respond(self, task: Task, state: Dict[str, Any], completion: str) -> Reply:
        counts: Dict[str, float] = {}
        try:
            calls = parser(getattr(getattr(self, "config", None), "tool_parser", "hermes"))(completion)
        except ToolCallError as e:
            counts["tool_errors"] = 1
            return Reply([{"role": "tool", "content": f"error: {e}"}], counts=counts)
        if not calls:
            return Reply(done=True)
        tools = {t.name: t for t in self.tools()}
        out = []
        for call in calls:
            counts["tool_calls"] = counts.get("tool_calls", 0) + 1
            result, ok = self.call_tool(tools, call, state)
            if not ok:
                counts["tool_errors"] = counts.get("tool_errors", 0) + 1
            out.append({"role": "tool", "name": call.name, "content": result})
        state.setdefault("tool_calls", []).extend(c.name for c in calls)
        return Reply(out, counts=counts)

    def call_tool(self, tools: Dict[str, Tool], call: ToolCall, state: Dict[str, Any]) -> tuple[str, bool]:
        """(result text, ok). Every failure is a message to the policy."""
        tool: Optional[Tool] = tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(tools) or 'none'})", False
        try:
            tool.check(call.arguments)
            kwargs = dict(call.arguments)
            if "state" in _parameters(tool.fn):
                kwargs["state"] = state
            with time_limit(self.tool_timeout_s):
                result = tool.fn(**kwargs)
            return (result if isinstance(result, str) else json.dumps(result)), True
        except ToolCallError as e:
            return f"error: {e}", False
        except Exception as e:  # the tool's own failure is the policy's information, not the run's
            return f"error: {call.name} failed: {type(e).__name__}: {e}", False


def _parameters(fn: Callable) -> List[str]:
    import inspect

    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []
