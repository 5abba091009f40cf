"""Stop signals: preemption, time limits and Ctrl-C become a flag the roles check at safe points.

A role checks `stop_requested()` at step boundaries and in its waits; a second signal stops at once (`Stop`).
"""

from __future__ import annotations

import signal

# Exit code of a trainer that checkpointed because it was asked to stop: "requeue me" (EX_TEMPFAIL).
REQUEUE_EXIT = 75


class Stop(Exception):
    """Raised where a role stops waiting because the process was asked to stop."""


_stop_signal: list = []


def stop_requested() -> str | None:
    """The name of the signal that asked this process to stop (SIGTERM/SIGINT/SIGUSR1), or None."""
    return _stop_signal[0] if _stop_signal else None


def install_stop_handlers() -> None:
    def handler(signum, frame):  # noqa: ARG001
        name = signal.Signals(signum).name
        if _stop_signal:
            raise Stop(f"{name} (second signal)")
        _stop_signal.append(name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, handler)
