"""The one entry point of every role process: `python -m rlhpc.role`.

A role learns who it is from its environment (rlhpc.run.identity), never from the launcher object.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

from rlhpc.config import schema as config_mod
from rlhpc.run.identity import Identity, identity_from_env
from rlhpc.run.procs import end_with_launcher
from rlhpc.run.rundir import RunDir, no_space, out_of_space_advice, space_problem, write_json
from rlhpc.run.stop import REQUEUE_EXIT, Stop, install_stop_handlers, stop_requested


def setup_logging(run: RunDir, ident: Identity, level: str) -> None:
    fmt = f"%(asctime)s {ident.role}[{ident.rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr, force=True)


def identity() -> Identity:
    """Who this process is: from the local launcher's RLHPC_* variables, or from a Slurm heterogeneous job's."""
    if "RLHPC_ROLE" in os.environ:
        return identity_from_env()
    if "SLURM_JOB_ID" in os.environ:
        from rlhpc.run.slurm_identity import identity_from_slurm

        # The task's GPU (trainer: cuda:LOCAL_RANK; engines: rlhpc/infer/engines): the job script exports it, a
        # hand-written `srun python -m rlhpc.role` may not.
        if "SLURM_LOCALID" in os.environ:
            os.environ.setdefault("LOCAL_RANK", os.environ["SLURM_LOCALID"])
        return identity_from_slurm(os.environ)
    raise RuntimeError("rlhpc.role needs RLHPC_ROLE/RLHPC_RANK/RLHPC_ROLE_SIZE/RLHPC_RUN_DIR or a Slurm job environment")


def main() -> int:
    ident = identity()
    run = RunDir(ident.run_dir)
    # Attached workers (rlhpc.cluster.attach) read the run's config with their command line's inference keys.
    cfg = config_mod.load(os.environ.get("RLHPC_CONFIG_DIR") or run.root)
    setup_logging(run, ident, cfg.log_level)
    install_stop_handlers()
    end_with_launcher()  # a local launcher's role stops when the launcher dies, as on Ctrl-C
    # Every thread's stack into this log on SIGUSR2: the launcher's hang watchdog asks for it (cluster/watchdog.py).
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    log = logging.getLogger("rlhpc.role")
    log.info("starting %s rank %d/%d pid %d in %s%s", ident.role, ident.rank, ident.size, os.getpid(), run.root,
             " (forked from the launcher's preload process)" if os.environ.get("RLHPC_PRELOADED") else "")
    try:
        if ident.role == "trainer":
            from rlhpc.infer.rollout import evaluator
            from rlhpc.train.trainer import run_trainer

            if run_trainer(cfg, ident, run, evaluator) == "requeue":  # the warm start measures through inference's code
                log.warning("checkpointed after %s; exiting with %d (requeue)", stop_requested(), REQUEUE_EXIT)
                return REQUEUE_EXIT
        elif ident.role == "inference":
            from rlhpc.infer.worker import run_worker

            run_worker(cfg, ident, run)
        elif ident.role == "follower":  # vLLM model workers of another node of a worker's instance
            from rlhpc.infer.follower import run_follower

            run_follower(cfg, ident, run)
        else:
            raise ValueError(f"unknown role {ident.role!r}")
    except Stop as e:
        log.warning("stopped by %s", e)
        return 143
    except BaseException as e:
        log.exception("%s rank %d failed", ident.role, ident.rank)
        error = repr(e)
        # Some writers report a full disk as something else (a short write, a bad position): the folder is asked.
        full = str(e) if no_space(e) else space_problem(run.root)
        if full:
            error = f"out of space: {full} ({out_of_space_advice(run.root)})"
            log.error("%s", error)
        # The first failure is the cause; later ones are consequences. A worker the launcher may restart has not
        # failed the run (its launcher makes its error the run's if it stops restarting it), nor has an attached
        # worker (its attach command reports it).
        marker = run.error_file(ident.role, ident.rank) if ident.restarts_left else run.failed
        if not ident.attached and not run.failed.exists():
            try:
                write_json(marker, {"role": ident.role, "rank": ident.rank, "error": error}, durable=False)
            except OSError as w:  # a full disk: the launcher finds that out itself (rundir.space_problem)
                log.error("cannot write %s: %s", marker, w)
        return 1
    log.info("%s rank %d finished", ident.role, ident.rank)
    return 0


def finish(code: int) -> None:
    """Ends a role process with `code` once its logs are out (never returns)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    vllm_module = sys.modules.get("rlhpc.infer.engines.vllm")
    if vllm_module is not None:
        vllm_module.remove_temp_folders()  # os._exit skips atexit
    # Skip interpreter teardown: a communication thread blocked inside gloo/NCCL would abort the process there.
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--preload"]:  # the local launcher's preload process: forks roles (rlhpc/run/preload.py)
        from rlhpc.run.preload import serve

        sys.modules.setdefault("rlhpc.role", sys.modules["__main__"])
        serve(main, finish)
        sys.exit(0)
    finish(main())
