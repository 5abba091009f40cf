"""benchmarks/dsa_indexer.py, at tiny sizes: it runs to the end and prints a row per length with finite, positive
figures; the trainer's blocked indexer chooses the keys its unblocked one does and holds less than transformers' at
the longer length."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_the_indexer_benchmark_compares_both_indexers_at_each_length():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "dsa_indexer.py"), "--lengths", "256", "768", "--repeats", "1",
         "--heads", "4", "--head-dim", "32", "--hidden", "128", "--topk", "64", "--block-elements", "16384"],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["256"], ["768"])]
    assert [int(r[0]) for r in rows] == [256, 768]
    for r in rows:
        figures = [float(v) for v in r[1:7]]
        assert all(math.isfinite(v) and v > 0 for v in figures), r
        assert r[7] == "yes"  # the blocked choice is the unblocked one
    transformers_mib, rlhpc_mib = float(rows[1][1]), float(rows[1][3])
    assert rlhpc_mib < transformers_mib  # 768 x 768 scores of 4 heads against blocks of 16384
