"""Expert parallelism (config `trainer.ep`): each MoE layer's routed experts live on `ep` ranks, E/ep each, and every
token row goes to the rank holding its expert and back, with all-to-all (gloo on CPU, NCCL on GPU).

Layout over a world of N = ep x dp ranks (rank r = e * dp + d):
- storage: the fused expert parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) are DTensors sharded on dim 0
  over the whole world, like FSDP2 shards every other parameter, so rank r stores experts [r E/N, (r+1) E/N). The
  layout does not depend on `ep`: a DCP checkpoint written at one `ep` resumes at any other, and the weights stream and
  exports (full_tensor, per-expert Hugging Face names: rlhpc/modeling/names.py) are those of the plain FSDP2 model;
- compute: the `dp` ranks e * dp .. e * dp + dp - 1 all-gather their stored chunks into the E/ep experts of expert
  group e (nothing to gather when ep = N); the `ep` ranks d, dp + d, ... exchange token rows with all-to-all.
  The all-to-all group strides over the world, the gather group is contiguous;
- gradients: a rank's local experts receive the gradients of the rows of every rank of its all-to-all group; the
  gather's backward sums them over its dp group (reduce-scatter) and divides by N, which is what FSDP2 does for every
  other parameter (the step scales each rank's loss by N: rlhpc/train/step.py), so the step's math is that of one rank.

Dispatch is dropless: every (token, k) row reaches its expert, so nothing is ever dropped. The experts' own forward
(transformers' module, including its `experts_implementation`) runs on the received rows with the local expert
indices; the router's top-k weights multiply each row on the rank that owns the token, as transformers' forward does.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

_FUSED = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place in the ep x dp layout and the two process groups it talks to."""

    ep: int
    dp: int
    ep_rank: int  # which expert group this rank computes: experts [ep_rank E/ep, (ep_rank+1) E/ep)
    ep_group: Optional[dist.ProcessGroup]  # the ep ranks exchanging token rows
    dp_group: Optional[dist.ProcessGroup]  # the dp ranks holding the same experts

    @staticmethod
    def make(ep: int) -> "ExpertGroups":
        """Collective: every rank of the world creates every group, in the same order."""
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = world // ep
        ep_group = dp_group = None
        for d in range(dp):
            g = dist.new_group([e * dp + d for e in range(ep)])
            if rank % dp == d:
                ep_group = g
        for e in range(ep):
            g = dist.new_group([e * dp + d for d in range(dp)]) if dp > 1 else None
            if rank // dp == e:
                dp_group = g
        return ExpertGroups(ep=ep, dp=dp, ep_rank=rank // dp, ep_group=ep_group, dp_group=dp_group)


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), ...] out, rows [sum(recv), ...] in; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: List[int], send: List[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _all_to_all(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, recv: List[int], send: List[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _GatherExperts(torch.autograd.Function):
    """This rank's stored experts -> its expert group's E/ep experts, in the compute dtype. Backward: the gradients
    summed over the dp group in float32, this rank's chunk kept, divided by the world size (FSDP2's average)."""

    @staticmethod
    def forward(ctx, stored: torch.Tensor, dtype: torch.dtype, group, dp: int, world: int) -> torch.Tensor:
        ctx.group, ctx.dp, ctx.world, ctx.dtype = group, dp, world, stored.dtype
        x = stored.to(dtype)
        if dp == 1:
            return x.view_as(x)  # autograd needs an output distinct from the input
        out = x.new_empty((x.shape[0] * dp,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.float()
        if ctx.dp > 1:
            mine = grad.new_empty((grad.shape[0] // ctx.dp,) + tuple(grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)
            grad = mine
        return (grad / ctx.world).to(ctx.dtype), None, None, None, None


class ExpertParallel(nn.Module):
    """A MoE layer's experts module, its experts spread over the ranks of `groups`. Same parameter names and forward
    signature as transformers' experts module it replaces: forward(hidden_states [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H]."""

    def __init__(self, experts: nn.Module, groups: ExpertGroups, mesh, compute_dtype: torch.dtype):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        names = {n for n, _ in experts.named_parameters()}
        if names != set(_FUSED):
            raise NotImplementedError(f"{type(experts).__name__} has parameters {sorted(names)}; expert parallelism "
                                      f"(trainer.ep) knows fused experts with exactly {list(_FUSED)}")
        self.num_experts = experts.gate_up_proj.shape[0]
        self.local_experts = self.num_experts // groups.ep
        self.groups, self.compute_dtype = groups, compute_dtype
        for name in _FUSED:  # stored as dim-0 shards over the world, like FSDP2's: no copy of the full tensor kept
            full = experts._parameters.pop(name)
            shard = distribute_tensor(full.detach(), mesh, [Shard(0)], src_data_rank=None)  # a local split, no comm
            self.register_parameter(name, nn.Parameter(shard, requires_grad=full.requires_grad))
        experts.num_experts = self.local_experts
        self._compute = (experts,)  # transformers' module runs the local experts; a tuple keeps it out of the state

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        g = self.groups
        world = dist.get_world_size()
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        with torch.no_grad():
            order = torch.argsort(flat, stable=True)  # rows grouped by expert, so by owning rank
            expert = flat[order]
            send = torch.bincount(expert // self.local_experts, minlength=g.ep)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=g.ep_group)
            send_l, recv_l = send.tolist(), recv.tolist()
            got_expert = _all_to_all(expert, recv_l, send_l, g.ep_group) - g.ep_rank * self.local_experts
        token = order // k
        rows = _AllToAll.apply(hidden_states[token], recv_l, send_l, g.ep_group)
        weights = [_GatherExperts.apply(getattr(self, n).to_local(), self.compute_dtype, g.dp_group, g.dp, world)
                   for n in _FUSED]
        out = self._run_local(rows, got_expert, weights)
        back = _AllToAll.apply(out, send_l, recv_l, g.ep_group)
        back = back * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token, back.to(hidden_states.dtype))

    def _run_local(self, rows: torch.Tensor, expert: torch.Tensor, weights: List[torch.Tensor]) -> torch.Tensor:
        """transformers' experts forward on the received rows, its fused parameters set to this group's experts."""
        module = self._compute[0]
        for name, w in zip(_FUSED, weights):
            setattr(module, name, w)
        try:
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            out = module(rows, expert.unsqueeze(-1), ones)
        finally:
            for name in _FUSED:
                delattr(module, name)
        if rows.shape[0] == 0:  # no rows here: keep the weights in the graph, so the gather's backward still runs
            out = out + sum(w.sum() for w in weights) * 0.0
        return out


def experts_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """The fused routed-experts modules of a Hugging Face MoE model, by name (a dense layer has none)."""
    return {name: m for name, m in model.named_modules()
            if name.endswith("mlp.experts") and all(isinstance(getattr(m, p, None), torch.Tensor) for p in _FUSED)}


def shard_experts(model: nn.Module, ep: int, mesh, compute_dtype: torch.dtype) -> List[nn.Parameter]:
    """Replaces every experts module of `model` by an ExpertParallel one; returns their parameters (which FSDP2 must
    leave alone). Collective."""
    from rlhpc.config.schema import ConfigError

    found = experts_modules(model)
    if not found:
        raise ConfigError(f"config key `trainer.ep`: {ep} needs a MoE model with fused routed experts; "
                          f"{type(model).__name__} has none (set trainer.ep=1)")
    world = dist.get_world_size()
    for name, m in found.items():
        n = m.gate_up_proj.shape[0]
        if n % world:
            raise ConfigError(f"config key `trainer.ep`: {name} has {n} experts, which must divide evenly over the "
                              f"{world} ranks (trainer.num_ranks) that store them")
    groups = ExpertGroups.make(ep)
    params: List[nn.Parameter] = []
    for name, m in found.items():
        parent_name, _, child = name.rpartition(".")
        wrapped = ExpertParallel(m, groups, mesh, compute_dtype)
        setattr(model.get_submodule(parent_name), child, wrapped)
        params += [wrapped.gate_up_proj, wrapped.down_proj]
    return params


class RouterStats:
    """Routed (token, expert) assignments per layer and expert, counted as the experts modules are called (padding
    included, every training forward of the policy); `collect` sums them over ranks. Dispatch is dropless, so the drop
    count is always 0."""

    def __init__(self, model: nn.Module):
        self.counts: Dict[str, torch.Tensor] = {}
        self.handles = []
        for name, m in model.named_modules():
            if name.endswith("mlp.experts") and hasattr(m, "gate_up_proj"):
                hook = self._hook(name, m.gate_up_proj.shape[0])
                self.handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))

    def _hook(self, name: str, num_experts: int):
        def count(module, args, kwargs):
            if not torch.is_grad_enabled():  # a no-grad pass (the router balance's count) is not a training forward
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            with torch.no_grad():
                c = torch.bincount(index.reshape(-1), minlength=num_experts)  # stays on the device
            self.counts[name] = self.counts.get(name, 0) + c
        return count

    def collect(self) -> Dict[str, float]:
        """Statistics of the assignments since the last call, over all ranks (collective when distributed)."""
        if not self.handles:
            return {}
        names = sorted(self.counts)  # every rank counted the same layers: every rank runs every forward
        if not names:
            return {}
        table = torch.stack([self.counts[n] for n in names]).to(torch.float64)
        self.counts = {}
        if dist.is_initialized():
            dist.all_reduce(table)
        table = table.cpu()
        mean = table.mean(dim=1).clamp_min(1e-9)
        load = table / mean[:, None]
        return {
            "moe/routed_tokens": float(table.sum()),
            "moe/load_max_over_mean": float(load.max()),  # the busiest expert of the worst layer
            "moe/load_min_over_mean": float(load.min()),
            "moe/unused_experts": float((table == 0).sum()),
            "moe/dropped_tokens": 0.0,
        }


class RouterBalance:
    """The router's load-balancing term in the RL loss (`algo.router_aux_loss_coef`): transformers' Switch-Transformer
    loss `load_balancing_loss_func`, E x sum_e f_e P_e, with f_e the fraction of (token, k) assignments routed to
    expert e and P_e the mean router probability of e, both over every MoE layer and over the positions that predict
    the step's loss tokens (each counted once per sample, as a padded batch holds them; packed rows share a prompt).

    f_e carries no gradient, and it is a property of the whole step: `count` adds up the assignments in a no-grad pass
    over the step's micro-batches before the first backward, and the ranks sum them. With those counts C_e and the
    step's N rows (positions x layers, all ranks), each micro-batch adds

        coef x E / N^2 x sum_e C_e x sum_{rows of the micro-batch} p_e

    to its loss: a sum over micro-batches and ranks that equals the term of one pass over the whole step, so any
    split (ranks, ep, micro-batches, packed or padded) gets the same loss and gradients. The extra pass costs about
    one forward of the step. Routers are read by forward hooks on each MoE layer's `mlp.gate`, whose output starts with
    the router logits [tokens, E]."""

    def __init__(self, model: nn.Module, coef: float):
        from rlhpc.config.schema import ConfigError

        self.model, self.coef = model, coef
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        hf_class = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")), None)
        hf_module = sys.modules.get(hf_class.__module__) if hf_class is not None else None
        gates = [m for name, m in model.named_modules()
                 if name.endswith("mlp.gate") and isinstance(getattr(m, "weight", None), torch.Tensor)]
        if not gates or not self.top_k or not hasattr(hf_module, "load_balancing_loss_func"):
            raise ConfigError(
                f"config key `algo.router_aux_loss_coef`: {coef} needs a MoE model trained with transformers' "
                f"load-balancing loss (qwen3_moe, minimax_m2, ...); {getattr(model.config, 'model_type', '?')} has "
                "none (GLM-5 balances its experts without one); set algo.router_aux_loss_coef=0")
        self.logits: Optional[List[torch.Tensor]] = None
        for gate in gates:
            gate.register_forward_hook(self._keep)

    def _keep(self, module, args, out) -> None:
        if self.logits is not None:
            self.logits.append(out[0] if isinstance(out, tuple) else out)

    @contextmanager
    def capture(self):
        """The router logits of each MoE layer of the forwards run inside, in layer order."""
        self.logits = []
        try:
            yield self.logits
        finally:
            self.logits = None

    def _probs(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.reshape(-1, logits.shape[-1])[positions].float(), dim=-1)

    def count(self, logits: List[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """Top-k assignments per expert [E] (float64) over `positions` (flat indices into the forward's tokens, repeats
        counted) of every layer, as transformers' loss picks them: top-k of the softmax."""
        counts = torch.zeros(logits[0].shape[-1], dtype=torch.float64, device=logits[0].device)
        with torch.no_grad():
            for layer in logits:
                top = torch.topk(self._probs(layer, positions), self.top_k, dim=-1).indices
                counts += torch.bincount(top.reshape(-1), minlength=counts.numel()).to(counts.dtype)
        return counts

    def term(self, logits: List[torch.Tensor], positions: torch.Tensor, counts: torch.Tensor,
             rows: float) -> torch.Tensor:
        """This micro-batch's share of the step's term, given the step's counts and rows (positions x layers)."""
        probs = sum(self._probs(layer, positions).sum(dim=0) for layer in logits)
        experts = counts.numel()
        return self.coef * experts * (counts.to(probs.dtype) * probs).sum() / (rows * rows)
