"""GLM-5's sparse attention (DSA) over packed rows: the indexer's choice of keys, made the same for a sample packed or
alone.

DSA attends each query to the `index_topk` keys its indexer scores highest (a ReLU'd dot product per indexer head,
weighted per query and summed over the heads), among the keys the attention mask allows. A packed row's mask allows a
query its own segment and the shared prompt, the keys it has alone, in the same order and at the same positions; so
the scores are the same. What is not the same is the choice among equal scores: the ReLU makes many scores exactly 0,
and torch.topk keeps an unspecified one of tied keys, which depends on where they sit in the row (measured on the
tiny GLM-5 with index_topk 16: 8 of 457 top-k boundaries tied, moving a packed sample's logprobs by up to 6e-2).

The trainer's indexer therefore breaks ties by order: among equal scores the earlier key is kept (a stable sort),
which is the same key packed or alone. Everything else is the model's own computation. With a cache (generation,
evaluation) it scores the new positions' queries against the cached keys as transformers' does, and chooses by the
same rule: the transformers engine installs it too (rlhpc/infer/engines/hf.py), so that its logprobs are the
trainer's (mismatch KL 0 in fp32 where transformers' choice gave ~1e-4). vLLM runs its own indexer, whose ties fall
as they fall.

It scores its queries a block at a time (trainer.attention_block_elements): transformers' indexer holds the float32
scores of every query against every key for each indexer head at once, (2 x heads + 1) x T x T x 4 B at its peak
(16 GiB for GLM-5 at 8192 tokens, 65 GiB at 16384); a block holds (2 x heads + 1) x attention_block_elements x 4 B
(1 GiB at the default 4M), whatever T. A query's scores are its own, so the choice is the same.

The trainer's model gets the packed rows' segments instead of a mask (rlhpc/train/attention.py), and so does the
indexer: it builds each block's mask from them. Under context parallelism (trainer.cp > 1, rlhpc/train/context.py)
each rank scores its own positions' queries against the keys of the whole row, gathered from its context group (one
key head of index_head_dim per position: small next to the scores); the scores, and so the choice, are those of the
row on one rank. The attention then applies the choice.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from rlhpc.modeling.segments import segment_mask
from rlhpc.patches.registry import check as check_patch

if TYPE_CHECKING:
    from rlhpc.train.context import ContextGroup  # the trainer's: its cp, its rank and `gather`

SPARSE_ATTENTION = ("glm_moe_dsa",)  # models whose indexer `install` replaces


def install(model: torch.nn.Module, block_elements: int = 0, group: Optional["ContextGroup"] = None) -> bool:
    """Gives every DSA indexer of `model` the order-stable choice of keys; False for a model without one. With
    `block_elements` (trainer.attention_block_elements) the indexer scores its queries a block at a time: each block's
    [B, block, T] scores at most that many elements (x index_n_heads while they are summed over the heads). `group`:
    the context group whose ranks split the packed rows (trainer.cp > 1), which the indexer gathers the keys from."""
    if getattr(model.config, "model_type", None) not in SPARSE_ATTENTION:
        return False
    check_patch("dsa_indexer_forward")  # rlhpc/patches/registry.py
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    for module in model.modules():
        if isinstance(module, GlmMoeDsaIndexer):
            if not getattr(module, "rlhpc_stable", False):
                module.rlhpc_original_forward = module.forward
                module.forward = types.MethodType(_indexer_forward, module)
                module.rlhpc_stable = True
            module.rlhpc_block_elements, module.rlhpc_group = block_elements, group
    return True


def installed(model: torch.nn.Module) -> bool:
    return any(getattr(m, "rlhpc_stable", False) for m in model.modules())


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` highest scores along the last dimension; of equal scores the earlier position first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def index_scores(indexer, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings,
                 attention_mask: torch.Tensor) -> torch.Tensor:
    """The indexer's score of every key for every query [B, S, T], -inf where the mask forbids the key.
    `attention_mask`: bool or additive [B, S, T], or packed rows' segments [B, 1, W] (long) of which this rank holds
    S positions: all W when W == S, its part of a row split over its context group when W == cp x S."""
    queries, keys, weights, mask = _project(indexer, hidden_states, q_resid, position_embeddings, attention_mask)
    return _scores(indexer, queries, keys, weights, mask(0, queries.shape[1]))


def choose(indexer, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings,
           attention_mask: torch.Tensor, block_elements: int = 0, past_key_values=None) -> torch.Tensor:
    """The keys each query attends to, int32 [B, S, k]: the index_topk best scored (index_scores), of equal scores the
    earlier. With `block_elements` the queries are scored a block at a time (the same choice: each query's scores are
    its own), so the indexer's transient memory is that of a block, not of S x T scores."""
    queries, keys, weights, mask = _project(indexer, hidden_states, q_resid, position_embeddings, attention_mask,
                                            past_key_values)
    B, S, T = queries.shape[0], queries.shape[1], keys.shape[1]
    k = min(indexer.index_topk, T)
    block = max(1, block_elements // (B * T)) if block_elements else S
    if block >= S:
        return stable_topk(_scores(indexer, queries, keys, weights, mask(0, S)), k).to(torch.int32)
    out = torch.empty(B, S, k, dtype=torch.int32, device=queries.device)
    for lo in range(0, S, block):
        hi = min(lo + block, S)
        out[:, lo:hi] = stable_topk(_scores(indexer, queries[:, lo:hi], keys, weights[:, lo:hi], mask(lo, hi)), k)
    return out


def _project(indexer, hidden_states, q_resid, position_embeddings, attention_mask, past_key_values=None):
    """The indexer's queries [B, S, H, D], keys [B, T, D] (the whole row's, gathered from the context group when the
    row is split; with a cache, the cached keys and these), head weights [B, S, H], and the mask of the queries at
    [lo, hi) as `mask(lo, hi)`."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    B, S, _ = hidden_states.shape
    rope = indexer.qk_rope_head_dim
    queries = indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim)
    keys = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)  # one key head [B, S, 1, D]
    cos, sin = position_embeddings
    q_rope, k_rope = apply_rotary_pos_emb_interleave(queries[..., :rope], keys[..., :rope], cos, sin,
                                                     unsqueeze_dim=2)  # GLM-5's indexer: interleaved RoPE
    queries = torch.cat([q_rope, queries[..., rope:]], dim=-1)
    keys = torch.cat([k_rope, keys[..., rope:]], dim=-1).squeeze(2)  # [B, S, D]
    if past_key_values is not None:  # generation: the cache holds the earlier positions' keys
        keys = past_key_values.update_indexer(keys, indexer.layer_idx)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() \
        * indexer.n_heads ** -0.5  # [B, S, H]
    segments = _segments(attention_mask)
    if segments is None:  # a mask [B, S, T], or [B, 1, T] for every query
        return queries, keys, weights, lambda lo, hi: attention_mask[:, lo:hi] if attention_mask.shape[1] > 1 \
            else attention_mask
    start, width = 0, segments.shape[-1]
    if width != S:  # a row split over the context group: the whole row's keys
        group = getattr(indexer, "rlhpc_group", None)
        if group is None or width != S * group.cp:
            raise ValueError(f"the indexer got {S} positions of packed rows of {width}, and no context group splits "
                             "them so")
        keys, start = group.gather(keys), group.rank * S
    return queries, keys, weights, lambda lo, hi: segment_mask(segments, start + lo, start + hi, width)[:, 0]


def _scores(indexer, queries, keys, weights, mask) -> torch.Tensor:
    """Scores [B, Q, T] of queries [B, Q, H, D] (head weights [B, Q, H]) against keys [B, T, D]; mask [B, Q, T]."""
    per_head = F.relu(torch.matmul(queries.float(), keys.transpose(-1, -2).float().unsqueeze(1))
                      * indexer.softmax_scale)  # [B, Q, H, T]
    scores = torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)  # [B, Q, T]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def _segments(mask: torch.Tensor):
    """The packed rows' segments [B, W] that reach the indexer as its "mask" [B, 1, W] (long, not a mask), or None."""
    if mask.dim() == 3 and mask.shape[1] == 1 and not mask.is_floating_point() and mask.dtype != torch.bool:
        return mask[:, 0]
    return None


def chosen(indices: torch.Tensor, keys: int) -> torch.Tensor:
    """bool [B, 1, Q, keys]: whether each key is among those `indices` [B, Q, k] chose for each query (transformers'
    sdpa path makes the same mask from the same choice)."""
    mask = torch.zeros(*indices.shape[:2], keys, dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, indices.long(), True).unsqueeze(1)


@torch.no_grad()
def _indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                     past_key_values=None, **kwargs):
    return choose(self, hidden_states, q_resid, position_embeddings, attention_mask,
                  getattr(self, "rlhpc_block_elements", 0), past_key_values)
