"""GLM-5's sparse attention (DSA) over packed rows: the indexer's choice of keys, made the same for a sample packed or
alone.

DSA attends each query to the `index_topk` keys its indexer scores highest (a ReLU'd dot product per indexer head,
weighted per query and summed over the heads), among the keys the attention mask allows. A packed row's mask allows a
query its own segment and the shared prompt, the keys it has alone, in the same order and at the same positions; so
the scores are the same. What is not the same is the choice among equal scores: the ReLU makes many scores exactly 0,
and torch.topk keeps an unspecified one of tied keys, which depends on where they sit in the row (measured on the
tiny GLM-5 with index_topk 16: 8 of 457 top-k boundaries tied, moving a packed sample's logprobs by up to 6e-2).

The trainer's indexer therefore breaks ties by order: among equal scores the earlier key is kept (a stable sort),
which is the same key packed or alone. Everything else is the model's own computation, and transformers' indexer
(whose ties fall as they fall) still runs wherever there is a cache (generation, evaluation).

Under context parallelism (trainer.cp > 1, rlhpc/train/context.py) the indexer gets the packed rows' segments instead
of a mask: each rank scores its own positions' queries against the keys of the whole row, gathered from its context
group (one key head of index_head_dim per position: small next to the scores), with the mask of those queries built
from the segments. The scores, and so the choice, are those of the row on one rank; each rank holds T / cp of the
quadratic scores. The attention then applies the choice (rlhpc/train/attention.py).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from rlhpc.train.batching import segment_mask
from rlhpc.train.context import gather_positions

SPARSE_ATTENTION = ("glm_moe_dsa",)  # models whose indexer `install` replaces


def install(model: torch.nn.Module) -> bool:
    """Gives every DSA indexer of `model` the order-stable choice of keys; False for a model without one."""
    if getattr(model.config, "model_type", None) not in SPARSE_ATTENTION:
        return False
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    for module in model.modules():
        if isinstance(module, GlmMoeDsaIndexer) and not getattr(module, "rlhpc_stable", False):
            module.rlhpc_original_forward = module.forward
            module.forward = types.MethodType(_indexer_forward, module)
            module.rlhpc_stable = True
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
    segments = _segments(attention_mask)
    if segments is not None:
        lo = 0
        if segments.shape[-1] != S:  # a row split over the context group: the whole row's keys
            from rlhpc.train.attention import context_of

            group = context_of(segments.shape[-1], S)
            keys, lo = gather_positions(keys, group), group.rank * S
        attention_mask = segment_mask(segments, lo, lo + S, segments.shape[-1])[:, 0]  # [B, S, W]
    per_head = F.relu(torch.matmul(queries.float(), keys.transpose(-1, -2).float().unsqueeze(1))
                      * indexer.softmax_scale)  # [B, S, H, T]
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() \
        * indexer.n_heads ** -0.5  # [B, S, H]
    scores = torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)  # [B, S, T]
    if attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask, float("-inf"))
    return scores + attention_mask


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
    if past_key_values is not None:  # generation: the cache holds the indexer's keys
        return self.rlhpc_original_forward(hidden_states, q_resid, position_embeddings, attention_mask,
                                           position_ids, past_key_values=past_key_values, **kwargs)
    scores = index_scores(self, hidden_states, q_resid, position_embeddings, attention_mask)
    return stable_topk(scores, min(self.index_topk, scores.shape[-1])).to(torch.int32)
