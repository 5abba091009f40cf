"""A config or command line that does not compose, said in one line that names the key (Hydra's and OmegaConf's own
reports span lines and suggest a stack trace), and `one_line`, the form every error a user sees takes."""

from __future__ import annotations

import re
import sys
from typing import Any, Callable, List, Optional

from rlhpc.config import schema as config_mod


def one_line(e: BaseException) -> str:
    """An exception as one line: its type (unless its message says enough) and its message's lines joined."""
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text if text.startswith("config key") else f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---- the command line ------------------------------------------------------------------------------------------


def composition_error(overrides: List[str], typed: Callable[[Any], Any] = config_mod.to_typed) -> Optional[str]:
    """Composes the config as a command's `main` will (`typed`: its schema's merge; rlhpc.eval adds keys), to report
    a wrong key, value or type as one line naming the key (Hydra's own report spans lines and suggests a stack
    trace). None when it composes, or when the arguments hold Hydra flags (-m, --cfg, --config-dir, ...), which Hydra
    handles itself. Of the `hydra.` overrides only `hydra.searchpath` (config folders of the user's) changes what
    composes, so only it is kept."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if any(a.startswith("-") for a in overrides):
        return None
    kept = [o for o in overrides if _searchpath(o) or not o.startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(config_mod.CONF_DIR), version_base=None):
            typed(compose(config_name="config", overrides=kept))
    except Exception as e:  # noqa: BLE001 - any composition error becomes its one-line report
        return config_key_error(e, dry_run=_asks_dry_run(overrides))
    finally:
        GlobalHydra.instance().clear()
    return None


def _searchpath(override: str) -> bool:
    return override.lstrip("+").partition("=")[0] == "hydra.searchpath"


def _asks_dry_run(overrides: List[str]) -> bool:
    """Whether the command line sets dry_run to true (`dry_run=true`, `++dry_run=True`, ...)."""
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "dry_run" and value.strip().lower() in ("true", "yes", "on", "1"):
            return True
    return False


def exit_on_composition_error(overrides: List[str], typed: Callable[[Any], Any] = config_mod.to_typed) -> None:
    """What every command does before Hydra's own start: a command line that does not compose ends here, in one line
    (`composition_error`), with exit code 2."""
    problem = composition_error(overrides, typed)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def config_key_error(e: BaseException, dry_run: bool = False) -> str:
    """`config key `a.b`: what is wrong`, from an OmegaConf error anywhere in the chain of `e` (Hydra wraps them).
    `dry_run`: the command line asks for a plan only (said where it changes the fix)."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options is not None:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return (f"config group `{group}`: no option {option!r} (conf/{group}/ has: {', '.join(e.options)})" if group
                else one_line(e))
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
            unset = re.search(r"Environment variable '([^']+)' not found", msg)
            if unset:  # a preset's `${oc.env:VAR}` (conf/model/*.yaml: model.path) with VAR not set
                return unset_variable(key, unset.group(1), dry_run)
            if "is not in struct" in msg and hint:  # a free-form dict (env.args, model.extra) takes new keys with +
                msg += f" ({hint})"
            elif "not in '" in msg:
                msg += f" ({_known_keys(err, key)})"
            return f"config key `{key}`: {msg}"
    return one_line(e)


# What a key that a preset reads from the environment holds, in the words of its refusal (the rest: "<value>").
_UNSET_VALUES = {"model.path": "a Hugging Face checkpoint folder"}


def unset_variable(key: str, variable: str, dry_run: bool = False) -> str:
    """The refusal of a key whose preset value is `${oc.env:variable}` while `variable` is not set: both ways to give
    it. A dry run does not read model.path (it plans for a checkpoint only the cluster holds), so any folder name
    does there."""
    what = _UNSET_VALUES.get(key, "a value")
    that = "that folder" if what.endswith("folder") else "that value"
    msg = (f"config key `{key}`: no value: the preset takes it from the environment variable {variable}, which is "
           f"not set; pass {key}=<{what}> on the command line, or set {variable}=<{that}> in the environment")
    if dry_run and key == "model.path":
        msg += " (a dry run does not read the folder: one that only the cluster holds will do)"
    return msg


def _known_keys(err: BaseException, key: str) -> str:
    """For a key its section lacks: the section's keys that look like it, or else all of them."""
    import dataclasses
    import difflib

    section, _, name = key.rpartition(".")
    schema = getattr(err, "object_type", None)
    if not dataclasses.is_dataclass(schema):
        return "no such key"
    names = [f.name for f in dataclasses.fields(schema)]
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"`{prefix}{c}`" for c in close) + "?"
    return f"{section or 'the top level'} has: {', '.join(names)}"
