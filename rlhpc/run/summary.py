"""The end-of-run summary: summary.json in the run directory and a short table on the terminal."""

from __future__ import annotations

from typing import Optional

from rlhpc.run.metrics import bottleneck
from rlhpc.run.rundir import RunDir, read_json, write_json


def print_summary(run: RunDir, wall_time_s: Optional[float] = None) -> dict:
    s = read_json(run.summary) or {}
    if wall_time_s is not None:
        s["wall_time_s"] = wall_time_s
        write_json(run.summary, s)
    rows = [
        ("held-out reward, base model", s.get("heldout_reward_base")),
        ("held-out reward after SFT", s.get("heldout_reward_sft")),
        ("held-out reward after RL", s.get("heldout_reward_rl")),
        ("SFT steps", s.get("sft_steps")),
        ("RL steps", s.get("rl_steps")),
        ("wall time (s)", s.get("wall_time_s")),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "-" * (width + 12))
    for k, v in rows:
        text = f"{v:.3f}" if isinstance(v, float) and "time" not in k else (f"{v:.0f}" if isinstance(v, float) else str(v))
        print(f"{k:<{width}}  {text:>8}")
    print("-" * (width + 12))
    if s.get("busy"):
        print("time: " + "; ".join(f"{name} busy {b['busy']:.0%}, waiting {b['waiting']:.0%}"
                                   for name, b in s["busy"].items()))
        verdict = bottleneck(s["busy"])
        if verdict:
            print(f"      {verdict}")
    print(f"summary: {run.summary}")
    if run.samples.exists():
        print(f"samples: {run.samples}  (rollouts as text: prompt, completion, reward; TensorBoard's text tab too)")
    return s
