"""The Slurm launchers as a user meets them: the plan and the job script, one heterogeneous job per run on a real
Slurm cluster, a failing role, a requeue mid-run, sweeps, the hand-written sbatch template.

Tests marked `slurm` need the local cluster (`sudo bash rlhpc/cluster/local_slurm.sh up`) and skip without it
(`RLHPC_REQUIRE_SLURM=1` makes that a failure). Every wait has a timeout; every job a test submits is cancelled when
the test ends.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlhpc.run.slurm_identity import SlurmIdentityError, first_node, identity_from_slurm, master_port, role_and_rank

REPO = Path(__file__).resolve().parents[1]
SMALL = ["+exp=reverse_text", "sft.steps=5", "eval.num_tasks=8", "eval.interval=0", "launcher.progress=true",
         "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1"]
ON_CLUSTER = ["cluster=local", "launcher=slurm"]


def launch(*args: str, cwd: Path, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhpc.launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def het_env(procid: int, trainers: int = 2, workers: int = 3, **extra: str) -> dict:
    return {
        "SLURM_JOB_ID": "4242", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(trainers + workers),
        "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": str(trainers), "SLURM_NTASKS_HET_GROUP_1": str(workers),
        "SLURM_JOB_NODELIST_HET_GROUP_0": "localhost", "SLURM_JOB_NODELIST_HET_GROUP_1": "localhost",
        "RLHPC_RUN_DIR": "/shared/run", **extra,
    }


# ---- who a task is (no cluster needed) ----------------------------------------------------------------------------


def test_each_task_of_the_two_component_step_finds_its_role_and_rank():
    seen = [role_and_rank(het_env(p)) for p in range(5)]
    assert seen == [("trainer", 0, 2), ("trainer", 1, 2), ("inference", 0, 3), ("inference", 1, 3), ("inference", 2, 3)]


def test_identity_carries_run_dir_attempt_and_the_trainers_rendezvous():
    ident = identity_from_slurm(het_env(3, SLURM_RESTART_COUNT="2"))
    assert (ident.role, ident.rank, ident.size) == ("inference", 1, 3)
    assert str(ident.run_dir) == "/shared/run"
    assert ident.attempt == "4242.2"  # a requeued job is a new attempt of the same run
    assert ident.master_addr == "localhost"
    # every task computes the same port from the job id; a restart moves it (the old one may linger in TIME_WAIT)
    assert identity_from_slurm(het_env(0, SLURM_RESTART_COUNT="2")).master_port == ident.master_port
    assert master_port(het_env(0)) != ident.master_port


def test_the_master_is_the_first_node_of_the_trainer_component():
    assert first_node("gpu[007-012,020],cpu01") == "gpu007"
    assert first_node("n1") == "n1"
    assert first_node("n[3-4]") == "n3"


def test_a_task_outside_a_step_over_both_components_is_told_how_to_start_the_roles():
    env = het_env(0)
    del env["SLURM_NTASKS_HET_GROUP_1"]
    with pytest.raises(SlurmIdentityError, match=r"srun --het-group=0,1"):
        role_and_rank(env)
    with pytest.raises(SlurmIdentityError, match="RLHPC_RUN_DIR"):
        identity_from_slurm({k: v for k, v in het_env(0).items() if k != "RLHPC_RUN_DIR"})


# ---- the plan and the script (no cluster needed) ------------------------------------------------------------------


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_dry_run_prints_the_plan_and_the_script_and_submits_nothing(tmp_path):
    spy = tmp_path / "bin"
    spy.mkdir()
    (spy / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >>{tmp_path}/sbatch-calls\n")
    (spy / "sbatch").chmod(0o755)
    env = dict(os.environ, PATH=f"{spy}{os.pathsep}{os.environ['PATH']}")
    for launcher in ("slurm", "sbatch"):
        run_dir = tmp_path / f"run-{launcher}"
        proc = launch(*SMALL, f"launcher={launcher}", "inference.num_workers=4", "cluster.inference.nodes=2",
                      "cluster.trainer.mem_gb=16", "dry_run=true", f"run_dir={run_dir}", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        assert "component 0 trainer   1 node(s) x 1 task(s) = 1 rank(s)" in out
        assert "16 GB/node" in out
        assert "component 1 inference 2 node(s) x 2 task(s) = 4 worker(s)" in out
        assert "weights group: 5 members" in out
        assert "#SBATCH hetjob" in out and "srun --het-group=0,1" in out
        assert not run_dir.exists()
    calls = (tmp_path / "sbatch-calls").read_text().splitlines()  # Slurm's verdict only: sbatch --test-only
    assert calls and all(c.startswith("--test-only ") for c in calls), calls


def composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from rlhpc.config import schema as config_mod
    from rlhpc.config.schema import CONF_DIR

    config_mod.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return config_mod.to_typed(compose(config_name="config", overrides=[*SMALL, "run_dir=/tmp/x", *overrides]))


# One vLLM instance over 2 nodes of 8 GPUs per worker (inference.nodes_per_instance), as +exp=glm5 on 80 GB GPUs.
TWO_NODE_INSTANCE = ["inference=vllm", "inference.tensor_parallel_size=16", "inference.nodes_per_instance=2",
                     "cluster.inference.gpus_per_node=8"]


@pytest.mark.parametrize("overrides, key", [
    (["trainer.num_ranks=2", "cluster.trainer.tasks_per_node=1"], "cluster.trainer.tasks_per_node"),
    (["inference.num_workers=3", "cluster.inference.nodes=2"], "cluster.inference.nodes"),
    (["cluster.inference.gpus_per_node=8", "inference.tensor_parallel_size=3"], "inference.tensor_parallel_size"),
    (["cluster.inference.gpus_per_node=2", "inference.tensor_parallel_size=2"], "cluster.inference.gpus_per_node"),
    (["cluster.trainer.gpus_per_node=1", "trainer.num_ranks=2"], "cluster.trainer.gpus_per_node"),
    (["cluster.inference.gpus_per_node=4", "inference.engine=vllm", "inference.num_workers=2"],
     "inference.engines_per_node"),
    (["cluster.inference.time_min=2", "cluster.grace_s=120"], "cluster.grace_s"),
    # Instances over 2 nodes: 2 workers are 4 tasks, one a node.
    ([*TWO_NODE_INSTANCE, "inference.num_workers=2", "cluster.inference.nodes=2"], "cluster.inference.nodes"),
    ([*TWO_NODE_INSTANCE, "inference.num_workers=2", "cluster.inference.nodes=2",
      "cluster.inference.tasks_per_node=2"], "cluster.inference.tasks_per_node"),
])
def test_a_job_the_cluster_settings_cannot_run_is_refused_naming_the_key(overrides, key):
    from rlhpc.cluster.hetjob import make_plan
    from rlhpc.config.schema import ConfigError

    with pytest.raises(ConfigError, match=re.escape(f"`{key}`")):
        make_plan(composed(*overrides))


def test_an_instance_over_two_nodes_is_two_tasks_of_the_inference_component_one_a_node():
    from rlhpc.cluster.hetjob import describe, make_plan, render_script

    cfg = composed(*TWO_NODE_INSTANCE, "inference.num_workers=3", "cluster.inference.nodes=6")
    plan = make_plan(cfg)
    script = render_script(plan)
    assert "export RLHPC_NODES_PER_INSTANCE=2" in script.splitlines()  # how a task tells a worker from a follower
    inference = script.partition("#SBATCH hetjob")[2].partition("\nexport ")[0]
    for line in ("# component 1: inference (6 tasks)", "#SBATCH --nodes=6", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8"):
        assert line in inference.splitlines()
    assert "task t is worker t // 2, vLLM node rank t % 2" in inference
    text = describe(plan, cfg, "slurm")
    assert "component 1 inference 6 node(s) x 1 task(s) = 6 task(s): 3 worker(s) x 2 nodes" in text
    assert "instance 2: nodes 4-5 of component 1, leader on 4, follower on 5" in text
    assert "weights group: 4 members (trainer rank 0 + 3 inference workers, the leaders)" in text


def test_an_allocation_without_a_task_per_node_of_each_instance_is_refused_naming_the_key(tmp_path, monkeypatch,
                                                                                          capsys):
    # sbatch/rlhpc.sbatch runs the launch step inside its allocation: 3 workers over 2 nodes each need 6 tasks.
    from rlhpc.cluster.slurm_launcher import SlurmLauncher
    from rlhpc.run.rundir import RunDir

    launcher = SlurmLauncher(composed(*TWO_NODE_INSTANCE, "inference.num_workers=3", "cluster.inference.nodes=6"))
    for key, value in {"SLURM_JOB_ID": "77", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "3"}.items():
        monkeypatch.setenv(key, value)
    assert launcher.prepared_only(RunDir(tmp_path), tmp_path / "job.sbatch") == 2
    assert ("config key `inference.num_workers`: the config wants 6 inference task(s) (inference.num_workers x "
            "inference.nodes_per_instance=2, one a node), but component 1 of job 77 has 3") in capsys.readouterr().err


def test_the_launch_refuses_such_a_job_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(*SMALL, "launcher=slurm", "inference.num_workers=3", "cluster.inference.nodes=2",
                  f"run_dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "`cluster.inference.nodes`" in proc.stderr and "inference.num_workers=3" in proc.stderr
    assert not run_dir.exists()


def test_the_rendered_script_runs_the_role_entry_point_and_owns_signals_and_requeue(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(*SMALL, "launcher=sbatch", "launcher.submit=false", "cluster.grace_s=90", f"run_dir={run_dir}",
                  "cluster.setup=[module load cuda]", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"sbatch {run_dir}/job.sbatch" in proc.stdout
    script = (run_dir / "job.sbatch").read_text()
    header, _, body = script.partition("#SBATCH hetjob")
    assert "--ntasks-per-node=1" in header and "--ntasks-per-node=2" in body
    assert "#SBATCH --signal=B:USR1@90" in header and "#SBATCH --requeue" in header
    assert "#SBATCH --job-name=rlhpc-reverse_text" in header
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--het-group=0,1" in srun and "--kill-on-bad-exit=1" in srun and "-m rlhpc.role" in srun
    assert "%j" not in srun
    assert f"export RLHPC_RUN_DIR={run_dir}" in script
    assert "module load cuda" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert not (run_dir / "jobs.json").exists()  # written, not submitted


# ---- srun options and containers (no cluster needed) ---------------------------------------------------------------

PYXIS = ["cluster.container.runtime=pyxis", "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'",
         "cluster.container.mounts=[/shared/data:/data:ro]", "cluster.container.workdir=/workspace"]
APPTAINER = ["cluster.container.runtime=apptainer", "cluster.container.image=/images/rlhpc.sif",
             "cluster.container.mounts=[/scratch]"]


def srun_of(script: str) -> list[str]:
    """The words of the script's srun line up to the task loop (`bash -c '<task>'`)."""
    line = next(line for line in script.splitlines() if line.startswith("srun "))
    return shlex.split(line.partition(" -c '")[0])


