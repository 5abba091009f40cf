"""What the launcher checks before anything starts (before a local process starts or a Slurm job is submitted), so that a
mistake costs seconds at the terminal, not a queue wait and a failed job. Every error names the config key.

- `model.path`: a folder whose config and tokenizer transformers loads (the weights are not read: that takes long);
- the environment: `env.name`/`env.cls` resolves and its constructor accepts `env.args`; `env.tool_parser` resolves;
- the loss: `algo.name` is a registered loss or an importable "package.module:function";
- the run directory: relaunching an unfinished run with a config that changes training is refused, with the
  differences listed, unless `resume.allow_config_change=true` (`training_changes`); so is launching into a run_dir
  that another launch or a live run writes (`launch_lock`, `check_not_running`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from rlhpc import config as config_mod
from rlhpc.config import Config, ConfigError
from rlhpc.rundir import RunDir


def check(cfg: Config, model: bool = True) -> None:
    """Raises ConfigError naming the key of the first thing that cannot work. `model=False` skips `model.path` (a dry
    run may plan for a checkpoint that only the cluster's filesystem holds); a model built in code is always checked.
    The quick checks come first: a wrong loss or environment name is reported in the time Python takes to start, not
    after the model was loaded and run."""
    check_loss(cfg)
    check_env(cfg)
    if model or not cfg.model.path:
        check_model(cfg)
    if cfg.inference.serve and cfg.launcher.name == "local" and not cfg.dry_run:
        check_serving(cfg)
    check_context(cfg)


def check_model(cfg: Config, trainer: bool = True) -> None:
    """`model.path` (when set) holds a config and a tokenizer that load and belong together, and whole weights
    (`check_weights`); `trainer=False` (serving, evaluation) also accepts weights other than safetensors. Without
    `model.path`, the model built in code builds and runs (rlhpc.models.built_model_problem)."""
    path = cfg.model.path
    if path and not Path(path).is_dir():  # said before transformers is imported (~2.5 s)
        raise ConfigError(f"config key `model.path`: {path} is not a folder (a local Hugging Face checkpoint: "
                          f"config.json, tokenizer files, *.safetensors)")
    from rlhpc import models

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
        if cfg.model.path:
            return "lower env.max_new_tokens or use a model with a longer context"
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
    from rlhpc.algo import loss

    try:
        loss.get(cfg.algo.name)
    except ValueError as e:
        raise ConfigError(one_line(e)) from None


def one_line(e: BaseException) -> str:
    """An exception as one line: its type (unless its message says enough) and its message's lines joined."""
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text if text.startswith("config key") else f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---- the command line -----------------------------------------------------------------------------------------------


def composition_error(overrides: List[str], typed: Callable[[Any], Any] = config_mod.to_typed) -> Optional[str]:
    """Composes the config as a command's `main` will (`typed`: its schema's merge; rlhpc.eval adds keys), to report
    a wrong key, value or type as one line naming the key (Hydra's own report spans lines and suggests a stack
    trace). None when it composes, or when the arguments hold Hydra flags (-m, --cfg, ...), which Hydra handles
    itself."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if any(a.startswith("-") for a in overrides):
        return None
    try:
        with initialize_config_dir(config_dir=str(config_mod.CONF_DIR), version_base=None):
            typed(compose(config_name="config",
                          overrides=[o for o in overrides if not o.startswith(("hydra.", "hydra/"))]))
    except Exception as e:  # noqa: BLE001 - any composition error becomes its one-line report
        return config_key_error(e, dry_run=_asks_dry_run(overrides))
    finally:
        GlobalHydra.instance().clear()
    return None


def _asks_dry_run(overrides: List[str]) -> bool:
    """Whether the command line sets dry_run to true (`dry_run=true`, `++dry_run=True`, ...)."""
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "dry_run" and value.strip().lower() in ("true", "yes", "on", "1"):
            return True
    return False


def exit_on_composition_error(overrides: List[str], typed: Callable[[Any], Any] = config_mod.to_typed) -> None:
    """What every command does before Hydra's own start: a command line that does not compose ends here, in one line
    (`composition_error`), with exit code 2."""
    problem = composition_error(overrides, typed)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def config_key_error(e: BaseException, dry_run: bool = False) -> str:
    """`config key `a.b`: what is wrong`, from an OmegaConf error anywhere in the chain of `e` (Hydra wraps them).
    `dry_run`: the command line asks for a plan only (said where it changes the fix)."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options is not None:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return (f"config group `{group}`: no option {option!r} (conf/{group}/ has: {', '.join(e.options)})" if group
                else one_line(e))
    hint = next((line.strip() for line in str(e).splitlines() if line.startswith("To append")), "")
    chain, seen = [], e
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for err in chain:
        key = getattr(err, "full_key", None)
        if isinstance(err, OmegaConfBaseException) and key:
            # The message without OmegaConf's trailer (full_key, reference_type, object_type lines).
            lines = [ln.strip() for ln in str(getattr(err, "msg", None) or err).splitlines()]
            msg = "; ".join(ln for ln in lines if ln and not ln.startswith(("full_key:", "reference_type", "object_type")))
            unset = re.search(r"Environment variable '([^']+)' not found", msg)
            if unset:  # a preset's `${oc.env:VAR}` (conf/model/*.yaml: model.path) with VAR not set
                return unset_variable(key, unset.group(1), dry_run)
            if "is not in struct" in msg and hint:  # a free-form dict (env.args, model.extra) takes new keys with +
                msg += f" ({hint})"
            elif "not in '" in msg:
                msg += f" ({_known_keys(err, key)})"
            return f"config key `{key}`: {msg}"
    return one_line(e)


