"""Weights out of the trainer: the stream of full tensors under Hugging Face checkpoint names, published to the
inference workers as each new version (with a snapshot on disk every `weights.snapshot_interval` versions) and
exported as a Hugging Face folder. With FSDP2 every rank takes part in the stream's all-gathers; rank 0 sends."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

from rlhpc.config import Config
from rlhpc.dtypes import dtype_of
from rlhpc.identity import Identity
from rlhpc.names import CheckpointNames, checkpoint_layout, state_tensors
from rlhpc.rundir import RunDir
from rlhpc.train.export import write_hf_folder, write_safetensors_stream
from rlhpc.transport.weights import BroadcastSender, FilesystemSender, WeightsSender, write_snapshot


def serving_dtype(cfg: Config) -> torch.dtype:
    """What inference loads and receives (model.dtype), whatever the trainer's master dtype."""
    return dtype_of(cfg.model.dtype)


def full_state(model: torch.nn.Module, serving: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor): what save_pretrained would write, under its Hugging Face checkpoint names
    (fused MoE experts split into per-expert views, rlhpc/names.py), one state tensor at a time, floating-point
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


class Publisher:
    """Sends each new weights version to the inference workers; the sender lives on rank 0 only."""

    def __init__(self, cfg: Config, ident: Identity, run: RunDir):
        self.cfg, self.ident, self.run = cfg, ident, run
        self.is_main, self.world = ident.rank == 0, ident.size
        self.sender: Optional[WeightsSender] = None

    def start(self) -> None:
        """Rank 0, before the first version it publishes."""
        self.sender = self.make_sender()

    def make_sender(self) -> WeightsSender:
        w = self.cfg.weights
        if w.transport == "filesystem":
            return FilesystemSender(self.run)
        # Trainer rank 0's address as the launcher resolved it (under Slurm: the first node of the trainer group).
        return BroadcastSender(self.run, self.cfg.inference.num_workers, w.bucket_mb, w.timeout_s, self.ident.attempt,
                               host=self.ident.master_addr, member_timeout_s=w.member_timeout_s)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Collective with FSDP: every rank takes part in the stream; rank 0 sends it (and snapshots it when due)."""
        serving = serving_dtype(self.cfg)
        if self.cfg.weights.transport == "broadcast" and version == self.cfg.trainer.steps:
            self.final_snapshot(model, version, serving)
        stream = full_state(model, serving)
        if not self.is_main:
            for _ in stream:  # take part in the all-gathers
                pass
            return
        snap = self.cfg.weights.snapshot_interval
        if snap and version % snap == 0 and self.cfg.weights.transport == "broadcast":
            stream = list(stream)
            write_snapshot(self.run, version, stream)
        self.sender.publish(version, stream, layout=checkpoint_layout(model, serving))

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
                       write=lambda folder: write_safetensors_stream(folder, layout, stream, max_file_bytes=1 << 62))

    def close(self) -> None:
        self.sender.close()
