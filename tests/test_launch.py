"""The local launcher as a user meets it: failures, signals, run directories, resume."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhpc.run.evaluation import read_curve
from rlhpc.run.metrics import read_rows
from rlhpc.run.preload import PRELOAD_NAME
from rlhpc.run.rundir import RunDir
from test_weights_members import alarms

TESTS = Path(__file__).resolve().parent
SMALL = ["+exp=reverse_text", "sft.steps=5", "eval.num_tasks=8", "eval.interval=0", "launcher.progress=false",
         "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1"]


def launch(run_dir, *overrides, timeout=240, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", *overrides],
        capture_output=True, text=True, timeout=timeout, env=env, **kw,
    )


def alarming_logs(run_dir) -> str:
    """What the role logs of `run_dir` show of a torch warning or a traceback (what reads as a crash), around it."""
    return alarms({p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")})


def rlhpc_processes(run_dir, roles_only: bool = False) -> list:
    """PIDs of processes started for `run_dir` (found by their environment): the roles and their helpers (each
    inference worker's environment pool, the launcher's preload process), or the roles only."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"RLHPC_RUN_DIR={run_dir}".encode() in environ:
            try:
                if roles_only and (b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
                                   or Path(f"/proc/{pid}/comm").read_text().strip() == PRELOAD_NAME):
                    continue
            except OSError:
                continue
            found.append(int(pid))
    return found


@pytest.mark.slow
def test_a_crashing_role_stops_the_others_and_the_launcher_shows_its_log(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "env.cls=crashing_env:CrashInWorkers", "trainer.steps=50", "inference.max_restarts=0",
                  env=env)
    assert proc.returncode == 1
    assert "inference-" in proc.stderr and "exited with code 1" in proc.stderr
    assert "reward model exploded" in proc.stderr  # the tail of the failed role's log
    assert rlhpc_processes(run_dir) == []



@pytest.mark.slow
def test_a_trainer_killed_by_a_signal_is_named_as_the_cause_not_the_worker_that_lost_it(tmp_path):
    """kill -9 (or the OOM killer) leaves no Python error and no status/FAILED of the killed role; the workers then fail
    on their dead weights-group peer and one of them writes the marker. The launcher and `rlhpc.status` name the
    trainer. (trainer.max_restarts=0: by default the trainer is started again, tests/test_chaos.py.)"""
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", "sft.steps=0",
                          "trainer.steps=10000", "inference.max_restarts=0", "trainer.max_restarts=0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ledger = run_dir / "queue" / "ledger.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not ledger.exists() or len(ledger.read_text().splitlines()) < 2):
        time.sleep(0.1)
    os.kill(json.loads((run_dir / "status" / "trainer-0.json").read_text())["pid"], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert "trainer-0 exited with code -9; ending the others" in err
    assert (run_dir / "logs" / "trainer-0.log").read_text().startswith("==== rlhpc: started trainer-0 at ")
    failed = json.loads((run_dir / "status" / "FAILED").read_text())
    assert (failed["role"], failed["rank"]) == ("trainer", 0) and "SIGKILL" in failed["error"]
    status = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir), "--no-slurm"], capture_output=True,
                            text=True, timeout=60)
    assert "trainer rank 0" in status.stdout and "SIGKILL" in status.stdout, status.stdout
    assert rlhpc_processes(run_dir) == []


def test_a_logs_tail_shows_the_process_that_ended_not_an_earlier_attempts_last_words(tmp_path):
    """Role logs are appended to over a run's launches and restarts; the launcher marks each start (LOG_START) and
    the tails it, rlhpc.status and the Slurm report show begin after the last mark."""
    from rlhpc.run.procs import LOG_START, tail

    log = tmp_path / "inference-1.log"
    log.write_text(f"{LOG_START} inference-1 at 2026-12-05 10:00:00 (launch 1-2)\nRuntimeError: weights group failed\n"
                   f"{LOG_START} inference-1 at 2026-12-05 10:05:00 (launch 3-4)\nloading\nSafetensorError: bad\n")
    assert tail(log).splitlines() == [f"{LOG_START} inference-1 at 2026-12-05 10:05:00 (launch 3-4)", "loading",
                                      "SafetensorError: bad"]
    assert tail(log, 1) == "SafetensorError: bad"
    unmarked = tmp_path / "slurm.out"  # a log no launcher marked (a Slurm job's output): its plain tail
    unmarked.write_text("a\nb\nc\n")
    assert tail(unmarked, 2) == "b\nc"

