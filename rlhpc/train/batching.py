"""Turning packed samples into model inputs, and logprobs out of the model, without per-token Python loops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from rlhpc.modeling.segments import PADDING, PREFIX, segment_mask
from rlhpc.patches.registry import check as check_patch

# Models whose attention does not follow a packed row's mask as a sample alone would: DeepSeek-V3.2's sparse attention
# picks its keys with an indexer whose ties fall by position (GLM-5's, the same kind, packs with the trainer's
# order-stable indexer: rlhpc/modeling/sparse.py). Their samples are padded one per row whatever trainer.packing says.
NO_CUSTOM_MASK = ("deepseek_v32",)

ATTENTION = "rlhpc"  # the attention implementation of a model that takes packed rows by their segments (attention.py)


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


@dataclass
class Row:
    """Samples of one group packed into one sequence: their common prefix once, then each sample's own suffix."""

    prefix: int  # tokens shared by all samples of the row (their group's common prefix)
    samples: List[int]  # sample indices within the step

    def length(self, sequences: Sequence[torch.Tensor]) -> int:
        return self.prefix + sum(int(sequences[i].numel()) - self.prefix for i in self.samples)


def common_prefix(seqs: Sequence[torch.Tensor]) -> int:
    """The number of leading tokens all of `seqs` share."""
    n = min(int(s.numel()) for s in seqs)
    if len(seqs) < 2 or n == 0:
        return n if len(seqs) == 1 else 0
    first = seqs[0][:n]
    same = torch.ones(n, dtype=torch.bool)
    for s in seqs[1:]:
        same &= s[:n] == first
    return n if bool(same.all()) else int(torch.argmin(same.int()))


def plan_rows(samples: Sequence[int], sequences: Sequence[torch.Tensor], group_of: torch.Tensor,
              row_tokens: int) -> List[Row]:
    """Packs the samples of each group into rows of at most `row_tokens` tokens (a sample longer than that gets a row
    of its own): the group's common prefix (its prompt) once per row, then the samples' suffixes. `sequences[i]` is
    sample i's tokens."""
    by_group: dict = {}
    for i in samples:
        by_group.setdefault(int(group_of[i]), []).append(i)
    rows = []
    for members in by_group.values():
        prefix = common_prefix([sequences[i] for i in members])
        members = sorted(members, key=lambda i: -int(sequences[i].numel()))
        current, length = [], prefix
        for i in members:
            own = int(sequences[i].numel()) - prefix
            if current and length + own > row_tokens:
                rows.append(Row(prefix, current))
                current, length = [], prefix
            current.append(i)
            length += own
        rows.append(Row(prefix, current))
    return rows


@dataclass
class Packed:
    """Rows of packed samples as model inputs, and where each wanted token's logprob comes from. In a row the prefix
    attends causally to itself, each sample's suffix to the prefix and causally to itself, never to another sample;
    positions restart after the prefix for each sample, so every sample sees exactly what it sees alone. Who attends
    to whom is kept as each position's segment (O(W) a row); `mask()` spells it out as [W, W] for attention that
    needs it whole."""

    input_ids: torch.Tensor  # long [R, W]
    position_ids: torch.Tensor  # long [R, W]
    segments: torch.Tensor  # long [R, W]: PREFIX, the j-th sample of the row (j >= 0), or PADDING
    predictors: torch.Tensor  # long [N], flat index (row * W + position) of the hidden state that predicts each target
    targets: torch.Tensor  # long [N]
    routing: Optional[torch.Tensor] = None  # [R, W, layers, k]: each position's replayed experts (padding: expert 0)

    def to(self, device) -> "Packed":
        return Packed(*(t.to(device) if t is not None else None
                        for t in (self.input_ids, self.position_ids, self.segments, self.predictors, self.targets,
                                  self.routing)))

    def mask(self) -> torch.Tensor:
        """bool [R, 1, W, W], True: attend."""
        W = self.segments.shape[1]
        return segment_mask(self.segments, 0, W, W)


