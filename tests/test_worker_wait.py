"""How an inference worker waits: backing off (a bounded number of looks at the shared filesystem per second), and
giving up after its own idle timeout (`inference.idle_timeout_s`), not after the weights group's; and that it closes
its engine however it ends."""

import time

import pytest

from rlhpc import env as env_mod
from rlhpc.config import schema as config_mod
from rlhpc.infer import worker
from rlhpc.run.evaluation import write_result
from rlhpc.run.identity import Identity
from rlhpc.run.rundir import RunDir
from rlhpc.transport.queue import Queue
from test_queue import make_batch


class IdleEngine:
    """Never asked to generate: the worker waits the whole time."""


def test_a_waiting_worker_backs_off_and_stops_after_its_own_idle_timeout(tmp_path, monkeypatch):
    cfg = config_mod.to_typed({
        "run_dir": str(tmp_path),
        "weights": {"transport": "filesystem", "timeout_s": 0.5},  # the old idle limit: must not apply
        "inference": {"idle_timeout_s": 2.0, "groups_per_batch": 8},
        "trainer": {"groups_per_step": 16},
        "queue": {"poll_max_s": 0.25, "max_pending_steps": 1},
    })
    run = RunDir(tmp_path).make()
    write_result(run, 0, 0.0, tasks=64)  # the warm start's: worker 0 owes no held-out evaluation of version 0
    q = Queue(run.queue)
    for s in range(2):  # one step's worth of groups pending and nobody claiming: back-pressure holds the worker
        q.publish(make_batch(num_groups=8), "w9", s)
    looks = []
    progress = Queue.progress
    monkeypatch.setattr(Queue, "progress", lambda self: looks.append(time.monotonic()) or progress(self))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"nothing moved for inference.idle_timeout_s=2s"):
        worker._loop(cfg, Identity("inference", 0, 1, tmp_path, "t"), run, IdleEngine(), env_mod.load(cfg.env),
                     None, None)
    elapsed = time.monotonic() - t0
    assert 2.0 <= elapsed < 5.0  # its own timeout, not weights.timeout_s (a loaded machine adds a look or two)
    # 10, 20, 40, 80, 160 ms, then every 250 ms: about a dozen looks in 2 s (the 10 ms poll took 200).
    assert len(looks) <= 6 + 2.0 / 0.25 + 2, len(looks)
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert max(gaps) < 0.25 + 0.2, gaps  # at most poll_max_s apart, with room for a loaded machine


class ClosedEngine:
    """Records whether the worker closed it."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_worker_whose_environment_fails_to_load_still_closes_its_engine(tmp_path):
    cfg = config_mod.to_typed({"run_dir": str(tmp_path), "env": {"name": "no-such-env"}})
    run = RunDir(tmp_path).make()
    engine = ClosedEngine()
    with pytest.raises(ValueError, match="config key `env.name`: no environment 'no-such-env'"):
        worker._run_engine(cfg, Identity("inference", 0, 1, tmp_path, "t"), run, engine, None)
    assert engine.closed  # with vLLM: its engine processes end with the worker's error, not at interpreter exit
