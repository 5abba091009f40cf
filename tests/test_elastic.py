"""Workers come and go: an inference worker killed mid-run is restarted by the local launcher, rejoins at the current
weights version, and the run finishes with every step trained once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import ConfigError
from faults import role_pid
from test_launch import SMALL, rlhpc_processes


def test_restarts_are_accepted_with_either_transport_and_the_member_timeout_is_checked():
    import rlhpc.algo  # noqa: F401  (registers the algorithms' config checks)

    for transport in ("broadcast", "filesystem"):
        for launcher in ("local", "slurm", "sbatch"):  # under Slurm the worker's task restarts it inside the job
            config_mod.validate(config_mod.to_typed({"run_dir": "/tmp/x", "inference": {"max_restarts": 2},
                                                     "weights": {"transport": transport},
                                                     "launcher": {"name": launcher}}))
    cfg = config_mod.to_typed({"run_dir": "/tmp/x", "weights": {"member_timeout_s": 0}})
    with pytest.raises(ConfigError, match="weights.member_timeout_s"):
        config_mod.validate(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["filesystem", "broadcast"])
def test_a_killed_worker_is_restarted_and_rejoins_at_the_current_version(tmp_path, transport):
    """filesystem: the new life starts from the newest snapshot; broadcast: it joins the weights group again at the
    next update (the group's next epoch leaves the dead member out)."""
    run_dir = tmp_path / "run"
    steps = 40  # long enough for the restarted worker to start (a few seconds) and publish before the end
    p = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", f"trainer.steps={steps}",
                          f"weights.transport={transport}", "inference.max_restarts=2", "queue.lease_s=5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ledger = run_dir / "queue" / "ledger.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not ledger.exists() or len(ledger.read_text().splitlines()) < 3):
        time.sleep(0.1)
    killed_at = len(ledger.read_text().splitlines())
    pid = role_pid(run_dir, "inference", 0)
    os.killpg(pid, signal.SIGKILL)  # the worker and its environment pool, as when its node dies
    _, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    assert "inference-0 exited with code -9; restarting it (1 of inference.max_restarts=2)" in err

    entries = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [e["step"] for e in entries] == list(range(steps))  # every step once: training went on
    uids = [u for e in entries for u in e["groups"]]
    assert len(uids) == len(set(uids))
    # The second life of worker 0 generated from the current weights, not from version 0.
    rows = [json.loads(line) for line in (run_dir / "logs" / "inference-0.metrics.jsonl").read_text().splitlines()]
    second_life = [r for i, r in enumerate(rows) if i and r["step"] == 0][-1:]
    assert second_life and second_life[0]["weights/version"] >= killed_at - 1, (killed_at, rows)
    assert rlhpc_processes(run_dir) == []


def test_a_snapshot_written_after_a_resume_replaces_the_later_ones_left_from_before(tmp_path):
    import torch

    from rlhpc.run.rundir import RunDir
    from rlhpc.transport.weights import latest_snapshot, load_snapshot, write_snapshot

    run = RunDir(tmp_path).make()
    for v in (10, 11, 12):  # the run got to version 12, then crashed; its checkpoint is at step 10
        write_snapshot(run, v, [("w", torch.full((2,), float(v)))])
    write_snapshot(run, 10, [("w", torch.full((2,), -10.0))])  # the resumed trainer republishes version 10
    assert latest_snapshot(run) == 10  # a restarted worker starts from the resumed weights, not the lost ones
    assert load_snapshot(run, 10)[0][1].tolist() == [-10.0, -10.0]


def test_a_worker_that_joins_after_the_last_update_takes_the_final_snapshot(tmp_path):
    """Broadcast transport: no update follows the final version, so the trainer writes it to disk too (streamed, before
    sending it), and a worker behind the trainer's published version takes the newest snapshot up to that version,
    never one the trainer has not published."""
    import torch

    from rlhpc.config.schema import ModelConfig
    from rlhpc.infer.engines.hf import HFEngine
    from rlhpc.infer.worker import _catch_up
    from rlhpc.modeling import models
    from rlhpc.modeling.names import checkpoint_layout
    from rlhpc.run.identity import Identity
    from rlhpc.run.rundir import RunDir
    from rlhpc.train.publish import Publisher, full_state
    from rlhpc.transport.weights import latest_snapshot, load_snapshot

    model_dir = models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), tmp_path / "m")
    run = RunDir(tmp_path / "run").make()
    trained = models.load_model(model_dir)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    cfg = config_mod.to_typed({"run_dir": str(run.root), "trainer": {"steps": 7}, "weights": {"transport": "broadcast"}})
    publisher = Publisher(cfg, Identity("trainer", 0, 1, run.root, "t"), run)
    publisher.final_snapshot(trained, 7, torch.float32)
    assert latest_snapshot(run) == 7
    want = dict(full_state(trained, torch.float32))
    got = dict(load_snapshot(run, 7))
    assert got.keys() == want.keys() == {n for n, _, _ in checkpoint_layout(trained, torch.float32)}
    assert all(torch.equal(got[n], want[n]) for n in want)

    engine = HFEngine.from_pretrained(str(model_dir))
    assert _catch_up(run, engine, 0, published=6) == 0  # the trainer has not published version 7: not taken
    assert _catch_up(run, engine, 0, published=7) == 7 and engine.version == 7
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, dict(trained.named_parameters())[name])
    assert _catch_up(run, engine, 7, published=7) == 7  # nothing newer: nothing loaded


def test_interval_snapshots_are_written_from_the_stream_as_it_is_broadcast(tmp_path):
    """weights.snapshot_interval with the broadcast transport: the snapshot is written as the weights stream goes out
    (a writer thread takes each tensor as it passes, no full copy), and holds exactly the version published."""
    import torch

    from rlhpc.config.schema import ModelConfig
    from rlhpc.modeling import models
    from rlhpc.run.identity import Identity
    from rlhpc.run.rundir import RunDir
    from rlhpc.train.publish import Publisher, full_state
    from rlhpc.transport.weights import latest_snapshot, load_snapshot

    model_dir = models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2), tmp_path / "m")
    run = RunDir(tmp_path / "run").make()
    model = models.load_model(model_dir)
    cfg = config_mod.to_typed({"run_dir": str(run.root), "trainer": {"steps": 9},
                               "inference": {"num_workers": 0},  # a group without members: the stream still goes out
                               "weights": {"transport": "broadcast", "snapshot_interval": 2, "timeout_s": 30}})
    publisher = Publisher(cfg, Identity("trainer", 0, 1, run.root, "t"), run)
    publisher.start()
    try:
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            publisher.publish(model, version)
            if version == 2:
                want = {n: t.clone() for n, t in full_state(model, torch.float32)}  # (views of the parameters)
        assert latest_snapshot(run) == 2  # versions 1 and 3 are not due
        got = dict(load_snapshot(run, 2))
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    finally:
        publisher.close()
