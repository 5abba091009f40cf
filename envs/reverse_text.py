"""Reverse a short random text. The first task a new user runs: it needs no data and a tiny model learns it in minutes.

The reward is the longest-common-subsequence ratio between the answer and the reversed text:
LCS(answer, target) / max(len(answer), len(target)), so a partial reversal earns partial credit and rambling is penalized.
"""

from __future__ import annotations

import random
from typing import Dict, Iterator, List

from rlhpc.env import Environment, Task


def lcs_length(a: str, b: str) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(answer: str, target: str) -> float:
    longest = max(len(answer), len(target))
    return lcs_length(answer, target) / longest if longest else 1.0


class ReverseText(Environment):
    name = "reverse_text"

    def __init__(self, min_len: int = 5, max_len: int = 10, alphabet: str = "abcdefghijklmnopqrstuvwxyz",
                 eval_size: int = 64, eval_seed: int = 12345, instruction: str = "Reverse:"):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"env.args: need 1 <= min_len ({min_len}) <= max_len ({max_len})")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet
        self.eval_size, self.eval_seed, self.instruction = eval_size, eval_seed, instruction
        rng = random.Random(eval_seed)
        self._eval = [self._text(rng) for _ in range(eval_size)]
        self._held_out = set(self._eval)

    def _text(self, rng: random.Random) -> str:
        return "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        if split == "eval":
            for i, text in enumerate(self._eval):
                yield Task(f"eval-{i}", {"text": text})
            return
        rng = random.Random(seed)
        i = 0
        while True:
            text = self._text(rng)
            if text in self._held_out:  # held-out texts are never trained on
                continue
            yield Task(f"{seed}-{i}", {"text": text})
            i += 1

    def messages(self, task: Task) -> List[Dict[str, str]]:
        return [{"role": "user", "content": f"{self.instruction} {task.data['text']}"}]

    def reward(self, task: Task, completion: str) -> float:
        return lcs_ratio(completion.strip(), task.data["text"][::-1])

    def reference(self, task: Task) -> str:
        return task.data["text"][::-1]
