"""More inference workers for a running run: `python -m rlhpc.launch run_dir=<run> +attach=inference
inference.num_workers=K`.

The run's own config (run_dir/config.yaml) decides everything; the command line may only set where and how the new
workers run (inference.*, launcher.*, cluster.*, run_dir), and nothing that changes training. The workers get ranks
no process of the run ever had (`rendezvous/attach/<rank>`, each created once, from the run's inference.num_workers
up), join the weights group at whatever attempt the run is in, and feed the same queue; the run notices them only in
its throughput. They leave when the run is done (status/DONE) or when their launcher or job ends. A failing attached
worker is its own affair: logged in logs/inference-<rank>.log and reported by the attach command, never status/FAILED.

- `launcher=local`: K processes on this machine, restarted as the run's own (rlhpc.cluster.restarts), ended on Ctrl-C,
  SIGTERM or SIGHUP; the command exits 0 once the run is done and every worker has left.
- `launcher=slurm`: one ordinary (single-component) Slurm job holding only the K workers, for example to fill
  backfill gaps; submitted through submitit, recorded in rendezvous/attach/<attach id>/job.json, never in the run's
  jobs.json. It ends when the run is done, or at its own time limit.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, List, Optional

from omegaconf import OmegaConf

from rlhpc.config import schema as config_mod
from rlhpc.config.errors import one_line
from rlhpc.config.schema import Config, ConfigError
from rlhpc.preflight.rundir import training_changes
from rlhpc.run.procs import exit_code, on_stop_signals, tail
from rlhpc.run.rundir import RunDir, read_json, write_json

# The command-line keys an attach may set (by their first part); the run's config.yaml decides every other.
ATTACH_KEYS = ("inference", "launcher", "cluster", "run_dir", "attach", "dry_run", "log_level")

# What `rlhpc-launch +attach=inference` exits with (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "the run is done and every attached worker left; launcher=slurm: the attach job completed (with "
       "launcher.wait=false: it was submitted); dry_run=true: the plan was printed",
    1: "an attached worker failed (the run goes on without it), the run failed, or the attach job was not submitted "
       "or did not complete",
    2: "refused before anything started (one line naming the key): run_dir holds no run that goes on, or the command "
       "line sets a key that changes training",
    124: "launcher.timeout_s was reached: the attached workers were ended (Slurm: their job cancelled)",
    130: "Ctrl-C: the attached workers were ended (launcher=slurm: their job keeps running); the run goes on",
    143: "SIGTERM: as Ctrl-C",
    129: "SIGHUP (the terminal was closed): as Ctrl-C",
}


@dataclass
class Attachment:
    run: RunDir
    cfg: Config  # the run's config with the command line's inference-side keys: what the attached workers run with
    first_rank: int  # the run's own workers are 0 .. first_rank-1
    id: str  # this attach command ("x<time>-<pid>"): names its folder and, locally, its workers' attempt

    @property
    def folder(self) -> Path:
        return self.run.rendezvous / "attach" / self.id


def attach(cmd: Config, overrides: Optional[Iterable[str]]) -> int:
    """The attach command: `cmd` is the composed command line, `overrides` its key=value arguments as given."""
    a = attachment(cmd, overrides or [])
    launcher = LocalAttach(a) if a.cfg.launcher.name == "local" else SlurmAttach(a)
    if a.cfg.dry_run:
        print(launcher.plan())
        return 0
    ranks = allocate_ranks(a.run, a.first_rank, a.cfg.inference.num_workers, a.id)
    a.folder.mkdir(parents=True, exist_ok=True)
    config_mod.save(a.cfg, a.folder / "config.yaml")
    return launcher.start(ranks)


def attachment(cmd: Config, overrides: Iterable[str]) -> Attachment:
    """Checks that run_dir holds a run that goes on, and makes the attached workers' config. Raises ConfigError (one
    line naming the key) for a run_dir without a running run or a command-line key the attach may not set."""
    config_mod.need(cmd.attach == "inference", "attach", f"{cmd.attach!r} is not one of: inference")
    run = RunDir(Path(cmd.run_dir))
    if not run.config.exists():
        raise ConfigError(f"config key `run_dir`: {run.root} holds no run (no config.yaml): attach=inference adds "
                          f"workers to a run started by `python -m rlhpc.launch`; start the run first")
    finished = [p.relative_to(run.root).as_posix() for p in (run.summary, run.done) if p.exists()]
    if finished:
        raise ConfigError(f"config key `run_dir`: {run.root} holds a finished run ({finished[0]}): there is nothing "
                          f"to attach workers to")
    if run.failed.exists():
        raise ConfigError(f"config key `run_dir`: {run.root} holds a failed run ({run.failure()}); relaunch it, then "
                          f"attach workers")
    try:
        saved = OmegaConf.load(run.config)
        merged = OmegaConf.merge(OmegaConf.structured(Config), saved)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config key `run_dir`: {run.config} cannot be read ({one_line(e)})") from None
    first_rank = int(merged.inference.num_workers)
    given = OmegaConf.structured(cmd)
    for key in override_keys(overrides):
        if key.split(".")[0] not in ATTACH_KEYS:
            raise ConfigError(f"config key `{key}`: attach=inference takes only inference.*, launcher.*, cluster.* and "
                              f"run_dir from the command line; the run's config.yaml decides the rest")
        OmegaConf.update(merged, key, OmegaConf.select(given, key), merge=False, force_add=True)
    merged.run_dir, merged.attach = str(run.root), "inference"
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    changes = [c for c in training_changes(saved, cfg) if c[0] != "attach"]
    if changes:
        key, old, new = changes[0]
        raise ConfigError(f"config key `{key}`: the run has {old!r}, the command line {new!r}: that changes training, "
                          f"which attached workers cannot; leave it out")
    config_mod.validate(cfg)
    if cfg.launcher.name not in ("local", "slurm"):
        raise ConfigError(f"config key `launcher.name`: attach=inference runs with launcher=local or launcher=slurm, "
                          f"not {cfg.launcher.name!r}")
    if cfg.inference.nodes_per_instance > 1:
        raise ConfigError(f"config key `inference.nodes_per_instance`: attached workers run instances on one node; "
                          f"the run has {cfg.inference.nodes_per_instance} nodes per instance: set it to 1 (with an "
                          f"inference.tensor_parallel_size that fits one node)")
    if cfg.inference.serve and cfg.weights.transport == "broadcast" and not cfg.inference.serve_open:
        raise ConfigError("config key `inference.serve`: attached workers cannot serve with the run's token over "
                          "weights.transport=broadcast yet; set inference.serve=false (or inference.serve_open=true)")
    return Attachment(run, cfg, first_rank, f"x{int(time.time())}-{os.getpid()}")


def override_keys(overrides: Iterable[str]) -> List[str]:
    """The config keys of `key=value` arguments (`+key`, `++key`, `~key` as the key; a config group by its name;
    Hydra's own `hydra.*` left out)."""
    keys = []
    for o in overrides:
        key = o.partition("=")[0].lstrip("+~").split("@")[0]
        if key and not key.startswith(("hydra.", "hydra/")) and key != "hydra":
            keys.append(key.replace("/", "."))
    return keys


def allocate_ranks(run: RunDir, first: int, count: int, attach_id: str) -> List[int]:
    """`count` ranks no process of the run has had: each is the first free `rendezvous/attach/<rank>` from `first`
    up, created exclusively (two attach commands at once never get the same one); a rank is never given twice."""
    folder = run.rendezvous / "attach"
    folder.mkdir(parents=True, exist_ok=True)
    ranks: List[int] = []
    rank = first
    while len(ranks) < count:
        try:
            fd = os.open(folder / str(rank), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            rank += 1
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f'{{"attach": "{attach_id}", "host": "{os.uname().nodename}", "pid": {os.getpid()}, '
                    f'"time": {time.time():.3f}}}\n')
        ranks.append(rank)
        rank += 1
    return ranks


# ---- launcher=local ---------------------------------------------------------------------------------------------------


class LocalAttach:
    """The K workers as processes of this machine, through the local launcher's spawn and restart."""

    def __init__(self, a: Attachment):
        from rlhpc.cluster.local_launcher import LocalLauncher

        self.a = a
        self.launcher = LocalLauncher(a.cfg)
        self.launcher.attempt = a.id
        self.launcher.env = {"RLHPC_ATTACH": "1", "RLHPC_CONFIG_DIR": str(a.folder)}

    def plan(self) -> str:
        c = self.a.cfg
        return (f"launcher=local +attach=inference run_dir={self.a.run.root}\n"
                f"  attach: {c.inference.num_workers} inference process(es), engine={c.inference.engine}, ranks from "
                f"{self.a.first_rank} (the first free under rendezvous/attach/)\n"
                f"  weights: {c.weights.transport}; restarts per worker: {c.inference.max_restarts}\n"
                f"  they leave when the run is done (status/DONE) or this command ends")

    def start(self, ranks: List[int]) -> int:
        run, cfg, launcher = self.a.run, self.a.cfg, self.launcher
        stop = {"signal": None}

        def on_signal(signum, frame):  # noqa: ARG001
            stop["signal"] = signum

        old = on_stop_signals(on_signal)
        t0 = time.time()
        try:
            for r in ranks:
                launcher.procs.append(launcher.spawn(run, "inference", r, len(ranks),
                                                     {"RLHPC_RESTARTS_LEFT": str(cfg.inference.max_restarts)}))
            print(f"attached inference worker(s) {', '.join(map(str, ranks))} to {run.root}\n"
                  f"logs: {', '.join(str(run.log_file('inference', r)) for r in ranks)}", flush=True)
            code = self.watch(t0, stop)
        finally:
            launcher.end_all()
            for s, h in old.items():
                signal.signal(s, h)
        published = sum((read_json(run.status / f"inference-{r}.json") or {}).get("published", 0) for r in ranks)
        print(f"attached worker(s) {', '.join(map(str, ranks))} published {published} queue file(s) in "
              f"{time.time() - t0:.0f}s", flush=True)
        return code

    def watch(self, t0: float, stop: dict) -> int:
        run, cfg, launcher = self.a.run, self.a.cfg, self.launcher
        while True:
            if stop["signal"] is not None:
                print(f"stopping: received {signal.Signals(stop['signal']).name}; ending the attached workers "
                      f"(the run goes on)", file=sys.stderr)
                return exit_code(stop["signal"])
            if run.failed.exists():
                print(f"the run failed ({run.failure()}); ending the attached workers", file=sys.stderr)
                return 1
            failed = [p for p in launcher.procs if p.popen.poll() not in (None, 0) and not launcher.restart(run, p)]
            launcher.start_due(run)
            if failed and not run.done.exists():
                p = failed[0]
                print(f"attached {p.name} exited with code {p.popen.returncode}; the run goes on without it; ending "
                      f"the other attached "
                      f"workers. Last lines of {run.log_file(p.role, p.rank)}:\n"
                      f"{tail(run.log_file(p.role, p.rank), 40)}", file=sys.stderr)
                return 1
            if all(p.popen.poll() is not None and p.name not in launcher.due for p in launcher.procs) \
                    or run.done.exists():
                return self.leave()
            if cfg.launcher.timeout_s and time.time() - t0 > cfg.launcher.timeout_s:
                print(f"launcher.timeout_s={cfg.launcher.timeout_s:.0f}s reached; ending the attached workers",
                      file=sys.stderr)
                return 124
            time.sleep(0.2)

    def leave(self, grace_s: float = 30.0) -> int:
        """The run is done (or every worker left on its own): give the workers `grace_s` to exit, 0 if all did."""
        procs, run = self.launcher.procs, self.a.run
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.popen.poll() is None for p in procs):
            time.sleep(0.1)
        bad = [p for p in procs if p.popen.poll() not in (None, 0) and p.name not in self.launcher.due]
        for p in bad:
            print(f"attached {p.name} exited with code {p.popen.returncode}. Last lines of "
                  f"{run.log_file(p.role, p.rank)}:\n{tail(run.log_file(p.role, p.rank), 40)}", file=sys.stderr)
        if not bad and not run.done.exists():
            print("the attached workers left before the run was done (the trainer stopped? see their logs); attach "
                  "again once the run goes on", file=sys.stderr)
        return 1 if bad else 0


