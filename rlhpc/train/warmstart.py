"""Supervised fine-tuning on reference answers: the warm start before RL (standalone: `python -m rlhpc.sft`).

Before RL, trainer rank 0 makes run_dir/model, the Hugging Face folder RL starts from, and marks it READY with the
warm start's results; the other ranks wait for it. A relaunched run finds READY and warm-starts no more. The warm start
evaluates on its own model (the held-out reward before and after SFT; the latter is the curve's version 0 in
run_dir/evals/) and lets that model go before RL builds its own.

A warm start saves its state every `sft.save_interval` steps, and when asked to stop (a preemption, a time limit,
Ctrl-C) after the step it is in, in run_dir/sft_state/: the model, the optimizer, the steps done and their losses,
the held-out reward before SFT. The requeued or relaunched run goes on from there and trains exactly what an
uninterrupted one would have (the task stream is deterministic and skipped to the step; SFT samples nothing).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import time
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlhpc.config.schema import Config, EnvConfig
from rlhpc.env import Environment, Task
from rlhpc.env.episode import Renderer
from rlhpc.modeling import models
from rlhpc.run import cores
from rlhpc.run.evaluation import heldout_tasks, write_result
from rlhpc.run.metrics import Metrics
from rlhpc.run.rundir import RunDir, read_json, wait_for, write_json
from rlhpc.run.stop import Stop, stop_requested
from rlhpc.train.batching import pad, token_logprobs
from rlhpc.train.optim import make_optimizer

log = logging.getLogger(__name__)


# How the warm start measures a model: `evaluator(model, tokenizer)` makes an engine over the model once and returns
# `reward(env, tasks, env_cfg)`, the greedy reward on tasks through it. The trainer's role passes
# rlhpc.infer.rollout.evaluator (rlhpc/role.py): the trainer's folder never imports inference.
Evaluator = Callable[[torch.nn.Module, Any], Callable[[Environment, Sequence[Task], EnvConfig], float]]


def start_model(cfg: Config, run: RunDir, env: Environment, metrics: Optional[Metrics], rank: int,
                evaluator: Optional[Evaluator] = None) -> Dict:
    """Rank 0 makes run_dir/model (the HF folder RL starts from); other ranks wait for it. Returns the warm start's
    results (the run's summary so far); raises Stop when asked to stop meanwhile."""
    ready = run.model / "READY"
    if rank == 0 and not ready.exists():
        threads = cores.warm_start_threads(cfg)
        log.info("warm start on %d thread(s)", threads)
        with cores.threads(threads):
            write_json(ready, warm_start(cfg, run, env, metrics, rank, evaluator))

    def abort() -> Optional[str]:
        if stop_requested():
            raise Stop(stop_requested())
        return run.failure()

    wait_for(ready.exists, cfg.inference.startup_timeout_s, f"{ready} (the SFT warm start on trainer rank 0)",
             abort=abort)
    return read_json(ready)


def warm_start(cfg: Config, run: RunDir, env: Environment, metrics: Metrics, rank: int,
               evaluator: Optional[Evaluator] = None) -> Dict:
    """SFT from the base model (built from `model` when `model.path` is empty) into run_dir/model, or on from the state
    a stopped warm start saved (run_dir/sft_state); the held-out reward before and after, and the SFT steps and time.
    Raises Stop, after saving that state, when asked to stop. `evaluator` measures the held-out reward (needed when
    sft.steps > 0)."""
    base = cfg.model.path or str(models.build(cfg.model, run.root / "base_model"))
    if cfg.sft.steps == 0:
        # Nothing to train: RL starts from the base checkpoint's files as they are, and no full model is loaded
        # here; inference worker 0 measures the starting held-out reward (version 0) with its engine.
        models.copy_checkpoint(base, run.model)
        return {"sft_steps": 0, "sft_wall_time_s": 0.0}
    if evaluator is None:
        raise ValueError("a warm start with sft.steps > 0 measures the held-out reward: pass its evaluator "
                         "(rlhpc.infer.rollout.evaluator)")
    saved = load_state(run.sft_state)
    model = models.load_model(str(run.sft_state / "model") if saved else base, cfg.model.dtype)
    tok = models.load_tokenizer(base)
    reward = evaluator(model, tok)
    tasks = heldout_tasks(env, cfg)
    if saved:
        out: Dict = {"heldout_reward_base": saved["heldout_reward_base"]}
        log.info("warm start: going on from SFT step %d (%s)", saved["step"], run.sft_state)
    else:
        out = {"heldout_reward_base": reward(env, tasks, cfg.env)}
    t0 = time.time() - (saved["wall_time_s"] if saved else 0.0)
    metrics.resumed("sft", saved["step"] if saved else 0)  # what an earlier attempt logged past it is trained again

    last_beat = 0.0

    def on_step(s: int, loss: float) -> None:
        nonlocal last_beat
        metrics.log(s + 1, {"sft/loss": loss})
        if time.time() - last_beat >= 1.0:  # the progress bar's: at most one a second, whatever a step takes
            run.heartbeat("trainer", rank, phase="sft", sft_step=s + 1, sft_steps=cfg.sft.steps, loss=loss)
            last_beat = time.time()

    def on_check(s: int, reward: float) -> None:
        metrics.log(s, {"sft/validation_reward": reward})

    def on_save(steps: int, optimizer: torch.optim.Optimizer, losses: List[float], model=model) -> None:
        save_state(run.sft_state, model, optimizer, {"step": steps, "losses": losses, "wall_time_s": time.time() - t0,
                                                     "heldout_reward_base": out["heldout_reward_base"]})
        if stop_requested():
            log.warning("stop requested (%s) during the warm start: saved after SFT step %d in %s; the requeued run "
                        "goes on from there", stop_requested(), steps, run.sft_state)

    resume = (saved["step"], torch.load(run.sft_state / "optimizer.pt"), saved["losses"]) if saved else None
    losses = sft_train(model, tok, env, cfg, on_step=on_step, on_check=on_check, on_save=on_save, resume=resume,
                       evaluator=evaluator)
    out["sft_steps"] = len(losses)
    out["heldout_reward_sft"] = reward(env, tasks, cfg.env)
    out["sft_wall_time_s"] = time.time() - t0
    log.info("warm start: held-out reward %.3f -> %.3f after %d SFT steps (%.1fs)", out["heldout_reward_base"],
             out["heldout_reward_sft"], out["sft_steps"], out["sft_wall_time_s"])
    model.save_pretrained(run.model)
    tok.save_pretrained(run.model)
    write_result(run, 0, out["heldout_reward_sft"], len(tasks))
    shutil.rmtree(run.sft_state, ignore_errors=True)  # READY, written next, supersedes it
    # RL builds its own (possibly sharded) model: this whole copy and its evaluation engine go now, not at exit, with
    # what the environment held for these evaluations (a verifiers endpoint over this engine, its episode processes).
    env.close()
    del reward, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def save_state(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """The state of a stopped warm start, written beside `folder` and renamed over it: a crash while saving leaves
    the previous state (or none), never half of one."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    write_json(tmp / "state.json", state)
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def load_state(folder: Path) -> Optional[Dict[str, Any]]:
    """The saved state of a stopped warm start (state.json), or None when there is none to go on from. A save killed
    between its two renames left the previous state as <folder>.old: it is put back first."""
    old = folder.with_name(folder.name + ".old")
    if old.exists() and not folder.exists():
        os.replace(old, folder)
    try:
        state = read_json(folder / "state.json")
    except ValueError:
        state = None
    if not state:
        return None
    if not (folder / "optimizer.pt").exists():
        log.warning("%s has no optimizer.pt: the warm start begins anew", folder)
        return None
    return state


def validation_reward(model: torch.nn.Module, tokenizer, env: Environment, cfg: Config,
                      evaluator: Evaluator) -> float:
    """Greedy reward on fixed train-distribution tasks (a validation set; the held-out eval set is never used here)."""
    tasks = list(islice(env.tasks("train", seed=cfg.seed + 104729), cfg.sft.validation_tasks))
    return evaluator(model, tokenizer)(env, tasks, cfg.env)


def reference_tokens(renderer: Renderer, tokenizer, env: Environment, task) -> Tuple[List[int], List[int]]:
    """Token ids of a task's reference episode and its loss mask (1 on the assistant's tokens), laid out exactly as
    an RL episode lays them out (rlhpc.env.episode): each assistant turn ends with the stop token, the environment's
    replies are rendered by the chat template after it."""
    history = list(env.messages(task))
    ids = renderer.prompt(history)
    mask = [0] * len(ids)
    ref = env.reference(task)
    turns = [{"role": "assistant", "content": ref}] if isinstance(ref, str) else list(ref)
    i = 0
    while i < len(turns):
        if turns[i]["role"] != "assistant":
            raise ValueError(f"environment {env.name}: reference of task {task.id} must alternate assistant turns and "
                             f"environment replies, starting with an assistant turn")
        answer = tokenizer(turns[i]["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += answer
        mask += [1] * len(answer)
        history.append(turns[i])
        j = i + 1
        while j < len(turns) and turns[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            reply = renderer.reply(history, True, turns[i + 1:j])
            ids += reply
            mask += [0] * len(reply)
            history += turns[i + 1:j]
        i = j
    return ids, mask


def sft_train(
    model: torch.nn.Module,
    tokenizer,
    env: Environment,
    cfg: Config,
    on_step: Optional[Callable[[int, float], None]] = None,
    on_check: Optional[Callable[[int, float], None]] = None,
    on_save: Optional[Callable[[int, torch.optim.Optimizer, List[float]], None]] = None,
    resume: Optional[Tuple[int, Dict[str, Any], List[float]]] = None,
    evaluator: Optional[Evaluator] = None,
) -> List[float]:
    """Trains on (prompt, reference answer) pairs for `cfg.sft.steps` steps, or until the validation reward reaches
    `cfg.sft.stop_at_reward` (a warm start to partial competence); returns the loss of each step.

    With `on_save`, `on_save(steps done, optimizer, losses)` saves them every `cfg.sft.save_interval` steps, and after
    the step a stop request comes in, before Stop is raised. `resume`: (steps done, the optimizer's state, their
    losses) of such a save, to go on from, with the model as it was saved. `evaluator` measures the validation reward
    (needed with sft.stop_at_reward)."""
    sft = cfg.sft
    if sft.stop_at_reward > 0 and evaluator is None:
        raise ValueError("sft.stop_at_reward checks a validation reward: pass sft_train its evaluator "
                         "(rlhpc.infer.rollout.evaluator)")
    opt = make_optimizer(model.parameters(), sft.optim)
    tasks = env.tasks("train", seed=cfg.seed + 7919)
    renderer = Renderer(tokenizer, [t.schema() for t in env.tools()])
    done, losses = 0, []
    if resume is not None:
        done, state, losses = resume
        opt.load_state_dict(state)
        for _ in islice(tasks, done * sft.batch_size):  # the tasks of the steps done
            pass
        losses = list(losses)
    model.train()
    for step in range(done, sft.steps):
        seqs, masks = [], []
        for task in islice(tasks, sft.batch_size):
            ids, mask = reference_tokens(renderer, tokenizer, env, task)
            seqs.append(torch.tensor(ids))
            masks.append(torch.tensor(mask, dtype=torch.bool))
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
            reward = validation_reward(model, tokenizer, env, cfg, evaluator)
            model.train()
            if on_check is not None:
                on_check(step + 1, reward)
            if reward >= sft.stop_at_reward:
                log.info("SFT stops after %d steps: validation reward %.3f >= sft.stop_at_reward", step + 1, reward)
                break
        if on_save is None or step + 1 == sft.steps:
            continue
        if stop_requested() or (sft.save_interval and (step + 1) % sft.save_interval == 0):
            on_save(step + 1, opt, losses)
        if stop_requested():
            raise Stop(stop_requested())
    return losses
