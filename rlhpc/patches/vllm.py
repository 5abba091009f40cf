"""The changes rlhpc makes to vLLM's (and the interpreter's) process globals, each with its undo.

The vLLM engine runs the engine core in-process, and sometimes two engines in one process (prefill and decode). A few
of vLLM's globals assume one engine per process; the context managers below swap them around each engine's calls and
always put back what was there. They touch vLLM internals, so they were checked against the versions that
rlhpc/patches/registry.py names (`vllm_engine_globals`), and `check()` fails with a clear message when an installed
vLLM lacks what they touch.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Callable, Iterator, List

import torch

from rlhpc.patches import registry
from rlhpc.patches.registry import swapped


def check() -> None:
    """Raises RuntimeError naming the vLLM version and the internals it lacks, if any (call before using vLLM): the
    registry's `vllm_engine_globals` (rlhpc/patches/registry.py holds the internals and the versions checked)."""
    registry.check("vllm_engine_globals")


@contextlib.contextmanager
def keep_set_num_threads() -> Iterator[None]:
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process while it starts: the
    worker role sets its own thread budget, so the real function is put back afterwards."""
    saved = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = saved


def tempdir(path: str) -> contextlib.AbstractContextManager:
    """vLLM names its single-process rendezvous file after tempfile.gettempdir(): keep it in the run directory."""
    return swapped(tempfile, "tempdir", str(path))


@contextlib.contextmanager
def own_kv_connector(store: Callable[[Any], None]) -> Iterator[None]:
    """vLLM keeps the worker-side KV connector in one process global (kv_transfer_state._KV_CONNECTOR_AGENT) and
    reuses whatever is there: a second in-process engine would run on the first one's connector. An engine is built
    from an empty slot, and the connector it made is handed to `store` (None when its workers are other processes)."""
    from vllm.distributed.kv_transfer import kv_transfer_state as state

    with swapped(state, "_KV_CONNECTOR_AGENT", None):
        yield
        store(state._KV_CONNECTOR_AGENT)


def installed_kv_connector(connector: Any) -> contextlib.AbstractContextManager:
    """Puts an engine's own KV connector in vLLM's global slot for the duration of a call into that engine."""
    from vllm.distributed.kv_transfer import kv_transfer_state as state

    return swapped(state, "_KV_CONNECTOR_AGENT", connector)


def no_dist_cleanup() -> contextlib.AbstractContextManager:
    """An in-process EngineCore tears down vLLM's process-global torch.distributed state when it shuts down; while
    another engine of the process still uses that state, its shutdown must leave it alone."""
    import vllm.v1.engine.core as core

    return swapped(core, "cleanup_dist_env_and_memory", lambda *a, **k: None)


def applied() -> List[str]:
    """What the patches touch, for logs and docs."""
    internals = registry.PATCHES["vllm_engine_globals"].internals
    return [i.replace(":", ".") for i in internals] + ["torch.set_num_threads", "tempfile.tempdir"]
