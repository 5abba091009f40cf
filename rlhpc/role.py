"""The one entry point of every role process: `python -m rlhpc.role`.

A role learns who it is from its environment, never from the launcher object:
- the local launcher sets RLHPC_ROLE, RLHPC_RANK, RLHPC_ROLE_SIZE, RLHPC_RUN_DIR (and MASTER_ADDR/PORT for the trainer);
- under Slurm, `rlhpc.cluster.slurm_identity` derives the same from SLURM_* variables of the heterogeneous job.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from rlhpc import config as config_mod
from rlhpc.rundir import RunDir, write_json


@dataclass
class Identity:
    role: str  # "trainer" | "inference"
    rank: int  # rank within the role
    size: int  # number of processes of the role
    run_dir: Path
    # Distinguishes launches of the same run (a requeue is a new attempt): rendezvous files carry it.
    attempt: str
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


def identity_from_env() -> Identity:
    env = os.environ
    if "RLHPC_ROLE" in env:
        return Identity(
            role=env["RLHPC_ROLE"],
            rank=int(env["RLHPC_RANK"]),
            size=int(env["RLHPC_ROLE_SIZE"]),
            run_dir=Path(env["RLHPC_RUN_DIR"]),
            attempt=env.get("RLHPC_ATTEMPT", "0"),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    if "SLURM_JOB_ID" in env:
        from rlhpc.cluster.slurm_identity import identity_from_slurm

        return identity_from_slurm(env)
    raise RuntimeError("rlhpc.role needs RLHPC_ROLE/RLHPC_RANK/RLHPC_ROLE_SIZE/RLHPC_RUN_DIR or a Slurm job environment")


def setup_logging(run: RunDir, ident: Identity, level: str) -> None:
    fmt = f"%(asctime)s {ident.role}[{ident.rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr, force=True)


class Stop(Exception):
    """Raised in a role's main thread when the process is asked to stop (SIGTERM/SIGINT/SIGUSR1)."""


def install_stop_handlers() -> None:
    def handler(signum, frame):  # noqa: ARG001
        raise Stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, handler)


def main() -> int:
    ident = identity_from_env()
    run = RunDir(ident.run_dir)
    cfg = config_mod.load(run.root)
    setup_logging(run, ident, cfg.log_level)
    install_stop_handlers()
    log = logging.getLogger("rlhpc.role")
    log.info("starting %s rank %d/%d pid %d in %s", ident.role, ident.rank, ident.size, os.getpid(), run.root)
    try:
        if ident.role == "trainer":
            from rlhpc.trainer import run_trainer

            run_trainer(cfg, ident, run)
        elif ident.role == "inference":
            from rlhpc.inference import run_worker

            run_worker(cfg, ident, run)
        else:
            raise ValueError(f"unknown role {ident.role!r}")
    except Stop as e:
        log.warning("stopped by %s", e)
        return 143
    except BaseException as e:
        log.exception("%s rank %d failed", ident.role, ident.rank)
        write_json(run.failed, {"role": ident.role, "rank": ident.rank, "error": repr(e)}, durable=False)
        return 1
    log.info("%s rank %d finished", ident.role, ident.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
