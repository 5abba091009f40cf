"""Math word problems from reasoning-gym's procedural generators, answered in \\boxed{...}.

`env.args.tasks` names the generators (reasoning_gym.create_dataset names such as basic_arithmetic, chain_sum,
simple_equations, products, gcd, fraction_simplification), `env.args.config` their difficulty settings (generator name
-> keyword arguments of its config, e.g. {"chain_sum": {"min_digits": 2, "max_digits": 3}}). Train tasks are an endless
seeded stream; the eval set is a fixed list from `eval_seed`, and its questions never appear in the train stream.

Reward: the last \\boxed{...} of the answer (outside any <think> block) is right (1) when reasoning-gym's own
`score_answer` gives it full marks or math-verify finds it equivalent to the reference (so 1/2, 0.5 and \\frac{1}{2}
are all right); otherwise 0, and 0 without a boxed answer. With `partial_credit: true` the reward is the larger of
score_answer's score and math-verify's 0/1 instead: off by default, because the default score_answer of most
generators gives len(answer)/len(given) when the answer is a substring of what was given, so "14" or "-4" earns 0.5
for the answer 4.
"""

from __future__ import annotations

import random
import re
import threading
from importlib.metadata import version
from typing import Any, Dict, Iterator, List, Optional, Sequence

from rlhpc.env import Environment, Task

try:
    import reasoning_gym
    from math_verify import parse, verify
    from reasoning_gym.factory import DATASETS
except ImportError as e:
    raise ImportError("envs/math.py needs reasoning-gym and math-verify "
                      f"(pip install reasoning-gym math-verify): {e}") from e

DEFAULT_TASKS = ("basic_arithmetic", "chain_sum", "simple_equations")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# Boxed answers longer than this are wrong without asking math-verify (a huge expression can keep sympy busy for
# seconds); the generators' answers are a few characters.
MAX_ANSWER_CHARS = 200
# Seconds math-verify may spend parsing or comparing (only enforced on a process's main thread: signal.alarm).
VERIFY_TIMEOUT_S = 2
# What math-verify is shown: numbers, fractions, roots, variables, arithmetic. Powers, factorials and the like
# ("9^{9^{9}}", "(10^{10})!") can keep sympy busy past any timeout a thread can set, so such answers only get
# score_answer's exact comparison.
_PLAIN = re.compile(r"(?:[\w\s.,+\-*/=()\[\]{}$%:<>]"
                    r"|\\(?:d?frac|tfrac|cdot|times|div|sqrt|pi|left|right|text|mathrm|[,;: ]))*")
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S)


def boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if there is none.
    Reading stops past MAX_ANSWER_CHARS: a longer answer is returned cut there (and is wrong anyway)."""
    text = _THINK.sub("", text)
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        if i - begin > MAX_ANSWER_CHARS:
            return text[begin:i + 1]
        i += 1
    return None  # unclosed: the answer was cut off


def _strip_dollars(s: str) -> str:
    s = s.strip()
    return s[1:-1].strip() if len(s) >= 2 and s[0] == s[-1] == "$" else s


def equivalent(gold: str, answer: str) -> bool:
    """math-verify's judgement that `answer` equals `gold` (numbers, fractions, expressions); False on any failure."""
    if not _PLAIN.fullmatch(answer) or "**" in answer:
        return False
    limit = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        g = parse("\\boxed{" + _strip_dollars(gold) + "}", parsing_timeout=limit)
        a = parse("\\boxed{" + answer + "}", parsing_timeout=limit)
        return bool(g and a and verify(g, a, timeout_seconds=limit))
    except Exception:  # noqa: BLE001 - a checker's failure on a strange answer makes it wrong, never a crash
        return False


