"""The trainer's model, sharded from the start: no rank ever holds the full state.

    build_sharded(path, trainer_cfg, device)
        1. the model is constructed on the meta device (shapes only, no memory) in `trainer.master_dtype`;
        2. FSDP2 shards it (rlhpc/train/parallel.py) while it is still on meta, so each parameter becomes a DTensor
           whose local shard is a 1/N row range of the full tensor;
        3. `to_empty` allocates only those local shards on the device;
        4. non-persistent buffers (rotary `inv_freq`), which no checkpoint holds, are computed again from the config;
        5. each rank reads from the Hugging Face safetensors only the rows it owns, tensor by tensor
           (`load_shards`), and copies them into its shards, cast to the master dtype.

Resuming skips step 5: the DCP checkpoint fills the same shards (rlhpc/train/checkpoint.py), also without a full copy.

Checkpoint names map to in-memory tensors through rlhpc/modeling/names.py, so MoE checkpoints, which hold one tensor per
expert, fill the fused in-memory experts: a rank owning experts [a, b) of a layer reads those experts' tensors only.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from rlhpc.config.schema import TrainerConfig
from rlhpc.modeling.names import CheckpointNames, state_tensors

log = logging.getLogger(__name__)

# A file's read handle is reopened after this many bytes, so the pages of the memory-mapped file that a rank has
# touched stop counting against its memory.
_REOPEN_BYTES = 64 << 20


def build_sharded(path: str | Path, cfg: TrainerConfig, device: torch.device, load_weights: bool = True,
                  dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """The model of the Hugging Face folder `path`, FSDP2-sharded over the current world, its parameters in `dtype`
    (default: `trainer.master_dtype`); with `load_weights=False` the parameters are left uninitialized for a DCP
    checkpoint to fill. Collective: every rank of the trainer world calls it."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from rlhpc.train.parallel import apply_fsdp, master_dtype

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} holds no Hugging Face checkpoint (no config.json); check `model.path`")
    hf_config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype or master_dtype(cfg))
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.generation_config.pad_token_id = model.config.pad_token_id
    apply_fsdp(model, cfg, device)
    model.to_empty(device=device)
    init_non_persistent_buffers(model)
    if load_weights:
        load_shards(model, path)
    return model


def init_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Buffers that are not in the state dict (rotary `inv_freq`) are computed from the config at construction; on the
    meta device they were not. transformers' own `_init_weights` recomputes them (it does so in `from_pretrained`);
    run it on the modules that own such buffers, before any parameter is loaded."""
    owners = [m for m in model.modules() if getattr(m, "_non_persistent_buffers_set", None)]
    for module in owners:
        model._init_weights(module)
    for module in owners:
        for name in module._non_persistent_buffers_set:
            buf = getattr(module, name, None)
            if buf is not None and buf.is_floating_point() and not torch.isfinite(buf).all():
                raise RuntimeError(f"{type(module).__name__}.{name}: transformers' _init_weights left this "
                                   "non-persistent buffer uninitialized; rlhpc cannot build this model sharded")


@dataclass(frozen=True)
class RowRange:
    """The rows [start, stop) of a full tensor that this rank's shard holds (FSDP2 shards dim 0 like torch.chunk)."""

    start: int
    stop: int


