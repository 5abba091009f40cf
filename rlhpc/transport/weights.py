"""Moving new weights from the trainer to the inference workers.

Two transports behind one sender/receiver pair:
- `broadcast`: the weights group, its own process group (NCCL on GPU, gloo on CPU) of trainer rank 0 and every
  inference worker, rendezvousing through a TCPStore at trainer rank 0 whose address and random token are published in
  `rendezvous/weights.json`. A member that does not present the token is refused. Tensors travel in flat buckets of one
  dtype, at most `weights.bucket_mb` each, filled from a stream of (name, tensor) so the sender never holds more than
  two buckets beyond its model (two staging buffers per dtype: one is packed while the other is on the wire).
- `filesystem`: a safetensors snapshot per version under `weights/` plus a READY marker. Snapshots are also how a
  worker starts (version 0) and how a late joiner catches up.

Tensors travel under their Hugging Face checkpoint names.
"""

from __future__ import annotations

import collections
import datetime
import gc
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

from rlhpc.modeling.dtypes import dtype_of
from rlhpc.run.procs import node_address
from rlhpc.run.rundir import RunDir, fsync_path, read_json, wait_for, write_json
from rlhpc.run.stop import Stop, stop_requested

log = logging.getLogger(__name__)

NamedTensors = Iterable[Tuple[str, torch.Tensor]]


@dataclass
class Update:
    version: int
    # None: already loaded into the engine (a receiver in place, weights.receive=in_place).
    tensors: Optional[List[Tuple[str, torch.Tensor]]]


class WeightsSender(ABC):
    @abstractmethod
    def publish(self, version: int, tensors: NamedTensors, layout=None) -> int:
        """Sends weights `version`; returns the bytes sent. `layout` ((name, shape, dtype) of the stream, in order)
        lets a streaming sender fix its buckets without holding the stream."""

    def admit(self) -> List[int]:
        """Between updates (the trainer waiting for rollouts): answers workers asking to join, so that a restarted
        worker need not wait for an update that only its own rollouts would bring. Returns the member ids admitted
        now: they are in the next update's epoch, and hold no current weights until it comes."""
        return []

    def close(self) -> None:
        """After the last version: nothing more will be sent."""

    def leave(self) -> None:
        """This process ends before the run does (asked to stop; a later launch goes on): lets go of the receivers
        connected to it. Unlike `close`, leaves nothing that tells a later launch's receivers the run ended."""


class WeightsReceiver(ABC):
    # A receiver that loads updates into the engine itself (BroadcastReceiver with `load`): the lock the worker holds
    # around every use of its engine, and whether an update broke off part way.
    gate: Optional[threading.Lock] = None
    torn: bool = False

    @abstractmethod
    def poll(self) -> Optional[Update]:
        """The newest update not yet returned, or None. Its tensors are valid until the next call."""

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


def write_snapshot(run: RunDir, version: int, tensors: Optional[NamedTensors], keep: int = 2,
                   write=None) -> Path:
    """Writes `weights/v<version>/model.safetensors` then a READY marker; keeps the newest `keep` snapshots. Snapshots
    of later versions are removed first: they are left from before a resume from an older checkpoint, and the newest
    snapshot must be the current weights (restarted and late workers start from it). `write(folder)`, if given,
    writes folder/model.safetensors instead of `tensors` (the trainer streams it, one tensor at a time)."""
    for stale in run.weights.glob("v*"):
        if stale.name[1:].isdigit() and int(stale.name[1:]) > version:
            shutil.rmtree(stale, ignore_errors=True)
    d = snapshot_dir(run, version)
    tmp = run.weights / f".tmp-v{version:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if write is not None:
        write(tmp)
    else:
        save_file({n: t.detach().contiguous().cpu() for n, t in tensors}, str(tmp / "model.safetensors"))
    with open(tmp / "model.safetensors", "rb") as f:
        os.fsync(f.fileno())
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    write_json(d / "READY", {"version": version, "time": time.time()})
    for old in sorted(p for p in run.weights.glob("v*") if (p / "READY").exists())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    fsync_path(run.weights)
    return d


