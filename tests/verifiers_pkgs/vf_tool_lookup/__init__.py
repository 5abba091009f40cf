"""A tool-using verifiers (v1) environment, written as a verifiers user would: reverse a short text, with a tool
that spells text backwards (an MCP tool server shared by the taskset's rollouts). The reward is the final answer's;
a metric counts tool calls."""

import random

import verifiers.v1 as vf

from vf_tool_lookup.servers.tool import LookupToolset

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reversal_reward(reply: str, text: str) -> float:
    want, got = text[::-1], reply.strip()
    n = 0
    while n < min(len(got), len(want)) and got[n] == want[n]:
        n += 1
    return n / len(want)


class LookupData(vf.TaskData):
    text: str


class LookupTask(vf.Task[LookupData]):
    @vf.reward(weight=1.0)
    async def answer(self, trace: vf.Trace) -> float:
        return reversal_reward(trace.last_reply, self.data.text)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class LookupConfig(vf.TasksetConfig):
    num_tasks: int = 64
    seed: int = 2
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    @classmethod
    def toolsets(cls, config: LookupConfig) -> list:
        return [LookupToolset(config.tools)]

    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
            yield LookupTask(LookupData(id=f"lookup-{i}", prompt=f"Reverse: {text}", text=text), self.config.task)


__all__ = ["LookupTaskset"]
