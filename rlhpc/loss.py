"""Policy losses. A loss maps `LossInputs` (the loss tokens of a micro-batch, flattened) to per-token losses.

The trainer weights the per-token losses so that a whole step sums to the normalized objective (`algo.normalize`), which
keeps the gradient independent of how the step is split into micro-batches and ranks. Losses are registered by name
(`algo.name`); a user-supplied one is named by import path ("package.module:function").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict

import torch

from rlhpc.config import AlgoConfig


@dataclass
class LossInputs:
    """N = loss tokens of a micro-batch (only tokens the policy generated)."""

    logprobs: torch.Tensor  # float [N], trainer logprobs (requires grad)
    inference_logprobs: torch.Tensor  # float [N], logprobs of the distribution the tokens were sampled from
    advantages: torch.Tensor  # float [N], the advantage of each token's sample
    sample_index: torch.Tensor  # long [N], sample of each token, 0..S-1 within the micro-batch
    num_samples: int  # S


@dataclass
class LossOutputs:
    token_loss: torch.Tensor  # float [N]
    metrics: Dict[str, torch.Tensor] = field(default_factory=dict)  # scalars, means over the micro-batch tokens


LossFn = Callable[[LossInputs, AlgoConfig], LossOutputs]
_REGISTRY: Dict[str, LossFn] = {}


def register(name: str) -> Callable[[LossFn], LossFn]:
    def deco(fn: LossFn) -> LossFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def get(name: str) -> LossFn:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"config key `algo.name`: cannot import loss {name!r}: {e}") from e
    raise ValueError(f"config key `algo.name`: unknown loss {name!r}; known: {', '.join(sorted(_REGISTRY))}")


def names() -> list[str]:
    return sorted(_REGISTRY)


@register("grpo")
def grpo(x: LossInputs, cfg: AlgoConfig) -> LossOutputs:
    """PPO-clipped token-level importance ratio against the inference policy (GRPO, arXiv:2402.03300)."""
    log_ratio = x.logprobs - x.inference_logprobs
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    token_loss = -torch.minimum(ratio * x.advantages, clipped * x.advantages)
    with torch.no_grad():
        lr = log_ratio.detach()
        metrics = {
            "clip_low_frac": ((ratio < 1.0 - cfg.clip_low) & (x.advantages < 0)).float().mean(),
            "clip_high_frac": ((ratio > 1.0 + cfg.clip_high) & (x.advantages > 0)).float().mean(),
            "ratio_mean": ratio.detach().mean(),
            # k3 estimator of KL(inference || trainer): the trainer/inference mismatch (plus staleness).
            "mismatch_kl": (torch.exp(lr) - 1 - lr).mean(),
        }
    return LossOutputs(token_loss, metrics)
