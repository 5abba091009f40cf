"""The local launcher's hang watchdog (`cluster.hang_timeout_s`): a run whose trainer stops advancing is not left to
sit.

The trainer writes its heartbeat at every RL step and checkpoint. From its first RL step on, when that heartbeat has not
changed for the hang timeout (`cluster.hang_timeout_s`, and at least HANG_STEPS times the slowest of the recent steps),
the watchdog asks every role for its Python stacks (SIGUSR2: faulthandler writes every thread's stack into the role's
log), reads where each one's main thread is, and names them. Then:

- the trainer waits on the inference workers (for rollouts, or in the weights group) and some are stuck (stopped, or no
  publication for the timeout): those workers are killed, and the launcher's restart policy (`inference.max_restarts`)
  starts them again, as after any death; the run goes on;
- otherwise (the trainer itself is stuck or stopped, or no worker is to blame): the run ends with exit code 1 and the
  report, resumable from its newest checkpoint with the same command.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from rlhpc.run.rundir import RunDir

# A step may take this many times the slowest recent one before the watchdog calls it hung (cluster.hang_timeout_s is
# the floor).
HANG_STEPS = 20
DUMP_WAIT_S = 5.0
STACK_SIGNAL = signal.SIGUSR2  # rlhpc.role registers faulthandler for it
# Where a trainer's main thread is when it waits on the inference workers: for rollouts (the queue's claim), or for
# the members of the weights group.
WAITS_ON_WORKERS = ("rlhpc/transport/queue.py", "rlhpc/transport/weights.py")


@dataclass
class Stuck:
    name: str  # "trainer-0", "inference-1"
    pid: int
    state: str  # "stopped" (SIGSTOP, a debugger), "running", "gone"
    where: str  # its main thread's innermost rlhpc frame and innermost frame, from its stack dump ("" if none)

    def line(self) -> str:
        if self.state == "stopped":
            return f"{self.name} (pid {self.pid}) is stopped (SIGSTOP or a debugger): it cannot run or dump its stack"
        if self.state == "gone":
            return f"{self.name} (pid {self.pid}) is gone"
        return f"{self.name} (pid {self.pid}) is in {self.where or 'a place its stack dump does not show'}"


class HangWatch:
    """Called from the launcher's watch loop; `due()` says when the trainer's heartbeat is older than the timeout."""

    def __init__(self, floor_s: float, run: RunDir):
        self.floor_s = floor_s
        self.run = run
        self.last_beat: Optional[bytes] = None
        self.last_change = time.monotonic()
        self.changes: List[float] = []  # monotonic times of the trainer's recent heartbeats
        self.next_look = 0.0

    def timeout_s(self) -> float:
        gaps = [b - a for a, b in zip(self.changes, self.changes[1:])][-10:]
        return max(self.floor_s, HANG_STEPS * max(gaps, default=0.0))

    def due(self) -> bool:
        """True once the trainer's heartbeat has stood still for the timeout, counted from its first RL step (the
        warm start, a model's load and the first rollouts are bounded by their own timeouts)."""
        now = time.monotonic()
        if not self.floor_s or now < self.next_look:
            return False
        self.next_look = now + 1.0
        try:
            beat = (self.run.status / "trainer-0.json").read_bytes()
            rl = "step" in json.loads(beat)
        except (OSError, ValueError):
            return False
        if not rl:
            return False
        if beat != self.last_beat:
            self.last_beat, self.last_change = beat, now
            self.changes = (self.changes + [now])[-11:]
            return False
        return now - self.last_change > self.timeout_s()

    def again(self) -> None:
        """After the watchdog acted and the run goes on: the clock starts again."""
        self.last_change = time.monotonic()


def inspect(run: RunDir, roles: Dict[str, int]) -> List[Stuck]:
    """Every live role's state, and where its main thread is from a faulthandler dump (roles name -> pid)."""
    sizes = {}
    out = []
    for name, pid in roles.items():
        state = process_state(pid)
        if state == "running":
            sizes[name] = _size(run.logs / f"{name}.log")
            try:
                os.kill(pid, STACK_SIGNAL)
            except ProcessLookupError:
                state = "gone"
        out.append(Stuck(name, pid, state, ""))
    deadline = time.monotonic() + DUMP_WAIT_S
    pending = set(sizes)
    while pending and time.monotonic() < deadline:
        time.sleep(0.2)
        pending = {n for n in pending if "(most recent call first)" not in _since(run.logs / f"{n}.log", sizes[n])}
    for s in out:
        if s.name in sizes:
            s.where = main_thread_place(_since(run.logs / f"{s.name}.log", sizes[s.name]))
    return out


def process_state(pid: int) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return "stopped" if state in ("T", "t") else "gone" if state in ("Z", "X") else "running"


FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def main_thread_place(dump: str) -> str:
    """From a faulthandler dump (every thread, most recent call first): the thread that runs rlhpc/role.py, as
    "<innermost rlhpc frame> (innermost: <frame>)"."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        frames = FRAME.findall(block)
        if not any(f.endswith("rlhpc/role.py") for f, _, _ in frames):
            continue
        ours = next(((f, ln, fn) for f, ln, fn in frames if "/rlhpc/" in f), None)
        place = f"{_short(ours[0])}:{ours[1]} {ours[2]}" if ours else ""
        inner = f"{_short(frames[0][0])}:{frames[0][1]} {frames[0][2]}" if frames else ""
        return place + (f" (innermost: {inner})" if inner and inner != place else "")
    return ""


def waits_on_workers(trainer: Stuck) -> bool:
    return trainer.state == "running" and any(w in trainer.where for w in WAITS_ON_WORKERS)


def _short(path: str) -> str:
    i = path.rfind("/rlhpc/")
    return path[i + 1:] if i >= 0 else os.path.basename(path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
