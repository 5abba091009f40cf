"""Nothing non-finite trains: a non-finite advantage, loss or gradient norm skips the optimizer step (weights unchanged),
is logged with the step and its groups, and too many in a row stop the run with a message that says what to do."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import ModelConfig
from rlhpc.modeling import models
from rlhpc.run.identity import Identity
from rlhpc.run.rundir import RunDir
from rlhpc.train.guard import TooManyBadSteps
from rlhpc.train.optim import make_optimizer
from rlhpc.transport.queue import Group, RolloutBatch

TESTS = Path(__file__).resolve().parent


def make_batch(vocab: int, seed: int = 0, groups: int = 4, group_size: int = 4) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 20, (groups * group_size,), generator=g)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(len(lengths)):
        mask[offsets[i] + 4 : offsets[i + 1]] = True
    return RolloutBatch(
        tokens=torch.randint(3, vocab, (total,), generator=g),
        offsets=offsets,
        logprobs=torch.where(mask, -torch.rand(total, generator=g) * 3, torch.zeros(total)),
        loss_mask=mask,
        advantages=torch.randn(len(lengths), generator=g),
        group_of=torch.arange(groups).repeat_interleave(group_size),
        groups=[Group(uid=f"group-{seed}-{i}", env="t", task_id=str(i), version=0, num_samples=group_size,
                      rewards=[0.0] * group_size, truncated=[False] * group_size) for i in range(groups)],
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), tmp_path_factory.mktemp("m"))


@pytest.fixture
def trainer(tmp_path, model_dir):
    from rlhpc.train.trainer import Trainer

    cfg = config_mod.to_typed({"run_dir": str(tmp_path), "trainer": {"max_bad_steps": 3}})
    run = RunDir(tmp_path).make()
    tr = Trainer(cfg, Identity("trainer", 0, 1, tmp_path, "t"), run)
    tr.tokenizer = models.load_tokenizer(model_dir)
    tr.model = models.load_model(model_dir)
    tr.optimizer = make_optimizer(tr.model.parameters(), cfg.trainer.optim)
    tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)
    tr.reference = None
    yield tr
    tr.metrics.close()


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_unchanged(before, model):
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_nan_advantage_skips_the_step_and_names_the_group(trainer, caplog):
    batch = make_batch(len(trainer.tokenizer))
    batch.advantages[5] = float("nan")  # sample 5 belongs to group 1
    before = weights(trainer.model)
    with caplog.at_level(logging.WARNING):
        stats = trainer.train_step(7, batch)
    assert stats["train/skipped"] == 1.0 and trainer.bad_steps.last.startswith("1 non-finite advantage")
    assert_unchanged(before, trainer.model)
    assert trainer.optimizer.state == {}  # Adam's moments never saw it
    assert "step 7 skipped" in caplog.text and "group-0-1" in caplog.text and "group-0-2" not in caplog.text


def test_a_loss_made_non_finite_by_a_hook_skips_the_step(trainer, caplog):
    hook = trainer.model.model.norm.register_forward_hook(lambda mod, args, out: out * float("nan"))
    before = weights(trainer.model)
    with caplog.at_level(logging.WARNING):
        stats = trainer.train_step(3, make_batch(len(trainer.tokenizer)))
    hook.remove()
    assert stats["train/skipped"] == 1.0 and trainer.bad_steps.last == "loss nan"
    assert_unchanged(before, trainer.model)
    assert all(p.grad is None for p in trainer.model.parameters())  # the poisoned gradients are gone
    assert "step 3 skipped: loss nan" in caplog.text and "group-0-0 group-0-1 group-0-2 group-0-3" in caplog.text
    # The next step trains normally.
    stats = trainer.train_step(4, make_batch(len(trainer.tokenizer), seed=1))
    assert stats["train/skipped"] == 0.0 and trainer.bad_steps.in_a_row == 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_an_infinite_gradient_norm_with_a_finite_loss_skips_the_step(trainer):
    param = next(trainer.model.parameters())
    hook = param.register_hook(lambda grad: grad * float("inf"))
    before = weights(trainer.model)
    stats = trainer.train_step(0, make_batch(len(trainer.tokenizer)))
    hook.remove()
    assert stats["train/skipped"] == 1.0 and torch.isfinite(torch.tensor(stats["loss/total"]))
    assert trainer.bad_steps.last.startswith("gradient norm")
    assert_unchanged(before, trainer.model)


def test_max_bad_steps_in_a_row_stops_the_run_with_a_clear_message(trainer):
    vocab = len(trainer.tokenizer)

    def bad(step):
        b = make_batch(vocab, seed=step)
        b.advantages[0] = float("inf")
        return trainer.train_step(step, b)

    bad(0), bad(1)
    trainer.train_step(2, make_batch(vocab, seed=2))  # a good step ends the run of bad ones
    bad(3), bad(4)
    with pytest.raises(TooManyBadSteps, match=r"3 optimizer steps in a row \(steps 3\.\.5\).*trainer.max_bad_steps=3"):
        bad(5)
    assert trainer.bad_steps.total == 5


def _launch(run_dir, *overrides, env):
    small = ["+exp=reverse_text", "sft.steps=5", "eval.num_tasks=8", "eval.interval=0", "launcher.progress=false",
             "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "algo.name=poison_loss:nan_grpo"]
    return subprocess.run([sys.executable, "-m", "rlhpc.launch", *small, f"run_dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.slow
def test_skipped_steps_still_publish_the_next_version_and_the_run_finishes(tmp_path):
    # The loss is NaN for the first 2 steps: both are skipped, recorded once, and the run trains the other 4.
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", RLHPC_TEST_NAN_CALLS="2")
    run_dir = tmp_path / "run"
    # One micro-batch per step, so that loss calls are steps.
    proc = _launch(run_dir, "trainer.steps=6", "async_level=0", "trainer.micro_batch_tokens=1000000", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ledger = [json.loads(line) for line in (run_dir / "queue" / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == list(range(6))
    assert [e.get("skipped") for e in ledger] == ["loss nan", "loss nan", None, None, None, None]
    rows = [json.loads(line) for line in (run_dir / "logs" / "trainer-0.metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/skipped" in r]
    assert [r["train/skipped"] for r in rows] == [1, 1, 0, 0, 0, 0] and rows[-1]["train/bad_steps"] == 2
    # async_level=0: step 2 needs groups of version 2, which only exist because skipped steps published versions 1, 2.
    assert all(r["async/staleness_max"] == 0 for r in rows)
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "step 0 skipped: loss nan; weights unchanged, republished as version 1" in log


@pytest.mark.slow
def test_a_loss_that_is_always_nan_stops_the_run_after_max_bad_steps(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("RLHPC_TEST_NAN_CALLS", None)
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "trainer.steps=50", "trainer.max_bad_steps=3", env=env)
    assert proc.returncode == 1
    assert "3 optimizer steps in a row (steps 0..2) were skipped" in proc.stderr
    assert "trainer.max_bad_steps=3" in proc.stderr
    assert not (run_dir / "summary.json").exists()
