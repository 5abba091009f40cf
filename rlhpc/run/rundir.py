"""The run directory on the shared filesystem, and the atomic-write primitive everything in it uses."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

from rlhpc.run.procs import tail


def fsync_path(path: Path) -> None:
    """Flushes a file or a folder (its entries: creations, renames, removals) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, durable: bool = True, sync_dir: bool = True) -> None:
    """Writes under a temporary name in the same folder, fsyncs, then renames: readers never see a partial file.
    `sync_dir` also makes the rename itself durable (one more fsync, of the folder). A write that fails (a full
    disk) leaves the old file as it was and no temporary file behind."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    os.replace(tmp, path)
    if durable and sync_dir:
        fsync_path(path.parent)


def write_json(path: Path, obj: Any, durable: bool = True) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True).encode(), durable=durable)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


# ---- a full filesystem --------------------------------------------------------------------------------------------

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def no_space(e: BaseException) -> bool:
    """Whether `e`, or an exception it came from, is a full filesystem or an exceeded quota, also where a library
    reports the OS error in its own (safetensors: "I/O error: No space left on device (os error 28)")."""
    seen: Optional[BaseException] = e
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE or any(t in str(seen) for t in _NO_SPACE_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def space_problem(folder: Path, probe_bytes: int = 64 << 10) -> Optional[str]:
    """Why `folder` cannot take more data (its filesystem full, or the user's quota exceeded), by writing and removing
    a probe file of `probe_bytes`; None if it can. Asked after a role failed: a full disk keeps the failing role from
    writing its own report, and a quota leaves the filesystem's free space looking fine."""
    probe = folder / f".rlhpc-space-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * probe_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno not in _NO_SPACE:
            return None
        free = free_bytes(folder)
        return f"{e.strerror} under {folder}" + (f" ({size_text(free)} free)" if free is not None else "")
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def out_of_space_advice(root: Path) -> str:
    """What to do after a run stopped on a full filesystem: nothing is lost that the next launch needs."""
    latest = read_json(Path(root) / "checkpoints" / "latest.json", default=None)
    where = (f"its last checkpoint (step {latest['step']})" if isinstance(latest, dict) and "step" in latest
             else "its start (no checkpoint yet)")
    return (f"free space (or raise your quota) under {root}, or move that folder where there is room, then launch "
            f"the same command with run_dir=<the folder>: the run resumes from {where}")


def resume_command(root: Path, overrides: Sequence[str]) -> str:
    """The command that goes on with the run in `root`: the launch's overrides, with run_dir naming that folder (the
    default run_dir names a new folder by the time of each launch; absolute, for any working directory) and without
    overwrite=."""
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in ("run_dir", "overwrite")]
    kept.append(f"run_dir={Path(root).absolute()}")
    return " ".join(["python -m rlhpc.launch", *map(shlex.quote, kept)])


