"""Episodes: multi-turn, tool-using, token-exact trajectories; faults in environments cost a sample, not the run."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhpc.config.schema import EnvConfig, ModelConfig
from rlhpc.env import load
from rlhpc.env.episode import EnvironmentFailure, Renderer, check_failures, failures, run_episodes
from rlhpc.env.pool import EnvPool
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.modeling import models
from rlhpc.train.batching import pad, token_logprobs

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build(ModelConfig(seed=3, tokenizer_added_tokens=["<tool_call>", "</tool_call>"]),
                        tmp_path_factory.mktemp("m"))


def echo_env(**kw):
    return load(EnvConfig(cls="episode_envs:Echo", max_new_tokens=12, **kw))


def trainer_logprobs(model, episodes, temperature):
    ids, attn = pad([torch.tensor(e.ids) for e in episodes], 0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, attn, temperature=temperature)
    return [lp[i, e.prompt_len - 1: len(e.ids) - 1] for i, e in enumerate(episodes)]


def assert_token_exact(episodes, model, temperature):
    for e, lp in zip(episodes, trainer_logprobs(model, episodes, temperature)):
        mask = torch.tensor(e.mask)
        sampled = torch.tensor(e.logprobs)
        assert len(e.ids) - e.prompt_len == len(e.mask) == len(e.logprobs)
        # The trainer's logprobs of the sampled tokens are the engine's sampling logprobs: mismatch KL ~0.
        diff = (lp[mask] - sampled[mask]).abs().max().item()
        kl = (sampled[mask] - lp[mask]).mean().abs().item()
        assert diff < 1e-4 and kl < 1e-5, (diff, kl)
        assert (sampled[~mask] == 0).all()  # environment tokens carry no logprob and no loss


def test_a_three_turn_tool_episode_is_token_exact_with_the_hf_engine(model_dir):
    env = echo_env()
    tok = models.load_tokenizer(model_dir)
    model = models.load_model(model_dir).eval()
    torch.manual_seed(0)
    tasks = [t for _, t in zip(range(3), env.tasks("train", 0))]
    with EnvPool(env.config, processes=0, env=env) as pool:
        groups = run_episodes(HFEngine(model, tok.pad_token_id), env, pool, tok, tasks, 2, 1.0, 12, 3)
    eps = [e for g in groups for e in g]
    assert all(e.turns == 3 and e.error is None and e.reward == 1.0 for e in eps)
    for e in eps:
        # Three runs of sampled tokens separated by two runs of environment tokens.
        runs = [k for k, _ in __import__("itertools").groupby(e.mask)]
        assert runs == [True, False, True, False, True]
        # The environment's tokens decode to the tool turn the chat template renders.
        env_text = tok.decode([t for t, m in zip(e.ids[e.prompt_len:], e.mask) if not m])
        assert "<|im_start|>tool\nTURN 1<|im_end|>" in env_text and "<|im_start|>assistant\n" in env_text
    # The prompt carries the tool schema through the chat template.
    assert "shout(word): repeats a word loudly" in tok.decode(eps[0].ids[:eps[0].prompt_len])
    assert_token_exact(eps, model, 1.0)


def test_prompts_extend_turn_by_turn_never_re_encoding_the_policy_tokens(model_dir):
    env = echo_env()
    tok = models.load_tokenizer(model_dir)
    model = models.load_model(model_dir).eval()
    torch.manual_seed(1)
    seen = []

    class Spy(HFEngine):
        def generate(self, prompts, *a, **k):
            seen.append([list(p) for p in prompts])
            return super().generate(prompts, *a, **k)

    with EnvPool(env.config, processes=0, env=env) as pool:
        (group,) = run_episodes(Spy(model, tok.pad_token_id), env, pool, tok, [next(env.tasks("train", 0))], 1, 1.0, 12, 3)
    e = group[0]
    assert len(seen) == 3
    for turn in range(2):  # each turn's prompt starts with the previous turn's prompt
        assert seen[turn + 1][0][: len(seen[turn][0])] == seen[turn][0]
    assert seen[2][0] == e.ids[: len(seen[2][0])]


def test_a_tool_call_reaches_the_tool_and_its_result_comes_back_as_a_tool_message():
    env = echo_env()
    state = env.start(next(env.tasks("train", 0)))
    reply = env.respond(None, state, '<tool_call>{"name": "shout", "arguments": {"word": "hey"}}</tool_call>')
    assert reply.messages == [{"role": "tool", "name": "shout", "content": "HEY"}] and not reply.done
    assert reply.counts == {"tool_calls": 1}


@pytest.mark.parametrize("text,error", [
    ('<tool_call>{"name": "shout", "arguments": {"word": </tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "whisper", "arguments": {}}</tool_call>', "unknown tool 'whisper'"),
    ('<tool_call>{"name": "shout", "arguments": {"wrd": "x"}}</tool_call>', "needs the argument(s) word"),
    ('<tool_call>{"name": "shout", "arguments": {"word": 3}}</tool_call>', "must be a string"),
])
def test_a_bad_tool_call_is_an_error_message_to_the_model_and_a_counted_metric(text, error):
    from rlhpc.env.tools import ToolEnvironment

    env = echo_env()
    reply = ToolEnvironment.respond(env, None, {}, text)
    assert not reply.done and error in reply.messages[0]["content"] and reply.counts.get("tool_errors") == 1


def test_a_tool_that_raises_or_hangs_is_an_error_message():
    from rlhpc.env.tools import Tool, ToolEnvironment

    env = echo_env()
    env.tool_timeout_s = 0.5
    boom = Tool("boom", "fails", {"type": "object", "properties": {}}, lambda: 1 / 0)
    slow = Tool("slow", "hangs", {"type": "object", "properties": {}}, lambda: time.sleep(30))
    env.tools = lambda: [boom, slow]
    t0 = time.time()
    reply = ToolEnvironment.respond(env, None, {}, '<tool_call>{"name": "boom"}</tool_call><tool_call>{"name": "slow"}</tool_call>')
    assert time.time() - t0 < 5
    texts = [m["content"] for m in reply.messages]
    assert "ZeroDivisionError" in texts[0] and "took longer than 0.5s" in texts[1]
    assert reply.counts == {"tool_calls": 2, "tool_errors": 2}


def test_rewards_that_raise_hang_or_are_not_finite_cost_their_sample_only(model_dir):
    cfg = EnvConfig(cls="episode_envs:Faulty", args={"hang_s": 60}, max_new_tokens=4, call_timeout_s=2.0,
                    pool_processes=2, error_reward=0.0, max_error_fraction=0.6)
    env = load(cfg)
    tok = models.load_tokenizer(model_dir)
    model = models.load_model(model_dir).eval()
    tasks = [t for _, t in zip(range(8), env.tasks("train", 0))]
    t0 = time.time()
    with EnvPool(cfg) as pool:
        groups = run_episodes(HFEngine(model, tok.pad_token_id), env, pool, tok, tasks, 2, 1.0, 4, 1,
                              error_reward=cfg.error_reward)
        # The pool replaced the process that hung and serves the next batch.
        again = run_episodes(HFEngine(model, tok.pad_token_id), env, pool, tok, tasks[4:5], 2, 1.0, 4, 1)
    assert time.time() - t0 < 30
    by_mode = {g[0].task.data["mode"]: g for g in groups}
    for mode in ("raise", "hang", "nan", "inf"):
        assert all(e.error and e.reward == 0.0 for e in by_mode[mode]), mode
    assert all(e.timed_out for e in by_mode["hang"]) and "reward exploded" in by_mode["raise"][0].error
    assert all(e.error is None and e.reward == 1.0 for g in groups[4:] for e in g)
    assert [e.reward for e in again[0]] == [1.0, 1.0]
    flat = [e for g in groups for e in g]
    stats = failures(flat)
    assert stats["env/errors"] == 8 and stats["env/timeouts"] == 2
    check_failures(env, flat, 0.6)  # 8 of 16 failed: under the limit, the run goes on
    with pytest.raises(EnvironmentFailure, match=r"environment 'faulty': 8 of 16 samples failed.*first error \(task"):
        check_failures(env, flat, 0.25)


def test_the_token_budget_ends_an_episode_as_truncated(model_dir):
    env = echo_env()
    tok = models.load_tokenizer(model_dir)
    model = models.load_model(model_dir).eval()
    task = next(env.tasks("train", 0))
    with EnvPool(env.config, processes=0, env=env) as pool:
        prompt = len(Renderer(tok, [t.schema() for t in env.tools()]).prompt(env.messages(task)))
        (group,) = run_episodes(HFEngine(model, tok.pad_token_id), env, pool, tok, [task], 2, 1.0, 12, 3,
                                max_tokens=prompt + 20)
    for e in group:
        assert len(e.ids) <= prompt + 20 and e.truncated and e.turns < 3


def test_a_pool_refuses_an_environment_that_cannot_start():
    with pytest.raises(RuntimeError, match="failed to start in a pool process.*nope"):
        EnvPool(EnvConfig(cls="episode_envs:Faulty", args={"nope": 1}, pool_processes=1))


def test_env_ignore_eos_runs_every_turn_to_max_new_tokens(model_dir):
    """`env.ignore_eos` (benchmarks): a model that says end-of-sequence at once still generates max_new_tokens."""
    env = echo_env()
    tok = models.load_tokenizer(model_dir)
    model = models.load_model(model_dir).eval()
    eos_first = model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: out.index_add(-1, torch.tensor([tok.eos_token_id]), torch.full(out.shape[:-1] + (1,), 30.0)))
    tasks = list(itertools.islice(env.tasks("train", 0), 2))  # an endless stream
    try:
        with EnvPool(env.config, processes=0, env=env) as pool:
            stopped = run_episodes(HFEngine(model, tok.pad_token_id), env, pool, tok, tasks, 2, 1.0, 12, 1)
            full = run_episodes(HFEngine(model, tok.pad_token_id), env, pool, tok, tasks, 2, 1.0, 12, 1,
                                ignore_eos=True)
        assert all(len(e.ids) - e.prompt_len == 1 for g in stopped for e in g)  # the eos alone
        episodes = [e for g in full for e in g]
        assert all(len(e.ids) - e.prompt_len == 12 for e in episodes)
        assert all(e.ids[e.prompt_len:].count(tok.eos_token_id) > 1 for e in episodes)
    finally:
        eos_first.remove()