# ---- launcher=slurm ---------------------------------------------------------------------------------------------------


class SlurmAttach:
    """The K workers as one Slurm job of one component, running the same task loop as the run's own workers (their
    restarts included): rlhpc.run.slurm_identity reads their ranks from RLHPC_ATTACH_RANKS."""

    def __init__(self, a: Attachment):
        from rlhpc.cluster.hetjob import make_plan

        self.a = a
        plan = make_plan(a.cfg)  # the checks of the inference component (tasks, CPUs, GPUs per worker)
        self.job = replace(plan, name=f"{plan.name}-attach", groups=[replace(plan.inference, component=0)],
                           requeue=False)

    def plan(self) -> str:
        from rlhpc.cluster.hetjob import start_lines

        g, c = self.job.groups[0], self.a.cfg
        return "\n".join([
            f"launcher=slurm +attach=inference: one Slurm job `{self.job.name}` of inference workers only",
            f"  run_dir: {self.a.run.root}",
            f"  inference {g.nodes} node(s) x {g.tasks_per_node} task(s) = {g.tasks} worker(s); {g.cpus_per_task} "
            f"CPU(s)/task, {g.gpus_per_node} GPU(s)/node, {f'{g.mem_gb} GB/node' if g.mem_gb else 'default memory'}, "
            f"{g.time_min} min",
            f"  ranks: allocated at submission, from {self.a.first_rank} (the first free under rendezvous/attach/)",
            f"  weights: {c.weights.transport}; restarts per worker: {c.inference.max_restarts}; no requeue",
            *start_lines(self.job, ATTACH_STEP),
            "",
            "----- job script -----",
            self.script(["<ranks>"]),
        ])

    def script(self, ranks: List[object]) -> str:
        from rlhpc.cluster.hetjob import _component_lines, _sbatch, run_dir_line, srun_line

        plan, g, folder = self.job, self.job.groups[0], self.a.folder
        header = [
            "#!/bin/bash",
            f"# rlhpc: inference workers attached to the run in {plan.run_dir} (`+attach=inference`)",
            _sbatch("job-name", plan.name),
            _sbatch("output", plan.run_dir / "logs" / "slurm-attach-%j.out"),
            _sbatch("open-mode", "append"),
            _sbatch("signal", f"B:USR1@{plan.grace_s}"),
            _sbatch("no-requeue"),
        ] + _component_lines(plan, g)
        env = [
            "",
            run_dir_line(plan.run_dir),
            f"export RLHPC_PYTHON={shlex.quote(plan.python)}",
            f"export RLHPC_MAX_RESTARTS={plan.max_restarts}",
            f"export RLHPC_RESTART_WINDOW_S={plan.restart_window_s}",
            f"export RLHPC_RESTART_BACKOFF_S={plan.restart_backoff_s:g}",
            "export RLHPC_ATTACH=1",
            f"export RLHPC_ATTACH_RANKS={','.join(map(str, ranks))}",
            f"export RLHPC_CONFIG_DIR={shlex.quote(str(folder))}",
            "export PYTHONUNBUFFERED=1",
        ]
        if plan.setup:
            env += ["", "# cluster.setup"] + list(plan.setup)
        env += ["", "set -u"]
        return "\n".join(header + env) + "\n" + _ATTACH_BODY.replace("__SRUN__", srun_line(plan, ATTACH_STEP))

    def start(self, ranks: List[int]) -> int:
        from rlhpc.cluster.slurm_launcher import HetJobExecutor

        a = self.a
        script = a.folder / "job.sbatch"
        script.write_text(self.script(ranks))
        (a.folder / "slurm").mkdir(exist_ok=True)  # submitit's record of the submission
        try:
            executor = HetJobExecutor(a.folder / "slurm", script.read_text(), len(ranks))
            job_id = executor.submit_script().job_id
        except Exception as e:  # noqa: BLE001 - no Slurm here, or sbatch refused the job: its message says which
            print(f"error: the attach job was not submitted: {one_line(e)}", file=sys.stderr)
            return 1
        write_json(a.folder / "job.json", {"job_id": job_id, "name": self.job.name, "ranks": ranks,
                                           "submitted": time.time(), "script": str(script)})
        print(f"submitted job {job_id} ({self.job.name}): inference worker(s) {', '.join(map(str, ranks))} for "
              f"{a.run.root}\nlogs: {a.run.logs}/inference-<rank>.log\nstop: scancel {job_id}", flush=True)
        return self.wait(job_id) if a.cfg.launcher.wait else 0

    def wait(self, job_id: str) -> int:
        """Follows the job to its end: 0 if it completed."""
        timeout, t0 = self.a.cfg.launcher.timeout_s, time.time()
        try:
            while _squeue_state(job_id):
                if timeout and time.time() - t0 > timeout:
                    print(f"launcher.timeout_s={timeout:.0f}s reached; cancelling job {job_id}", file=sys.stderr)
                    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
                    return 124
                time.sleep(2.0)
        except KeyboardInterrupt:
            print(f"\nstopped following job {job_id}; it keeps running (scancel {job_id} ends it)", file=sys.stderr)
            return 130
        state = _sacct_state(job_id)
        print(f"job {job_id}: {state or 'ended'}", file=sys.stderr if state not in ("", "COMPLETED") else sys.stdout)
        return 0 if state in ("", "COMPLETED") else 1


