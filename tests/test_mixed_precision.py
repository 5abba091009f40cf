"""Mixed precision (trainer.param_dtype=bfloat16, trainer.master_dtype=float32): bf16 compute over fp32 master weights
and fp32 AdamW state trains like fp32. 20 steps at lr 1e-6 from the same start move the weights as the fp32 reference
does, where pure bf16 (master_dtype=bfloat16) rounds those small updates away. On one rank (torch.autocast) and on 2
FSDP2 ranks (MixedPrecisionPolicy, fp32 gradient reduction); the export is cast from the master copy to model.dtype."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.identity import Identity
from rlhpc.run.rundir import RunDir
from test_sharded_load import on_ranks
from test_trainer_math import _full, make_batch

STEPS, LR = 20, 1e-6


def _train(rank, world, port, root, param_dtype, master_dtype, fsdp, export):
    """STEPS steps on fixed batches; the full parameters before and after (as float32), and the dtypes in play."""
    from rlhpc.train.trainer import Trainer

    torch.manual_seed(0)
    root = Path(root)
    run = RunDir(root)
    cfg = config_mod.to_typed({
        "run_dir": str(root), "model": {"dtype": "bfloat16"},  # the serving dtype: what the export is cast to
        "trainer": {"num_ranks": world, "fsdp": fsdp, "param_dtype": param_dtype, "master_dtype": master_dtype,
                    "micro_batch_tokens": 256, "optim": {"lr": LR}},
    })
    config_mod.validate(cfg)
    tr = Trainer(cfg, Identity("trainer", rank, world, root, "t", "127.0.0.1", port), run)
    tr.tokenizer = models.load_tokenizer(run.model)
    tr.setup_model()

    def params():
        return {n: _full(p.detach()).float().numpy().copy() for n, p in tr.model.named_parameters()}

    before = params()
    for step in range(STEPS):
        stats = tr.train_step(step, make_batch(len(tr.tokenizer), seed=step))
        assert stats["train/skipped"] == 0.0
    dtypes = {
        "param": {str(p.dtype) for p in tr.model.parameters()},
        "grad": {str(p.grad.dtype) for p in tr.model.parameters() if p.grad is not None},
        "adam": {str(v.dtype) for s in tr.optimizer.state.values() for k, v in s.items() if k != "step"},
    }
    if export:
        tr.export(root / "export")
    return {"before": before, "after": params(), "dtypes": dtypes}


def _moved(run):
    return np.concatenate([(run["after"][n] - run["before"][n]).ravel() for n in sorted(run["after"])])


def _relative_difference(run, reference) -> float:
    d, ref = _moved(run), _moved(reference)
    return float(np.linalg.norm(d - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    RunDir(root).make()
    models.build(ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2), root / "model")
    return root


@pytest.fixture(scope="module")
def fp32(root):
    return _train(0, 1, 0, str(root), "float32", "float32", False, False)


@pytest.mark.slow
def test_bf16_compute_with_fp32_master_weights_moves_the_weights_as_fp32_does_on_one_rank(root, fp32):
    mixed = _train(0, 1, 0, str(root), "bfloat16", "float32", False, False)
    pure = _train(0, 1, 0, str(root), "bfloat16", "bfloat16", False, False)
    assert mixed["dtypes"] == {"param": {"torch.float32"}, "grad": {"torch.float32"}, "adam": {"torch.float32"}}
    assert pure["dtypes"]["param"] == {"torch.bfloat16"}
    assert np.abs(_moved(fp32)).max() > 5 * LR  # the reference did move
    assert _relative_difference(mixed, fp32) < 0.1
    assert _relative_difference(pure, fp32) > 0.9  # most of the updates rounded away


@pytest.mark.slow
def test_bf16_compute_with_fp32_master_weights_on_two_fsdp_ranks_and_its_export_in_the_serving_dtype(root, fp32):
    mixed = on_ranks(2, _train, str(root), "bfloat16", "float32", True, True)
    pure = on_ranks(2, _train, str(root), "bfloat16", "bfloat16", True, False)
    assert mixed["dtypes"] == {"param": {"torch.float32"}, "grad": {"torch.float32"}, "adam": {"torch.float32"}}
    assert _relative_difference(mixed, fp32) < 0.1
    assert _relative_difference(pure, fp32) > 0.9
    # The export: model.dtype (bfloat16), cast from the fp32 master weights after the last step, loads as it is.
    export = root / "export"
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        saved = {n: f.get_tensor(n) for n in f.keys()}
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    for name, t in saved.items():
        want = torch.from_numpy(mixed["after"][name]).to(torch.bfloat16)
        assert torch.equal(t, want), name
    loaded = models.load_model(export, "bfloat16")
    assert loaded.config.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, saved["model.embed_tokens.weight"])  # tied, as saved
