"""A single-turn verifiers (v1) environment, written as a verifiers user would: reverse a short text.

The reward is rlhpc's reverse_text reward (envs/reverse_text.py, written again here: a package does not import rlhpc):
the longest common subsequence of the reply and the reversed text over the longer of the two, computed by verifiers
from the trace's last reply. Each task carries its reference answer (`answer`), as datasets do.
"""

import random

import verifiers.v1 as vf

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reversal_reward(reply: str, text: str) -> float:
    want, got = text[::-1], reply.strip()
    prev = [0] * (len(want) + 1)
    for a in got:
        cur = [0]
        for j, b in enumerate(want):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    longest = max(len(got), len(want))
    return prev[-1] / longest if longest else 1.0


class ReverseData(vf.TaskData):
    text: str
    answer: str  # the dataset's reference answer (rlhpc's SFT warm start reads it: env.args.reference_field=answer)


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def reversed_lcs(self, trace: vf.Trace) -> float:
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
            yield ReverseTask(ReverseData(id=f"rev-{i}", prompt=f"Reverse: {text}", text=text,
                                          answer=text[::-1]), self.config.task)


__all__ = ["ReverseTaskset"]
