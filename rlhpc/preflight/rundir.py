"""The run directory before a launch: made (a new run's name, `new_run_dir`), guarded (one launch at a time,
`launch_lock`; never a run_dir a live run writes, `check_not_running`), and resumed only with the config it trained with,
as far as training goes (`training_changes`, unless `resume.allow_config_change=true`)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from rlhpc.config import schema as config_mod
from rlhpc.config.errors import one_line
from rlhpc.config.schema import Config
from rlhpc.preflight.checks import weights_problem
from rlhpc.run.rundir import RunDir


# ---- relaunching an unfinished run ------------------------------------------------------------------------------------

# Keys that may change between launches of one run without changing what it trains: where and how it runs, how long,
# how often it checkpoints or evaluates, timeouts, how the work is split (the math does not depend on ranks or
# micro-batches: tests/test_trainer_math.py), how many workers produce the same kind of groups.
RUNTIME_KEYS = (
    "run_dir", "exp_name", "overwrite", "dry_run", "log_level", "resume", "launcher", "cluster", "eval", "metrics",
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
    from rlhpc.run.slurm_jobs import FINAL, query, recorded_jobs

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
    only with the config it trained with, as far as training goes (RUNTIME_KEYS may change)."""
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
