"""Context parallelism (`trainer.cp`) on gloo CPU ranks: the longest sequence a rank can train in a fixed memory
budget at cp = 1, 2, 4, and what cp does to a step's memory and time at one fixed length.

    python benchmarks/context_parallel.py [--cps 1 2 4] [--budget-mb 400] [--start 1024] [--resolution 0.07]
                                          [--fixed-tokens 4096] [--hidden 256] [--layers 4] [--heads 8]
                                          [--kv-heads 4] [--activation-checkpointing off|on|both]
                                          [--block-elements 4194304] [--no-baseline]

For each cp, `cp` ranks (forkserver processes, one thread each) form one context group (dp = 1) and train a dense
Qwen3 built in code (hidden `hidden`, `layers` layers, `heads` attention heads) with the rlhpc Trainer
(`Trainer.setup_model`, `train_step`; FSDP2 over the cp ranks, trainer.cp = cp). A step's batch is one group holding
one sample of L tokens (an 8-token prompt, the rest loss tokens), so its micro-batch is one packed row of L positions,
W = L rounded up to a multiple of cp; each rank holds L / cp of them.

Memory: each rank's peak resident memory during a `train_step` above its resident memory just before it (Linux VmHWM
reset through /proc/self/clear_refs; a process's RSS, allocator caching included, not tracked tensor bytes); max over
ranks. The optimizer's state exists before (a warm-up step at the start length), so the peak is the step's
activations, gradients, masks and scratch buffers. The ranks run with glibc's MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ fixed at 128 KiB, so a freed large buffer leaves the process at once: one process probes
several lengths in turn, and without this a step could reuse pages an earlier, longer step left resident and look
smaller than it is.

The search, per cp: L doubles from `start` while the step's peak stays under `budget-mb`, then bisects between the
last length that fit and the first that did not until they are within `resolution` of each other (lengths multiples
of 64). The first table gives the longest L that fit, its ratio to cp=1's, the peak and the seconds of that step
(slowest rank); the second, every cp at `fixed-tokens`: peak and seconds per step (median of 2 steps) against cp=1.
`--activation-checkpointing on` sets trainer.activation_checkpointing; `both` runs everything without, then with it.

What would be quadratic in L on every rank, whatever cp: the packed row's attention mask, [W, W], and sdpa's float
copy of it that autograd keeps for every layer (W x W x (1 + 4 x layers) bytes without activation checkpointing).
rlhpc's attention (rlhpc/train/attention.py) builds the mask from the row's segments one block of queries at a time
(`trainer.attention_block_elements`) and recomputes each block in the backward, so what a rank holds is linear: L / cp
positions' activations, and the whole row's q, k, v for H / cp heads in the layer that runs. The first row of each
table, "whole", is cp = 1 with the whole mask at once (attention_block_elements above W x W), the way packed rows
attended before: the alternative the others are measured against, beside cp = 1 in blocks.

The defaults take about 5 minutes on 2 cores (twice that and more with `both`). Wall-clock times on a shared CPU are
noisy, and cp=4 puts 4 single-thread ranks on however many cores there are.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ranks import kb, on_ranks, reset_peak  # noqa: E402

PROMPT = 8  # tokens of the sample's prompt; the rest are loss tokens
ALIGN = 64  # every probed length is a multiple of this (and so of cp)
MALLOC_KB = 128  # glibc's mmap and trim thresholds on the ranks


def make_batch(vocab: int, tokens: int, seed: int = 0):
    """One group of one sample of `tokens` tokens."""
    from rlhpc.transport.queue import Group, RolloutBatch

    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(tokens, dtype=torch.bool)
    mask[:PROMPT] = False
    return RolloutBatch(
        tokens=torch.randint(3, vocab, (tokens,), generator=g), offsets=torch.tensor([0, tokens]),
        logprobs=torch.where(mask, -torch.rand(tokens, generator=g) * 3, torch.zeros(tokens)), loss_mask=mask,
        advantages=torch.ones(1), group_of=torch.zeros(1, dtype=torch.long),
        groups=[Group(uid="0", env="bench", task_id="0", version=0, num_samples=1, rewards=[0.0], truncated=[False])],
    )


def search_rank(rank: int, world: int, port: int, root: str, checkpointing: bool, block_elements: int, budget_kb: int,
                start: int, resolution: float, max_tokens: int, fixed: int) -> dict:
    """On each of the cp ranks: the doubling-and-bisection search, then the fixed length. Every decision is taken on
    the group's maximum, so all ranks probe the same lengths."""
    import torch.distributed as dist

    from rlhpc.config import schema as config_mod
    from rlhpc.modeling import models
    from rlhpc.run.identity import Identity
    from rlhpc.run.rundir import RunDir
    from rlhpc.train.trainer import Trainer

    run = RunDir(Path(root))
    row = 1 << 30  # one micro-batch, one row, whatever L
    cfg = config_mod.to_typed({"run_dir": root, "trainer": {
        "num_ranks": world, "cp": world, "groups_per_step": 1, "micro_batch_tokens": row, "pack_row_tokens": row,
        "activation_checkpointing": checkpointing, "attention_block_elements": block_elements}})
    tr = Trainer(cfg, Identity("trainer", rank, world, Path(root), "t", "127.0.0.1", port), run)
    tr.tokenizer = models.load_tokenizer(run.model)
    tr.setup_model()
    vocab = len(tr.tokenizer)
    tr.train_step(0, make_batch(vocab, start))  # warm-up: also creates the optimizer's state
    steps = iter(range(1, 1 << 20))
    together = dist.is_initialized()  # one rank (cp=1) makes no process group

    def probe(tokens: int) -> tuple:
        """(peak KiB, seconds) of one step at `tokens`, the maxima over the group."""
        batch = make_batch(vocab, tokens)
        if together:
            dist.barrier()
        base = kb("VmRSS")
        reset_peak()
        t0 = time.perf_counter()
        tr.train_step(next(steps), batch)
        sec = time.perf_counter() - t0
        got = torch.tensor([kb("VmHWM") - base, sec], dtype=torch.float64)
        if together:
            dist.all_reduce(got, op=dist.ReduceOp.MAX)
        return int(got[0]), float(got[1])

    probes = {}  # tokens -> (peak KiB, seconds)

    def fits(tokens: int) -> bool:
        probes[tokens] = probe(tokens)
        return probes[tokens][0] <= budget_kb

    lo, hi = 0, start
    while hi <= max_tokens and fits(hi):
        lo, hi = hi, 2 * hi
    while lo and hi <= max_tokens and hi - lo > resolution * lo:
        mid = (lo + hi) // 2 // ALIGN * ALIGN
        if mid in (lo, hi):
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    at_fixed = [probe(fixed) for _ in range(2)]
    params = sum(p.numel() for p in tr.model.parameters())  # FSDP2's sharded parameters count whole
    return {"longest": lo, "probes": probes, "fixed": at_fixed, "params": params}


