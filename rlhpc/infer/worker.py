"""The inference worker role: an engine, its environment, and a loop that keeps the queue supplied.

Loop: take the newest weights received; if the queue already holds enough fresh groups, or these weights are too old
for the step that would consume what we generate now, wait (never spin); otherwise generate a batch of groups, score
them, compute advantages and publish one queue file. Worker 0 also measures the held-out reward of the weights it
serves when an evaluation is owed (rlhpc/run/evaluation.py), between two generations.
"""

from __future__ import annotations

import contextlib
import logging
import time
from itertools import islice
from typing import Optional

import torch

from rlhpc import env as env_mod
from rlhpc.config.schema import Config
from rlhpc.env.pool import EnvPool
from rlhpc.infer.engines import make_engine
from rlhpc.infer.follower import leading
from rlhpc.infer.rollout import evaluate, generate_groups
from rlhpc.modeling import models
from rlhpc.run import cores
from rlhpc.run.evaluation import eval_owed, heldout_tasks, read_curve, write_result
from rlhpc.run.identity import Identity
from rlhpc.run.metrics import Metrics
from rlhpc.run.rundir import Backoff, RunDir, wait_for
from rlhpc.run.stop import Stop, stop_requested
from rlhpc.transport.queue import Queue
from rlhpc.transport.weights import (BroadcastReceiver, FilesystemReceiver, WeightsReceiver, latest_snapshot,
                                    load_snapshot)

log = logging.getLogger(__name__)


def run_worker(cfg: Config, ident: Identity, run: RunDir) -> None:
    try:
        _run_worker(cfg, ident, run)
    except Stop as e:  # asked to stop while waiting (preemption, Ctrl-C): nothing of ours is lost
        log.warning("worker %d stopped while waiting: %s", ident.rank, e)


def _run_worker(cfg: Config, ident: Identity, run: RunDir) -> None:
    torch.set_num_threads(cfg.inference.threads)
    rank = ident.rank
    ready = run.model / "READY"
    wait_for(ready.exists, cfg.inference.startup_timeout_s, f"{ready} (the trainer's warm start)", poll_s=0.5,
             abort=lambda: _failed(run))
    tokenizer = models.load_tokenizer(run.model)
    seed = cfg.seed * 1000 + rank
    with leading(cfg, ident, run, str(run.model), seed) as instance:  # one instance over several nodes: follower.py
        engine = make_engine(cfg.inference.engine, str(run.model), cfg.model.dtype, cfg.trainer.router_replay,
                             cfg=instance.inference, run_dir=str(run.root), seed=seed)
        instance.started()
        _run_engine(cfg, ident, run, engine, tokenizer)


def _run_engine(cfg: Config, ident: Identity, run: RunDir, engine, tokenizer) -> None:
    """Runs the worker's loop on `engine`, and closes the engine (its processes, with vLLM) however the loop ends,
    also when the environment cannot be loaded or its pool cannot start."""
    pool = server = env = None
    try:
        env = env_mod.load(cfg.env)
        pool = EnvPool(cfg.env)  # rewards, tools and replies run here, beside generation
        if cfg.inference.serve:  # the policy over HTTP (docs/serving.md); its clients and the loop take turns
            from rlhpc.infer.server import serve_worker

            server = serve_worker(cfg, ident, run, engine)
            engine = server.engine
        _loop(cfg, ident, run, engine, env, pool, tokenizer)
    finally:
        if server is not None:
            server.close()
        if pool is not None:
            pool.close()
        if env is not None:
            env.close()
        engine.close()


