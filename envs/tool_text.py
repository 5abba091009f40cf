"""Reverse a text that only a tool can show: the smallest tool-using task, learnable by the quick-start model on a CPU.

The prompt does not contain the text. The policy must call `get_text` (`<tool_call>{"name": "get_text"}</tool_call>`),
read the tool's answer, then answer with the reversed text. Reward: the reverse_text reward (LCS ratio to the reversed
text) of the final answer, and 0 for an episode that never called the tool.
"""

from __future__ import annotations

from typing import Any, Dict, List

from rlhpc.env import Task
from rlhpc.env.base import env_module
from rlhpc.env.tools import Tool, ToolEnvironment

ReverseText = env_module("reverse_text").ReverseText

CALL = '<tool_call>{"name": "get_text"}</tool_call>'


class ToolText(ToolEnvironment, ReverseText):
    name = "tool_text"
    max_turns = 2

    def __init__(self, instruction: str = "Reverse the hidden text.", **kwargs: Any):
        super().__init__(instruction=instruction, **kwargs)

    def messages(self, task: Task) -> List[Dict[str, str]]:
        return [{"role": "user", "content": self.instruction}]

    def tools(self) -> List[Tool]:
        return [Tool("get_text", "shows the hidden text", {"type": "object", "properties": {}}, self.get_text)]

    def get_text(self, state: Dict[str, Any]) -> str:
        return state["text"]

    def start(self, task: Task) -> Dict[str, Any]:
        return {"text": task.data["text"]}

    def score(self, task: Task, state: Dict[str, Any], completions: List[str]) -> float:
        if "get_text" not in state.get("tool_calls", []):
            return 0.0
        return self.reward(task, completions[-1])

    def reference(self, task: Task) -> List[Dict[str, str]]:
        return [{"role": "assistant", "content": CALL},
                {"role": "tool", "name": "get_text", "content": task.data["text"]},
                {"role": "assistant", "content": task.data["text"][::-1]}]
