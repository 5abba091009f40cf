"""A single-turn verifiers (v1) environment, written as a verifiers user would: reverse a short text.

The reward is rlhpc's reverse_text reward (the longest common prefix with the reversed text, as a fraction), computed
by verifiers from the trace's last reply.
"""

import random

import verifiers.v1 as vf

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reversal_reward(reply: str, text: str) -> float:
    want = text[::-1]
    got = reply.strip()
    n = 0
    while n < min(len(got), len(want)) and got[n] == want[n]:
        n += 1
    return n / len(want)


class ReverseData(vf.TaskData):
    text: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def reversed_prefix(self, trace: vf.Trace) -> float:
        return reversal_reward(trace.last_reply, self.data.text)


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 64
    seed: int = 0
    min_len: int = 3
    max_len: int = 6


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(self.config.min_len, self.config.max_len)))
            yield ReverseTask(ReverseData(id=f"rev-{i}", prompt=f"Reverse: {text}", text=text), self.config.task)


__all__ = ["ReverseTaskset"]