def test_srun_args_reach_the_srun_line_that_starts_every_role():
    from rlhpc.cluster.hetjob import make_plan, render_script

    words = srun_of(render_script(make_plan(composed('cluster.srun_args=["--cpu-bind=cores","--comment=a b"]'))))
    assert words == ["srun", "--het-group=0,1", "--kill-on-bad-exit=1", "--unbuffered", "--cpu-bind=cores",
                     "--comment=a b", "bash"]


def test_a_pyxis_image_starts_every_task_in_it_with_run_dir_mounted_at_its_own_path():
    from rlhpc.cluster.hetjob import make_plan, render_script

    plan = make_plan(composed(*PYXIS))
    words = srun_of(render_script(plan))
    assert words[words.index("--unbuffered") + 1:] == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts=/shared/data:/data:ro,{plan.run_dir}:{plan.run_dir}",
        "--container-workdir=/workspace", "bash"]
    assert "export RLHPC_PYTHON=python3" in render_script(plan)  # the image's Python, not the launcher's


@pytest.mark.parametrize("gpus, nv", [("0", []), ("1", ["--nv"])])
def test_an_apptainer_image_wraps_the_task_and_brings_the_gpus_when_a_component_has_them(gpus, nv):
    from rlhpc.cluster.hetjob import make_plan, render_script

    plan = make_plan(composed(*APPTAINER, "cluster.container.exe=singularity", f"cluster.trainer.gpus_per_node={gpus}"))
    words = srun_of(render_script(plan))
    assert words[words.index("--unbuffered") + 1:] == [
        "singularity", "exec", *nv, "--bind", f"/scratch,{plan.run_dir}:{plan.run_dir}", "/images/rlhpc.sif", "bash"]


