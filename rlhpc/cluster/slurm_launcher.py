"""The Slurm launcher: the run as ONE heterogeneous Slurm job, submitted through submitit.

Component 0 holds the trainer ranks, component 1 the inference workers, each with its own nodes, tasks, CPUs, GPUs,
memory and time (`cluster.trainer`, `cluster.inference`); rlhpc.cluster.hetjob makes the plan and the batch script.
submitit has no heterogeneous jobs: `HetJobExecutor` hands it the finished script, and submitit does what it is good
at (sbatch, the job id, the job object). Job states come from sacct (rlhpc.run.slurm_jobs), which understands
the `<id>+<component>` rows of a heterogeneous job.

`python -m rlhpc.launch +exp=... launcher=slurm` returns once the job is submitted (its id is printed and written to
run_dir/jobs.json); with `launcher.wait=true` it follows the job to its end, printing progress, and reports the final
state, and for a failed run the failing role, its error and the end of its log. A sweep (`-m`) submits one job per
point and prints a table of them (`SweepCallback`, a Hydra callback set in conf/config.yaml).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import submitit
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from rlhpc.cluster.hetjob import JobPlan, describe, make_plan, python_problem, render_script
from rlhpc.config.disaggregation import describe as disagg_describe
from rlhpc.config.schema import Config
from rlhpc.patches import registry
from rlhpc.run import slurm_jobs
from rlhpc.run.procs import tail
from rlhpc.run.rundir import RunDir, out_of_space_advice, read_json, space_problem

POLL_S = 2.0
# launcher.wait: how long the launcher follows a job while no Slurm command answers before it stops following it.
SILENT_LIMIT_S = 600.0
# What a sweep submitted in this process (for SweepCallback).
SUBMITTED: List[Dict[str, Any]] = []


class SubmissionError(RuntimeError):
    pass


def _keys_for(refusal: str) -> str:
    """The config keys behind what Slurm refused, by the words of its message."""
    text = refusal.lower()
    if "partition" in text and ("invalid" in text or "not available" in text and "node" not in text):
        return "set by cluster.partition"
    if "account" in text:
        return "set by cluster.account"
    if "qos" in text:
        return "set by cluster.qos"
    if "time limit" in text:
        return "set by cluster.time_min, cluster.trainer.time_min or cluster.inference.time_min"
    if "gres" in text or "gpu" in text:
        return "set by cluster.trainer.gpus_per_node or cluster.inference.gpus_per_node"
    if "memory" in text or "mem" in text:
        return "set by cluster.trainer.mem_gb or cluster.inference.mem_gb"
    return ("set by cluster.trainer.* and cluster.inference.* (nodes, gpus_per_node, cpus_per_task, mem_gb, extra), "
            "cluster.partition, and trainer.num_ranks and inference.num_workers, which size the tasks")


class SlurmLauncher:
    name = "slurm"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Built (and checked) before the run directory exists: a config that cannot run makes nothing.
        self.job: JobPlan = make_plan(cfg)

    def plan(self) -> str:
        text = describe(self.job, self.cfg, self.name)
        pd = disagg_describe(self.cfg.inference)
        if pd:  # the P/D layout goes with the inference lines, before the job script
            head, sep, script = text.partition("\n\n----- job script -----")
            text = "\n".join([head] + pd) + sep + script
        return text

    def test_allocation(self) -> Optional[str]:
        """Slurm's refusal of the job as planned (`sbatch --test-only` on its script: a partition that does not exist,
        more nodes or memory than a partition has, ...), naming the config keys that set what it refused; None when
        Slurm would run it, or when no Slurm answers here. Before Slurm, also for a script only written: a
        cluster.python the job's tasks could not run."""
        problem = python_problem(self.job)
        if problem or not (self.cfg.launcher.submit or self.cfg.dry_run):  # a script only written: Slurm not asked
            return problem
        with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
            f.write(render_script(self.job, self.cfg.exp_name))
        try:
            proc = subprocess.run(["sbatch", "--test-only", f.name], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None  # no sbatch here, or no controller answering: the submission will say
        finally:
            os.unlink(f.name)
        said = " ".join(line.strip() for line in proc.stderr.splitlines() if line.strip())
        if proc.returncode == 0 or not said or "Unable to contact slurm controller" in said:
            return None
        return f"Slurm refuses this job (sbatch --test-only): {said} ({_keys_for(said)})"

    # ---- submission ----------------------------------------------------------------------------------------------

    def submit(self, run: RunDir, script: Path) -> str:
        """Submits through submitit; returns the job id."""
        folder = run.root / "slurm"  # submitit's record of the submission
        folder.mkdir(exist_ok=True)
        try:
            executor = HetJobExecutor(folder, script.read_text(), self.job.trainer.tasks + self.job.inference.tasks)
        except RuntimeError as e:  # submitit: 'Could not detect "srun"'
            raise SubmissionError(f"launcher=slurm needs Slurm's commands on this machine ({e}); dry_run=true shows "
                                  f"the job without submitting it") from e
        try:
            return executor.submit_script().job_id
        except Exception as e:  # submitit.core.utils.FailedJobError carries sbatch's message
            raise SubmissionError(f"sbatch refused the job: {e}") from e

    def start(self, run: RunDir) -> int:
        script = run.root / "job.sbatch"
        script.write_text(render_script(self.job, self.cfg.exp_name))
        if not self.cfg.launcher.submit:
            return self.prepared_only(run, script)
        # Ctrl-C while sbatch runs could end it after it submitted the job but before the id is known and recorded:
        # ignored until then, by sbatch too (it inherits the ignored signal). The submission takes about a second.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            job_id = self.submit(run, script)
            slurm_jobs.record_job(run, {"job_id": job_id, "name": self.job.name, "launcher": self.name,
                                        "submitted": time.time(), "script": str(script)})
        except SubmissionError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGINT, previous)
        SUBMITTED.append({"job_id": job_id, "run_dir": str(run.root), "overrides": _sweep_overrides()})
        g0, g1 = self.job.trainer, self.job.inference
        print(
            f"submitted job {job_id} ({self.job.name}): trainer {g0.nodes}x{g0.tasks_per_node} task(s), "
            f"inference {g1.nodes}x{g1.tasks_per_node} task(s)\n"
            f"run_dir: {run.root}\n"
            f"follow:  python -m rlhpc.status {run.root}   (or squeue -j {job_id}; logs in {run.logs}/)\n"
            f"stop:    scancel {job_id}",
            flush=True,
        )
        if not self.cfg.launcher.wait:
            return 0
        return self.wait(run, job_id)

    def prepared_only(self, run: RunDir, script: Path) -> int:
        """launcher.submit=false: only the script. Inside a heterogeneous job (sbatch/rlhpc.sbatch runs this step, then
        the script) check that the allocation fits the config, and record the job."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if job_id is None or "SLURM_NTASKS_HET_GROUP_0" not in os.environ:
            print(f"wrote {script}\nsubmit it with: sbatch {script}", flush=True)
            return 0
        n = self.cfg.inference.nodes_per_instance
        for k, g in enumerate(self.job.groups):
            have = int(os.environ.get(f"SLURM_NTASKS_HET_GROUP_{k}", "0"))
            if have != g.tasks:
                key = "trainer.num_ranks" if g.role == "trainer" else "inference.num_workers"
                why = (f" ({key} x inference.nodes_per_instance={n}, one a node)" if g.role == "inference" and n > 1
                       else "")
                print(f"error: config key `{key}`: the config wants {g.tasks} {g.role} task(s){why}, but component "
                      f"{k} of job {job_id} has {have}: change {key} or that component's #SBATCH lines",
                      file=sys.stderr)
                return 2
        if job_id not in [j["job_id"] for j in slurm_jobs.recorded_jobs(run)]:  # not again after a requeue
            slurm_jobs.record_job(run, {"job_id": job_id, "name": os.environ.get("SLURM_JOB_NAME", ""),
                                        "launcher": "sbatch (by hand)", "submitted": time.time(),
                                        "script": str(script)})
        print(f"wrote {script}; job {job_id} runs it now", flush=True)
        return 0

    # ---- following the job -----------------------------------------------------------------------------------------

    def wait(self, run: RunDir, job_id: str) -> int:
        t0 = time.time()
        timeout = self.cfg.launcher.timeout_s
        progress = _Progress(run) if self.cfg.launcher.progress else None
        last_state, last_restarts, silent_since = "", 0, None
        try:
            while True:
                st = slurm_jobs.query(job_id)
                state = st.describe()
                if state != last_state:
                    restarts = slurm_jobs.restarts(job_id) if last_state and st.components else 0
                    if restarts > last_restarts:
                        print(f"job {job_id}: requeued (restart {restarts}); the trainer resumes from its checkpoint",
                              flush=True)
                        last_restarts = restarts
                    where = ", ".join(f"{c.role} on {c.nodes}" for c in st.components if st.state == "RUNNING")
                    again = "" if st.answered else f"; asking again every {POLL_S:g} s"
                    print(f"job {job_id}: {state}" + (f" ({where})" if where else "") + again, flush=True)
                    last_state = state
                if st.final:
                    return self.report(run, job_id, st, time.time() - t0)
                silent_since = None if st.answered else (silent_since or time.time())
                if silent_since and time.time() - silent_since > SILENT_LIMIT_S:
                    print(f"stopped following job {job_id}: {slurm_jobs.NO_ANSWER} for {SILENT_LIMIT_S:.0f} s (are "
                          f"Slurm's commands on PATH here, and is its controller up?); the job may still run: "
                          f"squeue -j {job_id}, or python -m rlhpc.status {run.root}", file=sys.stderr)
                    return 1
                if progress:
                    progress.update()
                if timeout and time.time() - t0 > timeout:
                    print(f"launcher.timeout_s={timeout:.0f}s reached; cancelling job {job_id}", file=sys.stderr)
                    cancelled = slurm_jobs.cancel(job_id)
                    end = slurm_jobs.wait_final(job_id, 60)
                    if not (cancelled and end.final):
                        print(f"job {job_id}: its end is not confirmed (scancel {'sent' if cancelled else 'failed'}; "
                              f"job {end.describe()}): check squeue -j {job_id}", file=sys.stderr)
                    return 124
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            print(f"\nstopped following job {job_id}; it keeps running (scancel {job_id} ends it; "
                  f"python -m rlhpc.status {run.root} shows it)", file=sys.stderr)
            return 130

    def report(self, run: RunDir, job_id: str, st: slurm_jobs.JobState, wall_s: float) -> int:
        states = ", ".join(f"{c.role} {c.job_id} {c.state} (exit {c.exit_code})" for c in st.components)
        if st.state == "COMPLETED" and run.summary.exists():
            print(f"job {job_id} COMPLETED: {states}", flush=True)
            from rlhpc.run.summary import print_summary

            print_summary(run, wall_time_s=wall_s)
            return 0
        print(f"job {job_id} {st.state}: {states}", file=sys.stderr)
        fail = run.failure_report()
        if fail:
            print(f"{fail['role']} rank {fail['rank']} failed: {fail['error']}\nlast lines of {fail['log']}:\n"
                  f"{fail['log_tail']}", file=sys.stderr)
        else:
            batch_log = run.logs / f"slurm-{job_id}.out"
            print(f"last lines of {batch_log}:\n{tail(batch_log)}", file=sys.stderr)
        full = space_problem(run.root)
        if full:
            print(f"run_dir is out of space: {full}; {out_of_space_advice(run.root)}", file=sys.stderr)
        return 1


class HetJobExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor, taught one thing: submit a finished heterogeneous-job script as it is."""

    def __init__(self, folder: Path, script: str, num_tasks: int):
        registry.check("submitit_hetjob_script")  # its private methods, overridden and called below
        super().__init__(folder)
        self.script, self.num_tasks = script, num_tasks

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script

    def _num_tasks(self) -> int:
        return self.num_tasks

    def submit_script(self) -> submitit.SlurmJob:
        # submitit's own path for a command job: writes the file, runs sbatch, parses the id, makes the job object.
        return self._submit_command("")


