"""Workers come back by default: a dead inference worker is restarted within a budget (inference.max_restarts per
inference.restart_window_s, after a growing back-off), one that crashes at every start is not, and the run says why;
the same policy runs in the local launcher and in the Slurm job's task loop."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhpc.cluster.restarts import BACKOFF_CAP_S, Death, RestartPolicy, decide, last_line
from test_launch import SMALL, TESTS, rlhpc_processes

POLICY = RestartPolicy(max_restarts=3, window_s=3600, backoff_s=1.0)


def killed(t, worked=True):
    return Death(t, -9, "weights group: joined epoch 2", worked)


def test_restarts_count_within_the_window_and_the_budget_renews_as_it_slides():
    assert [decide([killed(t) for t in (0, 10, 20)[:k]], POLICY).restart for k in (1, 2, 3)] == \
        [True, True, True]
    spent = decide([killed(t) for t in (0, 10, 20, 30)], POLICY)
    assert not spent.restart
    assert "died 4 times within inference.restart_window_s=3600s" in spent.why_not
    assert "raise inference.max_restarts" in spent.why_not
    # An hour after the first death, only three fall in the window: the fourth restart is allowed.
    assert decide([killed(t) for t in (0, 10, 20, 3601)], POLICY).count == 3
    whole_run = RestartPolicy(max_restarts=3, window_s=0, backoff_s=1.0)
    assert not decide([killed(t) for t in (0, 5000, 10000, 15000)], whole_run).restart


def test_the_back_off_doubles_with_each_restart_in_the_window_up_to_the_cap():
    many = RestartPolicy(max_restarts=100, window_s=3600, backoff_s=1.0)
    delays = [decide([killed(t) for t in range(k)], many).delay_s for k in range(1, 10)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60] and BACKOFF_CAP_S == 60
    # Deaths older than the window no longer count: the back-off starts over.
    assert decide([killed(0), killed(1), killed(5000)], many).delay_s == 1


def test_a_worker_that_dies_the_same_way_without_working_is_not_restarted_again():
    crash = Death(0, 1, "RuntimeError: tool server unreachable at startup", worked=False)
    assert decide([crash], POLICY).restart  # one death says nothing of the next start
    again = decide([crash, Death(5, 1, crash.last_line, worked=False)], POLICY)
    assert not again.restart
    assert ("it crashed the same way at two starts in a row (exit code 1, last log line: RuntimeError: tool "
            "server unreachable at startup)") in again.why_not
    # It worked in between (published a batch): a kill at the same spot of two lives is no crash loop.
    assert decide([killed(0), killed(5, worked=True)], POLICY).restart
    # Numbers aside: the ids of the tasks it drew, its pid, differ from life to life.
    assert not decide([Death(0, 1, "EnvironmentFailure: 8 of 8 samples failed (task 15856-0)", False),
                       Death(5, 1, "EnvironmentFailure: 8 of 8 samples failed (task 20343-0)", False)], POLICY).restart
    # Another error, or another exit code, at the second start: restarted.
    assert decide([crash, Death(5, 1, "OSError: disk quota", worked=False)], POLICY).restart
    assert decide([crash, Death(5, -9, crash.last_line, worked=False)], POLICY).restart


def test_max_restarts_0_restarts_nothing():
    assert not decide([killed(0)], RestartPolicy(0, 3600, 1.0)).restart


def test_two_deaths_at_the_same_log_line_compare_equal_without_their_timestamps():
    a = last_line("2026-12-07 04:01:02,123 inference[0] INFO rlhpc.infer.worker: loading the engine\n\n")
    b = last_line("x\n2026-12-07 05:11:12,999 inference[0] INFO rlhpc.infer.worker: loading the engine")
    assert a == b == "inference[0] INFO rlhpc.infer.worker: loading the engine"
    assert last_line("") == ""


# ---- the Slurm job's task loop (bash), with a stand-in for Python that plays the role ------------------------------

FAKE_PYTHON = """#!/bin/bash
if [[ $2 == rlhpc.run.slurm_identity ]]; then echo inference-0; exit 0; fi
lives=$(cat "$RLHPC_RUN_DIR/lives" 2>/dev/null || echo 0); echo $((lives + 1)) >"$RLHPC_RUN_DIR/lives"
echo "$(date '+%Y-%m-%d %H:%M:%S,%3N') inference[0] INFO rlhpc.role: starting inference rank 0 (restart $RLHPC_RESTART)"
if (( lives < ${WORKING_LIVES:-0} )); then  # publishes (a heartbeat), then is killed
    echo '{"pid": 1}' >"$RLHPC_RUN_DIR/status/inference-0.json"; exit 137