@pytest.mark.parametrize("overrides, key, says", [
    (["cluster.container.runtime=docker", "cluster.container.image=x"], "cluster.container.runtime",
     "'docker' is not one of: pyxis"),
    (["cluster.container.runtime=apptainer"], "cluster.container.image",
     "cluster.container.runtime=apptainer needs an image, e.g. cluster.container.image=/shared/images/rlhpc.sif"),
    (["cluster.container.image=/images/rlhpc.sif"], "cluster.container.runtime",
     "set cluster.container.runtime=pyxis or apptainer"),
    ([*PYXIS, "cluster.container.mounts=['/a:/a,/b:/b']"], "cluster.container.mounts", "give each as its own item"),
    ([*PYXIS, "cluster.container.workdir=work"], "cluster.container.workdir", "must be an absolute path"),
])
def test_a_container_rlhpc_cannot_start_is_refused_naming_the_key_and_a_value_that_works(overrides, key, says):
    from rlhpc.config import schema as config_mod
    from rlhpc.config.schema import ConfigError

    importlib.import_module("rlhpc.algo")  # registers the algorithms' config checks
    with pytest.raises(ConfigError) as refused:
        config_mod.validate(composed(*overrides))
    assert str(refused.value).startswith(f"config key `{key}`: ") and says in str(refused.value)


