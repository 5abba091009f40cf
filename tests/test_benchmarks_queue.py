"""benchmarks/queue_throughput.py, at tiny sizes: both parts run to the end and print their ratios, where the
single producer's time goes, and each side's CPU seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_queue_benchmark_prints_its_ratios_breakdown_and_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "queue_throughput.py"), "--dir", str(tmp_path / "bench"),
         "--files", "4", "--groups", "2", "--group-size", "2", "--tokens", "16", "--files-per-step", "2",
         "--producers", "2", "--concurrent-files", "8", "--step-files", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    ratio = re.search(r"ratio rlhpc/raw throughput: ([0-9.]+)", text)
    assert ratio and float(ratio.group(1)) > 0, text
    assert re.search(r"publish \d+ ms \(raw write\+fsync \d+\), claim\+load \d+ ms \(raw read [0-9.]+\), "
                     r"record\+sync [0-9.]+ ms", text), text
    row = re.search(r"^\s+2\s+8\s.*queue ([0-9.]+) \+ ([0-9.]+), raw ([0-9.]+) \+ ([0-9.]+)$", text, re.M)
    assert row, text  # CPU seconds of each side (may round to 0 at these sizes: the kernel counts CPU in ticks)
    assert not (tmp_path / "bench").exists()  # it cleans up after itself
