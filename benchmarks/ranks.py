"""What the multi-rank benchmarks share: a function run on N local processes that form one torch.distributed world,
and each process's resident memory from /proc/self/status (Linux).

`on_ranks(target, world, args)` runs `target(rank, world, port, *args)` on each rank and returns the ranks' results
in rank order; a rank's exception is raised in the caller with its traceback. Every wait has a timeout and every
process is ended (killed if it does not exit). `kb("VmRSS")` is the resident set now, `kb("VmHWM")` its high-water
mark, which `reset_peak()` sets back to the resident set now: so a phase's peak above its start is
`kb("VmHWM") - base` after `base = kb("VmRSS"); reset_peak()`.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import traceback
import warnings
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMEOUT = 300.0  # seconds any one wait on the ranks may take


def kb(key: str) -> int:
    """This process's `key` line of /proc/self/status (VmRSS, VmHWM, ...), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")


def on_ranks(target, world: int, args: tuple, start: str = "forkserver", threads: Optional[int] = 1,
             timeout: float = TIMEOUT) -> list:
    """`target(rank, world, port, *args)` on `world` processes started by `start` ("forkserver": from a server that
    has imported torch and the trainer once; "spawn": each a fresh interpreter), each with `threads` torch threads
    (None: torch's default); each rank's return value, by rank. The ranks' process group, if they made one, is
    destroyed when `target` returns."""
    from rlhpc.run.procs import free_port

    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "rlhpc.train.trainer"])
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_guarded, args=(target, r, world, port, args, threads, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            status, rank, value = out.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [results[r] for r in range(world)]


def _guarded(target, rank, world, port, args, threads, out) -> None:
    import torch
    import torch.distributed as dist

    if threads is not None:
        torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of the collectives rlhpc calls
    try:
        out.put(("ok", rank, target(rank, world, port, *args)))
    except BaseException:  # noqa: BLE001
        out.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
