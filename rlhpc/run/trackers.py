"""Experiment trackers beside TensorBoard (`metrics.trackers`): W&B, MLflow and trackio get every scalar the roles log
(through rlhpc/run/metrics.py), the resolved config, a table of each trained step's sampled rollouts (the rows of
run_dir/samples.jsonl) and the run's summary. Their packages are imported here only, when a tracker is named: a run
without them never imports them (`pip install -e '.[trackers]'` installs all three).

Which tracker run a process writes to:
- W&B and trackio: one run per process, named <run_name>-<role>-<rank> and grouped by the run's name (W&B's pattern
  for distributed training): each process logs on its own and none waits for another. The scalars keep their names;
  the x-axis of their charts is the step each row carries, as in TensorBoard (the trainer's step, the warm start's,
  a worker's batch count, the weights version an evaluation measured). W&B gets it as a metric beside them ("step",
  "sft/step", "eval/version"), not as its own step, which only grows: a resumed run logs again the steps after its
  checkpoint, and those rows must not be dropped.
- MLflow: one run for the whole run, as MLflow compares runs. The trainer's scalars keep their names, an inference
  worker's go under inference-<rank>/ (worker 0's held-out evaluations keep theirs: eval/...). The trainer logs the
  config, the samples and the summary, and ends the run (FINISHED) after the last step; a stopped attempt leaves it
  RUNNING for the requeued one.

The launcher fixes the tracker runs' identities once, in run_dir/trackers.json (`prepare`): the run's name, the W&B
runs' ids and the MLflow run, which it creates so that every process finds it. So every process, a restarted worker
and a resumed or requeued attempt write to the same tracker runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from omegaconf import OmegaConf

from rlhpc.config.errors import one_line
from rlhpc.config.schema import Config, ConfigError
from rlhpc.run.rundir import RunDir, is_number, read_json, write_json

# The module each tracker imports, and the package pip installs for it (setup.cfg's `trackers` extra).
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny"), "trackio": ("trackio", "trackio")}

# The step of each phase's rows (rlhpc.run.metrics.phase_of), as W&B gets it: the x-axis of their charts.
STEP_KEYS = {"rl": "step", "sft": "sft/step", "eval": "eval/version"}

# The columns of the samples table: the rows rlhpc/train/samples.py writes to samples.jsonl.
SAMPLE_COLUMNS = ("step", "version", "env", "task_id", "reward", "advantage", "truncated", "prompt", "completion")


def missing(names: Iterable[str]) -> Optional[str]:
    """Why a tracker of `names` cannot start here (its package is not installed), or None. Asked by the launcher,
    which imports none of them."""
    for name in names:
        module, package = PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            return (f"{name} needs the {package} package, which is not installed: pip install -e '.[trackers]' (or "
                    f"pip install {package})")
    return None


def prepare(cfg: Config, run: RunDir) -> None:
    """At launch: the identities of the run's tracker runs in run_dir/trackers.json, those of an earlier launch of the
    run kept (it continues them), made for a tracker named for the first time."""
    named = [n for n in cfg.metrics.trackers if n in PACKAGES]
    if not named:
        return
    state = read_json(run.trackers) or {}
    before = json.dumps(state, sort_keys=True)
    state.setdefault("name", cfg.metrics.run_name or f"{cfg.exp_name}-{run.root.name}")
    if "wandb" in named:
        state.setdefault("wandb", {"id": secrets.token_hex(4)})
    if "mlflow" in named and "mlflow" not in state:
        state["mlflow"] = _create_mlflow_run(cfg, run, state["name"])
    if "trackio" in named:
        state.setdefault("trackio", {})
    if json.dumps(state, sort_keys=True) != before:
        write_json(run.trackers, state)


class Tracker:
    """One experiment tracker as one process writes to it. Starting it (the constructor) opens or resumes the
    process's tracker run and records the config there."""

    def log(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
        """Scalars of `phase` ("rl", "sft", "eval") at `step`."""
        raise NotImplementedError

    def samples(self, step: int, rows: List[dict]) -> None:
        """The sampled rollouts of trained step `step`, as a table (trainer rank 0)."""
        raise NotImplementedError

    def summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (summary.json), at its end (trainer rank 0)."""
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


def start(cfg: Config, run: RunDir, role: str, rank: int) -> List[Tracker]:
    """The trackers of `metrics.trackers` for process `role`-`rank`, on the runs `prepare` fixed."""
    named = [n for n in cfg.metrics.trackers if n in PACKAGES]
    if not named:
        return []
    state = read_json(run.trackers) or {}
    lacking = [n for n in named if n not in state]
    if lacking:
        raise RuntimeError(f"{run.trackers} names no {' or '.join(lacking)} run: the launcher makes them "
                           f"(python -m rlhpc.launch) before any role starts")
    kinds = {"wandb": Wandb, "mlflow": Mlflow, "trackio": Trackio}
    return [kinds[n](cfg, run, role, rank, state) for n in named]


def config_dict(cfg: Config) -> Dict[str, Any]:
    """The resolved config as nested plain values (what config.yaml holds)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def table(rows: List[dict]) -> Dict[str, list]:
    """Samples as columns and rows of values."""
    return {"columns": list(SAMPLE_COLUMNS), "data": [[r[c] for c in SAMPLE_COLUMNS] for r in rows]}


def numbers(summary: Mapping[str, Any]) -> Dict[str, float]:
    """The summary's top-level numbers (held-out rewards, steps, wall times)."""
    return {k: float(v) for k, v in summary.items() if is_number(v)}


# ---- W&B ---------------------------------------------------------------------------------------------------------


class Wandb(Tracker):
    def __init__(self, cfg: Config, run: RunDir, role: str, rank: int, state: Dict[str, Any]):
        import wandb

        c, name = cfg.metrics.wandb, state["name"]
        self.wandb = wandb
        # dir: the run's folder (W&B writes run_dir/wandb/<run>/, also online), where `wandb sync` finds an offline
        # run. resume="allow" with the id fixed at launch: a restarted or resumed process goes on with its W&B run.
        self.run = wandb.init(
            project=c.project, entity=c.entity or None, mode=c.mode, dir=str(run.root),
            id=f"{state['wandb']['id']}-{role}-{rank}", resume="allow", name=f"{name}-{role}-{rank}", group=name,
            job_type=role, tags=list(c.tags) or None, config=config_dict(cfg),
            reinit="create_new",  # one run per process; a process that holds several (tests) keeps each apart
        )
        self.defined: set = set()

    def log(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
        self.define(phase, scalars)
        self.run.log({**scalars, STEP_KEYS[phase]: step})

    def define(self, phase: str, keys: Iterable[str]) -> None:
        """Charts `keys` against their phase's step (each key once)."""
        for k in keys:
            if k not in self.defined:
                self.run.define_metric(k, step_metric=STEP_KEYS[phase])
                self.defined.add(k)

    def samples(self, step: int, rows: List[dict]) -> None:
        self.define("rl", ["samples"])
        self.run.log({"samples": self.wandb.Table(**table(rows)), STEP_KEYS["rl"]: step})

    def summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update(dict(summary))

    def finish(self) -> None:
        self.run.finish()


# ---- MLflow ------------------------------------------------------------------------------------------------------


def _mlflow_client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("file:"):
        # MLflow 3 keeps its file store in maintenance mode and refuses it unless told otherwise. It is the store for
        # a run directory on a shared filesystem: each process appends to files of its own metrics, where an SQLite
        # database would be written by processes on several nodes at once.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=tracking_uri)


def _create_mlflow_run(cfg: Config, run: RunDir, name: str) -> Dict[str, str]:
    uri = cfg.metrics.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run.root / "mlruns").as_uri()
    if ":" not in uri:  # a folder, named from where the launch runs: the roles may run elsewhere
        uri = Path(uri).absolute().as_uri()
    try:
        client = _mlflow_client(uri)
        experiment = client.get_experiment_by_name(cfg.metrics.mlflow.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(
            cfg.metrics.mlflow.experiment)
        created = client.create_run(experiment_id, run_name=name, tags={"rlhpc.run_dir": str(run.root)})
    except Exception as e:  # noqa: BLE001 - whatever MLflow raises (a server that does not answer, a bad URI)
        raise ConfigError(f"config key `metrics.mlflow.tracking_uri`: no MLflow run could be created at {uri}: "
                          f"{one_line(e)}") from None
    return {"tracking_uri": uri, "run_id": created.info.run_id}


def _params(tree: Mapping[str, Any], prefix: str = "") -> Dict[str, str]:
    """The config's keys as MLflow params: dotted names, values as text (MLflow keeps at most 6000 characters)."""
    out: Dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = (v if isinstance(v, str) else json.dumps(v))[:6000]
    return out


class Mlflow(Tracker):
    def __init__(self, cfg: Config, run: RunDir, role: str, rank: int, state: Dict[str, Any]):
        self.client = _mlflow_client(state["mlflow"]["tracking_uri"])
        self.run_id = state["mlflow"]["run_id"]
        self.prefix = "" if role == "trainer" else f"{role}-{rank}/"
        self.primary = role == "trainer"
        self.ended = False
        if self.primary:
            self.client.update_run(self.run_id, status="RUNNING")  # a resumed attempt runs it again
            self.log_config(cfg)

    def log_config(self, cfg: Config) -> None:
        """The config as params and as config.yaml. MLflow's params never change: a key a resumed run changed
        (resume.allow_config_change) keeps its first value there, and config.yaml holds the newest."""
        from mlflow.entities import Param

        known = self.client.get_run(self.run_id).data.params
        params = [Param(k, v) for k, v in _params(config_dict(cfg)).items() if k not in known]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, OmegaConf.to_yaml(OmegaConf.structured(cfg)), "config.yaml")

    def log(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        prefix = "" if phase == "eval" else self.prefix
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(prefix + k, float(v), now, step) for k, v in scalars.items()])

    def samples(self, step: int, rows: List[dict]) -> None:
        # One file a step, in the layout of MLflow's log_table (columns, data); a resumed run's step replaces the
        # earlier attempt's. log_table itself would download and rewrite one growing file at every step.
        self.client.log_dict(self.run_id, table(rows), f"samples/step_{step:06d}.json")

    def summary(self, summary: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, 0) for k, v in numbers(summary).items()])
        self.client.log_dict(self.run_id, dict(summary), "summary.json")
        self.ended = True

    def finish(self) -> None:
        if self.primary and self.ended:
            self.client.set_terminated(self.run_id, "FINISHED")


# ---- trackio -----------------------------------------------------------------------------------------------------


class Trackio(Tracker):
    def __init__(self, cfg: Config, run: RunDir, role: str, rank: int, state: Dict[str, Any]):
        import trackio

        name = state["name"]
        self.trackio = trackio
        self.run = trackio.init(project=cfg.metrics.trackio.project, name=f"{name}-{role}-{rank}", group=name,
                                config=config_dict(cfg), resume="allow", embed=False)

    def log(self, phase: str, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def samples(self, step: int, rows: List[dict]) -> None:
        self.run.log({"samples": self.trackio.Table(**table(rows))}, step=step)

    def summary(self, summary: Mapping[str, Any]) -> None:
        # trackio keeps no summary of a run: its numbers are the run's last row.
        self.run.log({f"summary/{k}": v for k, v in numbers(summary).items()})

    def finish(self) -> None:
        self.run.finish()
