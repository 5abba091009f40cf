"""envs/wordle.py: Wordle against reasoning-gym's answer list, with scripted policies instead of a model."""

import pickle
import sys
from itertools import islice

import pytest
from hydra import compose, initialize_config_dir

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import CONF_DIR
from rlhpc.config.schema import EnvConfig, to_typed
from rlhpc.env import Task, load
from rlhpc.env.base import play


@pytest.fixture(scope="module")
def env():
    return load(EnvConfig(name="wordle"))


@pytest.fixture(scope="module")
def wordle(env):
    return sys.modules[type(env).__module__]  # envs/wordle.py as the loader imported it


def task_with(secret):
    return Task("t", {"secret": secret})


def replay(turns):
    """A policy that says `turns` in order (and repeats the last one)."""
    def policy(conversation):
        done = sum(m["role"] == "assistant" for m in conversation)
        return turns[min(done, len(turns) - 1)]
    return policy


def reference_policy(env, task):
    return replay([m["content"] for m in env.reference(task) if m["role"] == "assistant"])


@pytest.mark.parametrize("secret, guess, marks", [
    ("abbey", "babes", "YYGG."),  # two b's in the secret: one green, one yellow
    ("abbey", "bbbbb", ".GG.."),  # surplus copies of a letter are grey
    ("crane", "eerie", "..Y.G"),  # the green e uses the secret's only e: the other e's are grey
    ("spool", "loops", "YYGYY"),
    ("light", "light", "GGGGG"),
    ("mamma", "amass", "YYY.."),
])
def test_feedback_follows_wordle_rules_for_repeated_letters(wordle, secret, guess, marks):
    assert wordle.feedback(secret, guess) == marks


def test_the_reply_spells_the_guess_with_its_marks_and_the_guesses_left(env):
    task = task_with("abbey")
    reply = env.respond(task, env.start(task), "I'll try <guess>babes</guess>")
    assert reply.messages == [{"role": "user", "content": "B A B E S\nY Y G G .\n5 guesses left."}]
    assert not reply.done and reply.counts == {"invalid_guesses": 0.0}


def test_the_first_message_explains_the_marks_and_the_answer_format(env):
    text = env.messages(task_with("abbey"))[0]["content"]
    assert "<guess>" in text and "6 guesses" in text and "G = right letter" in text


@pytest.mark.parametrize("text", ["<guess>crane</guess>", "<guess> CRANE </guess>",
                                  "Let me think. <guess>Crane</guess>", "crane", " Crane.\n",
                                  "<guess>slate</guess> no wait <guess>crane</guess>",
                                  "<think>maybe <guess>zzzzz</guess></think>\n<guess>crane</guess>"])
def test_a_guess_is_read_leniently(wordle, text):
    assert wordle.parse_guess(text) == "crane"


def test_the_reference_solver_solves_every_eval_task_it_is_given(env):
    scores = []
    for task in islice(env.tasks("eval", 0), 20):
        score, conversation = play(env, task, reference_policy(env, task))
        assert score >= 0.7, (task.data["secret"], conversation)
        scores.append(score)
    assert sum(scores) / len(scores) >= 0.8  # 3.5 guesses on average: about 0.85