# What a key that a preset reads from the environment holds, in the words of its refusal (the rest: "<value>").
_UNSET_VALUES = {"model.path": "a Hugging Face checkpoint folder"}


def unset_variable(key: str, variable: str, dry_run: bool = False) -> str:
    """The refusal of a key whose preset value is `${oc.env:variable}` while `variable` is not set: both ways to give
    it. A dry run does not read model.path (it plans for a checkpoint only the cluster holds), so any folder name
    does there."""
    what = _UNSET_VALUES.get(key, "a value")
    that = "that folder" if what.endswith("folder") else "that value"
    msg = (f"config key `{key}`: no value: the preset takes it from the environment variable {variable}, which is "
           f"not set; pass {key}=<{what}> on the command line, or set {variable}=<{that}> in the environment")
    if dry_run and key == "model.path":
        msg += " (a dry run does not read the folder: one that only the cluster holds will do)"
    return msg


def _known_keys(err: BaseException, key: str) -> str:
    """For a key its section lacks: the section's keys that look like it, or else all of them."""
    import dataclasses
    import difflib

    section, _, name = key.rpartition(".")
    schema = getattr(err, "object_type", None)
    if not dataclasses.is_dataclass(schema):
        return "no such key"
    names = [f.name for f in dataclasses.fields(schema)]
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"`{prefix}{c}`" for c in close) + "?"
    return f"{section or 'the top level'} has: {', '.join(names)}"


# ---- relaunching an unfinished run ------------------------------------------------------------------------------------

# Keys that may change between launches of one run without changing what it trains: where and how it runs, how long,
# how often it checkpoints or evaluates, timeouts, how the work is split (the math does not depend on ranks or
# micro-batches: tests/test_trainer_math.py), how many workers produce the same kind of groups.
RUNTIME_KEYS = (
    "run_dir", "exp_name", "overwrite", "dry_run", "log_level", "resume", "launcher", "cluster", "eval",
    "trainer.steps", "trainer.checkpoint_interval", "trainer.export_final", "trainer.rollout_timeout_s",
    "trainer.max_bad_steps", "trainer.threads", "trainer.num_ranks", "trainer.fsdp", "trainer.activation_checkpointing",
    "trainer.micro_batch_tokens", "trainer.logprob_chunk_tokens", "trainer.packing", "trainer.pack_row_tokens",
    "trainer.attention_block_elements", "trainer.compile",
    "inference.num_workers", "inference.threads", "inference.startup_timeout_s", "inference.idle_timeout_s",
    "inference.max_restarts", "inference.restart_window_s", "inference.restart_backoff_s",
    "inference.serve", "inference.serve_open", "inference.serve_port", "inference.serve_host",
    "inference.nodes_per_instance",
    "weights.timeout_s", "weights.bucket_mb", "weights.snapshot_interval", "weights.transport",
    "weights.member_timeout_s", "weights.receive",
    "queue.lease_s", "queue.poll_max_s", "queue.keep_dropped", "queue.keep_quarantined", "queue.keep_retired",
    "env.pool_processes", "sft.save_interval",
)


