"""Tests against a real Slurm cluster on this machine, as brought up by ``python -m rlhpc.cluster.local up``.

They skip when no cluster answers (set ``RLHPC_REQUIRE_SLURM=1`` to make that a failure instead). Every wait has a
timeout, and every job a test submits is cancelled when the module ends.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

CMD_TIMEOUT = 30  # seconds for any one Slurm command
JOB_TIMEOUT = 120  # seconds for a job to reach a state
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE")


def _run(*args: str, timeout: float = CMD_TIMEOUT, check: bool = True) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _expand(nodelist: str) -> list[str]:
    return _run("scontrol", "show", "hostnames", nodelist).split()


class Jobs:
    """Submits jobs and cancels whatever is left of them at the end."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def sbatch(self, script: Path, *opts: str) -> str:
        out = _run("sbatch", "--parsable", *opts, str(script)).strip()
        job_id = out.split(";")[0]
        assert job_id.isdigit(), out
        self.ids.append(job_id)
        return job_id

    def cancel_all(self) -> None:
        if self.ids:
            _run("scancel", *self.ids, check=False)


@pytest.fixture(scope="module")
def jobs():
    if shutil.which("sinfo") is None:
        _unavailable("Slurm client commands are not installed")
    try:
        ping = _run("scontrol", "ping", timeout=15, check=False)
    except subprocess.TimeoutExpired:
        ping = ""
    if "is UP" not in ping:
        _unavailable("no Slurm controller answers; start one with `sudo python -m rlhpc.cluster.local up`")
    j = Jobs()
    yield j
    j.cancel_all()