# A role that, on SIGTERM, takes `delay` seconds to end (a trainer finishing its step and checkpointing) and exits 75.
SLOW_TO_END = """
import signal, sys, time
def on_term(*_):
    time.sleep(float(sys.argv[1]))
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def slow_roles(tmp_path, delays):
    from rlhpc.cluster.local_launcher import Proc

    procs = []
    for role, delay in delays:
        log = open(tmp_path / f"{role}.log", "w+")
        popen = subprocess.Popen([sys.executable, "-c", SLOW_TO_END, str(delay)], stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
        assert popen.stdout.readline() == "ready\n"
        procs.append(Proc(role, 0, 1, popen, log))
    return procs


def test_on_a_stop_the_trainer_gets_its_grace_to_checkpoint_and_a_second_ctrl_c_cuts_it_short(tmp_path):
    """The local launcher's end of a stopped run: workers get 10 s, the trainer cluster.grace_s to finish its step and
    save (here 3 s of work: it exits 75, not killed); a second Ctrl-C (`cut`) kills at once."""
    from rlhpc.cluster.local_launcher import LocalLauncher

    launcher = LocalLauncher.__new__(LocalLauncher)  # its ending alone: no config, no preload process
    launcher.preload = None
    launcher.procs = slow_roles(tmp_path, [("trainer", 3), ("inference", 0)])
    t0 = time.time()
    launcher.end_all(grace_s=1, trainer_grace_s=30)
    assert [p.popen.returncode for p in launcher.procs] == [75, 75]
    assert 3 <= time.time() - t0 < 10

    launcher.procs = slow_roles(tmp_path, [("trainer", 60)])
    t0, cut_at = time.time(), time.time() + 1
    launcher.end_all(grace_s=1, trainer_grace_s=120, cut=lambda: time.time() > cut_at)
    assert launcher.procs[0].popen.returncode == -signal.SIGKILL
    assert time.time() - t0 < 10


@pytest.mark.slow
def test_sigint_ends_every_process_the_launcher_started(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", "trainer.steps=10000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(rlhpc_processes(run_dir, roles_only=True)) < 3:
        time.sleep(0.2)
    try:
        assert len(rlhpc_processes(run_dir, roles_only=True)) == 3
        time.sleep(2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 130
        assert "SIGINT" in err
        assert rlhpc_processes(run_dir) == []
    finally:  # a launcher that did not end must not train on beside the next tests
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        for leftover in rlhpc_processes(run_dir):
            os.kill(leftover, signal.SIGKILL)


@pytest.mark.slow
def test_a_launcher_killed_with_sigkill_leaves_no_role_behind_and_the_trainer_checkpoints(tmp_path):
    """kill -9 of the launcher (an OOM killer, a lost login node) cannot end its roles itself: each was asked at its
    start to get SIGTERM when the launcher dies (PR_SET_PDEATHSIG), and stops as on Ctrl-C."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", "trainer.steps=10000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ledger = run_dir / "queue" / "ledger.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and (not ledger.exists() or len(ledger.read_text().splitlines()) < 2):
            time.sleep(0.1)
        assert len(rlhpc_processes(run_dir, roles_only=True)) >= 3  # the roles (and the workers' environment pools)
        p.kill()
        p.wait(timeout=30)
        deadline = time.time() + 60  # the trainer finishes its step and saves
        while time.time() < deadline and rlhpc_processes(run_dir):
            time.sleep(0.2)
        assert rlhpc_processes(run_dir) == []
        assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] >= 2
        assert "stop requested" in (run_dir / "logs" / "trainer-0.log").read_text()
    finally:  # what a failure left running
        if p.poll() is None:
            p.kill()
        for leftover in rlhpc_processes(run_dir):
            os.kill(leftover, signal.SIGKILL)