def training_changes(saved: DictConfig, cfg: Config) -> List[Tuple[str, Any, Any]]:
    """(key, saved value, new value) of every key that differs and changes training. A key the saved config lacks (the
    schema grew between versions of rlhpc) is not a difference; free-form values (env.args, model.extra) compare
    whole."""
    old = OmegaConf.to_container(saved, resolve=False)
    changes = []
    for key, value in _leaves(cfg):
        if any(key == r or key.startswith(r + ".") for r in RUNTIME_KEYS):
            continue
        node: Any = old
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            if node != value:
                changes.append((key, node, value))
    return changes


def _leaves(obj: Any, prefix: str = "") -> List[Tuple[str, Any]]:
    """(dotted key, value) of every field of a config dataclass, recursing into nested config dataclasses only."""
    out: List[Tuple[str, Any]] = []
    for f in fields(obj):
        v = getattr(obj, f.name)
        if is_dataclass(v):
            out += _leaves(v, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", v))
    return out


# ---- the run directory ---------------------------------------------------------------------------------------------


class RunDirError(RuntimeError):
    pass


def prepare_run_dir(cfg: Config) -> RunDir:
    """Creates the run directory and writes config.yaml. Refuses a directory holding a finished run unless
    `overwrite=true`; a directory of an unfinished run is resumed, but refused if its saved config differs in a key that
    changes training, unless `resume.allow_config_change=true`."""
    run = RunDir(Path(cfg.run_dir))
    if run.root.exists() and not run.root.is_dir():
        raise RunDirError(f"run_dir={run.root} is a file, not a folder; choose another run_dir")
    if run.summary.exists() or run.done.exists():
        if not cfg.overwrite:
            raise RunDirError(
                f"run_dir={run.root} already holds a finished run (summary.json); pass another run_dir=... "
                f"or overwrite=true to replace it"
            )
        for p in run.root.iterdir():  # all but the lock this launch holds (launch_lock)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.name != LAUNCH_LOCK:
                p.unlink()
    elif run.root.exists() and any(p.name != LAUNCH_LOCK for p in run.root.iterdir()) and not run.config.exists():
        raise RunDirError(f"run_dir={run.root} is not empty and is not an rlhpc run directory; choose another run_dir")
    elif run.config.exists():
        check_not_running(run)
        check_resume(run, cfg)
    try:
        run.make()
    except OSError as e:
        raise RunDirError(f"run_dir={run.root} cannot be created: {one_line(e)}; choose another run_dir") from None
    for stale in (run.failed, run.requeue):  # an earlier attempt's: this one writes its own
        stale.unlink(missing_ok=True)
    config_mod.save(cfg, run.config)
    return run


LAUNCH_LOCK = ".launch.lock"


def new_run_dir(path: Path) -> Path:
    """The folder of a new run named by the time of its launch (the default run_dir, runs/<exp>/<time>), made here:
    `path`, or when another launch took that name in the same second, the first free one of <name>-2, <name>-3, ...
    (made with an exclusive mkdir: two launches never get the same folder)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                continue
    except OSError as e:
        raise RunDirError(f"run_dir={path} cannot be created: {one_line(e)}; choose another run_dir") from None
    raise RunDirError(f"run_dir={path}: it and 998 numbered variants exist already; choose another run_dir")


@contextmanager
def launch_lock(root: Path) -> Iterator[None]:
    """Held while this process launches into `root` (a local launch: until its run ends; a Slurm one: until the job is
    submitted and recorded). A second launch into the same run_dir meanwhile is refused: before the first run's roles
    beat or its job is recorded, check_not_running cannot see it. The lock (flock on run_dir/.launch.lock) dies with
    its process; on a filesystem without flock (Lustre mounted without `-o flock`) launches go unguarded."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LAUNCH_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        fd = None  # not a folder that can be made: prepare_run_dir says why
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                raise RunDirError(f"run_dir={root} is being launched into right now ({holder}): wait for that "
                                  "launch to end, or choose another run_dir") from None
            # any other error: no flock on this filesystem
        yield
    finally:
        os.close(fd)


def launcher_of(root: Path) -> Optional[Tuple[int, str]]:
    """(pid, host) of the last launch into `root`, as its launch lock recorded it; None if there is no such record."""
    try:
        words = (Path(root) / LAUNCH_LOCK).read_text().split()
    except OSError:
        return None
    if len(words) == 4 and words[0] == "pid" and words[1].isdigit() and words[2] == "on":
        return int(words[1]), words[3]
    return None


def check_not_running(run: RunDir) -> None:
    """Refuses a run directory that a live run still writes: a Slurm job of the run (jobs.json) that has not ended (the
    job this process runs in excepted: sbatch/rlhpc.sbatch launches inside its job, again after a requeue), or roles
    of a local launch alive on this machine. Two runs in one directory would quarantine each other's rollouts and mix
    their logs and checkpoints."""
    from rlhpc.cluster.slurm_jobs import FINAL, query, recorded_jobs

    own = os.environ.get("SLURM_JOB_ID")
    for entry in recorded_jobs(run, {}):
        job = str(entry.get("job_id", ""))
        if not job or job == own:
            continue
        state = query(job)
        if state.components and not state.final and state.state not in FINAL:
            raise RunDirError(f"run_dir={run.root} is being written by Slurm job {job} ({state.state}): let it end, or "
                              f"`scancel {job}`, before launching into it again; or choose another run_dir")
    for name, pid in list(run.live_roles().items())[:1]:  # the first one found names the launch
        raise RunDirError(f"run_dir={run.root} is being written by a running launch ({name} is pid {pid}): stop it "
                          "(Ctrl-C in its terminal) before launching into it again; or choose another run_dir")


def check_resume(run: RunDir, cfg: Config) -> None:
    """An unfinished run that has trained (a warm-started model, a stopped warm start's state or a checkpoint) resumes
    only with the config it trained with, as far as training goes (rlhpc.preflight.RUNTIME_KEYS may change)."""
    from omegaconf import OmegaConf

    if not ((run.model / "READY").exists() or (run.checkpoints / "latest.json").exists()
            or (run.sft_state / "state.json").exists()):
        return  # nothing trained yet: a relaunch after a failed start may change anything
    damaged = weights_problem(run.model) if (run.model / "READY").exists() else None  # every role resumes from it
    if damaged:
        raise RunDirError(f"run_dir={run.root}: its warm-started model is damaged ({damaged}); delete {run.model} to "
                          f"warm-start again, or choose another run_dir")
    if (run.checkpoints / "latest.json").exists():
        from rlhpc.train import checkpoint

        whole, broken = checkpoint.resumable(run.checkpoints)
        listing = "; ".join(f"{p.name}: {why}" for p, why in broken)
        if whole is None:
            raise RunDirError(f"run_dir={run.root}: no whole checkpoint to resume from ({listing}); move "
                              f"{run.checkpoints} aside to train RL again from the warm-started model, or choose "
                              "another run_dir")
        if broken:
            print(f"warning: run_dir={run.root}: damaged checkpoint(s) skipped ({listing}); resuming from the newest "
                  f"whole one, {whole.name}: the steps after it train again", file=sys.stderr)
    try:
        saved = OmegaConf.load(run.config)
    except Exception as e:  # noqa: BLE001
        raise RunDirError(f"run_dir={run.root}: its config.yaml cannot be read ({one_line(e)}); "
                          f"choose another run_dir") from None
    changes = training_changes(saved, cfg)
    if not changes:
        return
    listing = "".join(f"\n  {k}: {old!r} -> {new!r}" for k, old, new in changes)
    if not cfg.resume.allow_config_change:
        raise RunDirError(
            f"run_dir={run.root} holds an unfinished run whose config differs in keys that change training:{listing}"
            f"\nresume it with its own values, pass resume.allow_config_change=true to train on with the new ones, "
            f"or choose another run_dir"
        )
    print(f"warning: resuming run_dir={run.root} with a changed config (resume.allow_config_change=true):{listing}",
          file=sys.stderr)
    with open(run.root / "config_changes.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "changes": [[k, o, n] for k, o, n in changes]}, default=str) + "\n")