fi
echo '{"role": "inference", "rank": 0, "error": "RuntimeError(boom)"}' >"$RLHPC_RUN_DIR/status/inference-0.error"
echo "RuntimeError: boom (task 77$lives-3)"; exit 1
"""


def task_loop(tmp_path, **env):
    from rlhpc.cluster.hetjob import _TASK

    run = tmp_path / "run"
    (run / "status").mkdir(parents=True)
    (run / "logs").mkdir()
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "RLHPC_PYTHON": str(python), "RLHPC_RUN_DIR": str(run), "RLHPC_MAX_RESTARTS": "3",
           "RLHPC_RESTART_WINDOW_S": "3600", "RLHPC_RESTART_BACKOFF_S": "0.1", **env}
    proc = subprocess.run(["bash", "-c", _TASK], capture_output=True, text=True, env=env, timeout=60)
    return proc, run


def test_the_slurm_task_loop_restarts_a_worker_that_worked_and_stops_one_that_crashes_at_every_start(tmp_path):
    proc, run = task_loop(tmp_path, WORKING_LIVES="2")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert "inference-0 exited with code 137" in lines[0] and "restarting it (1 of inference.max_restarts=3) in 0.1s" \
        in lines[0]
    assert "restarting it (2 of inference.max_restarts=3) in 0.2s" in lines[1]
    assert "restarting it (3 of inference.max_restarts=3) in 0.4s" in lines[2]  # the first crash
    assert ("not restarting it: it crashed the same way at two starts in a row (exit code 1, last log line: "
            "RuntimeError: boom (task 773-3))") in lines[3]
    assert (run / "lives").read_text() == "4\n"
    assert json.loads((run / "status" / "FAILED").read_text())["error"] == "RuntimeError(boom)"


def test_the_slurm_task_loop_stops_restarting_when_the_budget_is_spent(tmp_path):
    proc, run = task_loop(tmp_path, WORKING_LIVES="99", RLHPC_MAX_RESTARTS="2")
    assert proc.returncode == 137
    assert "not restarting it: it died 3 times within inference.restart_window_s=3600s" in proc.stderr
    assert json.loads((run / "status" / "FAILED").read_text())["rank"] == 0  # its exit code stands in for its error
    proc, run = task_loop(tmp_path / "attached", WORKING_LIVES="99", RLHPC_MAX_RESTARTS="2", RLHPC_ATTACH="1")
    assert "not restarting it" in proc.stderr and not (run / "status" / "FAILED").exists()  # never the run's failure
    proc, run = task_loop(tmp_path / "off", RLHPC_MAX_RESTARTS="0")  # fail-fast: the first death ends the task
    assert proc.returncode == 1 and proc.stderr == "" and (run / "lives").read_text() == "1\n"


# ---- the local launcher, end to end ---------------------------------------------------------------------------------


def wait_until(ok, timeout, what):
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


@pytest.mark.slow  # over 10 s here: a short run from a tiny model, a worker killed and restarted mid-run
def test_under_default_settings_a_worker_killed_mid_run_is_restarted_and_the_run_finishes(tmp_path):
    run_dir, steps = tmp_path / "run", 12
    # Restart settings as shipped. A kill that lands mid-broadcast holds the survivors in the broken collective for
    # weights.member_timeout_s (60 s by default): shortened here, it only shortens the test. One worker: with two, the
    # other could generate the run's last steps before the killed one is back (CI once finished the run first). Its
    # next life must get the newest weights while the trainer waits for its rollouts: with two trainer ranks (FSDP)
    # both take part in sending them again.
    p = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", f"trainer.steps={steps}",
                          "inference.num_workers=1", "trainer.num_ranks=2", "weights.member_timeout_s=10"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ledger = run_dir / "queue" / "ledger.jsonl"
        beat = run_dir / "status" / "inference-0.json"
        wait_until(lambda: ledger.exists() and len(ledger.read_text().splitlines()) >= 2 and beat.exists()
                   or p.poll() is not None, 180, "no trained step")
        assert p.poll() is None, p.communicate()[1][-3000:]
        os.killpg(json.loads(beat.read_text())["pid"], signal.SIGKILL)  # the worker and its environment pool, as when the OOM killer strikes
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:  # the test failed: Ctrl-C ends the run's processes too
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
    assert p.returncode == 0, err[-3000:]
    assert ("inference-0 exited with code -9; restarting it (1 of inference.max_restarts=3) in 1s (restarts count "
            "within inference.restart_window_s=3600s)") in err
    assert "restart 1)" in (run_dir / "logs" / "inference-0.log").read_text()  # its second life started
    assert "sent again, to the worker(s) that joined since" in (run_dir / "logs" / "trainer-0.log").read_text()
    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(steps))
    assert not (run_dir / "status" / "FAILED").exists()
    assert rlhpc_processes(run_dir) == []


@pytest.mark.slow  # over 10 s here: a short run whose workers die at every start, twice each
def test_under_default_settings_a_worker_that_crashes_at_every_start_ends_the_run_saying_why(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", "trainer.steps=50",
                           "env.cls=crashing_env:FailsToStartInWorkers"],
                          capture_output=True, text=True, timeout=240, env=env)
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "restarting it (1 of inference.max_restarts=3) in 1s" in proc.stderr  # once, after the first crash
    said = [line for line in proc.stderr.splitlines() if "not restarting it" in line]
    assert said and "crashed the same way at two starts in a row (exit code 1, last log line: RuntimeError: tool " \
        "server unreachable at startup) without doing any work in between" in said[0], proc.stderr[-3000:]
    assert "fix the cause (its log), then launch the same command to resume" in said[0]
    failed = json.loads((run_dir / "status" / "FAILED").read_text())
    assert failed["role"] == "inference" and "tool server unreachable" in failed["error"]
    assert took < 120, took  # not the budget's three restarts, nor the trainer's wait for rollouts
    assert rlhpc_processes(run_dir) == []


@pytest.mark.slow  # over 10 s here: a short run whose workers die at their first start
def test_sigterm_during_a_back_off_ends_the_run_at_once_and_starts_nothing_more(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", "trainer.steps=50",
                          "env.cls=crashing_env:FailsToStartInWorkers", "inference.restart_backoff_s=300"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in p.stderr:  # the launcher's word that a worker waits out its back-off
            if "restarting it (1 of inference.max_restarts=3) in 300s" in line:
                break
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143
    assert took < 30, took  # the trainer's checkpoint grace at most, not the back-off
    assert all("restart 1" not in log.read_text() for log in (run_dir / "logs").glob("inference-*.log"))
    assert rlhpc_processes(run_dir) == []


def test_the_trainers_policy_names_its_own_keys_and_counts_a_newer_checkpoint_as_work():
    from rlhpc.config.schema import Config

    policy = RestartPolicy.of_trainer(Config().trainer)
    assert (policy.max_restarts, policy.window_s, policy.section) == (2, 3600.0, "trainer")
    assert [decide([killed(t) for t in range(k)], policy).restart for k in (1, 2, 3)] == [True, True, False]
    assert "more than trainer.max_restarts=2 restarts allow: raise trainer.max_restarts" in \
        decide([killed(t) for t in range(3)], policy).why_not
    oom = Death(0, -9, "trainer[0] INFO rlhpc.train.trainer: step 12 loss 0.1", worked=False)
    assert not decide([oom, Death(9, -9, "trainer[0] INFO rlhpc.train.trainer: step 12 loss 0.3", worked=False)],
                      policy).restart  # killed at the same step twice, no checkpoint in between
    assert decide([killed(0, worked=False)], RestartPolicy(0, 0, 2.0, "trainer")).why_not == \
        "trainer.max_restarts=0: a dead trainer ends the run"


def test_the_local_launcher_restarts_a_killed_trainer_but_not_one_that_raised_or_was_stopped(tmp_path):
    """What ends the launcher's watch decides: a trainer killed by a signal is started again (after the back-off), one
    that exited with a Python error, or died while the run was being stopped, or beyond its budget, is not."""
    from rlhpc.cluster.local_launcher import LocalLauncher, Proc
    from rlhpc.config.schema import Config
    from rlhpc.run.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.make()
    launcher = LocalLauncher(Config())

    def trainer_that(code):
        if launcher.failure is not None:
            launcher.failure.log.close()
        popen = subprocess.Popen([sys.executable, "-c", f"import os, signal, sys; "
                                  f"os.kill(os.getpid(), {-code}) if {code} < 0 else sys.exit({code})"])
        popen.wait(timeout=30)
        launcher.failure = Proc("trainer", 0, 1, popen, open(run.log_file("trainer", 0), "ab"))
        run.log_file("trainer", 0).write_text(f"step 7 of a life that ended with {code}\n")

    trainer_that(-signal.SIGKILL)
    assert launcher.trainer_restart(run, 1, {"signal": None}) == 2.0
    trainer_that(1)  # a traceback in its log: a restart would repeat it
    assert launcher.trainer_restart(run, 1, {"signal": None}) is None
    trainer_that(-signal.SIGKILL)
    assert launcher.trainer_restart(run, 130, {"signal": signal.SIGINT}) is None  # Ctrl-C: the run stops
    trainer_that(-signal.SIGSEGV)
    assert launcher.trainer_restart(run, 1, {"signal": None}) == 4.0  # the second in the window: twice the wait
    trainer_that(-signal.SIGKILL)
    assert launcher.trainer_restart(run, 1, {"signal": None}) is None  # 2 restarts spent
    launcher.failure.log.close()

    # Found hung (the watchdog): the trainer, still alive (stopped), is killed first, then started again.
    hung = LocalLauncher(Config())
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    os.kill(stopped.pid, signal.SIGSTOP)
    with open(run.log_file("trainer", 0), "ab") as log:
        hung.failure, hung.hung = Proc("trainer", 0, 1, stopped, log), True
        assert hung.trainer_restart(run, 1, {"signal": None}) == 2.0
    assert stopped.returncode == -signal.SIGKILL
    assert hung.trainer_deaths[-1].last_line.startswith("hung: ")