def test_reference_messages_are_exactly_what_respond_says(env):
    for task in islice(env.tasks("eval", 0), 10):
        ref = env.reference(task)
        assert [m["role"] for m in ref] == ["assistant", "user"] * (len(ref) // 2) + ["assistant"]
        state = env.start(task)
        for i in range(0, len(ref), 2):
            reply = env.respond(task, state, ref[i]["content"])
            if i + 1 < len(ref):
                assert not reply.done and reply.messages == [ref[i + 1]]
            else:
                assert reply.done and state["solved"]
        assert len(ref) // 2 + 1 <= 6


def test_fewer_guesses_earn_more(env):
    task = task_with("abbey")
    one, _ = play(env, task, replay(["<guess>abbey</guess>"]))
    two, _ = play(env, task, replay(["<guess>crane</guess>", "<guess>abbey</guess>"]))
    six, _ = play(env, task, replay(["<guess>crane</guess>"] * 5 + ["<guess>abbey</guess>"]))
    assert one == 1.0 and one > two > six == pytest.approx(0.7)


def test_garbage_and_unknown_words_score_zero_and_are_counted(env):
    task = task_with("abbey")
    state, counts = env.start(task), 0
    for text in ["I have no idea", "<guess>zzzzz</guess>", "<guess>ab</guess>", "<guess>abbeys</guess>", "", "xyzzy"]:
        reply = env.respond(task, state, text)
        counts += reply.counts["invalid_guesses"]
    assert reply.done and counts == 6 and state["invalid"] == 6
    assert "No guesses left: the word was ABBEY." in reply.messages[0]["content"]
    score, conversation = play(env, task, replay(["<guess>qxzvj</guess>"]))
    assert score == 0.0 and sum(m["role"] == "assistant" for m in conversation) == 6


@pytest.mark.parametrize("text, says", [("hello there", "No guess found"),
                                        ("<guess>qxzvj</guess>", "not in the word list"),
                                        ("<guess>cat</guess>", "not a 5-letter word")])
def test_an_invalid_guess_says_why_and_uses_a_guess(env, text, says):
    task = task_with("abbey")
    reply = env.respond(task, env.start(task), text)
    assert says in reply.messages[0]["content"] and "5 guesses left." in reply.messages[0]["content"]
    assert reply.counts == {"invalid_guesses": 1.0}


def test_the_same_valid_word_every_turn_earns_partial_credit(env):
    task = task_with("abbey")
    score, _ = play(env, task, replay(["<guess>babes</guess>"]))
    assert 0.0 < score < 0.3
    nothing_right, _ = play(env, task, replay(["<guess>crust</guess>"]))
    assert 0.0 < nothing_right < score  # a valid guess earns the format part even with no letter right


def test_the_episode_ends_after_six_guesses(env):
    task = task_with("abbey")
    _, conversation = play(env, task, replay(["<guess>crane</guess>"]), turns=10)
    assert sum(m["role"] == "assistant" for m in conversation) == 6


def test_a_last_turn_the_trainer_sent_no_reply_to_still_counts(env):
    # The trainer ends an episode at max_turns without calling respond on the last turn: score reads the turns.
    task = task_with("abbey")
    state = env.start(task)
    turns = ["<guess>crane</guess>"] * 5 + ["<guess>abbey</guess>"]
    for text in turns[:-1]:
        env.respond(task, state, text)
    assert env.score(task, state, turns) == pytest.approx(0.7)


def test_the_state_is_a_picklable_record_of_guesses_and_marks(env):
    task = task_with("abbey")
    state = env.start(task)
    env.respond(task, state, "<guess>babes</guess>")
    env.respond(task, state, "nope")
    back = pickle.loads(pickle.dumps(state))
    assert back["guesses"] == ["babes", None] and back["marks"][0] == "YYGG." and back["invalid"] == 1


def test_train_tasks_never_use_eval_secrets(env):
    eval_secrets = {t.data["secret"] for t in env.tasks("eval", 0)}
    train = [t.data["secret"] for t in islice(env.tasks("train", 3), 5000)]
    assert len(eval_secrets) == 100 and not eval_secrets & set(train)
    assert train[:50] == [t.data["secret"] for t in islice(env.tasks("train", 3), 50)]
    assert train[:50] != [t.data["secret"] for t in islice(env.tasks("train", 4), 50)]


@pytest.mark.parametrize("args, key", [({"guesses": "all"}, "env.args.guesses"),
                                       ({"eval_size": 0}, "env.args.eval_size"),
                                       ({"max_guesses": 0}, "env.args.max_guesses"),
                                       ({"colour": "green"}, "env.args")])
def test_bad_args_fail_at_construction_naming_the_key(args, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load(EnvConfig(name="wordle", args=args))


def test_the_config_preset_composes_and_loads():
    config_mod.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = to_typed(compose(config_name="config", overrides=["env=wordle", "run_dir=/tmp/x"]))
    assert cfg.env.name == "wordle" and cfg.env.max_turns == 6
    assert load(cfg.env).max_turns == 6
