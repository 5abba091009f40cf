"""Expert parallelism (`trainer.ep`) on gloo CPU ranks: what the token exchange costs over a raw all-to-all, and what
ep does to a small MoE model's step time and memory.

    python benchmarks/expert_parallel.py [--worlds 2 4] [--tokens 8192] [--hidden 256] [--experts 16] [--top-k 2]
                                         [--rounds 5] [--iters 3]
                                         [--ranks 4] [--eps 1 2 4] [--layers 4] [--moe-intermediate 512]
                                         [--groups 16] [--group-size 4] [--steps 5] [--skip-step]

(a) Exchange, on W ranks (each a forkserver process, one thread). Every rank routes `tokens` random tokens to
`top-k` of `experts` experts (the splits a real routing produces, uneven) and runs rlhpc's `ExpertParallel` layer
forward and backward with ep = W, its experts' compute replaced by the identity: so what is timed is the layer's
dispatch and combine (sorting rows by expert, the split-size and expert-index exchanges, `_AllToAll` out and back,
the top-k weighting and scatter-add, and the backward's two all-to-alls). Against it, `dist.all_to_all_single` run
raw on preallocated tensors with exactly the same splits and bytes: dispatch, combine, and their two backward
exchanges; and that raw exchange plus the layer's two small ones (split sizes, each row's expert index), so that
rlhpc minus raw+meta is the layer's local work (sort, row gather, weighting, scatter-add and their backward). Rounds
alternate the three; each round is `iters` iterations between barriers, and the table gives the
median round per iteration (slowest rank), the payload bytes one rank sends per iteration (averaged over ranks, its
own slice included), GB/s, and raw/rlhpc (1.0 = no overhead).

(b) Step, on `ranks` ranks: a Qwen3-MoE built in code (hidden 256, `layers` layers, `experts` experts) trained by the
rlhpc Trainer (`Trainer.setup_model`, `train_step`) at trainer.ep = each of `eps` (ep=1 is plain FSDP2 over the
ranks), on the same batch of `groups` x `group-size` samples. It prints the median seconds per `train_step` over
`steps` steps after one warm-up step (slowest rank), and each rank's peak resident memory during those steps above
its resident memory after the warm-up (Linux VmHWM, reset through /proc/self/clear_refs; max over ranks; a process's
RSS, allocator caching included, not tracked tensor bytes), with the ratios against ep=1.

The default sizes finish in under a minute on 2 cores. Every figure is wall-clock time on a shared CPU: noisy.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ranks import kb, on_ranks, reset_peak  # noqa: E402

# (a) the token exchange ------------------------------------------------------------------------------------------


class _FusedExperts(nn.Module):
    """The two fused parameters ExpertParallel takes over; their compute is never run here."""

    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, intermediate))


def _identity_experts(rows, expert, weights):
    return rows + sum(w.sum() for w in weights) * 0.0  # keeps the weights in the graph, as the layer does


def exchange_rank(rank: int, world: int, port: int, tokens: int, hidden: int, experts: int, top_k: int,
                  rounds: int, iters: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlhpc.train.experts import ExpertGroups, ExpertParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    layer = ExpertParallel(_FusedExperts(experts, hidden, 8), ExpertGroups.make(world), mesh, torch.float32)
    layer._run_local = _identity_experts  # only the exchange is timed, not the experts' matmuls

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(0, 1, experts)  # a real, uneven routing
    top_w, top_i = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    send = torch.bincount(top_i.reshape(-1) // (experts // world), minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_l, recv_l = send.tolist(), recv.tolist()
    out_rows, in_rows = torch.randn(sum(send_l), hidden), torch.empty(sum(recv_l), hidden)

    def rlhpc_iter():
        y = layer(x, top_i, top_w)
        y.backward(torch.ones_like(y))
        x.grad = None

    out_ids, in_ids = torch.zeros(sum(send_l), dtype=torch.long), torch.empty(sum(recv_l), dtype=torch.long)
    got = torch.empty_like(send)

    def raw_iter():
        for a, b, r, s in ((in_rows, out_rows, recv_l, send_l), (out_rows, in_rows, send_l, recv_l)) * 2:
            dist.all_to_all_single(a, b, r, s)  # dispatch, combine; then the backward's two, the same way

    def raw_meta_iter():  # and the layer's two small exchanges: split sizes, then each row's expert
        dist.all_to_all_single(got, send)
        dist.all_to_all_single(in_ids, out_ids, recv_l, send_l)
        raw_iter()

    times = {"rlhpc": [], "raw": [], "raw+meta": []}
    for round_ in range(rounds + 1):  # round 0 warms up
        for name, fn in (("rlhpc", rlhpc_iter), ("raw", raw_iter), ("raw+meta", raw_meta_iter)):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            dist.barrier()
            if round_:
                times[name].append((time.perf_counter() - t0) / iters)
    row_bytes = hidden * x.element_size()
    return {"times": times, "bytes": 2 * (sum(send_l) + sum(recv_l)) * row_bytes}


def exchange_table(args) -> list:
    rows = []
    for world in args.worlds:
        ranks = on_ranks(exchange_rank, world, (args.tokens, args.hidden, args.experts, args.top_k, args.rounds,
                                                args.iters))
        nbytes = statistics.mean(r["bytes"] for r in ranks)
        sec = {name: statistics.median(max(r["times"][name][i] for r in ranks) for i in range(args.rounds))
               for name in ("raw", "raw+meta", "rlhpc")}
        rows.append((world, nbytes, sec["raw"], sec["raw+meta"], sec["rlhpc"]))
    print(f"\n(a) Token exchange per iteration (forward + backward), {args.tokens} tokens x top-{args.top_k} of "
          f"{args.experts} experts per rank, hidden {args.hidden}, float32; gloo, CPU, 1 thread per rank")
    print(f"{'ranks':>5} {'MB sent/rank':>13} {'raw s':>9} {'raw+meta s':>10} {'rlhpc s':>9} {'raw GB/s':>9} "
          f"{'rlhpc GB/s':>10} {'raw/rlhpc':>9} {'raw+meta/rlhpc':>14}")
    for world, nbytes, raw, meta, ours in rows:
        print(f"{world:>5} {nbytes / 1e6:>13.2f} {raw:>9.5f} {meta:>10.5f} {ours:>9.5f} {nbytes / raw / 1e9:>9.3f} "
              f"{nbytes / ours / 1e9:>10.3f} {raw / ours:>9.3f} {meta / ours:>14.3f}")
    return rows


# (b) a MoE model's step ------------------------------------------------------------------------------------------


def make_batch(vocab: int, groups: int, group_size: int, seed: int = 0):
    from rlhpc.transport.queue import Group, RolloutBatch

    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = torch.randint(32, 64, (n,), generator=g)
    offsets = torch.zeros(n + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(n):  # an 8-token prompt, then the completion
        mask[offsets[i] + 8: offsets[i + 1]] = True
    return RolloutBatch(
        tokens=torch.randint(3, vocab, (total,), generator=g), offsets=offsets,
        logprobs=torch.where(mask, -torch.rand(total, generator=g) * 3, torch.zeros(total)), loss_mask=mask,
        advantages=torch.randn(n, generator=g), group_of=torch.arange(groups).repeat_interleave(group_size),
        groups=[Group(uid=str(i), env="bench", task_id=str(i), version=0, num_samples=group_size,
                      rewards=[0.0] * group_size, truncated=[False] * group_size) for i in range(groups)],
    )


def step_rank(rank: int, world: int, port: int, root: str, ep: int, groups: int, group_size: int,
              steps: int) -> dict:
    import torch.distributed as dist

    from rlhpc.config import schema as config_mod
    from rlhpc.modeling import models
    from rlhpc.run.identity import Identity
    from rlhpc.run.rundir import RunDir
    from rlhpc.train.trainer import Trainer

    run = RunDir(Path(root))
    cfg = config_mod.to_typed({"run_dir": root, "trainer": {
        "num_ranks": world, "ep": ep, "groups_per_step": groups, "micro_batch_tokens": 4096}})
    tr = Trainer(cfg, Identity("trainer", rank, world, Path(root), "t", "127.0.0.1", port), run)
    tr.tokenizer = models.load_tokenizer(run.model)
    tr.setup_model()
    batch = make_batch(len(tr.tokenizer), groups, group_size)
    loss = tr.train_step(0, batch)["loss/total"]  # warm-up: also creates the optimizer's state
    dist.barrier()
    base = kb("VmRSS")
    reset_peak()
    times = []
    for step in range(1, steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        tr.train_step(step, batch)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"times": times, "peak_kb": kb("VmHWM") - base, "loss": loss}


def step_table(args) -> list:
    from rlhpc.config.schema import ModelConfig
    from rlhpc.modeling import models
    from rlhpc.run.rundir import RunDir
    from transformers.utils import logging as hf_logging

    cfg = ModelConfig(name="bench_qwen3_moe", arch="qwen3_moe", hidden_size=args.hidden,
                      intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=256,
                      extra=dict(num_experts=args.experts, num_experts_per_tok=args.top_k,
                                 moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True))
    hf_logging.disable_progress_bar()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        RunDir(Path(tmp)).make()
        models.build(cfg, Path(tmp) / "model")
        params = sum(p.numel() for p in models.load_model(Path(tmp) / "model").parameters())
        for ep in args.eps:
            ranks = on_ranks(step_rank, args.ranks, (tmp, ep, args.groups, args.group_size, args.steps))
            sec = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
            rows.append((ep, sec, max(r["peak_kb"] for r in ranks) / 1024, ranks[0]["loss"]))
    print(f"\n(b) train_step of a {params / 1e6:.1f}M-parameter Qwen3-MoE (hidden {args.hidden}, {args.layers} layers, "
          f"{args.experts} experts, top-{args.top_k}) on {args.ranks} gloo ranks, {args.groups}x{args.group_size} "
          f"samples of 32-63 tokens; median of {args.steps} steps after a warm-up; peak = VmHWM above VmRSS after "
          "the warm-up, max over ranks")
    print(f"{'ep':>3} {'s/step':>9} {'peak MiB':>9} {'step / ep=1':>12} {'peak / ep=1':>12} {'warm-up loss':>13}")
    base = next((r for r in rows if r[0] == 1), rows[0])
    for ep, sec, peak, loss in rows:
        ratio = peak / base[2] if base[2] > 0 else math.nan
        print(f"{ep:>3} {sec:>9.4f} {peak:>9.1f} {sec / base[1]:>12.3f} {ratio:>12.3f} {loss:>13.6f}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--skip-step", action="store_true", help="only (a)")
    args = p.parse_args(argv)
    t0 = time.time()
    exchange_table(args)
    if not args.skip_step:
        step_table(args)
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