def owned_rows(tensor: torch.Tensor) -> Tuple[torch.Tensor, RowRange]:
    """(local tensor to write into, the rows of the full tensor it holds)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return tensor, RowRange(0, tensor.shape[0] if tensor.dim() else 0)
    if tensor.device_mesh.ndim != 1:
        raise NotImplementedError(f"a {tensor.device_mesh.ndim}-d device mesh: rlhpc loads FSDP2 (1-d) shards only")
    place = tensor.placements[0]
    local = tensor.to_local()
    if isinstance(place, Replicate):
        return local, RowRange(0, tensor.shape[0] if tensor.dim() else 0)
    if not (isinstance(place, Shard) and place.dim == 0):
        raise NotImplementedError(f"placement {place}: rlhpc loads dim-0 shards (FSDP2) only")
    rows, world = tensor.shape[0], tensor.device_mesh.size()
    per = -(-rows // world)
    start = min(tensor.device_mesh.get_local_rank() * per, rows)
    stop = min(start + per, rows)
    if local.shape[0] != stop - start:
        raise RuntimeError(f"shard of {stop - start} rows expected, FSDP2 holds {local.shape[0]}")
    return local, RowRange(start, stop)


class _Files:
    """Read handles on a checkpoint's safetensors files, reopened after `_REOPEN_BYTES` each."""

    def __init__(self):
        self.handles: Dict[Path, object] = {}
        self.read: Dict[Path, int] = {}

    def get(self, file: Path):
        from safetensors import safe_open

        if file not in self.handles or self.read[file] > _REOPEN_BYTES:
            self.close(file)
            self.handles[file] = safe_open(str(file), framework="pt", device="cpu")
            self.read[file] = 0
        return self.handles[file]

    def count(self, file: Path, t: torch.Tensor) -> None:
        self.read[file] += t.numel() * t.element_size()

    def close(self, file: Optional[Path] = None) -> None:
        for f in [file] if file is not None else list(self.handles):
            h = self.handles.pop(f, None)
            if h is not None:
                h.__exit__(None, None, None)


def checkpoint_files(path: Path) -> Dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors(.index.json); the trainer loads safetensors "
                                "checkpoints only (convert it with save_pretrained); check `model.path`")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_shards(model: torch.nn.Module, path: str | Path) -> None:
    """Copies each rank's rows of every parameter and persistent buffer from the safetensors of `path`, reading only
    those rows, one checkpoint tensor at a time. Every tensor the model saves must be found, and every checkpoint
    tensor must land somewhere (a different model fails here, naming the tensor)."""
    path = Path(path)
    names = CheckpointNames.of(model)
    files = checkpoint_files(path)
    by_target: Dict[str, List[Tuple[str, object]]] = {}
    for ck_name in files:
        slot = names.from_checkpoint(ck_name)
        by_target.setdefault(slot.name, []).append((ck_name, slot))
    handles = _Files()
    try:
        for name, tensor in state_tensors(model):
            sources = by_target.pop(name, None)
            if not sources:
                raise KeyError(f"{path}: the checkpoint has no tensor for {name!r} (is it the model of `model.path`?)")
            local, rows = owned_rows(tensor)
            for ck_name, slot in sources:
                f = handles.get(files[ck_name])
                if slot.expert is None:  # a whole tensor: read this rank's rows
                    sl = f.get_slice(ck_name)
                    shape = tuple(sl.get_shape())
                    if shape != tuple(tensor.shape):
                        raise ValueError(f"{ck_name}: shape {shape} in {path}, the model's is {tuple(tensor.shape)}")
                    src = sl[rows.start:rows.stop] if local.dim() else f.get_tensor(ck_name)
                    local.copy_(src)
                elif rows.start <= slot.expert < rows.stop:  # one expert of a fused tensor, owned here
                    src = f.get_tensor(ck_name)
                    dest = type(slot)(slot.name, slot.expert - rows.start, slot.half).view(local)
                    if dest.shape != src.shape:
                        raise ValueError(f"{ck_name}: shape {tuple(src.shape)} in {path}, the model's slice is "
                                         f"{tuple(dest.shape)}")
                    dest.copy_(src)
                else:
                    continue
                handles.count(files[ck_name], src)
                del src
    finally:
        handles.close()
    known = set(model.state_dict(keep_vars=True))  # a tied weight's second name (lm_head.weight) may be saved too
    unused = [ck for target, srcs in by_target.items() if target not in known for ck, _ in srcs]
    if unused:
        raise KeyError(f"{path}: checkpoint tensors the model does not have: {', '.join(sorted(unused)[:5])}"
                       f"{' ...' if len(unused) > 5 else ''}")
