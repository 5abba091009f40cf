"""The checks of the `algo` keys, without torch: the launcher validates a config before anything starts, and a
refused key or a `--help` page should not wait for torch to import. The losses and advantages (loss.py, advantage.py)
use the same names; tests/test_loss.py holds LOSSES equal to the registered losses."""

from __future__ import annotations

import math

from rlhpc.config.schema import AlgoConfig
from rlhpc.config.schema import need as config_need

# The losses rlhpc.algo.loss registers; any other `algo.name` is an import path, "package.module:function".
LOSSES = ("aipo", "cispo", "dapo", "dr_grpo", "grpo", "gspo")
NORMALIZE = ("token", "sequence", "constant")
IS_LEVELS = ("none", "token", "sequence")
IS_MODES = ("truncate", "mask")
BASELINES = ("mean", "loo")


def _need(ok: bool, key: str, msg: str) -> None:
    config_need(ok, f"algo.{key}", msg)


def loss_keys(cfg: AlgoConfig) -> None:
    """Checks the loss keys of `algo`, for config.validate to call before anything starts (the objective calls it
    too); raises ConfigError naming the key."""
    need = _need
    need(cfg.normalize in NORMALIZE, "normalize", f"{cfg.normalize!r} is not one of {', '.join(NORMALIZE)}")
    need(cfg.is_level in IS_LEVELS, "is_level", f"{cfg.is_level!r} is not one of {', '.join(IS_LEVELS)}")
    need(cfg.is_mode in IS_MODES, "is_mode", f"{cfg.is_mode!r} is not one of {', '.join(IS_MODES)}")
    need(0 <= cfg.is_low < cfg.is_high, "is_low", f"needs 0 <= is_low < is_high (got {cfg.is_low}, {cfg.is_high})")
    need(0 <= cfg.clip_low <= 1, "clip_low", f"must be in [0, 1] (got {cfg.clip_low})")
    need(cfg.clip_high >= 0, "clip_high", f"must be >= 0 (got {cfg.clip_high})")
    need(cfg.aipo_delta > 0, "aipo_delta", f"must be > 0 (got {cfg.aipo_delta})")
    # Coefficients multiply every token's term: an infinite one makes every step's loss non-finite.
    need(0 <= cfg.ref_kl_coef < math.inf, "ref_kl_coef", f"must be finite and >= 0 (got {cfg.ref_kl_coef})")
    need(0 <= cfg.inference_kl_coef < math.inf, "inference_kl_coef",
         f"must be finite and >= 0 (got {cfg.inference_kl_coef})")


def advantage_keys(cfg: AlgoConfig) -> None:
    """Checks the advantage keys of `algo`, for config.validate to call before anything starts; raises ConfigError
    naming the key."""
    need = _need
    need(cfg.baseline in BASELINES, "baseline", f"{cfg.baseline!r} is not one of {', '.join(BASELINES)}")
    buffer = cfg.overlong_buffer
    need(0 <= buffer <= 1, "overlong_buffer", f"is a fraction of env.max_new_tokens, in [0, 1] (got {buffer})")
    need(0 <= cfg.length_penalty < math.inf, "length_penalty", f"must be finite and >= 0 (got {cfg.length_penalty})")
