"""CI runs what the README tells a new user, and the default test run says how to run everything."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".ci"))
import readme  # noqa: E402  (.ci/readme.py)


def test_ci_runs_the_readmes_test_command_as_written_in_a_fresh_venv():
    test_command = readme.command("tests")
    assert test_command.endswith("python -m pytest") and "pip install -e '.[test]'" in test_command
    ci = (REPO / ".ci" / "run").read_text()
    # .ci/run takes the command from the README at run time, in a venv it has just made: the two cannot drift.
    assert 'python -m venv "$WORK/venv"' in ci and 'eval "$(python .ci/readme.py tests)"' in ci
    assert readme.command("quickstart").endswith("python -m rlhpc.launch +exp=reverse_text")


def test_a_readme_without_the_command_is_named_not_guessed():
    try:
        readme.command("tests", "# rlhpc\n\nNo commands here.\n")
    except SystemExit as e:
        assert "README.md has no paragraph starting 'The tests ('" in str(e)
    else:
        raise AssertionError("a README without the test command was accepted")


def _pytest(tmp_path, *args, env=None):
    (tmp_path / "test_tiers.py").write_text(
        "import pytest\n\n"
        "def test_quick():\n    pass\n\n"
        "@pytest.mark.slow\ndef test_end_to_end():\n    pass\n")
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = .\nmarkers =\n    slow: slow\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)


def test_the_default_run_leaves_the_slow_tests_out_and_says_how_to_run_everything(tmp_path):
    proc = _pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 deselected" in proc.stdout
    assert "1 slow end-to-end tests were left out (opt-in locally; CI runs them). " \
           "Everything: python -m pytest --slow" in proc.stdout
    assert "2 passed" in _pytest(tmp_path, "--slow").stdout
    assert "2 passed" in _pytest(tmp_path, "test_tiers.py").stdout  # a file named on the command line runs whole


def test_ci_runs_every_test_once_over_its_two_phases(tmp_path):
    first, env = tmp_path / "first.jsonl", dict(os.environ)
    _pytest(tmp_path, env={**env, "RLHPC_TEST_RECORD": str(first)})
    assert [(r["id"], r["outcome"]) for r in map(json.loads, first.read_text().splitlines())] == [
        ("test_tiers.py::test_quick", "passed")]
    second = tmp_path / "second.jsonl"
    proc = _pytest(tmp_path, "--slow", env={**env, "RLHPC_TEST_DONE": str(first), "RLHPC_TEST_RECORD": str(second)})
    assert "1 passed, 1 deselected" in proc.stdout
    assert [r["id"] for r in map(json.loads, second.read_text().splitlines())] == ["test_tiers.py::test_end_to_end"]


def test_a_failure_is_recorded_and_the_budget_report_prints_it(tmp_path):
    """CI's time limit can cut pytest short before it prints its summary: the record keeps each failure's end, and the
    report that runs at CI's exit prints it."""
    record = tmp_path / "record.jsonl"
    (tmp_path / "test_failing.py").write_text("def test_fails():\n    assert 1 + 1 == 3, 'arithmetic broke'\n")
    _pytest(tmp_path, "test_failing.py", env={**os.environ, "RLHPC_TEST_RECORD": str(record)})
    (row,) = map(json.loads, record.read_text().splitlines())
    assert row["outcome"] == "failed" and "arithmetic broke" in row["failure"]
    report = subprocess.run([sys.executable, str(REPO / ".ci" / "report.py"), f"rest={record}"],
                            capture_output=True, text=True, timeout=60)
    assert "== failed: test_failing.py::test_fails (rest)" in report.stdout
    assert "AssertionError: arithmetic broke" in report.stdout
