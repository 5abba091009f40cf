"""What the launcher checks before anything starts (before a local process starts or a Slurm job is submitted), so that a
mistake costs seconds at the terminal, not a queue wait and a failed job. Every error names the config key.

- `model.path`: a folder whose config and tokenizer transformers loads (the weights are not read: that takes long);
- the environment: `env.name`/`env.cls` resolves and its constructor accepts `env.args`; `env.tool_parser` resolves;
- the loss: `algo.name` is a registered loss or an importable "package.module:function";
- serving: the host and port a served engine binds, and the tokenizer files it needs;
- `metrics.trackers`: the package of each tracker it names is installed.

The run directory's own checks (a relaunch that changes training, a run_dir another launch writes) are
rlhpc/preflight/rundir.py's; a command line that does not compose is rlhpc/config/errors.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Tuple

from rlhpc.config.errors import one_line
from rlhpc.config.schema import Config, ConfigError
from rlhpc.run import trackers


def check(cfg: Config, model: bool = True) -> None:
    """Raises ConfigError naming the key of the first thing that cannot work. `model=False` skips `model.path` (a dry
    run may plan for a checkpoint that only the cluster's filesystem holds); a model built in code is always checked.
    The quick checks come first: a wrong loss or environment name is reported in the time Python takes to start, not
    after the model was loaded and run."""
    check_loss(cfg)
    check_env(cfg)
    check_trackers(cfg)
    if model or not cfg.model.path:
        check_model(cfg)
    if cfg.inference.serve and cfg.launcher.name == "local" and not cfg.dry_run:
        check_serving(cfg)
    check_context(cfg)


def check_trackers(cfg: Config) -> None:
    """Each tracker of `metrics.trackers` can start: its package is installed (found, not imported)."""
    problem = trackers.missing(cfg.metrics.trackers)
    if problem:
        raise ConfigError(f"config key `metrics.trackers`: {problem}")


def check_model(cfg: Config, trainer: bool = True) -> None:
    """`model.path` (when set) holds a config and a tokenizer that load and belong together, and whole weights
    (`check_weights`); `trainer=False` (serving, evaluation) also accepts weights other than safetensors. Without
    `model.path`, the model built in code builds and runs (rlhpc.modeling.models.built_model_problem)."""
    path = cfg.model.path
    if path and not Path(path).is_dir():  # said before transformers is imported (~2.5 s)
        raise ConfigError(f"config key `model.path`: {path} is not a folder (a local Hugging Face checkpoint: "
                          f"config.json, tokenizer files, *.safetensors)")
    from rlhpc.modeling import remembered

    k = remembered.key(cfg.model, [Path(__file__)], trainer=trainer)
    if remembered.recall("checked-models", k):  # the same model, files and code passed before (rlhpc/modeling/
        return                                  # remembered.py): no transformers import, no model built
    _check_model(cfg, trainer)
    remembered.remember("checked-models", k, True)


def _check_model(cfg: Config, trainer: bool) -> None:
    path = cfg.model.path
    from rlhpc.modeling import models

    if not path:
        problem = models.built_model_problem(cfg.model)
        if problem is not None:
            raise ConfigError(problem)
        return
    folder = Path(path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, the message is what the user needs
        raise ConfigError(f"config key `model.path`: no loadable model config in {path}: {one_line(e)}") from None
    # transformers makes an empty tokenizer from config.json alone: ask for the tokenizer's own files.
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"config key `model.path`: no loadable tokenizer in {path}: none of "
                          f"{', '.join(TOKENIZER_FILES)}")
    try:
        tokenizer = models.load_tokenizer(folder)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config key `model.path`: no loadable tokenizer in {path}: {one_line(e)}") from None
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    if vocab and len(tokenizer) > vocab:
        raise ConfigError(f"config key `model.path`: the tokenizer in {path} has {len(tokenizer)} tokens, more than "
                          f"the model's vocabulary ({vocab}): they do not belong together")
    check_weights(folder, safetensors_only=trainer)


def check_weights(folder: Path, safetensors_only: bool = True) -> None:
    """Raises ConfigError naming `model.path` and the file when the checkpoint's weights are not whole
    (`weights_problem`)."""
    problem = weights_problem(folder, safetensors_only)
    if problem:
        raise ConfigError(f"config key `model.path`: {problem}")


def weights_problem(folder: Path, safetensors_only: bool = True) -> str | None:
    """Why the checkpoint's weights in `folder` are not there or not whole, or None. Each safetensors file is opened
    as the roles open it (safe_open: its header parsed and checked against the file's size; the tensors are not read),
    and a sharded checkpoint's index must name files that exist: a truncated copy, or an HTML page saved as a shard,
    fails here, naming the file, rather than in a role after the job started. The trainer reads safetensors only
    (rlhpc/train/loading.py); serving and evaluation (`safetensors_only=False`) also accept PyTorch .bin weights, which
    are not checked."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is not an index
            return f"{index} is not a safetensors index: {one_line(e)}"
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    elif not safetensors_only and any(folder.glob("pytorch_model*.bin")):
        return None
    else:
        return (f"no model.safetensors or model.safetensors.index.json in {folder}"
                + (" (the trainer loads safetensors checkpoints; convert others with save_pretrained)"
                   if safetensors_only else ""))
    for name in files:
        path = folder / name
        if not path.exists():
            return f"{path}: missing (the checkpoint's index names it)"
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError and whatever else a foreign file makes it raise
            return f"{path}: not a whole safetensors file (an interrupted copy?): {one_line(e)}"
    return None


def model_context(cfg: Config) -> int | None:
    """Tokens a sequence of the model itself may hold: its max_position_embeddings (model.path's config.json, or the
    model built in code); None when model.path's config does not say."""
    if cfg.model.path:
        try:
            hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
        except (OSError, ValueError):
            return None  # check_model names what is wrong with it
        limit = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get("max_position_embeddings")
    else:
        limit = cfg.model.max_position_embeddings
    return limit if isinstance(limit, int) and limit > 0 else None


def context_tokens(cfg: Config) -> int | None:
    """Tokens a sequence may hold: the model's context (`model_context`), within vLLM's `inference.max_model_len`;
    None when model.path's config does not say."""
    limit = model_context(cfg)
    if limit and cfg.inference.engine == "vllm" and cfg.inference.max_model_len:
        limit = min(limit, cfg.inference.max_model_len)
    return limit


def check_context(cfg: Config) -> None:
    """A turn's completion fits in the model's context with room for a prompt: otherwise every episode is cut short
    and the run trains on nothing (a run of `env=math`, 512 new tokens, on the 256-token model built in code scored
    0 throughout, with only a transformers warning in the workers' logs). The refusal names the overrides that fit
    where the context is a setting (`longer_context`)."""
    limit = context_tokens(cfg)
    if limit is not None and cfg.env.max_new_tokens >= limit:
        own = model_context(cfg)
        where = (f"the context of model.path's config ({own} tokens)" if cfg.model.path
                 else f"model.max_position_embeddings ({own})")
        if own != limit:
            where += f" within inference.max_model_len ({limit})"
        raise ConfigError(f"config key `env.max_new_tokens`: {cfg.env.max_new_tokens} new tokens leave no room for a "
                          f"prompt in {where}; {longer_context(cfg)}")


def longer_context(cfg: Config) -> str:
    """What to change when a turn does not fit: the context of the model built in code (`model.max_position_embeddings`)
    and vLLM's `inference.max_model_len` are settings, so they are named with a value that holds the episode (the
    smallest power of two at least `episode_tokens`); a checkpoint's context is its own."""
    need, holds = episode_tokens(cfg)
    fits = 1 << (need - 1).bit_length()
    own = model_context(cfg) or 0
    overrides = []
    if own < fits:
        if cfg.model.path:  # half the context for the completion leaves the other half to the prompt
            return (f"lower env.max_new_tokens (env.max_new_tokens={max(own // 2, 1)} leaves half the context to the "
                    f"prompt) or use a model with a longer context")
        overrides.append(f"model.max_position_embeddings={fits}")
    if cfg.inference.engine == "vllm" and 0 < cfg.inference.max_model_len < fits:
        overrides.append(f"inference.max_model_len={fits}")
    return f"set {' '.join(overrides)} (a power of two that holds {holds}) or lower env.max_new_tokens"


def episode_tokens(cfg: Config) -> Tuple[int, str]:
    """Tokens an episode needs in the context, and what they are in words: `env.max_episode_tokens` when set (the
    budget of a whole episode); otherwise every turn's `env.max_new_tokens` and at least one token more for the
    prompt."""
    env = cfg.env
    if env.max_episode_tokens:
        return max(env.max_episode_tokens, env.max_new_tokens + 1), f"env.max_episode_tokens={env.max_episode_tokens}"
    turns = env.max_turns or environment_turns(cfg)
    said = f"{turns} turns of {env.max_new_tokens} new tokens" if turns > 1 else f"{env.max_new_tokens} new tokens"
    return turns * env.max_new_tokens + 1, f"a prompt and {said}"


def environment_turns(cfg: Config) -> int:
    """The environment's own policy turns per episode (`env.max_turns` 0); 1 when it cannot be loaded here (check_env
    names why)."""
    from rlhpc.env.base import load, max_turns

    try:
        environment = load(cfg.env)
    except Exception:  # noqa: BLE001 - only a refusal's suggestion depends on it
        return 1
    try:
        return max(max_turns(environment, cfg.env), 1)
    finally:
        environment.close()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_serving(cfg: Config, workers: int = 0) -> None:
    """The serving ports (inference.serve_port + rank for each of `workers`, default inference.num_workers) can be
    bound on inference.serve_host here; only when the servers will run on this machine (a local launch, rlhpc.serve)
    and the port is fixed (0 picks a free one)."""
    from rlhpc.infer.server import bind, node_address

    inf = cfg.inference
    if not inf.serve_port:
        return
    host = node_address(inf.serve_host)[0]
    for rank in range(workers or inf.num_workers):
        bind(host, inf.serve_port + rank).close()


def check_env(cfg: Config) -> None:
    from rlhpc import env as env_mod
    from rlhpc.env import tools

    key = "env.cls" if cfg.env.cls else "env.name"
    try:
        env_mod.load(cfg.env)
    except ValueError as e:  # the environment loader names the key itself
        raise ConfigError(one_line(e) if "config key" in str(e) else f"config key `{key}`: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - the environment's own constructor failed
        what = cfg.env.cls or cfg.env.name
        raise ConfigError(f"config key `env.args`: environment {what!r} failed to start with {dict(cfg.env.args)}: "
                          f"{one_line(e)}") from None
    try:
        tools.parser(cfg.env.tool_parser)
    except ValueError as e:
        raise ConfigError(one_line(e)) from None


def check_loss(cfg: Config) -> None:
    from rlhpc.algo import checks

    if cfg.algo.name in checks.LOSSES:  # a built-in: importing the losses (and torch) would only confirm it
        return
    from rlhpc.algo import loss

    try:
        loss.get(cfg.algo.name)
    except ValueError as e:
        raise ConfigError(one_line(e)) from None