class _Progress:
    """One line per change of the trainer's phase or step (readable in a terminal and in a log)."""

    def __init__(self, run: RunDir):
        self.run = run
        self.last: Optional[tuple] = None

    def update(self) -> None:
        hb = read_json(self.run.status / "trainer-0.json")
        if not hb:
            return
        if hb.get("phase") == "sft":
            key = ("sft", hb.get("sft_step"))
            line = f"  SFT step {hb.get('sft_step')}/{hb.get('sft_steps')} loss {hb.get('loss', 0):.3f}"
        else:
            key = ("rl", hb.get("step"))
            line = (f"  step {hb.get('step')}/{hb.get('steps')} reward {hb.get('reward', 0):.3f} "
                    f"held-out {hb.get('heldout', 0):.3f} loss {hb.get('loss', 0):.3f}")
        if key != self.last:
            print(line, flush=True)
            self.last = key


# ---- sweeps ----------------------------------------------------------------------------------------------------


def _sweep_overrides() -> str:
    try:
        hc = HydraConfig.get()
        if str(hc.mode) != "RunMode.MULTIRUN":
            return ""
        return " ".join(hc.overrides.task)
    except Exception:  # not under Hydra (e.g. launch() called directly)
        return ""


class SweepCallback(Callback):
    """Hydra callback for sweeps (`-m`, set in conf/config.yaml).

    Each point gets its own run directory, its Hydra job folder `<hydra.sweep.dir>/<point number>`: run_dir defaults to
    $RLHPC_SWEEP_RUN_DIR, set here for the point's job (a timestamp is resolved anew by every point, so it cannot tell
    them apart). After the sweep, a table of the Slurm jobs it submitted, one per point."""

    ENV = "RLHPC_SWEEP_RUN_DIR"

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        os.environ.pop(self.ENV, None)  # e.g. inherited by a job that a sweep submitted

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        SUBMITTED.clear()

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if str(config.hydra.mode) == "RunMode.MULTIRUN":
            os.environ[self.ENV] = str(config.hydra.runtime.output_dir)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        os.environ.pop(self.ENV, None)
        if not SUBMITTED:
            return
        # The overrides every point shares go in the heading; each row shows what makes its point different.
        points = [s["overrides"].split() for s in SUBMITTED]
        common = [o for o in points[0] if all(o in p for p in points[1:])]
        rows = [("job", "run_dir", "point")]
        rows += [(s["job_id"], s["run_dir"], " ".join(o for o in p if o not in common))
                 for s, p in zip(SUBMITTED, points)]
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        print(f"\n{len(SUBMITTED)} job(s) submitted ({' '.join(common)}):")
        for r in rows:
            print(f"  {r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}")
        print(f"follow them with: squeue -j {','.join(s['job_id'] for s in SUBMITTED)}", flush=True)
