"""The local launcher: every role as a plain OS process on this machine, through the same entry point Slurm uses.

It watches its children: a role that fails ends the others and the launcher exits non-zero with the tail of that
role's log, except an inference worker (or follower) that the restart policy starts again (rlhpc.cluster.restarts:
`inference.max_restarts` per `inference.restart_window_s`, after a back-off, never one that crashes at every start),
which rejoins at the newest weights while training goes on, and a trainer killed by a signal or found hung, which
the restart policy (`trainer.max_restarts`) starts again from its newest checkpoint with fresh workers; Ctrl-C,
SIGTERM or a closed terminal (SIGHUP) ends every process it started, the trainer checkpointing on its way out; a
progress bar follows the trainer's heartbeat. Its roles stop when it dies, however it dies (rlhpc.run.procs)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Dict, List, Optional, Union

from rlhpc.cluster.restarts import Death, RestartPolicy, decide, last_line
from rlhpc.cluster.watchdog import HangWatch, inspect, waits_on_workers
from rlhpc.config.disaggregation import describe as disagg_describe
from rlhpc.config.schema import Config
from rlhpc.run.preload import Forked, Preload, PreloadError
from rlhpc.run.procs import LAUNCHER_PID, LOG_START, exit_code, free_port, on_stop_signals, tail
from rlhpc.run.rundir import RunDir, out_of_space_advice, read_json, space_problem, write_json


@dataclass
class Proc:
    role: str
    rank: int
    size: int
    popen: Union[subprocess.Popen, Forked]  # Forked: from the preload process (rlhpc/run/preload.py)
    log: IO

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"


def local_gpus(cfg: Config, role: str, rank: int, visible: List[str] | None = None) -> dict:
    """Where a role process computes on this machine (nothing without GPUs): trainer rank r on GPU r (LOCAL_RANK=r,
    all GPUs visible, as NCCL wants); inference worker r on the inference.tensor_parallel_size GPUs after the trainer's,
    wrapping around to share them when the machine has too few (then lower inference.gpu_memory_utilization)."""
    if visible is None:
        from_env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if from_env is not None:
            visible = [d for d in from_env.split(",") if d.strip()]
        else:
            visible = [str(i) for i in range(_device_count())]
    if not visible:
        return {}
    if role == "trainer":
        return {"LOCAL_RANK": str(rank)}
    tp = max(cfg.inference.tensor_parallel_size, 1)
    pd = cfg.inference.disaggregation
    if pd.enabled:  # a worker's prefill and decode instances
        tp += pd.prefill_tensor_parallel_size or tp
    first = cfg.trainer.num_ranks + rank * tp
    mine = [visible[(first + i) % len(visible)] for i in range(min(tp, len(visible)))]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine), "LOCAL_RANK": "0"}


def _device_count() -> int:
    """The GPUs of this machine. Without a GPU's device files (NVIDIA, AMD, WSL) there are none, and the launcher of a
    CPU run does not import torch to learn it (seconds of its start)."""
    if not any(os.path.exists(f) for f in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        return 0
    import torch

    return torch.cuda.device_count()  # NVML: creates no CUDA context


class LocalLauncher:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.procs: List[Proc] = []
        self.restarts: dict = {}  # name of an inference worker or follower -> times restarted
        self.deaths: Dict[str, List[Death]] = {}  # name -> its deaths, oldest first (rlhpc.cluster.restarts)
        self.due: Dict[str, float] = {}  # name of a dead worker -> when its back-off ends and it starts again
        self.failure: Optional[Proc] = None  # the role whose failure ended the watch (`cause`), if one did
        self.hung = False  # the watch ended because the trainer hung (cluster.hang_timeout_s)
        self.trainer_deaths: List[Death] = []  # the trainer's deaths and hangs in this launch, oldest first
        self.start_step = 0  # the newest checkpoint when the trainer of this life started
        self.env: dict = {}  # added to every role's environment (attached workers: rlhpc.cluster.attach)
        self.preload: Optional[Preload] = None  # started at the first spawn where launcher.preload is on
        self.preload_failed = not cfg.launcher.preload
        self.stopping: Callable[[], bool] = lambda: False  # a stop signal came: a wait for the preload process ends

    def test_allocation(self) -> None:
        """Nothing to ask a scheduler: local processes (SlurmLauncher.test_allocation)."""
        return None

    def plan(self) -> str:
        c = self.cfg
        return (
            f"launcher=local run_dir={c.run_dir}\n"
            f"  trainer:   {c.trainer.num_ranks} process(es), {c.trainer.threads} thread(s) each\n"
            f"  inference: {c.inference.num_workers} process(es), engine={c.inference.engine}\n"
            + (f"  followers: {c.inference.num_workers * (c.inference.nodes_per_instance - 1)} process(es): each "
               f"instance spans {c.inference.nodes_per_instance} 'nodes' (inference.nodes_per_instance), here all on "
               f"this machine\n" if c.inference.nodes_per_instance > 1 else "")
            + f"  weights group: {c.inference.num_workers + 1} members ({c.weights.transport})\n"
            f"  steps: sft={c.sft.steps} rl={c.trainer.steps} async_level={c.async_level}"
        ) + "".join("\n" + line for line in disagg_describe(c.inference))

    def base_env(self, root: Path) -> dict:
        """The environment every role of the run in `root` shares (the preload process's too)."""
        env = dict(os.environ)
        env.update(RLHPC_RUN_DIR=str(root), PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.cfg.trainer.threads),
                   **{LAUNCHER_PID: str(os.getpid())}, **self.env)  # roles stop when this process dies
        return env

    def start_preload(self, root: Path, stderr: Optional[Path] = None) -> None:
        """Starts the preload process for the run in `root` (rlhpc/run/preload.py); `rlhpc.launch` calls it before its
        checks, so that its imports overlap them. Where it cannot start, roles are new interpreters."""
        if self.preload_failed or self.preload is not None:
            return
        try:
            # A GPU check in its imports asks NVML, which leaves CUDA usable in the forked roles.
            self.preload = Preload(dict(self.base_env(root), PYTORCH_NVML_BASED_CUDA_CHECK="1"), stderr)
        except (PreloadError, OSError) as e:
            self.no_preload(e)

    def spawn(self, run: RunDir, role: str, rank: int, size: int, extra_env: dict) -> Proc:
        base = self.base_env(run.root)
        env = dict(base, RLHPC_ROLE=role, RLHPC_RANK=str(rank), RLHPC_ROLE_SIZE=str(size), RLHPC_ATTEMPT=self.attempt,
                   **local_gpus(self.cfg, role, rank), **extra_env)
        run.error_file(role, rank).unlink(missing_ok=True)  # an error of an earlier life is not this one's
        path = run.log_file(role, rank)
        log = open(path, "ab")
        restart = extra_env.get("RLHPC_RESTART")
        log.write(f"{LOG_START} {role}-{rank} at {time.strftime('%Y-%m-%d %H:%M:%S')} (launch {self.attempt}"
                  f"{f', restart {restart}' if restart else ''})\n".encode())
        log.flush()
        if self.preload is not None and self.preload.env.get("RLHPC_RUN_DIR") != base["RLHPC_RUN_DIR"]:
            self.end_preload()  # started for another folder (a run_dir renamed after it started)
        self.start_preload(run.root, run.logs / "preload.txt")
        if self.preload is not None:
            try:
                return Proc(role, rank, size, self.preload.spawn(env, path, self.stopping), log)
            except PreloadError as e:
                self.no_preload(e)
        popen = subprocess.Popen(
            [sys.executable, "-m", "rlhpc.role"], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,  # its own process group, ended as one
        )
        return Proc(role, rank, size, popen, log)

    def no_preload(self, why: Exception) -> None:
        """The preload process cannot serve: said once, and every role from now on is a new interpreter."""
        print(f"launcher.preload: {why}; starting each role as a new process", file=sys.stderr, flush=True)
        self.preload_failed = True
        self.end_preload()

    def end_preload(self) -> None:
        if self.preload is not None:
            self.preload.close()
            self.preload = None

    def start(self, run: RunDir) -> int:
        cfg = self.cfg
        t0 = time.time()
        stop = {"signal": None}

        def on_signal(signum, frame):  # noqa: ARG001
            if stop["signal"] is not None:  # a second Ctrl-C: the trainer's checkpoint is not waited for
                stop["again"] = True
            stop["signal"] = stop["signal"] or signum

        old = on_stop_signals(on_signal)
        self.stopping = lambda: stop["signal"] is not None
        try:
            for life in itertools.count():
                # Each life of the trainer is an attempt of its own: its weights group meets at a new rendezvous.
                self.attempt = f"{int(time.time())}-{os.getpid()}" + (f"-{life}" if life else "")
                self.start_roles(run)
                if life == 0:
                    print(f"run_dir: {run.root}\nlogs:    {run.logs}/  (tensorboard --logdir {run.tb})", flush=True)
                code = self.watch(run, t0, stop)
                delay = self.trainer_restart(run, code, stop)
                if delay is None:
                    break
                self.end_all(keep_preload=True)  # the workers too: they meet the new trainer as a new group
                self.procs, self.due = [], {}
                for stale in (run.failed, run.requeue):  # the dead life's, as a new launch drops them
                    stale.unlink(missing_ok=True)
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline and stop["signal"] is None:
                    time.sleep(0.1)
                if stop["signal"] is not None:
                    code = exit_code(stop["signal"])
                    break
        finally:
            if stop["signal"] is None or not any(p.role == "trainer" and p.popen.poll() is None for p in self.procs):
                self.end_all()
            else:  # the trainer ends its step and checkpoints (rlhpc/run/stop.py): a step and a save may take a while
                grace = cfg.cluster.grace_s
                print(f"waiting up to cluster.grace_s={grace}s for the trainer to checkpoint (Ctrl-C again to end it "
                      f"now)", file=sys.stderr, flush=True)
                self.end_all(trainer_grace_s=grace, cut=lambda: stop.get("again", False))
            for s, h in old.items():
                signal.signal(s, h)
        if code == 0:
            from rlhpc.run.summary import print_summary

            print_summary(run, wall_time_s=time.time() - t0)
        return code

    def start_roles(self, run: RunDir) -> None:
        cfg = self.cfg
        master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        for r in range(cfg.trainer.num_ranks):
            self.procs.append(self.spawn(run, "trainer", r, cfg.trainer.num_ranks, master))
        for r in range(cfg.inference.num_workers):
            self.procs.append(self.spawn(run, "inference", r, cfg.inference.num_workers,
                                         {"RLHPC_RESTARTS_LEFT": str(cfg.inference.max_restarts)}))
        # The other "nodes" of instances that span several (rlhpc/infer/follower.py), here on this machine.
        followers = cfg.inference.num_workers * (cfg.inference.nodes_per_instance - 1)
        for r in range(followers):
            self.procs.append(self.spawn(run, "follower", r, followers,
                                         {"RLHPC_RESTARTS_LEFT": str(cfg.inference.max_restarts)}))
        self.start_step = checkpoint_step(run)
        self.failure, self.hung = None, False

    def trainer_restart(self, run: RunDir, code: int, stop: dict) -> Optional[float]:
        """After a watch that ended with `code`: the seconds to wait before the trainer (with fresh workers) starts
        again from its newest checkpoint, or None when the run ends here. Restarted: a trainer killed by a signal or
        found hung, within trainer.max_restarts, unless the run was stopped, finished, or is out of space."""
        p = self.failure
        if code != 1 or p is None or p.role != "trainer" or stop["signal"] is not None or run.done.exists():
            return None
        if not self.hung and (p.popen.returncode or 0) >= 0:
            return None  # a Python error: its log says why, and a restart would repeat it
        if space_problem(run.root):
            return None  # said by the watch
        if self.hung:
            _killpg(p.popen.pid, signal.SIGKILL)  # stopped or stuck: no grace to give it
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): nothing to restart into
                print(f"the hung trainer (pid {p.popen.pid}) did not end on SIGKILL within 10s; not restarting it",
                      file=sys.stderr, flush=True)
                return None
        log = run.log_file(p.role, p.rank)
        latest = checkpoint_step(run)
        self.trainer_deaths.append(Death(time.monotonic(), p.popen.returncode,
                                         ("hung: " if self.hung else "") + last_line(tail(log, 20)),
                                         worked=latest > self.start_step))
        verdict = decide(self.trainer_deaths, RestartPolicy.of_trainer(self.cfg.trainer))
        if not verdict.restart:
            if self.cfg.trainer.max_restarts:
                print(f"not restarting the trainer: {verdict.why_not}", file=sys.stderr, flush=True)
            return None
        print(f"restarting the trainer ({verdict.count} of trainer.max_restarts={self.cfg.trainer.max_restarts}) "
              f"in {verdict.delay_s:g}s from its newest checkpoint ("
              + (f"step {latest}" if latest else "none yet: RL starts over") + "), with fresh inference workers",
              file=sys.stderr, flush=True)
        return verdict.delay_s

    def watch(self, run: RunDir, t0: float, stop: dict) -> int:
        cfg = self.cfg
        bar = _Progress(cfg) if cfg.launcher.progress else None
        trainers = [p for p in self.procs if p.role == "trainer"]
        hang = HangWatch(cfg.cluster.hang_timeout_s, run)
        try:
            while True:
                if stop["signal"] is not None:
                    print(f"\nstopping: received {signal.Signals(stop['signal']).name}; ending all roles", file=sys.stderr)
                    return exit_code(stop["signal"])
                failed = [p for p in self.procs if p.popen.poll() not in (None, 0) and not self.restart(run, p)]
                self.start_due(run)
                if failed:
                    p = self.failure = self.cause(run, failed[0])
                    print(f"\n{p.name} exited with code {p.popen.poll()}; ending the others. Last lines of "
                          f"{run.log_file(p.role, p.rank)}:\n{tail(run.log_file(p.role, p.rank), 40)}", file=sys.stderr)
                    full = space_problem(run.root)
                    if full:
                        print(f"\nrun_dir is out of space: {full}; {out_of_space_advice(run.root)}", file=sys.stderr)
                    return 1
                if all(p.popen.poll() == 0 for p in trainers):
                    if bar:
                        bar.update(run)  # the trainer's last heartbeat: the final held-out reward
                    # Workers see status/DONE and exit on their own; give them a moment, then end them.
                    deadline = time.time() + 30
                    while time.time() < deadline and any(p.popen.poll() is None for p in self.procs):
                        time.sleep(0.1)
                    bad = [p for p in self.procs if p.popen.poll() not in (None, 0) and p.name not in self.due]
                    if bad:
                        p = bad[0]
                        print(f"\n{p.name} exited with code {p.popen.returncode}:\n{tail(run.log_file(p.role, p.rank), 40)}",
                              file=sys.stderr)
                        return 1
                    return 0
                if cfg.launcher.timeout_s and time.time() - t0 > cfg.launcher.timeout_s:
                    print(f"\nlauncher.timeout_s={cfg.launcher.timeout_s:.0f}s reached; ending all roles", file=sys.stderr)
                    return 124
                if hang.due() and not self.on_hang(run, hang, t0):
                    self.failure = next((p for p in trainers if p.rank == 0), None)
                    self.hung = True
                    return 1
                if bar:
                    bar.update(run)
                time.sleep(0.2)
        finally:
            if bar:
                bar.close()

    def on_hang(self, run: RunDir, hang: HangWatch, t0: float) -> bool:
        """The trainer's heartbeat stood still for the hang timeout: report where every role is; kill the stuck workers
        for the restart policy (True: the run goes on) or end the run (False), naming the cause in status/FAILED."""
        timeout = hang.timeout_s()
        found = inspect(run, {p.name: p.popen.pid for p in self.procs if p.popen.poll() is None})
        print(f"\nhang: the trainer's heartbeat has not changed for {timeout:.0f}s (cluster.hang_timeout_s="
              f"{self.cfg.cluster.hang_timeout_s:g}); every role's stacks are in its log. Where each is:\n  "
              + "\n  ".join(s.line() for s in found), file=sys.stderr, flush=True)
        trainer = next((s for s in found if s.name == "trainer-0"), None)
        now = time.time()

        def silent_s(name: str) -> float:
            try:
                return now - (run.status / f"{name}.json").stat().st_mtime
            except OSError:
                return now - t0

        workers = [s for s in found if s.name.startswith(("inference-", "follower-"))
                   and (s.state == "stopped" or silent_s(s.name) > timeout)]
        if trainer is not None and waits_on_workers(trainer) and workers and self.cfg.inference.max_restarts:
            names = ", ".join(s.name for s in workers)
            print(f"hang: the trainer waits on the inference workers; killing {names} (no rollouts for {timeout:.0f}s "
                  f"or stopped) for inference.max_restarts to start again", file=sys.stderr, flush=True)
            for s in workers:
                _killpg(s.pid, signal.SIGKILL)
            hang.again()
            return True
        cause = trainer or (found[0] if found else None)
        error = (f"hung: the trainer's heartbeat did not change for {timeout:.0f}s (cluster.hang_timeout_s); "
                 + "; ".join(s.line() for s in found))
        try:
            write_json(run.failed, {"role": "trainer", "rank": 0, "error": error,
                                    **({"then": read_json(run.failed)} if run.failed.exists() else {})},
                       durable=False)
        except OSError:
            pass  # a full disk: reported on its own (space_problem)
        print(f"hang: ending the trainer{'' if cause is None else ' (' + cause.line() + ')'}; trainer.max_restarts "
              f"starts it again from its newest checkpoint, or else the same command resumes it", file=sys.stderr,
              flush=True)
        return False

    def restart(self, run: RunDir, p: Proc) -> bool:
        """Decides on a dead inference worker (or follower): True if it is to be started again (by start_due, once its
        back-off is over; it stays dead meanwhile and the others go on), False if its death ends the run. Refused, its
        error becomes the run's (status/FAILED) and the reason is printed."""
        if p.name in self.due:
            return True
        limit = self.cfg.inference.max_restarts
        if p.role not in ("inference", "follower") or run.done.exists() or run.failed.exists():
            return False
        log = run.log_file(p.role, p.rank)
        beat = read_json(run.status / f"{p.name}.json") or {}
        deaths = self.deaths.setdefault(p.name, [])
        deaths.append(Death(time.monotonic(), p.popen.returncode, last_line(tail(log, 20)),
                            worked=beat.get("pid") == p.popen.pid))
        verdict = decide(deaths, RestartPolicy.of(self.cfg.inference))
        why_not = verdict.why_not if limit else ""
        if verdict.restart and space_problem(run.root):  # it would only fail again: the run stops, saying why
            why_not = "run_dir is out of space"
        if not verdict.restart or why_not:
            if why_not:
                print(f"\n{p.name} exited with code {p.popen.returncode}; not restarting it: {why_not}", file=sys.stderr,
                      flush=True)
                self._report(run, p)
            return False
        self.restarts[p.name] = self.restarts.get(p.name, 0) + 1
        self.due[p.name] = time.monotonic() + verdict.delay_s
        window = self.cfg.inference.restart_window_s
        print(f"\n{p.name} exited with code {p.popen.returncode}; restarting it ({verdict.count} of "
              f"inference.max_restarts={limit}) in {verdict.delay_s:g}s"
              f"{f' (restarts count within inference.restart_window_s={window:g}s)' if window else ''}; last lines "
              f"of its log:\n{tail(log, 5)}", file=sys.stderr, flush=True)
        _killpg(p.popen.pid, signal.SIGKILL)  # what is left of its process group (environment pool processes)
        p.log.close()
        return True

    def start_due(self, run: RunDir) -> None:
        """Starts again the dead workers whose back-off is over, while the run goes on."""
        if run.done.exists() or run.failed.exists():
            return  # they are not needed any more (and are no failure): the watch loop ends the run
        for p in [p for p in self.procs if self.due.get(p.name, float("inf")) <= time.monotonic()]:
            del self.due[p.name]
            self.procs[self.procs.index(p)] = self.spawn(
                run, p.role, p.rank, p.size,
                {"RLHPC_RESTART": str(self.restarts[p.name]), "RLHPC_RESTARTS_LEFT": str(self.cfg.inference.max_restarts)})

    def _report(self, run: RunDir, p: Proc) -> None:
        """A worker that is not restarted again: its error (kept aside while it could be restarted) becomes the run's
        failure, unless another role's came first."""
        error = read_json(run.error_file(p.role, p.rank))
        if error and not run.failed.exists():
            try:
                write_json(run.failed, error, durable=False)
            except OSError:
                pass  # a full disk: reported on its own (space_problem)

    def cause(self, run: RunDir, first: Proc) -> Proc:
        """The role whose failure started it all: one killed by a signal (kill -9, the OOM killer, a crash), else the
        one status/FAILED names (a role that fails in Python writes it first), else the first seen dead.

        A role killed by a signal cannot write status/FAILED; the marker there is then a survivor's that failed
        because of it (a dead peer of its weights group). The launcher writes the killed role into status/FAILED in its
        place, so that `rlhpc.status` and the summary name the true cause; the survivor's report stays under "then".
        Signals of rlhpc's own (the launcher ends roles only after this) are not counted: none has been sent yet."""
        time.sleep(0.5)  # let the failing role's marker land
        info = read_json(run.failed)
        killed = [p for p in self.procs if (p.popen.poll() or 0) < 0 and p.name not in self.due]
        if killed:
            p = next((k for k in killed if k.popen.returncode == -signal.SIGKILL), killed[0])
            name = signal.Signals(-p.popen.returncode).name
            try:
                write_json(run.failed, {"role": p.role, "rank": p.rank, "error": f"killed by {name} (no Python error: "
                                        f"the process was killed from outside, or crashed)", "then": info},
                           durable=False)
            except OSError:
                pass  # a full disk: reported on its own (space_problem)
            return p
        if info:
            for p in self.procs:
                if (p.role, p.rank) == (info["role"], info["rank"]):
                    return p
        return first

    def end_all(self, grace_s: float = 10.0, trainer_grace_s: Optional[float] = None,
                cut: Callable[[], bool] = lambda: False, keep_preload: bool = False) -> None:
        """SIGTERM to each role's process group, then SIGKILL what is left after `grace_s` (trainers: after
        `trainer_grace_s`, when given), or as soon as `cut()` says so; then the preload process, unless kept for a
        restart."""
        alive = [p for p in self.procs if p.popen.poll() is None]
        for p in alive:
            _killpg(p.popen.pid, signal.SIGTERM)
        t0 = time.time()

        def waited_for(p: Proc) -> bool:
            limit = trainer_grace_s if p.role == "trainer" and trainer_grace_s is not None else grace_s
            return p.popen.poll() is None and time.time() - t0 < limit

        while any(waited_for(p) for p in alive) and not cut():
            time.sleep(0.1)
        for p in self.procs:
            _killpg(p.popen.pid, signal.SIGKILL)  # also any grandchildren left in the group
            if p.popen.poll() is None:
                p.popen.wait(timeout=5)
            p.log.close()
        if not keep_preload:
            self.end_preload()


