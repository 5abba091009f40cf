"""A multi-turn verifiers (v1) environment with feedback, written as a verifiers user would: reverse a short text;
after a wrong answer the environment says how many letters were right and the policy tries again.

The environment's own `Env.run` plays the user (as verifiers' TextArena environments do); the task's `@vf.reward`
scores the final answer.
"""

import random

import verifiers.v1 as vf

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reversal_reward(reply: str, text: str) -> float:
    want, got = text[::-1], reply.strip()
    n = 0
    while n < min(len(got), len(want)) and got[n] == want[n]:
        n += 1
    return n / len(want)


class GuessData(vf.TaskData):
    text: str


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def final_answer(self, trace: vf.Trace) -> float:
        return reversal_reward(trace.last_reply, self.data.text)

    @vf.metric
    async def attempts(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 64
    seed: int = 1


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
            yield GuessTask(GuessData(id=f"guess-{i}", prompt=f"Reverse: {text}", text=text), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    attempts: int = 2


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for _ in range(self.config.attempts - 1):
                score = reversal_reward(segment.last_reply, task.data.text)
                if segment.terminated or score == 1.0:
                    break
                right = round(score * len(task.data.text))
                segment = await interaction.turn(f"{right} letters right. Try again.")


__all__ = ["GuessTaskset", "GuessEnv"]
