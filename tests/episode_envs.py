"""Environments for the episode tests, loaded by import path (`env.cls=episode_envs:...`)."""

from __future__ import annotations

import itertools
import math
import time
from typing import Any, Dict, Iterator, List

from rlhpc.env import Environment, Task
from rlhpc.env.base import Reply
from rlhpc.env.tools import Tool, ToolEnvironment


class Echo(ToolEnvironment):
    """Three policy turns, with tools: whatever the policy writes, the environment answers with a tool result."""

    name = "echo"
    max_turns = 3

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        for i in itertools.count():
            yield Task(f"{split}-{seed}-{i}", {"word": f"w{i % 7}"})

    def messages(self, task: Task) -> List[Dict[str, Any]]:
        return [{"role": "user", "content": f"Say {task.data['word']}"}]

    def tools(self) -> List[Tool]:
        return [Tool("shout", "repeats a word loudly", {"type": "object", "properties": {"word": {"type": "string"}},
                                                        "required": ["word"]}, lambda word: word.upper())]

    def respond(self, task: Task, state: Dict[str, Any], completion: str) -> Reply:
        reply = super().respond(task, state, completion)
        if reply.done:  # no tool call: answer as the tool would, so that every episode runs max_turns turns
            state["turn"] = state.get("turn", 0) + 1
            return Reply([{"role": "tool", "name": "shout", "content": f"TURN {state['turn']}"}])
        return reply

    def score(self, task: Task, state: Dict[str, Any], completions: List[str]) -> float:
        return float(len(completions)) / 3


class Faulty(Environment):
    """Rewards that raise, hang or are not finite, chosen by the task id; the others score 1."""

    name = "faulty"

    def __init__(self, modes: str = "raise,hang,nan,inf,ok,ok,ok,ok", hang_s: float = 60.0):
        self.modes, self.hang_s = modes.split(","), hang_s

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        for i in itertools.count():
            yield Task(f"{split}-{i}", {"mode": self.modes[i % len(self.modes)]})

    def messages(self, task: Task) -> List[Dict[str, Any]]:
        return [{"role": "user", "content": "hi"}]

    def reward(self, task: Task, completion: str) -> float:
        mode = task.data["mode"]
        if mode == "raise":
            raise RuntimeError("reward exploded")
        if mode == "hang":
            time.sleep(self.hang_s)
        return {"nan": math.nan, "inf": math.inf}.get(mode, 1.0)
