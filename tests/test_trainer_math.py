"""Batching that does not change the math: a step's loss and gradients are the same for 1 or 2 FSDP2 ranks, for any
micro-batch size, and with a group's samples packed behind their shared prompt or padded one per row; checkpoints resume
exactly, also on a different number of ranks."""

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.identity import Identity
from rlhpc.run.procs import free_port
from rlhpc.run.rundir import RunDir
from rlhpc.transport.queue import Group, RolloutBatch

CTX = mp.get_context("forkserver")  # preloaded with torch and the trainer (tests/conftest.py)


def make_batch(vocab: int, seed: int = 0, groups: int = 4, group_size: int = 4) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 30, (groups * group_size,), generator=g)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(len(lengths)):  # a 5-token prompt, then the completion
        mask[offsets[i] + 5 : offsets[i + 1]] = True
    return RolloutBatch(
        tokens=_shared_prompts(torch.randint(3, vocab, (total,), generator=g), offsets, group_size),
        offsets=offsets,
        logprobs=torch.where(mask, -torch.rand(total, generator=g) * 3, torch.zeros(total)),
        loss_mask=mask,
        advantages=torch.randn(len(lengths), generator=g),
        group_of=torch.arange(groups).repeat_interleave(group_size),
        groups=[Group(uid=str(i), env="t", task_id=str(i), version=0, num_samples=group_size,
                      rewards=[0.0] * group_size, truncated=[False] * group_size) for i in range(groups)],
    )


def _shared_prompts(tokens: torch.Tensor, offsets: torch.Tensor, group_size: int) -> torch.Tensor:
    """The samples of a group start with the same 5-token prompt, as rollouts of one task do."""
    for i in range(len(offsets) - 1):
        first = offsets[i - i % group_size]
        tokens[offsets[i] : offsets[i] + 5] = tokens[first : first + 5]
    return tokens


def _trainer(root: Path, rank: int, world: int, port: int, overrides: dict):
    from rlhpc.train.optim import make_optimizer
    from rlhpc.train.trainer import Trainer

    keys = {k: v for k, v in overrides.items() if k not in ("stop_at", "save", "resume")}  # test-only knobs
    cfg = config_mod.to_typed({"run_dir": str(root), **keys, "trainer": {"num_ranks": world, **keys.get("trainer", {})}})
    run = RunDir(root)
    tr = Trainer(cfg, Identity("trainer", rank, world, root, "t", "127.0.0.1", port), run)
    tr.tokenizer = models.load_tokenizer(run.model)
    tr.model = tr.wrap(models.load_model(run.model))
    tr.optimizer = make_optimizer(tr.model.parameters(), cfg.trainer.optim)
    tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)
    tr.reference = None
    return tr


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads_worker(root, rank, world, port, overrides, out):
    try:
        torch.manual_seed(0)
        tr = _trainer(Path(root), rank, world, port, overrides)
        tr.optimizer.step = lambda *a, **k: None  # keep the gradients of the step
        stats = tr.train_step(0, make_batch(len(tr.tokenizer)))
        # by value; a parameter without a gradient (GLM-5's DSA indexer) as zeros
        grads = {n: (_full(p.grad) if p.grad is not None else torch.zeros(_full(p.detach()).shape)).numpy().copy()
                 for n, p in tr.model.named_parameters()}
        if rank == 0:
            out.put(("ok", stats["loss/total"], grads))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc(), None))


