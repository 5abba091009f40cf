"""Moving new weights from the trainer to the inference workers.

Two transports behind one sender/receiver pair:
- `broadcast`: the weights group, its own process group (NCCL on GPU, gloo on CPU) of trainer rank 0 and every
  inference worker, rendezvousing through a TCPStore at trainer rank 0 whose address and random token are published in
  `rendezvous/weights.json`. A member that does not present the token is refused. Tensors travel in flat buckets of one
  dtype, at most `weights.bucket_mb` each, filled from a stream of (name, tensor) so the sender never holds more than a
  bucket beyond its model.
- `filesystem`: a safetensors snapshot per version under `weights/` plus a READY marker. Snapshots are also how a
  worker starts (version 0) and how a late joiner catches up.

Tensors travel under their Hugging Face checkpoint names.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import shutil
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from rlhpc.dtypes import dtype_of
from rlhpc.procs import node_address
from rlhpc.rundir import RunDir, fsync_dir, read_json, wait_for, write_json

log = logging.getLogger(__name__)

NamedTensors = Iterable[Tuple[str, torch.Tensor]]


@dataclass
class Update:
    version: int
    tensors: List[Tuple[str, torch.Tensor]]


class WeightsSender(ABC):
    @abstractmethod
    def publish(self, version: int, tensors: NamedTensors, layout=None) -> int:
        """Sends weights `version`; returns the bytes sent. `layout` ((name, shape, dtype) of the stream, in order)
        lets a streaming sender fix its buckets without holding the stream."""

    def close(self) -> None:
        pass


class WeightsReceiver(ABC):
    @abstractmethod
    def poll(self) -> Optional[Update]:
        """The newest update not yet returned, or None."""

    def closed(self) -> bool:
        """True once the sender said it will send nothing more."""
        return False

    def wait(self, timeout_s: float) -> float:
        """Waits up to `timeout_s`, less if this receiver knows an update arrived; returns the seconds waited."""
        time.sleep(timeout_s)
        return timeout_s

    def close(self) -> None:
        pass


# ---- filesystem snapshots ----------------------------------------------------------------------------------------


def snapshot_dir(run: RunDir, version: int) -> Path:
    return run.weights / f"v{version:08d}"


def write_snapshot(run: RunDir, version: int, tensors: NamedTensors, keep: int = 2) -> Path:
    """Writes `weights/v<version>/model.safetensors` then a READY marker; keeps the newest `keep` snapshots. Snapshots
    of later versions are removed first: they are left from before a resume from an older checkpoint, and the newest
    snapshot must be the current weights (restarted and late workers start from it)."""
    for stale in run.weights.glob("v*"):
        if stale.name[1:].isdigit() and int(stale.name[1:]) > version:
            shutil.rmtree(stale, ignore_errors=True)
    d = snapshot_dir(run, version)
    tmp = run.weights / f".tmp-v{version:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors}, str(tmp / "model.safetensors"))
    with open(tmp / "model.safetensors", "rb") as f:
        os.fsync(f.fileno())
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    write_json(d / "READY", {"version": version, "time": time.time()})
    for old in sorted(p for p in run.weights.glob("v*") if (p / "READY").exists())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(run.weights)
    return d


def latest_snapshot(run: RunDir) -> Optional[int]:
    versions = [int(p.name[1:]) for p in run.weights.glob("v*") if (p / "READY").exists() and p.name[1:].isdigit()]
    return max(versions) if versions else None


def load_snapshot(run: RunDir, version: int) -> List[Tuple[str, torch.Tensor]]:
    return list(load_file(str(snapshot_dir(run, version) / "model.safetensors")).items())


class FilesystemSender(WeightsSender):
    def __init__(self, run: RunDir, keep: int = 2):
        self.run, self.keep = run, keep

    def publish(self, version: int, tensors: NamedTensors, layout=None) -> int:
        d = write_snapshot(self.run, version, tensors, keep=self.keep)
        return (d / "model.safetensors").stat().st_size

    def close(self) -> None:
        write_json(self.run.weights / "CLOSED", {"time": time.time()})


class FilesystemReceiver(WeightsReceiver):
    def __init__(self, run: RunDir, version: int):
        self.run, self.version = run, version

    def poll(self) -> Optional[Update]:
        v = latest_snapshot(self.run)
        if v is None or v <= self.version:
            return None
        try:
            tensors = load_snapshot(self.run, v)
        except FileNotFoundError:  # replaced by a newer one while reading; the next poll takes that
            return None
        self.version = v
        return Update(v, tensors)

    def closed(self) -> bool:
        return (self.run.weights / "CLOSED").exists()


# ---- the weights group --------------------------------------------------------------------------------------------


def _make_group(store: dist.Store, rank: int, size: int, backend: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":  # GPU only: the CPU build of torch has no ProcessGroupNCCL
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"unknown weights backend {backend!r}")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _bucketize(layout: List[Tuple[str, List[int], str]], bucket_bytes: int) -> List[List[int]]:
    """Splits the layout into runs of consecutive same-dtype tensors of at most `bucket_bytes` (one tensor may exceed)."""
    buckets: List[List[int]] = []
    size, dtype = 0, None
    for i, (_, shape, dt) in enumerate(layout):
        nbytes = _numel(shape) * torch.empty((), dtype=dtype_of(dt)).element_size()
        if not buckets or dt != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _numel(shape: List[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class BroadcastSender(WeightsSender):
    """Trainer rank 0's end of the weights group (group rank 0)."""

    def __init__(self, run: RunDir, num_receivers: int, bucket_mb: int, timeout_s: float, attempt: str, backend: str = "",
                 host: str = ""):
        self.backend = backend or default_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.bucket_bytes = bucket_mb << 20
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.size = num_receivers + 1
        host = os.environ.get("RLHPC_WEIGHTS_HOST") or host or node_address()
        self.store = dist.TCPStore(host, 0, self.size, True, timeout=self.timeout, wait_for_workers=False)
        self.token = secrets.token_hex(16)
        write_json(
            run.rendezvous / "weights.json",
            {"host": host, "port": self.store.port, "token": self.token, "world_size": self.size, "attempt": attempt,
             "backend": self.backend},
        )
        self._admit(timeout_s)
        self.group = _make_group(dist.PrefixStore(f"rlhpc/{self.token}", self.store), 0, self.size, self.backend, self.timeout)
        self.layout: Optional[List[Tuple[str, List[int], str]]] = None
        log.info("weights group of %d formed (%s)", self.size, self.backend)

    def _admit(self, timeout_s: float) -> None:
        """Waits for every receiver to present the token; refuses (and keeps waiting for) any that does not.

        A candidate for group rank r claims the key join/<r> (compare-and-set: the first claim holds until read, so
        nobody overwrites another's) with "<nonce>:<token>"; this reads it, frees the key and answers at
        verdict/<r>/<nonce>: ok, refused (wrong token, or bytes that are no token) or taken (r has its member). A
        client that connects and says nothing, or says garbage, costs nothing here: only claimed keys are read."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.size))
        keys = [f"join/{rank}" for rank in range(1, self.size)]
        while waiting:
            for rank, key in enumerate(keys, start=1):
                if not self.store.check([key]):
                    continue
                raw = self.store.get(key)
                self.store.delete_key(key)
                nonce, _, presented = raw.decode("utf-8", "replace").partition(":")
                ok = secrets.compare_digest(presented.encode(), self.token.encode())
                verdict = "taken" if ok and rank not in waiting else "ok" if ok else "refused"
                self.store.set(f"verdict/{rank}/{nonce[:64]}", verdict)
                if verdict == "ok":
                    waiting.discard(rank)
                else:
                    log.warning("weights group: refused a candidate for rank %d (%s)", rank,
                                "rank already taken" if ok else "wrong token")
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"weights group: inference ranks {sorted(waiting)} did not join within weights.timeout_s="
                    f"{timeout_s:.0f}s (see logs/inference-*.log)"
                )
            time.sleep(0.01)

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def publish(self, version: int, tensors: NamedTensors, layout=None) -> int:
        stream = iter(tensors)
        if self.layout is None:  # the first update fixes the layout; later ones stream in the same order
            if layout is None:  # without metadata, learn it from the stream (holds one full copy, once)
                first = list(stream)
                layout = [(n, t.shape, t.dtype) for n, t in first]
                stream = iter(first)
            self.layout = [(n, list(shape), str(dtype)) for n, shape, dtype in layout]
            self.store.set("layout", json.dumps({"tensors": self.layout, "bucket_bytes": self.bucket_bytes}))
            self.buckets = _bucketize(self.layout, self.bucket_bytes)
        self._broadcast(torch.tensor([version, 1], dtype=torch.int64, device=self.device))
        sent = 0
        for bucket in self.buckets:
            parts = []
            for i in bucket:
                name, t = next(stream)
                if name != self.layout[i][0]:
                    raise RuntimeError(f"weights stream out of order: got {name}, expected {self.layout[i][0]}")
                parts.append(t.detach().reshape(-1).to(self.device))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
            del parts, flat
        return sent

    def close(self) -> None:
        try:
            self._broadcast(torch.tensor([-1, 0], dtype=torch.int64, device=self.device))
        except Exception as e:  # receivers already gone: nothing to tell them
            log.warning("weights group: shutdown message not delivered: %s", e)


class BroadcastReceiver(WeightsReceiver):
    """An inference worker's end of the weights group. A background thread receives every update as it is broadcast
    (so the trainer never waits for a generation to finish); `poll` hands the newest one to the worker's loop."""

    def __init__(self, run: RunDir, rank: int, timeout_s: float, attempt: str, token: Optional[str] = None,
                 abort=None):
        path = run.rendezvous / "weights.json"

        def current():
            info = read_json(path)
            return info if info and info.get("attempt") == attempt else None

        info = wait_for(current, timeout_s, f"the weights group rendezvous ({path})", poll_s=0.2, abort=abort)
        self.backend = info["backend"]
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(info["host"], info["port"], info["world_size"], False, timeout=timeout)
        token = info["token"] if token is None else token
        # Claim join/<rank> (compare-and-set: another candidate's claim is never overwritten; wait for it to be read).
        nonce = secrets.token_hex(8)
        claim, deadline = f"{nonce}:{token}", time.monotonic() + timeout_s
        while self.store.compare_set(f"join/{rank}", "", claim).decode("utf-8", "replace") != claim:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights group: join/{rank} stayed claimed by another candidate for "
                                   f"weights.timeout_s={timeout_s:.0f}s")
            time.sleep(0.05)
        verdict_key = f"verdict/{rank}/{nonce}"
        self.store.wait([verdict_key], timeout)
        verdict = self.store.get(verdict_key).decode()
        if verdict == "taken":
            raise PermissionError(f"weights group refused this worker: rank {rank} already has its member (two workers "
                                  f"with the same rank?)")
        if verdict != "ok":
            raise PermissionError("weights group refused this worker: wrong token (stale rendezvous/weights.json?)")
        self.group = _make_group(dist.PrefixStore(f"rlhpc/{token}", self.store), rank, info["world_size"], self.backend, timeout)
        self._lock = threading.Lock()
        self._latest: Optional[Update] = None
        self._closed = False
        self._arrived = threading.Event()  # set while an update (or the end) waits for `poll`
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="weights-receiver", daemon=True)
        self._thread.start()

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def _run(self) -> None:
        try:
            layout = None
            while True:
                header = torch.zeros(2, dtype=torch.int64, device=self.device)
                self._broadcast(header)
                version, kind = header.tolist()
                if kind == 0:
                    break
                if layout is None:  # fixed by the first update
                    info = json.loads(self.store.get("layout"))
                    layout = [(n, s, d) for n, s, d in info["tensors"]]
                    buckets = _bucketize(layout, info["bucket_bytes"])
                tensors: List[Tuple[str, torch.Tensor]] = []
                for bucket in buckets:
                    dtype = dtype_of(layout[bucket[0]][2])
                    flat = torch.empty(sum(_numel(layout[i][1]) for i in bucket), dtype=dtype, device=self.device)
                    self._broadcast(flat)
                    for (name, shape, _), part in zip(
                        (layout[i] for i in bucket), flat.split([_numel(layout[i][1]) for i in bucket])
                    ):
                        tensors.append((name, part.view(shape)))
                with self._lock:
                    self._latest = Update(version, tensors)
                    self._arrived.set()
        except BaseException as e:  # noqa: BLE001 - reported to the worker loop through `error`
            self.error = e
        finally:
            self._closed = True
            self._arrived.set()

    def poll(self) -> Optional[Update]:
        if self.error is not None:
            raise RuntimeError(f"weights group failed: {self.error}") from self.error
        with self._lock:
            update, self._latest = self._latest, None
            if not self._closed:
                self._arrived.clear()
        return update

    def wait(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        self._arrived.wait(timeout_s)
        return time.monotonic() - t0

    def closed(self) -> bool:
        return self._closed and self._latest is None

    def close(self) -> None:
        self._thread.join(timeout=1.0)