def _loop(cfg: Config, ident: Identity, run: RunDir, engine, env, pool: EnvPool, tokenizer) -> None:
    rank = ident.rank
    # A restarted worker draws other tasks than its first life did.
    tasks = env.tasks("train", seed=cfg.seed * 1000 + 17 + rank + 7919 * ident.restart)
    queue = Queue(run.queue, lease_s=cfg.queue.lease_s)
    receiver = make_receiver(cfg, ident, run, engine)
    # weights.receive=in_place: the receiver loads updates straight into the engine, whenever the loop does not hold
    # the gate (around every use of the engine); no in-flight updates then.
    gate = receiver.gate or contextlib.nullcontext()
    if getattr(engine, "supports_inflight_updates", False) and cfg.inference.inflight_updates and receiver.gate is None:
        engine.weight_updates = receiver.poll  # vLLM swaps weights between decode steps of a long generation
    metrics = Metrics(run, "inference", rank, cfg)
    idle, borrower = _lending(cfg, run, rank, engine)
    # The first worker of the launch evaluates; restarted ones take over what is not evaluated yet, attached ones never.
    heldout = HeldoutEval(cfg, run, env, pool, tokenizer) if rank == 0 and not ident.attached else None
    producer = f"w{rank}a{ident.attempt}" + (f"r{ident.restart}" if ident.restart else "")  # unique file names
    version, seq = 0, 0
    per_step = cfg.trainer.groups_per_step
    waited = 0.0
    filtered_total = 0
    env_totals: dict = {}
    t_last = time.time()
    # Waits back off up to queue.poll_max_s: a few metadata operations per look, so a bounded rate per worker.
    backoff, seen = Backoff(cfg.queue.poll_max_s), None
    while not run.done.exists() and not stop_requested():
        update = receiver.poll()
        if update is not None:
            if update.tensors is not None:  # (None: loaded in place already)
                engine.update_weights(update.tensors)
            version = engine.version = update.version  # labels the tokens generated from now on
        if receiver.torn:  # an in-place update failed part way: wait for a whole one
            waited += receiver.wait(backoff.next())
            _check_idle(cfg, rank, t_last, version, "its weights are part-loaded (weights.receive=in_place)")
            continue
        with gate:
            if heldout is not None:
                heldout(engine, version, metrics)
        if receiver.closed():
            break
        # Groups being generated by other workers, published, and in the claim being filled, read in the order a
        # batch moves through them: a batch that moves on between two reads is counted twice for one look (a short
        # wait), never missed (a batch for a step already covered: with async_level=0, dropped as too old).
        queued = queue.inflight_batches(exclude=producer)
        queued += queue.pending_count()
        progress = queue.progress()
        if cfg.weights.transport == "broadcast" and version < progress["version"]:
            with gate:
                version = _catch_up(run, engine, version, progress["version"])
        pending_groups = queued * cfg.inference.groups_per_batch + progress.get("claiming", 0)
        if (progress["claimed"], version) != seen:  # the run moved: the idle clock starts again
            seen, t_last = (progress["claimed"], version), time.time()
        if back_pressure(pending_groups, progress["claimed"], version, per_step, cfg.queue.max_pending_steps,
                         cfg.async_level) is not None:
            if borrower is not None:
                borrower.release()
            idle.set(True)  # back-pressure: the trainer may use this worker's threads meanwhile
            waited += receiver.wait(backoff.next())  # new weights end the wait early
            _check_idle(cfg, rank, t_last, version, f"trainer claimed {progress['claimed']} steps")
            continue
        backoff.reset()
        idle.set(False)
        t0 = time.time()
        queue.begin_batch(producer)
        try:
            with gate:
                batch, filtered, env_stats = generate_groups(engine, env, pool, tokenizer,
                                                             list(islice(tasks, cfg.inference.groups_per_batch)),
                                                             cfg.algo, cfg.env, version)
            if batch is not None:  # a file may hold fewer groups than asked when dynamic sampling filtered some
                queue.publish(batch, producer, seq)
        finally:
            queue.end_batch(producer)
        gen_s = time.time() - t0
        version = getattr(engine, "version", version)  # updates that landed during the generation (vLLM)
        filtered_total += filtered
        for k, v in env_stats.items():
            env_totals[k] = env_totals.get(k, 0) + v if k != "env/turns" else v
        if batch is None:
            continue
        rewards = [r for g in batch.groups for r in g.rewards]
        completion = int(batch.loss_mask.sum())
        metrics.log(seq, {
            "rollout/filtered_groups": filtered_total,
            "rollout/reward": sum(rewards) / len(rewards),
            "perf/generate_s": gen_s,
            "perf/tokens_per_s": completion / gen_s,
            "perf/idle_s": waited,
            **({"perf/borrowed_threads_s": borrower.take_borrowed_s()} if borrower is not None else {}),
            "weights/version": version,
            "queue/pending_groups": pending_groups,
            **env_totals,
        })
        run.heartbeat("inference", rank, version=version, published=seq + 1)
        seq += 1
        waited = 0.0
        t_last = time.time()
    idle.set(False)
    if receiver.closed() and not run.done.exists() and not stop_requested():
        log.info("the trainer stopped before the run was done (it checkpointed: a stop, a requeue) and closed the "
                 "weights group; leaving")
    log.info("worker %d done after %d batches (weights version %d)", rank, seq, version)
    metrics.close()
    receiver.close()


def back_pressure(pending_groups: int, claimed: int, version: int, per_step: int, max_pending_steps: int,
                  async_level: int) -> Optional[str]:
    """Why a worker waits instead of generating now, or None when it generates. `pending_groups`: the groups ahead of
    what it would generate (other workers' batches in flight, published files, the claim being filled); `claimed`:
    the steps the trainer has claimed; `version`: the worker's weights. Enough is queued once it covers
    `max_pending_steps` steps (queue.max_pending_steps); and what it generates now feeds step claimed + pending //
    per_step, which trains only on groups of weights at least that step - async_level."""
    if pending_groups >= max_pending_steps * per_step:
        return f"{pending_groups} groups queued: queue.max_pending_steps={max_pending_steps} steps of them"
    target = claimed + pending_groups // per_step
    if version < target - async_level:
        return f"weights version {version} is too old for step {target} (async_level={async_level})"
    return None


