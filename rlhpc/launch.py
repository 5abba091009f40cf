"""`python -m rlhpc.launch +exp=reverse_text [key=value ...]`: compose, check, write the run directory, start the roles.

The config is composed by Hydra on top of the typed schema (rlhpc.config), so a wrong key or type fails here, before
any process starts; then the model, the environment and the loss are checked (rlhpc.preflight). Every such error is
one line that names the config key. The launcher (`launcher=local|slurm|sbatch`) then starts the same role entry point
everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional

from rlhpc import algo  # noqa: F401  (registers the algorithms' config checks)
from rlhpc import config as config_mod
from rlhpc import preflight
from rlhpc.config import Config, ConfigError
from rlhpc.rundir import RunDir

CONF_DIR = Path(os.environ.get("RLHPC_CONF_DIR", Path(__file__).resolve().parents[1] / "conf"))


class RunDirError(RuntimeError):
    pass


def prepare_run_dir(cfg: Config) -> RunDir:
    """Creates the run directory and writes config.yaml. Refuses a directory holding a finished run unless
    `overwrite=true`; a directory of an unfinished run is resumed, but refused if its saved config differs in a key that
    changes training, unless `resume.allow_config_change=true`."""
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
    elif run.config.exists():
        check_resume(run, cfg)
    run.make()
    for stale in (run.failed,):
        stale.unlink(missing_ok=True)
    config_mod.save(cfg, run.config)
    return run


def check_resume(run: RunDir, cfg: Config) -> None:
    """An unfinished run that has trained (a warm-started model or a checkpoint) resumes only with the config it
    trained with, as far as training goes (rlhpc.preflight.RUNTIME_KEYS may change)."""
    from omegaconf import OmegaConf

    if not ((run.model / "READY").exists() or (run.checkpoints / "latest.json").exists()):
        return  # nothing trained yet: a relaunch after a failed start may change anything
    try:
        saved = OmegaConf.load(run.config)
    except Exception as e:  # noqa: BLE001
        raise RunDirError(f"run_dir={run.root}: its config.yaml cannot be read ({preflight.one_line(e)}); "
                          f"choose another run_dir") from None
    changes = preflight.training_changes(saved, cfg)
    if not changes:
        return
    listing = "".join(f"\n  {k}: {old!r} -> {new!r}" for k, old, new in changes)
    if not cfg.resume.allow_config_change:
        raise RunDirError(
            f"run_dir={run.root} holds an unfinished run whose config differs in keys that change training:{listing}"
            f"\nresume it with its own values, pass resume.allow_config_change=true to train on with the new ones, "
            f"or choose another run_dir"
        )
    print(f"warning: resuming run_dir={run.root} with a changed config (resume.allow_config_change=true):{listing}",
          file=sys.stderr)
    with open(run.root / "config_changes.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "changes": [[k, o, n] for k, o, n in changes]}, default=str) + "\n")


def launch(cfg: Config) -> int:
    config_mod.validate(cfg)
    # The model, the environment and the loss, before anything starts (a dry run may plan for a model.path that only
    # the cluster's filesystem holds).
    preflight.check(cfg, model=not cfg.dry_run)
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


def composition_error(overrides: List[str]) -> Optional[str]:
    """Composes the config as `main` will, to report a wrong key, value or type as one line naming the key (Hydra's
    own report spans lines and suggests a stack trace). None when it composes, or when the arguments hold Hydra
    flags (-m, --cfg, ...), which Hydra handles itself."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if any(a.startswith("-") for a in overrides):
        return None
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            config_mod.to_typed(compose(config_name="config",
                                        overrides=[o for o in overrides if not o.startswith(("hydra.", "hydra/"))]))
    except Exception as e:  # noqa: BLE001 - any composition error becomes its one-line report
        return config_key_error(e)
    finally:
        GlobalHydra.instance().clear()
    return None


def config_key_error(e: BaseException) -> str:
    """`config key `a.b`: what is wrong`, from an OmegaConf error anywhere in the chain of `e` (Hydra wraps them)."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options is not None:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return (f"config group `{group}`: no option {option!r} (conf/{group}/ has: {', '.join(e.options)})" if group
                else preflight.one_line(e))
    hint = next((line.strip() for line in str(e).splitlines() if line.startswith("To append")), "")
    chain, seen = [], e
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for err in chain:
        key = getattr(err, "full_key", None)
        if isinstance(err, OmegaConfBaseException) and key:
            # The message without OmegaConf's trailer (full_key, reference_type, object_type lines).
            lines = [ln.strip() for ln in str(getattr(err, "msg", None) or err).splitlines()]
            msg = "; ".join(ln for ln in lines if ln and not ln.startswith(("full_key:", "reference_type", "object_type")))
            if "is not in struct" in msg and hint:  # a free-form dict (env.args, model.extra) takes new keys with +
                msg += f" ({hint})"
            elif "not in '" in msg:
                msg += " (no such key: rlhpc/config.py lists every key)"
            return f"config key `{key}`: {msg}"
    return preflight.one_line(e)


def main() -> None:
    import hydra

    config_mod.register()
    problem = composition_error(sys.argv[1:])
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def _main(dcfg) -> None:
        try:
            cfg = config_mod.to_typed(dcfg)
            code = launch(cfg)
        except (ConfigError, RunDirError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
        except Exception as e:  # noqa: BLE001 - a wrong type that only the typed merge sees
            from omegaconf.errors import OmegaConfBaseException

            if not isinstance(e, OmegaConfBaseException):
                raise
            print(f"error: {config_key_error(e)}", file=sys.stderr)
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
