"""Policy losses. A loss maps `LossInputs` (the loss tokens of a micro-batch, flattened) to per-token losses.

The objective of a step is built in three layers, each in one place below:
  1. the loss (`algo.name`): per-token losses from the trainer and inference logprobs and the advantages;
  2. the off-policy correction (`algo.is_level`): a stop-gradient importance weight per token, multiplied in;
  3. the KL terms (`algo.ref_kl_coef`, `algo.inference_kl_coef`), added per token.
`get(name)` returns their composition, so every correction and KL term works with every loss, a user-supplied one
(named by import path, "package.module:function") included.

The trainer weights the per-token losses (`token_weights`, `algo.normalize`) so that a whole step sums to the normalized
objective, which keeps the gradient independent of how the step is split into micro-batches and ranks.
docs/algorithms.md gives every formula with its source.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Optional, Tuple

import torch

from rlhpc.algo import checks
from rlhpc.config.schema import AlgoConfig


@dataclass
class LossInputs:
    """N = loss tokens of a micro-batch (only tokens the policy generated)."""

    logprobs: torch.Tensor  # float [N], trainer logprobs (requires grad)
    inference_logprobs: torch.Tensor  # float [N], logprobs of the distribution the tokens were sampled from
    advantages: torch.Tensor  # float [N], the advantage of each token's sample
    sample_index: torch.Tensor  # long [N], sample of each token, 0..S-1 within the micro-batch
    num_samples: int  # S
    reference_logprobs: Optional[torch.Tensor] = None  # float [N], reference policy logprobs (for algo.ref_kl_coef)


@dataclass
class LossOutputs:
    token_loss: torch.Tensor  # float [N]
    metrics: Dict[str, torch.Tensor] = field(default_factory=dict)  # scalars, means over the micro-batch tokens


LossFn = Callable[[LossInputs, AlgoConfig], LossOutputs]
_REGISTRY: Dict[str, LossFn] = {}



def register(*names: str) -> Callable[[LossFn], LossFn]:
    def deco(fn: LossFn) -> LossFn:
        for name in names:
            _REGISTRY[name] = fn
        return fn

    return deco


def get(name: str) -> LossFn:
    """The step objective of loss `name`: the loss, with the configured off-policy correction and KL terms."""
    return functools.partial(objective, _lookup(name))


def _lookup(name: str) -> LossFn:
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


# ---- per-sequence reductions over the flat token layout (no Python loops) -------------------------------------------


def _per_sample_sum(v: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """float [S]: the sum of `v` over each sample's tokens."""
    return torch.zeros(x.num_samples, dtype=v.dtype, device=v.device).index_add(0, x.sample_index, v)


def _tokens_per_sample(x: LossInputs) -> torch.Tensor:
    return torch.bincount(x.sample_index, minlength=x.num_samples)


def _mean(v: torch.Tensor) -> torch.Tensor:
    """Token mean that stays finite on an empty micro-batch (the trainer weights metrics by token count)."""
    return v.float().sum() / max(v.numel(), 1)


# ---- the losses ------------------------------------------------------------------------------------------------------


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: AlgoConfig) -> LossOutputs:
    """PPO's pessimistic clipped surrogate: -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)."""
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    token_loss = -torch.minimum(ratio * adv, clipped * adv)
    with torch.no_grad():  # a token is clipped where the clip is active: its gradient is zero
        metrics = {
            "clip_low_frac": _mean((ratio < 1.0 - cfg.clip_low) & (adv < 0)),
            "clip_high_frac": _mean((ratio > 1.0 + cfg.clip_high) & (adv > 0)),
        }
    return LossOutputs(token_loss, metrics)


@register("grpo", "dr_grpo", "dapo")
def grpo(x: LossInputs, cfg: AlgoConfig) -> LossOutputs:
    """PPO-clipped token-level importance ratio against the inference policy (GRPO, arXiv:2402.03300).

    Dr. GRPO (arXiv:2503.20783) and DAPO (arXiv:2503.14476) share this token loss; they differ in their config
    (advantages, `algo.normalize`, the asymmetric clip, dynamic sampling, overlong shaping): conf/algo/*.yaml.
    """
    return _clipped_surrogate(torch.exp(x.logprobs - x.inference_logprobs), x.advantages, cfg)


