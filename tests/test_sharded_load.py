"""The trainer's model is sharded from the start (rlhpc/train/loading.py): built on the meta device, each rank reading
only its rows of the Hugging Face safetensors. That must change nothing a user sees: the same weights, buffers and tied
embeddings as a full load, the same first-step loss and gradients on 1 and 2 ranks, and exact resume from a DCP
checkpoint on another number of ranks without reading the Hugging Face weights at all."""

import multiprocessing as mp
import shutil
import traceback
from pathlib import Path

import pytest
import torch

from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.procs import free_port
from rlhpc.run.rundir import RunDir
from test_trainer_math import _full, _trainer, make_batch

MOE = ModelConfig(arch="qwen3_moe", hidden_size=64, intermediate_size=128, num_layers=2,
                  extra={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "norm_topk_prob": True})
MODELS = {"qwen3": ModelConfig(hidden_size=48, intermediate_size=96, num_layers=2), "qwen3_moe": MOE}


def on_ranks(world: int, target, *args, timeout: float = 240):
    """Runs target(rank, world, port, out, *args) on `world` ranks forked from a server that imported the trainer;
    returns what rank 0 put on `out`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rlhpc.train.trainer", "test_trainer_math"])
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_guarded, args=(target, r, world, port, out) + args, daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, result = out.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert status == "ok", result
    return result


def _guarded(target, rank, world, port, out, *args):
    try:
        result = target(rank, world, port, *args)
        if rank == 0:
            out.put(("ok", result))
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _state(model):
    """Full parameters and buffers (non-persistent ones included), by name, as numpy arrays."""
    out = {n: _full(p.detach()).float().numpy().copy() for n, p in model.named_parameters()}
    out.update({n: _full(b).float().numpy().copy() for n, b in model.named_buffers()})
    return out


def _first_step(rank, world, port, root):
    """State, first-step loss and gradients of the full-load path and of the sharded one, on the same ranks."""
    from rlhpc.train.optim import make_optimizer

    torch.manual_seed(0)
    # The full-load path: the whole model on every rank, then sharded (num_ranks=1 with FSDP too).
    tr = _trainer(Path(root), rank, world, port, {"trainer": {"fsdp": True, "micro_batch_tokens": 64}})
    results = {}
    for path in ("full", "sharded"):
        if path == "sharded":
            tr.model = tr.build_model()
            tr.optimizer = make_optimizer(tr.model.parameters(), tr.cfg.trainer.optim)
        emb, head = tr.model.get_input_embeddings().weight, tr.model.get_output_embeddings().weight
        state = _state(tr.model)
        tr.optimizer.step = lambda *a, **k: None  # keep the step's gradients
        stats = tr.train_step(0, make_batch(len(tr.tokenizer)))
        grads = {n: _full(p.grad).numpy().copy() for n, p in tr.model.named_parameters()}
        results[path] = {"state": state, "tied": head is emb, "loss": stats["loss/total"], "grads": grads}
    return results


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    out = {}
    for name, cfg in MODELS.items():
        root = tmp_path_factory.mktemp(name)
        RunDir(root).make()
        models.build(cfg, root / "model")
        out[name] = root
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(MODELS))
def test_sharded_loading_gives_the_weights_loss_and_gradients_of_a_full_load(roots, model_type):
    root = roots[model_type]
    plain = dict(models.load_model(root / "model").named_buffers())
    runs = {world: on_ranks(world, _first_step, str(root)) for world in (1, 2)}
    reference = runs[1]["full"]
    for world, run in runs.items():
        full, sharded = run["full"], run["sharded"]
        assert sharded["tied"] and full["tied"]  # the output head is still the input embedding
        assert sharded["state"].keys() == full["state"].keys()
        for name, value in full["state"].items():  # parameters and buffers (rotary inv_freq) bit for bit
            assert (sharded["state"][name] == value).all(), (world, name)
        for name, buf in plain.items():
            assert (sharded["state"][name] == buf.numpy()).all(), name  # as from_pretrained computes them
        assert sharded["loss"] == full["loss"]
        assert abs(sharded["loss"] - reference["loss"]) < 1e-5
        for name, g in reference["grads"].items():
            assert (sharded["grads"][name] == full["grads"][name]).all(), (world, name)
            assert torch.allclose(torch.from_numpy(sharded["grads"][name]), torch.from_numpy(g), atol=1e-6,
                                  rtol=1e-4), (world, name)
    assert max(abs(g).max() for g in reference["grads"].values()) > 1e-4  # a real gradient, not zeros


def _train_sharded(rank, world, port, root, stop_at, save, resume):
    """Trains to `stop_at` on fixed batches with the trainer's own model setup; resuming, the parameters are poisoned
    first, so only the DCP checkpoint can make them right."""
    from rlhpc.config import schema as config_mod
    from rlhpc.run.identity import Identity
    from rlhpc.train import checkpoint
    from rlhpc.train.trainer import Trainer

    torch.manual_seed(0)
    root = Path(root)
    run = RunDir(root)
    cfg = config_mod.to_typed({"run_dir": str(root), "trainer": {"num_ranks": world, "fsdp": True,
                                                                  "micro_batch_tokens": 256}})
    tr = Trainer(cfg, Identity("trainer", rank, world, root, "t", "127.0.0.1", port), run)
    tr.tokenizer = models.load_tokenizer(run.model)
    tr.setup_model(load_weights=not resume)
    start = 0
    if resume:
        with torch.no_grad():
            for p in tr.model.parameters():
                p.to_local().fill_(float("nan"))
        start = checkpoint.load(checkpoint.latest(run.checkpoints), tr.model, tr.optimizer, tr.scheduler)["step"]
    for step in range(start, stop_at):
        tr.train_step(step, make_batch(len(tr.tokenizer), seed=step))
    if save:
        checkpoint.save(run.checkpoints, stop_at, tr.model, tr.optimizer, tr.scheduler, {"eval_curve": []})
    return {n: _full(p.detach()).numpy().copy() for n, p in tr.model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_a_sharded_resume_on_other_ranks_matches_an_uninterrupted_run(tmp_path, roots, first, second):
    root = tmp_path / "run"
    shutil.copytree(roots["qwen3"], root)
    on_ranks(first, _train_sharded, str(root), 2, True, False)
    resumed = on_ranks(second, _train_sharded, str(root), 4, False, True)
    uninterrupted = on_ranks(first, _train_sharded, str(root), 4, False, False)
    initial = dict(models.load_model(root / "model").named_parameters())
    for name, p in uninterrupted.items():
        assert not torch.allclose(torch.from_numpy(p), initial[name].detach())  # training moved it
        assert torch.allclose(torch.from_numpy(resumed[name]), torch.from_numpy(p), atol=1e-6, rtol=1e-5), name
