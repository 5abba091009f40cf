"""A short launch with its roles forked from the preload process, against each role started as a new interpreter.

    python benchmarks/launch_start.py [--repeats 3] [--steps 2] [extra overrides ...]

Both sides run the same command, `python -m rlhpc.launch +exp=reverse_text` with a few SFT and RL steps, differing in
`launcher.preload` alone, alternating (on, off, on, off, ...) so that a machine's drift touches both. Reported per
side: the median wall time of the whole launch and the median CPU seconds of every process it started (the launcher
waits for all of them, so its children's rusage counts them), and the ratios preload/new interpreters. The first launch
of each side is not counted: it fills the launcher's model-check cache (rlhpc/modeling/remembered.py) after a change
of code.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_launch(run_dir: Path, preload: bool, steps: int, extra: list) -> tuple:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", "sft.steps=5", f"trainer.steps={steps}",
         "eval.num_tasks=4", "eval.interval=0", "algo.group_size=2", "trainer.groups_per_step=2",
         "inference.groups_per_batch=1", "launcher.progress=false", f"launcher.preload={str(preload).lower()}",
         f"run_dir={run_dir}", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed (launcher.preload={preload}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="more overrides for both sides")
    args = ap.parse_args()
    results = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats + 1):
            for preload in (True, False):
                wall, cpu = one_launch(Path(tmp) / f"{i}-{preload}", preload, args.steps, args.extra)
                print(f"  launcher.preload={str(preload).lower():5s} wall {wall:6.1f} s  cpu {cpu:6.1f} s"
                      f"{'  (warm-up, not counted)' if i == 0 else ''}", flush=True)
                if i:
                    results[preload].append((wall, cpu))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
    print(f"\nshort launch ({args.steps} RL steps), {os.cpu_count()} cores, median of {args.repeats}:")
    print(f"  forked from the preload process: {med[True][0]:6.1f} s wall, {med[True][1]:6.1f} s CPU")
    print(f"  new interpreters:                {med[False][0]:6.1f} s wall, {med[False][1]:6.1f} s CPU")
    print(f"  ratio preload/new: wall {med[True][0] / med[False][0]:.2f}, CPU {med[True][1] / med[False][1]:.2f}")


if __name__ == "__main__":
    main()
