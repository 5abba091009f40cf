"""The environment interface: where tasks come from, how an episode unfolds, how it is rewarded.

An episode starts from a task's messages; the policy answers; the environment replies (feedback, tool results, a new
question) or ends it; and so on, up to `env.max_turns` policy turns and `env.max_episode_tokens` tokens. A
single-turn environment is the one-turn case and only writes `tasks`, `messages` and `reward`:

    class Reverse(Environment):
        def tasks(self, split, seed): ...                       # Task(id, data)
        def messages(self, task): return [{"role": "user", "content": "Reverse: " + task.data["text"]}]
        def reward(self, task, completion): return float(completion.strip() == task.data["text"][::-1])

A multi-turn environment also writes `respond` (and keeps what it needs in the episode's `state`, a picklable dict
made by `start`); a tool-using one derives from `rlhpc.env.tools.ToolEnvironment` and declares `tools()`.
docs/environments.md has a worked example of each kind.

Where the methods run: `tasks`, `messages`, `tools` in the inference worker; `start`, `respond`, `score`, `finish`
in a pool of processes beside generation (rlhpc.env.pool), each call with a timeout, each process with its own
instance built from the same `env` config. An environment lives in `envs/<name>.py` (one class deriving from
`Environment`; `env.name=<name>`), in `<name>.py` of a folder of your own listed in $RLHPC_ENVS_DIR (searched first,
folders separated by `:`), or anywhere importable (`env.cls=package.module:Class`); its constructor takes `env.args`.
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
from typing import Any, Dict, Iterator, List, Optional, Union

from rlhpc.config import shipped
from rlhpc.config.schema import EnvConfig

# The shipped environments: the repository's envs/, or its copy in an installed wheel (rlhpc.config.shipped).
ENVS_DIR = shipped.folder("envs")

Message = Dict[str, Any]


@dataclass
class Task:
    id: str
    data: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """What the environment answers to the policy's last turn."""

    # Messages shown to the policy next (role "user" for feedback, "tool" for tool results).
    messages: List[Message] = field(default_factory=list)
    # The episode ends here: the policy takes no further turn.
    done: bool = False
    # Counters summed into the worker's metrics as env/<key> (tool_calls, tool_errors, invalid_guesses, ...).
    counts: Dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    name: str = "env"
    # Policy turns per episode unless `env.max_turns` says otherwise.
    max_turns: int = 1
    # The `env` config it was loaded with (set by `configure`; None for an instance built directly).
    config: Optional[EnvConfig] = None

    def configure(self, cfg: EnvConfig) -> None:
        """Called by `load` after the constructor with the whole `env` config; raise here to refuse to start."""
        self.config = cfg

    @abstractmethod
    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        """Tasks of `split` ("train": endless, in an order set by `seed`; "eval": the fixed held-out set)."""

    @abstractmethod
    def messages(self, task: Task) -> List[Message]:
        """The chat messages the policy answers first."""

    def reward(self, task: Task, completion: str) -> float:
        """Reward of a single-turn answer, in [0, 1] by convention (multi-turn environments write `score`)."""
        raise NotImplementedError(f"environment {self.name} defines neither reward nor score")

    def tools(self) -> List[Any]:
        """The tools the policy may call (rlhpc.env.tools.Tool); their schemas reach it through the chat template."""
        return []

    def start(self, task: Task) -> Dict[str, Any]:
        """The state of a new episode (a picklable dict: it travels to the pool's processes and back)."""
        return {}

    def respond(self, task: Task, state: Dict[str, Any], completion: str) -> Reply:
        """The environment's answer to the policy's turn `completion`; single-turn environments end at once."""
        return Reply(done=True)

    def score(self, task: Task, state: Dict[str, Any], completions: List[str]) -> float:
        """Reward of a whole episode, given the policy's turns in order (default: `reward` of the last turn)."""
        return self.reward(task, completions[-1])

    def finish(self, task: Task, state: Dict[str, Any]) -> None:
        """Releases what the episode held (a work folder, a sandbox); called after `score`, also after a failure."""

    def close(self) -> None:
        """Releases what the environment holds across episodes (a server, processes); called once when the role that
        loaded it ends."""

    def warm(self) -> None:
        """Called once in each pool process (rlhpc.env.pool) before it serves calls: loads what its calls need, so that
        a call's time limit counts the call alone and a broken environment fails the pool's start."""

    def reference(self, task: Task) -> Union[str, List[Message]]:
        """A correct answer for the supervised warm start: the answer's text (single turn), or the messages that
        follow `messages(task)` in a correct episode (assistant turns, with tool calls written as the policy would
        write them, and the environment's replies)."""
        raise NotImplementedError(f"environment {self.name} has no reference answers, so it cannot be used for SFT")


def env_dirs() -> List[Path]:
    """Where `env.name` is looked up, in order: the folders of $RLHPC_ENVS_DIR (yours), then the shipped envs/."""
    own = [Path(p).expanduser() for p in os.environ.get("RLHPC_ENVS_DIR", "").split(os.pathsep) if p]
    return [*own, ENVS_DIR]


def env_module(name: str) -> Any:
    """The module of `<name>.py` in the first folder of `env_dirs()` that has one, loaded once per process (an
    environment may build on another's module)."""
    dirs = env_dirs()
    path = next((d / f"{name}.py" for d in dirs if (d / f"{name}.py").is_file()), None)
    if path is None:
        known = sorted({p.stem for d in dirs for p in d.glob("*.py") if not p.stem.startswith("_")})
        where = ", ".join(map(str, dirs))
        raise ValueError(f"config key `env.name`: no environment {name!r} in {where} (known: {', '.join(known)}); "
                         f"add a folder of your own to RLHPC_ENVS_DIR, or name a class with env.cls=module:Class")
    module_name = f"rlhpc_envs.{name}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException:
            del sys.modules[module_name]
            raise
    return module


def load(cfg: EnvConfig) -> Environment:
    if cfg.cls:
        module_name, _, attr = cfg.cls.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"config key `env.cls`: cannot import {cfg.cls!r}: {e}") from e
    else:
        module = env_module(cfg.name)
        path = module.__file__
        found = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Environment)
                 and not inspect.isabstract(c) and c.__module__ == module.__name__]
        if len(found) != 1:
            raise ValueError(f"{path} must define exactly one Environment subclass (found {len(found)})")
        cls = found[0]
    try:
        env = cls(**cfg.args)
    except TypeError as e:
        raise ValueError(f"config key `env.args`: {cls.__name__} does not accept {dict(cfg.args)}: {e}") from e
    env.configure(cfg)  # what a pool process needs to build its own instance, and tools the sandbox settings
    return env


def max_turns(env: Environment, cfg: EnvConfig) -> int:
    return cfg.max_turns or env.max_turns


def play(env: Environment, task: Task, policy, turns: int = 0) -> tuple[float, List[Message]]:
    """Runs one episode in this process with a scripted `policy` (messages so far -> the assistant's text) and
    returns (score, the whole conversation). For testing an environment without a model: a reference policy should
    score 1 and a wrong one ~0. The trainer's episodes go through rlhpc.env.episode (tokens, pool, timeouts)."""
    turns = turns or env.max_turns
    state = env.start(task)
    conversation = list(env.messages(task))
    completions: List[str] = []
    try:
        for _ in range(turns):
            text = policy(conversation)
            completions.append(text)
            conversation.append({"role": "assistant", "content": text})
            reply = env.respond(task, state, text)
            if reply.done:
                break
            conversation.extend(reply.messages)
        return env.score(task, state, completions), conversation
    finally:
        env.finish(task, state)
