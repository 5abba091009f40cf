"""How the trainer's model is parallelized: FSDP2 (`fully_shard`) per decoder block and at the root.

On GPU the parameters are kept in bf16 for compute with fp32 gradient reductions (a mixed-precision policy); on CPU
everything stays fp32. Activation checkpointing wraps each decoder block when asked.

MoE models (Qwen3-MoE, GLM-5, MiniMax-M2, ...) shard the same way: transformers 5 keeps a layer's routed experts in
two fused parameters, which belong to their block's FSDP unit, so a block's all-gather brings all of its experts (no
expert parallelism). Parameters that get no gradient on any rank (GLM-5's DSA indexer, run without autograd by
transformers) are simply left out of the reduce-scatter.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlhpc.config import TrainerConfig


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of a Hugging Face causal LM (model.model.layers for Qwen3, Qwen3-MoE, GLM-5, MiniMax-M2,
    DeepSeek...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no `model.layers` to shard per block")
    return layers


def apply_fsdp(model: torch.nn.Module, cfg: TrainerConfig, device: torch.device) -> torch.nn.Module:
    mp = None
    if device.type == "cuda":  # GPU only: bf16 compute, fp32 reductions
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = decoder_blocks(model)
    if cfg.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    for block in blocks:
        fully_shard(block, mp_policy=mp) if mp else fully_shard(block)
    fully_shard(model, mp_policy=mp) if mp else fully_shard(model)
    return model
