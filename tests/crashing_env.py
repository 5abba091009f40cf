"""A test-only environment whose reward fails inside inference workers (to test how a crashing role is handled)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "envs"))

from reverse_text import ReverseText  # noqa: E402


def _role() -> str:
    if "RLHPC_ROLE" in os.environ:
        return os.environ["RLHPC_ROLE"]
    from rlhpc.run.slurm_identity import role_and_rank

    return role_and_rank(os.environ)[0] if "SLURM_JOB_ID" in os.environ else ""


class CrashInWorkers(ReverseText):
    def reward(self, task, completion):
        if _role() == "inference":
            raise RuntimeError("reward model exploded")
        return super().reward(task, completion)


class FailsToStartInWorkers(ReverseText):
    """Cannot be made in an inference worker (a missing dependency, a bad path): the worker dies at every start."""

    def __init__(self, *args, **kwargs):
        if _role() == "inference":
            raise RuntimeError("tool server unreachable at startup")
        super().__init__(*args, **kwargs)