def pack(rows: Sequence[Row], sequences: Sequence[torch.Tensor], wanted: Sequence[torch.Tensor],
         pad_id: int, routings: Optional[Sequence[torch.Tensor]] = None) -> Packed:
    """Packs `rows`. `wanted[i]` (bool, one per position 1..len-1 of sample i) selects the tokens whose logprob is
    needed; targets come sample by sample in row order, positions ascending (as `mask[:, 1:][mask]` orders them).
    `routings[i]` ([len, layers, k], optional): sample i's replayed experts, laid out as its tokens are."""
    width = max(r.length(sequences) for r in rows)
    R = len(rows)
    routing = None
    if routings is not None:  # padding goes to expert 0: its outputs are never read
        some = routings[rows[0].samples[0]]
        routing = torch.zeros((R, width) + tuple(some.shape[1:]), dtype=some.dtype)
    ids = torch.full((R, width), pad_id, dtype=torch.long)
    pos = torch.zeros((R, width), dtype=torch.long)
    seg = torch.full((R, width), PADDING, dtype=torch.long)
    predictors, targets = [], []
    for r, row in enumerate(rows):
        p = row.prefix
        first = sequences[row.samples[0]]
        ids[r, :p] = first[:p]
        pos[r, :p] = torch.arange(p)
        seg[r, :p] = PREFIX
        if routing is not None:  # the samples share the prefix's tokens; the first one's experts route it
            routing[r, :p] = routings[row.samples[0]][:p]
        at = p
        for j, i in enumerate(row.samples):
            seq = sequences[i]
            n = int(seq.numel())
            ids[r, at : at + n - p] = seq[p:]
            pos[r, at : at + n - p] = torch.arange(p, n)
            seg[r, at : at + n - p] = j
            if routing is not None:
                routing[r, at : at + n - p] = routings[i][p:]
            # Token t (1 <= t < n) is predicted by the hidden state of token t-1: in the prefix, or in the suffix.
            t = torch.nonzero(wanted[i]).flatten() + 1
            before = t - 1
            where = torch.where(before < p, before, at + before - p)
            predictors.append(r * width + where)
            targets.append(seq[t])
            at += n - p
    empty = torch.zeros(0, dtype=torch.long)
    return Packed(ids, pos, seg, torch.cat(predictors) if predictors else empty,
                  torch.cat(targets) if targets else empty, routing)


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


def pad(sequences: Sequence[torch.Tensor], pad_value: float | int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads tensors [L_i, ...] of one dtype into [B, L, ...] (keeping that dtype) and returns it with the
    attention mask [B, L]."""
    width = max(int(s.shape[0]) for s in sequences)
    ids = torch.full((len(sequences), width) + tuple(sequences[0].shape[1:]), pad_value, dtype=sequences[0].dtype)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = 1
    return ids, mask


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    with_entropy: bool = False, chunk_tokens: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each token given its prefix under softmax(logits / temperature): [B, L-1] for tokens 1..L-1.
    Entropy (no gradient) of the same distributions if asked.

    With `chunk_tokens` > 0 (config `trainer.logprob_chunk_tokens`) the [tokens, vocabulary] logits are never held at
    once: the output head computes them `chunk_tokens` rows at a time, keeps only each row's logprob and entropy, and
    recomputes a chunk's logits in the backward pass (ChunkedLogprobHead). 0 computes the full logits."""
    head = model.get_output_embeddings() if chunk_tokens > 0 and _plain_head(model) else None
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        return _target_logprobs(logits, input_ids[:, 1:], temperature, with_entropy)
    ChunkedLogprobHead.install(head)
    head.logprob_request = _Request(input_ids[:, 1:], temperature, chunk_tokens, with_entropy)
    try:
        # Through the model's own forward, so that FSDP2 has the head's parameters unsharded while it runs.
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, L-1, 2]
    finally:
        head.logprob_request = None
    return out[..., 0], (out[..., 1].detach() if with_entropy else None)


def packed_logprobs(model: torch.nn.Module, packed: Packed, temperature: float = 1.0, with_entropy: bool = False,
                    chunk_tokens: int = 2048) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (and entropy, no gradient) of each of `packed.targets` [N], from one forward over the packed rows. The
    output head runs only on the N predicting positions (chunked as in `token_logprobs`), not on every position."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == ATTENTION:  # rlhpc/train/attention.py: the segments themselves, never a [W, W] mask
        mask = packed.segments[:, None, None, :]
    elif impl == "eager":  # eager attention adds its mask
        dense = packed.mask()
        mask = torch.zeros(dense.shape, dtype=torch.float32, device=dense.device).masked_fill_(
            ~dense, torch.finfo(torch.float32).min)
    else:
        mask = packed.mask()
    inputs = dict(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, use_cache=False)
    head = model.get_output_embeddings() if chunk_tokens > 0 and _plain_head(model) else None
    if head is None:
        logits = model(**inputs).logits
        return _target_logprobs(logits.reshape(-1, logits.shape[-1])[packed.predictors], packed.targets, temperature,
                                with_entropy)
    ChunkedLogprobHead.install(head)
    head.logprob_request = _Request(packed.targets, temperature, chunk_tokens, with_entropy, packed.predictors)
    try:
        out = model(**inputs).logits  # [1, N, 2]: logprob, entropy
    finally:
        head.logprob_request = None
    return out[0, :, 0], (out[0, :, 1].detach() if with_entropy else None)


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full-logits path: logprob of `targets` under softmax(logits / temperature), and the entropy (no gradient)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
    return out, entropy


