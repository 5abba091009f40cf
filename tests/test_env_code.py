"""envs/code.py: write a function from its specification; hidden tests run in the sandbox."""

import itertools
import json

import pytest

from rlhpc.config.schema import EnvConfig, SandboxLimitsConfig
from rlhpc.env import load
from rlhpc.env.base import play
from rlhpc.env.sandbox import SandboxUnavailable

# Tight limits keep the runaway-code tests short.
LIMITS = SandboxLimitsConfig(cpu_s=2, wall_s=3.0)


def code_env(**args):
    return load(EnvConfig(name="code", args=args, sandbox_limits=LIMITS))


@pytest.fixture(scope="module")
def env():
    return code_env(eval_size=16)


@pytest.fixture(scope="module")
def tool_env():
    return code_env(tools=True, eval_size=4)


def task_of(env, family):
    return next(t for t in env.tasks("train", 0) if t.data["family"] == family)


def answer(code):
    return f"Here it is:\n```python\n{code}\n```"


def script(turns):
    """A policy that says `turns` in order."""
    it = iter(turns)
    return lambda conversation: next(it)


def tool_call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_reference_answers_score_one(env):
    for task in itertools.islice(env.tasks("eval", 0), 10):
        assert env.reward(task, env.reference(task)) == 1.0, task.data["family"]


def test_a_wrong_function_scores_below_half(env):
    task = task_of(env, "caesar")
    assert env.reward(task, answer("def caesar(s):\n    return s")) < 0.5


def test_no_code_block_or_garbage_scores_zero(env):
    task = task_of(env, "fizzbuzz")
    assert env.reward(task, "I would loop from 1 to n and check divisibility.") == 0.0
    assert env.reward(task, answer("def fizzbuzz(n) return [")) == 0.0  # a syntax error
    assert env.reward(task, answer("def something_else(n):\n    return []")) == 0.0


def test_an_infinite_loop_times_out_and_the_next_episode_works(env):
    task = task_of(env, "running")
    assert env.reward(task, answer("def running(xs):\n    while True:\n        pass")) == 0.0
    assert env.reward(task, env.reference(task)) == 1.0


def test_a_forged_passing_report_earns_nothing(env):
    task = task_of(env, "count_chars")
    fake = ('import sys\nprint(\'{"load_error": null}\')\n' + "print('{\"value\": 0}')\n" * 8 + "sys.exit(0)")
    assert env.reward(task, answer(fake)) == 0.0
    # Even code that finds the nonce and writes its own report on the runner's channel only earns what its values
    # earn: the expected values are not in the sandbox.
    nonce_thief = (
        "import json, os, sys\n"
        "main = sys.modules['__main__']\n"
        "p = main.payload\n"
        "os.write(main.report.fileno(), (p['nonce'] + json.dumps({'load_error': None}) + '\\n' + "
        "'\\n'.join('{\"value\": \"PASS\"}' for _ in p['inputs']) + '\\n').encode())\n"
        "os._exit(0)\n")
    assert env.reward(task, answer(nonce_thief)) == 0.0


def test_train_and_eval_tasks_are_disjoint(env):
    held_out = {t.data["key"] for t in env.tasks("eval", 0)}
    train = [t.data["key"] for t in itertools.islice(env.tasks("train", 3), 1500)]
    assert len(held_out) == 16
    assert not held_out & set(train)
    assert len(set(train)) > 400  # and training sees many distinct tasks


def test_train_order_depends_on_the_seed(env):
    first = [t.data["key"] for t in itertools.islice(env.tasks("train", 1), 5)]
    assert first == [t.data["key"] for t in itertools.islice(env.tasks("train", 1), 5)]
    assert first != [t.data["key"] for t in itertools.islice(env.tasks("train", 2), 5)]


