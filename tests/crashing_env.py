"""A test-only environment whose reward fails inside inference workers (to test how a crashing role is handled)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "envs"))

from reverse_text import ReverseText  # noqa: E402


class CrashInWorkers(ReverseText):
    def reward(self, task, completion):
        if os.environ.get("RLHPC_ROLE") == "inference":
            raise RuntimeError("reward model exploded")
        return super().reward(task, completion)
