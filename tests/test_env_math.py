"""envs/math.py: reasoning-gym math problems answered in \\boxed{...}, checked by score_answer and math-verify."""

import sys
import threading
import time
from fractions import Fraction
from itertools import islice

import pytest
from hydra import compose, initialize_config_dir

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import CONF_DIR
from rlhpc.config.schema import EnvConfig, to_typed
from rlhpc.env import Task, load


@pytest.fixture(scope="module")
def env():
    return load(EnvConfig(name="math"))


@pytest.fixture(scope="module")
def eval_tasks(env):
    return list(islice(env.tasks("eval", 0), 50))


def test_the_prompt_is_the_question_and_asks_for_a_boxed_answer(env, eval_tasks):
    text = env.messages(eval_tasks[0])[0]["content"]
    assert text.startswith(eval_tasks[0].data["question"]) and "\\boxed{}" in text


def test_the_eval_set_mixes_the_named_generators(eval_tasks):
    assert {t.data["generator"] for t in eval_tasks} == {"basic_arithmetic", "chain_sum", "simple_equations"}


def test_reference_answers_score_one(env, eval_tasks):
    assert [env.reward(t, env.reference(t)) for t in eval_tasks] == [1.0] * len(eval_tasks)
    assert all(env.reference(t).startswith("\\boxed{") for t in eval_tasks)


def test_reasoning_before_the_boxed_answer_is_fine(env, eval_tasks):
    t = eval_tasks[0]
    text = f"<think>Maybe \\boxed{{oops}}.</think>Step by step... so the answer is {env.reference(t)}."
    assert env.reward(t, text) == 1.0


def test_wrong_answers_score_zero(env, eval_tasks):
    for t in eval_tasks:
        wrong = int(t.data["answer"]) + 1
        assert env.reward(t, f"\\boxed{{{wrong}}}") == 0.0, t.data


def test_a_right_answer_without_a_box_scores_zero(env, eval_tasks):
    t = eval_tasks[0]
    assert env.reward(t, f"The answer is {t.data['answer']}.") == 0.0


def test_the_last_boxed_answer_counts(env, eval_tasks):
    t = eval_tasks[0]
    right, wrong = t.data["answer"], int(t.data["answer"]) + 1
    assert env.reward(t, f"\\boxed{{{wrong}}} no, \\boxed{{{right}}}") == 1.0
    assert env.reward(t, f"\\boxed{{{right}}} no, \\boxed{{{wrong}}}") == 0.0


def test_equivalent_forms_of_an_integer_answer_score_one(env, eval_tasks):
    for t in eval_tasks[:10]:
        n = int(t.data["answer"])
        for form in [f"{n}.0", f"\\frac{{{2 * n}}}{{2}}", f"x = {n}"]:
            assert env.reward(t, f"\\boxed{{{form}}}") == 1.0, (t.data, form)


def test_a_decimal_answer_to_a_fraction_question_scores_one():
    env = load(EnvConfig(name="math", args={"tasks": ["fraction_simplification"], "eval_size": 5}))

    def value(t):
        return Fraction(t.data["metadata"]["simplified_numerator"], t.data["metadata"]["simplified_denominator"])

    task = next(t for t in islice(env.tasks("train", 0), 5000)
                if value(t).denominator > 1 and set(_prime_factors(value(t).denominator)) <= {2, 5})
    value = value(task)
    decimal = f"{float(value):.10f}".rstrip("0")
    assert env.reward(task, f"\\boxed{{{decimal}}}") == 1.0, (task.data["answer"], decimal)
    p, q = value.numerator, value.denominator
    assert env.reward(task, f"\\boxed{{\\frac{{{p}}}{{{q}}}}}") == 1.0
    assert env.reward(task, f"\\boxed{{{p}/{q + 1}}}") < 0.1  # the generator's own partial scores stay off by default


def test_partial_credit_from_the_generators_own_scorer_is_opt_in():
    task = Task("t", {"generator": "basic_arithmetic", "question": "Calculate 2 + 2.", "answer": "4", "metadata": {}})
    strict = load(EnvConfig(name="math", args={"tasks": ["basic_arithmetic"], "eval_size": 1}))
    lenient = load(EnvConfig(name="math", args={"tasks": ["basic_arithmetic"], "eval_size": 1, "partial_credit": True}))
    assert strict.reward(task, "\\boxed{14}") == 0.0  # the default scorer finds "4" inside "14"
    assert lenient.reward(task, "\\boxed{14}") == 0.5
    assert strict.reward(task, "\\boxed{4}") == lenient.reward(task, "\\boxed{4}") == 1.0


