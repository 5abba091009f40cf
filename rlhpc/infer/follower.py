"""vLLM instances over several nodes (`inference.nodes_per_instance` > 1): the leader's side and the followers.

A model whose weights do not fit in one node's GPUs (GLM-5 in FP8 on 80 GB GPUs) is served by one vLLM instance over
N nodes: vLLM's multiprocessing executor with `nnodes=N`. Node rank 0 runs the whole engine (scheduler, sampler
output, the rlhpc worker around it); node ranks 1..N-1 run only vLLM's model workers ("headless"), which take their
orders from the leader over vLLM's message queue and join its torch.distributed group.

Rendezvous goes through the run directory, which every node shares: before starting its engine, the leader of worker
w picks its address and a free port and writes `rendezvous/instance-<w>.json` (a new `id` for every life of the
leader), then renews the file's modification time every few seconds while it lives (`LEASE_S`). A follower waits for
a record it has not served yet, starts vLLM's headless executor against it, and watches it: when the leader removes
it (the worker ended), replaces it (a restarted leader), or stops renewing it (a leader that died without a word; the
follower measures this with its own clock, so the nodes' clocks need not agree), the follower shuts its executor down
and waits for the next leader. It ends when the run is DONE or FAILED, when it is asked to stop, or when no leader has
come for `inference.startup_timeout_s` after the trainer's warm start (the worker waits for that before it leads).

Followers are role `follower`, rank f = w x (N - 1) + (node rank - 1): under Slurm task t of the inference component
is worker t // N's node rank t % N (rlhpc/run/slurm_identity.py); the local launcher starts them beside the
workers. Weight updates need nothing more: with tensor_parallel_size > 1 the leader writes each update as a file under
the run directory and every model worker of the instance, followers' included, reloads its shard from there
(rlhpc/infer/engines/vllm.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from rlhpc.config.schema import Config, InferenceConfig
from rlhpc.run.identity import Identity
from rlhpc.run.procs import free_port, node_address
from rlhpc.run.rundir import RunDir, read_json, write_json
from rlhpc.run.stop import stop_requested

log = logging.getLogger(__name__)

# The leader renews its record this often; a follower gives a leader up after LEASE_S without a renewal.
RENEW_S = 2.0
LEASE_S = 30.0


def record_path(run: RunDir, worker: int) -> Path:
    return run.rendezvous / f"instance-{worker}.json"


def follower_place(cfg: Config, rank: int) -> tuple[int, int]:
    """(worker, vLLM node rank) of follower `rank`."""
    per = cfg.inference.nodes_per_instance - 1
    return rank // per, rank % per + 1


def followers_of(cfg: Config, worker: int) -> List[int]:
    """The follower ranks of worker `worker`'s instance (the inverse of follower_place)."""
    per = cfg.inference.nodes_per_instance - 1
    return list(range(worker * per, (worker + 1) * per))


# ---- the leader -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Instance:
    """What `leading` yields: the inference config that makes the engine vLLM node rank 0 of its instance, and
    `started`, which the worker calls once its engine is up."""

    inference: InferenceConfig
    started: Callable[[], None] = lambda: None


