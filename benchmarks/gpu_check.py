"""rlhpc on NVIDIA GPUs, end to end, in a few minutes: a Qwen3-0.6B-shaped model built in code (random weights, no
download), then three checks, each printing one result line.

  train      FSDP2 (rlhpc.train.loading.build_sharded) in bf16 compute with fp32 master weights and AdamW, on one GPU
             over an NCCL world of one; a fixed synthetic batch; tokens/s and MFU = 6 x parameters x tokens/s over the
             GPU's peak dense bf16 FLOP/s (looked up from its name, or --peak-tflops). 6N counts the matmuls only
             (attention's own FLOPs are left out), the usual convention.
  broadcast  rlhpc's weights group (BroadcastSender -> one BroadcastReceiver in another process) sending the model in
             bf16, against a raw broadcast of one flat tensor of the same bytes in a group of the same backend. NCCL
             needs a GPU per member: with one GPU both run over gloo (through host memory) and the line says so.
  rl         a short RL run, `python -m rlhpc.launch` (launcher=local) with inference.engine=vllm when vllm imports,
             else hf; the trainer's and the worker's tokens/s from the run's metrics. On one GPU the trainer and the
             worker share it (weights.transport=filesystem then: NCCL refuses two members of a group on one GPU).

    bash benchmarks/gpu_check.sh [--quick] [--peak-tflops 989] [--only train,broadcast,rl]

Exit status: 0 when every check ran, 1 when one failed, 2 when there is no usable NVIDIA GPU (one line says why).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen3-0.6B: 28 layers, hidden 1024, MLP 3072, 16 query / 8 KV heads of 128, vocabulary 151936, tied embeddings.
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8)
QWEN3_0_6B_EXTRA = dict(head_dim=128, rope_theta=1000000.0, vocab_size=151936)

# Peak dense bf16 tensor-core TFLOP/s by device name (no sparsity), first match wins.
PEAK_BF16_TFLOPS = [
    ("GB200", 2500), ("B200", 2250), ("H200", 989), ("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989),
    ("H800", 989), ("H20", 148), ("A100", 312), ("A800", 312), ("L40S", 362), ("L40", 181), ("L4", 121),
    ("A10", 125), ("RTX 4090", 165), ("RTX 6000 Ada", 364),
]


def peak_tflops(name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in name.lower():
            return float(tflops)
    return None


def no_gpu_reason() -> str | None:
    if not shutil.which("nvidia-smi"):
        return "nvidia-smi not found: this check needs a machine with NVIDIA GPUs and their driver"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU build of torch, or no driver/GPU visible)"
    return None


# --smoke-cpu (for developing this script on a machine without GPUs): a tiny model of the same family, gloo, the CPU.
TINY = dict(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2)
TINY_EXTRA = dict(head_dim=16, rope_theta=1000000.0, vocab_size=4096)


def model_config(args):
    from rlhpc.config.schema import ModelConfig

    shape, extra = (TINY, TINY_EXTRA) if args.smoke_cpu else (QWEN3_0_6B, QWEN3_0_6B_EXTRA)
    return ModelConfig(name="qwen3_0_6b_shape", arch="qwen3", max_position_embeddings=4096, dtype="bfloat16",
                       extra=dict(extra), **shape)


def device_of(args, index: int = 0):
    import torch

    if args.smoke_cpu:
        return torch.device("cpu")
    torch.cuda.set_device(index)  # NCCL and every implicit "cuda" use it
    return torch.device("cuda", index)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    from rlhpc.run.procs import free_port as port

    return port()


# ---- train ---------------------------------------------------------------------------------------------------------


def check_train(path: Path, args) -> str:
    import torch
    import torch.distributed as dist

    from rlhpc.config.schema import TrainerConfig
    from rlhpc.train.loading import build_sharded
    from rlhpc.train.optim import make_optimizer
    from rlhpc.train.parallel import compute_dtype

    device = device_of(args)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tcfg = TrainerConfig(fsdp=True)  # param_dtype auto: bf16 on GPU; master_dtype float32
        model = build_sharded(path, tcfg, device)
        model.train()
        optimizer = make_optimizer(model.parameters(), tcfg.optim)
        params = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        gen = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, vocab, (args.batch, args.seq_len), device=device, generator=gen)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        for _ in range(args.warmup):
            step()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        sync(device)
        dt = time.perf_counter() - t0
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        tokens_per_s = args.batch * args.seq_len * args.steps / dt
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test)"
        peak = args.peak_tflops or peak_tflops(name)
        mfu = f"{6 * params * tokens_per_s / (peak * 1e12) * 100:.1f}% of {peak:.0f} TFLOP/s" if peak else \
            f"n/a ({name!r} is not in the table: pass --peak-tflops)"
        assert torch.isfinite(loss), f"loss {float(loss)}"
        precision = f"{str(compute_dtype(tcfg, device)).removeprefix('torch.')} compute, {tcfg.master_dtype} master"
        return (f"train: {params / 1e6:.0f}M params, FSDP2 {precision}, AdamW, batch {args.batch}x{args.seq_len}, "
                f"{args.steps} steps: {tokens_per_s:,.0f} tokens/s ({dt / args.steps * 1e3:.0f} ms/step), "
                f"MFU {mfu}, peak memory {peak_mem:.1f} GiB, {name}")
    finally:
        dist.destroy_process_group()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ---- broadcast -----------------------------------------------------------------------------------------------------


def raw_group(root: Path, rank: int, backend: str):
    """A plain two-member group over its own TCPStore: the baseline."""
    import torch.distributed as dist

    port_file = root / "raw_port"
    timeout = timedelta(seconds=300)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
        port_file.write_text(str(store.port))
    else:
        while not port_file.exists():
            time.sleep(0.01)
        time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), 2, False, timeout=timeout)
    prefixed = dist.PrefixStore("raw", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts), store
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout), store


def raw_broadcast(group, flat) -> None:
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([flat], opts).wait()
    if flat.is_cuda:
        torch.cuda.synchronize()  # NCCL's wait() only orders the stream


def receiver(root: str, backend: str, numel: int, updates: int) -> None:
    import torch

    from rlhpc.run.rundir import RunDir
    from rlhpc.transport.weights import BroadcastReceiver

    device = torch.device("cuda", 1) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the receiver's buffers live on the current device
    group, _store = raw_group(Path(root), 1, backend)
    flat = torch.empty(numel, dtype=torch.bfloat16, device=device)
    for _ in range(updates):
        raw_broadcast(group, flat)
    recv = BroadcastReceiver(RunDir(Path(root)), 1, timeout_s=300, attempt="gpu-check")
    got = 0
    while got < updates:
        if recv.poll() is not None:
            got += 1
        time.sleep(0.0005)
    while not recv.closed():
        time.sleep(0.01)


def check_broadcast(path: Path, args) -> str:
    import torch

    from rlhpc.modeling.models import load_model
    from rlhpc.run.rundir import RunDir
    from rlhpc.transport.weights import BroadcastSender

    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 and not args.smoke_cpu else "gloo"
    device = device_of(args)
    model = load_model(path, "bfloat16").to(device)  # what the trainer sends: model.dtype
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    nbytes = numel * 2
    root = Path(tempfile.mkdtemp(prefix="rlhpc-gpu-check-wb-"))
    run = RunDir(root).make()
    updates = args.rounds + 1  # the first of each kind warms up (NCCL makes its communicator at the first call)
    proc = mp.get_context("spawn").Process(target=receiver, args=(str(root), backend, numel, updates))
    proc.start()
    try:
        group, _store = raw_group(root, 0, backend)
        flat = torch.randn(numel, device=device).to(torch.bfloat16)
        if backend == "gloo":
            flat = flat.cpu()
        raw = []
        for _ in range(updates):
            t0 = time.perf_counter()
            raw_broadcast(group, flat)
            raw.append(time.perf_counter() - t0)
        del flat
        sender = BroadcastSender(run, 1, args.bucket_mb, timeout_s=300, attempt="gpu-check", backend=backend,
                                 host="127.0.0.1")
        layout = [(n, p.shape, p.dtype) for n, p in named]
        ours = []
        for v in range(updates):
            t0 = time.perf_counter()
            sender.publish(v + 1, named, layout=layout)
            sync(device)
            ours.append(time.perf_counter() - t0)
        sender.close()
        proc.join(timeout=120)
    finally:
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
        del model, named
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the RL run's processes want this GPU next
    best_raw, best_ours = min(raw[1:]), min(ours[1:])
    where = ("cuda:0 -> cuda:1" if backend == "nccl" else "CPU -> CPU (smoke test)" if args.smoke_cpu
             else "cuda:0 -> host (one GPU: NCCL needs a GPU per member)")
    return (f"broadcast: {nbytes / 1e9:.2f} GB bf16 ({numel / 1e6:.0f}M params), {backend}, {where}, best of "
            f"{args.rounds}: rlhpc {nbytes / best_ours / 1e9:.2f} GB/s ({best_ours * 1e3:.0f} ms), raw "
            f"{nbytes / best_raw / 1e9:.2f} GB/s ({best_raw * 1e3:.0f} ms), ratio {best_raw / best_ours:.2f}")


# ---- rl ------------------------------------------------------------------------------------------------------------


def median_of(jsonl: Path, key: str) -> tuple[float, int, int]:
    """The median of `key` over a role's metrics rows, leaving out the first (warm-up) when there are 3 or more; the
    number of rows used and of all rows."""
    values = []
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            row = json.loads(line)
            if key in row:
                values.append(float(row[key]))
    used = values[1:] if len(values) > 2 else values
    return (statistics.median(used) if used else float("nan")), len(used), len(values)


def check_rl(args) -> str:
    import torch

    try:
        importlib.import_module("vllm")
        engine = "hf" if args.smoke_cpu else "vllm"
    except Exception:  # not installed, or a build that does not import here
        engine = "hf"
    gpus = torch.cuda.device_count()
    run_dir = Path(tempfile.mkdtemp(prefix="rlhpc-gpu-check-rl-")) / "run"
    shape, extra = (TINY, TINY_EXTRA) if args.smoke_cpu else (QWEN3_0_6B, QWEN3_0_6B_EXTRA)
    # The built tokenizer's vocabulary (a few hundred tokens) stays the model's here: a random 151936-way model would
    # sample ids the tokenizer cannot decode.
    overrides_shape = [f"model.{k}={v}" for k, v in shape.items()]
    overrides_shape += [f"+model.extra.{k}={v}" for k, v in extra.items() if k != "vocab_size"]
    overrides_shape += ["model.dtype=bfloat16"]
    overrides = [
        "+exp=reverse_text", "sft.steps=0", f"trainer.steps={args.rl_steps}", "trainer.fsdp=true",
        "trainer.groups_per_step=16", "inference.num_workers=1", "eval.interval=0", "eval.num_tasks=16",
        f"inference.engine={engine}", "launcher=local", "launcher.progress=false", f"run_dir={run_dir}",
        *overrides_shape,
    ]
    if gpus < 2:
        overrides += ["weights.transport=filesystem"]
        if engine == "vllm":  # leaves the trainer room on the shared GPU
            overrides += ["inference.gpu_memory_utilization=0.35", "inference.kv_cache_gb=8"]
    env = dict(os.environ, VLLM_CACHE_ROOT=str(run_dir.parent / "vllm-cache"),
               TORCHINDUCTOR_CACHE_DIR=str(run_dir.parent / "inductor-cache"))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "rlhpc.launch", *overrides], capture_output=True, text=True,
                              timeout=args.rl_timeout, cwd=REPO, env=env)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    wall = time.perf_counter() - t0
    gen, n_gen, _ = median_of(run_dir / "logs" / "inference-0.metrics.jsonl", "perf/tokens_per_s")
    train, _, n_train = median_of(run_dir / "logs" / "trainer-0.metrics.jsonl", "perf/tokens_per_s")
    where = ("CPU (smoke test)" if args.smoke_cpu else "trainer cuda:0, worker cuda:1" if gpus >= 2
             else "trainer and worker share cuda:0")
    line = (f"rl: engine {engine}, {where}, {n_train} trainer steps in {wall:.0f} s: generation "
            f"{gen:,.0f} completion tokens/s (median of {n_gen} batches), trainer {train:,.0f} tokens/s; "
            f"run_dir {run_dir}")
    if code != 0:
        raise RuntimeError(f"{line}\n`python -m rlhpc.launch` ended with {code}; its last output:\n{out[-3000:]}")
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds, smaller batch")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="the GPU's peak dense bf16 TFLOP/s for MFU (default: looked up from its name)")
    ap.add_argument("--only", default="train,broadcast,rl", help="comma-separated subset of train,broadcast,rl")
    ap.add_argument("--batch", type=int, default=0, help="sequences per train step (default 8; --quick 4)")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default 2048; --quick 1024)")
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    reason = None if args.smoke_cpu else no_gpu_reason()
    if reason:
        print(f"gpu_check: no GPU: {reason}; nothing was run", file=sys.stderr)
        return 2
    args.batch = args.batch or (4 if args.quick else 8)
    args.seq_len = args.seq_len or (1024 if args.quick else 2048)
    args.warmup, args.steps = (2, 5) if args.quick else (3, 10)
    args.rounds, args.bucket_mb = (2 if args.quick else 5), 64
    args.rl_steps, args.rl_timeout = (4, 300) if args.quick else (12, 420)
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]

    import torch

    from rlhpc.modeling.models import build

    if args.smoke_cpu:
        args.batch, args.seq_len, args.rl_steps = 2, 64, 3
        print(f"gpu_check --smoke-cpu: the script's logic on the CPU with a tiny model, torch {torch.__version__}; "
              f"these numbers say nothing about GPUs", flush=True)
    else:
        print(f"gpu_check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="rlhpc-gpu-check-") as tmp:
        path = None
        if {"train", "broadcast"} & set(wanted):
            t0 = time.perf_counter()
            path = build(model_config(args), Path(tmp) / "model")
            print(f"built the {'tiny' if args.smoke_cpu else 'Qwen3-0.6B-shaped'} model in {time.perf_counter() - t0:.0f} s", flush=True)
        checks = {"train": lambda: check_train(path, args), "broadcast": lambda: check_broadcast(path, args),
                  "rl": lambda: check_rl(args)}
        for name in wanted:
            if name not in checks:
                print(f"gpu_check: unknown check {name!r} (--only takes train,broadcast,rl)", file=sys.stderr)
                return 2
            t0 = time.perf_counter()
            try:
                print(checks[name](), flush=True)
            except Exception as e:  # report it and go on to the next check
                failed += 1
                print(f"{name}: FAILED after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
