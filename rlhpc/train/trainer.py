"""The trainer role: one torch.distributed world of `trainer.num_ranks` ranks.

For step k: rank 0 claims enough fresh groups from the queue (version >= k - async_level), every rank trains on its
token-balanced share, the optimizer steps, and the new weights (version k+1) stream to the inference workers. Rank 0
also runs the supervised warm start, held-out evaluation, and writes summary.json.
"""

from __future__ import annotations

import logging
import os
import time
from itertools import islice
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from rlhpc.train import checkpoint
from rlhpc import env as env_mod
from rlhpc.algo import loss as loss_mod
from rlhpc import models
from rlhpc.train.batching import balance_ranks, pad, plan_micro_batches, token_logprobs
from rlhpc.config import Config
from rlhpc.dtypes import dtype_of
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.algo.loss import LossInputs
from rlhpc.names import checkpoint_layout
from rlhpc.metrics import Metrics
from rlhpc.transport.queue import Claim, Queue, RolloutBatch
from rlhpc.identity import Identity
from rlhpc.stop import Stop, stop_requested
from rlhpc.infer.rollout import evaluate
from rlhpc.rundir import RunDir, read_json, wait_for, write_json
from rlhpc.train.guard import BadSteps, nonfinite_advantages, nonfinite_groups, nonfinite_update
from rlhpc.train.export import write_hf_folder
from rlhpc.train.loading import build_sharded
from rlhpc.train.optim import make_optimizer
from rlhpc.train.parallel import autocast
from rlhpc.train.warmstart import sft_train
from rlhpc.transport.weights import BroadcastSender, FilesystemSender, WeightsSender, write_snapshot

log = logging.getLogger(__name__)


def run_trainer(cfg: Config, ident: Identity, run: RunDir) -> str:
    return Trainer(cfg, ident, run).train()


