"""Queue throughput: publish + claim + load through rlhpc.transport.queue, against a raw write + read of the same bytes.

    python benchmarks/queue_throughput.py [--dir DIR] [--files 40] [--groups 8] [--group-size 8] [--tokens 512]

Both sides write to the same filesystem (DIR, default a temp folder; point it at the shared filesystem of a cluster)
and fsync each file, so the ratio is the cost of the queue's format, atomic rename, claim and checks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.transport.queue import Group, Queue, RolloutBatch  # noqa: E402


def make_batch(groups: int, group_size: int, tokens: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = torch.full((n,), tokens)
    offsets = torch.zeros(n + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    return RolloutBatch(
        tokens=torch.randint(0, 150_000, (total,), generator=g),
        offsets=offsets,
        logprobs=-torch.rand(total, generator=g),
        loss_mask=torch.rand(total, generator=g) > 0.3,
        advantages=torch.randn(n, generator=g),
        group_of=torch.arange(groups).repeat_interleave(group_size),
        groups=[Group(uid=f"{seed}-{i}", env="bench", task_id=str(i), version=0, num_samples=group_size,
                      rewards=[0.5] * group_size, truncated=[False] * group_size, min_version=0) for i in range(groups)],
    )


def bench_queue(root: Path, batches, groups_per_step: int) -> tuple[float, int]:
    q = Queue(root)
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        q.publish(b, "w0", i)
    nbytes = sum(p.stat().st_size for p in q.pending_files())
    step, claimed = 0, 0
    while claimed < len(batches):
        c = q.claim(step, groups_per_step, min_version=0, timeout_s=10)
        claimed += len(c.files)
        q.retire_before(step + 1, keep=False)
        step += 1
    return time.perf_counter() - t0, nbytes


def bench_raw(root: Path, payloads) -> float:
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i, data in enumerate(payloads):
        with open(root / f"{i}.bin", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    for i in range(len(payloads)):
        with open(root / f"{i}.bin", "rb") as f:
            f.read()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--files-per-step", type=int, default=2, help="queue files a trainer step claims")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="rlhpc-queue-bench-"))
    batches = [make_batch(args.groups, args.group_size, args.tokens, i) for i in range(args.files)]
    payloads = [b.to_bytes("w0") for b in batches]
    best_q, best_r, nbytes = float("inf"), float("inf"), 0
    for r in range(args.repeats):
        shutil.rmtree(base / "q", ignore_errors=True)
        shutil.rmtree(base / "raw", ignore_errors=True)
        tq, nbytes = bench_queue(base / "q", batches, args.groups * args.files_per_step)
        tr = bench_raw(base / "raw", payloads)
        best_q, best_r = min(best_q, tq), min(best_r, tr)
    shutil.rmtree(base, ignore_errors=True)
    mb = nbytes / 1e6
    print(f"queue: {args.files} files x {args.groups} groups x {args.group_size} samples x {args.tokens} tokens "
          f"= {mb:.1f} MB, best of {args.repeats}")
    print(f"  rlhpc publish+claim+load : {mb / best_q:8.1f} MB/s  ({best_q * 1e3:.0f} ms)")
    print(f"  raw write+fsync+read     : {mb / best_r:8.1f} MB/s  ({best_r * 1e3:.0f} ms)")
    print(f"  ratio rlhpc/raw throughput: {best_r / best_q:.2f}")


if __name__ == "__main__":
    main()
