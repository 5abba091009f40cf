"""Hugging Face checkpoint names of a model's tensors, and back.

transformers 5 keeps the routed experts of a MoE layer fused in memory, one tensor per projection for all experts:

    <layer>.mlp.experts.gate_up_proj   [E, 2*I, H]   rows [:I] are expert j's gate_proj, rows [I:] its up_proj
    <layer>.mlp.experts.down_proj      [E, H, I]

while checkpoints (and so vLLM and every other loader) name each expert's projections:

    qwen2_moe family (qwen3_moe, glm_moe_dsa, glm4_moe, deepseek_v3, ...):
        <layer>.mlp.experts.{j}.gate_proj.weight / up_proj.weight / down_proj.weight
    mixtral family (mixtral, minimax_m2): the whole `mlp` block is called `block_sparse_moe`, and
        <layer>.block_sparse_moe.experts.{j}.w1.weight (gate) / w3.weight (up) / w2.weight (down)

These are the inverse of the WeightConverters in transformers' conversion_mapping.py ("qwen2_moe": MergeModulelist(0)
then Concatenate(1) of gate, up; "mixtral": the same over w1, w3, plus the `.block_sparse_moe.` -> `.mlp.` renaming),
which is also what `save_pretrained` reverts. tests/test_names.py checks the stream against `save_pretrained`'s
safetensors for both families. A model type with fused experts outside these families is refused rather than guessed.

The weights contract (shared/DESIGN.md) is that tensors travel under checkpoint names: the trainer's stream goes
through `CheckpointNames.to_checkpoint`, and an engine writes what it receives with a `Loader`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

_FUSED = re.compile(r"(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)")


@dataclass(frozen=True)
class ExpertLayout:
    """How one family of checkpoints names the MoE block and each expert's three projections."""

    block: str  # checkpoint name of the block that holds `experts` (in memory it is always `mlp`)
    gate: str
    up: str
    down: str


QWEN2_MOE = ExpertLayout(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL = ExpertLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2")

# Model types by the conversion family transformers loads them with (conversion_mapping.py); other model types are
# looked up in transformers' own table when it has one.
_FAMILY = {
    "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN2_MOE, "qwen3_next": QWEN2_MOE, "glm4_moe": QWEN2_MOE,
    "glm_moe_dsa": QWEN2_MOE, "deepseek_v2": QWEN2_MOE, "deepseek_v3": QWEN2_MOE, "olmoe": QWEN2_MOE,
    "mixtral": MIXTRAL, "minimax": MIXTRAL, "minimax_m2": MIXTRAL,
}


def layout_for(model_type: str) -> Optional[ExpertLayout]:
    if model_type in _FAMILY:
        return _FAMILY[model_type]
    try:  # transformers' map of model types to the conversion they share (private; absent in other versions)
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN
    except ImportError:
        return None
    return {"qwen2_moe": QWEN2_MOE, "mixtral": MIXTRAL}.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type, ""))


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor lives in memory: a whole tensor, or one expert's slice of a fused one."""

    name: str  # in-memory name
    expert: Optional[int] = None  # index along dim 0 of the fused tensor
    half: Optional[int] = None  # gate_up_proj only: 0 = gate rows [:I], 1 = up rows [I:]

    def view(self, fused: torch.Tensor) -> torch.Tensor:
        if self.expert is None:
            return fused
        t = fused[self.expert]
        if self.half is None:
            return t
        rows = t.shape[0] // 2
        return t[self.half * rows : (self.half + 1) * rows]


