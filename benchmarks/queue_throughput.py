"""Queue throughput: publish + claim + load through rlhpc.transport.queue, against a raw write + read of the same bytes.

    python benchmarks/queue_throughput.py [--dir DIR] [--files 40] [--groups 8] [--group-size 8] [--tokens 512]
                                          [--producers 8,64] [--concurrent-files 256] [--step-files 8]

Both sides write to the same filesystem (DIR, default a temp folder; point it at the shared filesystem of a cluster)
and fsync each file, so the ratio is the cost of the queue's format, atomic rename, claim, checks and per-step records.

First one producer publishes --files files, then a trainer claims and records them, --files-per-step a step (the lines
`rlhpc publish+claim+load`, `raw write+fsync+read`, `ratio`). Then, for each count in --producers, that many producers
share --concurrent-files files, publishing as fast as they can, while the trainer claims steps of --step-files files
and does its per-step bookkeeping as rlhpc/train/claims.py does (progress.json after each pass that moved files in and
twice a step, the ledger line that makes the claim durable); raw: as many producers write + fsync the same bytes
(no temporary name, no rename) while one reader reads each file once told it is written (through a pipe, where the
trainer has to look at the folder). Producers are threads of one process, the trainer (and the raw reader) a process
of its own: a trainer never shares an interpreter with workers. Times run from the start to the last file loaded,
best of --repeats. Retiring the trained steps (deleting their files: at checkpoints in a run) is timed apart, since
the raw side deletes nothing. Every timed part starts after an os.sync(), so that neither side pays in its first
fsync for the files the other side (or the previous repeat) wrote or deleted: a journal commit on ext4 carries
everything pending, whoever made it.

The raw side records nothing about what it read, so the trainer's record of each step (the ledger line) and the sync
that makes the claims durable (as before a checkpoint: once per run here, counted in the queue's time) have no
counterpart there. For reference only, `raw+record` is the raw side plus one fsynced line appended to a file per step
(the ratio against plain raw stays the figure of merit).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

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


# ---- one producer, then the trainer ----------------------------------------------------------------------------------


def bench_queue(root: Path, batches, groups_per_step: int) -> tuple[float, ...]:
    """(seconds to publish, claim and record every batch, seconds to retire the trained steps, and the parts of the
    first: publishing, claiming, recording and the sync)."""
    q = Queue(root)
    os.sync()
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        q.publish(b, "w0", i)
    t_publish = time.perf_counter() - t0
    step, claimed, t_claim = 0, 0, 0.0
    while claimed < len(batches):
        t = time.perf_counter()
        c = q.claim(step, groups_per_step, min_version=0, timeout_s=10)
        t_claim += time.perf_counter() - t
        q.record(step, c)
        claimed += len(c.files)
        step += 1
    q.sync()  # the claims made durable, as before a checkpoint (one per run here)
    t_queue = time.perf_counter() - t0
    q.retire_before(step, keep=False)
    return (t_queue, time.perf_counter() - t0 - t_queue, t_publish, t_claim, t_queue - t_publish - t_claim)


def bench_raw(root: Path, payloads, files_per_step: int = 0) -> tuple[float, float, float]:
    """(seconds to write + fsync, then read, every payload; seconds of the writing, of the reading); with `files_per_step`, also
    appending and fsyncing a line to a ledger after each step's files are read (raw+record)."""
    root.mkdir(parents=True, exist_ok=True)
    os.sync()
    t0 = time.perf_counter()
    for i, data in enumerate(payloads):
        write_fsync(root / f"{i}.bin", data)
    t_write = time.perf_counter() - t0
    for i in range(len(payloads)):
        with open(root / f"{i}.bin", "rb") as f:
            f.read()
        if files_per_step and (i + 1) % files_per_step == 0:
            append_fsync(root / "ledger", f"{i}\n")
    total = time.perf_counter() - t0
    return total, t_write, total - t_write


