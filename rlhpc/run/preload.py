"""Role processes forked from one process that imported their libraries once (`launcher=local`, `launcher.preload`).

Each role process imports torch, transformers and rlhpc's trainer or worker before its first line of work: ~7 s of CPU
here, paid again by every process of a launch and by every restarted worker. The local launcher instead starts one
preload process (`python -m rlhpc.role --preload`), which imports them once and then forks a role per request; a forked
role runs `rlhpc.role`'s main exactly as `python -m rlhpc.role` would, with the environment, log and working directory
the launcher gives it.

A role stays the launcher's own child, as with `subprocess.Popen`: the launcher marks itself a child subreaper
(Linux's PR_SET_CHILD_SUBREAPER), the preload process forks an intermediate process that forks the role and exits, and
the orphaned role is adopted by the launcher, which waits for it, reads its exit status and ends its process group like
any other (`Forked` has the part of Popen's interface the launcher uses). Where this cannot be set up (not Linux, the
preload process fails to import or answer), the launcher starts each role as a fresh interpreter, as before.

What a forked role sees differently from a fresh interpreter: its command line and /proc/<pid>/environ are the preload
process's (`python -m rlhpc.role --preload`, the launch's environment without the role's own variables; os.environ has
them all), and its name in ps and top is `<role>-<rank>` (the preload process's `rlhpc-preload`); the random
generators are seeded again after the fork, as a fresh process's would be.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Callable, Optional

PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
# What every role imports before its first line of work (rlhpc.role): the preload process imports them once.
MODULES = ("torch", "transformers", "rlhpc.train.trainer", "rlhpc.infer.rollout", "rlhpc.infer.worker",
           "rlhpc.infer.follower")
PRELOAD_NAME = "rlhpc-preload"  # the preload process in ps; a forked role renames itself <role>-<rank>
READY_TIMEOUT_S = 300.0  # the imports: ~7 s of CPU; a loaded machine or a cold filesystem takes longer
FORK_TIMEOUT_S = 60.0


class PreloadError(RuntimeError):
    """The preload process could not start, import or fork: the launcher starts its roles as fresh interpreters."""


def set_name(name: str) -> None:
    """The process's name in ps and top (15 bytes at most; its command line stays). Linux only."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def become_subreaper() -> bool:
    """Marks this process a child subreaper: orphaned descendants are re-parented to it, not to init. Linux only."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Forked:
    """A role forked by the preload process and adopted by this one: the part of subprocess.Popen the launcher uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (os.wait in this process): its status is lost
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]


class Preload:
    """The launcher's side: starts the preload process and asks it for roles."""

    def __init__(self, env: dict, stderr: Optional[Path] = None):
        """`stderr`: where the preload process's own errors go (None: a temporary file, quoted in a PreloadError)."""
        if not become_subreaper():
            raise PreloadError("this system cannot adopt forked roles (PR_SET_CHILD_SUBREAPER)")
        self.env = env
        self.err: IO = open(stderr, "ab+") if stderr is not None else tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlhpc.role", "--preload"], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.err, start_new_session=True,
        )
        self.ready = False
        self.closed = False

    def _reply(self, timeout_s: float, what: str, cancel: Callable[[], bool]) -> dict:
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not cancel():
            if select.select([out], [], [], 0.1)[0]:
                line = out.readline()
                if not line:  # it closed its end: it is exiting (its status may take a moment to be there)
                    try:
                        self.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    break
                return json.loads(line)
        code = self.proc.poll()
        if code is not None:
            raise PreloadError(f"the preload process exited with code {code} before it could {what}: "
                               f"{self._errors() or 'it printed nothing'}")
        raise PreloadError(f"the preload process did not {what} within {timeout_s:.0f}s")

    def spawn(self, env: dict, log: Path, cancel: Callable[[], bool] = lambda: False) -> Forked:
        """A role process with environment `env`, stdout and stderr appended to `log`, in a session of its own."""
        if not self.ready:
            self._reply(READY_TIMEOUT_S, "import the roles' libraries", cancel)
            self.ready = True
        assert self.proc.stdin is not None
        try:
            request = {"env": dict(env, RLHPC_PRELOADED="1"), "log": str(log), "cwd": os.getcwd()}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise PreloadError(f"the preload process is gone: {e}") from e
        reply = self._reply(FORK_TIMEOUT_S, "fork a role", cancel)
        if "pid" not in reply:
            raise PreloadError(f"the preload process could not fork a role: {reply.get('error')}")
        return Forked(reply["pid"])

    def _errors(self) -> str:
        """The last lines the preload process wrote to its stderr."""
        try:
            self.err.flush()
            self.err.seek(0)
            return " | ".join(self.err.read().decode(errors="replace").strip().splitlines()[-3:])
        except (OSError, ValueError):
            return ""

    def close(self) -> None:
        """Ends the preload process (its roles live on: they are this process's children now). Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            if f is not None:
                f.close()


def serve(role_main: Callable[[], int], finish: Callable[[int], None]) -> None:
    """The preload process: imports MODULES, says so, then forks a role for each request line on stdin until stdin
    ends (its launcher is gone). Each role runs `role_main` and ends through `finish` (which never returns)."""
    import importlib

    set_name(PRELOAD_NAME)
    for name in MODULES:
        importlib.import_module(name)
    requests, replies = sys.stdin.buffer, sys.stdout.buffer

    def say(msg: dict) -> None:
        replies.write((json.dumps(msg) + "\n").encode())
        replies.flush()

    say({"ready": True})
    for line in requests:
        request = json.loads(line)
        unsafe = _unsafe_to_fork()
        if unsafe:
            say({"error": unsafe})
            continue
        try:
            say({"pid": _fork_role(request, role_main, finish)})
        except OSError as e:
            say({"error": repr(e)})


def _unsafe_to_fork() -> str:
    """Why a fork of this process would give a broken role, or "": a Python thread (its locks do not survive the fork)
    or CUDA initialized by the imports (a forked child cannot use it)."""
    if threading.active_count() > 1:
        return f"the preload process runs {threading.active_count()} Python threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "importing the roles' libraries initialized CUDA"
    return ""


def _fork_role(request: dict, role_main: Callable[[], int], finish: Callable[[int], None]) -> int:
    """Forks a process that forks the role and exits at once: the role, orphaned, goes to the launcher (the subreaper
    above). Returns the role's pid once its parent is gone, so the launcher can wait for it."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            role = os.fork()
            if role == 0:
                os.close(write_end)
                _become_role(request, role_main, finish)
            os.write(write_end, str(role).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        pid = r.read()
    os.waitpid(middle, 0)
    if not pid:
        raise OSError("the role could not be forked")
    return int(pid)


def _become_role(request: dict, role_main: Callable[[], int], finish: Callable[[int], None]) -> None:
    code = 1
    try:
        os.setsid()  # its own session and process group, ended as one (as Popen's start_new_session)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        set_name(f"{request['env'].get('RLHPC_ROLE', 'role')}-{request['env'].get('RLHPC_RANK', '')}")
        _seed_again()
        sys.argv = [str(Path(sys.modules["rlhpc.role"].__file__ or "rlhpc/role.py"))]
        code = role_main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finish(code)
    os._exit(code)  # finish does not return; this only guards against one that does


def _seed_again() -> None:
    """The generators a fresh process seeds from the OS at start (Python's own reseeds at each fork)."""
    import torch

    torch.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
