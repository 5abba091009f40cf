"""Turning packed samples into model inputs, and logprobs out of the model, without per-token Python loops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch


@dataclass
class MicroBatch:
    """B sequences right-padded to length L; index arrays point back into the step's flat sample arrays."""

    input_ids: torch.Tensor  # long [B, L]
    attention_mask: torch.Tensor  # long [B, L]
    samples: torch.Tensor  # long [B], sample index within the step


def plan_micro_batches(lengths: torch.Tensor, token_budget: int) -> List[torch.Tensor]:
    """Groups samples (sorted by length, so padding is small) into micro-batches of at most `token_budget` padded tokens.
    A single sample longer than the budget gets a micro-batch of its own."""
    order = torch.argsort(lengths, descending=True).tolist()
    lens = lengths.tolist()
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, lens[i])
        if current and w * (len(current) + 1) > token_budget:
            batches.append(torch.tensor(current))
            current, w = [], lens[i]
        current.append(i)
        width = w
    if current:
        batches.append(torch.tensor(current))
    return batches


def balance_ranks(lengths: torch.Tensor, group_of: torch.Tensor, world: int) -> List[torch.Tensor]:
    """Splits samples over `world` ranks, whole groups together, balancing tokens (largest group first, to the
    lightest rank). Returns the sample indices of each rank."""
    num_groups = int(group_of.max()) + 1 if group_of.numel() else 0
    group_tokens = torch.zeros(num_groups, dtype=torch.long).index_add_(0, group_of, lengths)
    loads = [0] * world
    owner = [0] * num_groups
    for g in torch.argsort(group_tokens, descending=True).tolist():
        r = min(range(world), key=loads.__getitem__)
        owner[g] = r
        loads[r] += int(group_tokens[g])
    owner_t = torch.tensor(owner, dtype=torch.long)[group_of]
    return [torch.nonzero(owner_t == r).flatten() for r in range(world)]


def pad(sequences: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : s.numel()] = s
        mask[i, : s.numel()] = 1
    return ids, mask


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each token given its prefix under softmax(logits / temperature): [B, L-1] for tokens 1..L-1.
    Entropy (no gradient) of the same distributions if asked."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
    return out, entropy
