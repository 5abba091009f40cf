"""Small helpers for processes, ports and logs, shared by the launchers, the roles, the engines and the tests."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict

TAIL_LINES = 20


def node_address() -> str:
    """This node's address as other nodes reach it: the hostname's address under Slurm, loopback otherwise."""
    if os.environ.get("SLURM_JOB_ID"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            pass
    return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (another process may still take it before we bind it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# What stops a process that follows a run (a launcher, attached workers, a server): Ctrl-C, SIGTERM (kill, a
# scheduler) and SIGHUP (the terminal it was started from was closed). Without a handler SIGHUP would end the launcher
# alone: its roles run in sessions of their own, so they do not get it, and they would go on with no one to end them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def on_stop_signals(handler: Callable[[int, Any], None]) -> Dict[int, Any]:
    """Installs `handler` for STOP_SIGNALS, but for one this process was started ignoring (`nohup` ignores SIGHUP:
    the run then goes on after the terminal closes, as asked). A SIGHUP first points stdout and stderr away from the
    closed terminal (terminal_gone). Returns the previous handlers, to put back with `signal.signal`."""
    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            terminal_gone()
        handler(signum, frame)

    return {s: signal.signal(s, on_signal) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}


def exit_code(signum: int) -> int:
    """The exit status of a process ended by `signum`, as a shell reports it (130 for SIGINT, 143 for SIGTERM, 129 for
    SIGHUP)."""
    return 128 + signum


def terminal_gone() -> None:
    """Points stdout and stderr to /dev/null where they are terminals (character devices). After a hang-up, writing to
    the terminal raises OSError (EIO): a message printed on the way out would cut the ending short, leaving the roles
    running. Files and pipes are kept: they can still be read."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:
                continue  # closed: nothing to write to anyway
    finally:
        os.close(null)


# The first line the local launcher writes into a role's log when it starts the process: a log is appended to over the
# attempts and restarts of a run, and a tail starts after the last such line (the process that just ended), not
# among an earlier attempt's last words.
LOG_START = "==== rlhpc: started"


PR_SET_PDEATHSIG = 1
LAUNCHER_PID = "RLHPC_LAUNCHER_PID"  # set by the local launcher in its roles' environment


def end_with_launcher(adopt_timeout_s: float = 10.0) -> None:
    """A role of the local launcher gets SIGTERM when the launcher dies, however it dies (kill -9 included), and stops
    as on Ctrl-C, the trainer checkpointing: no role trains on, unwatched, beside the next launch (Linux's
    PR_SET_PDEATHSIG). A role forked by the preload process waits until the launcher has adopted it (its forking parent
    exits at once). A launcher already gone: SIGTERM at once. Elsewhere (Slurm steps, other systems): nothing."""
    launcher = int(os.environ.get(LAUNCHER_PID) or 0)
    if not launcher or not sys.platform.startswith("linux"):
        return
    deadline = time.monotonic() + adopt_timeout_s
    while os.getppid() != launcher and _alive(launcher) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # it died before the request took effect (or never adopted this role)
        os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log file since the last LOG_START line, or a note that it does not exist."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"({path} does not exist)"
    starts = [i for i, line in enumerate(text) if line.startswith(LOG_START)]
    return "\n".join(text[starts[-1] if starts else 0:][-lines:])
