"""Routing replay for MoE models (config `trainer.router_replay`): the engine records which experts each MoE layer
chose for every token it ran through the model, the records travel with the tokens in the queue file, and the
trainer's forward uses exactly those experts, so a token whose routing is nearly tied is not sent to other experts by
the trainer's different numerics (batch shape, kernels, dtype) than the engine sampled it with.

A routing is an integer tensor [tokens, layers, k]: per token, per MoE layer (in model order), the k expert ids the
layer's router picked. Ids are stored as uint8 when a layer has at most 256 experts, else int16 (`storage_dtype`).

Only the choice of experts is replayed. The routing weights are recomputed from the live router's logits at the
replayed experts, as the model's own router turns logits into weights (softmax or sigmoid scores, renormalized over
the k, scaled), so the loss's gradient still reaches the router. Which of those formulas a router uses is checked on
its first forward against the weights it computed itself: a router that neither reproduces is refused, never guessed.

Both sides hook each MoE layer's router module (`mlp.gate` in transformers' MoE models: qwen3_moe, glm_moe_dsa,
minimax_m2, deepseek_v3, glm4_moe), whose forward returns (router_logits, top_k_weights, top_k_index) over the
flattened [tokens, hidden] states of the layer: the experts module (transformers' or rlhpc's expert-parallel one)
receives whatever the hook returns, so replay works unchanged under expert parallelism.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn


def moe_gates(model: nn.Module) -> List[nn.Module]:
    """The routers of `model`'s MoE layers, in layer order (empty for a dense model)."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and isinstance(getattr(m, "top_k", None), int)]


def shape(model: nn.Module) -> Optional[Tuple[int, int, int]]:
    """(MoE layers, experts per token, experts per layer) of `model`; None for a dense model."""
    gates = moe_gates(model)
    if not gates:
        return None
    return len(gates), gates[0].top_k, int(gates[0].weight.shape[0])


def storage_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype that holds every expert id."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def bytes_per_token(layers: int, top_k: int, num_experts: int) -> int:
    """Queue-file bytes one token's routing takes."""
    return layers * top_k * storage_dtype(num_experts).itemsize


class Recorder:
    """Records the experts each router of `model` picks, call by call, while `recording()` is active (the engine's
    prefill and decode steps)."""

    def __init__(self, model: nn.Module):
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError(f"{type(model).__name__} has no MoE layers whose routing could be recorded")
        self.dtype = storage_dtype(int(self.gates[0].weight.shape[0]))
        self.calls: Optional[List[List[torch.Tensor]]] = None  # per layer, the [tokens, k] ids of each forward
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def keep(module, args, out):
            if self.calls is not None:
                self.calls[layer].append(out[2].detach().to(self.dtype))
        return keep

    @contextmanager
    def recording(self) -> Iterator[List[List[torch.Tensor]]]:
        """The ids of each forward run inside, per layer: `calls[layer][i]` is [tokens of forward i, k]."""
        self.calls = [[] for _ in self.gates]
        try:
            yield self.calls
        finally:
            self.calls = None


def _softmax_weights(gate: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """qwen3_moe and other softmax routers: softmax over all experts, the k picked, renormalized if configured."""
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
    if getattr(gate, "norm_topk_prob", False):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _sigmoid_weights(gate: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """glm_moe_dsa, deepseek_v3, glm4_moe, minimax_m2: sigmoid scores of the k picked (the selection bias only
    chooses), renormalized (minimax_m2 always), scaled."""
    w = logits.float().sigmoid().gather(1, index)
    if getattr(gate, "norm_topk_prob", True):
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * getattr(gate, "routed_scaling_factor", 1.0)


_WEIGHTS: Tuple[Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], ...] = (_softmax_weights,
                                                                                          _sigmoid_weights)


class Replay:
    """Forces the routers of `model` to the experts of a given routing while `forcing(routing)` is active; outside it
    (or with None) the routers choose live."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.gates = moe_gates(model)
        self.routing: Optional[torch.Tensor] = None  # long [tokens of the forward, layers, k]
        self.weights: Dict[int, List[Callable]] = {}  # each router's formula, once its forwards single it out
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def force(gate, args, out):
            logits, live_weights, live_index = out
            weights = self.weights.get(layer) or _formula(gate, logits, live_weights, live_index)
            if len(weights) == 1:
                self.weights[layer] = weights
            if self.routing is None:
                return None
            index = self.routing[:, layer]
            if index.shape != live_index.shape:
                raise ValueError(f"the replayed routing has {list(index.shape)} experts for MoE layer {layer}, whose "
                                 f"router picked {list(live_index.shape)} in this forward")
            return logits, weights[0](gate, logits, index), index
        return force

    @contextmanager
    def forcing(self, routing: Optional[torch.Tensor]):
        """Routes every forward inside by `routing` ([tokens, layers, k], the tokens in the order the routers see them:
        the forward's [batch, positions] flattened). Keep it active through the backward: activation checkpointing
        runs the forward again there."""
        self.routing = routing.long() if routing is not None else None
        try:
            yield
        finally:
            self.routing = None


def _formula(gate: nn.Module, logits: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> List[Callable]:
    """The formulas of _WEIGHTS that give `gate`'s own weights from its logits at its own experts. Several can agree
    on one forward (a router whose logits are all zero): the router's formula is known once only one does."""
    with torch.no_grad():
        found = [f for f in _WEIGHTS
                 if torch.allclose(f(gate, logits, index).float(), weights.float(), rtol=1e-4, atol=1e-6)]
    if not found:
        raise NotImplementedError(f"{type(gate).__name__} turns router logits into routing weights in a way routing "
                                  "replay does not know (softmax or sigmoid, renormalized, scaled); set "
                                  "trainer.router_replay=false")
    return found
