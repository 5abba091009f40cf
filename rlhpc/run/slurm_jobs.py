"""The state of a run's heterogeneous Slurm job, as sacct and squeue report it, and the run's record of its jobs.

sacct lists a heterogeneous job as one row per component (`26+0`: the trainer, `26+1`: inference). Right after the
job ends it can briefly show only the leader (`26`) or components still RUNNING: the job counts as finished only when
every component is in a final state. Without accounting (no sacct answer) squeue is asked instead; a job that has
left squeue then reads as "gone" (its final state unknown).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlhpc.run.rundir import RunDir, read_json, read_json_object, write_json
from rlhpc.run.slurm_identity import ROLES

# JobState.source when no Slurm command answered (not installed here, or no controller reachable).
NO_ANSWER = "neither sacct nor squeue answered"
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "REVOKED", "GONE")
# When components end differently, the job reads as the first of these that any component has.
_WORST_FIRST = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "DEADLINE", "PREEMPTED", "CANCELLED",
                "REVOKED", "GONE", "COMPLETED")
_ACTIVE_FIRST = ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                 "SUSPENDED", "STOPPED", "RESIZING")


@dataclass
class Component:
    job_id: str  # "26+0"
    role: str
    state: str
    exit_code: str = ""
    nodes: str = ""
    elapsed: str = ""
    reason: str = ""


@dataclass
class JobState:
    job_id: str
    components: List[Component] = field(default_factory=list)
    # "sacct", "squeue", or why neither answered
    source: str = ""

    @property
    def final(self) -> bool:
        return len(self.components) == len(ROLES) and all(c.state in FINAL for c in self.components)

    @property
    def answered(self) -> bool:
        return self.source != NO_ANSWER

    def describe(self) -> str:
        """The state as the launcher prints it: `RUNNING`, or why it is not known."""
        if self.components:
            return self.state
        if not self.answered:
            return f"state unknown ({NO_ANSWER})"
        return "not listed by sacct or squeue (yet)"

    @property
    def state(self) -> str:
        if not self.components:
            return "UNKNOWN"
        states = [c.state for c in self.components]
        order = _WORST_FIRST if self.final else _ACTIVE_FIRST
        for s in order:
            if s in states:
                return s
        return next((s for s in states if s not in FINAL), states[0])


def _run(args: List[str], timeout: float = 30) -> Optional[str]:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _component(job_id: str, het_id: str, fields: Dict[str, str]) -> Optional[Component]:
    if not het_id.startswith(f"{job_id}+"):
        return None
    offset = het_id.split("+", 1)[1]
    if not offset.isdigit() or int(offset) >= len(ROLES):
        return None
    return Component(het_id, ROLES[int(offset)], fields["state"].split()[0] if fields["state"] else "UNKNOWN",
                     fields.get("exit_code", ""), fields.get("nodes", ""), fields.get("elapsed", ""),
                     fields.get("reason", ""))


def query(job_id: str) -> JobState:
    """The job's components and states: sacct first, squeue when sacct knows nothing (yet)."""
    out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,NodeList,Elapsed"])
    comps: Dict[str, Component] = {}
    if out:
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) != 5:
                continue
            c = _component(job_id, parts[0], dict(state=parts[1], exit_code=parts[2], nodes=parts[3], elapsed=parts[4]))
            if c:
                comps[c.job_id] = c
        if comps:
            return JobState(job_id, [comps[k] for k in sorted(comps)], "sacct")
    accounting = out is not None
    out = _run(["squeue", "-j", job_id, "-h", "-o", "%i|%T|%N|%M|%r"])
    if out is None and not accounting:
        return JobState(job_id, [], NO_ANSWER)
    for line in (out or "").splitlines():
        parts = line.split("|")
        if len(parts) != 5:
            continue
        c = _component(job_id, parts[0], dict(state=parts[1], nodes=parts[2], elapsed=parts[3], reason=parts[4]))
        if c:
            comps[c.job_id] = c
    if not comps and not accounting:  # not queued any more, and no accounting to say how it ended
        return JobState(job_id, [Component(f"{job_id}+{k}", r, "GONE") for k, r in enumerate(ROLES)], "squeue")
    return JobState(job_id, [comps[k] for k in sorted(comps)], "squeue")


def wait_final(job_id: str, timeout_s: float, poll_s: float = 1.0) -> JobState:
    """Polls until every component is final (sacct lags a moment after the end) or `timeout_s` passes; at once when
    Slurm does not answer (nothing to wait for)."""
    deadline = time.monotonic() + timeout_s
    state = query(job_id)
    while not state.final and state.answered and time.monotonic() < deadline:
        time.sleep(poll_s)
        state = query(job_id)
    return state


def restarts(job_id: str) -> int:
    out = _run(["scontrol", "show", "job", job_id, "-o"]) or ""
    for word in out.split():
        if word.startswith("Restarts="):
            return int(word.split("=", 1)[1])
    return 0


def cancel(job_id: str) -> bool:
    """scancel; False when it failed or could not run."""
    return _run(["scancel", job_id]) is not None


# ---- run_dir/jobs.json: the Slurm jobs of a run ----------------------------------------------------------------------


def jobs_file(run: RunDir):
    return run.root / "jobs.json"


def record_job(run: RunDir, entry: Dict[str, Any]) -> None:
    data = read_json(jobs_file(run)) or {"jobs": []}
    data["jobs"].append(entry)
    write_json(jobs_file(run), data)


def recorded_jobs(run: RunDir, problems: Optional[Dict[Path, str]] = None) -> List[Dict[str, Any]]:
    """The Slurm jobs of the run (jobs.json; `problems`: as rlhpc.run.rundir.read_json_object)."""
    path = jobs_file(run)
    jobs = (read_json_object(path, problems) or {"jobs": []}).get("jobs")
    if isinstance(jobs, list) and all(isinstance(j, dict) and "job_id" in j for j in jobs):
        return jobs
    if problems is None:
        raise ValueError(f"{path}: no list of jobs with a job_id each")
    problems[path] = "no list of jobs with a job_id each"
    return []
