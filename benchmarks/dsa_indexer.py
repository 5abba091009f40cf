"""GLM-5's DSA indexer: transformers' (every query scored against every key at once) against the trainer's
(rlhpc/modeling/sparse.py: a block of queries at a time), on one sample of L tokens, by the memory and time of one call.

    python benchmarks/dsa_indexer.py [--lengths 2048 4096 8192] [--heads 8] [--head-dim 64] [--hidden 256]
                                     [--topk 256] [--block-elements 4194304] [--repeats 3]

The indexer is layer 0's of a GLM-5 built in code (transformers' glm_moe_dsa) with `heads` indexer heads of
`head-dim`, on random hidden states; each side is called as the model calls it in a training forward: transformers'
with the sample's whole causal mask [L, L] (bool, made by its caller: counted, as the caller holds it during the call),
the trainer's with the packed row's segments (it builds each block's mask itself). Memory: the process's peak resident
memory during the call above its resident memory just before (VmHWM reset through /proc/self/clear_refs; glibc's mmap
and trim thresholds at 128 KiB, so that a freed buffer leaves the process at once), best (least) of `repeats`; time:
the least of `repeats` calls, one thread. Both choose the same keys except among tied scores at the top-k boundary,
where the trainer keeps the earlier key (the check: the blocked choice equals the trainer's unblocked one).

transformers' peak is (2 x heads + 1) x L x L x 4 B of float32 scores (docs/scaling.md, row "DSA indexer"): quadratic.
The trainer's is (2 x heads + 1) x block-elements x 4 B plus what is linear in L: the ratio falls as L grows.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks import kb, reset_peak  # noqa: E402

MALLOC_KB = 128


def indexer_and_inputs(args, tokens: int):
    """Layer 0's indexer of a GLM-5 built in code, and its inputs for one sample of `tokens` tokens."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    cfg = GlmMoeDsaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                          moe_intermediate_size=args.hidden, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=4, q_lora_rank=args.hidden // 2, kv_lora_rank=64, qk_nope_head_dim=32,
                          qk_rope_head_dim=32, v_head_dim=32, index_topk=args.topk, index_n_heads=args.heads,
                          index_head_dim=args.head_dim, n_routed_experts=4, num_experts_per_tok=2,
                          first_k_dense_replace=1, max_position_embeddings=max(args.lengths))
    model = GlmMoeDsaForCausalLM(cfg).eval()
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(1, tokens, args.hidden)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden)).detach()
    position_embeddings = tuple(t.detach() for t in model.model.rotary_emb(hidden, torch.arange(tokens)[None]))
    return model, attn.indexer, hidden, q_resid, position_embeddings


def measure(args, tokens: int, side: str, out) -> None:
    """In a process of its own: (peak KiB above the start, seconds, the choice) of `side`'s indexer on `tokens`."""
    try:
        torch.set_num_threads(1)
        from rlhpc.modeling import sparse

        model, indexer, hidden, q_resid, pe = indexer_and_inputs(args, tokens)
        if side != "transformers":
            sparse.install(model, block_elements=args.block_elements if side == "rlhpc" else 0)
        peaks, seconds = [], []
        with torch.no_grad():
            for _ in range(args.repeats):
                base = kb("VmRSS")
                reset_peak()
                t0 = time.perf_counter()
                if side == "transformers":
                    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None]  # its caller's, [1, L, L]
                else:
                    mask = torch.zeros(1, 1, tokens, dtype=torch.long)  # the row's segments: one sample
                choice = indexer(hidden, q_resid, pe, mask, None)
                seconds.append(time.perf_counter() - t0)
                peaks.append(kb("VmHWM") - base)
                del mask
        out.put((min(peaks), min(seconds), choice.long().sort(-1).values.numpy()))  # by value
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put(f"{side} at {tokens} tokens failed: {type(e).__name__}: {e}")


def run(args, tokens: int, side: str):
    # A process of its own, forked from a server that imported the libraries once and ran nothing: nothing resident
    # from another side, without each measurement importing torch and transformers again (~10 s each here).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
                                "rlhpc.modeling.sparse"])
    out = ctx.Queue()
    proc = ctx.Process(target=measure, args=(args, tokens, side, out), daemon=True)
    proc.start()
    try:
        got = out.get(timeout=600)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--block-elements", type=int, default=4194304)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = os.environ["MALLOC_TRIM_THRESHOLD_"] = str(MALLOC_KB << 10)
    print(f"DSA indexer: {args.heads} heads x {args.head_dim}, index_topk {args.topk}, one sample of L tokens, one "
          f"thread; rlhpc in blocks of attention_block_elements={args.block_elements} scores; peak = VmHWM above VmRSS "
          f"before the call, best of {args.repeats}")
    print(f"  {'L':>6} {'transformers MiB':>17} {'s':>7} {'rlhpc MiB':>10} {'s':>7} {'memory ratio':>13} "
          f"{'time ratio':>11} {'same choice':>12}")
    for tokens in args.lengths:
        t_mem, t_sec, _ = run(args, tokens, "transformers")
        r_mem, r_sec, choice = run(args, tokens, "rlhpc")
        _, _, whole = run(args, tokens, "rlhpc-unblocked")
        same = "yes" if (choice == whole).all() else "NO"
        print(f"  {tokens:>6} {t_mem / 1024:>17.1f} {t_sec:>7.3f} {r_mem / 1024:>10.1f} {r_sec:>7.3f} "
              f"{r_mem / t_mem:>13.3f} {r_sec / t_sec:>11.2f} {same:>12}")
    print("  (memory ratio: rlhpc / transformers, lower is better; time ratio likewise)")


if __name__ == "__main__":
    main()