def test_the_prompt_shows_spec_signature_and_examples(env):
    task = next(env.tasks("eval", 0))
    text = env.messages(task)[0]["content"]
    assert task.data["spec"] in text and task.data["signature"] in text and "```python" in text
    assert len(task.data["examples"]) == 2 and len(task.data["tests"]) == 8
    for example in task.data["examples"]:
        assert repr(example["expected"]) in text
    for test in task.data["tests"]:  # hidden tests are hidden
        assert test not in task.data["examples"]


def test_reference_tool_episode_scores_one(tool_env):
    task = next(tool_env.tasks("eval", 0))
    reference = tool_env.reference(task)
    assert [m["role"] for m in reference] == ["assistant", "tool", "assistant"]
    score, conversation = play(tool_env, task, script([m["content"] for m in reference if m["role"] == "assistant"]))
    assert score == 1.0
    assert conversation[1:] == reference  # the tool reply is exactly what respond() gives


def test_run_python_returns_the_programs_output(tool_env):
    task = next(tool_env.tasks("eval", 0))
    reply = tool_env.respond(task, tool_env.start(task), tool_call("run_python", code="print(6 * 7)\n1 / 0"))
    (message,) = reply.messages
    assert message["role"] == "tool" and not reply.done
    assert "exit code 1" in message["content"] and "42" in message["content"]
    assert "ZeroDivisionError" in message["content"] and 'File "main.py"' in message["content"]


def test_run_tests_on_examples_reports_each_example(tool_env):
    task = next(tool_env.tasks("eval", 0))
    state = tool_env.start(task)
    good = tool_env.respond(task, state, tool_call("run_tests_on_examples", code=task.data["reference"]))
    assert good.messages[0]["content"].endswith("2 of 2 examples passed")
    broken = tool_env.respond(task, state, tool_call("run_tests_on_examples", code="x = ("))
    assert "SyntaxError" in broken.messages[0]["content"]


def test_bad_tool_calls_become_error_messages(tool_env):
    task = next(tool_env.tasks("eval", 0))
    state = tool_env.start(task)
    for text, error in [(tool_call("run_python", code="print(1)", source="print(2)"), "has no argument"),
                        (tool_call("run_python"), "needs the argument"),
                        (tool_call("rm_rf", path="/"), "unknown tool"),
                        ("<tool_call>{not json</tool_call>", "not valid JSON")]:
        reply = tool_env.respond(task, state, text)
        assert not reply.done and reply.counts["tool_errors"] == 1
        assert reply.messages[0]["content"].startswith("error:") and error in reply.messages[0]["content"]


def test_a_final_answer_without_tool_call_ends_the_episode(tool_env):
    task = next(tool_env.tasks("eval", 0))
    assert tool_env.respond(task, tool_env.start(task), tool_env.reference(task)[-1]["content"]).done
    # Out of turns while still calling tools: no final answer, no reward.
    assert tool_env.score(task, {}, [tool_call("run_python", code="print(1)")]) == 0.0


def test_without_tools_the_episode_is_single_turn(env):
    task = next(env.tasks("eval", 0))
    assert env.max_turns == 1 and env.tools() == []
    assert env.respond(task, env.start(task), "anything").done


@pytest.mark.parametrize("args, key", [({"tests": 0}, "env.args.tests"), ({"tools": "yes"}, "env.args.tools"),
                                       ({"families": ["sorting"]}, "env.args.families"),
                                       ({"eval_size": 0}, "env.args.eval_size"), ({"nope": 1}, "nope")])
def test_bad_args_are_refused_naming_the_key(args, key):
    with pytest.raises(ValueError, match=key):
        code_env(**args)


def test_refuses_to_start_without_a_working_sandbox(monkeypatch):
    monkeypatch.setenv("RLHPC_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="env.sandbox=unsandboxed"):
        code_env(eval_size=1)
    env = load(EnvConfig(name="code", args={"eval_size": 1}, sandbox="unsandboxed", sandbox_limits=LIMITS))
    task = next(env.tasks("eval", 0))
    assert env.reward(task, env.reference(task)) == 1.0