def latest_snapshot(run: RunDir) -> Optional[int]:
    versions = [int(p.name[1:]) for p in run.weights.glob("v*") if (p / "READY").exists() and p.name[1:].isdigit()]
    return max(versions) if versions else None


def load_snapshot(run: RunDir, version: int) -> List[Tuple[str, torch.Tensor]]:
    return list(load_file(str(snapshot_dir(run, version) / "model.safetensors")).items())


class FilesystemSender(WeightsSender):
    """`stream_writer(folder, layout, tensors)`, if given, writes folder/model.safetensors from a stream of known
    layout one tensor at a time (the trainer's: rlhpc/train/export.py); without it an update is collected first."""

    def __init__(self, run: RunDir, keep: int = 2, stream_writer=None):
        self.run, self.keep, self.stream_writer = run, keep, stream_writer

    def publish(self, version: int, tensors: NamedTensors, layout=None) -> int:
        streamed = layout is not None and self.stream_writer is not None
        write = (lambda folder: self.stream_writer(folder, layout, tensors)) if streamed else None
        d = write_snapshot(self.run, version, tensors, keep=self.keep, write=write)
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
#
# Members come and go. The group lives in epochs: each epoch is one process group of trainer rank 0 (group rank 0) and
# the members listed for it. The trainer speaks to every member through numbered messages in its TCPStore (pub/<n>):
#   {"kind": "call", "epoch": e}     members alive answer ack/<e>/<id>; the trainer lists who answered in members/<e>
#                                    and those form epoch e's group (a member not listed joins again);
#   {"kind": "update", "version": v, "epoch": e}
#                                    the buckets of version v follow in epoch e's group;
#   {"kind": "close"}                nothing more will be sent: each member drops its group and sets bye/<id> (as it
#                                    does when its worker stops), its last store call; the trainer waits for those (at
#                                    most CALL_WAIT_S) before its process ends and takes the store along, so that no
#                                    member meets a closed connection (torch logs one with a C++ stack).
# Each message rings bell/<id>/<n> for every member id known, set with it in one store request: a member blocks on
# its bell (a store wait, no polling) and reads the message the moment it is said.
# A candidate (a new, restarted or attached worker; member id = its rank + 1) announces its id (joiners counter,
# joiner/<i>), then claims join/<id> with "<nonce>:<token>" (compare-and-set: another candidate's claim is never
# overwritten); the trainer reads claims at each update and while it waits for rollouts (admit: a run's only worker,
# restarted, brings no update until it is in), answers verdict/<id>/<nonce> (ok, refused: no token, or
# taken: a second candidate while the first group forms) and start/<id>/<nonce> (the message to read from), and calls
# a new epoch at its next update. A member that dies breaks the epoch: the broadcast fails (gloo reports a closed
# connection at once; a member that stalls costs weights.member_timeout_s), the trainer calls a new epoch of those
# alive and sends the same version again. A member whose group failed reads on and answers the next call.
# A member that loads updates in place (weights.receive=in_place: no second copy of the weights) answers calls with
# "in_place" and, at each update, sets ready/<n>/<id> (n: the update's message) once its engine is between generations;
# the trainer waits for those (at most weights.timeout_s) before it broadcasts.


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
    """Splits the layout into runs of consecutive same-dtype tensors of at most `bucket_bytes`. A tensor of half a
    bucket or more is a bucket of its own, sent from its own memory: packing it would copy it to save one broadcast."""
    buckets: List[List[int]] = []
    size, dtype, alone = 0, None, False
    for i, (_, shape, dt) in enumerate(layout):
        nbytes = _numel(shape) * torch.empty((), dtype=dtype_of(dt)).element_size()
        big = 2 * nbytes >= bucket_bytes
        if not buckets or big or alone or dt != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size, alone = size + nbytes, big
    return buckets


