"""`python -m rlhpc.eval` as a user sees it: a one-line summary and where the JSON report went (the JSON itself on
stdout with eval.report=-), values that cannot work refused in one line before anything loads, pass@k for any k, a
server that dies mid-evaluation ending it in one line, and against a running server a model.path that needs only a
tokenizer."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlhpc.eval import default_report, summary, write_new
from rlhpc.infer.server import MAX_N, endpoint

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1"]
# Short episodes and no environment processes: the tests are about the command, not the scores.
FAST = ["env=reverse_text", "env.max_new_tokens=8", "env.pool_processes=0", *TINY]


def evaluate(*overrides: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The command run in `cwd` (where a report without eval.report goes; a test that lets it be written names one)."""
    return subprocess.run([sys.executable, "-m", "rlhpc.eval", *FAST, *overrides], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The only line on stderr, after checking the exit code and that no traceback was printed."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def start_server(run_dir: Path) -> subprocess.Popen:
    """`python -m rlhpc.serve` over the tiny model built in code, once its address is published (its output goes to
    a file next to run_dir: a pipe nobody reads could stall it)."""
    log = run_dir.parent / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "rlhpc.serve", f"run_dir={run_dir}", *TINY], stdout=out,
                                  stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (run_dir / "rendezvous" / "serve-0.json").exists():
        if server.poll() is not None:
            raise AssertionError(f"rlhpc.serve exited with {server.returncode}: {log.read_text()[-3000:]}")
        assert time.time() < deadline, "rlhpc.serve did not publish its address"
        time.sleep(0.2)
    return server


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A running rlhpc.serve: its run directory (eval.run)."""
    run_dir = tmp_path_factory.mktemp("serve") / "run"
    server = start_server(run_dir)
    yield run_dir
    stop(server)


def a_file(tmp_path: Path) -> Path:
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file"


@pytest.mark.parametrize("override, message", [
    (lambda tmp: "eval.temperature=-1",
     "error: config key `eval.temperature`: must be a finite number >= 0 (0 is greedy), got -1.0"),
    (lambda tmp: "eval.temperature=nan",
     "error: config key `eval.temperature`: must be a finite number >= 0 (0 is greedy), got nan"),
    (lambda tmp: "eval.concurrency=0",
     "error: config key `eval.concurrency`: must be >= 1 (requests in flight at once), got 0"),
    (lambda tmp: "eval.concurrency=-3",
     "error: config key `eval.concurrency`: must be >= 1 (requests in flight at once), got -3"),
    (lambda tmp: "eval.k=0", "error: config key `eval.k`: must be >= 1"),
    (lambda tmp: f"eval.report={tmp}",
     "error: config key `eval.report`: {tmp} is a folder: name a file in it (e.g. {tmp}/eval.json)"),
    (lambda tmp: f"eval.report={a_file(tmp)}/sub/report.json",
     "error: config key `eval.report`: {tmp}/a_file is not a folder"),
])
def test_a_value_that_cannot_work_is_one_line_naming_its_key_before_anything_loads(tmp_path, override, message):
    """These used to fail after the model was loaded and the episodes run: a traceback from the server's 400, a
    ThreadPoolExecutor error naming no key, a report written after the evaluation into a folder."""
    proc = evaluate(override(tmp_path), "eval.num_tasks=1", timeout=120)
    assert one_line(proc, 2) == message.format(tmp=tmp_path)
    assert proc.stdout == ""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_a_run_and_an_endpoint_both_named_are_refused_before_anything_loads(tmp_path):
    proc = evaluate(f"eval.run={tmp_path}", "eval.endpoint=http://node:8000", "eval.num_tasks=1", timeout=120)
    assert one_line(proc, 2) == ("error: config key `eval.endpoint`: set eval.run or eval.endpoint, not both "
                                 f"(eval.run={tmp_path} names its own served endpoint)")


def test_a_report_in_a_folder_that_cannot_be_made_is_refused_before_anything_loads():
    proc = evaluate("eval.report=/proc/nope/x.json", "eval.num_tasks=1", timeout=120)
    assert one_line(proc, 2).startswith("error: config key `eval.report`: cannot write in /proc: ")


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_more_samples_than_one_request_may_ask_are_all_drawn(served):
    """The server answers at most MAX_N completions per request; eval.k above it used to end in a traceback."""
    proc = evaluate(f"eval.run={served}", f"eval.k={MAX_N + 2}", "eval.num_tasks=2", "eval.greedy=false",
                    "eval.report=-")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["k"] == MAX_N + 2 and [len(t["rewards"]) for t in report["per_task"]] == [MAX_N + 2] * 2
    assert f"pass@{MAX_N + 2}" in report


def test_the_terminal_shows_the_headline_figures_and_where_the_report_was_written(served, tmp_path):
    """It used to print the whole report, about a thousand lines for the default 64 tasks."""
    proc = evaluate(f"eval.run={served}", "eval.k=2", "eval.num_tasks=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures, where = proc.stdout.splitlines()
    name = where.removeprefix("report: ")
    assert re.fullmatch(r"eval-reverse_text-\d{8}-\d{6}\.json", name), where
    assert [p.name for p in tmp_path.iterdir()] == [name]  # in the folder it ran in, and nothing else there
    report = json.loads((tmp_path / name).read_text())
    assert report["tasks"] == 2 and len(report["per_task"]) == 2
    assert figures == (f"reverse_text: 2 tasks x k=2 at temperature 1: pass@1 {report['pass@1']:.3f}  "
                       f"pass@2 {report['pass@2']:.3f}  mean reward {report['mean_reward']:.3f}  "
                       f"greedy reward {report['greedy_reward']:.3f}")


def test_with_report_dash_stdout_is_the_json_report_alone_and_nothing_is_written(served, tmp_path):
    proc = evaluate(f"eval.run={served}", "eval.k=1", "eval.num_tasks=2", "eval.report=-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["tasks"] == 2
    assert list(tmp_path.iterdir()) == []
    summary = proc.stderr.strip().splitlines()[-1]  # with k=1, pass@1 is named once
    assert summary.startswith("reverse_text: 2 tasks x k=1 at temperature 1: pass@1 ") and summary.count("pass@") == 1


def test_the_report_named_is_written_to_new_folders(served, tmp_path):
    report = tmp_path / "new" / "folder" / "eval.json"
    proc = evaluate(f"eval.run={served}", "eval.k=2", "eval.num_tasks=2", f"eval.report={report}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == f"report: {report}"
    assert json.loads(report.read_text())["tasks"] == 2


def test_a_default_report_name_taken_already_is_not_replaced(tmp_path):
    """Two evaluations of one environment started in the same second."""
    first = tmp_path / default_report("reverse_text", 0).name
    first.write_text("the first evaluation's")
    assert write_new(first, {"tasks": 2}) == tmp_path / f"{first.stem}-2.json"
    assert write_new(first, {"tasks": 3}) == tmp_path / f"{first.stem}-3.json"
    assert first.read_text() == "the first evaluation's"
    assert json.loads((tmp_path / f"{first.stem}-3.json").read_text()) == {"tasks": 3}


def test_a_default_report_name_is_a_plain_file_name_for_any_environment():
    assert re.fullmatch(r"eval-verifiers_org_my-env-\d{8}-\d{6}\.json",
                        str(default_report("verifiers:org/my-env", time.time())))


def test_episodes_that_failed_in_the_environment_are_named_on_the_summary_line():
    """Counted at env.error_reward in the figures, they would pass for a weak model."""
    out = {"env": "math", "tasks": 4, "k": 1, "temperature": 0.7, "pass@1": 0.5, "mean_reward": 0.5, "errors": 3}
    assert summary(out) == ("math: 4 tasks x k=1 at temperature 0.7: pass@1 0.500  mean reward 0.500  (3 episode(s) "
                            "failed in the environment: see per_task in the report)")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_a_current_folder_that_cannot_be_written_is_refused_before_anything_loads_naming_the_way_out():
    proc = evaluate("eval.num_tasks=1", timeout=120, cwd=Path("/proc"))
    line = one_line(proc, 2)
    assert line.startswith("error: config key `eval.report`: cannot write in /proc: "), line
    assert line.endswith(" (the report's default place): set eval.report=<file>, or eval.report=- to print it"), line


def test_against_a_server_model_path_needs_only_the_tokenizer(served, tmp_path):
    """It used to be refused for holding no model.safetensors, though eval only tokenizes with it."""
    folder = tmp_path / "tokenizer_only"
    folder.mkdir()
    for f in (served / "base_model").iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    ep = endpoint(served)
    proc = evaluate(f"eval.endpoint={ep.url}", f"eval.token={ep.token}", f"model.path={folder}", "eval.k=2",
                    "eval.num_tasks=2", "eval.report=-")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["tasks"] == 2


def test_against_a_server_a_model_path_without_a_tokenizer_is_one_line(served, tmp_path):
    ep = endpoint(served)
    proc = evaluate(f"eval.endpoint={ep.url}", f"eval.token={ep.token}", f"model.path={tmp_path}", timeout=120)
    assert one_line(proc, 2) == (f"error: config key `model.path`: no loadable tokenizer in {tmp_path}: none of "
                                 f"tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt")


class Relay:
    """A TCP relay in front of a server that says when the first generation request went through it, so the test
    kills the server mid-evaluation rather than before it began. When the server is gone, so are its connections."""

    def __init__(self, port: int):
        self.upstream = ("127.0.0.1", port)
        self.generating = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client and b"POST /inference/v1/generate" in data:
                    self.generating.set()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # shutdown, not only close: it wakes the other direction's thread blocked in recv
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_server_killed_mid_evaluation_ends_it_in_one_line_naming_its_key(tmp_path):
    """It used to end with an httpx traceback; it is not a config error, so the exit code is 1."""
    run_dir = tmp_path / "serve"
    server = start_server(run_dir)
    ep = endpoint(run_dir)
    relay = Relay(int(ep.url.rsplit(":", 1)[1]))
    proc = subprocess.Popen([sys.executable, "-m", "rlhpc.eval", *FAST, f"eval.endpoint={relay.url}",
                             f"eval.token={ep.token}", f"model.path={run_dir / 'base_model'}",
                             "eval.num_tasks=32", "eval.k=32", "env.max_new_tokens=64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert relay.generating.wait(120), "no generation request reached the server"
        server.kill()
        out, err = proc.communicate(timeout=120)
    finally:
        relay.close()
        for p in (proc, server):
            p.kill()
            p.wait()
    line = one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 1)
    assert line.startswith(f"error: `eval.endpoint`: the server at {relay.url} stopped answering: "), line
    assert line.endswith(" (no report)") and out == ""
