"""Chaos at reduced size: during one run, inference workers are killed three times, the trainer once, two queue files
are corrupted and a worker freezes for seconds. The run completes in one launch (workers and the trainer are started
again under the default restart settings); the ledger shows every step trained once, no group twice and none lost;
the final held-out reward is within REWARD_TOLERANCE of an undisturbed run of the same seed.

The injections and the accounting live in tests/faults.py (shared with benchmarks/chaos.py); the Slurm version of this
test is in tests/test_chaos_slurm.py.
"""

import json
import os
import sys

import pytest

from conftest import CHAOS_CHECKPOINT as CHECKPOINT, CHAOS_STEPS as STEPS
from faults import LocalChaos, account, heldout, rl_overrides, survived
from test_launch import rlhpc_processes

# |held-out reward of the disturbed run - that of the undisturbed run|, both RL from the same warm start with the same
# seed. Measured with `python benchmarks/chaos.py --steps 70 --checkpoint-interval 10 --repeats 3` (docs/
# changelog.md, 2026-12-03): warm start 0.429; undisturbed 0.545 0.537 0.576, disturbed 0.524 0.561 0.549; the largest
# |difference| of a pair 0.027, the undisturbed runs' own range 0.040 (async RL is not bitwise repeatable). Undisturbed
# runs of this test since: 0.504, 0.511 (its disturbed twin 0.575: a difference of 0.064 from noise alone), so the
# undisturbed runs span 0.504-0.576, and the tolerance is wider than that range.
REWARD_TOLERANCE = 0.09
# Disturbed runs gained +0.086 to +0.132 over the warm start (those three and this test's own run) on the first
# machine; on a second one, whose numerics give another warm start (0.418), +0.032 and +0.057 here and +0.033 in
# tests/test_chaos_slurm.py (undisturbed twins +0.057, +0.062), 2026-12-06. A disturbed run must gain at least this
# much, so a run that trained on nothing (its reward is the warm start's, to the digit) fails even when its undisturbed
# twin is low; the ledger checks above show that every step trained.
MIN_GAIN = 0.02


@pytest.mark.slow
def test_a_run_survives_killed_workers_a_killed_trainer_corrupt_files_and_a_frozen_worker(tmp_path, quickstart_sft_model,
                                                                                         chaos_calm):
    args = [sys.executable, "-m", "rlhpc.launch", *rl_overrides(quickstart_sft_model, STEPS, CHECKPOINT)]
    run_dir = tmp_path / "chaos"
    seed = int(os.environ.get("RLHPC_CHAOS_SEED", os.getpid()))
    print(f"chaos seed {seed} (RLHPC_CHAOS_SEED={seed} repeats the moments of the faults)")
    chaos = LocalChaos([*args, f"run_dir={run_dir}"], run_dir, STEPS, CHECKPOINT, seed=seed)
    code = chaos.run()
    assert code == 0, chaos.output[-3000:]
    # The trainer's kill did not end the run: the launcher started it again (trainer.max_restarts, by default).
    assert "trainer-0 exited with code -9" in chaos.output
    assert "restarting the trainer (1 of trainer.max_restarts=2)" in chaos.output, chaos.output[-3000:]
    assert chaos.resumed_from >= 2 * CHECKPOINT

    faults = survived(chaos.faults, run_dir, completed=True, log_text=chaos.output)
    kinds = [f.kind for f in faults]
    assert kinds.count("kill worker") == 3 and kinds.count("kill trainer") == 1
    assert kinds.count("corrupt file") == 2 and kinds.count("freeze worker") == 1
    assert all(f.survived for f in faults), faults  # each killed worker restarted, each corrupt file quarantined

    groups = account(run_dir, chaos.snapshots)
    print(groups.line())
    assert groups.steps == list(range(STEPS))  # every step trained once
    assert groups.duplicated == []  # no group trained twice
    assert groups.lost == []  # every group published before the trainer died was trained, dropped or set aside
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and summary["resumed_at"] == [chaos.resumed_from]

    sft, calm_reward = chaos_calm["sft"], chaos_calm["rl"]
    chaos_reward = heldout(run_dir)["rl"]
    print(f"held-out reward: warm start {sft:.3f}, undisturbed {calm_reward:.3f}, chaos {chaos_reward:.3f} "
          f"(tolerance {REWARD_TOLERANCE})")
    assert abs(chaos_reward - calm_reward) <= REWARD_TOLERANCE
    assert chaos_reward >= sft + MIN_GAIN
    assert rlhpc_processes(run_dir) == []
