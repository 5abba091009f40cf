"""Small helpers for processes, ports and logs, shared by the launchers, the roles, the engines and the tests."""

from __future__ import annotations

import os
import socket
from pathlib import Path

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


# The first line the local launcher writes into a role's log when it starts the process: a log is appended to over the
# attempts and restarts of a run, and a tail starts after the last such line (the process that just ended), not
# among an earlier attempt's last words.
LOG_START = "==== rlhpc: started"


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log file since the last LOG_START line, or a note that it does not exist."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"({path} does not exist)"
    starts = [i for i, line in enumerate(text) if line.startswith(LOG_START)]
    return "\n".join(text[starts[-1] if starts else 0:][-lines:])
