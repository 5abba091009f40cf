"""Trainer checkpoints that resume exactly: torch.distributed.checkpoint (sharded, so a checkpoint written by N ranks
loads on M) for the model and optimizer, plus per-rank RNG state and the trainer's own state (next step, LR schedule,
evaluation curve). `checkpoints/latest.json` points at the newest complete checkpoint; it is written last, atomically,
so a checkpoint interrupted half-way is never resumed from.

    checkpoints/step_00000012/   DCP files (model, optim), rng-<rank>.pt, trainer.json
    checkpoints/latest.json      {"step": 12, "path": "step_00000012"}
"""

from __future__ import annotations

import errno
import logging
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from rlhpc.run.rundir import no_space, read_json, space_problem, write_json

log = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
         trainer_state: Dict[str, Any], keep: int = 2) -> Path:
    """Collective over the trainer world: every rank calls it."""
    path = root / f"step_{step:08d}"
    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    _barrier()
    msd, osd = get_state_dict(model, optimizer)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group" on one rank is expected
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, path / f"rng-{_rank()}.pt")
    except BaseException as e:
        # DCP's writer can report a full disk as a torch.save "unexpected pos" error: asked before the partial folder
        # goes. That folder goes in any case (latest.json still names the previous checkpoint, intact), so that it
        # holds no space the next attempt needs.
        full = None if no_space(e) else space_problem(root)
        shutil.rmtree(path, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, f"the checkpoint of step {step} does not fit: {full}") from e
        raise
    _barrier()
    if _rank() == 0:
        write_json(path / "trainer.json", {**trainer_state, "step": step, "scheduler": scheduler.state_dict()})
        write_json(root / "latest.json", {"step": step, "path": path.name})
        done = sorted(p for p in root.glob("step_*") if p.is_dir() and p != path)
        for old in done[: max(0, len(done) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint of step %d written to %s", step, path)
    _barrier()
    return path


def latest(root: Path) -> Optional[Path]:
    info = read_json(root / "latest.json")
    return root / info["path"] if info else None


def resumable(root: Path) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """(the newest whole checkpoint under `root`, the damaged ones newer than it with what is wrong). The one
    latest.json names comes first; when it is damaged (a truncated copy, a file lost), the older ones kept beside it
    (`keep`) are tried, newest first."""
    first = latest(root)
    if first is None:
        return None, []
    others = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name < first.name), reverse=True)
    damaged = []
    for path in [first, *others]:
        problem = damage(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


def damage(path: Path) -> Optional[str]:
    """What keeps the checkpoint folder `path` from loading, or None: its trainer.json, its DCP metadata, and each
    data file at least as long as the metadata says (the tensors are not read)."""
    if not path.is_dir():
        return "missing"
    try:
        state = read_json(path / "trainer.json")
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return "trainer.json has no step"
    except (OSError, ValueError) as e:
        return f"trainer.json unreadable ({e})"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - whatever the unpickling raises, the metadata is unreadable
        return f".metadata unreadable ({type(e).__name__}: {e})"
    need: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        try:
            have = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if have < size:
            return f"{name} holds {have:,} bytes, its metadata needs {size:,} (a truncated write or copy)"
    return None


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Dict[str, Any]:
    """Loads into the (already wrapped) model and optimizer; returns the trainer state. Works on any number of ranks."""
    msd, osd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": msd}, checkpoint_id=str(path))  # strict: every weight must be in the checkpoint
        # Not strict for the optimizer: a parameter that never got a gradient (GLM-5's DSA indexer, which
        # transformers runs without autograd) has no AdamW state to save; it keeps the empty state made here.
        dcp.load({"optim": osd}, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(strict=False))
    trainer_state = read_json(path / "trainer.json")
    scheduler.load_state_dict(trainer_state.pop("scheduler"))
    rng_file = path / f"rng-{_rank()}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than wrote the checkpoint
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    log.info("resumed from %s (next step %d)", path, trainer_state["step"])
    return trainer_state
