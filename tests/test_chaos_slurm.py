"""Chaos on the local Slurm cluster: during one run (`launcher=slurm`, one heterogeneous job), an inference worker is
killed with `kill -9` (its task restarts it inside the job), a queue file is corrupted, and mid-RL the node of the
inference component is drained and the job requeued with `scontrol requeue`. The job comes back on other nodes, the
trainer resumes from its checkpoint, and the run completes: every step trained once, no group twice, none lost, and
the final held-out reward within the local chaos test's tolerance of the same undisturbed run (tests/conftest.py).

Needs the local cluster (`sudo bash rlhpc/cluster/local_slurm.sh up`); skips without it like the other `slurm` tests
(`RLHPC_REQUIRE_SLURM=1` makes that a failure). Every wait has a timeout; the job is cancelled and the node resumed
when the test ends, whatever happened.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import CHAOS_CHECKPOINT as CHECKPOINT, CHAOS_STEPS as STEPS
from faults import (account, corrupt_pending_file, heldout, kill_role, ledger, rl_overrides, snapshot,
                                 survived, wait_steps)
from test_chaos import MIN_GAIN, REWARD_TOLERANCE
from test_slurm_launch import ON_CLUSTER, _slurm, cluster, status  # noqa: F401  (cluster: the fixture)


def component_nodes(job_id: str) -> dict:
    """{"0": node list of the trainer component, "1": of the inference component}, from squeue."""
    rows = _slurm("squeue", "-h", "-j", job_id, "-o", "%i %N").split()
    return {jid.split("+")[1]: nodes for jid, nodes in zip(rows[::2], rows[1::2]) if "+" in jid and nodes}


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slurm_run_survives_a_killed_worker_a_corrupt_file_a_drained_node_and_a_requeue(cluster, tmp_path,
                                                                                         quickstart_sft_model, chaos_calm):
    run_dir = cluster.track(tmp_path / "run")
    follow = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.launch", *rl_overrides(quickstart_sft_model, STEPS, CHECKPOINT), *ON_CLUSTER,
         "launcher.wait=true", "inference.max_restarts=2", f"run_dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    def alive():
        return None if follow.poll() is None else f"the launch exited with {follow.returncode}"

    drained = ""
    try:
        wait_steps(run_dir, 2, alive, timeout=300)
        faults = [kill_role(run_dir, "inference", 0), corrupt_pending_file(run_dir)]
        wait_steps(run_dir, CHECKPOINT + 2, alive, timeout=300)  # past the first checkpoint
        (job_id,) = cluster.job_ids(run_dir)
        drained = component_nodes(job_id)["1"]
        snap = snapshot(run_dir)
        _slurm("scontrol", "update", f"nodename={drained}", "state=drain", "reason=rlhpc chaos test")
        at = len(ledger(run_dir))
        requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
        assert requeue.returncode == 0, requeue.stderr
        out, err = follow.communicate(timeout=600)
    finally:
        if drained:
            _slurm("scontrol", "update", f"nodename={drained}", "state=resume")
        if follow.poll() is None:
            follow.kill()
            follow.communicate()
    assert follow.returncode == 0, out + err
    assert f"job {job_id}: requeued (restart 1)" in out and f"job {job_id} COMPLETED" in out

    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    placed = re.findall(r"\(restart (\d+)\): trainer on (\S+), inference on (\S+);", batch_log)
    assert [p[0] for p in placed] == ["0", "1"], batch_log
    assert placed[0][2] == drained and placed[1][2] != drained  # the second attempt avoided the drained node
    assert "inference-0 exited with code 137" in batch_log and "restarting it (1 of inference.max_restarts=2)" in batch_log

    faults = survived(faults, run_dir, completed=True, log_text=batch_log)
    assert all(f.survived for f in faults), faults  # the worker restarted inside the job; the file quarantined
    groups = account(run_dir, [snap])
    print(f"requeued at step {at}; {groups.line()}")
    assert groups.steps == list(range(STEPS))
    assert groups.duplicated == [] and groups.lost == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS
    assert len(summary["resumed_at"]) == 1 and CHECKPOINT <= summary["resumed_at"][0] < STEPS
    assert f"step {STEPS}/{STEPS}" in status(run_dir)
    reward = heldout(run_dir)["rl"]
    print(f"held-out reward: warm start {chaos_calm['sft']:.3f}, undisturbed (local) {chaos_calm['rl']:.3f}, "
          f"chaos on Slurm {reward:.3f} (tolerance {REWARD_TOLERANCE})")
    assert abs(reward - chaos_calm["rl"]) <= REWARD_TOLERANCE
    assert reward >= chaos_calm["sft"] + MIN_GAIN