@register("gspo")
def gspo(x: LossInputs, cfg: AlgoConfig) -> LossOutputs:
    """Sequence-level ratio, the geometric mean of the token ratios of each sequence, clipped (GSPO, arXiv:2507.18071).

    Every token of a sequence carries the sequence's loss; with `algo.normalize=sequence` the step is the mean over
    sequences of the clipped sequence surrogate.
    """
    log_ratio = x.logprobs - x.inference_logprobs
    seq_log_ratio = _per_sample_sum(log_ratio, x) / _tokens_per_sample(x).clamp(min=1)
    return _clipped_surrogate(torch.exp(seq_log_ratio)[x.sample_index], x.advantages, cfg)


def _weighted_score(weight: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """-w A grad(log pi) as a loss: the weight is a constant; pi / stop_grad(pi) is 1 in value, so the loss value is
    -w A (comparable with the clipped surrogates) and its gradient is -w A grad(log pi)."""
    return -weight.detach() * x.advantages * torch.exp(x.logprobs - x.logprobs.detach())


@register("cispo")
def cispo(x: LossInputs, cfg: AlgoConfig) -> LossOutputs:
    """Clipped stop-gradient importance weight on every token times its log-probability (CISPO, arXiv:2506.13585).

    Unlike the PPO clip, no token loses its gradient: the weight clip(pi/mu, 1 - clip_low, 1 + clip_high) bounds it.
    """
    ratio = torch.exp((x.logprobs - x.inference_logprobs).detach())
    weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    metrics = {
        "clip_low_frac": _mean(ratio < 1.0 - cfg.clip_low),
        "clip_high_frac": _mean(ratio > 1.0 + cfg.clip_high),
    }
    return LossOutputs(_weighted_score(weight, x), metrics)


@register("aipo")
def aipo(x: LossInputs, cfg: AlgoConfig) -> LossOutputs:
    """Per-token truncated importance weight min(pi/mu, delta) against the inference policy, times the log-probability
    (AIPO, LlamaRL, arXiv:2505.24034); delta is `algo.aipo_delta`."""
    ratio = torch.exp((x.logprobs - x.inference_logprobs).detach())
    weight = torch.clamp(ratio, max=cfg.aipo_delta)
    return LossOutputs(_weighted_score(weight, x), {"clip_high_frac": _mean(ratio > cfg.aipo_delta)})


# ---- off-policy correction, KL terms, and their composition with a loss ----------------------------------------------


def importance_weights(x: LossInputs, cfg: AlgoConfig) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """float [N], stop-gradient: the off-policy weight pi/mu of each token (`algo.is_level=token`) or of its sequence,
    the product of its token ratios (`sequence`), clamped into [is_low, is_high] (`algo.is_mode=truncate`) or zeroed
    outside it (`mask`). Computed in log space, so long sequences cannot overflow."""
    with torch.no_grad():
        log_w = x.logprobs.detach() - x.inference_logprobs
        if cfg.is_level == "sequence":
            log_w = _per_sample_sum(log_w, x)[x.sample_index]
        lo = math.log(cfg.is_low) if cfg.is_low > 0 else -math.inf
        hi = math.log(cfg.is_high)
        outside = (log_w < lo) | (log_w > hi)
        weight = torch.exp(log_w.clamp(min=lo, max=hi))
        if cfg.is_mode == "mask":
            weight = weight.masked_fill(outside, 0.0)
        frac = _mean(outside)
        zero = torch.zeros_like(frac)
        metrics = {
            "is_weight_mean": _mean(weight),
            "is_truncated_frac": frac if cfg.is_mode == "truncate" else zero,
            "is_masked_frac": frac if cfg.is_mode == "mask" else zero,
        }
    return weight, metrics


def mismatch_metrics(x: LossInputs) -> Dict[str, torch.Tensor]:
    """Statistics of the token importance ratio pi/mu between trainer and inference (mismatch plus staleness)."""
    with torch.no_grad():
        log_ratio = x.logprobs.detach() - x.inference_logprobs
        ratio = torch.exp(log_ratio)
        empty = ratio.numel() == 0
        return {
            "ratio_mean": _mean(ratio),
            # Extremes of the micro-batch (the trainer's step value is their token-weighted mean over micro-batches).
            "ratio_min": ratio.new_tensor(1.0) if empty else ratio.min(),
            "ratio_max": ratio.new_tensor(1.0) if empty else ratio.max(),
            # k3 estimator of KL(inference || trainer), from the tokens the inference policy sampled.
            "mismatch_kl": _mean(ratio - 1 - log_ratio),
        }


def objective(loss_fn: LossFn, x: LossInputs, cfg: AlgoConfig) -> LossOutputs:
    """The per-token losses of a step: `loss_fn`, times the off-policy weight, plus the KL terms.

    With a correction on, the loss's own ratio is taken against the trainer's current policy (stop-gradient, the
    "proximal" policy of decoupled PPO; as in TRL's and verl's rollout correction): the weight carries pi/mu, and it
    must not be counted twice. Clipping then bounds nothing within a step (the ratio is 1), the weight does.
    """
    checks.loss_keys(cfg)
    if cfg.ref_kl_coef > 0 and x.reference_logprobs is None:
        raise ValueError(
            "config key `algo.ref_kl_coef` > 0 needs reference logprobs (LossInputs.reference_logprobs), which the "
            "trainer did not provide; set algo.ref_kl_coef=0, or have the trainer compute them"
        )
    metrics = mismatch_metrics(x)
    loss_inputs = x
    weight: Optional[torch.Tensor] = None
    if cfg.is_level != "none":
        weight, is_metrics = importance_weights(x, cfg)
        metrics.update(is_metrics)
        loss_inputs = replace(x, inference_logprobs=x.logprobs.detach())
    out = loss_fn(loss_inputs, cfg)
    token_loss = out.token_loss if weight is None else out.token_loss * weight
    if x.reference_logprobs is not None:
        d = x.reference_logprobs - x.logprobs
        ref_kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || reference)
        metrics["ref_kl"] = _mean(ref_kl.detach())
        if cfg.ref_kl_coef > 0:
            token_loss = token_loss + cfg.ref_kl_coef * ref_kl
    if cfg.inference_kl_coef > 0:
        sq = 0.5 * (x.logprobs - x.inference_logprobs) ** 2  # k2 estimator of the KL to the inference policy
        metrics["inference_kl_k2"] = _mean(sq.detach())
        token_loss = token_loss + cfg.inference_kl_coef * sq
    metrics.update(out.metrics)
    return LossOutputs(token_loss, metrics)


