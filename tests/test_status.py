"""`python -m rlhpc.status RUN_DIR` as a user reads it: where a run stands, from its run directory alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhpc.run.evaluation import write_result
from rlhpc.run.rundir import RunDir, write_json


def status(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir), *args], capture_output=True, text=True,
                          timeout=60, env=env)


def a_run(tmp_path: Path, step: int = 3, steps: int = 10) -> RunDir:
    """A run directory as the roles leave it mid-run: heartbeats, the trainer's metrics, a queue."""
    run = RunDir(tmp_path / "run").make()
    run.config.write_text(f"trainer:\n  steps: {steps}\n")
    rows = [{"step": -1, "time": 0, "sft/loss": 2.0}]
    rows += [{"step": s, "time": 0, "rollout/reward": 0.1 * s, "async/staleness_mean": 0.5} for s in range(1, step + 1)]
    (run.logs / "trainer-0.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_result(run, 0, 0.125, tasks=8)  # the warm start's
    write_result(run, 2, 0.25, tasks=8)  # inference worker 0's
    run.heartbeat("trainer", 0, step=step, steps=steps)
    run.heartbeat("inference", 0, version=step)
    run.heartbeat("inference", 1, version=step - 1)
    (run.queue / "pending").mkdir(parents=True, exist_ok=True)
    for name in ("w0a1-00000007.safetensors", "w1a1-00000004.safetensors", ".tmp-w1a1-00000005.safetensors"):
        (run.queue / "pending" / name).write_bytes(b"")
    return run


def test_a_local_run_shows_step_rewards_queue_and_heartbeats_and_no_slurm_job(tmp_path):
    run = a_run(tmp_path)
    proc = status(run.root)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "no Slurm job recorded" in out
    assert "step 3/10" in out
    assert "reward 0.300 (step 3)" in out and "held-out 0.250 (step 2)" in out
    assert "2 pending file(s)" in out and "staleness 0.500" in out
    for name in ("trainer-0", "inference-0", "inference-1"):
        assert name in out
    assert "s ago" in out


def test_a_local_run_whose_launcher_and_roles_are_gone_is_stopped_not_running(tmp_path):
    """A local run killed outright (its launcher kill -9'd, the machine restarted) leaves no marker; its launch lock
    names the launcher's pid, and neither it nor the roles' pids live: the status says so, and how to go on."""
    run = a_run(tmp_path)
    with open(run.config, "a") as f:
        f.write("launcher:\n  name: local\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    (run.root / ".launch.lock").write_text(f"pid {dead.pid} on {os.uname().nodename}\n")
    for name in ("trainer-0", "inference-0", "inference-1"):
        beat = json.loads((run.status / f"{name}.json").read_text())
        write_json(run.status / f"{name}.json", dict(beat, pid=dead.pid))
    out = status(run.root, "--no-slurm").stdout
    assert (f"state:   stopped: its launcher (pid {dead.pid} on {os.uname().nodename}) and its roles are gone, and "
            f"none said why (killed?); launch again with run_dir={run.root} to go on") in out, out
    # A role still alive, or the launcher (processes whose command lines name them, as theirs do): still running.
    for module, mark in (("rlhpc.role", run.status / "inference-1.json"), ("rlhpc.launch", run.root / ".launch.lock")):
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", module])
        try:
            if module == "rlhpc.role":
                write_json(mark, dict(beat, pid=alive.pid))
            else:
                mark.write_text(f"pid {alive.pid} on {os.uname().nodename}\n")
            assert "state:   running or not started" in status(run.root, "--no-slurm").stdout, module
        finally:
            alive.kill()
            alive.wait()


def test_a_launch_into_a_run_dir_that_a_live_role_writes_is_refused_and_accepted_once_it_ends(tmp_path):
    """The same live-role test as the status's (RunDir.live_roles) guards a relaunch: a fresh heartbeat from this
    host whose pid runs rlhpc.role refuses it; once that process is gone the launch may go on."""
    from rlhpc.preflight.rundir import RunDirError, check_not_running

    run = a_run(tmp_path)
    for name in ("inference-0", "inference-1"):
        (run.status / f"{name}.json").unlink()
    role = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "rlhpc.role"])
    try:
        beat = json.loads((run.status / "trainer-0.json").read_text())
        write_json(run.status / "trainer-0.json", dict(beat, pid=role.pid))
        with pytest.raises(RunDirError, match=f"being written by a running launch \\(trainer-0 is pid {role.pid}\\)"):
            check_not_running(run)
    finally:
        role.kill()
        role.wait()
    check_not_running(run)


def test_a_failed_run_names_the_role_its_error_and_the_end_of_its_log(tmp_path):
    run = a_run(tmp_path)
    run.log_file("inference", 1).write_text("starting\nTraceback (most recent call last):\nRuntimeError: boom\n")
    write_json(run.failed, {"role": "inference", "rank": 1, "error": "RuntimeError('boom')"})
    out = status(run.root).stdout
    assert "state:   failed" in out
    assert "inference rank 1: RuntimeError('boom')" in out
    assert "RuntimeError: boom" in out  # the log's last lines