def write_fsync(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def append_fsync(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


# ---- many producers, the trainer claiming meanwhile -----------------------------------------------------------------


def run_concurrent(producers: int, produce: Callable[[int], None],
                   consume: Callable[[], None]) -> tuple[float, float, float]:
    """(seconds from a common start until `consume()` returns, CPU seconds of the producers, CPU seconds of the
    consumer), with `produce(rank)` running on `producers` threads. CPU seconds are user + system time: the producers'
    are their process's over the run (its main thread only waits meanwhile), the consumer's its own.

    `consume` runs in a forked process of its own, as the trainer does: sharing an interpreter lock with the producers
    would charge the trainer for their Python work. The producers share one, which can only slow them."""
    ctx = mp.get_context("fork")
    ready, go, result = ctx.Event(), ctx.Event(), ctx.SimpleQueue()

    def consumer() -> None:
        torch.set_num_threads(1)  # as DataLoader workers do: the parent's thread pool does not survive a fork
        ready.set()
        go.wait()
        try:
            cpu = cpu_seconds()
            consume()
            # CLOCK_MONOTONIC: the same clock in both processes.
            result.put((time.perf_counter(), cpu_seconds() - cpu))
        except BaseException as e:  # noqa: BLE001 - reported by the parent
            result.put(f"the consumer failed: {type(e).__name__}: {e}")

    proc = ctx.Process(target=consumer, daemon=True)
    proc.start()
    ready.wait()
    os.sync()
    start, errors = threading.Event(), []

    def producer(rank: int) -> None:
        start.wait()
        try:
            produce(rank)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(r,), daemon=True) for r in range(producers)]
    for t in threads:
        t.start()
    cpu = cpu_seconds()
    t0 = time.perf_counter()
    go.set()
    start.set()
    for t in threads:
        t.join()
    producers_cpu = cpu_seconds() - cpu
    if errors:
        proc.kill()
        raise errors[0]
    end = result.get()
    proc.join()
    if isinstance(end, str):
        raise RuntimeError(end)
    return end[0] - t0, producers_cpu, end[1]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_queue_concurrent(root: Path, shares: Sequence[Sequence[RolloutBatch]], files_per_step: int,
                           groups: int) -> tuple[float, float, float, float]:
    """(seconds until the trainer has claimed every file, seconds to retire the trained steps, CPU seconds of the
    producers, of the trainer)."""
    total = sum(len(s) for s in shares)
    Queue(root)  # the folders, before anyone starts

    def produce(rank: int) -> None:
        q = Queue(root)  # each worker has its own
        for seq, b in enumerate(shares[rank]):
            q.publish(b, f"w{rank}", seq)

    def consume() -> None:
        trainer = Queue(root)
        claimed, step = 0, 0
        while claimed < total:
            c = trainer.claim(step, files_per_step * groups, min_version=0, timeout_s=60, max_version=step,
                              on_progress=lambda have: trainer.set_progress(step, step, claiming=have))
            trainer.set_progress(claimed=step + 1, version=step)
            trainer.set_progress(claimed=step + 1, version=step + 1)  # the step "trained": rlhpc/train/claims.py
            trainer.record(step, c)
            claimed += len(c.files)
            step += 1
        trainer.sync()  # as before a checkpoint: one per run here

    t_queue, cpu_producers, cpu_trainer = run_concurrent(len(shares), produce, consume)
    t0 = time.perf_counter()
    Queue(root).retire_before(1 << 30, keep=False)
    return t_queue, time.perf_counter() - t0, cpu_producers, cpu_trainer


