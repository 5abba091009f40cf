"""Environments: where tasks come from and how completions are rewarded.

An environment lives in `envs/<name>.py` (one class deriving from `Environment`) or anywhere importable
(`env.cls=package.module:Class`). Its constructor takes `env.args`. Each inference worker builds its own instance.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List

from rlhpc.config import EnvConfig

ENVS_DIR = Path(os.environ.get("RLHPC_ENVS_DIR", Path(__file__).resolve().parents[2] / "envs"))


@dataclass
class Task:
    id: str
    data: Dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    name: str = "env"

    @abstractmethod
    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        """Tasks of `split` ("train": endless, in an order set by `seed`; "eval": the fixed held-out set)."""

    @abstractmethod
    def messages(self, task: Task) -> List[Dict[str, str]]:
        """The chat messages the model answers."""

    @abstractmethod
    def reward(self, task: Task, completion: str) -> float:
        """Reward of one completion, in [0, 1] by convention."""

    def reference(self, task: Task) -> str:
        """A correct answer, for the supervised warm start."""
        raise NotImplementedError(f"environment {self.name} has no reference answers, so it cannot be used for SFT")


def load(cfg: EnvConfig) -> Environment:
    if cfg.cls:
        module_name, _, attr = cfg.cls.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"config key `env.cls`: cannot import {cfg.cls!r}: {e}") from e
    else:
        path = ENVS_DIR / f"{cfg.name}.py"
        if not path.exists():
            known = sorted(p.stem for p in ENVS_DIR.glob("*.py") if not p.stem.startswith("_"))
            raise ValueError(f"config key `env.name`: no environment {cfg.name!r} in {ENVS_DIR} (known: {', '.join(known)})")
        spec = importlib.util.spec_from_file_location(f"rlhpc_envs.{cfg.name}", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[spec.name] = module  # type: ignore[union-attr]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        found = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Environment) and c is not Environment
                 and c.__module__ == module.__name__]
        if len(found) != 1:
            raise ValueError(f"{path} must define exactly one Environment subclass (found {len(found)})")
        cls = found[0]
    try:
        return cls(**cfg.args)
    except TypeError as e:
        raise ValueError(f"config key `env.args`: {cls.__name__} does not accept {dict(cfg.args)}: {e}") from e
