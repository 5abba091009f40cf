"""Chunked logprobs: the same logprobs, entropy and gradients as the full [tokens x vocabulary] computation, without
ever holding that tensor, also under FSDP2; the model still generates afterwards."""

import multiprocessing as mp
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.procs import free_port
from rlhpc.train.batching import pad, token_logprobs

CTX = mp.get_context("forkserver")  # preloaded with torch and the trainer (tests/conftest.py)
SEQS = [[5, 9, 44, 70, 2, 3, 120, 121, 30, 31, 32], [7, 8, 100, 101, 102, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2), tmp_path_factory.mktemp("m"))


def batch():
    return pad([torch.tensor(s) for s in SEQS], 0)


def logprob_grads(model, chunk_tokens, scale=1.0, ids_attn=None, with_entropy=True):
    """Logprobs, entropy and the gradients of a weighted logprob sum (a stand-in for a policy loss)."""
    ids, attn = ids_attn or batch()
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs(model, ids, attn, temperature=0.7, with_entropy=with_entropy, chunk_tokens=chunk_tokens)
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp) * attn[:, 1:]
    ((lp * weights).sum() * scale).backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


def same_gradient(got, want):
    """Equal up to fp32 summation order, relative to the tensor's scale."""
    return float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_chunked_logprobs_entropy_and_gradients_equal_the_full_computation(model_dir):
    model = models.load_model(model_dir)
    lp_full, ent_full, g_full = logprob_grads(model, chunk_tokens=0)
    lp, ent, g = logprob_grads(model, chunk_tokens=7)  # 30 positions: 4 full chunks and a partial one
    assert torch.allclose(lp, lp_full, atol=1e-5)
    assert torch.allclose(ent, ent_full, atol=1e-5)
    assert ent.min() > 0.1 and not ent.requires_grad
    for name, grad in g_full.items():
        assert same_gradient(g[name], grad), name
    assert min(float(x.abs().max()) for x in g_full.values()) > 0  # every parameter has a real gradient
    lp_only, no_entropy, g_only = logprob_grads(model, chunk_tokens=7, with_entropy=False)
    assert no_entropy is None and torch.equal(lp_only, lp)
    assert all(torch.equal(g_only[n], x) for n, x in g.items())


class LargestLogits(TorchDispatchMode):
    """Records the most token rows any logits-like tensor (last dimension the vocabulary; the head's weight and its
    gradient, [hidden, vocab], aside) had in the forward and backward passes."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.vocab, self.hidden, self.rows = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                if tuple(t.shape) != (self.hidden, self.vocab):
                    self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_chunked_logprobs_never_hold_more_than_a_chunk_of_logits(model_dir):
    model = models.load_model(model_dir)
    vocab = model.config.vocab_size
    ids, attn = batch()
    sizes = {}
    for chunk in (0, 4):
        with LargestLogits(vocab, model.config.hidden_size) as spy:
            logprob_grads(model, chunk_tokens=chunk)
        sizes[chunk] = spy.rows
    assert sizes[0] >= ids.shape[0] * (ids.shape[1] - 1)  # the full path holds every position's logits
    assert sizes[4] == 4


def test_the_model_still_generates_after_chunked_logprobs(model_dir):
    from rlhpc.infer.engines.hf import HFEngine

    model = models.load_model(model_dir)
    ids, attn = batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=attn).logits
        plain = HFEngine(models.load_model(model_dir), 0).generate(SEQS, 1, 1.0, 6, [2], greedy=True)
        token_logprobs(model, ids, attn, chunk_tokens=4)
        after = model(input_ids=ids, attention_mask=attn).logits
    assert torch.equal(after, before)
    assert HFEngine(model, 0).generate(SEQS, 1, 1.0, 6, [2], greedy=True) == plain
    assert sorted(models.load_model(model_dir).state_dict()) == sorted(model.state_dict())  # names untouched


def _fsdp_worker(model_dir, rank, world, port, out):
    try:
        import torch.distributed as dist

        from rlhpc.config.schema import TrainerConfig
        from rlhpc.train.parallel import apply_fsdp

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = apply_fsdp(models.load_model(model_dir), TrainerConfig(), torch.device("cpu"))
        ids, attn = batch()
        mine = slice(rank * 2, rank * 2 + 2)  # rank 0: sequences 0-1, rank 1: sequence 2
        ids_attn = (ids[mine], attn[mine])
        lp, ent, grads = logprob_grads(model, chunk_tokens=5, scale=world, ids_attn=ids_attn)  # FSDP averages
        grads = {n: g.full_tensor().numpy().copy() for n, g in grads.items()}
        if rank == 0:
            out.put(("ok", grads))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc()))


@pytest.mark.slow
def test_chunked_logprobs_under_fsdp2_give_the_single_process_gradients(model_dir):
    port = free_port()
    out = CTX.Queue()
    procs = [CTX.Process(target=_fsdp_worker, args=(model_dir, r, 2, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        status, grads = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert status == "ok", grads
    # One process, full logits, the whole batch: the weights of each rank's rows are the same as in the split run.
    model = models.load_model(model_dir)
    ids, attn = batch()
    want = {}
    for rows in (slice(0, 2), slice(2, 3)):
        _, _, g = logprob_grads(model, chunk_tokens=0, ids_attn=(ids[rows], attn[rows]))
        for n, x in g.items():
            want[n] = want.get(n, 0) + x
    for name, g in want.items():
        assert same_gradient(torch.from_numpy(grads[name]), g), name
