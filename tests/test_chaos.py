"""Chaos at reduced size: during one run, inference workers are killed three times, the trainer once, two queue files
are corrupted and a worker freezes for seconds. The run completes; the ledger shows every step trained once and no
group twice."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_elastic import role_pid
from test_launch import SMALL, rlhpc_processes

STEPS = 30


def ledger_len(run_dir):
    path = run_dir / "queue" / "ledger.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_steps(run_dir, n, proc, timeout=180):
    deadline = time.time() + timeout
    while ledger_len(run_dir) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"step {n} not reached"
        time.sleep(0.05)


def kill_worker(run_dir, rank):
    deadline = time.time() + 60
    while (pid := role_pid(run_dir, "inference", rank)) is None:  # between two lives
        assert time.time() < deadline
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)


def corrupt_a_pending_file(run_dir):
    """Damages a published file in place (a bad disk block, a buggy copy): it must be quarantined, not trained."""
    deadline = time.time() + 60
    while time.time() < deadline:
        for path in sorted((run_dir / "queue" / "pending").glob("*.safetensors")):
            try:
                with open(path, "r+b") as f:
                    f.seek(8)
                    f.write(b"\x00" * 64)
                return path.name
            except FileNotFoundError:
                continue
        time.sleep(0.02)
    raise AssertionError("no pending file to corrupt")


@pytest.mark.slow
def test_a_run_survives_killed_workers_a_killed_trainer_corrupt_files_and_a_frozen_worker(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", f"trainer.steps={STEPS}",
            "trainer.checkpoint_interval=5", "weights.transport=filesystem", "inference.max_restarts=3",
            "queue.lease_s=3", "async_level=1"]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_steps(run_dir, 3, first)
    kill_worker(run_dir, 0)                                    # fault 1
    corrupted = [corrupt_a_pending_file(run_dir)]              # fault 2
    wait_steps(run_dir, 6, first)
    kill_worker(run_dir, 1)                                    # fault 3
    wait_steps(run_dir, 12, first)
    trainer = role_pid(run_dir, "trainer", 0)
    os.killpg(trainer, signal.SIGKILL)                         # fault 4: the launcher ends the run ...
    _, err = first.communicate(timeout=120)
    assert first.returncode == 1 and "trainer-0 exited with code -9" in err
    resumed_from = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    assert resumed_from >= 10

    second = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # ... and is relaunched
    wait_steps(run_dir, resumed_from + 2, second)
    kill_worker(run_dir, 0)                                    # fault 5
    corrupted.append(corrupt_a_pending_file(run_dir))          # fault 6
    wait_steps(run_dir, resumed_from + 5, second)
    frozen = role_pid(run_dir, "inference", 1)
    os.killpg(frozen, signal.SIGSTOP)                          # fault 7: a worker stalls for 4 s (its lease expires)
    time.sleep(4)
    os.killpg(frozen, signal.SIGCONT)
    _, err = second.communicate(timeout=240)
    assert second.returncode == 0, err[-3000:]

    entries = [json.loads(line) for line in (run_dir / "queue" / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(STEPS))
    uids = [u for e in entries for u in e["groups"]]
    assert len(uids) == len(set(uids)) and not any(e.get("skipped") for e in entries)
    quarantined = {p.name[: -len(".reason")] for p in (run_dir / "queue" / "quarantine").glob("*.reason")}
    assert set(corrupted) <= quarantined
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and summary["resumed_at"] == [resumed_from]
    assert "restarting it (1 of inference.max_restarts=3)" in err
    assert rlhpc_processes(run_dir) == []
