"""The optimizer the RL trainer and the SFT warm start share."""

from __future__ import annotations

import torch


def make_optimizer(params, optim) -> torch.optim.Optimizer:
    """AdamW from an `OptimConfig` (trainer.optim or sft.optim)."""
    return torch.optim.AdamW(params, lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay)
