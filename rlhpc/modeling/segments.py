"""Packed rows' segments: each position of a row is the shared prompt (PREFIX), the j-th sample of the row (j >= 0)
or PADDING, and a query attends to what its segment allows. The trainer packs rows by them (rlhpc/train/batching.py)
and both its attention and GLM-5's indexer (rlhpc/modeling/sparse.py) build their masks from them."""

from __future__ import annotations

import torch

PREFIX, PADDING = -1, -2


def segment_mask(segments: torch.Tensor, lo: int, hi: int, keys: int) -> torch.Tensor:
    """Which of the first `keys` positions the queries at positions [lo, hi) attend to, from the rows' segments
    [R, W]: bool [R, 1, hi - lo, keys]. A query attends causally to its own segment and to the prefix (a padding
    position to earlier padding and the prefix, and always to itself, so no query is left without keys)."""
    q = torch.arange(lo, hi, device=segments.device)
    causal = q.unsqueeze(1) >= torch.arange(keys, device=segments.device).unsqueeze(0)
    sq, sk = segments[:, lo:hi].unsqueeze(2), segments[:, :keys].unsqueeze(1)
    return (causal & ((sq == sk) | (sk == PREFIX))).unsqueeze(1)
