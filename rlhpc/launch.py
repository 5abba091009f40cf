"""`python -m rlhpc.launch +exp=reverse_text [key=value ...]`: compose, check, write the run directory, start the roles.

The config is composed by Hydra on top of the typed schema (rlhpc.config), so a wrong key or type fails here, before
any process starts. The launcher (`launcher=local|slurm|sbatch`) then starts the same role entry point everywhere.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from rlhpc import algo  # noqa: F401  (registers the algorithms' config checks)
from rlhpc import config as config_mod
from rlhpc.config import Config, ConfigError
from rlhpc.rundir import RunDir

CONF_DIR = Path(os.environ.get("RLHPC_CONF_DIR", Path(__file__).resolve().parents[1] / "conf"))


class RunDirError(RuntimeError):
    pass


def prepare_run_dir(cfg: Config) -> RunDir:
    """Creates the run directory and writes config.yaml. Refuses a directory holding a finished run unless
    `overwrite=true`; a directory of an unfinished run with the same config is resumed."""
    run = RunDir(Path(cfg.run_dir))
    if run.summary.exists() or run.done.exists():
        if not cfg.overwrite:
            raise RunDirError(
                f"run_dir={run.root} already holds a finished run (summary.json); pass another run_dir=... "
                f"or overwrite=true to replace it"
            )
        shutil.rmtree(run.root)
    elif run.root.exists() and any(run.root.iterdir()) and not run.config.exists():
        raise RunDirError(f"run_dir={run.root} is not empty and is not an rlhpc run directory; choose another run_dir")
    run.make()
    for stale in (run.failed,):
        stale.unlink(missing_ok=True)
    config_mod.save(cfg, run.config)
    return run


def launch(cfg: Config) -> int:
    config_mod.validate(cfg)
    if cfg.launcher.name == "local":
        from rlhpc.cluster.local_launcher import LocalLauncher as Launcher
    elif cfg.launcher.name == "slurm":
        from rlhpc.cluster.slurm_launcher import SlurmLauncher as Launcher  # type: ignore[no-redef]
    else:
        from rlhpc.cluster.sbatch_launcher import SbatchLauncher as Launcher  # type: ignore[no-redef]
    launcher = Launcher(cfg)
    if cfg.dry_run:
        print(launcher.plan())
        return 0
    run = prepare_run_dir(cfg)
    return launcher.start(run)


def main() -> None:
    import hydra

    config_mod.register()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def _main(dcfg) -> None:
        try:
            cfg = config_mod.to_typed(dcfg)
            code = launch(cfg)
        except (ConfigError, RunDirError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
        if code:
            from hydra.core.hydra_config import HydraConfig
            from hydra.types import RunMode

            if HydraConfig.get().mode == RunMode.MULTIRUN:  # one bad point does not end the sweep
                print(f"sweep point {HydraConfig.get().job.num} failed with code {code}", file=sys.stderr)
                return
            sys.exit(code)

    _main()


if __name__ == "__main__":
    main()
