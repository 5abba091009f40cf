"""Sandbox overhead: the cost per call of running a program through rlhpc.env.sandbox, against a bare subprocess.

    python benchmarks/sandbox_overhead.py [--calls 50] [--dir DIR]

Each command (`true`, `python -c pass`) runs --calls times bare (subprocess.run), unsandboxed (the same limits and
timeout through prlimit, no isolation) and in the bwrap sandbox, interleaved so that load on the node hits all three
alike. Prints per-call medians and the ratio sandbox/bare.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.env.sandbox import Sandbox  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--dir", default=None, help="parent of the sandbox workdirs (default: a temp folder)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rlhpc-sandbox-bench-", dir=args.dir))
    runners = {
        "bare": lambda argv: subprocess.run(argv, capture_output=True, cwd=base, check=True),
        "unsandboxed": Sandbox(base / "unsandboxed", mode="unsandboxed").run,
        "sandbox": Sandbox(base / "sandbox").run,
    }
    commands = {"true": ["true"], "python -c pass": [sys.executable, "-c", "pass"]}
    print(f"sandbox overhead: {args.calls} calls per command, median ms per call")
    print(f"  {'command':<16}" + "".join(f"{name:>13}" for name in runners) + f"{'sandbox/bare':>14}")
    for label, argv in commands.items():
        for run in runners.values():  # warm up: page cache, first exec
            run(argv)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.calls):
            for name, run in runners.items():
                times[name].append(timed(lambda: run(argv)))
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"  {label:<16}" + "".join(f"{m:13.1f}" for m in med.values()) + f"{med['sandbox'] / med['bare']:14.1f}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
