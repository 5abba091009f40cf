"""A warm start asked to stop (a preemption, a time limit) saves its state after the step it is in, and the requeued
run goes on from there to exactly the model an uninterrupted warm start makes."""

import json
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from rlhpc import env as env_mod
from rlhpc.config import schema as config_mod
from rlhpc.infer.rollout import evaluator
from rlhpc.run import stop
from rlhpc.run.metrics import Metrics, read_rows
from rlhpc.run.rundir import RunDir
from rlhpc.run.stop import Stop
from rlhpc.train.warmstart import warm_start

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1}


class Killed(Exception):
    """A trainer killed outright (kill -9, a lost node): nothing of it runs after."""


class StopAt(Metrics):
    """The trainer's metrics, with a stop request (as the SIGTERM handler makes it) arriving during SFT step `at`, or
    the trainer killed during step `killed_at`."""

    def __init__(self, run, at, killed_at):
        super().__init__(run, "trainer", 0)
        self.at, self.killed_at = at, killed_at

    def log(self, step, scalars):
        if step == self.killed_at and "sft/loss" in scalars:
            raise Killed
        super().log(step, scalars)
        if step == self.at and "sft/loss" in scalars:
            stop._stop_signal.append("SIGTERM")


def start(tmp_path, name, stop_at=0, killed_at=0, save_interval=0):
    cfg = config_mod.to_typed({"run_dir": str(tmp_path / name), "eval": {"num_tasks": 2}, "model": SIZES,
                               "sft": {"steps": 6, "batch_size": 4, "save_interval": save_interval}})
    run = RunDir(tmp_path / name).make()
    metrics = StopAt(run, stop_at, killed_at)
    try:
        return run, warm_start(cfg, run, env_mod.load(cfg.env), metrics, 0, evaluator)
    finally:
        metrics.close()
        stop._stop_signal.clear()


def test_a_stopped_warm_start_goes_on_from_its_saved_step_to_the_same_model(tmp_path):
    whole, out = start(tmp_path, "whole")
    with pytest.raises(Stop):
        start(tmp_path, "stopped", stop_at=3)
    run = RunDir(tmp_path / "stopped")
    state = json.loads((run.sft_state / "state.json").read_text())
    assert state["step"] == 3 and len(state["losses"]) == 3
    assert state["heldout_reward_base"] == out["heldout_reward_base"]
    assert not run.model.exists()

    _, resumed = start(tmp_path, "stopped")
    assert resumed["sft_steps"] == 6 and not run.sft_state.exists()
    a, b = load_file(whole.model / "model.safetensors"), load_file(run.model / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bit for bit
    assert resumed["heldout_reward_sft"] == out["heldout_reward_sft"]
    losses = [r["sft/loss"] for r in map(json.loads, (run.logs / "trainer-0.metrics.jsonl").read_text().splitlines())
              if "sft/loss" in r]
    whole_losses = [r["sft/loss"] for r in map(json.loads, (whole.logs / "trainer-0.metrics.jsonl").read_text()
                                              .splitlines()) if "sft/loss" in r]
    assert losses == whole_losses  # steps 1-3, then 4-6 after the requeue: each once


def sft_losses(run, rows=None):
    """The SFT losses the run's metrics show (rlhpc.run.metrics.read_rows), or those of `rows`."""
    return [r["sft/loss"] for r in (read_rows(run, "trainer") if rows is None else rows) if "sft/loss" in r]


def tensorboard_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_warm_start_killed_outright_goes_on_from_its_last_periodic_save(tmp_path):
    whole, out = start(tmp_path, "whole")
    with pytest.raises(Killed):
        start(tmp_path, "killed", killed_at=6, save_interval=2)  # saved after steps 2 and 4
    run = RunDir(tmp_path / "killed")
    assert json.loads((run.sft_state / "state.json").read_text())["step"] == 4
    # Killed between the two renames of a save: the previous state, kept as sft_state.old, is gone on from.
    (run.sft_state).rename(run.root / "sft_state.old")
    _, resumed = start(tmp_path, "killed", save_interval=2)
    a, b = load_file(whole.model / "model.safetensors"), load_file(run.model / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a) and resumed["heldout_reward_sft"] == out["heldout_reward_sft"]
    # Steps 1-5, the kill during 6, then 5 and 6 again from the save after 4: the metrics show each step once, as
    # TensorBoard does; the file keeps what the killed attempt logged, and the mark of the resume.
    assert sft_losses(run) == sft_losses(whole)
    written = list(map(json.loads, (run.logs / "trainer-0.metrics.jsonl").read_text().splitlines()))
    assert sft_losses(run, written) == sft_losses(whole)[:5] + sft_losses(whole)[4:]
    assert [r for r in written if "resumed" in r] == [{"resumed": "sft", "step": 4, "time": pytest.approx(time.time(),
                                                                                                          abs=600)}]
    shown = tensorboard_scalars(run.tb / "trainer-0" / "sft", "sft/loss")
    assert [s for s, _ in shown] == list(range(1, 7))
    assert [v for _, v in shown] == pytest.approx(sft_losses(whole))
    assert not run.sft_state.exists() and not (run.root / "sft_state.old").exists()


def test_a_state_without_its_optimizer_is_not_gone_on_from(tmp_path):
    with pytest.raises(Stop):
        start(tmp_path, "stopped", stop_at=2)
    run = RunDir(tmp_path / "stopped")
    (run.sft_state / "optimizer.pt").unlink()
    _, out = start(tmp_path, "stopped")
    assert out["sft_steps"] == 6
    assert (run.logs / "trainer-0.metrics.jsonl").read_text().count('"sft/loss"') == 2 + 6  # begun anew
    assert [r["step"] for r in read_rows(run, "trainer") if "sft/loss" in r] == list(range(1, 7))


@pytest.mark.slow
def test_a_launch_stopped_during_the_warm_start_is_relaunched_and_goes_on_from_it(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", f"run_dir={run_dir}", "sft.steps=400",
            "sft.stop_at_reward=0", "trainer.steps=2", "eval.num_tasks=8", "launcher.progress=false",
            *(f"model.{k}={v}" for k, v in SIZES.items())]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows = run_dir / "logs" / "trainer-0.metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not rows.exists() or rows.read_text().count('"sft/loss"') < 5):
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    state = json.loads((run_dir / "sft_state" / "state.json").read_text())
    assert 5 <= state["step"] < 400
    status = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir)], capture_output=True, text=True,
                            timeout=60).stdout
    assert f"trainer: SFT step {state['step']}/400 (saved at step {state['step']}: a relaunch goes on from it)" \
        in status, status

    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"going on from SFT step {state['step']}" in (run_dir / "logs" / "trainer-0.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sft_steps"] == 400
    steps = [r["step"] for r in map(json.loads, rows.read_text().splitlines()) if "sft/loss" in r]
    assert steps == list(range(1, 401))  # every SFT step once
    assert not (run_dir / "sft_state").exists()