def test_the_dry_run_shows_the_srun_line_and_the_container_and_leaves_the_images_python_unjudged():
    from rlhpc.cluster.hetjob import describe, make_plan, python_problem

    cfg = composed(*APPTAINER, 'cluster.srun_args=["--job-name=rlhpc-roles"]', "cluster.python=/opt/env/bin/python")
    plan = make_plan(cfg)
    assert python_problem(plan) is None  # /opt/env/bin/python is inside the image, not on this machine
    lines = describe(plan, cfg, "sbatch").splitlines()
    assert (f"  tasks start with: srun --het-group=0,1 --kill-on-bad-exit=1 --unbuffered --job-name=rlhpc-roles "
            f"apptainer exec --bind /scratch,{plan.run_dir}:{plan.run_dir} /images/rlhpc.sif bash -c '<task loop>'"
            in lines)
    assert f"  container: apptainer image /images/rlhpc.sif (apptainer exec); mounts /scratch, {plan.run_dir}:" \
           f"{plan.run_dir}" in lines
    assert ("  note: cluster.python=/opt/env/bin/python is the Python inside the image: not checked on this machine; "
            "the image must have rlhpc installed") in lines


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_sweep_gives_every_point_its_own_run_dir(tmp_path):
    proc = launch("-m", *SMALL, "launcher=slurm", "trainer.steps=4,6", "dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    dirs = re.findall(r"^  run_dir: (\S+)$", proc.stdout, re.M)
    assert len(dirs) == 2 and len(set(dirs)) == 2
    assert [Path(d).name for d in dirs] == ["0", "1"] and Path(dirs[0]).parent == Path(dirs[1]).parent


def test_following_a_job_slurm_does_not_answer_for_says_so_and_ends(tmp_path, monkeypatch, capsys):
    """launcher.wait=true with no sacct or squeue that answers (here: none on PATH): the launcher says why the state
    is unknown, and stops following after SILENT_LIMIT_S; at launcher.timeout_s it does not wait on a final state no
    one will report."""
    from rlhpc.cluster import slurm_launcher
    from rlhpc.cluster.slurm_launcher import SlurmLauncher
    from rlhpc.run.rundir import RunDir

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    monkeypatch.setattr(slurm_launcher, "POLL_S", 0.1)
    monkeypatch.setattr(slurm_launcher, "SILENT_LIMIT_S", 1.0)
    run = RunDir(tmp_path / "run").make()
    t0 = time.monotonic()
    assert SlurmLauncher(composed("launcher=slurm", "launcher.progress=false")).wait(run, "4242") == 1
    assert time.monotonic() - t0 < 10
    out, err = capsys.readouterr()
    assert out.count("job 4242: state unknown (neither sacct nor squeue answered); asking again every 0.1 s") == 1
    assert "stopped following job 4242: neither sacct nor squeue answered for 1 s" in err
    assert f"python -m rlhpc.status {run.root}" in err

    monkeypatch.setattr(slurm_launcher, "SILENT_LIMIT_S", 600.0)
    t0 = time.monotonic()
    launcher = SlurmLauncher(composed("launcher=slurm", "launcher.progress=false", "launcher.timeout_s=1"))
    assert launcher.wait(run, "4242") == 124
    assert time.monotonic() - t0 < 10  # not the 60 s given to a cancelled job to report its end
    err = capsys.readouterr().err
    assert "launcher.timeout_s=1s reached; cancelling job 4242" in err
    assert ("job 4242: its end is not confirmed (scancel failed; job state unknown (neither sacct nor squeue "
            "answered)): check squeue -j 4242") in err


# ---- on the local Slurm cluster --------------------------------------------------------------------------------


def _slurm(*args: str, timeout: float = 30) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout).stdout


class Cluster:
    """What a test submitted, cancelled at the end: jobs named `name`, and the jobs recorded in registered run dirs."""

    def __init__(self) -> None:
        self.name = f"rlhpc-test-{uuid.uuid4().hex[:8]}"
        self.run_dirs: list[Path] = []

    def track(self, run_dir: Path) -> Path:
        self.run_dirs.append(run_dir)
        return run_dir

    def job_ids(self, run_dir: Path) -> list[str]:
        path = run_dir / "jobs.json"
        return [j["job_id"] for j in json.loads(path.read_text())["jobs"]] if path.exists() else []

    def cancel_all(self) -> None:
        ids = [j for d in self.run_dirs for j in self.job_ids(d)]
        if ids:
            _slurm("scancel", *ids)
        _slurm("scancel", f"--name={self.name}")


