"""The inference worker role: an engine, its environment, and a loop that keeps the queue supplied.

Loop: take the newest weights received; if the queue already holds enough fresh groups, or these weights are too old
for the step that would consume what we generate now, wait (never spin); otherwise generate a batch of groups, score
them, compute advantages and publish one queue file.
"""

from __future__ import annotations

import logging
import time
from itertools import islice
from typing import Optional

import torch

from rlhpc import env as env_mod
from rlhpc import models
from rlhpc.config import Config
from rlhpc.engines import make_engine
from rlhpc.metrics import Metrics
from rlhpc.queue import Queue
from rlhpc.role import Identity
from rlhpc.rollout import generate_groups
from rlhpc.rundir import RunDir, read_json, wait_for
from rlhpc.weights import BroadcastReceiver, FilesystemReceiver, WeightsReceiver

log = logging.getLogger(__name__)


def run_worker(cfg: Config, ident: Identity, run: RunDir) -> None:
    torch.set_num_threads(cfg.inference.threads)
    rank = ident.rank
    ready = run.model / "READY"
    wait_for(ready.exists, cfg.inference.startup_timeout_s, f"{ready} (the trainer's warm start)", poll_s=0.5,
             abort=lambda: _failed(run))
    tokenizer = models.load_tokenizer(run.model)
    engine = make_engine(cfg.inference.engine, str(run.model), cfg.model.dtype, cfg=cfg.inference, run_dir=str(run.root))
    env = env_mod.load(cfg.env)
    tasks = env.tasks("train", seed=cfg.seed * 1000 + 17 + rank)
    queue = Queue(run.queue)
    receiver = make_receiver(cfg, ident, run)
    metrics = Metrics(run, "inference", rank)
    producer = f"w{rank}a{ident.attempt}"
    version, seq = 0, 0
    per_step = cfg.trainer.groups_per_step
    waited = 0.0
    t_last = time.time()
    while not run.done.exists():
        update = receiver.poll()
        if update is not None:
            engine.update_weights(update.tensors)
            version = update.version
        if receiver.closed():
            break
        progress = queue.progress()
        pending_groups = len(queue.pending_files()) * cfg.inference.groups_per_batch
        # The step that will consume what is generated now, and the oldest version that step accepts.
        target = progress["claimed"] + pending_groups // per_step
        if pending_groups >= cfg.queue.max_pending_steps * per_step or version < target - cfg.async_level:
            time.sleep(0.01)
            waited += 0.01
            if time.time() - t_last > cfg.weights.timeout_s:
                raise TimeoutError(f"inference worker {rank}: no progress for weights.timeout_s={cfg.weights.timeout_s:.0f}s "
                                   f"(weights version {version}, trainer claimed {progress['claimed']} steps)")
            continue
        t0 = time.time()
        batch = generate_groups(engine, env, tokenizer, list(islice(tasks, cfg.inference.groups_per_batch)), cfg.algo,
                                cfg.env.max_new_tokens, version)
        gen_s = time.time() - t0
        queue.publish(batch, producer, seq)
        rewards = [r for g in batch.groups for r in g.rewards]
        completion = int(batch.loss_mask.sum())
        metrics.log(seq, {
            "rollout/reward": sum(rewards) / len(rewards),
            "perf/generate_s": gen_s,
            "perf/tokens_per_s": completion / gen_s,
            "perf/idle_s": waited,
            "weights/version": version,
            "queue/pending_groups": pending_groups,
        })
        run.heartbeat("inference", rank, version=version, published=seq + 1)
        seq += 1
        waited = 0.0
        t_last = time.time()
    log.info("worker %d done after %d batches (weights version %d)", rank, seq, version)
    metrics.close()
    receiver.close()
    engine.close()


def make_receiver(cfg: Config, ident: Identity, run: RunDir) -> WeightsReceiver:
    if cfg.weights.transport == "filesystem":
        return FilesystemReceiver(run, version=0)
    return BroadcastReceiver(run, ident.rank + 1, cfg.weights.timeout_s, ident.attempt)


def _failed(run: RunDir) -> Optional[str]:
    info = read_json(run.failed)
    return f"{info['role']} rank {info['rank']} failed: {info['error']}" if info else None
