"""A pool of processes that runs environment calls (rewards, tools, replies) beside generation, each with a timeout.

Every process builds its own environment instance from the `env` config once, then serves calls by method name:
`pool.submit("score", task, state, completions)` returns a Future. A call that runs past `env.call_timeout_s` has its
process killed (with everything it started in its process group) and replaced; its Future raises CallTimeout. A call
that raises passes the exception (as text) to its Future; the process lives on. A process that dies is replaced, and
its call fails with CallFailed. The pool never hangs on a stuck environment: every wait has a timeout.

With `env.pool_processes=0` calls run inline in the caller's thread (no timeouts): for tests and debugging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, List, Optional, Tuple

from rlhpc.config.schema import EnvConfig

log = logging.getLogger(__name__)

# spawn: a fresh interpreter per pool process, so a worker's threads (torch, gloo, vLLM) never fork half-copied.
_CTX = mp.get_context("spawn")
_START_TIMEOUT_S = 120.0


class CallTimeout(TimeoutError):
    pass


class CallFailed(RuntimeError):
    pass


def call(env: Any, method: str, args: tuple) -> Any:
    """`env.method(*args)`; "respond" also returns the episode state it changed (it lives in this process's copy)."""
    value = getattr(env, method)(*args)
    return (args[1], value) if method == "respond" else value


def _serve(cfg: EnvConfig, envs_dir: Optional[str], conn) -> None:
    """A pool process: build the environment, then answer (method, args) with ("ok", value) or ("error", text)."""
    os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle; the worker ends the pool
    if envs_dir:
        os.environ["RLHPC_ENVS_DIR"] = envs_dir
    from rlhpc.env.base import load

    try:
        env = load(cfg)
        env.warm()
        conn.send(("ready", os.getpid()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it with the env's name
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        method, args = msg
        try:
            conn.send(("ok", call(env, method, args)))
        except BaseException as e:  # noqa: BLE001 - the call's failure belongs to its sample
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))


class _Slot:
    """One pool process and the thread that feeds it calls."""

    def __init__(self, pool: "EnvPool", index: int):
        self.pool, self.index = pool, index
        self.proc: Any = None
        self.conn: Any = None
        self.thread = threading.Thread(target=self._loop, name=f"env-pool-{index}", daemon=True)

    def start_process(self) -> None:
        parent, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_serve, args=(self.pool.cfg, os.environ.get("RLHPC_ENVS_DIR"), child), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        if not parent.poll(_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"environment {self.pool.cfg.name!r}: a pool process did not start in {_START_TIMEOUT_S:.0f}s")
        kind, value = parent.recv()
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"environment {self.pool.cfg.name!r} failed to start in a pool process: {value}")

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.join(timeout=5)
        self.conn.close()
        self.proc = None

    def _loop(self) -> None:
        while True:
            item = self.pool._calls.get()
            if item is None:
                return
            fut, method, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if self.proc is None:
                    self.start_process()
                self.conn.send((method, args))
                if self.conn.poll(self.pool.timeout_s):
                    kind, value = self.conn.recv()
                    if kind == "ok":
                        fut.set_result(value)
                    else:
                        fut.set_exception(CallFailed(value))
                    continue
                self.kill()
                limit = f"{self.pool.timeout_key}={self.pool.timeout_s:g}s"
                fut.set_exception(CallTimeout(f"{method} took longer than {limit}"))
            except (EOFError, OSError, BrokenPipeError) as e:  # the process died under the call
                self.kill()
                fut.set_exception(CallFailed(f"{method}: the pool process died ({type(e).__name__})"))
            except BaseException as e:  # noqa: BLE001 - a failed start fails this call; the next one retries
                if not fut.done():
                    fut.set_exception(e)


class EnvPool:
    def __init__(self, cfg: EnvConfig, processes: Optional[int] = None, timeout_s: Optional[float] = None,
                 env: Any = None, timeout_key: str = "env.call_timeout_s"):
        """`timeout_key`: the config key that sets `timeout_s`, named when a call runs past it."""
        self.cfg = cfg
        self.timeout_key = timeout_key
        self.processes = cfg.pool_processes if processes is None else processes
        self.timeout_s = cfg.call_timeout_s if timeout_s is None else timeout_s
        self._calls: "queue.Queue[Optional[Tuple[Future, str, tuple]]]" = queue.Queue()
        self._inline_env = env
        self._slots: List[_Slot] = []
        if self.processes == 0:
            if self._inline_env is None:
                from rlhpc.env.base import load

                self._inline_env = load(cfg)
            return
        t0 = time.time()
        self._slots = [_Slot(self, i) for i in range(self.processes)]
        try:
            for slot in self._slots:  # start eagerly: a broken environment fails here, before generation
                slot.start_process()
        except BaseException:
            self.close()
            raise
        for slot in self._slots:
            slot.thread.start()
        log.info("environment pool: %d processes for %s up in %.1fs", self.processes, cfg.name, time.time() - t0)

    def submit(self, method: str, *args: Any) -> Future:
        fut: Future = Future()
        if not self._slots:
            try:
                fut.set_result(call(self._inline_env, method, args))
            except Exception as e:  # noqa: BLE001
                fut.set_exception(CallFailed(f"{type(e).__name__}: {e}"))
            return fut
        self._calls.put((fut, method, args))
        return fut

    def close(self) -> None:
        for _ in self._slots:
            self._calls.put(None)
        for slot in self._slots:
            if slot.proc is not None:
                try:
                    slot.conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
                slot.proc.join(timeout=2)
                slot.kill()
        for slot in self._slots:
            if slot.thread.is_alive():
                slot.thread.join(timeout=2)
        self._slots = []

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
