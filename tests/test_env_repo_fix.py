"""envs/repo_fix.py: fix a planted bug in a small repository with file tools; hidden checks run in the sandbox."""

import itertools
import json
import os

import pytest

from rlhpc.config.schema import EnvConfig, SandboxLimitsConfig
from rlhpc.env import load
from rlhpc.env.base import play
from rlhpc.env.sandbox import SandboxUnavailable

LIMITS = SandboxLimitsConfig(cpu_s=2, wall_s=5.0)


@pytest.fixture(scope="module")
def work_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def env(work_root):
    return load(EnvConfig(name="repo_fix", args={"eval_size": 3, "work_root": work_root}, sandbox_limits=LIMITS))


@pytest.fixture(scope="module")
def task(env):
    return next(env.tasks("eval", 0))


@pytest.fixture
def state(env, task):
    state = env.start(task)
    yield state
    env.finish(task, state)


def tool_call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def call(env, task, state, name, **arguments):
    """The tool's reply to one call, as the policy sees it."""
    (message,) = env.respond(task, state, tool_call(name, **arguments)).messages
    return message["content"]


def script(turns):
    it = iter(turns)
    return lambda conversation: next(it)


def test_the_reference_fix_scores_one(env):
    for task in env.tasks("eval", 0):
        reference = env.reference(task)
        assert [m["role"] for m in reference] == ["assistant", "tool"] * 3 + ["assistant"]
        score, conversation = play(env, task, script([m["content"] for m in reference if m["role"] == "assistant"]))
        assert score == 1.0, (task.data["repo"], task.data["bug"])
        assert conversation[1:] == reference  # replayed against a fresh copy, every tool reply is the same


def test_no_edit_scores_zero(env, task, state):
    assert env.score(task, state, ["Looks fine to me."]) == 0.0


def test_fixing_by_editing_the_tests_scores_zero(env, task, state):
    test_file = next(p for p in task.data["test_hashes"])
    # Rewrite a test file (the failing asserts gone) and apply the real fix too: still 0.
    text = open(os.path.join(state["dir"], test_file)).read()
    rewritten = call(env, task, state, "edit_file", path=test_file, search=text, replace="def test_ok():\n    pass\n")
    assert rewritten.startswith("edited")
    fix = task.data["fix"]
    assert "edited" in call(env, task, state, "edit_file", **fix)
    assert env.score(task, state, ["done"]) == 0.0


def test_run_tests_shows_the_failure_before_the_fix_and_passes_after(env, task, state):
    before = call(env, task, state, "run_tests")
    assert "FAIL tests/" in before and not before.endswith(" 0 failed")
    call(env, task, state, "edit_file", **task.data["fix"])
    after = call(env, task, state, "run_tests")
    assert "FAIL" not in after and after.endswith(" 0 failed")


def test_paths_outside_the_work_folder_are_refused(env, task, state):
    for path in ["../../etc/passwd", "/etc/passwd", "tests/../../x.py"]:
        assert "outside the repository" in call(env, task, state, "read_file", path=path)
    assert "outside the repository" in call(env, task, state, "edit_file", path="../x.py", search="a", replace="b")
    # A link planted in the folder (by code the tests ran, say) does not lead out either.
    os.symlink("/etc", os.path.join(state["dir"], "etc"))
    assert "outside the repository" in call(env, task, state, "read_file", path="etc/passwd")


def test_edit_file_needs_the_search_text_exactly_once(env, task, state):
    path = task.data["fix"]["path"]
    missing = call(env, task, state, "edit_file", path=path, search="no such text", replace="x")
    assert missing.startswith("error:") and "not found" in missing
    twice = call(env, task, state, "edit_file", path=path, search="\n", replace="\n")
    assert twice.startswith("error:") and "times" in twice
    assert call(env, task, state, "read_file", path=path) == task.data["files"][path]  # nothing changed


def test_list_and_read_files(env, task, state):
    listed = call(env, task, state, "list_files").splitlines()
    assert listed == sorted(task.data["files"])
    assert call(env, task, state, "read_file", path="README.md") == task.data["files"]["README.md"]
    assert "no file" in call(env, task, state, "read_file", path="nope.py")


def test_a_package_that_forges_a_passing_report_scores_zero(env, task, state):
    # The package prints a made-up report when imported and exits: the checker still sees no right values.
    forged = ("import sys\nprint('\\n'.join(['ok'] * 50))\nsys.stdout.flush()\nimport os\nos._exit(0)\n")
    init = f"{task.data['package']}/__init__.py"
    call(env, task, state, "edit_file", path=init, search=task.data["files"][init], replace=forged)
    call(env, task, state, "edit_file", **task.data["fix"])
    assert env.score(task, state, ["done"]) == 0.0


def test_work_folders_are_removed_by_finish(env, task, work_root):
    state = env.start(task)
    assert os.path.isdir(state["dir"]) and os.path.dirname(state["dir"]) == work_root
    env.finish(task, state)
    assert not os.path.exists(state["dir"])
    play(env, task, script(["I give up."]))
    assert os.listdir(work_root) == []


def test_train_excludes_the_eval_bugs(env):
    held_out = {(t.data["repo"], t.data["bug"]) for t in env.tasks("eval", 0)}
    train = {(t.data["repo"], t.data["bug"]) for t in itertools.islice(env.tasks("train", 0), 3)}
    assert len(held_out) == 3 and not held_out & train


@pytest.mark.parametrize("args, key", [({"eval_size": 0}, "env.args.eval_size"),
                                       ({"eval_size": 100}, "env.args.eval_size"),
                                       ({"repos": ["kernel"]}, "env.args.repos"),
                                       ({"max_turns": "many"}, "env.args.max_turns"), ({"nope": 1}, "nope")])
def test_bad_args_are_refused_naming_the_key(args, key):
    with pytest.raises(ValueError, match=key):
        load(EnvConfig(name="repo_fix", args=args))


def test_refuses_to_start_without_a_working_sandbox(monkeypatch):
    monkeypatch.setenv("RLHPC_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="env.sandbox=unsandboxed"):
        load(EnvConfig(name="repo_fix"))
    assert load(EnvConfig(name="repo_fix", sandbox="unsandboxed")).tools()
