"""The Hugging Face export of the trainer's weights, written from the weights stream: one full tensor at a time.

`save_pretrained` needs a whole model in memory; with FSDP2 no rank has one. The stream (`Trainer.full_state`) already
yields what `save_pretrained` would write, under checkpoint names, each tensor all-gathered and cast to the serving
dtype when its turn comes. Its layout (names, shapes, dtypes: rlhpc/modeling/names.py `checkpoint_layout`) is known from
metadata before the first tensor arrives, so the safetensors header is written first and each tensor goes to its
offset as it comes; files are split at `max_file_bytes` with the usual `model.safetensors.index.json`.

The safetensors format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}
padded with spaces to a multiple of 8 bytes, then the tensors' bytes, row-major, little-endian.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

from rlhpc.modeling.dtypes import SAFETENSORS_NAMES, safetensors_header


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def plan_files(layout: Sequence[Tuple[str, Sequence[int], torch.dtype]], max_file_bytes: int) -> List[List[int]]:
    """Consecutive runs of the layout, each at most `max_file_bytes` (a larger tensor gets a file of its own)."""
    files: List[List[int]] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(layout):
        nbytes = _nbytes(shape, dtype)
        if not files or (size + nbytes > max_file_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    return files


def write_safetensors_stream(out_dir: Path, layout: Sequence[Tuple[str, Sequence[int], torch.dtype]],
                             stream: Iterable[Tuple[str, torch.Tensor]], max_file_bytes: int = 5 << 30) -> List[Path]:
    """Writes the tensors of `stream` (in `layout`'s order, each of its shape and dtype) as safetensors under `out_dir`,
    holding one tensor at a time. Returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = plan_files(layout, max_file_bytes)
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    where: Dict[int, Tuple[int, int]] = {}  # layout index -> (file, absolute byte offset)
    handles, weight_map = [], {}
    try:
        for f, (fname, idx) in enumerate(zip(names, groups)):
            header: Dict[str, Dict] = {"__metadata__": {"format": "pt"}}
            offset, starts = 0, []
            for i in idx:
                name, shape, dtype = layout[i]
                nbytes = _nbytes(shape, dtype)
                header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": [int(s) for s in shape],
                                "data_offsets": [offset, offset + nbytes]}
                starts.append(offset)
                offset += nbytes
                weight_map[name] = fname
            raw = safetensors_header(header)
            h = open(out_dir / (fname + ".tmp"), "wb")
            handles.append(h)
            h.write(raw)
            for i, start in zip(idx, starts):
                where[i] = (f, len(raw) + start)
        count = 0
        for i, (name, t) in enumerate(stream):
            want, shape, dtype = layout[i]
            if name != want or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"export stream out of step with its layout: got {name} {tuple(t.shape)} {t.dtype}, "
                                   f"expected {want} {tuple(shape)} {dtype}")
            f, at = where[i]
            data = t.detach().to("cpu").contiguous().reshape(-1)
            handles[f].seek(at)
            handles[f].write(memoryview(data.view(torch.uint8).numpy()))  # no copy of the tensor's bytes
            count += 1
        if count != len(layout):
            raise RuntimeError(f"export stream ended after {count} of {len(layout)} tensors")
    finally:
        for h in handles:
            h.close()
    paths = []
    for fname in names:
        os.replace(out_dir / (fname + ".tmp"), out_dir / fname)
        paths.append(out_dir / fname)
    if n > 1:
        total = sum(_nbytes(s, d) for _, s, d in layout)
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def write_hf_folder(out_dir: Path, model: torch.nn.Module, dtype: torch.dtype,
                    layout: Sequence[Tuple[str, Sequence[int], torch.dtype]],
                    stream: Iterable[Tuple[str, torch.Tensor]], tokenizer=None, max_file_bytes: int = 5 << 30) -> None:
    """A Hugging Face folder (config saying `dtype`, generation config, safetensors, tokenizer) from the stream."""
    import copy

    out_dir = Path(out_dir)
    write_safetensors_stream(out_dir, layout, stream, max_file_bytes)
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