def runs_module(pid: int, module: str) -> bool:
    """Whether process `pid` of this machine runs `python -m <module>` (read from its command line)."""
    try:
        return module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def free_bytes(path: Path) -> Optional[int]:
    """Bytes free for this user on the filesystem that holds `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_json_object(path: Path, problems: Optional[Dict[Path, str]] = None,
                     numbers: Sequence[str] = ()) -> Optional[Dict[str, Any]]:
    """The JSON object in `path`, or None if the file is missing (not written yet). A file that does not parse, is not
    an object, or whose `numbers` fields are not numbers raises ValueError naming it; with `problems`, for readers that
    must not stop at one bad file (rlhpc.status, rlhpc.plots: they run while the roles write, and a foreign hand or a
    power loss can leave one damaged), it is None instead, with the reason in `problems[path]`."""
    def bad(why: str) -> None:
        if problems is None:
            raise ValueError(f"{path}: {why}")
        problems[path] = why

    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        return bad(f"{type(e).__name__}: {e}")
    if not isinstance(value, dict):
        return bad(f"holds a JSON {type(value).__name__}, not an object")
    wrong = [k for k in numbers if not is_number(value.get(k))]
    if wrong:
        return bad(f"{', '.join(wrong)}: not a number")
    return value


def wait_for(
    check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05, abort: Optional[Callable[[], Any]] = None
) -> Any:
    """Polls `check` until it returns something truthy; raises TimeoutError naming `what` (never waits forever)."""
    deadline = time.monotonic() + timeout_s
    delay = min(poll_s, 0.01)
    while True:
        value = check()
        if value:
            return value
        if abort is not None:
            reason = abort()
            if reason:
                raise RuntimeError(f"stopped waiting for {what}: {reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, poll_s)


class Backoff:
    """The waits of a polling loop on the shared filesystem: `first_s`, doubling up to `max_s`, back to `first_s` on
    `reset()` (after progress). A loop that does k metadata operations per look thus does at most k / max_s per
    second while nothing happens, however long that lasts."""

    def __init__(self, max_s: float, first_s: float = 0.01):
        self.first_s, self.max_s = first_s, max_s
        self.delay = min(first_s, max_s)

    def next(self) -> float:
        """The next wait (the caller sleeps it, or waits on something that may end it early)."""
        d = self.delay
        self.delay = min(self.delay * 2, self.max_s)
        return d

    def reset(self) -> None:
        self.delay = min(self.first_s, self.max_s)


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).absolute())

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def queue(self) -> Path:
        return self.root / "queue"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def samples(self) -> Path:
        """A few rollouts of each trained step as text (rlhpc/train/samples.py)."""
        return self.root / "samples.jsonl"

    @property
    def trackers(self) -> Path:
        """The identities of the run's experiment tracker runs, fixed at its first launch (rlhpc/run/trackers.py)."""
        return self.root / "trackers.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def status(self) -> Path:
        return self.root / "status"

    @property
    def model(self) -> Path:
        """The Hugging Face folder RL starts from (the built or given base model, or the SFT export)."""
        return self.root / "model"

    @property
    def sft_state(self) -> Path:
        """Where a warm start stopped before its end (a preemption, a time limit) keeps its model, optimizer and step,
        to go on from on requeue (rlhpc.train.warmstart); removed once the warm start is done."""
        return self.root / "sft_state"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def done(self) -> Path:
        """Written by the trainer after its last step: every role may exit."""
        return self.status / "DONE"

    @property
    def failed(self) -> Path:
        return self.status / "FAILED"

    def error_file(self, role: str, rank: int) -> Path:
        """The error of a restartable role's last life, kept out of status/FAILED while it may be restarted: its
        launcher (or Slurm task) makes it status/FAILED when it stops restarting the role (rlhpc.cluster.restarts)."""
        return self.status / f"{role}-{rank}.error"

    @property
    def requeue(self) -> Path:
        """Written by the trainer when it checkpointed on a stop signal: the step the run goes on at."""
        return self.status / "REQUEUE"

    def failure(self) -> Optional[str]:
        """What status/FAILED says (the first role that failed), or None."""
        info = read_json(self.failed)
        return f"{info['role']} rank {info['rank']} failed: {info['error']}" if info else None

    def failure_report(self, problems: Optional[Dict[Path, str]] = None) -> Optional[Dict[str, Any]]:
        """Which role failed first (status/FAILED, written by the role itself), why, and the end of its log
        (`problems`: as read_json_object)."""
        info = read_json_object(self.failed, problems)
        if not info:
            return None
        log = self.log_file(info.get("role", "?"), info.get("rank", 0))
        return {**info, "log": str(log), "log_tail": tail(log)}

    def make(self) -> "RunDir":
        for p in (self.queue, self.weights, self.checkpoints, self.rendezvous, self.tb, self.logs, self.status):
            p.mkdir(parents=True, exist_ok=True)
        return self

    def log_file(self, role: str, rank: int) -> Path:
        return self.logs / f"{role}-{rank}.log"

    def heartbeat(self, role: str, rank: int, **fields: Any) -> None:
        info: Dict[str, Any] = {"role": role, "rank": rank, "pid": os.getpid(), "host": os.uname().nodename}
        info.update(fields, time=time.time())
        write_json(self.status / f"{role}-{rank}.json", info, durable=False)

    def heartbeats(self, problems: Optional[Dict[Path, str]] = None) -> Dict[str, Dict[str, Any]]:
        """Every role's last heartbeat (status/<role>-<rank>.json) by name (`problems`: as read_json_object)."""
        out = {}
        for p in sorted(self.status.glob("*-*.json")):
            info = read_json_object(p, problems, ("time",))
            if info:
                out[p.stem] = info
        return out

    def live_roles(self, heartbeats: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, int]:
        """The roles of this run alive on this machine, name -> pid: a heartbeat of the last 5 minutes from this host
        whose pid still runs `rlhpc.role` (a pid reused by another program does not count)."""
        host = os.uname().nodename
        live = {}
        for name, beat in (self.heartbeats({}) if heartbeats is None else heartbeats).items():
            pid = beat.get("pid")
            if beat.get("host") == host and type(pid) is int and time.time() - beat.get("time", 0) <= 300 \
                    and runs_module(pid, "rlhpc.role"):
                live[name] = pid
        return live
