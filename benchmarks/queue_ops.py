"""Filesystem metadata operations per trainer step, with many inference workers waiting on the queue.

    python benchmarks/queue_ops.py [--workers 64] [--steps 12] [--train-s 0.5] [--generate-s 2.0] [--dir DIR]

A trainer thread claims, "trains" (sleeps --train-s), publishes progress and records the step, as
rlhpc/train/trainer.py does; each of --workers threads runs the waiting policy of rlhpc/infer/worker.py
(back-pressure on pending and in-flight batches, backing off up to queue.poll_max_s) and "generates" a batch in
--generate-s under an in-flight lease, then publishes it. Weights arrive by broadcast (in memory) in a real run, so here a worker takes its version from progress.json,
which it reads anyway. Workers produce faster than the trainer consumes, so most of them wait most of the time:
the case that matters on a cluster.

Every call that costs the filesystem a metadata operation is counted (stat, open, listing, rename, unlink, mkdir,
utime, fsync, link), by the thread that makes it. `--old` runs the waiting policy rlhpc had before leases and back-off
(a look every 10 ms, a stat per pending file, markers without expiry) for comparison.
"""

from __future__ import annotations

import argparse
import builtins
import io
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.run.rundir import Backoff  # noqa: E402
from rlhpc.transport.queue import Queue  # noqa: E402
from queue_throughput import make_batch  # noqa: E402

# ---- counting ------------------------------------------------------------------------------------------------------

_counts: Counter = Counter()
_lock = threading.Lock()


def _who() -> str | None:
    name = threading.current_thread().name
    if name == "trainer":
        return "trainer"
    if name.startswith("worker") or name == "queue-lease":
        return "workers"
    return None


def _count(n: int = 1) -> None:
    who = _who()
    if who is not None:
        with _lock:
            _counts[who] += n


def _counted(fn):
    def wrapper(*args, **kwargs):
        _count()
        return fn(*args, **kwargs)

    return wrapper


class _Entry:
    """A DirEntry whose stat() is counted (listing a folder is one operation, each stat of an entry another)."""

    def __init__(self, entry):
        self._entry = entry

    def stat(self, **kwargs):
        _count()
        return self._entry.stat(**kwargs)

    def __getattr__(self, name):
        return getattr(self._entry, name)

    def __fspath__(self):
        return self._entry.path


class _Scan:
    def __init__(self, it):
        self._it = it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._it.close()

    def __iter__(self):
        return (_Entry(e) for e in self._it)

    def close(self):
        self._it.close()


def install_counters() -> None:
    for name in ("stat", "lstat", "listdir", "open", "replace", "rename", "unlink", "remove", "mkdir", "rmdir",
                 "utime", "fsync", "link"):
        setattr(os, name, _counted(getattr(os, name)))
    scandir = os.scandir
    os.scandir = lambda *a, **k: (_count(), _Scan(scandir(*a, **k)))[1]
    io.open = builtins.open = _counted(builtins.open)


# ---- the roles -----------------------------------------------------------------------------------------------------


