"""`python -m rlhpc.launch +exp=reverse_text [key=value ...]`: compose, check, write the run directory, start the roles.

The config is composed by Hydra on top of the typed schema (rlhpc.config.schema), so a wrong key or type fails here,
before any process starts; then the model, the environment and the loss are checked (rlhpc.preflight.checks). Every
such error is one line that names the config key. A model that passed its checks before (the same keys, files, library
versions and rlhpc code) is not built again to check it: that is remembered in $RLHPC_CACHE_DIR (default
~/.cache/rlhpc; deleting it only costs the next launch the check). The launcher (`launcher=local|slurm|sbatch`) then
starts the same role entry point everywhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, List, Optional

from rlhpc import commands
from rlhpc.cluster import memory
from rlhpc.config import schema as config_mod
from rlhpc.config.errors import config_key_error
from rlhpc.config.schema import Config, ConfigError
from rlhpc.preflight import checks as preflight
from rlhpc.preflight import rundir as run_setup
from rlhpc.preflight.rundir import RunDirError, prepare_run_dir
from rlhpc.run import trackers
from rlhpc.run.procs import STOP_SIGNALS, exit_code
from rlhpc.run.rundir import RunDir, read_json, resume_command


def launch(cfg: Config, overrides: Optional[List[str]] = None, new_run: bool = False) -> int:
    """Starts (or resumes) the run of `cfg`; with `attach=inference`, adds workers to the run in run_dir instead, taking
    from the command line (`overrides`, as given) only its inference-side keys (rlhpc.cluster.attach). `new_run`: the
    run_dir is named by the launch's time (the default), so a folder of that name is another launch's (of the same
    second), and this run takes the next free name instead (run_setup.new_run_dir)."""
    if cfg.attach is not None:
        from rlhpc.cluster.attach import attach

        return attach(cfg, overrides)
    config_mod.validate(cfg)
    warm = None
    if cfg.launcher.name == "local" and not cfg.dry_run:
        from rlhpc.cluster.local_launcher import LocalLauncher

        # The roles' preload process imports torch and transformers while the checks below run (rlhpc/run/preload.py).
        warm = LocalLauncher(cfg)
        warm.start_preload(Path(cfg.run_dir))
    try:
        return _launch(cfg, overrides, new_run, warm)
    finally:
        if warm is not None:
            warm.end_preload()  # a refused launch's; a started one's ended with its roles


def _launch(cfg: Config, overrides: Optional[List[str]], new_run: bool, warm: Any) -> int:
    # The model, the environment and the loss, before anything starts (a dry run may plan for a model.path that only
    # the cluster's filesystem holds).
    preflight.check(cfg, model=not cfg.dry_run)
    if cfg.launcher.name == "local":
        from rlhpc.cluster.local_launcher import LocalLauncher as Launcher
    elif cfg.launcher.name == "slurm":
        from rlhpc.cluster.slurm_launcher import SlurmLauncher as Launcher  # type: ignore[no-redef]
    else:
        from rlhpc.cluster.sbatch_launcher import SbatchLauncher as Launcher  # type: ignore[no-redef]
    launcher = _adopt(Launcher(cfg), warm)
    fit = memory.plan(cfg)  # the device mesh, the memory per GPU (or CPU process); refused if it cannot fit or divide
    # Slurm's own verdict on the job (sbatch --test-only), where Slurm answers: a partition that does not exist, more
    # nodes than it has, ... (not asked for a job only written, or where no Slurm answers); and a cluster.python the
    # job's tasks could not run. None for the local launcher.
    slurm = launcher.test_allocation()
    if cfg.dry_run:
        print(fit.placed_in(launcher.plan()))
        if slurm:  # a plan may be made on a machine whose Slurm is not the cluster's: told, not refused
            print(f"  note: {slurm}")
        if fit.refusal:
            print(f"error: {fit.refusal}", file=sys.stderr)
            return 2
        return 0
    if fit.refusal:
        raise ConfigError(fit.refusal)
    if slurm:
        raise ConfigError(slurm)
    if new_run:
        cfg.run_dir = str(run_setup.new_run_dir(Path(cfg.run_dir)))
        launcher = _adopt(Launcher(cfg), warm)  # placed in the folder made (a preload process started for the
        # folder's first name is replaced at the first spawn if the name changed)
    with run_setup.launch_lock(Path(cfg.run_dir)):
        run = prepare_run_dir(cfg)
        trackers.prepare(cfg, run)  # the tracker runs every role writes to (an earlier launch's, continued)
        code = launcher.start(run)
    if cfg.launcher.name == "local" and code in map(exit_code, STOP_SIGNALS):  # stopped: the roles have ended
        print(stopped_note(run, cfg, overrides), file=sys.stderr)
    return code


def _adopt(launcher: Any, warm: Any) -> Any:
    """The local launcher that starts the roles takes the preload process `warm` started before the checks."""
    if warm is not None:
        launcher.preload, launcher.preload_failed = warm.preload, warm.preload_failed
    return launcher


def stopped_note(run: RunDir, cfg: Config, overrides: Optional[List[str]]) -> str:
    """What a local run stopped by Ctrl-C, SIGTERM or SIGHUP kept, and the command that goes on from there."""
    try:
        saved = read_json(run.requeue)  # the trainer's, when it saved its state on the way out
        latest = read_json(run.checkpoints / "latest.json")
    except ValueError:  # garbled by a foreign hand; the next launch says what it resumes from
        saved = latest = None
    if isinstance(saved, dict) and "sft_step" in saved:
        kept = (f"the trainer saved the SFT warm start after SFT step {saved['sft_step']}" if saved["sft_step"] else
                "the trainer was in the SFT warm start and had no step to save yet")
    elif isinstance(saved, dict) and "step" in saved:
        kept = f"the trainer checkpointed on the way out; RL goes on at step {saved['step']} of {cfg.trainer.steps}"
    elif isinstance(latest, dict) and "step" in latest:
        kept = (f"the trainer ended before it could checkpoint; RL goes on from the newest checkpoint, at step "
                f"{latest['step']} of {cfg.trainer.steps}")
    else:
        kept = "nothing was checkpointed yet"
    again = resume_command(run.root, overrides) if overrides is not None else f"the same launch with run_dir={run.root}"
    return f"stopped: {kept}. To go on:\n  {again}"


# What the command's exit status says (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "the run finished (its summary is printed); launcher=slurm or sbatch with launcher.wait=false: the job was "
       "submitted (launcher.submit=false: its script written); dry_run=true: the plan fits",
    1: "a role failed (the end of its log is printed), the Slurm job ended other than COMPLETED or was not submitted, "
       "or a point of a sweep (-m) failed",
    2: "the config was refused before anything started (one line naming the key), or dry_run=true's plan does not fit",
    124: "launcher.timeout_s was reached: the roles were ended (Slurm: the job cancelled)",
    130: "Ctrl-C: a local run's roles ended once the trainer checkpointed, and the command that goes on is printed; "
         "launcher=slurm stops following the job, which keeps running",
    143: "SIGTERM: as Ctrl-C",
    129: "SIGHUP (the terminal was closed): as Ctrl-C",
}


def main() -> None:
    attach = any(a.lstrip("+").startswith("attach=") for a in sys.argv[1:])

    def _main(dcfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        try:
            check_sweep_run_dir(list(HydraConfig.get().overrides.task))
        except ConfigError as e:  # every point would fail alike: the sweep ends at its first
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        try:
            cfg = config_mod.to_typed(dcfg)
            code = launch(cfg, list(HydraConfig.get().overrides.task), new_run=named_by_time(dcfg))
        except (ConfigError, RunDirError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
        except KeyboardInterrupt:  # Ctrl-C before anything runs (the launchers handle it once they follow a run)
            print("\ninterrupted: nothing was started", file=sys.stderr)
            code = 130
        except Exception as e:  # noqa: BLE001 - a wrong type that only the typed merge sees
            from omegaconf.errors import OmegaConfBaseException

            if not isinstance(e, OmegaConfBaseException):
                raise
            print(f"error: {config_key_error(e)}", file=sys.stderr)
            code = 2
        if code:
            from hydra.types import RunMode

            if HydraConfig.get().mode == RunMode.MULTIRUN and code != 130:  # one bad point does not end the sweep
                print(f"sweep point {HydraConfig.get().job.num} failed with code {code}", file=sys.stderr)
                FAILED_POINTS.append(HydraConfig.get().job.num)
                return
            sys.exit(code)  # Ctrl-C (130) ends a sweep too

    commands.hydra_command("attach" if attach else "launch", _main)
    if FAILED_POINTS:  # the sweep ran every point; its exit code says that some failed
        print(f"sweep: point(s) {', '.join(map(str, FAILED_POINTS))} failed", file=sys.stderr)
        sys.exit(1)


def named_by_time(dcfg: Any) -> bool:
    """Whether run_dir names a new run by the time of its launch (`${now:...}`: the default, outside sweeps, whose
    points each get their Hydra job folder)."""
    from omegaconf import OmegaConf

    from rlhpc.cluster.slurm_launcher import SweepCallback

    raw = OmegaConf.to_container(dcfg, resolve=False).get("run_dir")
    return isinstance(raw, str) and "${now:" in raw and not os.environ.get(SweepCallback.ENV)


def check_sweep_run_dir(overrides: List[str]) -> None:
    """In a sweep, a run_dir given on the command line must differ per point (e.g. contain ${hydra:job.num}); by
    default each point gets its own (conf/config.yaml)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    fixed = [o for o in overrides if o.startswith("run_dir=") and "${" not in o]
    if fixed:
        raise ConfigError(f"config key `run_dir`: every point of this sweep would write {fixed[0][8:]}; leave run_dir "
                          "out (each point gets a folder of its own) or make it differ per point, e.g. "
                          "run_dir=runs/sweep/${hydra:job.num}")


# The sweep points (Hydra multirun) that failed, for the sweep's exit code.
FAILED_POINTS: List[int] = []


if __name__ == "__main__":
    main()
