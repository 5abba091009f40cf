"""Held-out evaluation during training: greedy reward on the first `eval.num_tasks` tasks of the eval split,
measured on trainer rank 0 every `eval.interval` versions and at the last; the (version, reward) pairs: the curve."""

from __future__ import annotations

from itertools import islice
from typing import List, Tuple

from rlhpc.config import Config
from rlhpc.env import Environment
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.infer.rollout import evaluate

# (weights version, held-out reward), in order; checkpointed, so a resumed run goes on with it.
Curve = List[Tuple[int, float]]


def heldout_tasks(env: Environment, cfg: Config) -> list:
    """The fixed held-out tasks: the same before SFT, after it and during RL."""
    return list(islice(env.tasks("eval", 0), cfg.eval.num_tasks))


def eval_due(cfg: Config, version: int) -> bool:
    iv = cfg.eval.interval
    return version == cfg.trainer.steps or (iv > 0 and version % iv == 0)


class Evaluator:
    """Rank 0's evaluator: an engine over the trainer's model (one rank) or over a full copy that publishing fills
    (FSDP), the tokenizer, and the held-out tasks."""

    def __init__(self, engine: HFEngine, env: Environment, tokenizer, tasks: list, cfg: Config):
        self.engine, self.env, self.tokenizer, self.tasks, self.cfg = engine, env, tokenizer, tasks, cfg

    def reward(self) -> float:
        return evaluate(self.engine, self.env, self.tokenizer, self.tasks, self.cfg.env)
