"""The patches of libraries other than vLLM that are small enough to live here (rlhpc/patches/registry.py lists them
all, with the versions checked and how long each lasts)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from rlhpc.patches.registry import check


def suppress_compile_errors() -> None:
    """What dynamo cannot compile runs eagerly instead of failing the step (trainer.compile=true). For the process:
    dynamo reads the flag when a compiled block first runs, long after the blocks are compiled."""
    check("dynamo_suppress_errors")
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True


def in_process_httpx(app_for: Callable[[str], Optional[Any]]) -> None:
    """Makes the httpx client verifiers builds for a base URL call `app_for(url)` (an ASGI app of this process)
    through an httpx ASGI transport instead of a socket, where there is one; clients of other URLs get verifiers'
    own. verifiers builds every client's httpx client in `verifiers.v1.clients.base.build_async_httpx`, which is
    wrapped once, for the process (rlhpc/env/verifiers_env.py says what it saves)."""
    check("verifiers_in_process_httpx")
    from verifiers.v1.clients import base

    original = base.build_async_httpx
    if getattr(original, "rlhpc_in_process", False):
        return

    def build_async_httpx(config: Any) -> Any:
        import httpx

        app = app_for(str(config.base_url or ""))
        if app is None:
            return original(config)
        return httpx.AsyncClient(timeout=httpx.Timeout(**config.timeout.model_dump()),
                                 transport=httpx.ASGITransport(app=app))

    build_async_httpx.rlhpc_in_process = True  # type: ignore[attr-defined]
    base.build_async_httpx = build_async_httpx
