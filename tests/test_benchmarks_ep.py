"""benchmarks/expert_parallel.py, at tiny sizes: it runs to the end on gloo ranks and prints both tables, a row per
rank count and per ep, with finite, positive ratios."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _rows(text: str, header: str) -> list:
    """The rows of numbers under the table whose header line starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [header]) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append([float(v) for v in line.split()])
    return rows


@pytest.mark.slow
def test_the_expert_parallel_benchmark_prints_finite_positive_ratios_for_each_layout():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "expert_parallel.py"), "--worlds", "2", "4", "--tokens", "128",
         "--hidden", "32", "--experts", "4", "--rounds", "1", "--iters", "1", "--ranks", "2", "--eps", "1", "2",
         "--layers", "1", "--moe-intermediate", "16", "--groups", "2", "--group-size", "2", "--steps", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    exchange = _rows(proc.stdout, "ranks")
    assert [int(r[0]) for r in exchange] == [2, 4]
    assert all(r[1] > 0 and all(math.isfinite(v) and v > 0 for v in r[-2:]) for r in exchange)  # bytes; ratios
    step = _rows(proc.stdout, "ep")
    assert [int(r[0]) for r in step] == [1, 2]
    assert step[0][3] == 1.0 and all(math.isfinite(r[3]) and r[3] > 0 for r in step)  # s/step against ep=1
    assert max(r[-1] for r in step) - min(r[-1] for r in step) < 1e-5  # the same warm-up loss whatever ep
