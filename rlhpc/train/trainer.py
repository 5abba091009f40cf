"""The trainer role: one torch.distributed world of `trainer.num_ranks` ranks.

For step k: rank 0 claims enough fresh groups from the queue (version >= k - async_level), every rank trains on its
token-balanced share, the optimizer steps, and the new weights (version k+1) stream to the inference workers. Rank 0
also runs the supervised warm start and writes summary.json. Held-out evaluation during RL runs on inference worker 0
(rlhpc/run/evaluation.py): no step waits for it; at the end rank 0 waits for the final version's result.

Each concern has its module: the warm start (warmstart), claims and the ledger (claims), the step (step), weights out
and the export (publish), the held-out curve (evaluation), checkpoints (checkpoint). The trainer holds their state and
runs the loop.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from rlhpc import env as env_mod
from rlhpc.config.errors import one_line
from rlhpc.config.schema import Config, ConfigError
from rlhpc.modeling import models, routing
from rlhpc.run import cores
from rlhpc.run.evaluation import Curve, discard_after, read_curve, result_path
from rlhpc.run.identity import Identity
from rlhpc.run.metrics import Metrics, busy_by_process
from rlhpc.run.rundir import RunDir, read_json, wait_for, write_json
from rlhpc.run.stop import Stop, stop_requested
from rlhpc.train import checkpoint, publish
from rlhpc.train.claims import Claims
from rlhpc.train.experts import RouterStats
from rlhpc.train.guard import BadSteps
from rlhpc.train.loading import build_sharded
from rlhpc.train.optim import make_optimizer
from rlhpc.train.parallel import enable_activation_checkpointing
from rlhpc.train.publish import Publisher
from rlhpc.train.samples import Samples
from rlhpc.train.step import Step
from rlhpc.train.warmstart import Evaluator, load_state, start_model
from rlhpc.transport.queue import Claim, RolloutBatch

log = logging.getLogger(__name__)


def run_trainer(cfg: Config, ident: Identity, run: RunDir, evaluator: Optional[Evaluator] = None) -> str:
    """The trainer role; `evaluator` measures the warm start (rlhpc.infer.rollout.evaluator, from rlhpc/role.py)."""
    trainer = Trainer(cfg, ident, run, evaluator)
    try:
        return trainer.train()
    finally:
        trainer.env.close()


class Trainer:
    def __init__(self, cfg: Config, ident: Identity, run: RunDir, evaluator: Optional[Evaluator] = None):
        self.cfg, self.ident, self.run = cfg, ident, run
        self.evaluator = evaluator  # of the warm start (sft.steps > 0)
        self.rank, self.world = ident.rank, ident.size
        self.is_main = self.rank == 0
        torch.set_num_threads(cfg.trainer.threads)
        torch.manual_seed(cfg.seed + self.rank)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":  # before NCCL: its communicators and every implicit "cuda" use this rank's GPU
            torch.cuda.set_device(self.device)
        if self.world > 1 or cfg.trainer.fsdp:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{ident.master_addr}:{ident.master_port}",
                                    rank=self.rank, world_size=self.world)
        self.claims = Claims(cfg, run, self.is_main)
        self.env = env_mod.load(cfg.env)
        # Steps skipped for non-finite values (rlhpc/train/guard.py); too many in a row stop the run.
        self.bad_steps = BadSteps(cfg.trainer.max_bad_steps, report=self.is_main)
        self.stepper = Step(cfg, self.rank, self.world, self.device, self.bad_steps)
        # One machine (launcher=local): threads lent to and borrowed from the inference workers (rlhpc/run/cores.py).
        lend = cores.enabled(cfg) and self.device.type == "cpu"
        self.idle = cores.Idle(run, "trainer", self.rank, cfg.trainer.threads, enabled=lend)
        self.borrower = cores.Borrower(run, "inference", cfg.trainer.threads, borrowers=self.world) if lend else None
        self.metrics: Optional[Metrics] = Metrics(run, "trainer", self.rank, cfg) if self.is_main else None
        self.summary: Dict = {}
        # Rank 0's last heartbeat after a step (report), which the end repeats with the final held-out reward.
        self.beat: Dict[str, Any] = {"step": 0, "steps": cfg.trainer.steps}
        self.publisher = Publisher(cfg, ident, run)
        # Set up in train(): the model (FSDP2-sharded when world > 1), its optimizer and LR schedule, the frozen
        # reference policy (algo.ref_kl_coef > 0) and the tokenizer.
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.scheduler: torch.optim.lr_scheduler.LambdaLR
        self.reference: Optional[torch.nn.Module] = None
        self.tokenizer: Any
        # MoE models: tokens routed to each expert, counted during the step's forwards (rlhpc/train/experts.py).
        self.router_stats: Optional[RouterStats] = None

    # ---- the main loop -------------------------------------------------------------------------------------------

    def train(self) -> str:
        """Runs to the last step ("done") or, when asked to stop, checkpoints and returns "requeue"."""
        t_start = time.time()
        try:
            self.summary = start_model(self.cfg, self.run, self.env, self.metrics, self.rank, self.evaluator)
        except Stop:
            # The warm start saved its state after its last step (run_dir/sft_state), if it had taken one.
            log.warning("stop requested (%s) during the warm start; the requeued run goes on with it", stop_requested())
            saved = load_state(self.run.sft_state) if self.is_main else None  # rank 0's to read (it warm-starts)
            return self.requeue(0, sft_step=(saved or {}).get("step", 0))
        try:
            start = self.start()
        except Exception as e:
            if not stop_requested():
                raise
            # A stop signal reaches every role at once: workers that leave while the weights group forms, say, fail
            # the start. Nothing was trained since the checkpoint it was starting from: requeue, do not fail the run.
            step = self.resume_step()
            log.warning("stop requested (%s) while starting (%s); the requeued run resumes at step %d",
                        stop_requested(), one_line(e), step)
            return self.requeue(step)
        t_rl = time.time()
        for step in range(start, self.cfg.trainer.steps):
            if stop_requested():
                return self.stop(step)
            try:
                self.lend(True)  # waiting for rollouts: the workers may use this rank's threads
                claim = self.claims.claim(step, while_waiting=lambda: self.publisher.admit(self.model))
            except Stop:
                return self.stop(step)
            finally:
                self.lend(False)
            stats = self.train_step(step, claim.batch)
            t_pub = time.time()
            self.publish(step + 1)
            stats["weights/publish_s"] = time.time() - t_pub
            if self.is_main:
                self.report(step, claim, stats)
            self.end_step(step + 1)
        return self.finish(t_start, t_rl)

    def start(self) -> int:
        """The model, fresh or resumed from the latest checkpoint; rank 0's ledger and sender. Returns the first step
        to train; a resumed run brings the workers to its weights version."""
        self.tokenizer = models.load_tokenizer(self.run.model)
        resume_from, damaged = checkpoint.resumable(self.run.checkpoints)
        for path, problem in damaged:
            log.warning("checkpoint %s is damaged (%s); not resuming from it", path, problem)
        if damaged and resume_from is None:
            raise RuntimeError(f"no whole checkpoint to resume from in {self.run.checkpoints}: "
                               + "; ".join(f"{p.name}: {why}" for p, why in damaged))
        # Resuming, the DCP checkpoint fills the (sharded) parameters: the Hugging Face weights are not read.
        self.setup_model(load_weights=resume_from is None)
        self.claims.queue.vocab_size = self.model.config.vocab_size  # a file with larger token ids is quarantined
        if self.cfg.trainer.router_replay:  # and one whose routing does not fit the model's MoE layers
            self.claims.queue.routing = routing.shape(self.model)
            if self.claims.queue.routing is not None and self.cfg.trainer.compile:
                raise ConfigError("config key `trainer.compile`: is not tested with routing replay (its hooks force "
                                  "the routers inside the compiled blocks): set trainer.compile=false or "
                                  "trainer.router_replay=false")
        start = 0
        if resume_from is not None:
            start = checkpoint.load(resume_from, self.model, self.optimizer, self.scheduler)["step"]
            self.summary["resumed_at"] = self.summary.get("resumed_at", []) + [start]
        if self.is_main:
            self.metrics.resumed("rl", start)  # what an earlier attempt logged past it is trained again
            self.samples = Samples(self.run, self.cfg.metrics.samples_per_step, self.tokenizer, self.metrics)
            self.samples.resumed(start)
            if start > 0:
                discard_after(self.run, start)
            self.claims.start(start)
            self.publisher.start()
        if start > 0:  # workers start from run_dir/model (version 0): bring them to the resumed version
            self.publish(start)
        return start

    def resume_step(self) -> int:
        """The step the run resumes at: its newest whole checkpoint's (0 without one)."""
        path, _ = checkpoint.resumable(self.run.checkpoints)
        return read_json(path / "trainer.json")["step"] if path is not None else 0

    def report(self, step: int, claim: Claim, stats: Dict[str, float]) -> None:
        """Rank 0, once version step + 1 is out: the ledger, metrics and heartbeat (with the newest held-out reward
        recorded by inference worker 0)."""
        self.claims.trained(step, claim, skipped=self.bad_steps.last)
        stats.update(self.claims.stats(step, claim))
        stats["lr"] = self.scheduler.get_last_lr()[0]
        self.metrics.log(step + 1, stats)
        self.samples.write(step + 1, claim.batch)  # a few of the batch's rollouts as text
        curve = read_curve(self.run)
        heldout = {"heldout": curve[-1][1], "heldout_version": curve[-1][0]} if curve else {}
        self.beat = dict(step=step + 1, steps=self.cfg.trainer.steps, reward=stats["rollout/reward"],
                         loss=stats["loss/total"], **heldout)
        self.run.heartbeat("trainer", self.rank, **self.beat)

    def end_step(self, next_step: int) -> None:
        """A checkpoint every `trainer.checkpoint_interval` steps (the last step exports instead); without
        checkpoints, the step's queue files are retired at once."""
        iv = self.cfg.trainer.checkpoint_interval
        if iv and next_step % iv == 0 and next_step < self.cfg.trainer.steps:
            self.save_checkpoint(next_step)
        elif not iv and self.is_main:  # no checkpoint to resume from: trained steps are never read again
            self.claims.retire_before(next_step)

    def finish(self, t_start: float, t_rl: float) -> str:
        """After the last step: the export, then (rank 0) the final version's held-out reward from inference worker 0,
        summary.json and DONE. The weights group stays open and DONE unwritten until that result exists, so the
        workers are still there to evaluate the final version."""
        cfg, steps = self.cfg, self.cfg.trainer.steps
        rl_time = time.time() - t_rl
        if cfg.trainer.export_final:
            self.export(self.run.checkpoints / "final")
        if self.is_main:
            curve = self.final_curve(steps)
            # The last step's heartbeat with the final held-out reward: what the progress bar and status end on.
            self.run.heartbeat("trainer", self.rank, **{**self.beat, "step": steps, "heldout": curve[-1][1],
                                                        "heldout_version": curve[-1][0]})
            if "heldout_reward_sft" not in self.summary:  # sft.steps=0: the warm start evaluated nothing
                self.summary.update(heldout_reward_base=curve[0][1], heldout_reward_sft=curve[0][1])
            self.summary.update(
                heldout_reward_rl=curve[-1][1], rl_steps=steps, rl_wall_time_s=rl_time,
                trainer_wall_time_s=time.time() - t_start, eval_curve=curve, exp_name=cfg.exp_name,
                async_level=cfg.async_level, algo=cfg.algo.name,
                busy=busy_by_process(self.run),  # per process: fractions of the RL wall time working and waiting
            )
            write_json(self.run.summary, self.summary)
            self.metrics.summary(self.summary)
            self.claims.sync()  # the finished run's ledger, durable before DONE
            write_json(self.run.done, {"time": time.time(), "steps": steps})
            self.publisher.close()
            self.metrics.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return "done"

    def final_curve(self, steps: int) -> Curve:
        """Rank 0: the held-out curve once inference worker 0 has recorded the final version (run_dir/evals/)."""
        timeout = self.cfg.eval.timeout_s
        t0 = time.time()
        wait_for(result_path(self.run, steps).exists, timeout,
                 f"{result_path(self.run, steps)}, the held-out evaluation of the final weights by inference worker 0 "
                 f"(see logs/inference-0.log; raise eval.timeout_s={timeout:.0f} if it is only slow)",
                 poll_s=0.5, abort=self.run.failure)
        log.info("final held-out result after %.1fs", time.time() - t0)
        return read_curve(self.run)

    def save_checkpoint(self, next_step: int) -> None:
        if self.is_main:
            # A save is progress too: the launcher's hang watchdog times this heartbeat (cluster.hang_timeout_s).
            self.run.heartbeat("trainer", self.rank, **self.beat, saving=next_step)
            self.claims.sync()  # the steps the checkpoint covers: durable before it is
        # The held-out curve is not trainer state: it lives in run_dir/evals/.
        checkpoint.save(self.run.checkpoints, next_step, self.model, self.optimizer, self.scheduler, {})
        if self.is_main:
            self.claims.retire_before(next_step)

    def stop(self, next_step: int) -> str:
        """Asked to stop (preemption, time limit, Ctrl-C): checkpoint at the step boundary, tell the launcher to requeue."""
        log.warning("stop requested (%s): checkpointing at step %d", stop_requested(), next_step)
        self.save_checkpoint(next_step)
        if self.is_main:
            self.publisher.leave()
            self.metrics.close()
        return self.requeue(next_step)

    def requeue(self, step: int, **extra: int) -> str:
        """Rank 0 tells the launcher to requeue (status/REQUEUE: the step the run resumes at, which the job script's
        no-progress guard compares, and `extra`, e.g. the warm start's saved SFT step)."""
        if self.is_main:
            write_json(self.run.requeue, {"step": step, **extra, "signal": stop_requested(),
                                                     "time": time.time()})
        return "requeue"

    # ---- the model ---------------------------------------------------------------------------------------------------

    def setup_model(self, load_weights: bool = True) -> None:
        """The policy, its optimizer and LR schedule, and the frozen reference policy when a KL penalty needs it.
        With `load_weights=False` the policy's parameters are left for a DCP checkpoint to fill."""
        cfg = self.cfg
        self.model = self.build_model(load_weights)
        if self.borrower is not None:
            self.borrower.attach(self.model)
        self.router_stats = RouterStats(self.model)
        self.optimizer = make_optimizer(self.model.parameters(), cfg.trainer.optim)
        # The frozen policy RL starts from, for a KL penalty against it (algo.ref_kl_coef).
        self.reference = None
        if cfg.algo.ref_kl_coef > 0:
            self.reference = self.build_model().eval()
            self.reference.requires_grad_(False)
        warmup = max(cfg.trainer.optim.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))

    def build_model(self, load_weights: bool = True) -> torch.nn.Module:
        """run_dir/model with its parameters in `trainer.master_dtype`. With FSDP2 it is sharded from the start: built
        on the meta device, each rank reading only its shards of the safetensors (rlhpc/train/loading.py); one rank
        without FSDP loads it whole."""
        tcfg = self.cfg.trainer
        if self.world > 1 or tcfg.fsdp:
            return build_sharded(self.run.model, tcfg, self.device, load_weights=load_weights)
        model = models.load_model(self.run.model, tcfg.master_dtype).to(self.device)
        if tcfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        return model

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shards (or prepares) a model already loaded whole: the path before sharded loading, which tests compare
        build_model against."""
        if self.world > 1 or self.cfg.trainer.fsdp:
            from rlhpc.train.parallel import apply_fsdp

            apply_fsdp(model, self.cfg.trainer, self.device)
        elif self.cfg.trainer.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.router_stats = RouterStats(model)
        return model

    # ---- the step and the weights out, on this trainer's model ------------------------------------------------------

    def train_step(self, step: int, batch: RolloutBatch) -> Dict[str, float]:
        """One optimizer step on this rank's share of `batch` (rlhpc/train/step.py); its statistics, with the MoE
        router's (tokens per expert over all ranks) for a MoE model. Collective with FSDP."""
        stats = self.stepper(step, batch, self.model, self.optimizer, self.scheduler, self.reference,
                             self.tokenizer.pad_token_id)
        if self.borrower is not None:
            stats["perf/borrowed_threads_s"] = self.borrower.take_borrowed_s()
        if self.router_stats is not None:
            stats.update(self.router_stats.collect())
        return stats

    def lend(self, idle: bool) -> None:
        """Marks this rank idle (waiting for rollouts: its threads are lent to the workers) or busy again."""
        if idle and self.borrower is not None:
            self.borrower.release()
        self.idle.set(idle)

    def publish(self, version: int) -> None:
        """The weights as `version` to the workers. Collective with FSDP."""
        self.publisher.publish(self.model, version)

    def full_state(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The weights stream in the serving dtype (rlhpc/train/publish.py); every rank iterates it with FSDP."""
        return publish.full_state(self.model, publish.serving_dtype(self.cfg))

    def export(self, path) -> None:
        """The current weights as a Hugging Face folder at `path` (rlhpc/train/publish.py). Collective with FSDP."""
        publish.export(path, self.model, self.tokenizer, self.cfg, self.is_main)
