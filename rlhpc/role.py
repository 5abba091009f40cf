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


# Exit code of a trainer that checkpointed because it was asked to stop: "requeue me" (EX_TEMPFAIL).
REQUEUE_EXIT = 75


class Stop(Exception):
    """Raised where a role stops waiting because the process was asked to stop."""


_stop_signal: list = []


def stop_requested() -> str | None:
    """The name of the signal that asked this process to stop (SIGTERM/SIGINT/SIGUSR1), or None. Roles check it at
    safe points (step boundaries, waits); a second signal stops at once."""
    return _stop_signal[0] if _stop_signal else None


def install_stop_handlers() -> None:
    def handler(signum, frame):  # noqa: ARG001
        name = signal.Signals(signum).name
        if _stop_signal:
            raise Stop(f"{name} (second signal)")
        _stop_signal.append(name)

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

            if run_trainer(cfg, ident, run) == "requeue":
                log.warning("checkpointed after %s; exiting with %d (requeue)", stop_requested(), REQUEUE_EXIT)
                return REQUEUE_EXIT
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
        if not run.failed.exists():  # the first failure is the cause; later ones are consequences
            write_json(run.failed, {"role": ident.role, "rank": ident.rank, "error": repr(e)}, durable=False)
        return 1
    log.info("%s rank %d finished", ident.role, ident.rank)
    return 0


if __name__ == "__main__":
    # Run the imported module, not __main__: the stop flag must be the one the roles import.
    from rlhpc import role as _role

    code = _role.main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a communication thread blocked inside gloo/NCCL would abort the process there.
    os._exit(code)
