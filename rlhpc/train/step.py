"""One RL optimizer step, on every trainer rank: this rank's token-balanced share of the claimed batch, forward and
backward in micro-batches, the gradients clipped and applied (or dropped when not finite: rlhpc/train/guard.py), and
the step's statistics reduced over ranks, so every rank reports and decides the same."""

from __future__ import annotations

import contextlib
import time
from contextlib import contextmanager
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from rlhpc.algo import loss as loss_mod
from rlhpc.algo.loss import LossInputs
from rlhpc.config.schema import Config
from rlhpc.modeling import sparse
from rlhpc.train import attention, context
from rlhpc.train.batching import (ATTENTION, NO_CUSTOM_MASK, Packed, balance_ranks, pack, packed_logprobs, pad,
                                  plan_micro_batches, plan_rows, token_logprobs)
from rlhpc.modeling.models import decoder_blocks
from rlhpc.modeling.routing import Replay, moe_gates
from rlhpc.patches.libraries import suppress_compile_errors
from rlhpc.train.experts import RouterBalance
from rlhpc.train.guard import BadSteps, nonfinite_advantages, nonfinite_groups, nonfinite_update
from rlhpc.train.parallel import autocast
from rlhpc.transport.queue import RolloutBatch




def packs(model: torch.nn.Module) -> bool:
    """Whether `model` can take packed rows: attention that applies a 4-D mask (sdpa, eager) and no sparse selection,
    or GLM-5's once its indexer chooses among tied keys by order (rlhpc/modeling/sparse.py)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return (model_type not in NO_CUSTOM_MASK
            and (model_type not in sparse.SPARSE_ATTENTION or sparse.installed(model))
            and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager", ATTENTION))


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile each decoder block in place, once (parameter names and the state dict are unchanged); what dynamo
    cannot compile runs eagerly instead of failing the step."""
    blocks = decoder_blocks(model)
    if getattr(blocks, "rlhpc_compiled", False):
        return
    suppress_compile_errors()
    for block in blocks:
        block.compile(dynamic=True)
    blocks.rlhpc_compiled = True


