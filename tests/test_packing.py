"""Packing a group's samples behind their shared prompt (trainer.packing=shared_prefix): each sample gets the logprobs
and gradients it gets alone, for the dense and MoE model families and GLM-5, and the rows hold far fewer tokens than the
samples. GLM-5's sparse attention follows the packing mask once its indexer keeps the earlier of tied keys
(rlhpc/modeling/sparse.py): with transformers' indexer, whose ties fall by position, the same comparison differs by
~6e-2."""

from pathlib import Path

import pytest
import torch

from rlhpc.modeling import models
from rlhpc.modeling import sparse
from rlhpc.train import attention as segment_attention
from rlhpc.train.batching import ATTENTION, common_prefix, pack, packed_logprobs, plan_rows, token_logprobs
from rlhpc.train.step import packs
from test_moe import preset

VOCAB = 100


def rollouts(seed=0):
    """Three groups: two share a prompt (of 7 and 12 tokens), one has none; completions of 1 to 9 tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs, group_of = [], []
    for group, prompt_len in enumerate((7, 12, 0)):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g)
        for _ in range(4):
            n = int(torch.randint(1, 10, (1,), generator=g))
            seqs.append(torch.cat([prompt, torch.randint(3, VOCAB, (n if prompt_len else n + 3,), generator=g)]))
            group_of.append(group)
    return seqs, torch.tensor(group_of)


def test_rows_hold_each_prompt_once_and_respect_their_size():
    seqs, group_of = rollouts()
    assert common_prefix(seqs[:4]) >= 7 and common_prefix(seqs[8:]) < 3
    rows = plan_rows(range(len(seqs)), seqs, group_of, row_tokens=30)
    assert sorted(i for r in rows for i in r.samples) == list(range(len(seqs)))  # every sample once
    assert all(r.length(seqs) <= 30 or len(r.samples) == 1 for r in rows)
    assert sum(r.length(seqs) for r in rows) < sum(len(s) for s in seqs)  # the prompts are not repeated


def test_glm5_packs_once_its_indexer_breaks_ties_by_order(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(segment_attention, "_INSTALLED", None)  # restored after the test
    models.build(preset("tiny_glm5"), tmp_path / "glm5")
    models.build(preset("tiny_qwen3_moe"), tmp_path / "moe")
    glm5 = models.load_model(tmp_path / "glm5")
    assert not packs(glm5)  # transformers' indexer: ties fall by position, so a packed sample's keys could differ
    assert segment_attention.install(glm5, 1, block_elements=60)  # the rows' segments, in blocks...
    assert packs(glm5)  # ...and the trainer's indexer (rlhpc/modeling/sparse.py)
    assert packs(models.load_model(tmp_path / "moe"))


def test_the_trainers_indexer_keeps_the_keys_transformers_keeps_except_among_ties(tmp_path: Path):
    """The order-stable indexer scores keys as transformers' does; it differs only in which of equally scored keys
    at the top-k boundary it keeps (there the earlier one)."""
    models.build(preset("tiny_glm5"), tmp_path / "glm5")
    model = models.load_model(tmp_path / "glm5").eval()
    calls = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, kwargs: calls.append((mod, args, kwargs)), with_kwargs=True)
             for m in model.modules() if type(m).__name__ == "GlmMoeDsaIndexer"]
    seqs, _ = rollouts()
    with torch.no_grad():
        for s in seqs:
            model(s.unsqueeze(0) % model.config.vocab_size, use_cache=False)
    for h in hooks:
        h.remove()
    assert calls
    sparse.install(model, block_elements=60)  # its queries a block of 1 or 2 at a time
    boundaries = ties = 0
    for mod, args, kwargs in calls:
        theirs = mod.rlhpc_original_forward(*args, **kwargs).long().sort(-1).values
        ours = mod(*args, **kwargs).long().sort(-1).values
        scores = sparse.index_scores(mod, *args[:3], args[3])
        k = ours.shape[-1]
        if k == scores.shape[-1]:  # every key is kept
            assert torch.equal(ours, theirs)
            continue
        top = scores.sort(-1, descending=True).values
        tied = top[..., k - 1] == top[..., k]  # a tie at the boundary, among allowed keys or masked ones
        boundaries += tied.numel()
        ties += int((tied & torch.isfinite(top[..., k])).sum())
        assert torch.equal(ours[~tied], theirs[~tied])
    assert boundaries > 100 and ties > 0  # the comparison saw real choices, and ties among them


# "rlhpc": the trainer's attention over packed rows from their segments (rlhpc/train/attention.py), here in blocks of
# a few queries (a mask of at most 60 elements at a time) whose backward recomputes them.
# GLM-5 (as the trainer runs it): the same, with its indexer's choice in each block's mask, the indexer scoring its
# queries a few at a time (rlhpc/modeling/sparse.py).
@pytest.mark.parametrize("name,attention", [("tiny_qwen3", "sdpa"), ("tiny_qwen3", "eager"), ("tiny_qwen3_moe", "sdpa"),
                                            ("tiny_qwen3", ATTENTION), ("tiny_qwen3_moe", ATTENTION),
                                            ("tiny_glm5", ATTENTION)])
@pytest.mark.parametrize("chunk", [0, 16])
def test_each_packed_sample_gets_the_logprobs_and_gradients_it_gets_alone(tmp_path: Path, name, attention, chunk,
                                                                          monkeypatch):
    cfg = preset(name)
    models.build(cfg, tmp_path / "model")
    model = models.load_model(tmp_path / "model")
    if attention == ATTENTION:
        monkeypatch.setattr(segment_attention, "_INSTALLED", None)
        assert segment_attention.install(model, 1, block_elements=60)
    else:
        model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    model.train()
    seqs, group_of = rollouts()
    seqs = [s % model.config.vocab_size for s in seqs]
    # Alone: one sample per forward, no padding; the logprob of every token after the first.
    alone = [token_logprobs(model, s.unsqueeze(0), torch.ones(1, len(s), dtype=torch.long), 0.7,
                            chunk_tokens=chunk)[0][0] for s in seqs]
    torch.stack([a.sum() for a in alone]).sum().backward()
    grads_alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # Packed: rows of at most 25 tokens, padded to the longest row; wanted = every position.
    rows = plan_rows(range(len(seqs)), seqs, group_of, row_tokens=25)
    assert any(len(r.samples) > 1 and r.prefix > 0 for r in rows)
    order = [i for r in rows for i in r.samples]
    packed = pack(rows, seqs, {i: torch.ones(len(s) - 1, dtype=torch.bool) for i, s in enumerate(seqs)}, pad_id=0)
    logp, entropy = packed_logprobs(model, packed, 0.7, with_entropy=True, chunk_tokens=chunk)
    expected = torch.cat([alone[i] for i in order])
    assert logp.shape == expected.shape and entropy.shape == expected.shape
    assert torch.allclose(logp, expected.detach(), atol=1e-5), (logp - expected).abs().max()
    logp.sum().backward()
    assert grads_alone
    for n, p in model.named_parameters():  # sums over a hundred tokens, added in another order: fp32 rounding only
        if n in grads_alone:
            scale = float(grads_alone[n].abs().max())
            assert float((p.grad - grads_alone[n]).abs().max()) <= 1e-4 * max(scale, 1e-3), (n, scale)
