"""Facts about a model that take seconds to learn, remembered between launches: whether it passed the launcher's model
checks, and the shape the memory plan reads. Learning either imports transformers and builds the model (5-8 s of a
launch's start, on one core, before any role starts); a launch of a model seen before reads a small file instead.

Each fact is kept under a key of everything it depends on: the model's config keys, the files of `model.path` (names,
sizes, modification times), the versions of the libraries that read them, and rlhpc's own code that computes it.
Anything that changes makes a new key, and the fact is learned again. Kept in $RLHPC_CACHE_DIR, by default
$XDG_CACHE_HOME/rlhpc or ~/.cache/rlhpc; a cache that cannot be read or written only costs the time of learning."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Optional

LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")


def cache_dir() -> Path:
    """$RLHPC_CACHE_DIR, else $XDG_CACHE_HOME/rlhpc, else ~/.cache/rlhpc."""
    if os.environ.get("RLHPC_CACHE_DIR"):
        return Path(os.environ["RLHPC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlhpc"


def _version(lib: str) -> Optional[str]:
    try:
        return metadata.version(lib)
    except metadata.PackageNotFoundError:
        return None


def key(model_cfg: Any, code: Iterable[Path], **more: Any) -> str:
    """The key of a fact about the model of `model_cfg` (the `model` config group), computed by the modules `code`
    (with rlhpc/modeling's, always): a hash of the model's keys, the files of model.path, the libraries' versions, that
    code's text and `more`."""
    here = Path(__file__).parent
    files = sorted({*here.glob("*.py"), *map(Path, code)})
    if dataclasses.is_dataclass(model_cfg):
        model = dataclasses.asdict(model_cfg)
    else:
        model = dict(model_cfg.items()) if hasattr(model_cfg, "items") else dict(vars(model_cfg))
    facts = {"model": model, "libraries": {lib: _version(lib) for lib in LIBRARIES},
             "code": hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest(), **more}
    path = model.get("path")
    if path and Path(path).is_dir():
        facts["files"] = [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                          for f in sorted(Path(path).iterdir()) if f.is_file()]
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def recall(kind: str, k: str) -> Optional[Any]:
    """The fact of `kind` kept under key `k`, or None (never learned, or unreadable)."""
    try:
        return json.loads((cache_dir() / kind / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None


def remember(kind: str, k: str, fact: Any) -> None:
    """Keeps `fact` (JSON) under `k`; written whole or not at all (a rename), so that concurrent launches read either
    nothing or the whole fact."""
    folder = cache_dir() / kind
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{k}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(fact))
        os.replace(tmp, folder / f"{k}.json")
    except OSError:  # a read-only or full home: the next launch learns it again
        pass