class Trainer:
    def __init__(self, cfg: Config, ident: Identity, run: RunDir):
        self.cfg, self.ident, self.run = cfg, ident, run
        self.rank, self.world = ident.rank, ident.size
        self.is_main = self.rank == 0
        torch.set_num_threads(cfg.trainer.threads)
        torch.manual_seed(cfg.seed + self.rank)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        if self.world > 1 or cfg.trainer.fsdp:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{ident.master_addr}:{ident.master_port}",
                                    rank=self.rank, world_size=self.world)
        self.queue = Queue(run.queue, lease_s=cfg.queue.lease_s, keep_dropped=cfg.queue.keep_dropped,
                           keep_quarantined=cfg.queue.keep_quarantined)
        self.env = env_mod.load(cfg.env)
        self.loss_fn = loss_mod.get(cfg.algo.name)
        self.metrics: Optional[Metrics] = Metrics(run, "trainer", self.rank) if self.is_main else None
        self.summary: Dict = {}
        # Steps skipped for non-finite values (rlhpc/train/guard.py); too many in a row stop the run.
        self.bad_steps = BadSteps(cfg.trainer.max_bad_steps, report=self.is_main)
        # Set up in run(): the model (FSDP2-sharded when world > 1), its optimizer, the weights sender, the evaluator.
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.sender: Optional[WeightsSender] = None
        self.eval_engine: Optional[HFEngine] = None

    # ---- the main loop -------------------------------------------------------------------------------------------

    def train(self) -> str:
        """Runs to the last step ("done") or, when asked to stop, checkpoints and returns "requeue"."""
        t_start = time.time()
        cfg = self.cfg
        try:
            self.prepare_model()
        except Stop:
            log.warning("stop requested (%s) during the warm start; it restarts on requeue", stop_requested())
            if self.is_main:
                write_json(self.run.status / "REQUEUE", {"step": 0, "signal": stop_requested(), "time": time.time()})
            return "requeue"
        self.tokenizer = models.load_tokenizer(self.run.model)
        resume_from = checkpoint.latest(self.run.checkpoints)
        # Resuming, the DCP checkpoint fills the (sharded) parameters: the Hugging Face weights are not read.
        self.setup_model(load_weights=resume_from is None)
        self.queue.vocab_size = self.model.config.vocab_size  # a file with larger token ids is quarantined
        self.eval_tasks = list(islice(self.env.tasks("eval", 0), cfg.eval.num_tasks))
        start, curve = 0, None
        if resume_from is not None:
            state = checkpoint.load(resume_from, self.model, self.optimizer, self.scheduler)
            start, curve = state["step"], [tuple(x) for x in state["eval_curve"]]
            self.summary["resumed_at"] = self.summary.get("resumed_at", []) + [start]
        steps = cfg.trainer.steps
        if self.is_main:
            # With FSDP the evaluator is a full copy of the model on rank 0 (evaluation moves off the trainer later;
            # docs/trainer.md lists the full copies that remain).
            self.eval_engine = HFEngine(self.model if self.world == 1 else models.load_model(self.run.model), self.tokenizer.pad_token_id)
            if "heldout_reward_sft" not in self.summary:  # sft.steps=0: the warm start loaded no model to evaluate
                r = curve[0][1] if curve else evaluate(self.eval_engine, self.env, self.tokenizer, self.eval_tasks, cfg.env)
                self.summary.update(heldout_reward_base=r, heldout_reward_sft=r)
            self.queue.truncate_ledger(before_step=start)
            self.queue.set_progress(claimed=start, version=start)
            self.sender = self.make_sender()
        curve = curve or [(0, self.summary.get("heldout_reward_sft"))]
        if start > 0:  # workers start from run_dir/model (version 0): bring them to the resumed version
            self.publish(start, eval_due=self.world > 1)
        t_rl = time.time()
        for step in range(start, steps):
            if stop_requested():
                return self.stop(step, curve)
            try:
                claim = self.claim(step)
            except Stop:
                return self.stop(step, curve)
            if self.is_main:  # workers size their next batch by this
                self.queue.set_progress(claimed=step + 1, version=step)
            stats = self.train_step(step, claim.batch)
            t_pub = time.time()
            self.publish(step + 1, eval_due=self.eval_due(step + 1))
            stats["weights/publish_s"] = time.time() - t_pub
            if self.is_main:
                self.queue.set_progress(claimed=step + 1, version=step + 1)
                self.queue.record(step, claim, skipped=self.bad_steps.last)
                if self.eval_due(step + 1):
                    r = evaluate(self.eval_engine, self.env, self.tokenizer, self.eval_tasks, cfg.env)
                    curve.append((step + 1, r))
                    stats["eval/heldout_reward"] = r
                    log.info("step %d held-out reward %.3f", step + 1, r)
                stats.update(self.claim_stats(step, claim))
                stats["lr"] = self.scheduler.get_last_lr()[0]
                self.metrics.log(step + 1, stats)
                self.run.heartbeat("trainer", self.rank, step=step + 1, steps=steps, reward=stats["rollout/reward"],
                                   heldout=curve[-1][1], loss=stats["loss/total"])
            iv = cfg.trainer.checkpoint_interval
            if iv and (step + 1) % iv == 0 and step + 1 < steps:
                self.save_checkpoint(step + 1, curve)
            elif not iv and self.is_main:  # no checkpoint to resume from: trained steps are never read again
                self.queue.retire_before(step + 1, keep=cfg.queue.keep_retired)
        if self.is_main:
            rl_time = time.time() - t_rl
            if curve[-1][0] != steps:
                curve.append((steps, evaluate(self.eval_engine, self.env, self.tokenizer, self.eval_tasks, cfg.env)))
            self.summary.update(
                heldout_reward_rl=curve[-1][1], rl_steps=steps, rl_wall_time_s=rl_time,
                trainer_wall_time_s=time.time() - t_start, eval_curve=curve, exp_name=cfg.exp_name,
                async_level=cfg.async_level, algo=cfg.algo.name,
            )
        if cfg.trainer.export_final:
            self.export(self.run.checkpoints / "final")
        if self.is_main:
            write_json(self.run.summary, self.summary)
            write_json(self.run.done, {"time": time.time(), "steps": steps})
            self.sender.close()
            self.metrics.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return "done"

    def save_checkpoint(self, next_step: int, curve) -> None:
        checkpoint.save(self.run.checkpoints, next_step, self.model, self.optimizer, self.scheduler,
                        {"eval_curve": curve})
        if self.is_main:
            self.queue.retire_before(next_step, keep=self.cfg.queue.keep_retired)

    def stop(self, next_step: int, curve) -> str:
        """Asked to stop (preemption, time limit, Ctrl-C): checkpoint at the step boundary, tell the launcher to requeue."""
        log.warning("stop requested (%s): checkpointing at step %d", stop_requested(), next_step)
        self.save_checkpoint(next_step, curve)
        if self.is_main:
            write_json(self.run.status / "REQUEUE", {"step": next_step, "signal": stop_requested(), "time": time.time()})
            self.metrics.close()
        return "requeue"

    def eval_due(self, version: int) -> bool:
        iv = self.cfg.eval.interval
        return version == self.cfg.trainer.steps or (iv > 0 and version % iv == 0)

    # ---- model preparation: build, SFT warm start, hand to RL ------------------------------------------------------

    def prepare_model(self) -> None:
        """Rank 0 makes run_dir/model (the HF folder RL starts from); other ranks wait for it."""
        ready = self.run.model / "READY"
        if self.is_main and not ready.exists():
            self.summary.update(self.warm_start())
            write_json(ready, self.summary)
        def abort() -> Optional[str]:
            if stop_requested():
                raise Stop(stop_requested())
            return self.run_failed()

        wait_for(ready.exists, self.cfg.inference.startup_timeout_s, f"{ready} (the SFT warm start on trainer rank 0)",
                 abort=abort)
        self.summary = read_json(ready)

    def warm_start(self) -> Dict:
        cfg = self.cfg
        base = cfg.model.path or str(models.build(cfg.model, self.run.root / "base_model"))
        if cfg.sft.steps == 0:
            # Nothing to train: RL starts from the base checkpoint's files as they are, and no full model is loaded
            # here; train() measures the starting held-out reward with the evaluator it has anyway.
            models.copy_checkpoint(base, self.run.model)
            return {"sft_steps": 0, "sft_wall_time_s": 0.0}
        model, tok = models.load_model(base, cfg.model.dtype), models.load_tokenizer(base)
        engine = HFEngine(model, tok.pad_token_id)
        tasks = list(islice(self.env.tasks("eval", 0), cfg.eval.num_tasks))
        out: Dict = {"heldout_reward_base": evaluate(engine, self.env, tok, tasks, cfg.env)}
        t0 = time.time()

        def on_step(s: int, loss: float) -> None:
            if stop_requested():
                raise Stop(stop_requested())
            self.metrics.log(s + 1, {"sft/loss": loss})
            if s % 20 == 0:
                self.run.heartbeat("trainer", self.rank, phase="sft", sft_step=s, sft_steps=cfg.sft.steps, loss=loss)

        def on_check(s: int, reward: float) -> None:
            self.metrics.log(s, {"sft/validation_reward": reward})

        losses = sft_train(model, tok, self.env, cfg, on_step=on_step, on_check=on_check)
        out["sft_steps"] = len(losses)
        out["heldout_reward_sft"] = evaluate(engine, self.env, tok, tasks, cfg.env)
        out["sft_wall_time_s"] = time.time() - t0
        log.info("warm start: held-out reward %.3f -> %.3f after %d SFT steps (%.1fs)", out["heldout_reward_base"],
                 out["heldout_reward_sft"], out["sft_steps"], out["sft_wall_time_s"])
        model.save_pretrained(self.run.model)
        tok.save_pretrained(self.run.model)
        return out

    def setup_model(self, load_weights: bool = True) -> None:
        """The policy, its optimizer and LR schedule, and the frozen reference policy when a KL penalty needs it.
        With `load_weights=False` the policy's parameters are left for a DCP checkpoint to fill."""
        cfg = self.cfg
        self.model = self.build_model(load_weights)
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
            model.gradient_checkpointing_enable()
        return model

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shards (or prepares) a model already loaded whole: the path before sharded loading, which tests compare
        build_model against."""
        if self.world > 1 or self.cfg.trainer.fsdp:
            from rlhpc.train.parallel import apply_fsdp

            apply_fsdp(model, self.cfg.trainer, self.device)
        elif self.cfg.trainer.activation_checkpointing:
            model.gradient_checkpointing_enable()
        return model

    def make_sender(self) -> WeightsSender:
        w = self.cfg.weights
        if w.transport == "filesystem":
            return FilesystemSender(self.run)
        # Trainer rank 0's address as the launcher resolved it (under Slurm: the first node of the trainer group).
        return BroadcastSender(self.run, self.cfg.inference.num_workers, w.bucket_mb, w.timeout_s, self.ident.attempt,
                               host=self.ident.master_addr)

    # ---- one step ---------------------------------------------------------------------------------------------------

    def claim(self, step: int) -> Claim:
        def abort() -> Optional[str]:
            if stop_requested():
                raise Stop(stop_requested())
            return self.run_failed()

        timeout = self.cfg.trainer.rollout_timeout_s
        # Weights version `step` is the newest there is: a group claiming a newer one is left from before a restart.
        if self.is_main:
            return self.queue.claim(step, self.cfg.trainer.groups_per_step, step - self.cfg.async_level, timeout,
                                    abort=abort, max_version=step)
        return self.queue.wait_claim(step, timeout, abort=abort, max_version=step)

    def run_failed(self) -> Optional[str]:
        return self.run.failure()

    def train_step(self, step: int, batch: RolloutBatch) -> Dict[str, float]:
        t0 = time.time()
        cfg = self.cfg
        mine = balance_ranks(batch.lengths, batch.group_of, self.world)[self.rank]
        lengths = batch.lengths[mine]
        # Loss weights: the whole step sums to a mean over tokens (or sequences) of all ranks.
        loss_tokens_per_sample = torch.stack(
            [batch.loss_mask[batch.offsets[i] + 1 : batch.offsets[i + 1]].sum() for i in mine.tolist()]
        ) if mine.numel() else torch.zeros(0, dtype=torch.long)
        tokens = torch.tensor([float(loss_tokens_per_sample.sum())])
        if self.world > 1:
            dist.all_reduce(tokens)  # loss tokens of the whole step (the sample count is global already)
        total_tokens, total_samples = max(float(tokens[0]), 1.0), float(batch.num_samples)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        bad = nonfinite_advantages(batch)  # the same batch on every rank: all ranks skip together
        if bad is not None:
            self.bad_steps.skipped(step, bad, nonfinite_groups(batch))
            return {"loss/total": float("nan"), "grad_norm": float("nan"), "train/skipped": 1.0,
                    "train/bad_steps": float(self.bad_steps.total), "perf/train_s": time.time() - t0}
        sums: Dict[str, float] = {}
        n_loss_tokens = 0
        plan = plan_micro_batches(lengths, cfg.trainer.micro_batch_tokens)
        if self.world > 1:  # every rank runs as many forward/backward passes (FSDP's collectives must pair up)
            n = torch.tensor([len(plan)])
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            plan += [None] * (int(n) - len(plan))
        for mb in plan:
            if mb is None:
                self.idle_pass()
                continue
            samples = mine[mb]
            seqs = [batch.tokens[batch.offsets[i] : batch.offsets[i + 1]] for i in samples.tolist()]
            ids, attn = pad(seqs, self.tokenizer.pad_token_id)
            masks, _ = pad([batch.loss_mask[batch.offsets[i] : batch.offsets[i + 1]] for i in samples.tolist()], 0)
            inf_lp, _ = pad([batch.logprobs[batch.offsets[i] : batch.offsets[i + 1]] for i in samples.tolist()], 0)
            ids, attn = ids.to(self.device), attn.to(self.device)
            with autocast(cfg.trainer, self.device, self.model):  # one rank, mixed precision: the forward only
                logp, entropy = token_logprobs(self.model, ids, attn, cfg.algo.temperature, with_entropy=True,
                                               chunk_tokens=cfg.trainer.logprob_chunk_tokens)
            sel = masks[:, 1:].bool().to(self.device)
            row = torch.arange(len(samples), device=self.device).unsqueeze(1).expand_as(sel)[sel]
            inputs = LossInputs(
                logprobs=logp[sel],
                inference_logprobs=inf_lp[:, 1:].to(self.device)[sel],
                advantages=batch.advantages[samples].to(self.device)[row],
                sample_index=row,
                num_samples=len(samples),
            )
            if self.reference is not None:
                with torch.no_grad(), autocast(cfg.trainer, self.device, self.reference):
                    ref_lp, _ = token_logprobs(self.reference, ids, attn, cfg.algo.temperature,
                                               chunk_tokens=cfg.trainer.logprob_chunk_tokens)
                inputs.reference_logprobs = ref_lp[sel]
            out = self.loss_fn(inputs, cfg.algo)
            weight = loss_mod.token_weights(inputs, cfg.algo.normalize, total_tokens, total_samples,
                                            cfg.env.max_new_tokens)
            loss = (out.token_loss * weight).sum() * self.world  # FSDP averages gradients over ranks
            loss.backward()
            k = int(sel.sum())
            n_loss_tokens += k
            sums["loss/total"] = sums.get("loss/total", 0.0) + float(loss.detach()) / self.world
            sums["entropy"] = sums.get("entropy", 0.0) + float(entropy[sel].sum())
            for name, v in out.metrics.items():
                sums[f"loss/{name}"] = sums.get(f"loss/{name}", 0.0) + float(v) * k
        if self.world > 1:  # the step's statistics over all ranks
            keys = sorted(sums)
            packed = torch.tensor([sums[k] for k in keys] + [float(n_loss_tokens)], dtype=torch.float64)
            dist.all_reduce(packed)
            sums = dict(zip(keys, packed[:-1].tolist()))
            n_loss_tokens = int(packed[-1])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.trainer.optim.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # Loss and norm are reduced over ranks, so every rank takes the same decision.
        bad = nonfinite_update(sums.get("loss/total", 0.0), float(grad_norm))
        if bad is None:
            self.optimizer.step()
            self.scheduler.step()
            self.bad_steps.applied()
        else:  # drop the gradients; the weights stay those of version `step`
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps.skipped(step, bad, nonfinite_groups(batch))
        stats = {"loss/total": sums.get("loss/total", 0.0)}
        for k_, v in sums.items():
            if k_ != "loss/total":
                stats[k_] = v / max(n_loss_tokens, 1)
        dt = time.time() - t0
        stats.update({
            "grad_norm": float(grad_norm),
            "train/skipped": float(bad is not None),
            "train/bad_steps": float(self.bad_steps.total),
            "perf/train_s": dt,
            "perf/tokens_per_s": float(batch.tokens.numel()) / dt,
            "perf/loss_tokens": float(total_tokens),
        })
        return stats

    def idle_pass(self) -> None:
        """A forward/backward that adds nothing to the gradients, for a rank with fewer micro-batches than others."""
        ids = torch.tensor([[self.tokenizer.pad_token_id, self.tokenizer.pad_token_id]], device=self.device)
        with autocast(self.cfg.trainer, self.device, self.model):
            logp, _ = token_logprobs(self.model, ids, torch.ones_like(ids),
                                     chunk_tokens=self.cfg.trainer.logprob_chunk_tokens)
        (logp.sum() * 0.0).backward()

    def claim_stats(self, step: int, claim: Claim) -> Dict[str, float]:
        b = claim.batch
        rewards = [r for g in b.groups for r in g.rewards]
        staleness = [step - g.version for g in b.groups]
        counts = self.queue.counts()
        comp = [n for g in b.groups for n in g.extra.get("completion_tokens", [])]
        return {
            "rollout/reward": sum(rewards) / len(rewards),
            "rollout/truncated_frac": sum(t for g in b.groups for t in g.truncated) / max(len(rewards), 1),
            "rollout/completion_tokens": sum(comp) / max(len(comp), 1),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": max(staleness),
            "async/dropped_groups": claim.dropped_groups,
            "queue/pending_files": counts["pending_files"],
            "queue/quarantined_files": counts["quarantined_files"],
            "perf/rollout_wait_s": claim.wait_s,
        }

    # ---- weights out ---------------------------------------------------------------------------------------------------

    @property
    def serving_dtype(self) -> torch.dtype:
        """What inference loads and receives (model.dtype), whatever the trainer's master dtype."""
        return dtype_of(self.cfg.model.dtype)

    def full_state(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(checkpoint name, full tensor): what save_pretrained would write, under its Hugging Face checkpoint names
        (fused MoE experts split into per-expert views, rlhpc/names.py), one state tensor at a time, floating-point
        tensors cast from the master copy to the serving dtype. With FSDP2 each parameter is cast as a shard, then
        all-gathered on demand: every rank must iterate the stream."""
        from rlhpc.names import CheckpointNames, state_tensors

        names = CheckpointNames.of(self.model)
        serving = self.serving_dtype
        for name, t in state_tensors(self.model):
            if t.is_floating_point() and t.dtype != serving:
                t = t.to(serving)
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield from names.to_checkpoint(name, t)

    def publish(self, version: int, eval_due: bool) -> None:
        stream = self.full_state()
        if not self.is_main:
            for _ in stream:  # take part in the all-gathers
                pass
            return
        if self.world > 1 and eval_due:  # the evaluator is a separate copy: fill it from the same stream
            stream = _tee_into(stream, self.eval_engine)
        snap = self.cfg.weights.snapshot_interval
        if snap and version % snap == 0 and self.cfg.weights.transport == "broadcast":
            stream = list(stream)
            write_snapshot(self.run, version, stream)
        self.sender.publish(version, stream, layout=checkpoint_layout(self.model, self.serving_dtype))

    def export(self, path) -> None:
        """Hugging Face folder (safetensors, config, tokenizer) of the current weights in the serving dtype, written by
        rank 0 from the weights stream, one full tensor at a time (rlhpc/train/export.py). Collective with FSDP."""
        stream = self.full_state()
        if not self.is_main:
            for _ in stream:  # take part in the all-gathers
                pass
            return
        serving = self.serving_dtype
        write_hf_folder(Path(path), self.model, serving, checkpoint_layout(self.model, serving), stream, self.tokenizer)


def _tee_into(stream, engine: HFEngine):
    for name, t in stream:
        engine.update_weights([(name, t)])
        yield name, t
