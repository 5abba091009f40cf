"""benchmarks/context_parallel.py, at tiny sizes: it runs to the end on gloo ranks and prints both tables, a row for
the whole mask and one per cp in blocks with finite, positive figures, and two ranks fit at least the sequence one rank
does."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tables(text: str, header: str) -> list:
    """The rows under each table whose header line starts with `header`: a label, then numbers."""
    lines = text.splitlines()
    tables = []
    for start, line in enumerate(lines):
        if line.split()[:1] != [header]:
            continue
        rows = []
        for row in lines[start + 1:]:
            if not row.strip():
                break
            label, *values = row.split()
            rows.append([label] + [float(v) for v in values])
        tables.append(rows)
    return tables


@pytest.mark.slow
def test_the_context_parallel_benchmark_fits_a_longer_sequence_on_two_ranks_than_on_one():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "context_parallel.py"), "--cps", "1", "2", "--budget-mb", "40",
         "--start", "256", "--resolution", "0.15", "--fixed-tokens", "512", "--hidden", "64", "--layers", "2",
         "--heads", "4", "--kv-heads", "2", "--activation-checkpointing", "off", "--block-elements", "65536"],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    longest, fixed = _tables(proc.stdout, "attention")
    layouts = [("whole", 1), ("blocks", 1), ("blocks", 2)]
    assert [(r[0], int(r[1])) for r in longest] == layouts and [(r[0], int(r[1])) for r in fixed] == layouts
    assert all(math.isfinite(v) and v > 0 for r in longest + fixed for v in r[1:])
    assert longest[2][2] >= longest[1][2]  # the longest L at cp=2 against cp=1
    assert longest[1][3] == 1.0 and fixed[1][3] == 1.0 and fixed[1][5] == 1.0  # ratios to cp=1 in blocks
