"""Per-role metrics: TensorBoard scalars under tb/<role>-<rank>/ and the same rows in logs/<role>-<rank>.metrics.jsonl
(what the status command and the plots read)."""

from __future__ import annotations

import json
import time
from typing import Dict, Mapping

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
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    return rows
