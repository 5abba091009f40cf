"""The tool-using quick start at reduced size, end to end: SFT on reference trajectories that call the tool, then
asynchronous RL on two-turn episodes that raises held-out reward."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_tool_text_learns_to_call_the_tool_and_rl_raises_held_out_reward(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", "+exp=tool_text", f"run_dir={run_dir}", "trainer.steps=100",
         "eval.interval=50", "launcher.progress=false",
         # The SFT's stop check on 32 tasks every 20 steps instead of 64 every 5: in CI (2026-12-07) 169 checks were a
         # third of its 432 s of SFT (845 steps). It stops at most 15 steps later, a little past 0.45; RL then gained
         # +0.18 (0.451 -> 0.633), far above the bound below.
         "sft.check_interval=20", "sft.validation_tasks=32",
         # SFT sits on a plateau (loss ~1.28: the format learned, the reversal not) until the reversal clicks: at lr
         # 1e-3 (the preset's) after ~750 steps, stopping at 860 (317 s); at 3e-3 after ~500, stopping at 620 (238 s),
         # held-out 0.456 (2026-12-07).
         "sft.optim.lr=3e-3"],
        capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # The base model never calls the tool; SFT on trajectories teaches the call and partial competence.
    assert summary["heldout_reward_base"] < 0.05
    assert 0.2 <= summary["heldout_reward_sft"] <= 0.6, summary
    # Measured (docs/environments.md): +0.17 and +0.20 after 100 steps (0.406 -> 0.571, 0.603) on one 2-core machine;
    # +0.09, +0.09 and +0.11 (0.447 -> 0.538, 0.541, 0.556) on another, whose numerics gave another SFT model. The
    # bound leaves room for both and for seed noise.
    assert summary["heldout_reward_rl"] >= summary["heldout_reward_sft"] + 0.05, summary
    rows = [json.loads(x) for x in (run_dir / "logs" / "inference-0.metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    # Every episode called the tool and took two turns; no environment call failed.
    assert last["env/turns"] == 2.0 and last["env/tool_calls"] > 0 and last["env/errors"] == 0