def test_a_slurm_run_shows_its_job_even_where_slurm_does_not_answer(tmp_path):
    run = a_run(tmp_path)
    write_json(run.root / "jobs.json", {"jobs": [{"job_id": "77", "name": "rlhpc-x", "launcher": "slurm",
                                                  "submitted": time.time()}]})
    no_slurm = dict(os.environ, PATH=str(tmp_path / "empty"))  # no sacct, no squeue
    proc = status(run.root, env=no_slurm)
    assert proc.returncode == 0, proc.stderr
    assert "job 77 rlhpc-x: UNKNOWN (neither sacct nor squeue answered)" in proc.stdout
    assert "step 3/10" in proc.stdout


def test_json_output_carries_the_same_facts(tmp_path):
    run = a_run(tmp_path, step=4, steps=8)
    info = json.loads(status(run.root, "--json", "--no-slurm").stdout)
    assert info["trainer"]["step"] == 4 and info["trainer"]["steps"] == 8
    assert info["trainer"]["staleness_mean"] == 0.5
    assert info["queue_pending_files"] == 2
    assert set(info["heartbeats"]) == {"trainer-0", "inference-0", "inference-1"}
    assert info["jobs"] == []


def test_a_folder_that_is_not_a_run_directory_is_named(tmp_path):
    proc = status(tmp_path)
    assert proc.returncode == 2
    assert str(tmp_path) in proc.stderr and "not a run directory" in proc.stderr


def test_the_status_says_which_side_waits_for_the_other(tmp_path):
    """From the recent metrics rows of each process: how much of its time it worked and how much it waited."""
    run = a_run(tmp_path)
    trainer = [{"step": s, "time": 100.0 + 2 * s, "perf/train_s": 0.6, "weights/publish_s": 0.1,
                "perf/rollout_wait_s": 1.2} for s in range(10)]
    (run.logs / "trainer-0.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trainer))
    for rank in (0, 1):
        worker = [{"step": s, "time": 100.0 + s, "perf/generate_s": 0.95, "perf/idle_s": 0.0} for s in range(20)]
        (run.logs / f"inference-{rank}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in worker))
    out = status(run.root).stdout
    assert "trainer-0 busy 35%, waiting 60%" in out and "inference-1 busy 95%, waiting 0%" in out
    assert "the trainer waits for rollouts 60% of the time: generation is the bottleneck" in out


# The status runs while the roles write: a half-written or damaged file is named, and everything else still shows.
@pytest.mark.parametrize("name", ["summary.json", "status/trainer-0.json", "status/FAILED", "evals/v000002.json",
                                  "jobs.json", "rendezvous/serve-0.json"])
@pytest.mark.parametrize("content", ["", '{"role": "infer'], ids=["empty", "cut"])
def test_a_half_written_file_is_named_and_the_rest_still_shows(tmp_path, name, content):
    run = a_run(tmp_path)
    (run.root / name).write_text(content)
    proc = status(run.root, "--no-slurm")
    assert proc.returncode == 0, proc.stderr
    assert f"unreadable: {name} (JSONDecodeError: " in proc.stdout
    assert "step 3/10" in proc.stdout and "inference-1" in proc.stdout


def test_a_metrics_row_that_is_not_numbers_is_skipped_and_named(tmp_path):
    run = a_run(tmp_path)
    with open(run.logs / "trainer-0.metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": "x", "time": 0, "rollout/reward": 1.0}) + "\n")
    proc = status(run.root, "--no-slurm")
    assert proc.returncode == 0, proc.stderr
    why = "1 row(s) skipped: a metrics row holds numbers only"
    assert f"unreadable: logs/trainer-0.metrics.jsonl ({why})" in proc.stdout
    assert "step 3/10  reward 0.300 (step 3)" in proc.stdout


def test_json_output_lists_the_unreadable_files(tmp_path):
    run = a_run(tmp_path)
    healthy = json.loads(status(run.root, "--json", "--no-slurm").stdout)
    run.summary.write_text("")
    info = json.loads(status(run.root, "--json", "--no-slurm").stdout)
    assert healthy["unreadable"] == {}
    assert list(info["unreadable"]) == ["summary.json"]
    assert info["unreadable"]["summary.json"].startswith("JSONDecodeError: ")
    assert info["trainer"]["step"] == 3


def test_a_moved_run_says_its_job_script_names_the_old_folder(tmp_path):
    """job.sbatch names its run_dir: a folder moved since would be written by a job submitted from it by hand (and
    Slurm could not open its log there). Status says so, and how to write the script anew."""
    from hydra import compose, initialize_config_dir

    from rlhpc.cluster.hetjob import make_plan, render_script
    from rlhpc.config import schema as config_mod

    run = a_run(tmp_path)
    config_mod.register()

    def script_for(run_dir: Path) -> str:
        with initialize_config_dir(config_dir=str(config_mod.CONF_DIR), version_base=None):
            cfg = config_mod.to_typed(compose(config_name="config", overrides=[
                "+exp=reverse_text", "cluster=local", "launcher=sbatch", f"run_dir={run_dir}"]))
        return render_script(make_plan(cfg), cfg.exp_name)

    (run.root / "job.sbatch").write_text(script_for(run.root))
    assert "script:" not in status(run.root, "--no-slurm").stdout
    old = tmp_path / "old place"
    (run.root / "job.sbatch").write_text(script_for(old))
    out = status(run.root, "--no-slurm").stdout
    assert (f"script:  job.sbatch names run_dir={old}, not this folder (moved?): do not submit it; launch again with "
            f"run_dir={run.root}") in out, out