# ---- normalization (the trainer's per-token weights) -----------------------------------------------------------------


def token_weights(
    x: LossInputs, normalize: str, total_tokens: float, total_samples: float, max_tokens: int
) -> torch.Tensor:
    """float [N]: the weight of each token loss, so that the weighted sum over all micro-batches and ranks of a step is

    token:    the mean over all loss tokens of the step                   (total_tokens: loss tokens of the step)
    sequence: the mean over sequences of each sequence's token mean       (total_samples: samples of the step)
    constant: the token sum / (total_samples * max_tokens), Dr. GRPO      (max_tokens: env.max_new_tokens)

    A sample's tokens all lie in one micro-batch, so its token count is counted here.
    """
    dtype, device = x.logprobs.dtype, x.logprobs.device
    if normalize == "token":
        return torch.full((x.sample_index.numel(),), 1.0 / total_tokens, dtype=dtype, device=device)
    if normalize == "sequence":
        per_sample = _tokens_per_sample(x).clamp(min=1).to(dtype)
        return 1.0 / (per_sample[x.sample_index] * total_samples)
    if normalize == "constant":
        return torch.full((x.sample_index.numel(),), 1.0 / (total_samples * max_tokens), dtype=dtype, device=device)
    raise ValueError(f"config key `algo.normalize`: {normalize!r} is not one of {', '.join(checks.NORMALIZE)}")