class Math(Environment):
    name = "math"

    def __init__(self, tasks: Sequence[str] = DEFAULT_TASKS, config: Optional[Dict[str, Dict[str, Any]]] = None,
                 eval_size: int = 100, eval_seed: int = 12345, instruction: str = INSTRUCTION,
                 partial_credit: bool = False):
        if isinstance(tasks, str) or not tasks or not all(isinstance(t, str) for t in tasks):
            raise ValueError(f"env.args.tasks: need a non-empty list of reasoning-gym generator names, got {tasks!r}")
        unknown = [t for t in tasks if t not in DATASETS]
        if unknown:
            raise ValueError(f"env.args.tasks: unknown reasoning-gym generator(s) {', '.join(unknown)} "
                             f"(reasoning-gym {version('reasoning-gym')} has: {', '.join(sorted(DATASETS))})")
        config = dict(config or {})
        stray = [k for k in config if k not in tasks]
        if stray:
            raise ValueError(f"env.args.config: settings for {', '.join(stray)}, which env.args.tasks does not name")
        for name, kwargs in config.items():
            if not isinstance(kwargs, dict):
                raise ValueError(f"env.args.config.{name}: need a mapping of config keys, got {kwargs!r}")
            if "seed" in kwargs or "size" in kwargs:
                raise ValueError(f"env.args.config.{name}: seed and size are set by the environment "
                                 "(use env.args.eval_seed and the run's seed)")
        if eval_size < 1:
            raise ValueError(f"env.args.eval_size: need at least 1, got {eval_size}")
        self.generators = list(tasks)
        self.settings = {name: dict(config.get(name, {})) for name in self.generators}
        self.instruction, self.partial_credit = instruction, bool(partial_credit)
        # One dataset per generator, for its score_answer (which does not depend on the seed); building it checks
        # the settings.
        self._scorers = {name: self._dataset(name, seed=0, size=1) for name in self.generators}
        self._eval = self._make_eval(eval_size, eval_seed)
        self._held_out = {t.data["question"] for t in self._eval}

    def _dataset(self, name: str, seed: int, size: int):
        try:
            return reasoning_gym.create_dataset(name, seed=seed, size=size, **self.settings[name])
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"env.args.config.{name}: {type(e).__name__}: {e}") from None

    def _task(self, task_id: str, name: str, entry: Dict[str, Any]) -> Task:
        return Task(task_id, {"generator": name, "question": entry["question"], "answer": str(entry["answer"]),
                              "metadata": entry.get("metadata", {})})

    def _make_eval(self, size: int, seed: int) -> List[Task]:
        per = -(-size // len(self.generators))
        columns = []
        for k, name in enumerate(self.generators):
            ds = self._dataset(name, seed=seed + 1_000_003 * k, size=per)
            columns.append([ds[i] for i in range(per)])
        entries = [(name, col[i]) for i in range(per) for name, col in zip(self.generators, columns)][:size]
        return [self._task(f"eval-{i}", name, e) for i, (name, e) in enumerate(entries)]

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        if split == "eval":
            yield from self._eval
            return
        rng = random.Random(seed)
        # Generators seed item i with Random(dataset_seed + i), so train and eval seeds can meet; the held-out filter
        # below is what keeps eval questions out (small problems also repeat by chance). Seeds stay below 2**32 for
        # generators that seed numpy.
        chunk = 1000
        streams = {name: (self._dataset(name, seed=rng.randrange(2**31), size=chunk), 0) for name in self.generators}
        i = 0
        while True:
            name = rng.choice(self.generators)
            ds, j = streams[name]
            if j == chunk:
                ds, j = self._dataset(name, seed=rng.randrange(2**31), size=chunk), 0
            streams[name] = (ds, j + 1)
            entry = ds[j]
            if entry["question"] in self._held_out:
                continue
            yield self._task(f"{seed}-{i}", name, entry)
            i += 1

    def messages(self, task: Task) -> List[Dict[str, str]]:
        return [{"role": "user", "content": f"{task.data['question']}\n\n{self.instruction}"}]

    def reward(self, task: Task, completion: str) -> float:
        answer = boxed(completion or "")
        if not answer or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        own = self._own_score(task, answer)
        if own >= 1.0 or equivalent(task.data["answer"], answer):
            return 1.0
        return own if self.partial_credit else 0.0

    def _own_score(self, task: Task, answer: str) -> float:
        """The generator's score_answer, clamped to [0, 1]; 0 when it raises or is not a number."""
        entry = {"question": task.data["question"], "answer": task.data["answer"], "metadata": task.data["metadata"]}
        try:
            own = float(self._scorers[task.data["generator"]].score_answer(answer, entry))
        except Exception:  # noqa: BLE001 - some generators' scorers raise on unparsable answers
            return 0.0
        return min(max(own, 0.0), 1.0) if own == own else 0.0  # own != own: NaN

    def reference(self, task: Task) -> str:
        return f"\\boxed{{{_strip_dollars(task.data['answer'])}}}"