class Step:
    """What stays the same from step to step: the config, this rank's place in the world, the loss, the bad-step count.
    The model and its optimizer are the trainer's fields, passed in at each call."""

    def __init__(self, cfg: Config, rank: int, world: int, device: torch.device, bad_steps: BadSteps):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.bad_steps = bad_steps
        self.loss_fn = loss_mod.get(cfg.algo.name)
        self.balance: Optional[RouterBalance] = None
        self.replays: Dict[int, Replay] = {}  # routing replay's hooks, by model (the policy, the reference)
        # Context parallelism: the cp consecutive ranks of a context group train the same samples, each on W / cp
        # positions of every packed row (rlhpc/train/context.py); the batch is split over the dp = world / cp groups.
        self.cp = cfg.trainer.cp if world > 1 else 1
        self.dp, self.dp_rank = world // self.cp, rank // self.cp
        self.context: Optional[context.ContextGroup] = None

    def __call__(self, step: int, batch: RolloutBatch, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, reference: Optional[torch.nn.Module], pad_id: int) -> Dict[str, float]:
        """One optimizer step: this rank's shard of the batch, the forward and backward passes of its micro-batches,
        the statistics reduced over ranks, then the update applied or skipped (non-finite loss or gradient norm)."""
        t0 = time.time()
        cfg = self.cfg
        if self.cp > 1 and self.context is None:
            self.context = context.context_group(self.cp)
        if cfg.trainer.packing == "shared_prefix":  # packed rows attend from their segments (rlhpc/train/attention.py)
            for m in (model, reference):
                if m is not None:
                    attention.install(m, self.cp, cfg.trainer.attention_block_elements)
        mine, total_tokens = self.shard(batch)
        model.train()
        if cfg.trainer.compile:
            compile_blocks(model)
        optimizer.zero_grad(set_to_none=True)
        bad = nonfinite_advantages(batch)  # the same batch on every rank: all ranks skip together
        if bad is not None:
            self.bad_steps.skipped(step, bad, nonfinite_groups(batch))
            return {"loss/total": float("nan"), "grad_norm": float("nan"), "train/skipped": 1.0,
                    "train/bad_steps": float(self.bad_steps.total), "perf/train_s": time.time() - t0}
        sums, n_loss_tokens = self.forward_backward(batch, mine, model, reference, pad_id, total_tokens)
        sums, n_loss_tokens = self.reduce(sums, n_loss_tokens)
        grad_norm, bad = self.apply_or_skip(step, batch, model, optimizer, scheduler, sums)
        totals = ("loss/total", "loss/router_aux")  # the step's sums; the other statistics are means per loss token
        stats = {k_: v if k_ in totals else v / max(n_loss_tokens, 1) for k_, v in sums.items()}
        stats.setdefault("loss/total", 0.0)
        dt = time.time() - t0
        stats.update({
            "grad_norm": grad_norm,
            "train/skipped": float(bad is not None),
            "train/bad_steps": float(self.bad_steps.total),
            "perf/train_s": dt,
            "perf/tokens_per_s": float(batch.tokens.numel()) / dt,
            "perf/loss_tokens": total_tokens,
        })
        return stats

    def shard(self, batch: RolloutBatch) -> Tuple[torch.Tensor, float]:
        """This rank's samples (balanced over the dp groups) and the loss tokens of the whole step, over all ranks."""
        mine = balance_ranks(batch.lengths, batch.group_of, self.dp)[self.dp_rank]
        # Loss weights: the whole step sums to a mean over tokens (or sequences) of all ranks.
        loss_tokens_per_sample = torch.stack(
            [batch.loss_mask[batch.offsets[i] + 1 : batch.offsets[i + 1]].sum() for i in mine.tolist()]
        ) if mine.numel() else torch.zeros(0, dtype=torch.long)
        tokens = torch.tensor([float(loss_tokens_per_sample.sum())])
        if self.world > 1:
            dist.all_reduce(tokens)  # loss tokens of the whole step (the sample count is global already)
            tokens /= self.cp  # the ranks of a context group hold the same samples
        return mine, max(float(tokens[0]), 1.0)

    def forward_backward(self, batch: RolloutBatch, mine: torch.Tensor, model: torch.nn.Module,
                         reference: Optional[torch.nn.Module], pad_id: int,
                         total_tokens: float) -> Tuple[Dict[str, float], int]:
        """The forward and backward passes of this rank's micro-batches, gradients accumulated; this rank's sums of
        the step's statistics and its count of loss tokens."""
        cfg = self.cfg
        share = 1.0 if self.context is None or self.context.first else 0.0  # a context group counts its stats once
        total_samples = float(batch.num_samples)
        sums: Dict[str, float] = {}
        n_loss_tokens = 0
        split = batch.offsets.diff().tolist()
        sequences, loss_masks = batch.tokens.split(split), batch.loss_mask.split(split)
        routings = batch.routing.split(split) if self.replays_routing(batch, model) else None
        models = [m for m in (model, reference) if m is not None]
        plan = self.plan(mine, batch.lengths[mine], sequences, batch.group_of, packs(model))
        if self.world > 1:  # every rank runs as many forward/backward passes (FSDP's collectives must pair up)
            n = torch.tensor([len(plan)])
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            plan += [None] * (int(n) - len(plan))
        balance = self.router_balance(model)
        loads = self.router_loads(plan, model, balance, mine, batch, sequences, loss_masks, routings,
                                  pad_id) if balance else None
        for mb in plan:
            if mb is None:
                self.idle_pass(model, pad_id)
                continue
            samples, sel, row, logprobs, positions, routing = self.micro_batch(mb, mine, sequences, loss_masks,
                                                                               routings, pad_id)
            inf_lp, _ = pad([batch.logprobs[batch.offsets[i] : batch.offsets[i + 1]] for i in samples.tolist()], 0)
            # The recorded experts route the forward, the reference's and, with activation checkpointing, the
            # forward's recomputation in the backward.
            with self.replaying(models, routing):
                with autocast(cfg.trainer, self.device, model), self.capture(balance) as routers:  # the forward only
                    logp, entropy = logprobs(model, with_entropy=True)
                inputs = LossInputs(
                    logprobs=logp,
                    inference_logprobs=inf_lp[:, 1:].to(self.device)[sel],
                    advantages=batch.advantages[samples].to(self.device)[row],
                    sample_index=row,
                    num_samples=len(samples),
                )
                if reference is not None:
                    with torch.no_grad(), autocast(cfg.trainer, self.device, reference):
                        inputs.reference_logprobs, _ = logprobs(reference)
                out = self.loss_fn(inputs, cfg.algo)
                weight = loss_mod.token_weights(inputs, cfg.algo.normalize, total_tokens, total_samples,
                                                cfg.env.max_new_tokens)
                loss = (out.token_loss * weight).sum()  # under CP the same on every rank of the context group
                total = share * float(loss.detach())
                if balance is not None:  # under CP each rank's own positions' share
                    aux = balance.term(routers, positions, *loads)
                    loss = loss + aux
                    total += float(aux.detach())
                    sums["loss/router_aux"] = sums.get("loss/router_aux", 0.0) + float(aux.detach())
                loss = loss * self.world  # FSDP averages gradients over ranks
                loss.backward()
            k = int(sel.sum()) * share
            n_loss_tokens += k
            sums["loss/total"] = sums.get("loss/total", 0.0) + total
            sums["entropy"] = sums.get("entropy", 0.0) + float(entropy.sum()) * share
            for name, v in out.metrics.items():
                sums[f"loss/{name}"] = sums.get(f"loss/{name}", 0.0) + float(v) * k
        return sums, n_loss_tokens

    def reduce(self, sums: Dict[str, float], n_loss_tokens: int) -> Tuple[Dict[str, float], int]:
        """The step's statistics and loss-token count over all ranks."""
        if self.world == 1:
            return sums, n_loss_tokens
        keys = sorted(sums)
        packed = torch.tensor([sums[k] for k in keys] + [float(n_loss_tokens)], dtype=torch.float64)
        dist.all_reduce(packed)
        return dict(zip(keys, packed[:-1].tolist())), int(packed[-1])

    def apply_or_skip(self, step: int, batch: RolloutBatch, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler, sums: Dict[str, float]) -> Tuple[float, Optional[str]]:
        """Clips the gradients and steps the optimizer, or drops them when the loss or the norm is not finite (the
        weights stay those of version `step`); the gradient norm, and why the step was skipped (None: applied). Loss
        and norm are reduced over ranks, so every rank takes the same decision."""
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.trainer.optim.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        bad = nonfinite_update(sums.get("loss/total", 0.0), float(grad_norm))
        if bad is None:
            optimizer.step()
            scheduler.step()
            self.bad_steps.applied()
        else:
            optimizer.zero_grad(set_to_none=True)
            self.bad_steps.skipped(step, bad, nonfinite_groups(batch))
        return float(grad_norm), bad

    def plan(self, mine: torch.Tensor, lengths: torch.Tensor, sequences, group_of: torch.Tensor, packing: bool) -> list:
        """This rank's micro-batches: lists of packed rows (`trainer.packing=shared_prefix`), or index tensors into
        `mine` of samples padded to a common length (`padded`). Either way at most `trainer.micro_batch_tokens` tokens,
        padding included, or one row or sample alone if longer."""
        budget = self.cfg.trainer.micro_batch_tokens
        if self.cp > 1 and not packing:
            raise ValueError(f"trainer.cp={self.cp} needs a model that takes packed rows (a custom attention mask); "
                             "this one does not (set trainer.cp=1)")
        if self.cfg.trainer.packing != "shared_prefix" or not packing:
            return plan_micro_batches(lengths, budget)
        rows = plan_rows(mine.tolist(), sequences, group_of, self.cfg.trainer.pack_row_tokens)
        sizes = torch.tensor([r.length(sequences) for r in rows], dtype=torch.long)
        return [[rows[k] for k in mb.tolist()] for mb in plan_micro_batches(sizes, budget)]

    def micro_batch(self, mb, mine: torch.Tensor, sequences, loss_masks, routings, pad_id: int):
        """A planned micro-batch's samples (indices into the step), its loss-token selection `sel` [samples, L-1] and
        each selected token's sample (`row`), its logprobs function (`logprobs`), the flat positions of the forward's
        tokens that predict the selected tokens, in `sel`'s order (a packed row's prompt position once per sample),
        and the experts that route the forward's tokens (None: live routing)."""
        rows = mb if isinstance(mb, list) else None  # packed rows, or sample positions within `mine`
        samples = torch.tensor([i for r in rows for i in r.samples]) if rows is not None else mine[mb]
        masks, _ = pad([loss_masks[i] for i in samples.tolist()], 0)
        sel = masks[:, 1:].bool().to(self.device)
        row = torch.arange(len(samples), device=self.device).unsqueeze(1).expand_as(sel)[sel]
        logprobs, positions, routing = self.logprobs(rows, samples, sequences, loss_masks, routings, sel, pad_id)
        return samples, sel, row, logprobs, positions, routing

    def router_balance(self, model: torch.nn.Module) -> Optional[RouterBalance]:
        """The load-balancing term's hooks on `model` when `algo.router_aux_loss_coef` > 0 (made once per model)."""
        if self.cfg.algo.router_aux_loss_coef <= 0:
            return None
        if self.balance is None or self.balance.model is not model:
            self.balance = RouterBalance(model, self.cfg.algo.router_aux_loss_coef)
        return self.balance

    def router_loads(self, plan: list, model: torch.nn.Module, balance: RouterBalance, mine: torch.Tensor,
                     batch: RolloutBatch, sequences, loss_masks, routings, pad_id: int) -> Tuple[torch.Tensor, float]:
        """The step's expert assignment counts [E] and rows (positions x MoE layers) over all ranks, from a no-grad
        pass over this rank's micro-batches (the same number of forwards on every rank, like the step's)."""
        counts, rows = 0, 0
        nothing = torch.zeros(0, dtype=torch.long, device=self.device)
        with torch.no_grad():
            for mb in plan:  # every rank has at least one entry, an idle pass if nothing else: it learns E from it
                with balance.capture() as routers:
                    if mb is None:
                        self.idle_pass(model, pad_id, backward=False)
                        positions = nothing
                    else:
                        _, _, _, logprobs, positions, routing = self.micro_batch(mb, mine, sequences, loss_masks,
                                                                                 routings, pad_id)
                        with autocast(self.cfg.trainer, self.device, model), self.replaying([model], routing):
                            logprobs(model)
                counts = counts + balance.count(routers, positions)
                rows += positions.numel() * len(routers)
        total = torch.cat([counts, torch.tensor([float(rows)], dtype=torch.float64, device=self.device)])
        if self.world > 1:
            dist.all_reduce(total)
        return total[:-1], max(float(total[-1]), 1.0)

    def replays_routing(self, batch: RolloutBatch, model: torch.nn.Module) -> bool:
        """Whether this step replays the batch's routing (`trainer.router_replay`, a MoE model, a batch that carries
        routing)."""
        return bool(self.cfg.trainer.router_replay and batch.routing is not None and moe_gates(model))

    @contextmanager
    def replaying(self, models: Sequence[torch.nn.Module], routing: Optional[torch.Tensor]):
        """`models` routed by `routing` (flat over the forward's tokens) inside; live routing with None."""
        if routing is None:
            yield
            return
        for m in models:
            if id(m) not in self.replays or self.replays[id(m)].model is not m:
                self.replays[id(m)] = Replay(m)
        with contextlib.ExitStack() as stack:
            for m in models:
                stack.enter_context(self.replays[id(m)].forcing(routing))
            yield

    @contextmanager
    def capture(self, balance: Optional[RouterBalance]):
        if balance is None:
            yield None
        else:
            with balance.capture() as routers:
                yield routers

    def logprobs(self, rows, samples, sequences, loss_masks, routings, sel, pad_id):
        """`f(model, with_entropy=False)`: the micro-batch's loss-token logprobs [N] (and entropies) under `model`,
        in the order of `sel` ([samples, L-1], the loss tokens after the first position); the flat positions of
        the forward's tokens that predict them; the experts of the forward's tokens [tokens, layers, k] in the order
        the routers see them, from `routings` (each sample's; None: live routing)."""
        chunk, temperature = self.cfg.trainer.logprob_chunk_tokens, self.cfg.algo.temperature
        if rows is not None:
            packed = pack(rows, sequences, {i: loss_masks[i][1:] for i in samples.tolist()}, pad_id,
                          routings).to(self.device)
            if self.context is not None:
                return self.context_logprobs(packed, pad_id)
            return (lambda m, with_entropy=False: packed_logprobs(m, packed, temperature, with_entropy, chunk),
                    packed.predictors, _flat(packed.routing))
        ids, attn = pad([sequences[i] for i in samples.tolist()], pad_id)
        ids, attn = ids.to(self.device), attn.to(self.device)
        routing = None
        if routings is not None:  # padding goes to expert 0: its outputs are never read
            routing = _flat(pad([routings[i] for i in samples.tolist()], 0)[0].to(self.device))

        def padded(m, with_entropy=False):
            logp, entropy = token_logprobs(m, ids, attn, temperature, with_entropy=with_entropy, chunk_tokens=chunk)
            return logp[sel], (entropy[sel] if entropy is not None else None)
        # Position t of a sample predicts its token t + 1: sel's columns are positions 0 .. L-2 of each row.
        return padded, torch.nonzero(torch.nn.functional.pad(sel, (0, 1)).reshape(-1)).flatten(), routing

    def context_logprobs(self, packed: Packed, pad_id: int):
        """`logprobs` of a packed micro-batch under context parallelism: this rank's W / cp positions of each row go
        through the model (attention exchanging heads over the context group), its targets' logprobs are gathered from
        the group, so every rank gets all N in order; the flat positions are this rank's own forward's."""
        chunk, temperature = self.cfg.trainer.logprob_chunk_tokens, self.cfg.algo.temperature
        sp = context.split(packed, self.context, pad_id)

        def f(m, with_entropy=False):
            logp, entropy = packed_logprobs(m, sp.local, temperature, with_entropy, chunk)
            return context.gather(logp, sp), (context.gather(entropy, sp) if entropy is not None else None)
        return f, sp.local.predictors, _flat(sp.local.routing)

    def idle_pass(self, model: torch.nn.Module, pad_id: int, backward: bool = True) -> None:
        """A forward (and backward) that adds nothing to the gradients, for a rank with fewer micro-batches than others:
        FSDP's and expert parallelism's collectives pair up across ranks."""
        ids = torch.tensor([[pad_id, pad_id]], device=self.device)
        with autocast(self.cfg.trainer, self.device, model):
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids),
                                     chunk_tokens=self.cfg.trainer.logprob_chunk_tokens)
        if backward:
            (logp.sum() * 0.0).backward()


def _flat(routing: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[rows, positions, layers, k] -> [rows x positions, layers, k]: the order a MoE layer's router sees tokens."""
    return routing.flatten(0, 1) if routing is not None else None
