"""How the trainer's model is parallelized and in which dtypes it computes: FSDP2 (`fully_shard`) per decoder block and
at the root, and mixed precision.

Dtypes (config `trainer.param_dtype`, `trainer.master_dtype`):
- the master weights (the sharded parameters) and the AdamW state are `trainer.master_dtype` (float32 by default);
- forward and backward compute in `trainer.param_dtype` ("auto": bfloat16 on GPU, the master dtype on CPU). With FSDP2 the
  parameters are all-gathered in it (`MixedPrecisionPolicy`); one rank without FSDP runs the forward under
  `torch.autocast` instead (which also works on CPU);
- gradients are reduced over ranks in float32 and land on the master weights in the master dtype.
Both float32 is exact (no cast anywhere); both bfloat16 is pure bf16 training, where updates much smaller than a
weight round away (docs/trainer.md, tests/test_mixed_precision.py).

Activation checkpointing recomputes each decoder block in backward when asked, with or without FSDP, through
transformers' own checkpointing (`enable_activation_checkpointing`).

MoE models (Qwen3-MoE, GLM-5, MiniMax-M2, ...) shard the same way: transformers 5 keeps a layer's routed experts in
two fused parameters, which belong to their block's FSDP unit, so a block's all-gather brings all of its experts.
With `trainer.ep` > 1 (expert parallelism, rlhpc/train/experts.py) the fused experts leave FSDP2: they are stored as
dim-0 shards over the same 1-d world mesh, each rank computes E/ep experts and tokens travel to them by all-to-all;
everything else stays FSDP2 over all ranks. One mesh for every parameter keeps gradient clipping and DCP checkpoints
as they are. Parameters that get no gradient on any rank (GLM-5's DSA indexer, run without autograd by
transformers) are simply left out of the reduce-scatter.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlhpc.config.schema import TrainerConfig
from rlhpc.modeling.dtypes import dtype_of
from rlhpc.modeling.models import decoder_blocks


def master_dtype(cfg: TrainerConfig) -> torch.dtype:
    return dtype_of(cfg.master_dtype)


def compute_dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    if cfg.param_dtype == "auto":  # bf16 where it is fast; on CPU compute as the master weights are stored
        return torch.bfloat16 if device.type == "cuda" else master_dtype(cfg)
    return dtype_of(cfg.param_dtype)


def mixed_precision(cfg: TrainerConfig, device: torch.device) -> MixedPrecisionPolicy | None:
    """FSDP2's policy: all-gather in the compute dtype, reduce gradients in float32; None when nothing is cast."""
    compute, master = compute_dtype(cfg, device), master_dtype(cfg)
    if compute == master == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=compute if compute != master else None, reduce_dtype=torch.float32)


def autocast(cfg: TrainerConfig, device: torch.device, model: torch.nn.Module):
    """The forward's context on one rank without FSDP: autocast to the compute dtype when it is not the master's."""
    from torch.distributed.fsdp import FSDPModule

    compute = compute_dtype(cfg, device)
    if isinstance(model, FSDPModule) or compute == master_dtype(cfg):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Each decoder block recomputes its forward in backward (non-reentrant `torch.utils.checkpoint`). transformers'
    checkpointing, not torch's `checkpoint_wrapper`: its blocks then drop the KV cache the model makes for a forward
    (config `use_cache`), which the recompute would otherwise fill a second time (keys twice the mask's width), and
    the parameter names stay Hugging Face's. Before `fully_shard`: FSDP2 unshards a block for its recompute."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: torch.nn.Module, cfg: TrainerConfig, device: torch.device) -> torch.nn.Module:
    """Shards `model` in place (also on the meta device, before any memory exists: rlhpc/train/loading.py); with
    `trainer.ep` > 1 its routed experts are spread over the ranks first. Collective."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    ignored = set()
    if cfg.ep > 1:
        from rlhpc.train.experts import shard_experts

        ignored = set(shard_experts(model, cfg.ep, mesh, compute_dtype(cfg, device)))
    mp = mixed_precision(cfg, device)
    kw = dict(mesh=mesh, ignored_params=ignored or None, **({"mp_policy": mp} if mp else {}))
    if cfg.cp > 1:
        from rlhpc.train.attention import install

        install(model, cfg.cp, cfg.attention_block_elements)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    for block in decoder_blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model
