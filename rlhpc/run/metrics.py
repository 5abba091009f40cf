"""Per-role metrics: the rows of logs/<role>-<rank>.metrics.jsonl (what the status command and the plots read), and
the same scalars in the trackers of `metrics.trackers`: TensorBoard under tb/<role>-<rank>/ (the warm start's under
tb/trainer-0/sft/, inference worker 0's held-out evaluations under tb/inference-0/eval/), and W&B, MLflow or trackio
(rlhpc/run/trackers.py), which also get the config, the sampled rollouts and the summary.

A run that resumes trains again the steps after its last checkpoint (or saved warm start state): the rows the killed
attempt wrote for them are not the run's. The trainer marks the resume in the rows ({"resumed": "rl" or "sft",
"step": k}); read_rows leaves out the earlier rows of that phase past step k, and TensorBoard purges its events past
k (its `purge_step`); inference worker 0's first evaluation in a new life purges its held-out evaluations past the
last result on record (those of versions a resumed run trains again)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Dict, List, Mapping, Optional

from rlhpc.config.errors import one_line
from rlhpc.config.schema import Config
from rlhpc.run import trackers
from rlhpc.run.rundir import RunDir

log = logging.getLogger(__name__)


def phase_of(row: Mapping) -> str:
    """"sft" for the warm start's rows (sft/ scalars), "rl" for the others."""
    return "sft" if any(k.startswith("sft/") for k in row) else "rl"


class Metrics:
    """One process's metrics. Without `cfg` (tests, tools): the rows and TensorBoard only."""

    def __init__(self, run: RunDir, role: str, rank: int, cfg: Optional[Config] = None):
        self.folder = run.tb / f"{role}-{rank}"
        self.to_tensorboard = cfg is None or "tensorboard" in cfg.metrics.trackers
        # TensorBoard's writers by phase, each in its folder: the warm start's steps and RL's share numbers, as do a
        # worker's batches and the versions it evaluates, and a purge on resume (which hides all of a folder's events
        # from its step on) must not reach the other phase's.
        self.writers: Dict[str, object] = {}
        self.purge: Dict[str, int] = {}
        self.jsonl = open(run.logs / f"{role}-{rank}.metrics.jsonl", "a", buffering=1)
        self.relaunched = self.jsonl.tell() > 0  # an earlier attempt of the run wrote rows
        self.trackers: List[trackers.Tracker] = trackers.start(cfg, run, role, rank) if cfg is not None else []

    def writer(self, phase: str):
        if phase not in self.writers:
            from torch.utils.tensorboard import SummaryWriter

            folder = self.folder if phase == "rl" else self.folder / phase
            self.writers[phase] = SummaryWriter(log_dir=str(folder), flush_secs=5, purge_step=self.purge.get(phase))
        return self.writers[phase]

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        row: Dict[str, float] = {k: float(v) for k, v in scalars.items()}
        self.scalars(step, row)
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **row}) + "\n")

    def scalars(self, step: int, scalars: Mapping[str, float], phase: Optional[str] = None) -> None:
        """Scalars for the trackers only, not rows of the metrics file (`phase`: "rl", "sft" or "eval", by default the
        rows')."""
        phase = phase or phase_of(scalars)
        if self.to_tensorboard:
            writer = self.writer(phase)
            for k, v in scalars.items():
                writer.add_scalar(k, float(v), step)
        self.each_tracker("scalars", lambda t: t.log(phase, step, scalars))

    def samples(self, step: int, rows: List[dict], text: str) -> None:
        """Sampled rollouts of trained step `step` (rlhpc/train/samples.py): `rows` as a table in each tracker, `text`
        (markdown) in TensorBoard's text tab."""
        if self.to_tensorboard:
            self.writer("rl").add_text("samples", text, step)
        self.each_tracker("samples", lambda t: t.samples(step, rows))

    def summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (summary.json) for the trackers."""
        self.each_tracker("the summary", lambda t: t.summary(summary))

    def each_tracker(self, what: str, call) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 - a tracker's outage (its server down) costs its records, not the run
                log.warning("metrics.trackers: %s could not record %s (%s); the run goes on, logs/*.metrics.jsonl "
                            "keeps every scalar", type(tracker).__name__, what, one_line(e))

    def resumed(self, phase: str, step: int) -> None:
        """This attempt goes on after `step` of `phase` ("rl": the checkpoint's step; "sft": the saved warm start's):
        what an earlier attempt logged past it is superseded. Nothing to mark in a run's first attempt."""
        if not self.relaunched:
            return
        self.jsonl.write(json.dumps({"resumed": phase, "step": step, "time": time.time()}) + "\n")
        self.purge_after(phase, step)

    def purge_after(self, phase: str, step: int) -> None:
        """TensorBoard hides the events of `phase` that earlier attempts wrote past `step`."""
        old = self.writers.pop(phase, None)
        if old is not None:
            old.close()
        self.purge[phase] = step + 1

    def close(self) -> None:
        for writer in self.writers.values():
            writer.flush()
            writer.close()
        for tracker in self.trackers:
            tracker.finish()
        self.jsonl.close()


