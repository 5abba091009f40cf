"""Per-role metrics: TensorBoard scalars under tb/<role>-<rank>/ and the same rows in logs/<role>-<rank>.metrics.jsonl
(what the status command and the plots read)."""

from __future__ import annotations

import json
import time
from typing import Dict, List, Mapping, Optional

from rlhpc.rundir import RunDir


class Metrics:
    def __init__(self, run: RunDir, role: str, rank: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.tb / f"{role}-{rank}"), flush_secs=5)
        self.jsonl = open(run.logs / f"{role}-{rank}.metrics.jsonl", "a", buffering=1)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        row: Dict[str, float] = {k: float(v) for k, v in scalars.items()}
        for k, v in row.items():
            self.writer.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **row}) + "\n")

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
        self.jsonl.close()


def read_rows(run: RunDir, role: str, rank: int = 0) -> list[dict]:
    path = run.logs / f"{role}-{rank}.metrics.jsonl"
    return _rows(path) if path.exists() else []


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
    return rows
