"""benchmarks/verifiers_overhead.py, at a tiny size: the four ways run to the end, every episode succeeds, and it
prints a row each and the in-process / HTTP and processes / in-process ratios."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="pip install -e '.[verifiers]'")

ROOT = Path(__file__).resolve().parents[1]


def test_the_verifiers_overhead_benchmark_prints_each_way_and_the_ratio():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "verifiers_overhead.py"), "--tasks", "2", "--n",
                          "2", "--repeats", "1", "--processes", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ways = "rlhpc reverse_text|verifiers in-process|verifiers loopback HTTP|verifiers 2 processes"
    rows = {m.group(1): float(m.group(2))
            for m in re.finditer(rf"^  ({ways})\s+([0-9.]+)\s+[0-9.]+\s+[0-9.]+$", out.stdout, re.M)}
    assert len(rows) == 4 and all(ms > 0 for ms in rows.values()), out.stdout
    assert re.search(r"in-process / loopback HTTP: [0-9.]+$", out.stdout, re.M), out.stdout
    assert re.search(r"2 processes / in-process: [0-9.]+$", out.stdout, re.M), out.stdout
