"""Who a task of the heterogeneous job is, from Slurm's environment alone.

The job has two components, started together by one `srun --het-group=0,1`: component 0 runs the trainer ranks,
component 1 the inference workers. Slurm tells no task its component: `SLURM_PROCID` counts across both components in
order, so task p belongs to the first component k with p < NTASKS_HET_GROUP_0 + ... + NTASKS_HET_GROUP_k, and its rank
within the role is p minus the tasks before that component. Every task sees the leader's `SLURM_JOB_ID`.

    python -m rlhpc.run.slurm_identity      # prints "trainer-0", "inference-1", ...: the task's log name

With vLLM instances over several nodes (RLHPC_NODES_PER_INSTANCE=N, from inference.nodes_per_instance), the inference
component has N tasks per worker: the worker and N - 1 followers ("follower-<f>"; see _instance_place).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Tuple

from rlhpc.run.identity import Identity

# Component k of the heterogeneous job runs ROLES[k].
ROLES = ("trainer", "inference")
# The trainer's torch.distributed port: derived from the job id (and the restart), so every task computes the same one.
PORT_BASE, PORT_SPAN = 10000, 22000


class SlurmIdentityError(RuntimeError):
    pass


def role_and_rank(env: Mapping[str, str]) -> Tuple[str, int, int]:
    """(role, rank within the role, size of the role) of this task of `srun --het-group=0,1`, or of a job of attached
    inference workers (one component; RLHPC_ATTACH_RANKS lists the ranks rlhpc.cluster.attach allocated)."""
    if env.get("RLHPC_ATTACH") == "1":
        ranks = [int(r) for r in env.get("RLHPC_ATTACH_RANKS", "").split(",") if r.strip()]
        procid = int(env["SLURM_PROCID"])
        if procid >= len(ranks):
            raise SlurmIdentityError(f"SLURM_PROCID={procid}, but RLHPC_ATTACH_RANKS={env.get('RLHPC_ATTACH_RANKS')!r} "
                                     f"names {len(ranks)} worker(s): the attach job's script sets both")
        return "inference", ranks[procid], len(ranks)
    sizes = []
    for k in range(len(ROLES)):
        value = env.get(f"SLURM_NTASKS_HET_GROUP_{k}")
        if value is None:
            raise SlurmIdentityError(
                f"SLURM_NTASKS_HET_GROUP_{k} is not set: rlhpc roles run as one step over both components of the "
                f"heterogeneous job (`srun --het-group=0,1 python -m rlhpc.role`; see sbatch/rlhpc.sbatch)"
            )
        sizes.append(int(value))
    procid, ntasks = int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", sum(sizes)))
    if ntasks != sum(sizes):
        raise SlurmIdentityError(
            f"this step has {ntasks} tasks but the job's components have {sizes}: start the roles with "
            f"`srun --het-group=0,1` so that one step spans both components"
        )
    first = 0
    for role, size in zip(ROLES, sizes):
        if procid < first + size:
            return _instance_place(role, procid - first, size, int(env.get("RLHPC_NODES_PER_INSTANCE") or 1))
        first += size
    raise SlurmIdentityError(f"SLURM_PROCID={procid} is outside the job's {sum(sizes)} tasks")


def _instance_place(role: str, task: int, size: int, nodes: int) -> Tuple[str, int, int]:
    """With vLLM instances over `nodes` nodes (inference.nodes_per_instance; the job script exports it), task t of the
    inference component is worker t // nodes's node rank t % nodes: rank 0 is the worker itself, the others are its
    followers (rlhpc/infer/follower.py), numbered w x (nodes - 1) + node rank - 1."""
    if role != "inference" or nodes <= 1:
        return role, task, size
    if size % nodes:
        raise SlurmIdentityError(f"the inference component has {size} tasks, not a multiple of "
                                 f"RLHPC_NODES_PER_INSTANCE={nodes} (inference.nodes_per_instance)")
    worker, node_rank = divmod(task, nodes)
    if node_rank == 0:
        return "inference", worker, size // nodes
    return "follower", worker * (nodes - 1) + node_rank - 1, size // nodes * (nodes - 1)


def attempt(env: Mapping[str, str]) -> str:
    """`<job id>.<restart count>`: a requeued job is a new attempt of the same run."""
    return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT') or 0}"


def master_port(env: Mapping[str, str]) -> int:
    if env.get("RLHPC_MASTER_PORT"):
        return int(env["RLHPC_MASTER_PORT"])
    restart = int(env.get("SLURM_RESTART_COUNT") or 0)
    return PORT_BASE + (int(env["SLURM_JOB_ID"]) * 8 + restart % 8) % PORT_SPAN


def first_node(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[007-012,020],cpu01" -> "gpu007"."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise SlurmIdentityError(f"cannot read the node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def node_address(node: str) -> str:
    """An address other nodes can reach `node` at: its DNS name if it resolves, else Slurm's NodeAddr (on a
    single-machine cluster the node names n1..n4 are not host names)."""
    try:
        socket.gethostbyname(node)
        return node
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "show", "node", node, "-o"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmIdentityError(f"node {node} does not resolve and `scontrol show node` failed: {e}") from e
    m = re.search(r"\bNodeAddr=(\S+)", out)
    if not m:
        raise SlurmIdentityError(f"node {node} does not resolve and scontrol knows no NodeAddr for it")
    return m.group(1)


def identity_from_slurm(env: Mapping[str, str]) -> Identity:
    role, rank, size = role_and_rank(env)
    run_dir = env.get("RLHPC_RUN_DIR")
    if not run_dir:
        raise SlurmIdentityError("RLHPC_RUN_DIR is not set: the job script exports it (see sbatch/rlhpc.sbatch)")
    attached = env.get("RLHPC_ATTACH") == "1"
    return Identity(
        role=role,
        rank=rank,
        size=size,
        run_dir=Path(run_dir),
        attempt=attempt(env),
        # Attached workers never talk to the trainer's torch.distributed group (only to the weights group).
        master_addr="127.0.0.1" if attached else node_address(first_node(env["SLURM_JOB_NODELIST_HET_GROUP_0"])),
        master_port=master_port(env),
        # Set by the job script's task loop when it restarts a dead inference worker (inference.max_restarts).
        restart=int(env.get("RLHPC_RESTART") or 0),
        restarts_left=int(env.get("RLHPC_RESTARTS_LEFT") or 0),
        attached=attached,
    )


def main() -> int:
    try:
        role, rank, _ = role_and_rank(os.environ)
    except (SlurmIdentityError, KeyError) as e:
        print(f"rlhpc.run.slurm_identity: {e}", file=sys.stderr)
        return 1
    print(f"{role}-{rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
