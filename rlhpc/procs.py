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


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log file, or a note that it does not exist."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"({path} does not exist)"
