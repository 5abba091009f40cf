"""Tensor dtypes by name: config values ("bfloat16") and wire names of the weights stream ("torch.bfloat16")."""

from __future__ import annotations

import torch

DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "int32")}


def dtype_of(name: str) -> torch.dtype:
    """The dtype called `name`, with or without the `torch.` prefix; a ValueError lists the known ones."""
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})") from None