@contextlib.contextmanager
def leading(cfg: Config, ident: Identity, run: RunDir, model_path: str, seed: int) -> Iterator[Instance]:
    """Around the leader's engine: announces the instance to its followers and yields its Instance; removes the record
    when the worker ends, which ends the followers' executors.

    A watchdog bounds the engine's start: if a follower has not joined within `inference.startup_timeout_s` (vLLM
    would wait for it until torch.distributed's own timeout), it kills the engine's processes, and the start fails
    with an error that names the missing followers and their logs. `Instance.started()` ends the watch: an engine that
    is up has every follower (vLLM's start waits for all its nodes), whether or not their heartbeats are in yet."""
    inf = cfg.inference
    if inf.nodes_per_instance <= 1:
        yield Instance(inf)
        return
    addr = node_address()
    port = free_port("0.0.0.0")
    path = record_path(run, ident.rank)
    record = {"id": uuid.uuid4().hex, "worker": ident.rank, "addr": addr, "port": port,
              "nnodes": inf.nodes_per_instance, "model": model_path, "dtype": cfg.model.dtype, "seed": seed,
              "host": os.uname().nodename, "pid": os.getpid()}
    write_json(path, record)
    log.info("instance of worker %d over %d nodes: leader at %s:%d; waiting for its %d follower(s) to join",
             ident.rank, inf.nodes_per_instance, addr, port, inf.nodes_per_instance - 1)
    done = threading.Event()
    followers = followers_of(cfg, ident.rank)  # still watched; Instance.started() clears it
    late: Dict[str, str] = {}  # why the watchdog ended the engine's start

    def renew() -> None:
        start = time.monotonic()
        while not done.wait(RENEW_S):
            with contextlib.suppress(OSError):
                os.utime(path)
            if followers and time.monotonic() - start > inf.startup_timeout_s:
                missing = [f for f in followers if not _joined(run, f, record["id"])]
                if not missing:
                    followers.clear()  # all joined: nothing more to watch
                    continue
                if "why" not in late:
                    late["why"] = (
                        f"follower(s) {missing} of worker {ident.rank} did not join its instance within "
                        f"inference.startup_timeout_s={inf.startup_timeout_s:.0f}s (see "
                        f"{', '.join(str(run.log_file('follower', f)) for f in missing)}; "
                        f"inference.nodes_per_instance={inf.nodes_per_instance} needs a follower task on each further "
                        f"node)")
                    log.error("%s; ending the engine's start", late["why"])
                # vLLM's engine core, waiting for them; every round until the start has failed, in case the engine
                # had not started its processes yet.
                for child in multiprocessing.active_children():
                    child.kill()

    thread = threading.Thread(target=renew, name="instance-lease", daemon=True)
    thread.start()
    args = dict(inf.engine_args, nnodes=inf.nodes_per_instance, node_rank=0, master_addr=addr, master_port=port,
                distributed_executor_backend="mp")
    try:
        yield Instance(dataclasses.replace(inf, engine_args=args), followers.clear)
    except BaseException as e:
        if "why" in late:
            raise RuntimeError(late["why"]) from e
        raise
    finally:
        done.set()
        thread.join(timeout=RENEW_S + 1)
        if (read_json(path) or {}).get("id") == record["id"]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


# ---- a follower -----------------------------------------------------------------------------------------------------


def run_follower(cfg: Config, ident: Identity, run: RunDir) -> None:
    worker, node_rank = follower_place(cfg, ident.rank)
    path = record_path(run, worker)
    served: Optional[str] = None
    wait_since = time.monotonic()
    while True:
        if why := _ended(run):
            log.info("follower %d (worker %d, node rank %d): %s; exiting", ident.rank, worker, node_rank, why)
            return
        if not (run.model / "READY").exists():  # the leader announces itself after the trainer's warm start
            wait_since = time.monotonic()
        record = read_json(path)
        fresh = record is not None and record.get("id") != served and _renewed_within(path, LEASE_S)
        if not fresh:
            if time.monotonic() - wait_since > cfg.inference.startup_timeout_s:
                log.warning("follower %d: no leader for worker %d announced itself in %s for "
                            "inference.startup_timeout_s=%.0fs; exiting", ident.rank, worker, path,
                            cfg.inference.startup_timeout_s)
                return
            time.sleep(0.5)
            continue
        served = record["id"]
        _serve(cfg, run, ident.rank, record, node_rank, path)
        wait_since = time.monotonic()


