"""Tensor dtypes by name: config values ("bfloat16"), wire names of the weights stream ("torch.bfloat16"), and the
names of the safetensors format ("BF16"), with the header that format starts with."""

from __future__ import annotations

import json
from typing import Any, Dict

import torch

DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "int32")}


def dtype_of(name: str) -> torch.dtype:
    """The dtype called `name`, with or without the `torch.` prefix; a ValueError lists the known ones."""
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})") from None


# The dtypes of the safetensors format that torch has, by their names there.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_header(header: Dict[str, Any]) -> bytes:
    """The start of a safetensors file: the header's length (8 bytes, little-endian), then the header as JSON padded
    with spaces to a multiple of 8 bytes, so that every tensor after it starts aligned."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