def read_rows(run: RunDir, role: str, rank: int = 0) -> list[dict]:
    path = run.logs / f"{role}-{rank}.metrics.jsonl"
    return _rows(path) if path.exists() else []


def current(rows: List[dict]) -> List[dict]:
    """`rows` less the resume marks and the rows they supersede: those of the marked phase past its step, written
    before the mark."""
    out: List[dict] = []
    for row in rows:
        if "resumed" in row:
            if isinstance(row.get("step"), (int, float)):
                out = [r for r in out if phase_of(r) != row["resumed"]
                       or not (isinstance(r.get("step"), (int, float)) and r["step"] > row["step"])]
            continue
        out.append(row)
    return out


# What each role's rows say about its time: the seconds it worked and the seconds it waited for the other side, since
# its previous row (the trainer: training and publishing vs waiting for rollouts; a worker: generating vs waiting on
# back-pressure or for new weights).
TIME_KEYS = {"trainer": (("perf/train_s", "weights/publish_s"), "perf/rollout_wait_s"),
             "inference": (("perf/generate_s",), "perf/idle_s")}


def busy(rows: List[dict], role: str) -> Optional[Dict[str, float]]:
    """{"busy", "waiting"}: fractions of the wall time between the first and the last of `rows` (one process's metrics
    rows, in order) that the process worked and waited; None with fewer than two rows or an unknown role."""
    if role not in TIME_KEYS:
        return None
    work_keys, wait_key = TIME_KEYS[role]
    rows = [r for r in rows if work_keys[0] in r and "time" in r]
    if len(rows) < 2 or rows[-1]["time"] <= rows[0]["time"]:
        return None
    span = rows[-1]["time"] - rows[0]["time"]
    later = rows[1:]  # each row's seconds cover the time since the row before it
    work = sum(r.get(k, 0.0) for r in later for k in work_keys)
    wait = sum(r.get(wait_key, 0.0) for r in later)
    return {"busy": round(min(work / span, 1.0), 3), "waiting": round(min(wait / span, 1.0), 3)}


def busy_by_process(run: RunDir, rows_of=None) -> Dict[str, Dict[str, float]]:
    """busy() of every trainer and inference process of the run ("trainer-0", "inference-1", ...). `rows_of(path)`
    reads a metrics file (default: all of it)."""
    out = {}
    for path in sorted(run.logs.glob("*.metrics.jsonl")):
        name = path.name[:-len(".metrics.jsonl")]
        role = name.rpartition("-")[0]
        b = busy(rows_of(path) if rows_of else _rows(path), role)
        if b is not None:
            out[name] = b
    return out


def bottleneck(fractions: Dict[str, Dict[str, float]]) -> Optional[str]:
    """Which side the other waits for, in words; None when neither waits much (or nothing is known)."""
    trainer = [b for n, b in fractions.items() if n.startswith("trainer-")]
    workers = [b for n, b in fractions.items() if n.startswith("inference-")]
    if not trainer or not workers:
        return None
    trainer_waits = max(b["waiting"] for b in trainer)
    workers_wait = sum(b["waiting"] for b in workers) / len(workers)
    if trainer_waits >= 0.2 and workers_wait >= 0.2:
        return (f"both sides wait for each other (the trainer {trainer_waits:.0%} of the time, the workers "
                f"{workers_wait:.0%}): they take turns, as in synchronous mode (async_level=0) or with too little overlap")
    if trainer_waits >= 0.2:
        return (f"the trainer waits for rollouts {trainer_waits:.0%} of the time: generation is the bottleneck "
                f"(more inference workers or GPUs would help)")
    if workers_wait >= 0.2:
        return (f"inference workers wait {workers_wait:.0%} of the time (back-pressure, or new weights): training is the "
                f"bottleneck (more trainer ranks, or fewer workers, would help)")
    return None


def _rows(path) -> List[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return current(rows)
