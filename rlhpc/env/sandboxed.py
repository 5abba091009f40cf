"""For environments that run model-written code: their sandbox, from `env.sandbox` and `env.sandbox_limits`."""

from __future__ import annotations

import tempfile

from rlhpc.config.schema import EnvConfig
from rlhpc.env.base import Environment
from rlhpc.env.sandbox import Limits, Sandbox


class SandboxedEnvironment(Environment):
    """An environment whose tools or rewards run code in rlhpc.env.sandbox. Loading it where the sandbox cannot run
    fails at once (naming `env.sandbox=unsandboxed`, the opt-out), not at the first episode."""

    def configure(self, cfg: EnvConfig) -> None:
        super().configure(cfg)
        with tempfile.TemporaryDirectory(prefix=f"rlhpc-{self.name}-") as d:
            self.sandbox(d)

    def limits(self) -> Limits:
        if self.config is None:
            return Limits()
        lim = self.config.sandbox_limits
        return Limits(cpu_s=lim.cpu_s, memory_mb=lim.memory_mb, processes=lim.processes,
                      file_size_mb=lim.file_size_mb, wall_s=lim.wall_s)

    def sandbox(self, workdir: str) -> Sandbox:
        """A sandbox whose writable work folder is `workdir`."""
        return Sandbox(workdir, self.limits(), mode=self.config.sandbox if self.config else "bwrap")

    @property
    def tool_timeout_s(self) -> float:  # a tool call is one sandboxed run, which has its own wall-clock limit
        return self.limits().wall_s + 10.0
