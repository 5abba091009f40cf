"""Cores lent between the roles of one machine (`launcher=local`, config `launcher.lend_cores`).

On one machine the trainer and the inference workers each get a fixed thread budget (`trainer.threads`,
`inference.threads`), and whichever side is not the bottleneck spends part of every step waiting: workers on
back-pressure when the trainer is slower, the trainer on rollouts when generation is. A waiting process marks itself
idle (a file run_dir/status/idle/<role>-<rank> holding its thread budget), and the processes of the other role borrow
those threads: before each decoder block of a forward or backward (at most every `EVERY_S`), a borrower sets torch's
thread count to its own budget plus its share of the idle threads of the other role, never above the machine's cores
(the idle threads are shared evenly between the borrowing processes). When the lender starts working again it removes
its file, and the borrower is back to its own budget by its next block.

Only within one machine: on a cluster the roles run on different nodes, where borrowing would only oversubscribe.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

EVERY_S = 0.05  # how often a borrower looks at the idle files (a listing and a few tiny reads)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def enabled(cfg) -> bool:
    return cfg.launcher.name == "local" and cfg.launcher.lend_cores


def warm_start_threads(cfg) -> int:
    """Torch threads of the warm start on trainer rank 0. On one machine every other process of the launch only waits
    for it (the workers for its model, the other trainer ranks for READY), so it takes the threads of all of them,
    never more than the machine's cores; elsewhere, or with lending off, its own `trainer.threads`."""
    if not enabled(cfg):
        return cfg.trainer.threads
    launch = cfg.trainer.threads * cfg.trainer.num_ranks + cfg.inference.threads * cfg.inference.num_workers
    return max(cfg.trainer.threads, min(launch, cores()))


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Torch's thread count set to `n` within, and back to what it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def idle_dir(run) -> Path:
    return run.status / "idle"


class Idle:
    """This process's idle mark: `set(True)` while it waits on the other role, `set(False)` when it works again. Only
    changes touch the filesystem; a disabled mark does nothing."""

    def __init__(self, run, role: str, rank: int, threads: int, enabled: bool = True):
        self.path = idle_dir(run) / f"{role}-{rank}"
        self.threads, self.enabled, self.on = threads, enabled, False

    def set(self, idle: bool) -> None:
        if not self.enabled or idle == self.on:
            return
        if idle:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(str(self.threads))
            os.replace(tmp, self.path)
        else:
            self.path.unlink(missing_ok=True)
        self.on = idle


class Borrower:
    """Raises this process's torch threads by its share of the other role's idle threads, block by block."""

    def __init__(self, run, lender_role: str, own: int, borrowers: int, cap: Optional[int] = None):
        self.dir, self.prefix = idle_dir(run), f"{lender_role}-"
        self.own, self.borrowers = own, max(borrowers, 1)
        self.cap = cap or cores()
        self.current, self.last = own, 0.0
        self.borrowed_s = 0.0  # seconds spent with more threads than its own (for the metrics)
        self._since: Optional[float] = None

    def lent(self) -> int:
        """The other role's idle threads, this process's share of them."""
        total = 0
        try:
            with os.scandir(self.dir) as it:
                for entry in it:
                    if entry.name.startswith(self.prefix) and not entry.name.endswith(".tmp"):
                        try:
                            total += int(Path(entry.path).read_text() or 0)
                        except (OSError, ValueError):  # removed (or being written) between the listing and the read
                            pass
        except FileNotFoundError:
            return 0
        return total // self.borrowers

    def adjust(self, *_args) -> None:
        now = time.monotonic()
        if now - self.last < EVERY_S:
            return
        self.last = now
        self._set(min(self.own + self.lent(), self.cap))

    def release(self) -> None:
        """Back to its own budget (at the end of a step, before waiting)."""
        self._set(self.own)

    def _set(self, n: int) -> None:
        if n == self.current:
            return
        now = time.monotonic()
        if self.current > self.own and self._since is not None:
            self.borrowed_s += now - self._since
        self._since = now if n > self.own else None
        torch.set_num_threads(n)
        self.current = n

    def attach(self, model: torch.nn.Module) -> None:
        """Looks before each decoder block's forward and backward (the backward of a CPU model runs on this thread)."""
        from rlhpc.modeling.models import decoder_blocks

        def before_backward(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self.adjust())  # runs as the block's backward starts

        for block in decoder_blocks(model):
            block.register_forward_pre_hook(self.adjust)
            block.register_forward_hook(before_backward)

    def take_borrowed_s(self) -> float:
        """Seconds with borrowed threads since the last call."""
        if self._since is not None:
            now = time.monotonic()
            self.borrowed_s += now - self._since
            self._since = now
        out, self.borrowed_s = self.borrowed_s, 0.0
        return out