def first_report(ctx, target, args, world: int, timeout: float = 240):
    """Starts `world` rank processes, `target(*args(rank, queue))`, and returns the first thing one puts on the queue
    (rank 0's result, or an error); every process is ended, killed if it does not exit."""
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=args(r, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def run_ranks(root, world, overrides, target=_grads_worker):
    port = free_port()
    result = first_report(CTX, target, lambda r, out: (str(root), r, world, port, overrides, out), world)
    assert result[0] == "ok", result[1]
    status, loss, arrays = result
    return status, loss, {n: torch.from_numpy(a) for n, a in arrays.items()}


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    RunDir(root).make()
    models.build(ModelConfig(hidden_size=48, intermediate_size=96, num_layers=2), root / "model")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_loss_and_gradients_do_not_depend_on_ranks_or_micro_batches(run_root, normalize):
    algo = {"algo": {"normalize": normalize}}
    _, loss_1, grads_1 = run_ranks(run_root, 1, {**algo, "trainer": {"micro_batch_tokens": 100000}})
    _, loss_mb, grads_mb = run_ranks(run_root, 1, {**algo, "trainer": {"micro_batch_tokens": 64}})
    _, loss_2, grads_2 = run_ranks(run_root, 2, {**algo, "trainer": {"micro_batch_tokens": 64}})
    assert abs(loss_1 - loss_mb) < 1e-5 and abs(loss_1 - loss_2) < 1e-5
    for name, g in grads_1.items():
        assert torch.allclose(grads_mb[name], g, atol=1e-6, rtol=1e-4), name
        assert torch.allclose(grads_2[name], g, atol=1e-6, rtol=1e-4), name
    assert max(g.abs().max() for g in grads_1.values()) > 1e-4  # a real gradient, not zeros


@pytest.mark.slow
def test_packing_a_groups_samples_behind_their_prompt_changes_nothing(run_root):
    _, loss_pad, grads_pad = run_ranks(run_root, 1, {"trainer": {"packing": "padded"}})
    _, loss_rows, grads_rows = run_ranks(run_root, 1, {"trainer": {"packing": "shared_prefix", "pack_row_tokens": 40}})
    assert abs(loss_pad - loss_rows) < 1e-5
    for name, g in grads_pad.items():
        assert torch.allclose(grads_rows[name], g, atol=1e-6, rtol=1e-4), name



@pytest.mark.slow
@pytest.mark.parametrize("packing", ["shared_prefix", "padded"])
def test_activation_checkpointing_changes_neither_loss_nor_gradients(run_root, packing):
    # The recompute in backward must see what the forward saw (the mask, the positions, no KV cache filled twice), on
    # one rank (transformers' checkpointing) and under FSDP2; the gradients keep their Hugging Face names.
    base = {"packing": packing, "micro_batch_tokens": 64}
    _, loss, grads = run_ranks(run_root, 1, {"trainer": base})
    _, loss_1, grads_1 = run_ranks(run_root, 1, {"trainer": {**base, "activation_checkpointing": True}})
    _, loss_2, grads_2 = run_ranks(run_root, 2, {"trainer": {**base, "activation_checkpointing": True}})
    assert abs(loss - loss_1) < 1e-5 and abs(loss - loss_2) < 1e-5
    assert grads_1.keys() == grads.keys() and grads_2.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.allclose(grads_1[name], g, atol=1e-6, rtol=1e-4), name
        assert torch.allclose(grads_2[name], g, atol=1e-6, rtol=1e-4), name

def _one_step_grads(root, overrides):
    torch.manual_seed(0)
    tr = _trainer(root, 0, 1, 0, overrides)
    tr.optimizer.step = lambda *a, **k: None  # keep the gradients of the step
    stats = tr.train_step(0, make_batch(len(tr.tokenizer)))
    return stats["loss/total"], {n: p.grad.clone() for n, p in tr.model.named_parameters()}


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones(run_root):
    from torch._dynamo.utils import counters

    loss_eager, grads_eager = _one_step_grads(run_root, {})
    counters.clear()
    loss_compiled, grads_compiled = _one_step_grads(run_root, {"trainer": {"compile": True}})
    assert counters["stats"]["unique_graphs"] >= 1  # compiled, not run eagerly after a failure
    assert abs(loss_eager - loss_compiled) < 1e-5
    for name, g in grads_eager.items():  # fused kernels add in another order: fp32 rounding
        assert torch.allclose(grads_compiled[name], g, atol=1e-5, rtol=1e-3), name


def _train_worker(root, rank, world, port, overrides, out):
    """Trains `steps` steps on fixed batches, checkpointing/resuming as told; rank 0 reports the full parameters."""
    try:
        from rlhpc.train import checkpoint

        torch.manual_seed(0)
        tr = _trainer(Path(root), rank, world, port, overrides)
        run = RunDir(Path(root))
        start = 0
        if overrides.get("resume"):
            start = checkpoint.load(checkpoint.latest(run.checkpoints), tr.model, tr.optimizer, tr.scheduler)["step"]
        for step in range(start, overrides["stop_at"]):
            tr.train_step(step, make_batch(len(tr.tokenizer), seed=step))
        if overrides.get("save"):
            checkpoint.save(run.checkpoints, overrides["stop_at"], tr.model, tr.optimizer, tr.scheduler, {"eval_curve": []})
        params = {n: _full(p.detach()).numpy().copy() for n, p in tr.model.named_parameters()}
        if rank == 0:
            out.put(("ok", None, params))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc(), None))


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(1, 1), (2, 1), (1, 2)])
def test_a_run_stopped_and_resumed_matches_an_uninterrupted_one(tmp_path, run_root, first, second):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(run_root, root)
    base = {"trainer": {"micro_batch_tokens": 256}}
    _, _, _ = run_ranks(root, first, {**base, "stop_at": 2, "save": True}, target=_train_worker)
    _, _, resumed = run_ranks(root, second, {**base, "stop_at": 4, "resume": True}, target=_train_worker)
    _, _, uninterrupted = run_ranks(root, first, {**base, "stop_at": 4}, target=_train_worker)
    initial = dict(models.load_model(root / "model").named_parameters())
    assert all(not torch.allclose(p, initial[n].detach()) for n, p in uninterrupted.items())  # training moved them
    for name, p in uninterrupted.items():
        assert torch.allclose(resumed[name], p, atol=1e-6, rtol=1e-5), name