def _squeue_state(job_id: str) -> str:
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"  # ask again
    return out.stdout.strip()


def _sacct_state(job_id: str) -> str:
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.split() or [""])[0]


# srun's options of the step that starts the attached workers' tasks (one failing worker does not end the others).
ATTACH_STEP = ["--kill-on-bad-exit=0", "--unbuffered"]

# The job's batch shell: start every worker's task loop (hetjob's: restarts, exit on status/DONE), pass Slurm's
# signals on (the time limit's USR1, scancel's TERM: the workers stop), and never touch the run's status markers.
_ATTACH_BODY = r"""
mkdir -p "$RLHPC_RUN_DIR/logs"
echo "rlhpc: job $SLURM_JOB_ID: inference worker(s) $RLHPC_ATTACH_RANKS attached to $RLHPC_RUN_DIR on" \
     "$SLURM_JOB_NODELIST" >&2
signalled=""
interrupted=0
forward() {
    signalled=$1
    interrupted=1
    kill -s "$1" "$srun_pid" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

__SRUN__ &
srun_pid=$!
rc=0
while true; do
    interrupted=0
    wait "$srun_pid"
    code=$?
    [[ $code == 127 ]] && break
    rc=$code
    [[ $interrupted == 1 ]] || break
done
# Stopped by the time limit or scancel: the workers left as asked.
[[ -n $signalled ]] && rc=0
exit $rc
"""
