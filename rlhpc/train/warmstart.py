"""Supervised fine-tuning: the warm start before RL, also runnable on its own.

    python -m rlhpc.sft +exp=reverse_text run_dir=runs/sft-only     # trains, evaluates, exports to run_dir/model
"""

from __future__ import annotations

import logging
import random
import time
from itertools import islice
from typing import Callable, List, Optional

import torch

from rlhpc.batching import pad, token_logprobs
from rlhpc.config import Config
from rlhpc.env import Environment
from rlhpc.rollout import prompt_ids

log = logging.getLogger(__name__)


def make_optimizer(params, optim) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay)


def validation_reward(model: torch.nn.Module, tokenizer, env: Environment, cfg: Config) -> float:
    """Greedy reward on fixed train-distribution tasks (a validation set; the held-out eval set is never used here)."""
    from rlhpc.engines.hf import HFEngine
    from rlhpc.rollout import evaluate

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


def main() -> None:
    """Standalone SFT: build or load the model, train, evaluate greedy held-out reward, export in HF format."""
    import hydra

    from rlhpc import config as config_mod
    from rlhpc import env as env_mod
    from rlhpc import models
    from rlhpc.engines.hf import HFEngine
    from rlhpc.launch import CONF_DIR, prepare_run_dir
    from rlhpc.rollout import evaluate
    from rlhpc.rundir import RunDir, write_json

    config_mod.register()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def _run(dcfg) -> None:
        cfg = config_mod.to_typed(dcfg)
        config_mod.validate(cfg)
        run = prepare_run_dir(cfg)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s sft %(levelname)s: %(message)s", force=True)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        base = cfg.model.path or str(models.build(cfg.model, run.root / "base_model"))
        model, tok = models.load_model(base, cfg.model.dtype), models.load_tokenizer(base)
        env = env_mod.load(cfg.env)
        eval_tasks = list(islice(env.tasks("eval", 0), cfg.eval.num_tasks))
        engine = HFEngine(model, tok.pad_token_id)
        before = evaluate(engine, env, tok, eval_tasks, cfg.env.max_new_tokens)
        t0 = time.time()
        losses = sft_train(model, tok, env, cfg, on_step=lambda s, l: s % 50 == 0 and log.info("sft step %d loss %.4f", s, l))
        after = evaluate(engine, env, tok, eval_tasks, cfg.env.max_new_tokens)
        model.save_pretrained(run.model)
        tok.save_pretrained(run.model)
        out = {"heldout_reward_before": before, "heldout_reward_sft": after, "sft_steps": len(losses),
               "wall_time_s": time.time() - t0, "model": str(run.model)}
        write_json(RunDir(run.root).summary, out)
        print(f"SFT: held-out reward {before:.3f} -> {after:.3f} in {out['wall_time_s']:.0f}s; model in {run.model}")

    _run()


if __name__ == "__main__":
    main()