@pytest.fixture
def cluster():
    if shutil.which("sbatch") is None or "is UP" not in _slurm("scontrol", "ping", timeout=15):
        why = "no Slurm cluster answers; start one with `sudo bash rlhpc/cluster/local_slurm.sh up`"
        if os.environ.get("RLHPC_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    c = Cluster()
    yield c
    c.cancel_all()


def sacct_rows(job_id: str) -> dict[str, tuple[str, str, str]]:
    """JobID -> (JobName, State, ExitCode) of a job's components (`<id>+0`, `<id>+1`)."""
    rows = {}
    for line in _slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,JobName,State,ExitCode").splitlines():
        jid, name, state, code = line.split("|")
        rows[jid] = (name, state.split()[0], code)
    return rows


def wait_final(job_id: str, timeout: float = 180) -> dict[str, tuple[str, str, str]]:
    """Until sacct shows both components final (it lags a moment behind the job's end)."""
    deadline = time.monotonic() + timeout
    rows: dict = {}
    while time.monotonic() < deadline:
        rows = sacct_rows(job_id)
        if all(rows.get(f"{job_id}+{k}", ("", "PENDING", ""))[1] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING")
               for k in (0, 1)):
            return rows
        time.sleep(1)
    pytest.fail(f"job {job_id} did not end within {timeout}s: {rows}\n{_slurm('squeue')}")


def wait_for(what: str, predicate, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def trainer_step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "status" / "trainer-0.json").read_text()).get("step", 0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def status(run_dir: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slurm
def test_sbatch_accepts_the_rendered_script_and_the_template(cluster, tmp_path):
    run_dir = tmp_path / "run"
    assert launch(*SMALL, *ON_CLUSTER, "launcher=sbatch", "launcher.submit=false", f"run_dir={run_dir}",
                  cwd=tmp_path).returncode == 0
    for script in (run_dir / "job.sbatch", REPO / "sbatch" / "rlhpc.sbatch"):
        proc = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=30,
                              cwd=tmp_path)
        assert proc.returncode == 0 and "to start at" in proc.stderr, (script, proc.stderr)


@pytest.mark.slurm
def test_a_run_is_one_heterogeneous_job_that_ends_completed(cluster, tmp_path):
    run_dir = cluster.track(tmp_path / "run")
    t0 = time.monotonic()
    proc = launch(*SMALL, *ON_CLUSTER, "launcher.wait=true", "trainer.steps=4", f"run_dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job_id,) = cluster.job_ids(run_dir)
    assert f"submitted job {job_id}" in proc.stdout and f"job {job_id} COMPLETED" in proc.stdout
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == 4

    rows = wait_final(job_id, timeout=60)
    assert set(rows) == {f"{job_id}+0", f"{job_id}+1"}  # one job, two components
    assert all(r == ("rlhpc-reverse_text", "COMPLETED", "0:0") for r in rows.values()), rows
    for name, who in (("trainer-0", "trainer rank 0/1"), ("inference-0", "inference rank 0/2"),
                      ("inference-1", "inference rank 1/2")):
        assert f"starting {who}" in (run_dir / "logs" / f"{name}.log").read_text()
    shown = status(run_dir)
    assert f"job {job_id} rlhpc-reverse_text: COMPLETED" in shown and "step 4/4" in shown
    print(f"completed run: {time.monotonic() - t0:.0f}s")


@pytest.mark.slurm
def test_a_run_in_an_apptainer_image_with_srun_args_completes(cluster, tmp_path):
    """Apptainer cannot run here: a stand-in of that name (cluster.container.exe) records how each task called it and
    runs the command after the image on the host. The step's name is the one cluster.srun_args gave srun."""
    calls = tmp_path / "apptainer-calls"
    fake = tmp_path / "apptainer"
    fake.write_text(
        "#!/bin/bash\n"
        "args=(\"$@\")\n"
        "for i in \"${!args[@]}\"; do\n"
        "  if [[ ${args[$i]} == /images/rlhpc.sif ]]; then\n"
        f"    echo \"${{args[*]:0:$((i + 1))}}\" >>{calls}\n"
        "    exec \"${args[@]:$((i + 1))}\"\n"
        "  fi\n"
        "done\n"
        "exit 99\n"
    )
    fake.chmod(0o755)
    run_dir = cluster.track(tmp_path / "run")
    proc = launch(*SMALL, *ON_CLUSTER, "launcher.wait=true", "trainer.steps=2", f"run_dir={run_dir}",
                  'cluster.srun_args=["--job-name=rlhpc-roles"]', "cluster.container.runtime=apptainer",
                  "cluster.container.image=/images/rlhpc.sif", f"cluster.container.exe={fake}",
                  f"cluster.python={sys.executable}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job_id,) = cluster.job_ids(run_dir)
    assert all(r[1] == "COMPLETED" for r in wait_final(job_id, timeout=60).values())
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == 2
    # One call per task (a trainer rank, two inference workers), run_dir mounted at its own path.
    assert calls.read_text().splitlines() == [f"exec --bind {run_dir}:{run_dir} /images/rlhpc.sif"] * 3
    steps = dict(line.split("|") for line in _slurm("sacct", "-j", job_id, "-n", "-P", "-o", "JobID,JobName").split())
    assert steps[f"{job_id}+0.0"] == steps[f"{job_id}+1.0"] == "rlhpc-roles", steps


@pytest.mark.slurm
def test_the_launch_returns_at_once_and_a_sweep_submits_one_job_per_point(cluster, tmp_path):
    t0 = time.monotonic()
    proc = launch("-m", *SMALL, *ON_CLUSTER, f"cluster.job_name={cluster.name}", "trainer.steps=4,5", "sft.steps=500",
                  cwd=tmp_path, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout[proc.stdout.index("2 job(s) submitted"):]
    rows = re.findall(r"^  (\d+)\s+(\S+)\s+(trainer\.steps=\d)$", table, re.M)
    assert [r[2] for r in rows] == ["trainer.steps=4", "trainer.steps=5"]
    for job_id, run_dir, _ in rows:
        cluster.track(Path(run_dir))
        assert cluster.job_ids(Path(run_dir)) == [job_id]
        assert not (Path(run_dir) / "summary.json").exists()  # the launch did not wait for the runs
    assert took < 60
    queued = _slurm("squeue", f"--name={cluster.name}", "-h", "-o", "%i")
    assert {f"{r[0]}+0" for r in rows} <= set(queued.split())


@pytest.mark.slurm
def test_a_failing_role_fails_the_job_promptly_with_its_error_and_log(cluster, tmp_path):
    # An environment whose reward fails in the inference workers only (the trainer would wait for rollouts).
    (tmp_path / "crash_env.py").write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO / 'envs')!r})\n"
        "from reverse_text import ReverseText\n"
        "from rlhpc.run.slurm_identity import role_and_rank\n\n"
        "class CrashInInference(ReverseText):\n"
        "    def reward(self, task, completion):\n"
        "        if role_and_rank(os.environ)[0] == 'inference':\n"
        "            raise RuntimeError('reward model exploded')\n"
        "        return super().reward(task, completion)\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run_dir = cluster.track(tmp_path / "run")
    t0 = time.monotonic()
    # Fail-fast (restarts off): the first failure ends the job (tests/test_restarts.py covers the task loop's restarts).
    proc = launch(*SMALL, *ON_CLUSTER, "launcher.wait=true", "trainer.steps=50", "trainer.rollout_timeout_s=600",
                  "inference.max_restarts=0", "env.cls=crash_env:CrashInInference", f"run_dir={run_dir}", cwd=tmp_path,
                  env=env, timeout=180)
    assert time.monotonic() - t0 < 120  # not the trainer's 600 s wait for rollouts
    assert proc.returncode == 1
    (job_id,) = cluster.job_ids(run_dir)
    assert f"job {job_id} FAILED" in proc.stderr
    # The environment layer turns the reward's exception into a failed sample; a whole batch failing stops the run,
    # naming the environment, the fraction and the first error (docs/environments.md).
    assert re.search(r"inference rank \d failed: EnvironmentFailure\(.environment 'reverse_text': \d+ of \d+ samples "
                     r"failed, more than env.max_error_fraction=0.5; first error \(task [^)]*\): CallFailed: RuntimeError: reward model "
                     r"exploded.\)\n", proc.stderr), proc.stderr[-2000:]
    assert "Traceback" in proc.stderr  # the end of that role's log
    assert {state for _, state, _ in wait_final(job_id, timeout=60).values()} == {"FAILED"}
    assert "reward model exploded" in status(run_dir)


@pytest.mark.slurm
def test_a_requeued_job_resumes_and_trains_every_group_exactly_once(cluster, tmp_path):
    """Needs the trainer's side of the contract: on SIGUSR1 it checkpoints, writes status/REQUEUE, exits 75, and a new
    attempt resumes from that checkpoint."""
    steps = 8
    run_dir = cluster.track(tmp_path / "run")
    follow = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.launch", *SMALL, *ON_CLUSTER, "launcher.wait=true", f"trainer.steps={steps}",
         f"run_dir={run_dir}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        wait_for("the trainer's second step", lambda: trainer_step(run_dir) >= 2, timeout=150)
        (job_id,) = cluster.job_ids(run_dir)
        # What Slurm does `cluster.grace_s` before the time limit, sent now.
        _slurm("scancel", "--signal=USR1", "--batch", job_id)
        out, err = follow.communicate(timeout=240)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.communicate()
    assert follow.returncode == 0, out + err
    assert f"job {job_id}: requeued (restart 1)" in out and f"job {job_id} COMPLETED" in out
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    stopped_at = int(re.search(r'the trainer checkpointed \(.*"step":(\d+).*\); requeueing job', batch_log).group(1))
    assert 2 <= stopped_at < steps, "the signal must land mid-run"

    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == steps
    ledger = [json.loads(line) for line in (run_dir / "queue" / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == list(range(steps))
    uids = [u for e in ledger for u in e["groups"]]
    assert len(uids) == len(set(uids)), "a group was trained twice"
    assert f"step {steps}/{steps}" in status(run_dir)


@pytest.mark.slurm
def test_the_sbatch_template_runs_a_chosen_experiment_and_checks_its_allocation(cluster, tmp_path):
    template = REPO / "sbatch" / "rlhpc.sbatch"
    overrides = ["cluster=local", *SMALL[1:], "trainer.steps=2"]
    env = dict(os.environ, RLHPC_EXP="reverse_text", RLHPC_PYTHON=sys.executable)
    submit = ["sbatch", "--parsable", f"--job-name={cluster.name}", str(template)]
    job_id = subprocess.run([*submit, *overrides], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=30, check=True).stdout.strip().split(";")[0]
    # The same template with a config that does not fit its allocation: refused before any role starts.
    bad_id = subprocess.run([*submit, *overrides, "inference.num_workers=3"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=30, check=True).stdout.strip().split(";")[0]

    assert {s for _, s, _ in wait_final(job_id, timeout=180).values()} == {"COMPLETED"}
    run_dir = tmp_path / "runs" / "reverse_text" / f"slurm-{job_id}"
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == 2
    assert (run_dir / "logs" / "inference-1.log").exists()
    assert f"job {job_id} {cluster.name}: COMPLETED" in status(run_dir)

    assert {s for _, s, _ in wait_final(bad_id, timeout=120).values()} == {"FAILED"}
    assert "`inference.num_workers`" in (tmp_path / f"rlhpc-{bad_id}.out").read_text()


@pytest.mark.slurm
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_vllm_instance_over_two_nodes_of_the_job_trains_and_its_follower_ends(cluster, tmp_path):
    """inference.nodes_per_instance=2 on the real cluster: the inference component's two tasks (two Slurm nodes) are
    worker 0 (vLLM node rank 0) and its follower (node rank 1), tp=2 over both; the job ends COMPLETED."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm.sh)")
    run_dir = cluster.track(tmp_path / "run")
    proc = launch("sft.steps=0", "trainer.steps=3", "trainer.groups_per_step=2", "inference.groups_per_batch=2",
                  "algo.group_size=4", "eval.interval=0", "launcher.progress=false", *ON_CLUSTER, "launcher.wait=true",
                  "inference.engine=vllm", "inference.tensor_parallel_size=2", "inference.nodes_per_instance=2",
                  "inference.num_workers=1", "inference.kv_cache_gb=0.0625", "cluster.inference.nodes=2",
                  f"run_dir={run_dir}", cwd=tmp_path, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = cluster.job_ids(run_dir)
    assert all(r[1] == "COMPLETED" for r in wait_final(job_id, timeout=60).values())
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == 3
    follower = (run_dir / "logs" / "follower-0.log").read_text()
    assert "starting follower rank 0/1" in follower
    assert "joining worker 0's instance as node rank 1 of 2" in follower
    assert "the run is done; exiting" in follower
    assert "weights version 3" in (run_dir / "logs" / "inference-0.log").read_text()


# ---- what Slurm refuses, a run_dir in use, sweeps, requeues without progress ----------------------------------------


@pytest.mark.slurm
@pytest.mark.parametrize("overrides, says, keys", [
    (["cluster.partition=nosuch"], "invalid partition specified: nosuch", "(set by cluster.partition)"),
    (["cluster.trainer.nodes=8", "trainer.num_ranks=8"], "Requested node configuration is not available",
     "(set by cluster.trainer.* and cluster.inference.*"),
])
def test_a_job_slurm_cannot_run_is_refused_before_anything_is_written(cluster, tmp_path, overrides, says, keys):
    """sbatch --test-only asks Slurm first: one line with its reason and the keys behind it, exit 2, no run_dir and no
    job (it used to submit a job that stayed PENDING forever, or exit 1 with sbatch's error printed twice)."""
    run_dir = tmp_path / "run"
    proc = launch(*SMALL, *ON_CLUSTER, f"cluster.job_name={cluster.name}", *overrides, f"run_dir={run_dir}",
                  cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: Slurm refuses this job (sbatch --test-only): ") and says in line and keys in line
    assert not run_dir.exists()
    assert _slurm("squeue", f"--name={cluster.name}", "-h").strip() == ""
    dry = launch(*SMALL, *ON_CLUSTER, *overrides, f"run_dir={run_dir}", "dry_run=true", cwd=tmp_path, timeout=120)
    assert dry.returncode == 0 and "  note: Slurm refuses this job (sbatch --test-only): " in dry.stdout


@pytest.mark.slurm
def test_a_run_dir_whose_job_has_not_ended_is_not_launched_into_again(cluster, tmp_path):
    """A second launch would have submitted a second job writing the same run_dir (its trainer quarantined the first
    job's rollouts as 'from the future'); once the job is cancelled, the status says so, not 'waiting to be
    requeued'."""
    run_dir = cluster.track(tmp_path / "run")
    first = launch(*SMALL, *ON_CLUSTER, f"cluster.job_name={cluster.name}", "trainer.steps=50", "sft.steps=500",
                   f"run_dir={run_dir}", cwd=tmp_path, timeout=120)
    assert first.returncode == 0, first.stderr
    (job_id,) = cluster.job_ids(run_dir)
    again = launch(*SMALL, *ON_CLUSTER, f"cluster.job_name={cluster.name}", "trainer.steps=50", "sft.steps=500",
                   f"run_dir={run_dir}", cwd=tmp_path, timeout=120)
    assert again.returncode == 2
    assert re.fullmatch(rf"error: run_dir={re.escape(str(run_dir))} is being written by Slurm job {job_id} "
                        rf"\((PENDING|RUNNING)\): let it end, or `scancel {job_id}`, before launching into it again; or "
                        r"choose another run_dir", again.stderr.strip()), again.stderr
    assert cluster.job_ids(run_dir) == [job_id]
    _slurm("scancel", job_id)
    wait_final(job_id, timeout=60)
    assert f"state:   stopped: its Slurm job {job_id} ended CANCELLED" in status(run_dir)


@pytest.mark.slow  # over 10 s here: a short job on the local cluster, a worker killed and restarted in it
@pytest.mark.slurm
def test_under_default_settings_a_killed_worker_is_restarted_inside_the_job(cluster, tmp_path):
    run_dir, steps = cluster.track(tmp_path / "run"), 16
    proc = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, *ON_CLUSTER, "launcher.wait=true",
                             f"trainer.steps={steps}", "weights.transport=filesystem", f"run_dir={run_dir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        ledger, beat = run_dir / "queue" / "ledger.jsonl", run_dir / "status" / "inference-0.json"
        deadline = time.monotonic() + 180
        # Two trained steps, and worker 0 at work (its heartbeat: the other worker may feed the first steps alone).
        while not (ledger.exists() and len(ledger.read_text().splitlines()) >= 2 and beat.exists()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no trained step"
            time.sleep(0.2)
        os.kill(json.loads(beat.read_text())["pid"], 9)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    (out,) = (run_dir / "logs").glob("slurm-*.out")
    assert "rlhpc: inference-0 exited with code 137 on" in out.read_text()
    assert "restarting it (1 of inference.max_restarts=3) in 1s" in out.read_text()
    assert [json.loads(line)["step"] for line in ledger.read_text().splitlines()] == list(range(steps))


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_sweep_with_one_run_dir_for_every_point_is_refused_and_a_failed_point_fails_the_sweep(tmp_path):
    proc = launch("-m", *SMALL, "run_dir=" + str(tmp_path / "one"), "algo.temperature=0.7,1.0",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", "dry_run=true", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: config key `run_dir`: every point of this sweep would write {tmp_path / 'one'}; "
                                   "leave run_dir out (each point gets a folder of its own) or make it differ per "
                                   "point, e.g. run_dir=runs/sweep/${hydra:job.num}")
    mixed = launch("-m", *SMALL, "model.arch=qwen3,qwen4", f"hydra.sweep.dir={tmp_path / 'sweep2'}", "dry_run=true",
                   cwd=tmp_path, timeout=120)
    assert mixed.returncode == 1, mixed.stderr  # it used to exit 0
    assert "sweep point 1 failed with code 2" in mixed.stderr and "sweep: point(s) 1 failed" in mixed.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_a_requeue_that_makes_no_progress_is_not_repeated(cluster, tmp_path):
    """Signalled twice before the first step (as a time limit shorter than start-up and a step does, every attempt;
    here the step waits for more rollouts than come): the first signal requeues, the second, at the same step, ends
    the job FAILED saying why, instead of requeueing forever. (A warm start makes progress with each SFT step it
    saves: tests/test_sft_resume.py.)"""
    run_dir = cluster.track(tmp_path / "run")
    proc = launch(*SMALL, *ON_CLUSTER, f"cluster.job_name={cluster.name}", "trainer.groups_per_step=5000",
                  "trainer.steps=10", f"run_dir={run_dir}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (job_id,) = cluster.job_ids(run_dir)
    progress = run_dir / "queue" / "progress.json"  # written by the trainer once it is in RL, claiming

    def started(restart: int):
        log = run_dir / "logs" / f"slurm-{job_id}.out"
        return log.exists() and f"rlhpc: job {job_id} (restart {restart})" in log.read_text()

    for restart in (0, 1):
        wait_for(f"attempt {restart} to start", lambda: started(restart), timeout=180)
        since = time.time()
        wait_for(f"attempt {restart} to claim step 0", lambda: progress.exists() and progress.stat().st_mtime > since,
                 timeout=180)
        _slurm("scancel", "--signal=USR1", "--batch", job_id)
    rows = wait_final(job_id, timeout=180)
    assert {state for _, state, _ in rows.values()} == {"FAILED"}
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert batch_log.count("requeueing job") == 1
    assert f"rlhpc: this attempt stopped at step 0, where the last requeue left off: no progress, so job {job_id} is " \
           "not requeued again" in batch_log