def _unavailable(why: str) -> None:
    if os.environ.get("RLHPC_REQUIRE_SLURM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def _sacct(job_id: str) -> dict[str, tuple[str, str]]:
    """JobID -> (State, ExitCode) for a job, its het components and its steps."""
    out = _run("sacct", "-j", job_id, "-n", "-P", "-o", "JobID,State,ExitCode")
    rows = {}
    for line in out.splitlines():
        if line.strip():
            jid, state, code = line.split("|")
            rows[jid] = (state.split()[0], code)  # "CANCELLED by 0" -> "CANCELLED"
    return rows


def _wait_done(job_id: str, components: list[str], timeout: float = JOB_TIMEOUT) -> dict[str, tuple[str, str]]:
    """Wait until sacct shows every component (e.g. ["7+0", "7+1"] or ["7"]) in a terminal state."""
    deadline = time.monotonic() + timeout
    rows: dict[str, tuple[str, str]] = {}
    while time.monotonic() < deadline:
        rows = _sacct(job_id)
        if all(c in rows and rows[c][0] in TERMINAL for c in components):
            return rows
        time.sleep(1)
    _run("scancel", job_id, check=False)
    pytest.fail(f"job {job_id} did not finish within {timeout}s; sacct: {rows}\n{_run('squeue', check=False)}")


def _wait_for(what: str, predicate, timeout: float = JOB_TIMEOUT, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def _job_field(job_id: str, field: str) -> str:
    out = _run("scontrol", "show", "job", job_id, check=False)
    m = re.search(rf"\b{field}=(\S+)", out)
    return m.group(1) if m else ""


def _write(path: Path, text: str) -> Path:
    path.write_text(text.lstrip())
    return path


# ---------------------------------------------------------------------------------------------------------------


def test_cluster_is_up_with_idle_nodes(jobs):
    want = int(os.environ.get("RLHPC_SLURM_NODES", "4"))

    def idle_nodes():
        out = _run("sinfo", "-h", "-N", "-o", "%N %t")
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return states if len(states) == want and set(states.values()) == {"idle"} else None

    states = _wait_for("all nodes idle", idle_nodes, timeout=60)
    assert sorted(states) == [f"n{i}" for i in range(1, want + 1)]
    config = _run("scontrol", "show", "config")
    assert re.search(r"JobRequeue\s*=\s*1", config)
    assert re.search(r"AccountingStorageType\s*=\s*accounting_storage/slurmdbd", config)


def test_heterogeneous_job_runs_to_completed(jobs, tmp_path):
    script = _write(tmp_path / "het.sh", f"""
#!/bin/bash
#SBATCH --job-name=rlhpc-test-het
#SBATCH --output={tmp_path}/out-%j.txt
#SBATCH --time=5
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=1
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks=2 --cpus-per-task=1
srun --het-group=0,1 bash -c 'env | grep -E "^SLURM" | sort > {tmp_path}/env-$SLURM_PROCID'
""")
    job_id = jobs.sbatch(script)
    rows = _wait_done(job_id, [f"{job_id}+0", f"{job_id}+1"])
    for comp in (f"{job_id}+0", f"{job_id}+1", f"{job_id}+0.0", f"{job_id}+1.0"):
        assert rows.get(comp) == ("COMPLETED", "0:0"), (comp, rows)

    envs = {}
    for f in sorted(tmp_path.glob("env-*")):
        envs[int(f.name.split("-")[1])] = dict(line.split("=", 1) for line in f.read_text().splitlines())
    assert sorted(envs) == [0, 1, 2], envs.keys()
    group0 = _expand(envs[0]["SLURM_JOB_NODELIST_HET_GROUP_0"])
    group1 = _expand(envs[0]["SLURM_JOB_NODELIST_HET_GROUP_1"])
    assert len(group0) == 1 and len(group1) == 2 and not set(group0) & set(group1)
    for rank, env in envs.items():
        # One global task numbering across the components, in component order; no per-task component index.
        assert env["SLURM_PROCID"] == str(rank)
        assert env["SLURM_NTASKS"] == "3"
        assert env["SLURM_HET_SIZE"] == "2"
        assert env["SLURM_NTASKS_HET_GROUP_0"] == "1" and env["SLURM_NTASKS_HET_GROUP_1"] == "2"
        assert env["SLURM_JOB_ID"] == job_id  # the leader's id in every component
        group = 0 if rank < int(env["SLURM_NTASKS_HET_GROUP_0"]) else 1
        assert env["SLURMD_NODENAME"] in (group0, group1)[group]


def test_accounting_records_exit_codes(jobs, tmp_path):
    cluster = re.search(r"ClusterName\s*=\s*(\S+)", _run("scontrol", "show", "config")).group(1)
    assert cluster in _run("sacctmgr", "-n", "-P", "show", "cluster", "format=cluster").split()
    ok = jobs.sbatch(_write(tmp_path / "ok.sh", "#!/bin/bash\ntrue\n"), "-o", "/dev/null", "--time=2")
    bad = jobs.sbatch(_write(tmp_path / "bad.sh", "#!/bin/bash\nexit 3\n"), "-o", "/dev/null", "--time=2")
    assert _wait_done(ok, [ok])[ok] == ("COMPLETED", "0:0")
    assert _wait_done(bad, [bad])[bad] == ("FAILED", "3:0")


def test_requeued_heterogeneous_job_starts_again(jobs, tmp_path):
    starts = tmp_path / "starts"
    script = _write(tmp_path / "requeue.sh", f"""
#!/bin/bash
#SBATCH --job-name=rlhpc-test-requeue
#SBATCH --output=/dev/null
#SBATCH --time=5
#SBATCH --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1
echo "start restart_count=${{SLURM_RESTART_COUNT:-0}}" >> {starts}
exec sleep 300
""")
    job_id = jobs.sbatch(script)

    def n_starts():
        return len(starts.read_text().splitlines()) if starts.exists() else 0

    _wait_for("the first start", lambda: n_starts() >= 1, timeout=60)
    _run("scontrol", "requeue", job_id)
    # cred_expire=10 holds a requeued job ~10 s; the waker then gets the het job scheduled again.
    _wait_for("the start after requeue", lambda: n_starts() >= 2, timeout=90)
    assert starts.read_text().splitlines()[1] == "start restart_count=1"
    assert _job_field(job_id, "Restarts") == "1"
    _run("scancel", job_id)
    rows = _wait_done(job_id, [f"{job_id}+0", f"{job_id}+1"], timeout=60)
    assert rows[f"{job_id}+0"][0] == "CANCELLED"


def test_signal_reaches_batch_shell_before_time_limit(jobs, tmp_path):
    got = tmp_path / "got-usr1"
    script = _write(tmp_path / "signal.sh", f"""
#!/bin/bash
#SBATCH --job-name=rlhpc-test-signal
#SBATCH --output=/dev/null
#SBATCH --time=1
#SBATCH --signal=B:USR1@50
trap 'echo "$(date +%s)" > {got}; kill $child; exit 0' USR1
sleep 100 & child=$!
wait
""")
    job_id = jobs.sbatch(script)
    # (proctrack/linuxproc does not end processes that outlive the batch shell: the trap kills its sleep itself.)
    # Slurm checks time limits periodically: the signal comes between 10 s (60 - 50) and ~45 s after the start.
    rows = _wait_done(job_id, [job_id], timeout=100)
    assert got.exists(), rows
    assert rows[job_id] == ("COMPLETED", "0:0")
