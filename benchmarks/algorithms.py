"""The quick start once per algorithm, same seed, same SFT warm start; one PNG of held-out reward against RL step.

    python benchmarks/algorithms.py [--algos grpo dr_grpo dapo gspo cispo aipo grpo_kl] [--steps 100] [--out docs/img/algorithms.png]

The SFT warm start runs once (`python -m rlhpc.sft`); every algorithm then starts RL from that same model
(`model.path=<sft model> sft.steps=0`), so the curves differ only by the algorithm. Prints a table of the held-out
reward after SFT and after RL for each, and the RL wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhpc.plots import plot_runs  # noqa: E402

ALGOS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "aipo", "grpo_kl"]


def launch(args, *overrides) -> None:
    cmd = [sys.executable, "-m", *args, "+exp=reverse_text", "launcher.progress=false", *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", nargs="*", default=ALGOS)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-algorithms")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "algorithms.png")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sft_dir = args.workdir / "sft"
    if not (sft_dir / "model" / "config.json").exists():
        launch(["rlhpc.sft"], f"run_dir={sft_dir}", "overwrite=true")
    sft = json.loads((sft_dir / "summary.json").read_text())
    rows, runs = [], []
    for algo in args.algos:
        run_dir = args.workdir / algo
        t0 = time.time()
        launch(["rlhpc.launch"], f"algo={algo}", f"run_dir={run_dir}", "overwrite=true", f"model.path={sft_dir / 'model'}",
               "sft.steps=0", f"trainer.steps={args.steps}")
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append((algo, summary["heldout_reward_sft"], summary["heldout_reward_rl"], time.time() - t0))
        runs.append(run_dir)
        print(f"{algo:>8}: held-out {summary['heldout_reward_sft']:.3f} -> {summary['heldout_reward_rl']:.3f}", flush=True)
    plot_runs(runs, args.out, labels=args.algos, title=f"reverse_text: RL from the same SFT model ({sft['heldout_reward_sft']:.2f})")
    print(f"\n{'algo':>8} {'after SFT':>10} {'after RL':>9} {'gain':>6} {'wall s':>7}")
    for algo, before, after, wall in rows:
        print(f"{algo:>8} {before:>10.3f} {after:>9.3f} {after - before:>+6.3f} {wall:>7.0f}")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