def _numel(shape: List[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# Seconds a member waits on its bell before it looks for the message anyway. Every message rings the bell of every
# member id the trainer knows, and a member reads from a message said after the trainer knew it, so a wait ends with
# a message (or a closed connection: the trainer is gone); the bound only keeps one wait finite. It is long because
# torch logs every store wait that runs out, and a trainer may say nothing for as long as a step, a checkpoint or the
# final evaluation takes.
BELL_WAIT_S = 3600.0

# Seconds a call waits for the answers of the members it expects (those alive answer within milliseconds; the wait
# only runs out when one died, once per failure).
CALL_WAIT_S = 5.0


class BroadcastSender(WeightsSender):
    """Trainer rank 0's end of the weights group (group rank 0)."""

    def __init__(self, run: RunDir, num_receivers: int, bucket_mb: int, timeout_s: float, attempt: str, backend: str = "",
                 host: str = "", member_timeout_s: float = 60.0):
        self.backend = backend or default_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.bucket_bytes = bucket_mb << 20
        self.member_timeout = datetime.timedelta(seconds=member_timeout_s)
        host = os.environ.get("RLHPC_WEIGHTS_HOST") or host or node_address()
        timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(host, 0, num_receivers + 1, True, timeout=timeout, wait_for_workers=False)
        self.token = secrets.token_hex(16)
        self.members: List[int] = []  # member ids of the current epoch, in group-rank order (group rank = index + 1)
        self.in_place: set = set()  # members of the epoch that load in place: each update waits for them to be ready
        self.epoch, self.group, self.broken = -1, None, False
        self.admitted: set = set()  # members admitted between updates (admit), in the next update's epoch
        self.next_msg = 0
        self.watch = set(range(1, num_receivers + 1))  # member ids whose join/<id> claims are read
        self.joiners_seen = 0
        self._buffers: dict = {}  # (slot, dtype) -> staging buffer of the bucketed broadcast
        self.layout: Optional[List[Tuple[str, List[int], str]]] = None
        write_json(
            run.rendezvous / "weights.json",
            {"host": host, "port": self.store.port, "token": self.token, "world_size": num_receivers + 1,
             "attempt": attempt, "backend": self.backend},
        )
        first = self._admit_first(set(self.watch), timeout_s)
        self._call(first)
        missing = sorted(first - set(self.members))
        if missing:
            raise TimeoutError(f"weights group: inference ranks {missing} joined but did not form the group within "
                               f"{CALL_WAIT_S:.0f}s")
        log.info("weights group of %d formed (%s)", len(self.members) + 1, self.backend)

    # -- membership --

    def admit(self) -> List[int]:
        # They read from the next message, the call of the epoch that the next update forms with them.
        admitted = self._read_claims(set(), start=self.next_msg)
        self.admitted.update(admitted)
        return admitted

    def _read_claims(self, forming: set, start: int) -> List[int]:
        """Reads the join claims waiting; answers each; returns the member ids admitted. `forming`: ids already
        admitted while the first group forms (a second candidate for one of them is refused as "taken"); `start`: the
        message an admitted member reads from."""
        count = self.store.add("joiners", 0)
        while self.joiners_seen < count and self.store.check([f"joiner/{self.joiners_seen}"]):
            raw = self.store.get(f"joiner/{self.joiners_seen}").decode("utf-8", "replace")
            if raw.isdigit() and 0 < int(raw) < 1 << 20:
                self.watch.add(int(raw))
            self.joiners_seen += 1
        admitted = []
        for member in sorted(self.watch):
            key = f"join/{member}"
            if not self.store.check([key]):
                continue
            raw = self.store.get(key)
            self.store.delete_key(key)
            nonce, _, presented = raw.decode("utf-8", "replace").partition(":")
            nonce = nonce[:64]
            ok = secrets.compare_digest(presented.encode(), self.token.encode())
            verdict = "taken" if ok and member in forming else "ok" if ok else "refused"
            if verdict == "ok":
                for key in (f"bye/{member}", f"leaving/{member}"):  # left by an earlier life of this member
                    self.store.delete_key(key)
                self.store.set(f"start/{member}/{nonce}", str(start))
                admitted.append(member)
                if member in self.members:  # a restarted worker: its earlier life is gone
                    log.warning("weights group: member %d joins again (restarted); a new epoch forms", member)
            else:
                log.warning("weights group: refused a candidate for rank %d (%s)", member,
                            "rank already taken" if ok else "wrong token")
            self.store.set(f"verdict/{member}/{nonce}", verdict)
        return admitted

    def _admit_first(self, expected: set, timeout_s: float) -> set:
        """Waits for every first member to present the token; refuses (and keeps waiting for) any that does not. A
        client that connects and says nothing, or says garbage, costs nothing here: only claimed keys are read."""
        deadline = time.monotonic() + timeout_s
        admitted: set = set()
        while expected - admitted:
            if stop_requested():  # a Ctrl-C while a worker is down (waiting out its restart back-off, say)
                raise Stop(stop_requested())
            admitted.update(self._read_claims(admitted, start=0))
            if expected - admitted and time.monotonic() > deadline:
                raise TimeoutError(
                    f"weights group: inference ranks {sorted(expected - admitted)} did not join within "
                    f"weights.timeout_s={timeout_s:.0f}s (see logs/inference-*.log)"
                )
            time.sleep(0.01)
        return admitted

    def _say(self, msg: dict) -> int:
        """Message n, with a bell for every member id known (bell/<id>/<n>): a member waits on its bell rather than
        polling, so it starts receiving as soon as the update is said."""
        n = self.next_msg
        bells = [f"bell/{m}/{n}" for m in sorted(self.watch)]
        self.store.multi_set([f"pub/{n}"] + bells, [json.dumps(msg)] + ["1"] * len(bells))
        self.next_msg += 1
        return n

    def _call(self, expected: set) -> None:
        """Forms a new epoch of the members in `expected` that answer (and of candidates admitted meanwhile); members
        that left (their worker ended) are not waited for."""
        self._drop_group()
        expected = {m for m in expected if not self.store.check([f"leaving/{m}"])}
        self.epoch += 1
        e = self.epoch
        n = self._say({"kind": "call", "epoch": e})
        deadline = time.monotonic() + CALL_WAIT_S
        answered: set = set()
        while True:
            expected.update(self._read_claims(set(), start=n))  # admitted now: they read from this call
            answered.update(m for m in expected - answered if self.store.check([f"ack/{e}/{m}"]))
            if answered >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        self.members = sorted(answered)
        self.in_place = {m for m in self.members if self.store.get(f"ack/{e}/{m}") == b"in_place"}
        self.store.set(f"members/{e}", json.dumps(self.members))
        if expected - answered:
            log.warning("weights group: members %s did not answer epoch %d (dead, or still failing an earlier one); "
                        "they join again when they can", sorted(expected - answered), e)
        self.broken = False
        if self.members:
            try:
                self.group = _make_group(dist.PrefixStore(f"rlhpc/{self.token}/e{e}", self.store), 0,
                                         len(self.members) + 1, self.backend, self.member_timeout)
            except Exception as err:  # noqa: BLE001 - a member died after answering: the next update calls again
                log.warning("weights group epoch %d did not form (%s)", e, str(err).splitlines()[0][:200])
                self.broken = True
        log.info("weights group epoch %d: members %s%s", e, self.members,
                 f" ({sorted(self.in_place)} load in place)" if self.in_place else "")

    def _drop_group(self) -> None:
        # Releasing the group closes its connections, so members still waiting in it fail at once and answer the next
        # call (gloo's abort() leaves them waiting out their timeout).
        self.group = None
        gc.collect()

    # -- updates --

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
        joined = set(self._read_claims(set(), start=self.next_msg)) | self.admitted
        self.admitted = set()
        if joined or self.broken:
            self._call(set(self.members) | joined)
        n = self._say({"kind": "update", "version": version, "epoch": self.epoch})
        if self.in_place and self.group is not None and not self.broken:
            self._wait_ready(n, version)
        # Broadcasts run in the background (gloo and NCCL alike): the next bucket is gathered and packed while the two
        # before it are on the wire. A bucket of one tensor goes from that tensor's memory; one of several is packed
        # into one of two staging buffers per dtype, kept across updates (a slot is packed again once its broadcast is
        # done).
        sent, inflight, packed = 0, collections.deque(), collections.Counter()

        def retire() -> None:  # waits for the oldest broadcast in flight
            nonlocal sent
            work, flat, _ = inflight.popleft()
            sent += self._finish(work, flat, version)

        for bucket in self.buckets:
            parts = []
            for i in bucket:
                name, t = next(stream)
                if name != self.layout[i][0]:
                    raise RuntimeError(f"weights stream out of order: got {name}, expected {self.layout[i][0]}")
                parts.append(t.detach().reshape(-1).to(self.device))
            if self.group is None or self.broken:  # nobody to send to: the stream is still taken in full (with FSDP,
                continue                           # every rank's all-gathers go on)
            slot = None
            if len(parts) == 1:
                flat = parts[0].contiguous()
            else:
                slot = (packed[parts[0].dtype] % 2, parts[0].dtype)
                packed[parts[0].dtype] += 1
                while any(s == slot for _, _, s in inflight):
                    retire()
                flat = self._staging(slot, sum(t.numel() for t in parts))
                torch.cat(parts, out=flat)
            del parts
            while len(inflight) >= 2:
                retire()
            if not self.broken:
                inflight.append((self._start(flat), flat, slot))
        while inflight:
            retire()
        return sent

    def _wait_ready(self, n: int, version: int) -> None:
        """Waits until every member that loads in place is between generations (it then receives at once); one that
        is not within weights.timeout_s breaks the epoch: the group is dropped now, so that those ready fail at once
        rather than after weights.member_timeout_s, and the next update calls a new epoch."""
        keys = [f"ready/{n}/{m}" for m in sorted(self.in_place)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))  # returns as the last one is set
        except dist.DistStoreError:
            late = [m for m, k in zip(sorted(self.in_place), keys) if not self.store.check([k])]
            self._failed(TimeoutError(f"members {late} (weights.receive=in_place) were not ready within "
                                      f"weights.timeout_s={self.timeout_s:.0f}s"), version)
            self._drop_group()

    def _staging(self, slot: Tuple[int, torch.dtype], numel: int) -> torch.Tensor:
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[slot] = torch.empty(numel, dtype=slot[1], device=self.device)
        return buf[:numel]

    def _start(self, flat: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            return self.group.broadcast([flat], opts)
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return None

    def _finish(self, work, flat: torch.Tensor, version: int) -> int:
        """Waits for a broadcast started by `_start`; its bytes, or 0 if the epoch broke."""
        if work is None:
            return 0
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - a member died or stalled: the next update goes to those alive
            self._failed(e, version)
            return 0
        return flat.numel() * flat.element_size()

    def _failed(self, e: BaseException, version: int = -1) -> None:
        if not self.broken:
            # A member whose worker ended (a stop, the end of its work) says so before its connections close: the send
            # that fails on them is no fault.
            left = [m for m in self.members if self.store.check([f"leaving/{m}"])]
            if left:
                log.info("weights group epoch %d: members %s left while version %d was sent (their workers ended); "
                         "the next update goes to the others", self.epoch, left, version)
            else:
                log.warning("weights group epoch %d failed sending version %d (%s); the next update forms a new one",
                            self.epoch, version, str(e).splitlines()[0][:200])
        self.broken = True

    def close(self) -> None:
        """Says that nothing more will be sent, then waits until the members have left (bye/<id>), at most CALL_WAIT_S:
        those alive leave within milliseconds, and this process may end (taking the store along) once they have."""
        try:
            self._say({"kind": "close"})
        except Exception as e:  # noqa: BLE001 - receivers already gone: nothing to tell them
            log.warning("weights group: shutdown message not delivered: %s", e)
        self._drop_group()
        members = sorted(set(self.members) | self.admitted)
        deadline = time.monotonic() + CALL_WAIT_S
        # Polled: a store wait that runs out is logged by torch, and it runs out whenever a member died meanwhile.
        while not self.store.check([f"bye/{m}" for m in members]) and time.monotonic() < deadline:
            time.sleep(0.005)
        stayed = [m for m in members if not self.store.check([f"bye/{m}"])]
        if stayed:
            log.warning("weights group: members %s did not leave within %.0fs of the close (dead?); closing anyway",
                        stayed, CALL_WAIT_S)

    def leave(self) -> None:
        self.close()  # the group ends with this process either way: a later launch forms its own


class BroadcastReceiver(WeightsReceiver):
    """An inference worker's end of the weights group. A background thread follows the trainer's messages and receives
    every update as it is broadcast (so the trainer never waits for a generation to finish); `poll` hands the newest
    one to the worker's loop. `attempt`: the launch whose rendezvous to join (None: whichever is current, for workers
    attached to a running run).

    `load` (weights.receive=in_place): instead of keeping a received copy of the weights for `poll`, each bucket is
    loaded into the engine as it lands, through `load(named_tensors)` (part of the model each call), into two
    bucket-sized buffers: the worker holds no second copy of the model. The engine must then not be in use meanwhile:
    the worker's loop holds `gate` while it generates or evaluates, and an update waits for it (the trainer waits for
    every such member to be ready). `poll` then hands out Update(version, None). An update that fails part way leaves
    the engine's weights torn (`torn`): the worker must not generate until the next complete update."""

    def __init__(self, run: RunDir, rank: int, timeout_s: float, attempt: Optional[str], token: Optional[str] = None,
                 abort=None, member_timeout_s: float = 60.0, load=None):
        path = run.rendezvous / "weights.json"

        def current():
            info = read_json(path)
            return info if info and (attempt is None or info.get("attempt") == attempt) else None

        info = wait_for(current, timeout_s, f"the weights group rendezvous ({path})", poll_s=0.2, abort=abort)
        self.backend = info["backend"]
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.member, self.timeout_s = rank, timeout_s
        self.member_timeout = datetime.timedelta(seconds=member_timeout_s)
        self.load = load
        self.gate = threading.Lock() if load is not None else None
        self.torn = False
        self.store = dist.TCPStore(info["host"], info["port"], info["world_size"], False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        # A second connection, for `close` to ring this member's bell while the thread waits on the first.
        self._waker = self.store.clone()
        self.token = info["token"] if token is None else token
        self.announced = False
        self.cursor = self._join()
        self.group, self.group_epoch = None, -1
        self.layout = self.buckets = None
        self._lock = threading.Lock()
        self._latest: Optional[Update] = None
        # The receive buffers (one flat tensor per bucket) behind the update waiting for `poll` and behind the one
        # `poll` last returned, and a free set kept for the next update.
        self._pending = self._lent = None
        self._free: list = []
        self._closed = False
        self._arrived = threading.Event()  # set while an update (or the end) waits for `poll`
        self.error: Optional[BaseException] = None
        self._stopping = False
        # Held while this member says bye, and by `close` while it rings the bell: once bye is said the trainer may end
        # and take the store along, so no call to the store follows it.
        self._leaving = threading.Lock()
        self._left = False
        self._thread = threading.Thread(target=self._run, name="weights-receiver", daemon=True)
        self._thread.start()

    def _join(self) -> int:
        """Presents the token for this member id; returns the number of the first message to read."""
        if not self.announced:  # the trainer reads the claims of the ids announced to it
            i = self.store.add("joiners", 1) - 1
            self.store.set(f"joiner/{i}", str(self.member))
            self.announced = True
        nonce = secrets.token_hex(8)
        claim, deadline = f"{nonce}:{self.token}", time.monotonic() + self.timeout_s
        key = f"join/{self.member}"
        while self.store.compare_set(key, "", claim).decode("utf-8", "replace") != claim:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights group: {key} stayed claimed by another candidate for "
                                   f"weights.timeout_s={self.timeout_s:.0f}s")
            time.sleep(0.05)
        verdict_key = f"verdict/{self.member}/{nonce}"
        self.store.wait([verdict_key], datetime.timedelta(seconds=self.timeout_s))
        verdict = self.store.get(verdict_key).decode()
        if verdict == "taken":
            raise PermissionError(f"weights group refused this worker: rank {self.member} already has its member (two "
                                  f"workers with the same rank?)")
        if verdict != "ok":
            raise PermissionError("weights group refused this worker: wrong token (stale rendezvous/weights.json?)")
        return int(self.store.get(f"start/{self.member}/{nonce}"))

    def _next_message(self) -> Optional[dict]:
        """The next message of the trainer (waits on this member's bell for it); None once stopping."""
        key, bell = f"pub/{self.cursor}", f"bell/{self.member}/{self.cursor}"
        while not self.store.check([key]):
            if self._stopping:
                return None
            try:
                self.store.wait([bell], datetime.timedelta(seconds=BELL_WAIT_S))
            except dist.DistStoreError:  # the safety net ran out: look for the message again
                pass
        self.cursor += 1
        msg = json.loads(self.store.get(key))
        self.store.delete_key(bell)  # the store keeps no bell per message and member for the whole run
        return msg

    def _run(self) -> None:
        try:
            while True:
                msg = self._next_message()
                if msg is None or msg["kind"] == "close":
                    break
                if msg["kind"] == "call":
                    self._answer(msg["epoch"])
                elif self.group is not None and msg["epoch"] == self.group_epoch:
                    if self.load is not None:
                        self._receive_in_place(msg["version"], self.cursor - 1)
                    else:
                        self._receive(msg["version"])
                elif msg["epoch"] != self.group_epoch or self.group is None:
                    # An update of an epoch this member is not in (it missed the call): join the next one.
                    self.cursor = self._join()
            self._leave()
        except BaseException as e:  # noqa: BLE001 - reported to the worker loop through `error`
            self.error = e
        finally:
            self._closed = True
            self._arrived.set()

    def _leave(self) -> None:
        """Drops the group and tells the trainer that this member is done with its store (the close, or `close`). The
        trainer learns first that it leaves: a send failing on its closed connections is then no fault, and the next
        call does not wait for it."""
        try:
            self.store.set(f"leaving/{self.member}", "1")
        finally:  # the store gone too (the trainer died): the group is dropped all the same
            self._drop_group()
        with self._leaving:
            self.store.set(f"bye/{self.member}", "1")
            self._left = True

    def _answer(self, epoch: int) -> None:
        """Answers a call; forms epoch `epoch`'s group if listed, else joins again."""
        self._drop_group()
        self.store.set(f"ack/{epoch}/{self.member}", "1" if self.load is None else "in_place")
        self.store.wait([f"members/{epoch}"], datetime.timedelta(seconds=self.timeout_s))
        members = json.loads(self.store.get(f"members/{epoch}"))
        if self.member not in members:
            self.cursor = self._join()
            return
        try:
            self.group = _make_group(dist.PrefixStore(f"rlhpc/{self.token}/e{epoch}", self.store),
                                     members.index(self.member) + 1, len(members) + 1, self.backend,
                                     self.member_timeout)
        except Exception as e:  # noqa: BLE001 - another member died meanwhile: the trainer calls again
            log.warning("weights group epoch %d did not form (%s); waiting for the next", epoch,
                        str(e).splitlines()[0][:200])
            return
        self.group_epoch = epoch

    def _drop_group(self) -> None:
        self.group, self.group_epoch = None, -1  # closes its connections (see BroadcastSender._drop_group)
        gc.collect()

    def _receive(self, version: int) -> None:
        self._fix_layout()
        layout = self.layout
        with self._lock:
            flats = self._free.pop() if self._free else None
        if flats is None:
            flats = [torch.empty(sum(_numel(layout[i][1]) for i in bucket), dtype=dtype_of(layout[bucket[0]][2]),
                                 device=self.device) for bucket in self.buckets]
        tensors: List[Tuple[str, torch.Tensor]] = []
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            # Every bucket's receive is posted at once, so the next one lands while this one is waited for.
            posted = [self.group.broadcast([flat], opts) for flat in flats]
            for work, flat, bucket in zip(posted, flats, self.buckets):
                work.wait()
                for (name, shape, _), part in zip((layout[i] for i in bucket),
                                                  flat.split([_numel(layout[i][1]) for i in bucket])):
                    tensors.append((name, part.view(shape)))
        except Exception as e:  # noqa: BLE001 - the epoch broke (a member died): answer the next call
            log.warning("weights group epoch %d failed receiving version %d (%s); waiting for the next epoch",
                        self.group_epoch, version, str(e).splitlines()[0][:200])
            self._drop_group()
            self._release(flats)
            return
        with self._lock:
            if self._pending is not None:  # replaced before the worker took it
                self._release(self._pending)
            self._latest, self._pending = Update(version, tensors), flats
            self._arrived.set()

    def _receive_in_place(self, version: int, n: int) -> None:
        """Loads update `version` (message `n`) into the engine bucket by bucket, once the engine is free: bucket k+1
        lands in one buffer while bucket k is loaded from the other."""
        self._fix_layout()
        layout, buckets = self.layout, self.buckets
        if not self._free:  # two buffers per dtype, as large as that dtype's largest bucket, kept across updates
            sizes: dict = {}
            for bucket in buckets:
                dt = layout[bucket[0]][2]
                sizes[dt] = max(sizes.get(dt, 0), sum(_numel(layout[i][1]) for i in bucket))
            self._free.append({dt: [torch.empty(n_, dtype=dtype_of(dt), device=self.device) for _ in range(2)]
                               for dt, n_ in sizes.items()})
        buffers = self._free[0]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0

        def post(k):
            bucket = buckets[k]
            flat = buffers[layout[bucket[0]][2]][k % 2][:sum(_numel(layout[i][1]) for i in bucket)]
            return self.group.broadcast([flat], opts), flat

        with self.gate:
            self.store.set(f"ready/{n}/{self.member}", "1")
            posted: list = []
            try:
                posted += [post(k) for k in range(min(2, len(buckets)))]
                for k, bucket in enumerate(buckets):
                    work, flat = posted[k]
                    work.wait()
                    sizes = [_numel(layout[i][1]) for i in bucket]
                    self.torn = True  # from the first bucket loaded until the last
                    self.load([(layout[i][0], part.view(layout[i][1])) for i, part in zip(bucket, flat.split(sizes))])
                    if k + 2 < len(buckets):
                        posted.append(post(k + 2))
            except Exception as e:  # noqa: BLE001 - the epoch broke (a member died): answer the next call
                log.warning("weights group epoch %d failed receiving version %d in place (%s); the engine's weights "
                            "are torn until the next update", self.group_epoch, version, str(e).splitlines()[0][:200])
                del posted
                self._drop_group()
                return
            self.torn = False
        with self._lock:
            self._latest = Update(version, None)
            self._arrived.set()

    def _fix_layout(self) -> None:
        if self.layout is None:  # fixed by the first update
            info = json.loads(self.store.get("layout"))
            self.layout = [(n, s, d) for n, s, d in info["tensors"]]
            self.buckets = _bucketize(self.layout, info["bucket_bytes"])

    def _release(self, flats) -> None:
        """Keeps one set of buffers for the next update (the pages stay mapped: no page faults on the next receive);
        further sets are let go."""
        if not self._free:
            self._free.append(flats)

    def poll(self) -> Optional[Update]:
        """The newest update; its tensors are valid until the next call (their buffers are then reused: apply them,
        e.g. `engine.update_weights`, which copies, before polling again)."""
        if self.error is not None:
            raise RuntimeError(f"weights group failed: {self.error}") from self.error
        with self._lock:
            if self._lent is not None:
                self._release(self._lent)
                self._lent = None
            update, self._latest = self._latest, None
            if update is not None:
                self._lent, self._pending = self._pending, None
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
        self._stopping = True
        with self._leaving:
            if self._thread.is_alive() and not self._left:
                try:  # the thread waits on this bell, or stops first
                    self._waker.set(f"bell/{self.member}/{self.cursor}", "stop")
                except Exception:  # noqa: BLE001 - the trainer's store is gone: the thread already stopped on that
                    pass
        self._thread.join(timeout=5.0)  # it leaves at once (its collection takes up to a second in a large process);
        # one blocked on a store that stopped answering is not waited for