class Sim:
    def __init__(self, root: Path, args):
        self.root, self.a = root, args
        self.q = Queue(root / "queue", lease_s=args.lease_s)
        self.done = root / "DONE"
        self.step_times: list = []
        self.batches = [make_batch(args.groups_per_batch, 4, 64, i) for i in range(4)]

    def trainer(self) -> None:
        a, q = self.a, self.q
        for step in range(a.steps):
            claim = q.claim(step, a.groups_per_step, step - a.async_level, timeout_s=120, max_version=step)
            q.set_progress(claimed=step + 1, version=step)
            time.sleep(a.train_s)
            q.set_progress(claimed=step + 1, version=step + 1)
            q.record(step, claim)  # the ledger line, which makes the claim durable
            q.retire_before(step + 1, keep=False)
            with _lock:
                self.step_times.append((time.monotonic(), sum(_counts.values()), dict(_counts)))
        self.done.touch()

    def worker(self, rank: int) -> None:
        a = self.a
        q = Queue(self.root / "queue", lease_s=a.lease_s)  # each worker has its own, as each process does
        producer, seq = f"w{rank}", 0
        backoff = Backoff(a.poll_max_s)
        while not self.done.exists():
            progress = q.progress()
            version = progress["version"]  # by broadcast in a real run: no filesystem operation
            if a.old:
                waiting = len(q.pending_files()) + sum(1 for p in q.inflight.iterdir() if p.name != producer)
            else:
                waiting = q.pending_count() + q.inflight_batches(exclude=producer)
            pending_groups = waiting * a.groups_per_batch
            target = progress["claimed"] + pending_groups // a.groups_per_step
            if pending_groups >= a.max_pending_steps * a.groups_per_step or version < target - a.async_level:
                time.sleep(0.01 if a.old else backoff.next())
                continue
            backoff.reset()
            if a.old:
                (q.inflight / producer).touch()
            else:
                q.begin_batch(producer)
            time.sleep(a.generate_s)
            batch = self.batches[seq % len(self.batches)]
            for g in batch.groups:
                g.version, g.min_version = version, version
            q.publish(batch, producer, seq)
            if a.old:
                (q.inflight / producer).unlink(missing_ok=True)
            else:
                q.end_batch(producer)
            seq += 1


def run(args, root: Path) -> dict:
    _counts.clear()
    sim = Sim(root, args)
    threads = [threading.Thread(target=sim.worker, args=(r,), name=f"worker-{r}", daemon=True)
               for r in range(args.workers)]
    for t in threads:
        t.start()
    trainer = threading.Thread(target=sim.trainer, name="trainer")
    trainer.start()
    trainer.join()
    for t in threads:
        t.join(timeout=10)
    # Steady state: from the end of step `warmup` to the end of the last step.
    (t0, _, c0), (t1, _, c1) = sim.step_times[args.warmup - 1], sim.step_times[-1]
    steps = len(sim.step_times) - args.warmup
    per_step = {k: (c1.get(k, 0) - c0.get(k, 0)) / steps for k in ("trainer", "workers")}
    return {"per_step": per_step, "step_s": (t1 - t0) / steps,
            "per_worker_per_s": (c1.get("workers", 0) - c0.get("workers", 0)) / (t1 - t0) / args.workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the queue lives (default: a temp folder)")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps not measured")
    ap.add_argument("--train-s", type=float, default=0.5)
    ap.add_argument("--generate-s", type=float, default=2.0)
    ap.add_argument("--groups-per-step", type=int, default=64)
    ap.add_argument("--groups-per-batch", type=int, default=8)
    ap.add_argument("--max-pending-steps", type=int, default=2)
    ap.add_argument("--async-level", type=int, default=1)
    ap.add_argument("--poll-max-s", type=float, default=0.5, help="queue.poll_max_s")
    ap.add_argument("--lease-s", type=float, default=60.0, help="queue.lease_s")
    ap.add_argument("--old", action="store_true", help="only the waiting policy from before leases and back-off")
    ap.add_argument("--new", action="store_true", help="only the current waiting policy")
    args = ap.parse_args()
    install_counters()
    base = Path(args.dir or tempfile.mkdtemp(prefix="rlhpc-queue-ops-"))
    modes = ["old"] if args.old else ["new"] if args.new else ["new", "old"]
    print(f"{args.workers} simulated workers; a step: {args.groups_per_step} groups, {args.train_s}s of training; a "
          f"batch: {args.groups_per_batch} groups in {args.generate_s}s; queue.poll_max_s={args.poll_max_s}")
    print(f"{'waiting policy':<40} {'step s':>7} {'trainer ops/step':>17} {'worker ops/step':>16} "
          f"{'ops/s per worker':>17}")
    for mode in modes:
        args.old = mode == "old"
        root = base / mode
        shutil.rmtree(root, ignore_errors=True)
        r = run(args, root)
        label = "10 ms polls, stat per file (before)" if args.old else "back-off + leases (rlhpc now)"
        print(f"{label:<40} {r['step_s']:7.2f} {r['per_step']['trainer']:17.0f} {r['per_step']['workers']:16.0f} "
              f"{r['per_worker_per_s']:17.1f}")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
