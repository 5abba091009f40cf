"""When a dead inference worker (or follower), or a dead trainer, is started again: the restart policy, as one pure
function.

A worker holds nothing a restart cannot rebuild, so a death costs a restart, not the run, within a budget:
`inference.max_restarts` restarts per worker within any `inference.restart_window_s` seconds, each after a back-off
(`inference.restart_backoff_s`, doubling with every restart of that worker in the window, up to BACKOFF_CAP_S). A worker
that dies again the same way (same exit code, same last line of its log, numbers aside: task ids, pids and counts
differ between lives) without having done any work since it was started (no heartbeat of its own: a worker writes one
with each batch it publishes, a follower once it joined its leader) crashes at every start: restarting it again would
only spin, so it is not, whatever budget is left.
`inference.max_restarts=0`: the first death ends the run.

The trainer has a policy of its own (`trainer.max_restarts` per `trainer.restart_window_s`): its "work" is a checkpoint
newer than the one it started from, the only progress a restart keeps.

The local launcher (rlhpc.cluster.local_launcher) asks `decide`; inside a Slurm job the task loop of
rlhpc.cluster.hetjob does the same in bash for workers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

BACKOFF_CAP_S = 60.0  # the longest wait before a restart: a worker in a crash loop costs one start a minute at most
TRAINER_BACKOFF_S = 2.0  # the first wait before the trainer starts again, doubled like a worker's

# A role's log line starts with a timestamp (rlhpc.role's format); two deaths at the same line differ only there.
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(,\d+)? ")
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int  # <section>.max_restarts: restarts per process within the window (0: none)
    window_s: float  # <section>.restart_window_s (0: the whole run)
    backoff_s: float  # the first wait, doubled by every restart in the window
    section: str = "inference"  # the config section whose keys the verdicts name

    @classmethod
    def of(cls, inference) -> "RestartPolicy":
        return cls(inference.max_restarts, inference.restart_window_s, inference.restart_backoff_s)

    @classmethod
    def of_trainer(cls, trainer) -> "RestartPolicy":
        return cls(trainer.max_restarts, trainer.restart_window_s, TRAINER_BACKOFF_S, "trainer")


@dataclass(frozen=True)
class Death:
    time: float  # when it was seen dead (seconds, any clock that all deaths of the worker share)
    code: int  # its exit code (negative: the signal that killed it)
    last_line: str  # the last line of its log, timestamp left out (`last_line`)
    worked: bool  # it wrote a heartbeat of its own: it did work since it was started

    @property
    def signature(self) -> tuple:
        return self.code, _NUMBER.sub("#", self.last_line)


@dataclass(frozen=True)
class Verdict:
    restart: bool
    delay_s: float = 0.0  # the back-off before the restart
    count: int = 0  # the restarts in the window, this one included
    why_not: str = ""  # when not restarted: why, naming the key to change or what to fix


def decide(deaths: Sequence[Death], policy: RestartPolicy) -> Verdict:
    """Whether a worker (or the trainer) whose deaths so far are `deaths` (oldest first, the one just seen last), is
    restarted, and after how long."""
    last, key = deaths[-1], policy.section
    if policy.max_restarts <= 0:
        return Verdict(False, why_not=f"{key}.max_restarts=0: a dead "
                                      f"{'trainer' if key == 'trainer' else 'worker'} ends the run")
    if len(deaths) >= 2 and not last.worked and last.signature == deaths[-2].signature:
        return Verdict(False, why_not=(
            f"it crashed the same way at two starts in a row (exit code {last.code}, last log line: "
            f"{last.last_line or '(empty log)'}) without doing any work in between: it would crash at every start, so "
            f"it is not restarted again; fix the cause (its log), then launch the same command to resume"))
    recent = [d for d in deaths if not policy.window_s or d.time > last.time - policy.window_s]
    if len(recent) > policy.max_restarts:
        within = f"within {key}.restart_window_s={policy.window_s:g}s" if policy.window_s else "in this run"
        return Verdict(False, why_not=(
            f"it died {len(recent)} times {within}, more than {key}.max_restarts={policy.max_restarts} "
            f"restarts allow: raise {key}.max_restarts (or lower {key}.restart_window_s) to restart it more "
            f"often; its log tells why it dies"))
    delay = min(policy.backoff_s * 2 ** (len(recent) - 1), max(BACKOFF_CAP_S, policy.backoff_s))
    return Verdict(True, delay_s=delay, count=len(recent))


def last_line(log_tail: str) -> str:
    """The last non-blank line of a role's log (its error, or where it was when killed), timestamp left out."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    return _STAMP.sub("", lines[-1]) if lines else ""
