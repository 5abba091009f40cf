"""Peak memory of token logprobs (+ entropy, + backward) with the full [tokens x vocabulary] logits against the chunked
output head (rlhpc.train.batching, `trainer.logprob_chunk_tokens`), on a long sequence with a large vocabulary and a small
model, so that the logits dominate.

    python benchmarks/logprob_memory.py [--vocab 151936] [--tokens 8192] [--hidden 64] [--chunk 2048] [--device cpu]

Each variant runs in a fresh process. On CPU the peak is the kernel's resident-set high-water mark (VmHWM, reset
through /proc/self/clear_refs just before the measured call) minus the resident set at that point; on GPU it is
torch.cuda.max_memory_allocated over the same call minus what was allocated before it. The naive variant needs about
four copies of the logits (8192 x 151936 fp32 = 5 GB each): pick --tokens to fit the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.config.schema import ModelConfig  # noqa: E402
from rlhpc.modeling import models  # noqa: E402
from rlhpc.train.batching import token_logprobs  # noqa: E402
from ranks import kb  # noqa: E402

MB = 1 << 20




def measure(model_dir: str, tokens: int, chunk: int, device: str, temperature: float, out) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    dev = torch.device(device)
    model = models.load_model(model_dir).to(dev)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=dev)
    attn = torch.ones_like(ids)
    weights = torch.randn(1, tokens - 1, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
            f.write("5")
        base = kb("VmRSS") * 1024
    t0 = time.perf_counter()
    lp, ent = token_logprobs(model, ids, attn, temperature, with_entropy=True, chunk_tokens=chunk)
    (lp * weights).sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = kb("VmHWM") * 1024
    out.put((chunk, peak - base, time.perf_counter() - t0, float(lp.detach().sum()), float(ent.sum())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ModelConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=1, num_heads=2,
                          num_kv_heads=1, max_position_embeddings=args.tokens, extra={"vocab_size": args.vocab})
        model_dir = str(models.build(cfg, Path(tmp)))
        rows = {}
        for chunk in (0, args.chunk):
            q = ctx.Queue()
            p = ctx.Process(target=measure, args=(model_dir, args.tokens, chunk, args.device, args.temperature, q))
            p.start()
            rows[chunk] = q.get()
            p.join()
    logits_mb = args.tokens * args.vocab * 4 / MB
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, hidden {args.hidden}, {args.device}: one fp32 copy of the "
          f"logits is {logits_mb:.0f} MiB")
    print(f"{'variant':<22}{'peak extra MiB':>16}{'seconds':>10}{'sum logprobs':>16}{'sum entropy':>14}")
    for chunk, peak, secs, lp_sum, ent_sum in rows.values():
        name = "full logits" if chunk == 0 else f"chunked ({chunk} tokens)"
        print(f"{name:<22}{peak / MB:>16.0f}{secs:>10.2f}{lp_sum:>16.2f}{ent_sum:>14.2f}")
    full, chunked = rows[0][1], rows[args.chunk][1]
    print(f"peak memory ratio full / chunked: {full / max(chunked, 1):.1f}x")


if __name__ == "__main__":
    main()
