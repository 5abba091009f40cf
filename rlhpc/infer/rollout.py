"""From tasks to rollout groups: run a group of episodes per task, score them, compute advantages, pack.

Shared by the inference worker (training rollouts) and held-out evaluation. The episodes themselves (turns, tools,
the environment's replies, token-exact trajectories) are rlhpc.env.episode's.
"""

from __future__ import annotations

import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlhpc.algo.advantage import group_advantages, keep_group
from rlhpc.config.schema import AlgoConfig, EnvConfig
from rlhpc.env import Environment, Task
from rlhpc.env.base import max_turns
from rlhpc.env.episode import Episode, Renderer, check_failures, failures, run_episodes
from rlhpc.env.pool import EnvPool
from rlhpc.infer.engines import Engine
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.infer.server import private_server
from rlhpc.transport.queue import Group, RolloutBatch


def prompt_ids(tokenizer, env: Environment, task: Task) -> List[int]:
    """The first prompt of a task's episode, with the environment's tools, as token ids."""
    return Renderer(tokenizer, [t.schema() for t in env.tools()]).prompt(env.messages(task))


def episodes(engine: Engine, env: Environment, pool: EnvPool, tokenizer, tasks: Sequence[Task], n: int,
             temperature: float, env_cfg: EnvConfig, version: int = 0, greedy: bool = False) -> List[List[Episode]]:
    if hasattr(env, "run_episodes"):  # an environment that runs its own episodes (rlhpc.env.verifiers_env)
        return env.run_episodes(engine, tokenizer, tasks, n, temperature, env_cfg, version=version, greedy=greedy,
                                serve=private_server)
    return run_episodes(engine, env, pool, tokenizer, tasks, n, temperature, env_cfg.max_new_tokens,
                        max_turns(env, env_cfg), env_cfg.max_episode_tokens, version, greedy=greedy,
                        error_reward=env_cfg.error_reward, timeout_s=env_cfg.call_timeout_s * 4 + 60,
                        ignore_eos=env_cfg.ignore_eos)


def generate_groups(engine: Engine, env: Environment, pool: EnvPool, tokenizer, tasks: Sequence[Task],
                    algo: AlgoConfig, env_cfg: EnvConfig, version: int
                    ) -> Tuple[Optional[RolloutBatch], int, Dict[str, float]]:
    """A batch with one group per task, how many groups dynamic sampling filtered out (None if all were), and the
    environment's counters (env/errors, env/timeouts, tool calls, ...). Raises EnvironmentFailure when more than
    `env.max_error_fraction` of the samples failed."""
    groups_of_episodes = episodes(engine, env, pool, tokenizer, tasks, algo.group_size, algo.temperature, env_cfg,
                                  version)
    flat = [e for g in groups_of_episodes for e in g]
    check_failures(env, flat, env_cfg.max_error_fraction)
    tokens, logprobs, mask, advantages, group_of, lengths = [], [], [], [], [], []
    routing: Optional[List[torch.Tensor]] = [] if all(e.routing is not None for e in flat) else None
    groups: List[Group] = []
    filtered = 0
    for task, eps in zip(tasks, groups_of_episodes):
        rewards = torch.tensor([e.reward for e in eps], dtype=torch.float32)
        if not keep_group(rewards, algo):  # no reward variance: no learning signal (DAPO dynamic sampling)
            filtered += 1
            continue
        gi = len(groups)
        adv = group_advantages(rewards, torch.tensor([e.sampled_tokens for e in eps]), algo, env_cfg.max_new_tokens)
        for e, a in zip(eps, adv.tolist()):
            tokens.append(torch.as_tensor(e.ids, dtype=torch.long))
            logprobs.append(torch.cat([torch.zeros(e.prompt_len), torch.as_tensor(e.logprobs, dtype=torch.float32)]))
            mask.append(torch.cat([torch.zeros(e.prompt_len, dtype=torch.bool), torch.as_tensor(e.mask, dtype=torch.bool)]))
            advantages.append(a)
            group_of.append(gi)
            lengths.append(len(e.ids))
            if routing is not None:
                routing.append(sample_routing(e.routing, len(e.ids)))
        groups.append(
            Group(
                uid=uuid.uuid4().hex,
                env=env.name,
                task_id=task.id,
                # With in-flight updates (vLLM) a completion knows the versions that produced it.
                version=max(e.max_version if e.max_version is not None else version for e in eps),
                num_samples=len(eps),
                rewards=rewards.tolist(),
                truncated=[e.truncated for e in eps],
                min_version=min(e.min_version if e.min_version is not None else version for e in eps),
                extra={"completion_tokens": [e.sampled_tokens for e in eps], "turns": [e.turns for e in eps],
                       "errors": [e.error for e in eps if e.error]},
            )
        )
    stats = failures(flat)
    stats["env/turns"] = sum(e.turns for e in flat) / max(len(flat), 1)
    if not groups:
        return None, filtered, stats
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.as_tensor(lengths), 0)
    batch = RolloutBatch(
        tokens=torch.cat(tokens),
        offsets=offsets,
        logprobs=torch.cat(logprobs),
        loss_mask=torch.cat(mask),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        group_of=torch.tensor(group_of, dtype=torch.long),
        groups=groups,
        routing=torch.cat(routing) if routing else None,
    )
    return batch, filtered, stats


def sample_routing(pieces: List[torch.Tensor], length: int) -> torch.Tensor:
    """An episode's routing [length, layers, k] from its turns' pieces: cut to its tokens, and its last token (never
    an input of the engine) given the experts of the token before it."""
    routing = torch.cat(pieces)[:length]
    return torch.cat([routing, routing[-1:].expand(length - routing.shape[0], -1, -1)])


def evaluate(engine: Engine, env: Environment, tokenizer, tasks: Sequence[Task], env_cfg: EnvConfig,
             pool: Optional[EnvPool] = None) -> float:
    """Mean reward of greedy episodes of `tasks` (environment calls inline unless a pool is given)."""
    pool = pool if pool is not None else EnvPool(env_cfg, processes=0, env=env)
    eps = episodes(engine, env, pool, tokenizer, tasks, 1, 1.0, env_cfg, greedy=True)
    rewards = [g[0].reward for g in eps]
    return sum(rewards) / len(rewards)


def evaluator(model: torch.nn.Module, tokenizer) -> Callable[[Environment, Sequence[Task], EnvConfig], float]:
    """A transformers engine over `model`, made once, and `evaluate` through it: the warm start's evaluator
    (rlhpc/train/warmstart.py), which the trainer's role passes in, so that the trainer's folder never imports
    inference."""
    engine = HFEngine(model, tokenizer.pad_token_id)
    return lambda env, tasks, env_cfg: evaluate(engine, env, tokenizer, tasks, env_cfg)