def _serve(cfg: Config, run: RunDir, rank: int, record: Dict[str, Any], node_rank: int, path: Path) -> None:
    """Runs vLLM's headless model workers of node `node_rank` for the leader of `record` until that leader is gone."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from rlhpc.infer.engines.vllm import engine_args, vllm_files
    from rlhpc.patches import vllm as patches

    patches.check()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    inf = cfg.inference
    args = engine_args(inf, record["model"], record["dtype"], record["seed"], current_platform.is_cuda_alike())
    args.update(nnodes=record["nnodes"], node_rank=node_rank, master_addr=record["addr"],
                master_port=record["port"], distributed_executor_backend="mp")
    files = vllm_files(str(run.root))
    log.info("joining worker %d's instance as node rank %d of %d (leader %s:%d on %s)", record["worker"], node_rank,
             record["nnodes"], record["addr"], record["port"], record["host"])
    t0 = time.time()
    joined: Dict[str, Any] = {}

    def join() -> None:  # blocks until the leader's model workers and these have met
        try:
            with patches.keep_set_num_threads(), patches.tempdir(files / "tmp"):
                vllm_config = EngineArgs(**args).create_engine_config(headless=True)
                joined["executor"] = MultiprocExecutor(vllm_config, monitor_workers=False)
        except BaseException as e:  # noqa: BLE001 - raised below, or the join was abandoned
            joined["error"] = e

    thread = threading.Thread(target=join, name="instance-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        why = thread.is_alive() and (_ended(run) or _leader_gone(path, record))
        if why:
            # A leader can die while its followers join (a follower restarted after its own death joins the leader
            # that this very death is ending): the model workers would wait for it forever. End them; the join fails.
            log.warning("abandoning the join of worker %d's instance: %s", record["worker"], why)
            for child in multiprocessing.active_children():
                child.kill()
            thread.join(timeout=60)
            if "executor" in joined:
                joined["executor"].shutdown()
            return
    if "error" in joined:
        raise joined["error"]
    executor = joined["executor"]
    log.info("model workers up in %.1fs", time.time() - t0)
    beat = 0.0
    try:
        while True:
            if time.monotonic() - beat > 10:  # `python -m rlhpc.status` lists it beside the roles
                run.heartbeat("follower", rank, worker=record["worker"], node_rank=node_rank, leader=record["host"],
                              instance=record["id"])
                beat = time.monotonic()
            if why := _ended(run) or _leader_gone(path, record):
                log.info("%s; shutting the model workers down", why)
                return
            dead = [w.proc.pid for w in executor.workers if not w.proc.is_alive()]
            if dead:
                raise RuntimeError(f"vLLM model worker process(es) {dead} of node rank {node_rank} died")
            time.sleep(0.5)
    finally:
        executor.shutdown()


def _joined(run: RunDir, rank: int, instance: str) -> bool:
    """Whether follower `rank` has joined the instance `instance`: its model workers are up (its heartbeat says so)."""
    return (read_json(run.status / f"follower-{rank}.json") or {}).get("instance") == instance


def _leader_gone(path: Path, record: Dict[str, Any]) -> str:
    """Why the leader of `record` is gone ("" while it lives)."""
    current = read_json(path)
    if current is None or current.get("id") != record["id"]:
        return f"the leader of worker {record['worker']} ended (its record {'was replaced' if current else 'is gone'})"
    if not _renewed_within(path, LEASE_S):
        return f"the leader of worker {record['worker']} stopped renewing {path} for {LEASE_S:.0f}s (dead?)"
    return ""


# Per record: (the modification time last seen, when it was seen to change; None: not yet).
_seen: Dict[Path, tuple] = {}


def _renewed_within(path: Path, seconds: float) -> bool:
    """Whether `path` was seen renewed (its modification time changed) within the last `seconds` of this process's
    clock. Modification times are compared with one another, never with this node's time (another node's clock wrote
    them), so a record met for the first time counts only once it has been renewed: a dead leader's is never joined."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        _seen.pop(path, None)
        return False
    now = time.monotonic()
    if path not in _seen:
        _seen[path] = (mtime, None)
        return False
    last, since = _seen[path]
    if mtime != last:
        _seen[path] = (mtime, now)
        return True
    return since is not None and now - since <= seconds


def _ended(run: RunDir) -> str:
    if run.done.exists():
        return "the run is done"
    if run.failed.exists():
        return "the run failed"
    if stop_requested():
        return f"asked to stop ({stop_requested()})"
    return ""