def bench_raw_concurrent(root: Path, shares: Sequence[Sequence[bytes]],
                         files_per_step: int = 0) -> tuple[float, float, float]:
    root.mkdir(parents=True, exist_ok=True)
    total = sum(len(s) for s in shares)
    written = mp.get_context("fork").SimpleQueue()

    def produce(rank: int) -> None:
        for seq, data in enumerate(shares[rank]):
            path = root / f"w{rank}-{seq}.bin"
            write_fsync(path, data)
            written.put(str(path))

    def consume() -> None:
        for i in range(total):
            with open(written.get(), "rb") as f:
                f.read()
            if files_per_step and (i + 1) % files_per_step == 0:
                append_fsync(root / "ledger", f"{i}\n")

    return run_concurrent(len(shares), produce, consume)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--files-per-step", type=int, default=2, help="queue files a trainer step claims (one producer)")
    ap.add_argument("--producers", default="8,64", help="producer counts for the concurrent runs ('' for none)")
    ap.add_argument("--concurrent-files", type=int, default=256, help="files of each concurrent run, all producers")
    ap.add_argument("--step-files", type=int, default=8, help="queue files a trainer step claims (concurrent runs)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="rlhpc-queue-bench-"))
    batches = [make_batch(args.groups, args.group_size, args.tokens, i) for i in range(args.files)]
    payloads = [b.to_bytes("w0") for b in batches]
    best = best_of(args.repeats, base, {
        "queue": lambda: bench_queue(base / "q", batches, args.groups * args.files_per_step),
        "raw": lambda: bench_raw(base / "raw", payloads),
        "raw+record": lambda: bench_raw(base / "raw", payloads, args.files_per_step),
    })
    mb = sum(len(p) for p in payloads) / 1e6
    (best_q, best_retire, q_publish, q_claim, q_record), (best_r, r_write, r_read) = best["queue"], best["raw"]
    best_rr = best["raw+record"][0]
    print(f"queue: {args.files} files x {args.groups} groups x {args.group_size} samples x {args.tokens} tokens "
          f"= {mb:.1f} MB, best of {args.repeats}")
    print(f"  rlhpc publish+claim+load : {mb / best_q:8.1f} MB/s  ({best_q * 1e3:.0f} ms)")
    print(f"  raw write+fsync+read     : {mb / best_r:8.1f} MB/s  ({best_r * 1e3:.0f} ms)")
    print(f"  ratio rlhpc/raw throughput: {best_r / best_q:.2f}")
    print(f"  where the time goes (the least of each part): publish {q_publish * 1e3:.0f} ms (raw write+fsync "
          f"{r_write * 1e3:.0f}), claim+load {q_claim * 1e3:.0f} ms (raw read {r_read * 1e3:.1f}), "
          f"record+sync {q_record * 1e3:.1f} ms")
    print(f"  (raw+record, an fsynced line a step: {best_rr * 1e3:.0f} ms, ratio {best_rr / best_q:.2f}; retiring "
          f"the {args.files // args.files_per_step} trained steps, not timed above: {best_retire * 1e3:.0f} ms)")

    counts = [int(p) for p in args.producers.split(",") if p.strip()]
    if counts:
        print(f"concurrent: producers publishing {args.concurrent_files} files in all while the trainer claims "
              f"{args.step_files} files a step; best of {args.repeats}")
        print(f"  {'producers':>9} {'files':>6} {'MB':>7} {'queue s':>8} {'raw s':>7} {'queue/raw throughput':>21} "
              f"{'retire s':>9} {'raw+record s':>13} {'ratio to it':>12}   CPU s (producers + trainer or reader)")
    for producers in counts:
        files = args.concurrent_files - args.concurrent_files % args.step_files
        batches = [make_batch(args.groups, args.group_size, args.tokens, i) for i in range(files)]
        payloads = [b.to_bytes(f"w{i % producers}") for i, b in enumerate(batches)]
        shares = [batches[r::producers] for r in range(producers)]
        raw_shares = [payloads[r::producers] for r in range(producers)]
        best = best_of(args.repeats, base, {
            "queue": lambda: bench_queue_concurrent(base / "q", shares, args.step_files, args.groups),
            "raw": lambda: bench_raw_concurrent(base / "raw", raw_shares),
            "raw+record": lambda: bench_raw_concurrent(base / "raw", raw_shares, args.step_files),
        })
        mb = sum(len(p) for p in payloads) / 1e6
        (best_q, best_retire, q_prod, q_train), (best_r, r_prod, r_read) = best["queue"], best["raw"]
        best_rr = best["raw+record"][0]
        print(f"  {producers:>9} {files:>6} {mb:>7.1f} {best_q:>8.3f} {best_r:>7.3f} {best_r / best_q:>21.2f} "
              f"{best_retire:>9.3f} {best_rr:>13.3f} {best_rr / best_q:>12.2f}   "
              f"queue {q_prod:.3f} + {q_train:.3f}, raw {r_prod:.3f} + {r_read:.3f}")
    if counts:
        print(f"  (CPU s: the least over the repeats; with {os.cpu_count()} cores a run takes at least its CPU seconds / "
              f"{os.cpu_count()})")
    shutil.rmtree(base, ignore_errors=True)


def best_of(repeats: int, base: Path,
            runs: Dict[str, Callable[[], Tuple[float, ...]]]) -> Dict[str, Tuple[float, ...]]:
    """The least of each of the figures (seconds) that `runs` return over `repeats` rounds, from fresh folders; the
    order of the runs turns each round, so that a load that changes during a round does not favour one of them."""
    best: Dict[str, Tuple[float, ...]] = {}
    names = list(runs)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            shutil.rmtree(base / "q", ignore_errors=True)
            shutil.rmtree(base / "raw", ignore_errors=True)
            figures = runs[name]()
            best[name] = tuple(map(min, best[name], figures)) if name in best else figures
    return best


if __name__ == "__main__":
    main()