def _lending(cfg: Config, run: RunDir, rank: int, engine):
    """This worker's idle mark, and the borrower of the trainer's threads while it waits for rollouts (the
    transformers engine on the CPU only: vLLM runs its own threads), on one machine (rlhpc/run/cores.py)."""
    lend = cores.enabled(cfg)
    idle = cores.Idle(run, "inference", rank, cfg.inference.threads, enabled=lend)
    model = getattr(engine, "model", None)
    if not (lend and isinstance(model, torch.nn.Module) and next(model.parameters()).device.type == "cpu"):
        return idle, None
    borrower = cores.Borrower(run, "trainer", cfg.inference.threads, borrowers=cfg.inference.num_workers)
    borrower.attach(model)
    return idle, borrower


def _check_idle(cfg: Config, rank: int, t_last: float, version: int, why: str) -> None:
    idle = cfg.inference.idle_timeout_s
    if idle and time.time() - t_last > idle:
        raise TimeoutError(f"inference worker {rank}: nothing moved for inference.idle_timeout_s={idle:.0f}s "
                           f"(weights version {version}, {why})")


class HeldoutEval:
    """Worker 0's held-out evaluation: greedy reward on the held-out tasks with this worker's engine, for each weights
    version owed one (the schedule and the record: rlhpc/run/evaluation.py), written to run_dir/evals/."""

    def __init__(self, cfg: Config, run: RunDir, env, pool: EnvPool, tokenizer):
        self.cfg, self.run, self.env, self.pool, self.tokenizer = cfg, run, env, pool, tokenizer
        self.tasks = heldout_tasks(env, cfg)
        self.checked: Optional[int] = None  # the version last looked at: the record is read once per version
        self.evaluated = False  # in this life of the worker

    def __call__(self, engine, version: int, metrics: Metrics) -> None:
        if version == self.checked:
            return
        self.checked = version
        # What is recorded already (by the warm start, or by this worker's previous life).
        done = [v for v, _ in read_curve(self.run) if v <= version]
        if not eval_owed(self.cfg, version, done[-1] if done else None):
            return
        # The whole evaluation on one version: no weights land in the middle of it (vLLM in-flight updates).
        inflight = getattr(engine, "weight_updates", None)
        if inflight is not None:
            engine.weight_updates = None
        t0 = time.time()
        try:
            reward = evaluate(engine, self.env, self.tokenizer, self.tasks, self.cfg.env, pool=self.pool)
        finally:
            if inflight is not None:
                engine.weight_updates = inflight
        eval_s = time.time() - t0
        if not self.evaluated and metrics.relaunched:
            # TensorBoard hides what an earlier life showed past the last result on record: results of versions that
            # a run resumed from an older checkpoint trains again (rlhpc/run/evaluation.py discards their files;
            # the trainer does so before it publishes weights, so before this version reached the worker).
            metrics.purge_after("eval", done[-1] if done else -1)
        self.evaluated = True
        write_result(self.run, version, reward, len(self.tasks))
        # The trackers only, against the weights version; the metrics rows stay one per generated batch.
        metrics.scalars(version, {"eval/heldout_reward": reward, "eval/time_s": eval_s}, phase="eval")
        log.info("weights version %d: held-out reward %.3f (%d tasks, %.1fs)", version, reward, len(self.tasks), eval_s)


def _catch_up(run: RunDir, engine, version: int, published: int) -> int:
    """Broadcast transport: a worker behind the trainer's newest version that no update will bring (it joined after
    the last one) takes the newest snapshot up to that version (the trainer writes the final version to disk too);
    returns the version the engine now holds."""
    v = latest_snapshot(run)
    if v is None or not version < v <= published:
        return version
    try:
        engine.update_weights(load_snapshot(run, v))
    except FileNotFoundError:  # replaced while reading: the next look takes the newer one
        return version
    log.info("took weights version %d from its snapshot (no update will bring it)", v)
    engine.version = v
    return v


def make_receiver(cfg: Config, ident: Identity, run: RunDir, engine) -> WeightsReceiver:
    if cfg.weights.transport == "filesystem":
        return FilesystemReceiver(run, version=0)
    load = None
    if cfg.weights.receive == "in_place":
        if not getattr(engine, "loads_in_parts", False):
            raise ValueError("config key `weights.receive`: in_place needs an engine that loads part of the model at a "
                             "time (inference.engine=hf, or vLLM on GPU with inference.weight_update auto/inplace and "
                             "tensor_parallel_size 1); this one reloads the whole model: use weights.receive=buffered")
        load = engine.update_weights
    # An attached worker joins whatever attempt of the run rendezvous/weights.json holds (attempt=None).
    return BroadcastReceiver(run, ident.rank + 1, cfg.weights.timeout_s, None if ident.attached else ident.attempt,
                             abort=lambda: _failed(run), member_timeout_s=cfg.weights.member_timeout_s, load=load)


def _failed(run: RunDir) -> Optional[str]:
    if stop_requested():
        raise Stop(stop_requested())
    return run.failure()
