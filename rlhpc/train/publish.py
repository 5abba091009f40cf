"""Weights out of the trainer: the stream of full tensors under Hugging Face checkpoint names, published to the
inference workers as each new version (with a snapshot on disk every `weights.snapshot_interval` versions) and
exported as a Hugging Face folder. With FSDP2 every rank takes part in the stream's all-gathers; rank 0 sends."""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

from rlhpc.config.schema import Config
from rlhpc.modeling.dtypes import dtype_of
from rlhpc.modeling.names import CheckpointNames, checkpoint_layout, state_tensors
from rlhpc.run.identity import Identity
from rlhpc.run.rundir import RunDir, read_json, write_json
from rlhpc.train.export import write_hf_folder, write_safetensors_stream
from rlhpc.transport.weights import BroadcastSender, FilesystemSender, WeightsSender, write_snapshot

log = logging.getLogger(__name__)


def serving_dtype(cfg: Config) -> torch.dtype:
    """What inference loads and receives (model.dtype), whatever the trainer's master dtype."""
    return dtype_of(cfg.model.dtype)


def full_state(model: torch.nn.Module, serving: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor): what save_pretrained would write, under its Hugging Face checkpoint names
    (fused MoE experts split into per-expert views, rlhpc/modeling/names.py), one state tensor at a time, floating-point
    tensors cast from the master copy to the serving dtype. With FSDP2 each parameter is cast as a shard, then
    all-gathered on demand: every rank must iterate the stream."""
    names = CheckpointNames.of(model)
    for name, t in state_tensors(model):
        if t.is_floating_point() and t.dtype != serving:
            t = t.to(serving)
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield from names.to_checkpoint(name, t)


def export(path, model: torch.nn.Module, tokenizer, cfg: Config, is_main: bool) -> None:
    """Hugging Face folder (safetensors, config, tokenizer) of the current weights in the serving dtype, written by
    rank 0 from the weights stream, one full tensor at a time (rlhpc/train/export.py). Collective with FSDP."""
    serving = serving_dtype(cfg)
    stream = full_state(model, serving)
    if not is_main:
        for _ in stream:  # take part in the all-gathers
            pass
        return
    write_hf_folder(Path(path), model, serving, checkpoint_layout(model, serving), stream, tokenizer)


def snapshot_file(folder: Path, layout, stream: Iterator[Tuple[str, torch.Tensor]]) -> None:
    """folder/model.safetensors from the weights stream, one tensor at a time (one file, whatever its size)."""
    write_safetensors_stream(folder, layout, stream, max_file_bytes=1 << 62)


class SnapshotTap:
    """Writes a snapshot of the weights stream while something else consumes it: each tensor is handed to a writer
    thread as it passes (at most `depth` tensors wait for it), so the snapshot costs no full copy of the weights."""

    _END = object()

    def __init__(self, run: RunDir, version: int, layout, depth: int = 2, timeout_s: float = 600.0):
        self.run, self.version, self.layout, self.timeout_s = run, version, layout, timeout_s
        self.tensors: "queue.Queue" = queue.Queue(maxsize=depth)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._write, name="snapshot-writer", daemon=True)

    def __enter__(self) -> "SnapshotTap":
        self.thread.start()
        return self

    def tee(self, stream: Iterator[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        for item in stream:
            self._put(item)
            yield item

    def _put(self, item, check: bool = True) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if check and self.error is not None:
                raise RuntimeError(f"weights snapshot v{self.version} failed: {self.error}") from self.error
            try:
                self.tensors.put(item, timeout=0.5)
                return
            except queue.Full:
                if time.monotonic() > deadline or not self.thread.is_alive():
                    raise RuntimeError(f"weights snapshot v{self.version}: its writer took no tensor for "
                                       f"{self.timeout_s:.0f}s") from None

    def _write(self) -> None:
        def stream():
            while True:
                item = self.tensors.get()
                if item is SnapshotTap._END:
                    return
                yield item

        try:
            write_snapshot(self.run, self.version, None,
                           write=lambda folder: snapshot_file(folder, self.layout, stream()))
        except BaseException as e:  # noqa: BLE001 - raised in the publishing thread
            self.error = e
            while self.tensors.get() is not SnapshotTap._END:  # let the stream finish
                pass

    def __exit__(self, kind, value, tb) -> None:
        self._put(SnapshotTap._END, check=False)  # a writer that failed drains until this
        self.thread.join(timeout=self.timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"weights snapshot v{self.version}: not written within {self.timeout_s:.0f}s")
        if self.error is not None and kind is None:
            raise RuntimeError(f"weights snapshot v{self.version} failed: {self.error}") from self.error


class Publisher:
    """Sends each new weights version to the inference workers; the sender lives on rank 0 only."""

    def __init__(self, cfg: Config, ident: Identity, run: RunDir):
        self.cfg, self.ident, self.run = cfg, ident, run
        self.is_main, self.world = ident.rank == 0, ident.size
        self.sender: Optional[WeightsSender] = None
        self.version: Optional[int] = None  # the newest version published (None: the workers' run_dir/model, v0)
        self.resends = 0  # versions sent again to workers that joined after them (see `admit`)
        # Rank 0 announces each resend here; with FSDP the other ranks join its collective stream at their next look.
        self.resend_file = run.rendezvous / f"resend-{ident.attempt}.json"

    def start(self) -> None:
        """Rank 0, before the first version it publishes."""
        self.sender = self.make_sender()

    def make_sender(self) -> WeightsSender:
        w = self.cfg.weights
        if w.transport == "filesystem":  # each version written as it streams, one tensor at a time
            return FilesystemSender(self.run, stream_writer=snapshot_file)
        # Trainer rank 0's address as the launcher resolved it (under Slurm: the first node of the trainer group).
        return BroadcastSender(self.run, self.cfg.inference.num_workers, w.bucket_mb, w.timeout_s, self.ident.attempt,
                               host=self.ident.master_addr, member_timeout_s=w.member_timeout_s)

    def admit(self, model: torch.nn.Module) -> None:
        """Every rank, between two looks at the queue while it waits for rollouts. Rank 0 lets restarted or attached
        workers join the weights group (WeightsSender.admit) and sends the newest version again at once to those that
        joined: a run whose only worker restarted would otherwise wait for ever, its worker for weights newer than it
        has, the trainer for that worker's rollouts. With FSDP the stream is collective: rank 0 announces the resend in
        run_dir/rendezvous first, and the other ranks join it at their next look (they wait for the same claim)."""
        if self.is_main:
            if self.sender is None or not self.sender.admit() or self.version is None:
                return
            self.resends += 1
            if self.world > 1:
                write_json(self.resend_file, {"resend": self.resends, "version": self.version}, durable=False)
            log.info("weights: version %d sent again, to the worker(s) that joined since", self.version)
            self.publish(model, self.version, resend=True)
            return
        if self.cfg.weights.transport == "broadcast":  # (a rank other than 0: there are several)
            said = read_json(self.resend_file)
            if said and said["resend"] > self.resends:
                self.resends = said["resend"]
                self.publish(model, said["version"], resend=True)

    def publish(self, model: torch.nn.Module, version: int, resend: bool = False) -> None:
        """Collective with FSDP: every rank takes part in the stream; rank 0 sends it (and snapshots it when due).
        `resend`: a version published before, sent again (no snapshot)."""
        serving = serving_dtype(self.cfg)
        self.version = version
        broadcast = self.cfg.weights.transport == "broadcast"
        if broadcast and version == self.cfg.trainer.steps and not resend:
            self.final_snapshot(model, version, serving)
        stream = full_state(model, serving)
        if not self.is_main:
            for _ in stream:  # take part in the all-gathers
                pass
            return
        layout = checkpoint_layout(model, serving)
        snap = self.cfg.weights.snapshot_interval
        if snap and version % snap == 0 and broadcast and not resend:
            with SnapshotTap(self.run, version, layout) as tap:  # written as the stream goes out: no full copy
                self.sender.publish(version, tap.tee(stream), layout=layout)
            return
        self.sender.publish(version, stream, layout=layout)

    def final_snapshot(self, model: torch.nn.Module, version: int, serving: torch.dtype) -> None:
        """The last version on disk too, written before it is broadcast: no update follows it, so a worker that joins
        later (a restarted worker 0 owing the final evaluation) takes it from there (rlhpc/infer/worker.py). Streamed
        one tensor at a time, like the export; collective with FSDP."""
        stream = full_state(model, serving)
        if not self.is_main:
            for _ in stream:
                pass
            return
        layout = checkpoint_layout(model, serving)
        write_snapshot(self.run, version, None,
                       write=lambda folder: snapshot_file(folder, layout, stream))

    def close(self) -> None:
        """Rank 0, after the last version."""
        self.sender.close()

    def leave(self) -> None:
        """Rank 0 stopping before the last step: the workers let go of it before this process ends
        (WeightsSender.leave)."""
        self.sender.leave()
