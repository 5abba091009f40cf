"""MoE models (Qwen3-MoE, GLM-5) train on FSDP2 ranks with the math of one rank, and the final export of any model
loads with from_pretrained and gives the trainer's logits. The model presets: tiny ones built in code, real-size ones
from a checkpoint folder the user names."""

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.rundir import RunDir
from test_trainer_math import _trainer, first_report, free_port, make_batch

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
PRESETS = ["tiny_qwen3_moe", "tiny_glm5", "tiny_qwen3"]  # the Hydra presets, as a user gets them
MOE = PRESETS[:2]
IDS = torch.tensor([[5, 9, 44, 70, 2, 3, 120, 121, 30, 31], [7, 8, 100, 101, 102, 2, 60, 61, 62, 63]])


def preset(name: str) -> ModelConfig:
    schema = OmegaConf.structured(ModelConfig)
    return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(CONF / f"{name}.yaml")))


def _step_and_export(root: Path, rank: int, world: int, port: int):
    """One training step (optimizer included), then the trained model's logits and the final export."""
    import torch.distributed as dist

    from rlhpc.modeling.names import checkpoint_layout

    torch.manual_seed(0)
    tr = _trainer(root, rank, world, port, {"trainer": {"micro_batch_tokens": 64 if world > 1 else 100000}})
    stats = tr.train_step(0, make_batch(len(tr.tokenizer)))
    grads = {n: None if p.grad is None else _full(p.grad).numpy().copy() for n, p in tr.model.named_parameters()}
    with torch.no_grad():
        logits = tr.model(input_ids=IDS).logits.numpy().copy()
    layout = [(n, list(shape), str(dtype)) for n, shape, dtype in checkpoint_layout(tr.model)]
    streamed = [(n, list(t.shape), str(t.dtype)) for n, t in tr.full_state()]  # collective with FSDP
    export = root / f"export-{world}"
    tr.export(export)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {"loss": stats["loss/total"], "grads": grads, "logits": logits, "export": str(export), "layout": layout,
            "streamed": streamed}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(roots, rank, world, ports, out):
    try:
        results = {name: _step_and_export(Path(root), rank, world, port)
                   for (name, root), port in zip(roots.items(), ports)}
        if rank == 0:
            out.put(("ok", results))
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc()))


def on_two_ranks(roots):
    # Forked from a server that imported the trainer once: each rank starts in well under a second.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rlhpc.train.trainer", "test_trainer_math"])
    ports = [free_port() for _ in roots]
    status, results = first_report(ctx, _worker, lambda r, out: (roots, r, 2, ports, out), 2)
    assert status == "ok", results
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each preset: one step and an export on 1 rank (in this process) and on 2 FSDP2 ranks."""
    roots = {}
    for name in PRESETS:
        root = tmp_path_factory.mktemp(name)
        RunDir(root).make()
        models.build(preset(name), root / "model")
        roots[name] = str(root)
    one = {name: _step_and_export(Path(root), 0, 1, 0) for name, root in roots.items()}
    two = on_two_ranks(roots)
    return {1: one, 2: two, "roots": roots}


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_a_moe_step_on_two_fsdp_ranks_has_the_loss_and_gradients_of_one_rank(runs, name):
    one, two = runs[1][name], runs[2][name]
    assert abs(one["loss"] - two["loss"]) < 1e-5
    assert one["grads"].keys() == two["grads"].keys()
    for param, g in one["grads"].items():
        g2 = two["grads"][param]
        if g is None:  # e.g. GLM-5's DSA indexer, which transformers runs without gradients
            assert g2 is None, param
            continue
        g, g2 = torch.from_numpy(g), torch.from_numpy(g2)
        assert float((g2 - g).abs().max()) <= 1e-5 * float(g.abs().max()), param
    experts = [g for p, g in one["grads"].items() if p.endswith("experts.gate_up_proj")]
    assert experts and all(abs(g).max() > 0 for g in experts)  # the routed experts did learn


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", PRESETS)
def test_the_final_export_loads_with_from_pretrained_and_gives_the_trainers_logits(runs, name, ranks):
    run = runs[ranks][name]
    exported = AutoModelForCausalLM.from_pretrained(run["export"], dtype=torch.float32).eval()
    initial = AutoModelForCausalLM.from_pretrained(Path(runs["roots"][name]) / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        got, before = exported(input_ids=IDS).logits, initial(input_ids=IDS).logits
    want = torch.from_numpy(run["logits"])
    assert (before - want).abs().max() > 1e-3  # the step changed the model: the export must carry the new weights
    assert torch.allclose(got, want, atol=1e-5)
    assert models.load_tokenizer(run["export"]).eos_token == "<|im_end|>"  # the tokenizer travels with it


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_fsdp_ranks_stream_every_tensor_of_the_checkpoint_under_its_name_and_shape(runs, name):
    from safetensors import safe_open

    run = runs[2][name]
    with safe_open(str(Path(runs["roots"][name]) / "model" / "model.safetensors"), "pt") as f:
        saved = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {n: shape for n, shape, _ in run["streamed"]} == saved
    assert len(run["streamed"]) == len(saved)
    assert run["layout"] == run["streamed"]  # known from the shards' metadata before anything is gathered


@pytest.mark.parametrize("name,arch", [("qwen3_0_6b", "qwen3"), ("qwen3_30b_a3b", "qwen3_moe"), ("glm5", "glm_moe_dsa"),
                                       ("minimax_m2", "minimax_m2")])
def test_a_real_size_preset_takes_the_checkpoint_folder_and_fails_without_one(name, arch, monkeypatch):
    from hydra import compose, initialize_config_dir

    from rlhpc.config.schema import register, to_typed

    register()
    monkeypatch.delenv("RLHPC_MODEL_PATH", raising=False)
    with initialize_config_dir(config_dir=str(CONF.parent), version_base=None):
        cfg = to_typed(compose("config", overrides=[f"model={name}", "model.path=/models/x", "run_dir=/tmp/r"]))
        assert (cfg.model.path, cfg.model.arch, cfg.model.dtype) == ("/models/x", arch, "bfloat16")
        with pytest.raises(Exception, match=r"model\.path"):
            to_typed(compose("config", overrides=[f"model={name}", "run_dir=/tmp/r"]))
