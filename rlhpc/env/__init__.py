"""Environments: tasks, episodes, rewards (base), and what episodes use: tools, the sandbox, the call pool."""

from rlhpc.env.base import ENVS_DIR, Environment, Task, load

__all__ = ["ENVS_DIR", "Environment", "Task", "load"]