class CheckpointNames:
    """Translates between a model's in-memory parameter names and its Hugging Face checkpoint names."""

    def __init__(self, model_type: str):
        self.model_type = model_type
        self.layout = layout_for(model_type)
        lay = self.layout or QWEN2_MOE
        self._per_expert = re.compile(
            rf"(?P<layer>.+)\.{re.escape(lay.block)}\.experts\.(?P<j>\d+)"
            rf"\.(?P<proj>{lay.gate}|{lay.up}|{lay.down})\.weight"
        )

    @classmethod
    def of(cls, model: torch.nn.Module) -> "CheckpointNames":
        return cls(getattr(getattr(model, "config", None), "model_type", "") or "")

    def to_checkpoint(self, name: str, tensor: torch.Tensor) -> Iterator[Tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs of one in-memory tensor: one pair, or 2E / E for fused experts (views, no
        copies)."""
        m = _FUSED.fullmatch(name)
        if m is None:
            yield self._rename_block(name), tensor
            return
        lay = self._require_layout(name)
        prefix = f"{m['layer']}.{lay.block}.experts"
        if m["proj"] == "gate_up_proj":
            rows = tensor.shape[1] // 2
            for j in range(tensor.shape[0]):
                yield f"{prefix}.{j}.{lay.gate}.weight", tensor[j, :rows]
                yield f"{prefix}.{j}.{lay.up}.weight", tensor[j, rows:]
        else:
            for j in range(tensor.shape[0]):
                yield f"{prefix}.{j}.{lay.down}.weight", tensor[j]

    def from_checkpoint(self, name: str) -> Slot:
        """The in-memory slot of a checkpoint name. In-memory names map to themselves."""
        m = self._per_expert.fullmatch(name) if self.layout is not None else None
        if m is None:
            if self.layout is MIXTRAL:
                name = name.replace(f".{MIXTRAL.block}.", ".mlp.")
            return Slot(name)
        lay, proj = self.layout, m["proj"]
        if proj == lay.down:
            return Slot(f"{m['layer']}.mlp.experts.down_proj", int(m["j"]))
        return Slot(f"{m['layer']}.mlp.experts.gate_up_proj", int(m["j"]), 0 if proj == lay.gate else 1)

    def _rename_block(self, name: str) -> str:
        if self.layout is MIXTRAL:
            return name.replace(".mlp.", f".{MIXTRAL.block}.")
        return name

    def _require_layout(self, name: str) -> ExpertLayout:
        if self.layout is None:
            raise NotImplementedError(
                f"{name}: fused MoE experts of model type {self.model_type!r}, whose checkpoint layout rlhpc does not "
                "know; add its family to rlhpc/modeling/names.py (see transformers' conversion_mapping.py)"
            )
        return self.layout


def state_tensors(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """What `save_pretrained` saves, in memory names: parameters and persistent buffers (e.g. a router's
    e_score_correction_bias), each once — tied weights under their first name — and without wrapper prefixes
    (activation checkpointing's state-dict hooks strip them; `named_parameters` would not). FSDP2 parameters come as
    DTensor shards."""
    seen = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t.detach()


def checkpoint_layout(model: torch.nn.Module,
                      dtype: Optional[torch.dtype] = None) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """(checkpoint name, shape, dtype) of every tensor the stream of `model` carries, in stream order, from metadata
    alone: no all-gather, no copy (FSDP2 shards report their global shape). With `dtype`, floating-point tensors are
    listed in it (a stream cast to the serving dtype)."""
    names = CheckpointNames.of(model)
    out = []
    for name, t in state_tensors(model):
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        meta = torch.empty(t.shape, dtype=dt, device="meta")
        out.extend((n, tuple(v.shape), v.dtype) for n, v in names.to_checkpoint(name, meta))
    return out


class Loader:
    """Writes tensors received under checkpoint names into a model, per-expert slices into its fused experts."""

    def __init__(self, model: torch.nn.Module):
        self.names = CheckpointNames.of(model)
        # Every state-dict name, tied ones too (an update may name either), without wrapper prefixes.
        self.targets: Dict[str, torch.Tensor] = {n: t.detach() for n, t in model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        slot = self.names.from_checkpoint(name)
        target = self.targets.get(slot.name)
        if target is None:
            raise KeyError(f"weight update names {name!r}, which the inference model does not have")
        dest = slot.view(target)
        if dest.shape != tensor.shape:
            raise ValueError(f"weight update {name!r} has shape {tuple(tensor.shape)}; the inference model's is "
                             f"{tuple(dest.shape)} (is it the same model?)")
        dest.copy_(tensor)
