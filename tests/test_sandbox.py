"""The code sandbox (rlhpc/env/sandbox.py): what a program written by a model can and cannot do.

No test skips: on a node where bwrap cannot run, these tests fail (CI runs them as root; the sandbox then runs programs
as nobody inside their own user namespace).
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlhpc.env.sandbox import Limits, Sandbox, SandboxUnavailable, check

REPO = Path(__file__).resolve().parents[1]


def sandbox(tmp_path, mode="bwrap", **limits) -> Sandbox:
    return Sandbox(tmp_path / "work", Limits(**{"wall_s": 5.0, **limits}), mode=mode)


def host_pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def leftovers(marker: str, before: set[int]) -> list[int]:
    """Processes started since `before` that carry `marker` in their command line, or zombies a sandbox run left
    (a zombie has no command line)."""
    found = []
    for pid in host_pids() - before:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            comm, rest = Path(f"/proc/{pid}/stat").read_text().split("(", 1)[1].rsplit(")", 1)
        except OSError:
            continue
        if marker.encode() in cmdline or (rest.split()[0] == "Z" and comm in ("bwrap", Path(sys.executable).name)):
            found.append(pid)
    return found


def test_sandbox_works_on_this_node():
    assert check() is None


def test_program_prints_reads_stdin_and_writes_a_file_the_host_sees(tmp_path):
    sb = sandbox(tmp_path)
    r = sb.run_python("name = input()\nprint('hello', name)\nopen('out.txt', 'w').write(name * 2)", stdin="ada\n")
    assert r.ok and r.stdout == "hello ada\n" and not r.timed_out
    assert (sb.workdir / "out.txt").read_text() == "adaada"


def test_program_may_delete_its_own_source(tmp_path):
    r = sandbox(tmp_path).run_python("import os\nos.remove(__file__)\nprint('gone')")
    assert r.ok and r.stdout == "gone\n"


def test_run_takes_argv_and_reports_the_exit_code(tmp_path):
    r = sandbox(tmp_path).run(["sh", "-c", "echo to-err >&2; exit 3"])
    assert r.returncode == 3 and r.stderr == "to-err\n" and not r.ok


def test_infinite_loop_is_killed_at_the_wall_timeout_and_the_next_program_runs(tmp_path):
    sb = sandbox(tmp_path, wall_s=1.0)
    t0 = time.monotonic()
    r = sb.run_python("print('started')\nwhile True:\n    pass")
    assert r.timed_out and r.returncode is None and not r.ok
    assert r.stdout == "started\n"  # what it printed before the kill
    assert time.monotonic() - t0 < 3.0
    assert sb.run_python("print(6 * 7)").stdout == "42\n"


def test_program_that_closes_its_output_is_still_killed_at_the_wall_timeout(tmp_path):
    t0 = time.monotonic()
    r = sandbox(tmp_path, wall_s=1.0).run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)")
    assert r.timed_out and time.monotonic() - t0 < 3.0


def test_cpu_burner_is_killed_by_the_cpu_limit(tmp_path):
    r = sandbox(tmp_path, cpu_s=1, wall_s=8.0).run_python("while True:\n    pass")
    assert not r.timed_out and r.returncode == 128 + 9  # SIGKILL at the CPU limit


def test_fork_bomb_is_contained_and_leaves_no_process(tmp_path):
    marker = f"rlhpc-bomb-{uuid.uuid4().hex}"
    before = host_pids()
    bomb = f"import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n# {marker}"
    r = sandbox(tmp_path, processes=16, wall_s=2.0).run([sys.executable, "-c", bomb])
    assert r.timed_out
    assert leftovers(marker, before) == []


def test_process_cap_stops_forks_beyond_the_limit(tmp_path):
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(3)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)")
    r = sandbox(tmp_path, processes=16).run_python(code)
    forked, errno = map(int, r.stdout.split())
    assert 8 <= forked < 16 and errno == 11  # EAGAIN


def test_huge_allocation_raises_memory_error(tmp_path):
    r = sandbox(tmp_path, memory_mb=256).run_python(
        "try:\n    b = bytearray(10 * 1024**3)\nexcept MemoryError:\n    print('MemoryError')")
    assert r.ok and r.stdout == "MemoryError\n"


def test_cannot_reach_a_server_on_the_hosts_loopback(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        r = sandbox(tmp_path).run_python(
            "import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=3)\n    print('connected')\n"
            "except OSError as e:\n    print(type(e).__name__)" % port)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert r.stdout == "ConnectionRefusedError\n"


def test_connecting_outside_fails_at_once(tmp_path):
    # Network namespace: no route at all, so nothing is sent (never run this unsandboxed).
    r = sandbox(tmp_path).run_python(
        "import socket, time\nt = time.monotonic()\n"
        "try:\n    socket.create_connection(('10.255.255.1', 80), timeout=5)\n"
        "except OSError as e:\n    print(e.errno, round(time.monotonic() - t))")
    assert r.stdout == "101 0\n"  # ENETUNREACH, in well under a second


def test_writes_outside_the_workdir_fail(tmp_path):
    name = f"rlhpc-sandbox-{uuid.uuid4().hex}"
    targets = [Path("/etc") / name, REPO / name, Path.home() / name]
    code = "import sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'w')\n        print('wrote', p)\n" \
           "    except OSError as e:\n        print('refused', e.errno)"
    sb = sandbox(tmp_path)
    r = sb.run([sys.executable, "-c", code, *map(str, targets)])
    assert r.stdout.count("refused") == 3, r.stdout
    assert not any(p.exists() for p in targets)


def test_tmp_is_private(tmp_path):
    name = f"rlhpc-sandbox-{uuid.uuid4().hex}"
    r = sandbox(tmp_path).run_python(f"open('/tmp/{name}', 'w').write('x')\nimport os\nprint(os.listdir('/tmp'))")
    assert r.ok and name in r.stdout
    assert not (Path("/tmp") / name).exists()


def test_callers_home_is_hidden(tmp_path, monkeypatch):
    home = Path(tempfile.mkdtemp(prefix="rlhpc-home-", dir="/var/tmp"))  # outside /tmp, which is private anyway
    try:
        (home / "token").write_text("secret")
        monkeypatch.setenv("HOME", str(home))
        r = sandbox(tmp_path).run_python(f"import os\nprint(os.listdir({str(home)!r}))")
    finally:
        shutil.rmtree(home)
    assert r.ok and r.stdout == "[]\n"


def test_environment_is_minimal(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHPC_TEST_SECRET", "hunter2")
    sb = sandbox(tmp_path)
    r = sb.run_python("import os\nprint(sorted(os.environ.items()))")
    assert "hunter2" not in r.stdout and f"('HOME', '{sb.workdir}')" in r.stdout


def test_file_size_limit_stops_a_huge_write(tmp_path):
    sb = sandbox(tmp_path, file_size_mb=1)
    r = sb.run_python("try:\n    open('big', 'wb').write(b'x' * (50 << 20))\nexcept OSError as e:\n    print(e.errno)")
    assert r.stdout == "27\n"  # EFBIG
    assert (sb.workdir / "big").stat().st_size <= 1 << 20


def test_huge_output_is_truncated_not_hung(tmp_path):
    r = sandbox(tmp_path, output_bytes=65536).run_python("import sys\nsys.stdout.write('x' * (50 << 20))")
    assert r.ok and r.truncated and r.stdout == "x" * 65536  # ok: it ran to its end, not to the wall timeout


def test_large_stdin_the_program_ignores_does_not_block(tmp_path):
    r = sandbox(tmp_path).run_python("print('done')", stdin="y" * (10 << 20))
    assert r.ok and r.stdout == "done\n"


def test_program_sees_its_own_pid_namespace(tmp_path):
    r = sandbox(tmp_path).run_python("import os\nprint(os.getpid(), sum(p.isdigit() for p in os.listdir('/proc')))")
    pid, visible = map(int, r.stdout.split())
    assert pid == 1 and visible <= 2


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("mode", ["bwrap", "unsandboxed"])
def test_program_dies_with_the_process_that_started_it(tmp_path, mode):
    marker = f"rlhpc-orphan-{uuid.uuid4().hex}"
    caller = ("import sys\nfrom rlhpc.env.sandbox import Limits, Sandbox\n"
              f"Sandbox(sys.argv[1], Limits(wall_s=60), mode={mode!r}).run([sys.executable, '-c', "
              f"'import time; time.sleep(60) # {marker}'])")
    before = host_pids()
    worker = subprocess.Popen([sys.executable, "-c", caller, str(tmp_path / "work")], cwd=REPO)
    try:
        assert wait_until(lambda: leftovers(marker, before), 10.0)
    finally:
        worker.kill()  # a worker that crashes
        worker.wait()
    assert wait_until(lambda: not leftovers(marker, before), 2.0)


def test_unusable_bwrap_raises_with_the_reason_and_the_opt_out(tmp_path):
    missing = str(tmp_path / "no-bwrap")
    with pytest.raises(SandboxUnavailable) as e:
        Sandbox(tmp_path / "work", bwrap=missing)
    assert missing in str(e.value) and "user namespaces" in str(e.value) and "env.sandbox=unsandboxed" in str(e.value)


def test_rlhpc_bwrap_names_the_binary(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-bwrap-env")
    monkeypatch.setenv("RLHPC_BWRAP", missing)
    with pytest.raises(SandboxUnavailable, match=missing):
        Sandbox(tmp_path / "work")


def test_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="env.sandbox"):
        Sandbox(tmp_path, mode="docker")


def test_unsandboxed_mode_kills_at_the_wall_timeout(tmp_path):
    t0 = time.monotonic()
    r = sandbox(tmp_path, mode="unsandboxed", wall_s=1.0).run_python("while True:\n    pass")
    assert r.timed_out and time.monotonic() - t0 < 3.0


def test_unsandboxed_mode_applies_cpu_and_memory_limits(tmp_path):
    sb = sandbox(tmp_path, mode="unsandboxed", cpu_s=1, memory_mb=256, wall_s=8.0)
    assert sb.run_python("while True:\n    pass").returncode == 128 + 9  # SIGKILL at the CPU limit
    r = sb.run_python("try:\n    b = bytearray(10 * 1024**3)\nexcept MemoryError:\n    print('MemoryError')")
    assert r.stdout == "MemoryError\n"
