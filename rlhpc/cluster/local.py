"""Run ``local_slurm.sh``: a real Slurm cluster (munged, MariaDB, slurmdbd, slurmctld, 4 slurmd) on this machine.

    python -m rlhpc.cluster.local up       # install if missing, start; idempotent
    python -m rlhpc.cluster.local status   # exit 0 up, 1 partly up, 3 down
    python -m rlhpc.cluster.local down     # cancel jobs, stop exactly what 'up' started
    python -m rlhpc.cluster.local purge    # down, then delete its state dir and config files
    python -m rlhpc.cluster.local path     # print the script's path (e.g. for ``sudo bash "$(...)" up``)

``up``/``down``/``purge`` need root. See docs/slurm-local.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("local_slurm.sh")
COMMANDS = ("up", "down", "status", "purge")


def run(command: str, *, check: bool = False) -> int:
    """Run ``local_slurm.sh <command>`` with this process's stdout/stderr; return its exit status."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; expected one of {', '.join(COMMANDS)}")
    rc = subprocess.call(["bash", str(SCRIPT), command])
    if check and rc != 0:
        raise subprocess.CalledProcessError(rc, ["bash", str(SCRIPT), command])
    return rc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1 or args[0] not in (*COMMANDS, "path"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if args[0] == "path":
        print(SCRIPT)
        return 0
    if args[0] != "status" and os.geteuid() != 0:
        print(
            f"rlhpc-slurm: '{args[0]}' must run as root, e.g.:\n"
            f"  sudo bash {SCRIPT} {args[0]}\n"
            f"  sudo {sys.executable} -m rlhpc.cluster.local {args[0]}",
            file=sys.stderr,
        )
        return 1
    return run(args[0])


if __name__ == "__main__":
    sys.exit(main())