def checkpoint_step(run: RunDir) -> int:
    """The step of the run's newest checkpoint (0: none)."""
    try:
        return int((read_json(run.checkpoints / "latest.json") or {}).get("step", 0))
    except (ValueError, TypeError, AttributeError):
        return 0  # garbled: the trainer's resume says what it finds


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Progress:
    """A terminal progress bar over the trainer's heartbeat (SFT steps, then RL steps)."""

    def __init__(self, cfg: Config):
        from tqdm import tqdm

        self.tqdm = tqdm
        self.cfg = cfg
        self.bar = None
        self.phase = None

    def update(self, run: RunDir) -> None:
        hb = read_json(run.status / "trainer-0.json")
        if not hb:
            return
        phase = hb.get("phase", "rl")
        n = hb.get("sft_step", 0) if phase == "sft" else hb.get("step", 0)
        if phase != self.phase:
            if self.bar:
                self.bar.close()
            total = self.cfg.sft.steps if phase == "sft" else self.cfg.trainer.steps
            # Starting at the step first seen (a resumed run's, say): its rate counts only the steps it saw taken.
            self.bar = self.tqdm(total=total, initial=n, desc=phase.upper(), unit="step", dynamic_ncols=True)
            self.phase = phase
        elif n > self.bar.n:
            self.bar.update(n - self.bar.n)
        post = {"loss": f"{hb.get('loss', 0):.3f}"}
        if phase != "sft":
            post.update(reward=f"{hb.get('reward', 0):.3f}", heldout=f"{hb.get('heldout', 0):.3f}")
        self.bar.set_postfix(post, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
