"""Weights group: rlhpc's bucketed broadcast of a model under its HF names, against a raw broadcast of one flat tensor
of the same size, in the same process group (gloo on CPU, NCCL on GPU), plus the sender's peak extra memory.

    python benchmarks/weights_broadcast.py [--receivers 2] [--hidden 512] [--layers 8] [--bucket-mb 64] [--rounds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from datetime import timedelta

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.run.rundir import RunDir  # noqa: E402
from rlhpc.transport.weights import BroadcastReceiver, BroadcastSender  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples this process's resident memory every millisecond while active."""

    def __enter__(self):
        self.base = self.peak = rss()
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()

    @property
    def extra(self) -> int:
        return self.peak - self.base


def raw_group(root: str, rank: int, size: int) -> dist.ProcessGroup:
    """A plain gloo group over its own TCPStore: the baseline transport."""
    port_file = Path(root) / "raw_port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=300), wait_for_workers=False)
        port_file.write_text(str(store.port))
    else:
        while not port_file.exists():
            time.sleep(0.01)
        time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), size, False, timeout=timedelta(seconds=300))
    return dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, size, timedelta(seconds=300)), store


def raw_broadcast(group, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()


def receiver(root: str, rank: int, size: int, rounds: int, numel: int) -> None:
    group, _store = raw_group(root, rank, size)
    flat = torch.empty(numel)
    recv = BroadcastReceiver(RunDir(root), rank, timeout_s=300, attempt="bench")
    for r in range(rounds):  # the rounds alternate: a raw broadcast, then an rlhpc update
        raw_broadcast(group, flat)
        while True:
            update = recv.poll()
            if update is not None and update.version == r + 1:
                break
            recv.wait(0.001)
    while not recv.closed():
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", vocab_size=32000, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                               head_dim=args.hidden // 8, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    numel = sum(p.numel() for p in model.parameters())
    nbytes = numel * 4
    root = tempfile.mkdtemp(prefix="rlhpc-wbench-")
    run = RunDir(Path(root)).make()
    ctx = mp.get_context("spawn")
    size = args.receivers + 1
    procs = [ctx.Process(target=receiver, args=(root, r + 1, size, args.rounds, numel)) for r in range(args.receivers)]
    for p in procs:
        p.start()
    group, _store = raw_group(root, 0, size)
    flat = torch.randn(numel)
    sender = BroadcastSender(run, args.receivers, args.bucket_mb, timeout_s=300, attempt="bench")
    layout = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]  # metadata: the stream is never held
    # Raw and rlhpc rounds alternate, so that a change in the machine's load falls on both alike.
    raw, ours, peak = [], [], 0
    for v in range(args.rounds):
        t0 = time.perf_counter()
        raw_broadcast(group, flat)
        raw.append(time.perf_counter() - t0)
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            sender.publish(v + 1, model.named_parameters(), layout=layout)
            ours.append(time.perf_counter() - t0)
        peak = max(peak, mem.extra)
    sender.close()
    for p in procs:
        p.join(timeout=60)
    best_raw, best_ours = min(raw), min(ours)
    print(f"weights: {numel / 1e6:.1f}M parameters, {nbytes / 1e6:.0f} MB fp32, {args.receivers} receivers, "
          f"{sender.backend}, bucket {args.bucket_mb} MiB, best of {args.rounds}")
    print(f"  raw flat broadcast     : {nbytes / best_raw / 1e9:6.2f} GB/s  ({best_raw * 1e3:.0f} ms)")
    print(f"  rlhpc bucketed publish : {nbytes / best_ours / 1e9:6.2f} GB/s  ({best_ours * 1e3:.0f} ms)")
    print(f"  ratio rlhpc/raw throughput: {best_raw / best_ours:.2f} (best rounds; medians "
          f"{statistics.median(raw) / statistics.median(ours):.2f}; median of paired rounds "
          f"{statistics.median(r / o for r, o in zip(raw, ours)):.2f})")
    print(f"  sender peak extra memory: {peak / 2**20:.0f} MiB ({peak / nbytes:.2f} x the model; bucket "
          f"{args.bucket_mb} MiB)")


if __name__ == "__main__":
    main()
