"""More inference workers join a running run (`+attach=inference`), feed its queue, and leave when it is done; the run
notices only the throughput. An attach that would change training, or that finds no running run, is refused.

Tests marked `slurm` need the local cluster (`sudo bash rlhpc/cluster/local_slurm.sh up`) and skip without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhpc.cluster.attach import allocate_ranks
from rlhpc.config import schema as config_mod
from rlhpc.run.rundir import RunDir
from rlhpc.run.slurm_identity import identity_from_slurm, role_and_rank
from test_launch import SMALL, rlhpc_processes
from test_slurm_launch import cluster  # noqa: F401  (cluster: the fixture)

REPO = Path(__file__).resolve().parents[1]
ATTACH = [sys.executable, "-m", "rlhpc.launch", "+attach=inference"]


def attach(run_dir: Path, *overrides: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*ATTACH, f"run_dir={run_dir}", *overrides], capture_output=True, text=True,
                          timeout=timeout, **kw)


def saved_run(run_dir: Path, **sections) -> RunDir:
    """A run directory as the original launch leaves it (its config.yaml), without starting the run."""
    run = RunDir(run_dir).make()
    cfg = config_mod.to_typed({"run_dir": str(run.root), "exp_name": "reverse_text", "inference": {"num_workers": 2},
                               "weights": {"transport": "filesystem"}, **sections})
    config_mod.save(cfg, run.config)
    return run


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# ---- refusals (fast) ----------------------------------------------------------------------------------------------


def test_attaching_where_no_run_was_started_is_refused(tmp_path):
    line = one_line_error(attach(tmp_path / "nothing", "inference.num_workers=1"))
    assert "`run_dir`" in line and "no config.yaml" in line
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize("marker", ["summary.json", "status/DONE"])
def test_attaching_to_a_finished_run_is_refused(tmp_path, marker):
    run = saved_run(tmp_path / "run")
    (run.root / marker).write_text("{}")
    line = one_line_error(attach(run.root, "inference.num_workers=1"))
    assert "finished run" in line and marker in line
    assert not (run.rendezvous / "attach").exists()


@pytest.mark.parametrize("override, key", [
    ("algo.group_size=4", "algo.group_size"),  # not an inference key at all
    ("trainer.steps=5", "trainer.steps"),  # a runtime key, but the run's own
    ("inference.groups_per_batch=4", "inference.groups_per_batch"),  # an inference key that changes training
    ("+exp=reverse_text", "exp"),  # an experiment sets training keys
])
def test_a_key_that_changes_training_is_refused_naming_it(tmp_path, override, key):
    run = saved_run(tmp_path / "run")
    before = run.config.read_text()
    line = one_line_error(attach(run.root, "inference.num_workers=1", override))
    assert f"`{key}`" in line
    assert run.config.read_text() == before
    assert not (run.rendezvous / "attach").exists()


def test_attach_takes_only_inference_as_its_value(tmp_path):
    run = saved_run(tmp_path / "run")
    assert "`attach`" in one_line_error(attach(run.root, "attach=trainer"))


# ---- ranks and identities (fast) ------------------------------------------------------------------------------------


def test_attached_ranks_start_after_the_runs_own_workers_and_are_never_given_twice(tmp_path):
    run = RunDir(tmp_path).make()
    first = allocate_ranks(run, 2, 2, "a")
    (run.rendezvous / "attach" / "5").touch()  # taken by another attach command meanwhile
    second = allocate_ranks(run, 2, 2, "b")
    assert first == [2, 3] and second == [4, 6]
    assert json.loads((run.rendezvous / "attach" / "6").read_text())["attach"] == "b"


def test_a_task_of_a_slurm_attach_job_is_the_attached_inference_worker_its_ranks_name():
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n3",
           "RLHPC_RUN_DIR": "/shared/run", "RLHPC_ATTACH": "1", "RLHPC_ATTACH_RANKS": "4,5"}
    assert role_and_rank(env) == ("inference", 5, 2)
    ident = identity_from_slurm(env)
    assert (ident.role, ident.rank, ident.attached, ident.attempt) == ("inference", 5, True, "77.0")


def test_the_slurm_dry_run_plans_one_job_of_inference_workers_and_writes_nothing(tmp_path):
    run = saved_run(tmp_path / "run")
    before = sorted(p.relative_to(run.root) for p in run.root.rglob("*"))
    proc = attach(run.root, "inference.num_workers=3", "cluster=local", "launcher=slurm", "cluster.inference.nodes=1",
                  "dry_run=true")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1 node(s) x 3 task(s) = 3 worker(s)" in out
    assert "ranks: allocated at submission, from 2" in out
    assert "#SBATCH hetjob" not in out and "--het-group" not in out
    assert "export RLHPC_ATTACH=1" in out and "#SBATCH --no-requeue" in out
    assert "#SBATCH --partition=debug" in out
    assert 'rm -f "$status/REQUEUE" "$status/FAILED"' not in out  # the run's markers are the run's
    assert sorted(p.relative_to(run.root) for p in run.root.rglob("*")) == before


def test_an_attach_job_starts_its_workers_with_the_srun_args_and_the_container_of_the_command_line(tmp_path):
    run = saved_run(tmp_path / "run")
    proc = attach(run.root, "inference.num_workers=1", "cluster=local", "launcher=slurm", "dry_run=true",
                  'cluster.srun_args=["--job-name=rlhpc-attached"]', "cluster.container.runtime=apptainer",
                  "cluster.container.image=/images/rlhpc.sif", "cluster.inference.gpus_per_node=1")
    assert proc.returncode == 0, proc.stderr
    srun = next(line for line in proc.stdout.splitlines() if line.startswith("srun "))
    assert srun.startswith(f"srun --kill-on-bad-exit=0 --unbuffered --job-name=rlhpc-attached apptainer exec --nv "
                           f"--bind {run.root}:{run.root} /images/rlhpc.sif bash -c 'name=$(")
    assert "  note: cluster.python=python3 is the Python inside the image" in proc.stdout


def test_ending_the_attach_command_ends_its_workers_and_leaves_the_run_alone(tmp_path):
    run = saved_run(tmp_path / "run")  # no trainer: the workers wait for its warm start
    before = run.config.read_text()
    p = subprocess.Popen([*ATTACH, f"run_dir={run.root}", "inference.num_workers=2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(rlhpc_processes(run.root, roles_only=True)) < 2:
            time.sleep(0.2)
        assert len(rlhpc_processes(run.root, roles_only=True)) == 2
        p.terminate()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "attached inference worker(s) 2, 3" in out and "SIGTERM" in err
    assert rlhpc_processes(run.root) == []
    assert run.config.read_text() == before and not run.failed.exists()


# ---- a real run (slow) ------------------------------------------------------------------------------------------------


def trained_files(run_dir: Path) -> list:
    """The queue files the trainer trained on: the claim manifests of the steps the ledger lists as trained
    (queue.keep_retired=true keeps them after a checkpoint)."""
    ledger = [json.loads(line) for line in (run_dir / "queue" / "ledger.jsonl").read_text().splitlines()]
    files = []
    for e in ledger:
        if e.get("skipped"):
            continue
        for where in ("retired", "steps"):
            manifest = run_dir / "queue" / where / f"{e['step']:08d}" / "manifest.json"
            if manifest.exists():
                files += json.loads(manifest.read_text())["files"]
    return files


def start_run(run_dir: Path, transport: str, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", f"trainer.steps={steps}",
         "inference.num_workers=1", f"weights.transport={transport}", "queue.keep_retired=true",
         "launcher.timeout_s=400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not path.exists():
        time.sleep(0.1)
    assert path.exists(), f"no {path} after {timeout}s"


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["filesystem", "broadcast"])
def test_attached_workers_feed_the_running_run_and_leave_when_it_is_done(tmp_path, transport):
    run_dir = tmp_path / "run"
    steps = 60  # long enough for the attached workers to start (a few seconds) and publish before the end
    main = start_run(run_dir, transport, steps=steps)
    try:
        wait_for_file(run_dir / "model" / "READY", 180)  # trained: the SFT warm start is done, RL begins
        extra = subprocess.Popen([*ATTACH, f"run_dir={run_dir}", "inference.num_workers=2", "launcher.timeout_s=300"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = extra.communicate(timeout=360)
        _, main_err = main.communicate(timeout=120)
    finally:
        for p in (main, locals().get("extra")):
            if p is not None and p.poll() is None:
                p.kill()
    assert main.returncode == 0, main_err[-3000:]
    assert extra.returncode == 0, err[-3000:]
    assert "attached inference worker(s) 1, 2" in out
    assert (run_dir / "summary.json").exists() and not (run_dir / "status" / "FAILED").exists()
    # The trainer trained on what the attached workers (ranks 1 and 2, after the run's worker 0) generated.
    producers = {f.rsplit("-", 1)[0] for f in trained_files(run_dir)}
    assert any(p.startswith(("w1ax", "w2ax")) for p in producers), producers
    assert any(p.startswith("w0a") for p in producers), producers
    entries = [json.loads(line) for line in (run_dir / "queue" / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(steps))  # every step once
    assert sorted(os.listdir(run_dir / "rendezvous" / "attach"))[:2] == ["1", "2"]
    assert rlhpc_processes(run_dir) == []


@pytest.mark.slow
def test_a_failing_attached_worker_fails_its_attach_command_not_the_run(tmp_path):
    run_dir = tmp_path / "run"
    main = start_run(run_dir, "filesystem", steps=20)
    try:
        wait_for_file(run_dir / "config.yaml", 120)
        # Serving on an address no machine has: the attached worker fails to start its server.
        extra = attach(run_dir, "inference.num_workers=1", "inference.serve=true", "inference.serve_open=true",
                       "inference.serve_host=192.0.2.1", "launcher.timeout_s=200", timeout=240)
        _, main_err = main.communicate(timeout=300)
    finally:
        if main.poll() is None:
            main.kill()
    assert extra.returncode == 1, extra.stdout + extra.stderr
    assert "attached inference-1 exited with code 1" in extra.stderr
    assert main.returncode == 0, main_err[-3000:]
    assert (run_dir / "summary.json").exists() and not (run_dir / "status" / "FAILED").exists()
    assert (run_dir / "logs" / "inference-1.log").exists()
    assert rlhpc_processes(run_dir) == []


# ---- on the local Slurm cluster (slurm) ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.slurm
def test_a_slurm_attach_job_feeds_the_running_run_and_ends_with_it(tmp_path, cluster):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    main = start_run(run_dir, "broadcast", steps=150)  # long enough for a Slurm job to start its worker (~20 s)
    try:
        wait_for_file(run_dir / "model" / "READY", 180)
        extra = attach(run_dir, "inference.num_workers=1", "cluster=local", "launcher=slurm", "launcher.wait=true",
                       "launcher.timeout_s=300", timeout=360, env=env, cwd=REPO)
        _, main_err = main.communicate(timeout=120)
    finally:
        if main.poll() is None:
            main.kill()
        jobs = [json.loads(p.read_text())["job_id"] for p in run_dir.glob("rendezvous/attach/*/job.json")]
        if jobs:
            subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
    assert extra.returncode == 0, extra.stdout + extra.stderr
    assert len(jobs) == 1 and f"submitted job {jobs[0]}" in extra.stdout
    assert main.returncode == 0, main_err[-3000:]
    assert (run_dir / "summary.json").exists() and not (run_dir / "status" / "FAILED").exists()
    producers = {f.rsplit("-", 1)[0] for f in trained_files(run_dir)}
    assert any(p.startswith(f"w1a{jobs[0]}.") for p in producers), producers  # the job's worker: rank 1
    assert not (run_dir / "jobs.json").exists()  # the run's record of its own jobs is the run's
    assert rlhpc_processes(run_dir) == []