@pytest.mark.slow
def test_closing_the_terminal_ends_every_process_and_the_trainer_checkpoints(tmp_path):
    """A launcher whose terminal is closed gets SIGHUP; its roles, in sessions of their own, do not. It ends them as on
    Ctrl-C, though printing to the closed terminal now fails: no process is left, the trainer checkpoints on its way
    out and `rlhpc.status` says how to go on."""
    import pty
    import select

    run_dir = tmp_path / "run"
    pid, terminal = pty.fork()  # the child leads a session whose controlling terminal is `terminal`
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}",
                                  "trainer.steps=10000"])
    ended = (0, 0)
    try:
        ledger, output = run_dir / "queue" / "ledger.jsonl", b""
        deadline = time.time() + 180
        while time.time() < deadline and (not ledger.exists() or len(ledger.read_text().splitlines()) < 2):
            if select.select([terminal], [], [], 0.1)[0]:
                output += os.read(terminal, 1 << 16)  # a terminal that is read, as a user's is
        assert ledger.exists(), output.decode(errors="replace")[-2000:]
        os.close(terminal)  # the window closed: the kernel hangs up the terminal
        deadline = time.time() + 150
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.time() < deadline:
            time.sleep(0.2)
        assert ended[0] == pid, "the launcher did not end after its terminal was closed"
        assert os.waitstatus_to_exitcode(ended[1]) == 128 + signal.SIGHUP
        assert rlhpc_processes(run_dir) == []
        assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] >= 2
    finally:  # what a failure left running
        for leftover in rlhpc_processes(run_dir) + ([pid] if ended[0] == 0 else []):
            os.kill(leftover, signal.SIGKILL)
        if ended[0] == 0:
            os.waitpid(pid, 0)
    status = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir), "--no-slurm"], capture_output=True,
                            text=True, timeout=60)
    assert f"stopped with a checkpoint: launch again with run_dir={run_dir} to go on" in status.stdout, status.stdout


def test_under_nohup_a_closed_terminal_does_not_stop_the_launcher():
    """`nohup` starts a process ignoring SIGHUP so that it outlives the terminal: the launcher keeps it ignored."""
    from rlhpc.run.procs import on_stop_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        replaced = on_stop_signals(lambda signum, frame: None)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert set(replaced) == {signal.SIGINT, signal.SIGTERM}
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert signal.SIGHUP in on_stop_signals(lambda signum, frame: None)  # not ignored: handled
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.slow
def test_a_finished_run_directory_is_not_overwritten_unless_asked(tmp_path):
    run_dir = tmp_path / "run"
    first = launch(run_dir, "trainer.steps=2")
    assert first.returncode == 0, first.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    # The progress bar and status end on the final held-out reward, not the one before the last step.
    beat = json.loads((run_dir / "status" / "trainer-0.json").read_text())
    assert (beat["step"], beat["heldout"], beat["heldout_version"]) == (2, summary["heldout_reward_rl"], 2)
    status = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir), "--no-slurm"], capture_output=True,
                            text=True, timeout=60).stdout
    assert f"held-out {summary['heldout_reward_rl']:.3f} (step 2)" in status, status
    pending = len(list((run_dir / "queue" / "pending").glob("*.safetensors")))
    assert (f"queue:   {pending} pending file(s) (generated past the last step: never trained)" if pending else
            "queue:   0 pending file(s);") in status, status
    again = launch(run_dir, "trainer.steps=2")
    assert again.returncode == 2
    assert "already holds a finished run" in again.stderr and "overwrite=true" in again.stderr
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    replaced = launch(run_dir, "trainer.steps=3", "overwrite=true")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == 3


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_from_its_checkpoint_and_trains_each_group_once(tmp_path):
    run_dir = tmp_path / "run"
    steps = 60
    args = [sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", f"trainer.steps={steps}"]
    ledger, err = stop_after(args, run_dir, 3)
    stopped_at = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
    assert 3 <= stopped_at < steps
    assert not (run_dir / "summary.json").exists()
    # The launcher says what was kept and the command that goes on: the user's, with run_dir named (the default one
    # would name a new folder).
    assert f"stopped: the trainer checkpointed on the way out; RL goes on at step {stopped_at} of {steps}. To go on:" \
        in err, err[-2000:]
    command = shlex.split(err.rsplit("To go on:", 1)[1].strip().splitlines()[0])
    assert command[:3] == ["python", "-m", "rlhpc.launch"] and f"run_dir={run_dir}" in command
    status = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir), "--no-slurm"], capture_output=True,
                            text=True, timeout=60)
    assert f"state:   stopped with a checkpoint: launch again with run_dir={run_dir} to go on" in status.stdout, \
        status.stdout

    resumed = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_at"] == [stopped_at] and summary["rl_steps"] == steps
    assert_each_step_and_group_once(ledger, steps)
    # Neither the stop nor the end: the trainer's store outlives the workers' use of it, in both launches.
    found = alarming_logs(run_dir)
    assert not found, found