WHOLE = 1 << 62  # attention_block_elements above any W x W: the whole mask at once


def run_all(args, root: str, checkpointing: bool) -> tuple:
    """Rows (label, cp, longest L, its peak MiB and s/step, the probes) and (label, cp, peak MiB, s/step) at the fixed
    length: "whole" first (cp = 1, the whole mask), then every cp in blocks."""
    layouts = ([("whole", 1, WHOLE)] if args.baseline else []) + [("blocks", cp, args.block_elements) for cp in args.cps]
    rows, fixed, params = [], [], 0
    for label, cp, elements in layouts:
        r = on_ranks(search_rank, cp, (root, checkpointing, elements, args.budget_mb * 1024, args.start,
                                       args.resolution, args.max_tokens, args.fixed_tokens))[0]
        peak, sec = r["probes"].get(r["longest"], (float("nan"), float("nan")))
        rows.append((label, cp, r["longest"], peak / 1024, sec, sorted(r["probes"].items())))
        fixed.append((label, cp, max(p for p, _ in r["fixed"]) / 1024, statistics.median(s for _, s in r["fixed"])))
        params = r["params"]
    return rows, fixed, params


def print_tables(args, rows: list, fixed: list, checkpointing: bool, params: float) -> None:
    what = "with" if checkpointing else "without"
    print(f"\nLongest sequence per step in {args.budget_mb} MiB per rank, {what} activation checkpointing: a "
          f"{params / 1e6:.1f}M-parameter Qwen3 (hidden {args.hidden}, {args.layers} layers, {args.heads} heads), one "
          f"sample per step, cp ranks (dp=1), gloo, CPU, 1 thread per rank; peak = VmHWM above VmRSS before the step, "
          f"max over ranks; resolution {args.resolution:.0%}; ratios against cp=1 in blocks")
    base = next((r for r in rows if r[0] == "blocks" and r[1] == 1), rows[0])
    print(f"{'attention':>9} {'cp':>3} {'longest L':>10} {'L / cp=1':>9} {'peak MiB':>9} {'s/step':>8}")
    for label, cp, longest, peak, sec, _ in rows:
        print(f"{label:>9} {cp:>3} {longest:>10} {longest / base[2]:>9.2f} {peak:>9.1f} {sec:>8.2f}")
    print("\nprobes (L: peak MiB):")
    for label, cp, _, _, _, probes in rows:
        print(f"  {label} cp={cp}: " + ", ".join(f"{n}: {p / 1024:.0f}" for n, (p, _) in probes))
    print(f"\nOne step at L = {args.fixed_tokens}, {what} activation checkpointing (median of 2 steps)")
    base = next((f for f in fixed if f[0] == "blocks" and f[1] == 1), fixed[0])
    print(f"{'attention':>9} {'cp':>3} {'peak MiB':>9} {'peak / cp=1':>12} {'s/step':>8} {'step / cp=1':>12}")
    for label, cp, peak, sec in fixed:
        print(f"{label:>9} {cp:>3} {peak:>9.1f} {peak / base[2]:>12.3f} {sec:>8.2f} {sec / base[3]:>12.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--budget-mb", type=int, default=400)
    p.add_argument("--start", type=int, default=1024)
    p.add_argument("--resolution", type=float, default=0.07)
    p.add_argument("--max-tokens", type=int, default=1 << 16, help="the search stops here")
    p.add_argument("--fixed-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--activation-checkpointing", choices=("off", "on", "both"), default="off")
    p.add_argument("--block-elements", type=int, default=1 << 22, help="trainer.attention_block_elements")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="leave out cp=1 with the whole mask")
    args = p.parse_args(argv)
    if any(args.heads % cp for cp in args.cps) or args.start % ALIGN or args.fixed_tokens % max(args.cps):
        p.error(f"--heads must divide by every cp, --start by {ALIGN} and --fixed-tokens by the largest cp")
    # Read by glibc when a process starts: the forkserver, started by the first launch, and so every rank.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = os.environ["MALLOC_TRIM_THRESHOLD_"] = str(MALLOC_KB << 10)

    from rlhpc.config.schema import ModelConfig
    from rlhpc.modeling import models
    from rlhpc.run.rundir import RunDir
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = ModelConfig(name="bench_qwen3", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                      max_position_embeddings=args.max_tokens)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        RunDir(Path(tmp)).make()
        models.build(cfg, Path(tmp) / "model")
        for checkpointing in {"off": [False], "on": [True], "both": [False, True]}[args.activation_checkpointing]:
            rows, fixed, params = run_all(args, tmp, checkpointing)
            print_tables(args, rows, fixed, checkpointing, params)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
