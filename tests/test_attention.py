"""Packed rows attend from their segments (rlhpc/train/attention.py): in blocks of queries the attention and its
gradients equal sdpa's over the whole [W, W] mask, what autograd keeps per layer grows linearly with the row instead of
with its square, and a model set up for it still generates as before."""

import pytest
import torch
import torch.nn.functional as F

from rlhpc.modeling import models
from rlhpc.train import attention
from rlhpc.train.batching import ATTENTION, Row, pack
from test_moe import preset


def packed_rows():
    """Two rows: a prompt of 20 tokens shared by three samples; one sample alone (shorter, so its row is padded)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.arange(20)
    seqs = [torch.cat([prompt, torch.randint(0, 50, (n,), generator=g)]) for n in (30, 17, 41)] + [torch.arange(60)]
    wanted = {i: torch.ones(len(s) - 1, dtype=torch.bool) for i, s in enumerate(seqs)}
    return pack([Row(20, [0, 1, 2]), Row(60, [3])], seqs, wanted, pad_id=0)


def test_blocks_of_queries_give_the_attention_and_gradients_of_the_whole_mask():
    packed = packed_rows()
    R, W = packed.segments.shape
    g = torch.Generator().manual_seed(1)
    # 4 query heads, 2 key/value heads (grouped-query attention)
    q, k, v = (torch.randn(R, h, W, 8, dtype=torch.float64, generator=g).requires_grad_() for h in (4, 2, 2))
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.mask(), enable_gqa=True)
    grad = torch.randn(whole.shape, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad(whole, (q, k, v), grad)
    # one block; blocks of 1, 3 and 37 queries (the last one shorter)
    for elements in (R * W * W, R * W, 3 * R * W, 37 * R * W):
        out = attention.segment_attention(q, k, v, packed.segments, None, elements)
        assert torch.allclose(out, whole, atol=1e-12), elements
        for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected):
            assert torch.allclose(got, want, atol=1e-12), elements


def _kept_bytes(W: int, block_elements: int) -> int:
    """Bytes autograd keeps for the backward of one attention call over one row of W positions."""
    segments = torch.full((1, W), -1)
    segments[0, W // 4 : W // 2], segments[0, W // 2 :] = 0, 1  # a prompt and two samples
    q, k, v = (torch.randn(1, 2, W, 16, requires_grad=True) for _ in range(3))
    kept = {}

    def keep(t):
        kept[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        attention.segment_attention(q, k, v, segments, None, block_elements)
    return sum(kept.values())


def test_blocks_of_queries_attend_only_to_the_keys_glm5s_indexer_chose():
    from rlhpc.modeling import sparse

    packed = packed_rows()
    R, W = packed.segments.shape
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(R, 4, W, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    topk = torch.randint(0, W, (R, W, 5), generator=g, dtype=torch.int32)  # any keys, masked ones included
    mask = packed.mask() & sparse.chosen(topk, W)
    assert 0 < int(mask.sum()) < int(packed.mask().sum())  # the choice leaves keys out
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad = torch.randn(whole.shape, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad(whole, (q, k, v), grad)
    for elements in (R * W * W, 3 * R * W):
        out = attention.segment_attention(q, k, v, packed.segments, None, elements, topk)
        # a query none of whose chosen keys it may see attends to nothing: NaN in both, as in transformers' sdpa path
        assert torch.allclose(out, whole, atol=1e-12, equal_nan=True), elements
        for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), expected):
            assert torch.allclose(got.nan_to_num(), want.nan_to_num(), atol=1e-12), elements


def test_glm5_set_up_for_packed_rows_still_generates_as_before(tmp_path, monkeypatch):
    # The trainer's GLM-5 runs this attention; generation and evaluation (a cache, a 2-D mask) then apply the
    # indexer's choice here as transformers' sdpa path does.
    from rlhpc.modeling import sparse

    glm5 = preset("tiny_glm5")
    glm5.extra["index_topk"] = 4
    models.build(glm5, tmp_path / "model")
    plain, installed = models.load_model(tmp_path / "model"), models.load_model(tmp_path / "model")
    monkeypatch.setattr(attention, "_INSTALLED", None)
    attention.register()
    for m in (plain, installed):  # the same choice of keys (ties by order) on both: only the attention differs
        sparse.install(m)
    assert plain.config._attn_implementation == "sdpa"  # transformers applies the choice itself
    installed.config._attn_implementation = ATTENTION  # as attention.install does
    prompt = torch.tensor([[5, 9, 2, 7, 7, 1, 4, 4, 6], [3, 3, 8, 0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 9, [1, 1, 1, 0, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        assert torch.allclose(plain(prompt, attention_mask=mask).logits, installed(prompt, attention_mask=mask).logits,
                              atol=1e-5)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(plain.generate(prompt, **kw), installed.generate(prompt, **kw))


def test_wide_rows_keep_no_mask_for_the_backward():
    whole = [_kept_bytes(W, 1 << 40) for W in (1024, 2048)]
    blocks = [_kept_bytes(W, 1 << 18) for W in (1024, 2048)]
    assert whole[1] > 3.5 * whole[0] and whole[1] > 4 * 2048 * 2048  # the whole mask, as float, kept
    assert blocks[1] <= 2.1 * blocks[0] and blocks[1] < 2048 * 2048  # q, k, v (and a segment per position) only


def test_a_model_set_up_for_packed_rows_still_generates_as_before(tmp_path, monkeypatch):
    models.build(preset("tiny_qwen3"), tmp_path / "model")
    plain, installed = models.load_model(tmp_path / "model"), models.load_model(tmp_path / "model")
    monkeypatch.setattr(attention, "_INSTALLED", None)
    assert attention.install(installed, 1, block_elements=60)
    assert installed.config._attn_implementation == ATTENTION
    prompt = torch.tensor([[5, 9, 2, 7, 7, 1], [3, 3, 8, 0, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(plain.generate(prompt, **kw), installed.generate(prompt, **kw))
    installed.save_pretrained(tmp_path / "export")
    assert ATTENTION not in (tmp_path / "export" / "config.json").read_text()  # exports load anywhere


@pytest.mark.slow
def test_a_step_over_packed_rows_in_blocks_has_the_loss_and_gradients_of_padded_samples(tmp_path):
    from rlhpc.config.schema import ModelConfig
    from rlhpc.run.rundir import RunDir
    from test_trainer_math import run_ranks

    RunDir(tmp_path).make()
    models.build(ModelConfig(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2),
                 tmp_path / "model")
    _, loss_padded, grads_padded = run_ranks(tmp_path, 1, {"trainer": {"packing": "padded"}})
    _, loss, grads = run_ranks(tmp_path, 1, {"trainer": {"packing": "shared_prefix", "attention_block_elements": 200}})
    assert abs(loss - loss_padded) < 1e-5
    assert max(float(g.abs().max()) for g in grads_padded.values()) > 1e-3
    assert max(float((grads[n] - g).abs().max()) for n, g in grads_padded.items()) < 1e-5
