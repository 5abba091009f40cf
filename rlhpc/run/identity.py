"""Who a role process is: role, rank, size, run directory, attempt. Learned from the environment, never from a launcher.

- the local launcher sets RLHPC_ROLE, RLHPC_RANK, RLHPC_ROLE_SIZE, RLHPC_RUN_DIR (and MASTER_ADDR/PORT for the trainer);
- under Slurm, `rlhpc.run.slurm_identity` derives the same from SLURM_* variables of the heterogeneous job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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
    # How many times this process was restarted after dying, and inference.max_restarts when its launcher may restart
    # it again (0: its death ends the run; rlhpc.cluster.restarts).
    restart: int = 0
    restarts_left: int = 0
    # An inference worker added to a running run (`+attach=inference`, rlhpc.cluster.attach): it joins the weights
    # group at whatever attempt the run is in, and its failure is its own (it never marks the run failed).
    attached: bool = False


def identity_from_env(env=os.environ) -> Identity:
    """The identity the local launcher (or a user) set in RLHPC_* variables."""
    return Identity(
        role=env["RLHPC_ROLE"],
        rank=int(env["RLHPC_RANK"]),
        size=int(env["RLHPC_ROLE_SIZE"]),
        run_dir=Path(env["RLHPC_RUN_DIR"]),
        attempt=env.get("RLHPC_ATTEMPT", "0"),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        restart=int(env.get("RLHPC_RESTART", "0")),
        restarts_left=int(env.get("RLHPC_RESTARTS_LEFT", "0")),
        attached=env.get("RLHPC_ATTACH") == "1",
    )
