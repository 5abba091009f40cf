"""Attention over packed rows from their segments, without a [W, W] mask per layer (config
`trainer.attention_block_elements`), and the head exchange of context parallelism (rlhpc/train/context.py).

A packed row says who attends to whom by each position's segment (rlhpc/train/batching.py `Packed`): O(W) numbers,
where the equivalent boolean mask is W x W and the attention kernel turns it into a float copy of W x W that autograd
keeps for every layer (2 GiB a layer for a 32768-token row in bf16). A model the trainer installs here runs
`ATTENTION`: transformers hands it the segments (as a [R, 1, 1, W] long "mask") and it builds the mask itself:
- R rows of W positions with R x W x W <= attention_block_elements: the whole mask at once, then sdpa (as before);
- wider rows: queries in blocks of attention_block_elements / (R x W), each against the keys up to its last position
  (the causal half only), its mask built from the segments for that block alone. The backward recomputes each block's
  attention instead of keeping it, so what stays per layer is q, k, v and the output: linear in W. The price is one
  more attention forward per layer in the backward.

Under context parallelism a split row's segments are the whole row's (W = cp x the positions this rank holds): the
layer exchanges its queries, keys and values with the group first (all-to-all head sharding), attends over the whole
row with heads / cp heads, and exchanges the output back. Any other mask (generation, evaluation, a 2-D padding mask)
goes to transformers' sdpa attention unchanged.

GLM-5's sparse attention (DSA) takes the segments too: its indexer chooses each query's keys from the whole row
(rlhpc/modeling/sparse.py) and hands the choice, [B, S, index_topk] of this rank's queries, to the attention as
`indices`; each block's mask is the segments' mask and the choice together, as transformers' sdpa path builds it
whole. A split row's attention first gathers the choice of all W queries from the group. Any other mask gets the
choice applied as transformers' sdpa path does.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rlhpc.modeling import sparse
from rlhpc.train.batching import ATTENTION, NO_CUSTOM_MASK, segment_mask
from rlhpc.train.context import ContextGroup, HeadsToSeq, SeqToHeads, context_group, gather_positions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Installed:
    block_elements: int  # trainer.attention_block_elements
    group: Optional[ContextGroup]  # the context group of a context-parallel model; None at cp=1


_INSTALLED: Optional[Installed] = None  # one trainer model per process


def install(model: torch.nn.Module, cp: int, block_elements: int) -> bool:
    """Makes `model` take packed rows by their segments (and, with cp > 1, split over a context group: collective
    the first time). GLM-5's indexer breaks its ties by order and scores its queries in blocks
    (rlhpc/modeling/sparse.py).
    Returns False, leaving its attention as it is, when that is not sdpa (eager attention takes the whole mask) at
    cp=1; raises naming trainer.cp when cp > 1 and the model cannot (its heads do not divide by cp, DeepSeek-V3.2's
    sparse attention, attention other than sdpa)."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", "?")
    impl = getattr(cfg, "_attn_implementation", "sdpa")
    global _INSTALLED
    if cp > 1:
        _check_context_parallel(cfg, cp)
    group = context_group(cp) if cp > 1 else None
    # GLM-5: its indexer's ties broken by order, its queries in blocks, and split rows' keys gathered from the group
    sparse.install(model, block_elements, group)
    if model_type in NO_CUSTOM_MASK or impl not in ("sdpa", ATTENTION):
        return False
    if impl == ATTENTION and _INSTALLED == Installed(block_elements, group):
        return True  # the step installs its models before each step: once is enough
    register()
    cfg._attn_implementation = ATTENTION  # transformers' setter passes it on to sub-configs
    _INSTALLED = Installed(block_elements, group)
    if group is not None:
        heads = cfg.num_attention_heads
        log.info("context parallelism: each packed row split over %d ranks (this one holds part %d), attention over "
                 "the whole row with %d of the %d heads", cp, group.rank, heads // cp, heads)
    return True


def _check_context_parallel(cfg, cp: int) -> None:
    model_type = getattr(cfg, "model_type", "?")
    impl = getattr(cfg, "_attn_implementation", "sdpa")
    if model_type in NO_CUSTOM_MASK:
        raise ValueError(f"trainer.cp={cp}: {model_type}'s sparse attention takes no packed rows, which context "
                         "parallelism splits (set trainer.cp=1)")
    if impl not in ("sdpa", ATTENTION):
        raise ValueError(f"trainer.cp={cp}: {model_type} runs attention {impl!r}; context parallelism runs sdpa "
                         "attention over packed rows")
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if not heads or heads % cp:
        raise ValueError(f"trainer.cp={cp} must divide the model's {heads} attention heads (num_attention_heads): "
                         "each of the cp ranks attends with heads / cp of them")
    if heads % math.lcm(kv_heads, cp):
        raise ValueError(f"trainer.cp={cp}: the model's {kv_heads} key/value heads cannot be repeated to a multiple "
                         f"of cp that divides its {heads} attention heads")


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # 2-D masks (generation, evaluation) become sdpa's masks


def is_segments(mask) -> bool:
    """Whether an attention "mask" is packed rows' segments [R, 1, 1, W] (long), not a mask."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[2] == 1 and not mask.is_floating_point() \
        and mask.dtype != torch.bool


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              indices=None, **kwargs):
    """transformers' attention signature: query [B, H, S, D], key/value [B, Hkv, S, D] of this rank's S positions ->
    output [B, S, H, D]. `indices` [B, S, k]: the keys each query may attend to, chosen by GLM-5's indexer (None for
    dense attention)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not is_segments(attention_mask):
        if indices is not None:  # as transformers' sdpa path applies GLM-5's choice
            attention_mask = _choose(attention_mask, indices, key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout and module.training:
        raise ValueError("packed rows' attention recomputes its blocks in the backward and takes no attention dropout "
                         "(set the model's attention_dropout to 0)")
    segments = attention_mask[:, 0, 0]  # [B, W]
    installed = _INSTALLED  # segments reach only a model `install` set up
    group = installed.group
    W, S = segments.shape[1], query.shape[2]
    split = group is not None and W == S * group.cp
    if not split and W != S:
        raise ValueError(f"attention got {S} positions for packed rows of {W}")
    if split:
        repeat = math.lcm(key.shape[1], group.cp) // key.shape[1]  # key/value heads repeated until cp divides them
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        query, key, value = (SeqToHeads.apply(t, group) for t in (query, key, value))
        if indices is not None:  # the choice of every query of the row: this rank now attends from all of them
            indices = gather_positions(indices, group)
    out = segment_attention(query, key, value, segments, scaling, installed.block_elements,
                            indices).transpose(1, 2)
    return (HeadsToSeq.apply(out, group) if split else out.contiguous()), None


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
                      scale: Optional[float], block_elements: int, topk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, W, D], k, v [B, Hkv, W, D] (H a multiple of Hkv) of packed rows with `segments` [B, W] -> attention
    output [B, H, W, D]. With `topk` [B, W, k] each query attends only to the keys chosen for it (GLM-5's DSA)."""
    B, W = q.shape[0], q.shape[2]
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: each key/value head serves `groups` query heads
    block = max(1, block_elements // (B * W))  # a block's mask: [B, block, W] at most
    if block >= W:
        k, v = _repeat(k, groups), _repeat(v, groups)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(segments, topk, 0, W, W), scale=scale)
    return _BlockAttention.apply(q, k, v, segments, topk, scale, block, groups)


def _mask(segments: torch.Tensor, topk: Optional[torch.Tensor], lo: int, hi: int, keys: int) -> torch.Tensor:
    """The mask of the queries at [lo, hi) over the first `keys` positions: their segments', and their chosen keys'."""
    mask = segment_mask(segments, lo, hi, keys)
    # The choice may name keys past `keys` (masked ones, when a query has fewer than index_topk): a row's width.
    return mask if topk is None else mask & sparse.chosen(topk[:, lo:hi], topk.shape[1])[..., :keys]


def _choose(mask: Optional[torch.Tensor], indices: torch.Tensor, keys: int) -> torch.Tensor:
    """A 4-D mask (bool or additive) [B, 1, S, keys] narrowed to the keys `indices` [B, S, k] chose."""
    if mask is None:
        raise ValueError("GLM-5's sparse attention needs the causal mask that its model makes (got none)")
    chosen = sparse.chosen(indices, keys)
    if mask.dtype == torch.bool:
        return mask & chosen
    return mask.masked_fill(~chosen, torch.finfo(mask.dtype).min)


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


class _BlockAttention(torch.autograd.Function):
    """Attention of `block` queries at a time against the keys up to the block's last position. Saves q, k, v (the
    key/value heads unrepeated) and recomputes each block in the backward: no mask or attention weights are kept."""

    @staticmethod
    def forward(ctx, q, k, v, segments, topk, scale, block, groups):
        dev = q.device.type
        ctx.autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        W = q.shape[2]
        kr, vr = _repeat(k, groups), _repeat(v, groups)  # this layer's only, while it runs
        out = None  # made from the first block's output: its dtype is what autocast gave sdpa
        for lo in range(0, W, block):
            hi = min(lo + block, W)
            o = F.scaled_dot_product_attention(q[:, :, lo:hi], kr[:, :, :hi], vr[:, :, :hi],
                                               attn_mask=_mask(segments, topk, lo, hi, hi), scale=scale)
            if out is None:
                out = o.new_empty(*q.shape[:3], o.shape[-1])
            out[:, :, lo:hi] = o
        ctx.save_for_backward(q, k, v, segments, topk)
        ctx.scale, ctx.block, ctx.groups = scale, block, groups
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, segments, topk = ctx.saved_tensors
        W, block, groups = q.shape[2], ctx.block, ctx.groups
        kr, vr = _repeat(k, groups), _repeat(v, groups)
        dq = torch.empty_like(q)
        acc = torch.promote_types(k.dtype, torch.float32)  # the blocks' key/value gradients add up in float32 at least
        dk, dv = torch.zeros_like(kr, dtype=acc), torch.zeros_like(vr, dtype=acc)
        dev = q.device.type
        for lo in range(0, W, block):
            hi = min(lo + block, W)
            qb, kb, vb = (t.detach().requires_grad_() for t in (q[:, :, lo:hi], kr[:, :, :hi], vr[:, :, :hi]))
            with torch.enable_grad(), torch.autocast(dev, dtype=ctx.autocast or torch.bfloat16,
                                                     enabled=ctx.autocast is not None):
                o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=_mask(segments, topk, lo, hi, hi),
                                                   scale=ctx.scale)
            gq, gk, gv = torch.autograd.grad(o, (qb, kb, vb), grad[:, :, lo:hi])
            dq[:, :, lo:hi] = gq
            dk[:, :, :hi] += gk
            dv[:, :, :hi] += gv
        if groups > 1:  # a key/value head's gradient sums over the query heads it serves
            dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
            dv = dv.unflatten(1, (v.shape[1], groups)).sum(2)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
