"""Faults on purpose, and what they cost: the injections of the chaos test (tests/test_chaos.py) and its benchmark
(benchmarks/chaos.py), and the accounting of a run's groups after them.

Each injection acts on a live run directory the way a real failure does: `kill -9` of a role (its process group when
the local launcher started it, the process alone inside a Slurm step), bytes overwritten in a published queue file,
a worker frozen with SIGSTOP. Roles are found by their heartbeat (`status/<role>-<rank>.json` holds the pid), so the
same code works for local runs and for Slurm jobs on the local cluster (all its nodes are this machine).

The accounting (`account`) reads every group a run ever showed: the queue files seen in snapshots taken before
faults, and every file left at the end (pending/, steps/, retired/, dropped/, quarantine/). A group is *trained* if
queue/ledger.jsonl names it, *dropped* (too stale) or *quarantined* (invalid, or from weights a resumed trainer never
made) if its file is in those folders, *pending* if still unclaimed at the end; any other is *lost*. A uid the
ledger names twice is *duplicated*.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from rlhpc.run.rundir import read_json
from rlhpc.transport.queue import SUFFIX, RolloutBatch


# ---- waiting on a run --------------------------------------------------------------------------------------------


def ledger(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / "queue" / "ledger.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def wait_steps(run_dir: Path, n: int, alive: Callable[[], Optional[str]], timeout: float = 300) -> None:
    """Until the ledger holds `n` steps. `alive()` returns why the run cannot get there (it ended), or None."""
    deadline = time.monotonic() + timeout
    while len(ledger(run_dir)) < n:
        why = alive()
        if why:
            raise RuntimeError(f"the run ended before step {n}: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {n} not reached within {timeout:.0f}s (at {len(ledger(run_dir))})")
        time.sleep(0.05)


# ---- injections --------------------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str  # "kill worker", "kill trainer", "corrupt file", "freeze worker", "requeue job", "drain node"
    target: str  # "inference-0", a file name, a job id, a node
    at_step: int  # steps in the ledger when it was injected
    survived: Optional[bool] = None  # decided after the run (see `survived`)


def role_pid(run_dir: Path, role: str, rank: int, timeout: float = 120) -> int:
    """The pid of a live role process of this run, from its heartbeat. Waits while the role is between two lives (a
    restarted worker writes its heartbeat once it is up)."""
    path = Path(run_dir) / "status" / f"{role}-{rank}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = read_json(path) if path.exists() else None
        pid = (info or {}).get("pid")
        if pid and _belongs_to(pid, run_dir):
            return pid
        time.sleep(0.1)
    raise TimeoutError(f"no live {role}-{rank} of {run_dir} within {timeout:.0f}s")


def _belongs_to(pid: int, run_dir: Path) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return f"RLHPC_RUN_DIR={Path(run_dir)}".encode() in env and state not in ("Z", "X")


def _signal_role(pid: int, sig: int) -> None:
    """The role's process group if it leads one (the local launcher starts each role in its own session, with its
    environment pool), else the process alone (a task of a Slurm step: the step's shell must live on)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_role(run_dir: Path, role: str, rank: int) -> Fault:
    """`kill -9` of a role, as when its node dies."""
    at = len(ledger(run_dir))
    _signal_role(role_pid(run_dir, role, rank), signal.SIGKILL)
    return Fault(f"kill {'trainer' if role == 'trainer' else 'worker'}", f"{role}-{rank}", at)


def freeze_role(run_dir: Path, role: str, rank: int, seconds: float) -> Fault:
    """SIGSTOP for `seconds`, then SIGCONT: a worker that stalls (swapping, a hung filesystem) past its lease."""
    at = len(ledger(run_dir))
    pid = role_pid(run_dir, role, rank)
    _signal_role(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        _signal_role(pid, signal.SIGCONT)
    return Fault("freeze worker", f"{role}-{rank} ({seconds:g}s)", at)


def corrupt_pending_file(run_dir: Path, timeout: float = 120) -> Fault:
    """Overwrites 64 bytes of a published, unclaimed file in place (a bad disk block, a buggy copy): it must be
    quarantined, never trained."""
    pending = Path(run_dir) / "queue" / "pending"
    at = len(ledger(run_dir))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in sorted(pending.glob(f"*{SUFFIX}")):
            try:
                with open(path, "r+b") as f:
                    f.seek(8)
                    f.write(b"\x00" * 64)
                return Fault("corrupt file", path.name, at)
            except FileNotFoundError:
                continue  # claimed meanwhile
        time.sleep(0.02)
    raise TimeoutError(f"no pending file to corrupt in {pending} within {timeout:.0f}s")


# ---- accounting --------------------------------------------------------------------------------------------------


def read_uids(path: Path) -> Optional[List[str]]:
    """The group uids of a queue file, or None if it cannot be read (or vanished)."""
    try:
        return [g.uid for g in RolloutBatch.from_bytes(path.read_bytes()).groups]
    except (OSError, ValueError):
        return None


def _queue_files(queue: Path, folder: str) -> List[Path]:
    return sorted(p for p in (queue / folder).rglob(f"*{SUFFIX}") if not p.name.startswith("."))


def snapshot(run_dir: Path) -> Dict[str, List[str]]:
    """file name -> group uids of every readable queue file the run holds now (taken before a fault that could lose
    some: a trainer kill, a requeue)."""
    queue = Path(run_dir) / "queue"
    seen: Dict[str, List[str]] = {}
    for folder in ("pending", "steps", "retired"):
        for p in _queue_files(queue, folder):
            uids = read_uids(p)
            if uids:
                seen[p.name] = uids
    return seen


@dataclass
class Accounting:
    published: int  # groups seen in any snapshot or file
    trained: int
    dropped: int
    quarantined: int
    pending: int
    lost: List[str] = field(default_factory=list)
    duplicated: List[str] = field(default_factory=list)
    steps: List[int] = field(default_factory=list)  # the ledger's steps, in order

    def line(self) -> str:
        return (f"groups: {self.published} published, {self.trained} trained, {self.dropped} dropped (stale), "
                f"{self.quarantined} quarantined, {self.pending} pending at the end, {len(self.lost)} lost, "
                f"{len(self.duplicated)} duplicated")


def account(run_dir: Path, snapshots: Sequence[Dict[str, List[str]]] = ()) -> Accounting:
    queue = Path(run_dir) / "queue"
    entries = ledger(run_dir)
    trained = [u for e in entries for u in e["groups"]]
    trained_set = set(trained)
    duplicated = sorted(u for u, n in Counter(trained).items() if n > 1)
    where: Dict[str, str] = {}
    for folder in ("dropped", "quarantine", "pending"):
        for p in _queue_files(queue, folder):
            for u in read_uids(p) or []:
                where[u] = folder
    # A quarantined file may be unreadable (that is why it is there): its name stands for the uids seen before.
    quarantined_names = {p.name for p in _queue_files(queue, "quarantine")}
    quarantined_names |= {p.name[: -len(".reason")] for p in (queue / "quarantine").glob("*.reason")}
    every: Dict[str, str] = {}  # uid -> file name
    for snap in list(snapshots) + [snapshot(run_dir)]:
        for name, uids in snap.items():
            for u in uids:
                every.setdefault(u, name)
    for u in trained_set | set(where):
        every.setdefault(u, "")
    for name, uids in ((n, u) for s in snapshots for n, u in s.items()):
        if any(name == q or q.startswith(name[: -len(SUFFIX)] + "-") for q in quarantined_names):
            for u in uids:
                where.setdefault(u, "quarantine")
    lost = sorted(u for u in every if u not in trained_set and u not in where)
    by = {k: sum(1 for u in every if u not in trained_set and where.get(u) == k) for k in ("dropped", "quarantine",
                                                                                          "pending")}
    return Accounting(published=len(every), trained=len(trained_set), dropped=by["dropped"],
                      quarantined=by["quarantine"], pending=by["pending"], lost=lost, duplicated=duplicated,
                      steps=[e["step"] for e in entries])


def survived(faults: Sequence[Fault], run_dir: Path, completed: bool, log_text: str = "") -> List[Fault]:
    """Decides for each fault whether the run absorbed it: it completed, and a killed worker was restarted
    (`log_text` holds the launcher's or the job's output), a corrupt file went to quarantine/ and was never trained.
    A killed trainer and a frozen worker count as survived when the run completed (a resumed trainer shows in
    summary.json's `resumed_at`, checked by the caller)."""
    queue = Path(run_dir) / "queue"
    quarantined = {p.name[: -len(".reason")] for p in (queue / "quarantine").glob("*.reason")}
    restarts: Dict[str, int] = {}
    for line in log_text.splitlines():
        if "restarting it (" in line:
            name = line.split(" exited with code")[0].split()[-1]
            restarts[name] = restarts.get(name, 0) + 1
    for f in faults:
        ok = completed
        if f.kind == "kill worker":
            ok = ok and restarts.get(f.target, 0) > 0
            if ok:
                restarts[f.target] -= 1
        elif f.kind == "corrupt file":
            ok = ok and f.target in quarantined
        f.survived = ok
    return list(faults)


# ---- the reduced-size run the chaos test and benchmark disturb --------------------------------------------------


def warm_start(run_dir: Path, timeout: float = 900) -> Path:
    """The quick-start SFT model (reverse_text: SFT until the greedy validation reward reaches 0.45, ~140 steps; no RL
    step), from which RL improves the held-out reward within tens of steps. Both the undisturbed and the disturbed
    run start from it."""
    import sys

    proc = subprocess.run([sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", "trainer.steps=0",
                           "eval.num_tasks=64", "launcher.progress=false", f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"SFT warm start failed:\n{proc.stderr[-3000:]}")
    return Path(run_dir) / "model"


def rl_overrides(model: Path, steps: int, checkpoint_interval: int, seed: int = 3,
                 transport: str = "broadcast") -> List[str]:
    """RL from `model` as the quick start does it, with what surviving faults needs beyond the defaults (which restart
    dead workers and a dead trainer): short leases, retired steps kept for the accounting. The final held-out reward
    uses 64 tasks."""
    return ["+exp=reverse_text", f"model.path={model}", "sft.steps=0", f"trainer.steps={steps}",
            f"trainer.checkpoint_interval={checkpoint_interval}", "eval.num_tasks=64", "eval.interval=0",
            "launcher.progress=false", f"weights.transport={transport}", "queue.lease_s=3",
            "queue.keep_retired=true", f"seed={seed}"]


def heldout(run_dir: Path) -> Dict[str, float]:
    s = read_json(Path(run_dir) / "summary.json") or {}
    return {"sft": s.get("heldout_reward_sft"), "rl": s.get("heldout_reward_rl")}


# ---- running a launch under faults (local launcher) --------------------------------------------------------------


@dataclass
class LocalChaos:
    """Runs `python -m rlhpc.launch <args>` and injects, at seeded random moments: 2 worker kills and a corrupt file,
    then a trainer kill (the launcher starts the trainer again, with fresh workers, from its newest checkpoint:
    trainer.max_restarts), then a third worker kill, a second corrupt file and a frozen worker. `steps` is
    trainer.steps of the launch; the run needs restarts of workers and of the trainer (the defaults) and a checkpoint
    interval well below steps/2."""

    args: List[str]
    run_dir: Path
    steps: int
    checkpoint_interval: int
    seed: int = 0
    freeze_s: float = 4.0
    env: Optional[dict] = None
    faults: List[Fault] = field(default_factory=list)
    snapshots: List[Dict[str, List[str]]] = field(default_factory=list)
    output: str = ""
    resumed_from: int = -1
    returncode: Optional[int] = None

    def _wait(self, proc: subprocess.Popen, n: int, rng) -> None:
        wait_steps(self.run_dir, n, lambda: None if proc.poll() is None else f"exit code {proc.returncode}")
        time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside the step, not at its boundary

    def run(self, timeout: float = 900) -> int:
        import random

        rng = random.Random(self.seed)
        iv, steps = self.checkpoint_interval, self.steps
        kill_trainer_at = rng.randint(2 * iv + 1, 3 * iv - 1)  # after two checkpoints, before the third
        proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        try:
            self._wait(proc, rng.randint(1, iv), rng)
            self.faults.append(kill_role(self.run_dir, "inference", 0))
            self.faults.append(corrupt_pending_file(self.run_dir))
            self._wait(proc, rng.randint(iv + 1, 2 * iv), rng)
            self.faults.append(kill_role(self.run_dir, "inference", 1))
            self._wait(proc, kill_trainer_at, rng)
            self.snapshots.append(snapshot(self.run_dir))
            killed = role_pid(self.run_dir, "trainer", 0)
            self.faults.append(kill_role(self.run_dir, "trainer", 0))  # the launcher starts it again ...
            # ... from the newest checkpoint, which the dead trainer can no longer move
            self.resumed_from = (read_json(self.run_dir / "checkpoints" / "latest.json") or {}).get("step", 0)
            deadline = time.monotonic() + 180
            while role_pid(self.run_dir, "trainer", 0, timeout=180) == killed:  # its heartbeat still names the dead
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer was not started again (launcher exit code {proc.poll()})")
                time.sleep(0.1)
            after = max(self.resumed_from, len(ledger(self.run_dir)))
            self._wait(proc, after + rng.randint(1, 3), rng)
            self.faults.append(kill_role(self.run_dir, "inference", rng.randint(0, 1)))
            self.faults.append(corrupt_pending_file(self.run_dir))
            self._wait(proc, min(steps - 3, after + rng.randint(4, 6)), rng)
            self.faults.append(freeze_role(self.run_dir, "inference", 1, self.freeze_s))
            out, err = proc.communicate(timeout=timeout)
        finally:
            _end(proc)
        self.output += out + err
        self.returncode = proc.returncode
        return proc.returncode


def _end(proc: subprocess.Popen) -> None:
    """SIGINT (the launcher ends every role it started), then SIGKILL if it does not exit."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
