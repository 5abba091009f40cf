"""Supervised fine-tuning on reference answers: the warm start before RL (standalone: `python -m rlhpc.sft`)."""

from __future__ import annotations

import logging
from itertools import islice
from typing import Callable, List, Optional

import torch

from rlhpc.train.batching import pad, token_logprobs
from rlhpc.config import Config
from rlhpc.env import Environment
from rlhpc.infer.rollout import prompt_ids
from rlhpc.train.optim import make_optimizer

log = logging.getLogger(__name__)


def validation_reward(model: torch.nn.Module, tokenizer, env: Environment, cfg: Config) -> float:
    """Greedy reward on fixed train-distribution tasks (a validation set; the held-out eval set is never used here)."""
    from rlhpc.infer.engines.hf import HFEngine
    from rlhpc.infer.rollout import evaluate

    tasks = list(islice(env.tasks("train", seed=cfg.seed + 104729), cfg.sft.validation_tasks))
    return evaluate(HFEngine(model, tokenizer.pad_token_id), env, tokenizer, tasks, cfg.env.max_new_tokens)


def sft_train(
    model: torch.nn.Module,
    tokenizer,
    env: Environment,
    cfg: Config,
    on_step: Optional[Callable[[int, float], None]] = None,
    on_check: Optional[Callable[[int, float], None]] = None,
) -> List[float]:
    """Trains on (prompt, reference answer) pairs for `cfg.sft.steps` steps, or until the validation reward reaches
    `cfg.sft.stop_at_reward` (a warm start to partial competence); returns the loss of each step."""
    sft = cfg.sft
    opt = make_optimizer(model.parameters(), sft.optim)
    tasks = env.tasks("train", seed=cfg.seed + 7919)
    eos = tokenizer.eos_token_id
    losses = []
    model.train()
    for step in range(sft.steps):
        seqs, masks = [], []
        for task in islice(tasks, sft.batch_size):
            p = prompt_ids(tokenizer, env, task)
            a = tokenizer(env.reference(task), add_special_tokens=False)["input_ids"] + [eos]
            seqs.append(torch.tensor(p + a))
            masks.append(torch.tensor([0] * len(p) + [1] * len(a), dtype=torch.bool))
        ids, attn = pad(seqs, tokenizer.pad_token_id)
        target_mask, _ = pad(masks, 0)
        logp, _ = token_logprobs(model, ids, attn, chunk_tokens=cfg.trainer.logprob_chunk_tokens)
        m = target_mask[:, 1:].float()
        loss = -(logp * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), sft.optim.max_grad_norm)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, loss.item())
        if sft.stop_at_reward > 0 and (step + 1) % sft.check_interval == 0:
            reward = validation_reward(model, tokenizer, env, cfg)
            model.train()
            if on_check is not None:
                on_check(step + 1, reward)
            if reward >= sft.stop_at_reward:
                log.info("SFT stops after %d steps: validation reward %.3f >= sft.stop_at_reward", step + 1, reward)
                break
    return losses
