"""Advantages of the completions of one group, computed by the inference worker before publishing.

reward -> shaped reward (length penalty, DAPO overlong shaping) -> minus a baseline (group mean, or leave-one-out)
-> optionally divided by the group's std. `keep_group` is DAPO's dynamic sampling: a group whose rewards are all equal
carries no learning signal and is dropped before publishing. docs/algorithms.md gives the formulas and sources.
"""

from __future__ import annotations

import torch

from rlhpc.algo import checks
from rlhpc.config.schema import AlgoConfig

def shaped_rewards(
    rewards: torch.Tensor, completion_tokens: torch.Tensor, cfg: AlgoConfig, max_tokens: int
) -> torch.Tensor:
    """float [G]: the rewards with the length terms of `algo` applied; completion_tokens: [G] generated token counts,
    max_tokens: the generation limit (env.max_new_tokens)."""
    r = rewards.to(torch.float32)
    length = completion_tokens.to(torch.float32)
    if cfg.length_penalty:
        r = r - cfg.length_penalty * length / max_tokens
    if cfg.overlong_buffer > 0:
        # DAPO's soft overlong punishment: 0 up to max - buffer, then linear down to -1 at max (and -1 beyond).
        buffer = cfg.overlong_buffer * max_tokens
        r = r + ((max_tokens - buffer - length) / buffer).clamp(min=-1.0, max=0.0)
    return r


def group_advantages(
    rewards: torch.Tensor, completion_tokens: torch.Tensor, cfg: AlgoConfig, max_tokens: int
) -> torch.Tensor:
    """rewards: float [G] of one group, completion_tokens: [G] -> advantages float [G].

    The shaped reward minus the group mean (`algo.baseline=mean`) or minus the mean of the other G-1 completions
    (`loo`, RLOO), divided by the group's reward std when `algo.std_normalize`.
    """
    checks.advantage_keys(cfg)
    r = shaped_rewards(rewards, completion_tokens, cfg, max_tokens)
    g = r.numel()
    baseline = r.mean() if cfg.baseline == "mean" else (r.sum() - r) / (g - 1)
    adv = r - baseline
    if cfg.std_normalize:
        adv = adv / (r.std() + 1e-4)
    return adv


def keep_group(rewards: torch.Tensor, cfg: AlgoConfig) -> bool:
    """DAPO dynamic sampling (`algo.dynamic_sampling`): False for a group whose (task) rewards are all equal, whose
    advantages are zero (all solved or all failed); always True when dynamic sampling is off."""
    return not cfg.dynamic_sampling or bool(rewards.max() > rewards.min())

