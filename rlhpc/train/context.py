"""Context parallelism (config `trainer.cp`): each packed micro-batch is split along the sequence over `cp` ranks, so a
rank holds W / cp of every row's tokens, activations and output-head work.

How attention sees the whole row: all-to-all head sharding (DeepSpeed-Ulysses). In each attention layer the `cp`
ranks exchange their queries, keys and values so that each gets every position of H / cp heads, attends over the full
row from its segments (rlhpc/train/attention.py: samples never attend across their boundaries, exactly as on one
rank, and no [W, W] mask is kept), and exchanges the output back to its own positions. Everything else in a block
(norms, MLP, experts, rotary embeddings with the row's position ids) works per token and runs on the local positions
unchanged. Chosen over ring attention because it reuses the packed rows' attention as it is and is exact by
construction; its limit: the attention heads must divide by cp (key/value heads that do not are repeated until they
do).

Layout over a world of N = dp x cp ranks: the cp ranks of one context group are consecutive (rank = d * cp + c) and
train the same samples; the step splits its batch over the dp groups. Parameters stay FSDP2-sharded over all N ranks
(the cp ranks of a group hold different shards, like any other ranks) and expert parallelism composes unchanged: its
all-to-all moves tokens, wherever in a row they sit.

The loss: every rank of a group gathers the logprobs (and entropies) of all the micro-batch's targets from the group,
so sequence-level terms (GSPO's ratio, per-sequence normalization) see whole samples, and each rank computes the same
loss; the gather's backward keeps only this rank's own targets' gradients, so the group's ranks together contribute
each target's gradient once. Statistics are counted on the group's first rank only.

The segments say which rows are split: segments of cp times the positions a layer got (a step's micro-batch, also when
activation checkpointing recomputes its blocks in the backward) exchange heads; anything else (idle passes, the SFT
warm start, evaluation) is plain sdpa attention on whatever tokens the rank has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from rlhpc.train.batching import PADDING, Packed

@dataclass(frozen=True)
class ContextGroup:
    """This rank's place among the cp ranks that share its samples."""

    cp: int
    rank: int  # position within the group: this rank holds positions [rank W/cp, (rank+1) W/cp) of each row
    group: Optional[dist.ProcessGroup]

    @property
    def first(self) -> bool:
        return self.rank == 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`gather_positions` of `x` over this group."""
        return gather_positions(x, self)


_GROUPS: Dict[Tuple[int, int], ContextGroup] = {}

def context_group(cp: int) -> ContextGroup:
    """This rank's group of `cp` consecutive ranks. Collective the first time (every rank creates every group, in
    the same order); later calls return the same group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (world, cp)
    if key not in _GROUPS:
        if world % cp:
            raise ValueError(f"trainer.cp={cp} must divide the {world} trainer ranks")
        mine = None
        for d in range(world // cp):
            g = dist.new_group(list(range(d * cp, (d + 1) * cp)))
            if rank // cp == d:
                mine = g
        _GROUPS[key] = ContextGroup(cp=cp, rank=rank % cp, group=mine)
    return _GROUPS[key]


def _exchange(x: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """x [cp, ...]: part j goes to rank j of the group; returns [cp, ...] with part j from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group.group)
    return out


def _seq_to_heads(x: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    B, H, S, D = x.shape
    cp = group.cp
    parts = x.reshape(B, cp, H // cp, S, D).transpose(0, 1)  # [cp (head block), B, H/cp, S, D]
    got = _exchange(parts, group)  # [cp (source rank = position block), B, H/cp, S, D]
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * S, D)


def _heads_to_seq_bwd(g: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """The inverse of _seq_to_heads: [B, H/cp, W, D] -> [B, H, W/cp, D]."""
    B, h, W, D = g.shape
    cp = group.cp
    parts = g.reshape(B, h, cp, W // cp, D).permute(2, 0, 1, 3, 4)  # [cp (position block), B, h, S, D]
    got = _exchange(parts, group)  # [cp (head block), B, h, S, D]
    return got.transpose(0, 1).reshape(B, h * cp, W // cp, D)


def gather_positions(x: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """x [B, S, ...] of this rank's positions -> [B, cp x S, ...] of the whole row, from every rank of the group (no
    gradient: GLM-5's indexer keys and its choice of keys, rlhpc/modeling/sparse.py)."""
    x = x.contiguous()
    got = x.new_empty(group.cp * x.shape[0], *x.shape[1:])  # the ranks' parts one after the other (gloo's layout)
    dist.all_gather_into_tensor(got, x, group=group.group)
    return got.unflatten(0, (group.cp, x.shape[0])).transpose(0, 1).flatten(1, 2)


class SeqToHeads(torch.autograd.Function):
    """[B, H, S, D] of this rank's positions -> [B, H/cp, W, D] of this rank's heads; backward the inverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq_bwd(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Attention output [B, W, H/cp, D] of this rank's heads -> [B, S, H, D] of its positions; backward the inverse."""

    @staticmethod
    def forward(ctx, out, group):
        ctx.group = group
        return _heads_to_seq_bwd(out.transpose(1, 2), group).transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.transpose(1, 2), ctx.group).transpose(1, 2), None


# ---- a packed micro-batch split over the group ------------------------------------------------------------------


def pad_to_multiple(packed, multiple: int, pad_id: int):
    """`packed` widened with padding to a multiple of `multiple` positions (padding segments: no sample attends to
    them); predictors are re-indexed to the new width."""
    R, W = packed.input_ids.shape
    width = -(-W // multiple) * multiple
    if width == W:
        return packed
    extra = width - W
    ids = torch.nn.functional.pad(packed.input_ids, (0, extra), value=pad_id)
    pos = torch.nn.functional.pad(packed.position_ids, (0, extra), value=0)
    segments = torch.nn.functional.pad(packed.segments, (0, extra), value=PADDING)
    predictors = packed.predictors // W * width + packed.predictors % W
    routing = packed.routing
    if routing is not None:  # padding goes to expert 0, as pack's
        routing = torch.cat([routing, routing.new_zeros((R, extra) + tuple(routing.shape[2:]))], dim=1)
    return Packed(ids, pos, segments, predictors, packed.targets, routing)


@dataclass
class Split:
    """A packed micro-batch as one rank of a context group sees it: its positions of each row (`local`, a Packed of
    width W / cp whose predictors index the local positions and whose segments are the whole row's), and which of the
    micro-batch's N targets it predicts (`mine`, indices into the N, in order) and how many each rank does."""

    local: Packed
    mine: torch.Tensor
    owners: torch.Tensor  # long [N]: the group rank whose positions predict each target
    group: ContextGroup


def split(packed: Packed, group: ContextGroup, pad_id: int) -> Split:
    packed = pad_to_multiple(packed, group.cp, pad_id)
    R, W = packed.input_ids.shape
    S = W // group.cp
    lo = group.rank * S
    row, pos = packed.predictors // W, packed.predictors % W
    owners = pos // S
    mine = torch.nonzero(owners == group.rank).flatten()
    local = Packed(packed.input_ids[:, lo : lo + S], packed.position_ids[:, lo : lo + S], packed.segments,
                   row[mine] * S + (pos[mine] - lo), packed.targets[mine],
                   packed.routing[:, lo : lo + S] if packed.routing is not None else None)
    return Split(local, mine, owners, group)


class _Gather(torch.autograd.Function):
    """Each rank's values of its own targets -> all N targets' values, in order, on every rank of the group. Every
    rank then computes the same loss from them, so the backward keeps this rank's own targets' gradient as it is."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, mine: torch.Tensor, owners: torch.Tensor, group: ContextGroup):
        ctx.mine = mine
        counts = torch.bincount(owners, minlength=group.cp)
        width = max(int(counts.max()) if counts.numel() else 0, 1)  # gloo wants a non-empty tensor
        send = values.new_zeros(width)
        send[: values.numel()] = values
        got = values.new_empty(group.cp * width)
        dist.all_gather_into_tensor(got, send, group=group.group)
        got = got.view(group.cp, width)
        out = values.new_empty(owners.numel())
        for c in range(group.cp):
            where = torch.nonzero(owners == c).flatten()
            out[where] = got[c, : where.numel()]
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.mine], None, None, None


def gather(values: torch.Tensor, sp: Split) -> torch.Tensor:
    return _Gather.apply(values, sp.mine.to(values.device), sp.owners.to(values.device), sp.group)
