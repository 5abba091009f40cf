"""Plots of a run (or several): `python -m rlhpc.plots RUN_DIR [RUN_DIR ...] --out curves.png`.

Left: the SFT loss per warm-start step. Right: held-out reward (greedy) against RL step, with the training rollouts'
mean reward faded behind it. Reads logs/trainer-0.metrics.jsonl and summary.json (a run still going: run_dir/evals/,
the held-out results, written by rlhpc/train/evaluation.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

from rlhpc.metrics import read_rows
from rlhpc.rundir import RunDir, read_json


def plot_runs(run_dirs: List[Path], out: Path, labels: Optional[List[str]] = None, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_sft = any("sft/loss" in r for d in run_dirs for r in read_rows(RunDir(d), "trainer", 0))
    if with_sft:
        fig, (ax_sft, ax_rl) = plt.subplots(1, 2, figsize=(12, 4.5))
    else:  # RL only (e.g. from model.path with sft.steps=0)
        fig, ax_rl = plt.subplots(1, 1, figsize=(7, 4.5))
        ax_sft = None
    for i, d in enumerate(run_dirs):
        run = RunDir(d)
        rows = read_rows(run, "trainer", 0)
        summary = read_json(run.summary) or {}
        label = labels[i] if labels else summary.get("algo", d.name)
        sft = [(r["step"], r["sft/loss"]) for r in rows if "sft/loss" in r]
        if sft and ax_sft is not None:
            ax_sft.plot([k for k, _ in sft], [v for _, v in sft], label=f"{label} loss", lw=1)
        val = [(r["step"], r["sft/validation_reward"]) for r in rows if "sft/validation_reward" in r]
        if val and ax_sft is not None:
            ax_val = ax_sft.twinx()
            ax_val.plot([k for k, _ in val], [v for _, v in val], color="tab:green", marker=".", lw=1,
                        label="validation reward (greedy)")
            ax_val.set(ylabel="reward", ylim=(0, 1))
            ax_val.legend(fontsize=8, loc="center right")
        # The held-out curve: (weights version, reward); version v is the policy after RL step v.
        curve = (summary.get("eval_curve")
                 or sorted((e["version"], e["reward"]) for e in map(read_json, (run.root / "evals").glob("v*.json")) if e)
                 or [(r["step"], r["eval/heldout_reward"]) for r in rows if "eval/heldout_reward" in r])
        (line,) = ax_rl.plot([s for s, _ in curve], [v for _, v in curve], marker="o", ms=3, label=f"{label} held-out (greedy)")
        train = [(r["step"], r["rollout/reward"]) for r in rows if "rollout/reward" in r]
        if train:
            ax_rl.plot([s for s, _ in train], [v for _, v in train], color=line.get_color(), alpha=0.25, lw=1)
    if ax_sft is not None:
        ax_sft.set(title="SFT warm start (stops at partial competence)", xlabel="SFT step", ylabel="loss")
    ax_rl.set(title="RL (faded: training rollouts' mean reward)", xlabel="RL step", ylabel="reward", ylim=(0, 1))
    for ax in (a for a in (ax_sft, ax_rl) if a is not None):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("curves.png"))
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    print(plot_runs(args.run_dirs, args.out, args.labels, args.title))


if __name__ == "__main__":
    main()
