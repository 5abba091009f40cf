"""Advantages of the completions of one group (computed by the inference worker before publishing)."""

from __future__ import annotations

import torch

from rlhpc.config import AlgoConfig


def group_advantages(rewards: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """rewards: float [G] of one group -> advantages float [G]: reward minus the group mean, optionally / std."""
    adv = rewards - rewards.mean()
    if cfg.std_normalize:
        adv = adv / (rewards.std() + 1e-4)
    return adv
