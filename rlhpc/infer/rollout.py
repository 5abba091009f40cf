"""From tasks to rollout groups: prompt, generate a group per task, reward, compute advantages, pack.

Shared by the inference worker (training rollouts) and held-out evaluation.
"""

from __future__ import annotations

import uuid
from typing import List, Optional, Sequence, Tuple

import torch

from rlhpc.algo.advantage import group_advantages, keep_group
from rlhpc.config import AlgoConfig
from rlhpc.infer.engines import Engine
from rlhpc.env import Environment, Task
from rlhpc.transport.queue import Group, RolloutBatch


def prompt_ids(tokenizer, env: Environment, task: Task) -> List[int]:
    ids = tokenizer.apply_chat_template(env.messages(task), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def stop_ids(tokenizer) -> List[int]:
    return [tokenizer.eos_token_id]


def generate_groups(
    engine: Engine, env: Environment, tokenizer, tasks: Sequence[Task], algo: AlgoConfig, max_new_tokens: int, version: int
) -> Tuple[Optional[RolloutBatch], int]:
    """A batch with one group per task, and how many groups dynamic sampling filtered out (None if all were)."""
    prompts = [prompt_ids(tokenizer, env, t) for t in tasks]
    outs = engine.generate(prompts, algo.group_size, algo.temperature, max_new_tokens, stop_ids(tokenizer))
    tokens, logprobs, mask, advantages, group_of, lengths = [], [], [], [], [], []
    groups: List[Group] = []
    filtered = 0
    for task, prompt, comps in zip(tasks, prompts, outs):
        rewards = torch.tensor([env.reward(task, tokenizer.decode(c.tokens, skip_special_tokens=True)) for c in comps])
        if not keep_group(rewards, algo):  # no reward variance: no learning signal (DAPO dynamic sampling)
            filtered += 1
            continue
        gi = len(groups)
        adv = group_advantages(rewards, torch.tensor([len(c.tokens) for c in comps]), algo, max_new_tokens)
        for c, a in zip(comps, adv.tolist()):
            tokens.append(torch.as_tensor(prompt + c.tokens, dtype=torch.long))
            logprobs.append(torch.cat([torch.zeros(len(prompt)), torch.as_tensor(c.logprobs, dtype=torch.float32)]))
            mask.append(torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(c.tokens), dtype=torch.bool)]))
            advantages.append(a)
            group_of.append(gi)
            lengths.append(len(prompt) + len(c.tokens))
        groups.append(
            Group(
                uid=uuid.uuid4().hex,
                env=env.name,
                task_id=task.id,
                # With in-flight updates (vLLM) a completion knows the versions that produced it.
                version=max(getattr(c, "max_version", None) or version for c in comps),
                num_samples=len(comps),
                rewards=rewards.tolist(),
                truncated=[c.finish_reason == "length" for c in comps],
                min_version=min(getattr(c, "min_version", None) if getattr(c, "min_version", None) is not None
                                else version for c in comps),
                extra={"completion_tokens": [len(c.tokens) for c in comps]},
            )
        )
    if not groups:
        return None, filtered
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
    )
    return batch, filtered


def evaluate(engine: Engine, env: Environment, tokenizer, tasks: Sequence[Task], max_new_tokens: int) -> float:
    """Mean reward of greedy answers to `tasks`."""
    prompts = [prompt_ids(tokenizer, env, t) for t in tasks]
    outs = engine.generate(prompts, 1, 1.0, max_new_tokens, stop_ids(tokenizer), greedy=True)
    rewards = [env.reward(t, tokenizer.decode(o[0].tokens, skip_special_tokens=True)) for t, o in zip(tasks, outs)]
    return sum(rewards) / len(rewards)
