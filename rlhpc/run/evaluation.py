"""Held-out evaluation: greedy reward on the first `eval.num_tasks` tasks of the eval split; its schedule and its record.

Where it runs: the SFT warm start evaluates its own model (version 0); during RL inference worker 0 evaluates the
weights it serves, with the run's engine, between generations (rlhpc/infer/worker.py), so the trainer never holds a
copy for it and no step waits for it. Each result is one file, run_dir/evals/v<version>.json
{"version", "reward", "time", "tasks"}; the curve is these files in version order. Workers take the newest weights
and may skip versions: a due version that worker 0 never applied is measured at the first version after it, under
that version's number, so the curve holds the versions that were evaluated.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from rlhpc.run.rundir import RunDir, read_json_object, write_json

if TYPE_CHECKING:
    from rlhpc.config.schema import Config
    from rlhpc.env import Environment

# (weights version, held-out reward), in version order.
Curve = List[Tuple[int, float]]


def heldout_tasks(env: Environment, cfg: Config) -> list:
    """The fixed held-out tasks: the same before SFT, after it and during RL."""
    return list(islice(env.tasks("eval", 0), cfg.eval.num_tasks))


def eval_due(cfg: Config, version: int) -> bool:
    iv = cfg.eval.interval
    return version == cfg.trainer.steps or (iv > 0 and version % iv == 0)


def eval_owed(cfg: Config, version: int, last: Optional[int]) -> bool:
    """Whether `version` is to be evaluated when `last` is the newest version evaluated so far (None: none yet, so
    the curve starts here): it is due, or a due version between the two was skipped."""
    if last is None:
        return True
    if version <= last:
        return False
    iv = cfg.eval.interval
    return version >= cfg.trainer.steps or eval_due(cfg, version) or (iv > 0 and version // iv > last // iv)


def evals_dir(run: RunDir) -> Path:
    return run.root / "evals"


def result_path(run: RunDir, version: int) -> Path:
    return evals_dir(run) / f"v{version:06d}.json"


def write_result(run: RunDir, version: int, reward: float, tasks: int) -> None:
    """One evaluation's record, written atomically: a reader never sees half a file."""
    evals_dir(run).mkdir(parents=True, exist_ok=True)
    write_json(result_path(run, version), {"version": version, "reward": reward, "time": time.time(), "tasks": tasks})


def read_curve(run: RunDir, problems: Optional[Dict[Path, str]] = None) -> Curve:
    """Every evaluation recorded so far, in version order (`problems`: as rlhpc.run.rundir.read_json_object)."""
    rows = (read_json_object(p, problems, ("version", "reward")) for p in sorted(evals_dir(run).glob("v*.json")))
    return sorted((r["version"], r["reward"]) for r in rows if r)


def discard_after(run: RunDir, version: int) -> None:
    """A run resumed at `version` trains later versions again: their old results are not theirs."""
    for v, _ in read_curve(run):
        if v > version:
            result_path(run, v).unlink(missing_ok=True)
