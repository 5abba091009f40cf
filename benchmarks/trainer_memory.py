"""Peak resident memory of each trainer rank through model load, one RL step and a checkpoint, for 1, 2 and 4 ranks
(FSDP2 over gloo, CPU), on a ~150M-parameter Qwen3 built in code and saved as Hugging Face safetensors.

    python benchmarks/trainer_memory.py [--ranks 1 2 4] [--hidden 1024] [--layers 12] [--full-load] [--mmap-threshold-kb 128]

Each rank is a fresh process running the trainer's own code (`Trainer.setup_model`, `train_step`, `checkpoint.save`).
Its baseline is the resident set (VmRSS) after imports, process group and trainer construction; then the kernel's
high-water mark (VmHWM) is reset to it (/proc/self/clear_refs) and read after each phase, so each number is the peak so
far. file-backed pages count (the safetensors a rank maps while it reads its rows). The model-state peak is the peak
minus the baseline. The target: at N ranks a rank's peak <= (1/N) x the 1-rank model-state peak + a fixed overhead,
so the ratio of model-state peaks (N ranks / 1 rank) should be about 1/N.

The 1-rank run uses FSDP too (trainer.fsdp=true), the same sharded path. Every rank trains on one group of 2 samples,
so the activations are the same at every N. Held-out evaluation runs on inference worker 0, not on the trainer; the
full copy rank 0 kept for it when N > 1, before that change, is what `--eval-copy` adds to rank 0 here, for comparison.
`--full-load` measures the path before sharded loading instead (every rank loads the whole model, then shards).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ranks import kb, on_ranks, reset_peak  # noqa: E402

MB = 1 << 20


def _batch(vocab: int, groups: int, seed: int = 0):
    from rlhpc.transport.queue import Group, RolloutBatch

    g = torch.Generator().manual_seed(seed)
    n = groups * 2
    lengths = torch.randint(48, 64, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(n):
        mask[offsets[i] + 8: offsets[i + 1]] = True
    return RolloutBatch(
        tokens=torch.randint(3, vocab, (total,), generator=g), offsets=offsets,
        logprobs=torch.where(mask, -torch.rand(total, generator=g) * 3, torch.zeros(total)), loss_mask=mask,
        advantages=torch.randn(n, generator=g), group_of=torch.arange(groups).repeat_interleave(2),
        groups=[Group(uid=str(i), env="t", task_id=str(i), version=0, num_samples=2, rewards=[0.0, 0.0],
                      truncated=[False, False]) for i in range(groups)],
    )


def rank_main(rank: int, world: int, port: int, root: str, full_load: bool, eval_copy: bool) -> dict:
    import torch.distributed as dist

    from rlhpc.config import schema as config_mod
    from rlhpc.modeling import models
    from rlhpc.run.identity import Identity
    from rlhpc.run.rundir import RunDir
    from rlhpc.train import checkpoint
    from rlhpc.train.optim import make_optimizer
    from rlhpc.train.trainer import Trainer

    run = RunDir(Path(root))
    cfg = config_mod.to_typed({"run_dir": root, "trainer": {
        "num_ranks": world, "fsdp": True, "groups_per_step": world * 2, "micro_batch_tokens": 4096}})
    tr = Trainer(cfg, Identity("trainer", rank, world, Path(root), "t", "127.0.0.1", port), run)
    tr.tokenizer = models.load_tokenizer(run.model)
    dist.barrier()
    base = kb("VmRSS")
    reset_peak()
    t0 = time.time()
    if full_load:  # the path before sharded loading: the whole model on every rank, then sharded
        tr.model = tr.wrap(models.load_model(run.model))
        tr.optimizer = make_optimizer(tr.model.parameters(), cfg.trainer.optim)
        tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)
        tr.reference = None
    else:
        tr.setup_model()
    eval_model = models.load_model(run.model) if eval_copy and rank == 0 and world > 1 else None
    dist.barrier()
    peaks = {"load": kb("VmHWM")}
    t_load = time.time() - t0
    stats = tr.train_step(0, _batch(len(tr.tokenizer), world))
    dist.barrier()
    peaks["step"] = kb("VmHWM")
    t_step = time.time() - t0 - t_load
    checkpoint.save(run.checkpoints / f"ranks_{world}", 1, tr.model, tr.optimizer, tr.scheduler, {"eval_curve": []})
    peaks["checkpoint"] = kb("VmHWM")
    t_ckpt = time.time() - t0 - t_load - t_step
    params = sum(p.numel() for p in tr.model.parameters())
    dist.barrier()
    return {"base": base, **peaks, "loss": stats["loss/total"], "params": params,
            "times": (t_load, t_step, t_ckpt), "eval_copy": eval_model is not None}


def measure(root: str, world: int, full_load: bool, eval_copy: bool, timeout: float) -> list:
    """Each rank a fresh interpreter with torch's default threads, so its baseline holds only what it imports."""
    return on_ranks(rank_main, world, (root, full_load, eval_copy), start="spawn", threads=None, timeout=timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--full-load", action="store_true", help="measure the path before sharded loading")
    ap.add_argument("--eval-copy", action="store_true", help="add the full copy rank 0 kept for evaluation (N > 1) before evaluation moved to the workers")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--mmap-threshold-kb", type=int, default=0,
                    help="run the ranks with glibc's MALLOC_MMAP_THRESHOLD_ (and MALLOC_TRIM_THRESHOLD_) fixed at this "
                         "many KiB, so large freed buffers go back to the system; 0: glibc's default (a threshold that "
                         "grows as large blocks are freed, which then stay in the heap)")
    args = ap.parse_args()
    if args.mmap_threshold_kb:  # read by glibc when a process starts: the ranks, spawned below, inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = os.environ["MALLOC_TRIM_THRESHOLD_"] = str(args.mmap_threshold_kb << 10)

    from rlhpc.config.schema import ModelConfig
    from rlhpc.modeling import models
    from rlhpc.run.rundir import RunDir

    with tempfile.TemporaryDirectory(prefix="rlhpc-trainer-memory-") as tmp:
        RunDir(Path(tmp)).make()
        cfg = ModelConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_layers=args.layers,
                          num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128)
        t0 = time.time()
        models.build(cfg, Path(tmp) / "model")
        print(f"built the model in {time.time() - t0:.0f} s; safetensors "
              f"{(Path(tmp) / 'model' / 'model.safetensors').stat().st_size / MB:.0f} MiB", flush=True)
        rows = {}
        for world in args.ranks:
            rows[world] = measure(tmp, world, args.full_load, args.eval_copy, args.timeout)
            r0 = rows[world][0]
            print(f"{world} rank(s): {r0['params'] / 1e6:.1f}M parameters, loss {r0['loss']:.4f}, load/step/checkpoint "
                  + " / ".join(f"{t:.1f}" for t in r0["times"]) + " s", flush=True)

    path = "full load, then shard" if args.full_load else "sharded from the start"
    malloc = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold_kb} KiB" if args.mmap_threshold_kb else "glibc's default malloc"
    print(f"\nPeak RSS per rank ({path}; gloo, CPU; evaluation copy {'on rank 0' if args.eval_copy else 'off'}; "
          f"{malloc}), MiB:\n")
    print("| ranks | rank | baseline | peak: load | peak: + RL step | peak: + checkpoint | model-state peak "
          "| ratio to 1 rank | 1/N | peak - (1-rank model state)/N |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    one = None
    if 1 in rows:
        one = max(r["checkpoint"] - r["base"] for r in rows[1])
    for world, ranks in rows.items():
        for rank, r in enumerate(ranks):
            state = r["checkpoint"] - r["base"]
            ratio = f"{state / one:.3f}" if one else "-"
            overhead = f"{(r['checkpoint'] - one / world) / 1024:.0f}" if one else "-"
            print(f"| {world} | {rank} | {r['base'] / 1024:.0f} | {r['load'] / 1024:.0f} | {r['step'] / 1024:.0f} "
                  f"| {r['checkpoint'] / 1024:.0f} | {state / 1024:.0f} | {ratio} | {1 / world:.3f} | {overhead} |")


if __name__ == "__main__":
    main()