@dataclass
class _Request:
    targets: torch.Tensor  # long [B, L-1]; or [N] with `rows`
    temperature: float
    chunk_tokens: int
    with_entropy: bool
    rows: torch.Tensor | None = None  # long [N]: the flat positions (row * W + position) whose hidden states predict


# Config keys of models whose logits are not just the head's output (soft-capping, scaling): those take the full path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _plain_head(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if cfg is None or type(head) not in (torch.nn.Linear, ChunkedLogprobHead):
        return False
    return all(getattr(cfg, k, None) in (None, 1.0) for k in _LOGIT_TRANSFORMS)


class ChunkedLogprobHead(torch.nn.Linear):
    """The model's output head (an nn.Linear), computing token logprobs chunk by chunk when `token_logprobs` asks.

    `install` swaps the class of the existing head in place (as FSDP2 does for the modules it wraps), so parameter
    names, the state dict, save_pretrained and tied embeddings are untouched. Without a request it is the plain head,
    so generation and scoring still get logits. With one, it returns [B, L-1, 2] (logprob, entropy) computed
    `chunk_tokens` rows at a time by _ChunkLogprob, whose backward recomputes the chunk's logits: the head's peak
    memory is one or two [chunk_tokens, vocabulary] fp32 buffers instead of several [tokens, vocabulary] ones."""

    logprob_request: _Request | None = None

    @staticmethod
    def install(head: torch.nn.Linear) -> None:
        if type(head) is torch.nn.Linear:
            check_patch("chunked_logprob_head")  # rlhpc/patches/registry.py
            head.__class__ = ChunkedLogprobHead

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self.logprob_request
        if req is None:
            return super().forward(hidden)
        if req.rows is not None:  # packed rows: only the predicting positions
            shape = (1, req.targets.numel())
            h = hidden.reshape(-1, hidden.shape[-1])[req.rows]
            targets = req.targets
        else:
            B, Lm1 = shape = tuple(req.targets.shape)
            if hidden.shape[1] != Lm1 + 1:
                raise ValueError(f"the output head got {hidden.shape[1]} positions for {Lm1 + 1} input tokens")
            h = hidden[:, :-1].reshape(B * Lm1, hidden.shape[-1])
            targets = req.targets.reshape(B * Lm1)
        pieces = [
            _ChunkLogprob.apply(h[i : i + req.chunk_tokens], self.weight, self.bias, targets[i : i + req.chunk_tokens],
                                req.temperature, req.with_entropy)
            for i in range(0, targets.numel(), req.chunk_tokens)
        ]
        if not pieces:  # nothing wanted: an empty result that still depends on the head (FSDP's hooks run)
            empty = (h.sum() * 0.0).reshape(1).expand(0)
            return torch.stack([empty, empty], dim=-1).reshape(*shape, 2)
        logp = torch.cat([p[0] for p in pieces]).view(shape)
        entropy = torch.cat([p[1] for p in pieces]).view(shape)
        return torch.stack([logp, entropy], dim=-1)  # a new tensor (FSDP2 wants its output not to be a view)


class _ChunkLogprob(torch.autograd.Function):
    """Logprob of `targets` and entropy (no gradient) under softmax((h W^T + b) / T) for one chunk of rows.

    Saves only its inputs and the log-normalizer; the backward pass recomputes the logits into one buffer and turns it
    in place into d/dlogits = (onehot(target) - softmax) * grad / T."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, with_entropy):
        # Under autocast (one rank, mixed precision) the head's matmul runs in the autocast dtype, in the forward and
        # in the recomputation of the backward alike (which runs outside autocast).
        dev = h.device.type
        ctx.compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        logits = _scaled_logits(h, weight, bias, temperature, ctx.compute_dtype)  # fp32 [chunk, V], our own buffer
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if with_entropy:
            log_probs = logits.sub_(lse.unsqueeze(-1))
            entropy = -log_probs.exp().mul_(log_probs).sum(-1)
        else:
            entropy = torch.zeros_like(logp)
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        h, weight, bias, targets, lse = ctx.saved_tensors
        dt = ctx.compute_dtype
        grad = _scaled_logits(h, weight, bias, ctx.temperature, dt).sub_(lse.unsqueeze(-1)).exp_()  # softmax
        grad.mul_(-grad_logp.unsqueeze(-1)).scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(dt or weight.dtype)
        dh = (grad @ weight.to(grad.dtype)).to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = (grad.t() @ h.to(grad.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = grad.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dh, dw, db, None, None, None


def _scaled_logits(h, weight, bias, temperature, compute_dtype=None) -> torch.Tensor:
    if compute_dtype is not None:
        h, weight = h.to(compute_dtype), weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    with torch.autocast(h.device.type, enabled=False):
        logits = torch.nn.functional.linear(h, weight, bias).float()
    return logits.div_(temperature) if temperature != 1.0 else logits