def _prime_factors(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@pytest.mark.parametrize("garbage", [
    "", "   ", "\\boxed{", "\\boxed{}", "}}}{{{\\boxed}", "\\boxed{\\frac{1}{0}}", "\\boxed{nan}", "\\boxed{\\infty}",
    "\\boxed{x^{x^{x^{x}}}}", "\\boxed{ünïcødé ✓}", "\\boxed{\\boxed{\\boxed{}}}",
    "\\boxed{1+" + "1+" * 100_000 + "1}",
    "x" * 1_000_000, "\\boxed{" + "9" * 150 + "}", "<think>never closed \\boxed{1}", "\x00\\boxed{\x00}",
])
def test_garbage_answers_score_zero_without_raising(env, eval_tasks, garbage):
    start = time.monotonic()
    assert env.reward(eval_tasks[0], garbage) == 0.0
    assert time.monotonic() - start < 5


def test_answers_that_would_keep_sympy_busy_score_zero_quickly_even_off_the_main_thread(env, eval_tasks):
    # math-verify's own timeout is signal.alarm, which only works on a process's main thread.
    results = []
    worker = threading.Thread(target=lambda: results.extend(
        env.reward(eval_tasks[0], f"\\boxed{{{a}}}") for a in ["9^{9^{9^{9}}}", "(10^{10^{10}})!", "2**2**40"]))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and results == [0.0, 0.0, 0.0]


def test_an_unknown_generator_fails_naming_env_args_tasks():
    with pytest.raises(ValueError, match=r"env\.args\.tasks.*no_such_generator"):
        load(EnvConfig(name="math", args={"tasks": ["chain_sum", "no_such_generator"]}))


@pytest.mark.parametrize("args, key", [
    ({"tasks": "chain_sum"}, "env.args.tasks"),
    ({"tasks": []}, "env.args.tasks"),
    ({"config": {"chain_sum": {"max_digit": 3}}}, "env.args.config.chain_sum"),
    ({"config": {"chain_sum": {"min_digits": 3, "max_digits": 1}}}, "env.args.config.chain_sum"),
    ({"config": {"gcd": {}}}, "env.args.config"),
    ({"config": {"chain_sum": {"seed": 1}}}, "env.args.config.chain_sum"),
    ({"eval_size": 0}, "env.args.eval_size"),
])
def test_bad_args_fail_at_construction_naming_the_key(args, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load(EnvConfig(name="math", args=args))


def test_generator_settings_reach_the_problems():
    env = load(EnvConfig(name="math", args={"tasks": ["chain_sum"], "eval_size": 20,
                                            "config": {"chain_sum": {"min_digits": 3, "max_digits": 3, "min_terms": 2,
                                                                     "max_terms": 2}}}))
    for t in env.tasks("eval", 0):
        assert all(len(n) == 3 for n in t.data["question"].split(":")[-1].replace("=", " ").split() if n.isdigit())


def test_train_and_eval_questions_are_disjoint_and_the_stream_is_seeded(env):
    held_out = {t.data["question"] for t in env.tasks("eval", 0)}
    train = [t.data["question"] for t in islice(env.tasks("train", 0), 3000)]
    assert len(held_out) > 90 and not held_out & set(train)
    assert train[:30] == [t.data["question"] for t in islice(env.tasks("train", 0), 30)]
    assert train[:30] != [t.data["question"] for t in islice(env.tasks("train", 1), 30)]


def test_the_config_preset_composes_and_loads():
    config_mod.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = to_typed(compose(config_name="config", overrides=["env=math", "run_dir=/tmp/x"]))
    env = load(cfg.env)
    assert cfg.env.name == "math" and env.max_turns == 1
    task = next(env.tasks("eval", 0))
    assert env.reward(task, env.reference(task)) == 1.0


def test_the_math_env_does_not_shadow_the_standard_library(env):
    import math

    assert sys.modules["math"] is math and hasattr(math, "sqrt")