def stop_after(args, run_dir, lines: int, ready=lambda: True):
    """Starts the launch `args`, and once its ledger has `lines` steps and `ready()` holds, stops it with SIGTERM (the
    trainer checkpoints); returns the ledger's path and the launcher's stderr."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ledger = run_dir / "queue" / "ledger.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None and \
            (not ledger.exists() or len(ledger.read_text().splitlines()) < lines or not ready()):
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err[-2000:]
    return ledger, err


def assert_each_step_and_group_once(ledger, steps: int):
    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(steps))
    uids = [u for e in entries for u in e["groups"]]
    assert len(uids) == len(set(uids))


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_one_before(tmp_path):
    """A truncated copy of the newest checkpoint (a filesystem that lost the end of a file): the launch warns, naming
    it and what is wrong, and the run resumes from the older checkpoint kept beside it; every step is in the ledger
    once, no group twice."""
    run_dir = tmp_path / "run"
    steps = 40
    args = [sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", f"trainer.steps={steps}",
            "trainer.checkpoint_interval=2", "eval.interval=1"]
    # The purge below is tested only if worker 0 evaluated a version past the older checkpoint before the stop: the
    # stop waits until it has evaluated one past the newest periodic checkpoint. Should a periodic checkpoint land
    # between that look and the stop (a loaded machine), the attempt is made again, from scratch.
    def evaluated_past_the_checkpoint() -> bool:
        latest, curve = run_dir / "checkpoints" / "latest.json", read_curve(RunDir(run_dir))
        try:
            return bool(curve) and curve[-1][0] > json.loads(latest.read_text())["step"]
        except (OSError, ValueError, KeyError):  # no checkpoint yet, or one being replaced
            return False

    for _ in range(3):
        shutil.rmtree(run_dir, ignore_errors=True)
        ledger, _ = stop_after(args, run_dir, 5, ready=evaluated_past_the_checkpoint)
        first_curve = read_curve(RunDir(run_dir))
        newest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]
        kept = sorted(d.name for d in (run_dir / "checkpoints").glob("step_*"))
        assert len(kept) == 2 and kept[-1] == f"step_{newest:08d}", kept
        older = int(kept[0].split("_")[1])
        if any(v > older for v, _ in first_curve):
            break
    assert any(v > older for v, _ in first_curve), (older, first_curve)
    data = run_dir / "checkpoints" / kept[-1] / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)

    resumed = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"warning: run_dir={run_dir}: damaged checkpoint(s) skipped ({kept[-1]}: __0_0.distcp holds "
            in resumed.stderr), resumed.stderr[-3000:]
    assert f"resuming from the newest whole one, {kept[0]}: the steps after it train again" in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_at"] == [older] and summary["rl_steps"] == steps
    assert_each_step_and_group_once(ledger, steps)
    # The steps after the older checkpoint were logged twice, by each attempt; the metrics show the second.
    written = [json.loads(line) for line in (run_dir / "logs" / "trainer-0.metrics.jsonl").read_text().splitlines()]
    assert len([r for r in written if "lr" in r]) > steps
    assert [r["step"] for r in read_rows(RunDir(run_dir), "trainer") if "lr" in r] == list(range(1, steps + 1))
    # So were held-out evaluations of versions past it: the curve and TensorBoard show the second attempt's, once.
    curve = read_curve(RunDir(run_dir))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb" / "inference-0" / "eval"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("eval/heldout_reward")]
    assert shown == [(v, pytest.approx(r)) for v, r in curve if v > 0], (shown, curve, first_curve)
