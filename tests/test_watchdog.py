"""The local launcher's hang watchdog (cluster.hang_timeout_s, rlhpc/cluster/watchdog.py): a trainer that stops
advancing is noticed, every role's stacks land in its log, stuck workers are killed for the restart policy, and a stuck
trainer ends the run naming it."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from faults import role_pid
from rlhpc.cluster.watchdog import HANG_STEPS, HangWatch, main_thread_place
from rlhpc.run.rundir import RunDir
from test_launch import SMALL, rlhpc_processes


def test_the_timeout_is_the_floor_or_twenty_times_the_slowest_recent_step(tmp_path):
    run = RunDir(tmp_path)
    run.status.mkdir(parents=True)
    watch = HangWatch(floor_s=2.0, run=run)
    assert not watch.due()  # no heartbeat yet: a model's load is not a hang
    run.heartbeat("trainer", 0, phase="sft", sft_step=1)
    watch.last_change -= 10
    assert not watch.due()  # the warm start is not watched
    for step in range(3):
        run.heartbeat("trainer", 0, step=step)
        watch.next_look = 0.0
        assert not watch.due()
        time.sleep(0.05)
    assert watch.timeout_s() == 2.0  # 20 x ~0.05 s is below the floor
    watch.changes = [0.0, 1.0, 4.0]  # steps of 1 s and 3 s
    assert watch.timeout_s() == HANG_STEPS * 3.0
    watch.changes = [0.0, 0.05]
    watch.last_change -= 2.5
    watch.next_look = 0.0
    assert watch.due()
    assert not HangWatch(floor_s=0.0, run=run).due()  # 0: no watchdog


DUMP = '''Thread 0x00007f1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/site/rlhpc/transport/queue.py", line 890 in _renew

Current thread 0x00007f0 (most recent call first):
  File "/usr/lib/python3.11/time.py", line 1 in sleep
  File "/site/rlhpc/transport/queue.py", line 634 in claim
  File "/site/rlhpc/train/trainer.py", line 126 in run
  File "/site/rlhpc/role.py", line 60 in main
'''


def test_a_stack_dump_names_the_main_threads_innermost_rlhpc_frame():
    assert main_thread_place(DUMP) == "rlhpc/transport/queue.py:634 claim (innermost: time.py:1 sleep)"
    assert main_thread_place("no dump here") == ""


def start(run_dir, *overrides):
    return subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}",
                             "cluster.hang_timeout_s=4", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def end(p):
    """A launcher left running by a failed assertion: SIGTERM ends every role it started (stopped ones by SIGKILL
    after its grace); a bare SIGKILL would leave them behind."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_steps(run_dir, n, timeout=180):
    ledger = run_dir / "queue" / "ledger.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ledger.exists() and len(ledger.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{n} steps not trained within {timeout}s")


def freeze_after(run_dir, roles, *overrides, steps_first=12):
    """A launch with a 4 s hang floor whose `roles` are stopped with SIGSTOP once `steps_first` steps are trained; it is
    then followed to its end: (the launcher's process, its stderr)."""
    p = start(run_dir, *overrides)
    try:
        wait_steps(run_dir, steps_first)
        for role, rank in roles:
            os.kill(role_pid(run_dir, role, rank), signal.SIGSTOP)
        _, err = p.communicate(timeout=300)
    finally:
        end(p)
    return p, err


@pytest.mark.slow
def test_a_stopped_trainer_is_named_with_every_roles_stack_then_restarted_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    steps = 25
    p, err = freeze_after(run_dir, [("trainer", 0)], f"trainer.steps={steps}", "trainer.checkpoint_interval=5")
    assert p.returncode == 0, err[-3000:]
    assert "hang: the trainer's heartbeat has not changed for" in err
    assert "trainer-0 (pid" in err and "is stopped (SIGSTOP or a debugger)" in err
    assert "hang: ending the trainer (trainer-0 (pid" in err
    for name in ("inference-0", "inference-1"):  # running workers: their stacks, and where they are, named
        assert "(most recent call first)" in (run_dir / "logs" / f"{name}.log").read_text()
        assert re.search(rf"{name} \(pid \d+\) is in rlhpc/\S+\.py:\d+ ", err), err[-3000:]
    restarted = re.search(r"restarting the trainer \(1 of trainer.max_restarts=2\) in 2s from its newest checkpoint "
                          r"\(step (\d+)\), with fresh inference workers", err)
    assert restarted, err[-3000:]
    resumed = int(restarted.group(1))
    assert resumed >= 10 and resumed % 5 == 0  # frozen after 12 steps were trained, checkpoints every 5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == steps and summary["resumed_at"] == [resumed]
    entries = [json.loads(line) for line in (run_dir / "queue" / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(steps))  # every step once
    assert rlhpc_processes(run_dir) == []


@pytest.mark.slow
def test_stopped_workers_are_killed_and_restarted_and_the_run_trains_every_step_once(tmp_path):
    run_dir = tmp_path / "run"
    steps = 30
    # Weights through files: the trainer goes on to wait for rollouts, not inside a collective with stopped members.
    p, err = freeze_after(run_dir, [("inference", 0), ("inference", 1)], f"trainer.steps={steps}",
                          "weights.transport=filesystem", "queue.lease_s=5")
    assert p.returncode == 0, err[-3000:]
    assert "hang: the trainer waits on the inference workers; killing inference-0, inference-1" in err
    assert "trainer-0 (pid" in err and "is in rlhpc/transport/queue.py" in err
    assert "inference-0 exited with code -9; restarting it" in err
    entries = [json.loads(line) for line in (run_dir / "queue" / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(steps))  # every step once
    assert rlhpc_processes(run_dir) == []
