"""vLLM engine vs transformers engine: generation throughput on the same model and prompts, in one run.

    python benchmarks/engines.py                      # the tiny model built in code, 8 prompts x 8 completions x 32
    python benchmarks/engines.py --hidden-size 512 --layers 8   # a ~20M-parameter model built in code
    python benchmarks/engines.py --model-path DIR     # any local Hugging Face checkpoint

Both engines go through the rlhpc Engine interface (the inference worker's path): n completions per prompt at
temperature 1, no stop tokens, so every completion is exactly --max-new-tokens long and both do the same work. Each
engine gets one warm-up call, then the calls alternate between the engines (so a busy machine slows both alike), and the
best of --repeats is reported. Also reported: the time of one full weight update through `update_weights`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="", help="a Hugging Face checkpoint folder (default: build tiny_qwen3)")
    ap.add_argument("--hidden-size", type=int, default=128, help="of the model built in code (128: tiny_qwen3)")
    ap.add_argument("--layers", type=int, default=4, help="of the model built in code")
    ap.add_argument("--run-dir", default="", help="where the model and vLLM's caches go (default: a temporary folder)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of both engines")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before torch starts its pool
    import torch

    from rlhpc.config.schema import InferenceConfig, ModelConfig
    from rlhpc.infer.engines import make_engine
    from rlhpc.modeling import models

    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rlhpc-bench-engines-"))
    built = ModelConfig(hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size, num_layers=args.layers,
                        num_heads=max(4, args.hidden_size // 64), num_kv_heads=max(2, args.hidden_size // 128))
    model_path = Path(args.model_path) if args.model_path else models.build(built, run_dir / "model")
    vocab = models.load_model(model_path).config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_tokens), generator=g).tolist()
    call = dict(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
    expected = args.prompts * args.n * args.max_new_tokens

    engines = {}
    t0 = time.time()
    engines["hf"] = make_engine("hf", str(model_path), args.dtype)
    start_s = {"hf": time.time() - t0}
    t0 = time.time()
    engines["vllm"] = make_engine("vllm", str(model_path), args.dtype, cfg=InferenceConfig(engine="vllm"),
                                  run_dir=str(run_dir))
    start_s["vllm"] = time.time() - t0

    times = {k: [] for k in engines}
    for k, eng in engines.items():  # warm-up: first-call costs (allocation, oneDNN primitive caches)
        eng.generate(prompts, **call)
    for _ in range(args.repeats):
        for k, eng in engines.items():
            t0 = time.perf_counter()
            out = eng.generate(prompts, **call)
            times[k].append(time.perf_counter() - t0)
            tokens = sum(len(c.tokens) for grp in out for c in grp)
            assert tokens == expected, f"{k} generated {tokens} tokens, expected {expected}"

    update_s = {}
    weights = [(n, p.detach()) for n, p in models.load_model(model_path, dtype=args.dtype).named_parameters()]
    for k, eng in engines.items():
        t0 = time.perf_counter()
        eng.update_weights(weights)
        update_s[k] = time.perf_counter() - t0

    n_params = sum(t.numel() for _, t in weights)
    print(f"model {model_path} ({n_params / 1e6:.2f}M parameters, {args.dtype}), {args.prompts} prompts x {args.n} "
          f"completions x {args.max_new_tokens} tokens = {expected} tokens per call, {args.threads} thread(s), "
          f"best of {args.repeats}")
    best = {k: expected / min(v) for k, v in times.items()}
    for k in engines:
        med = expected / statistics.median(times[k])
        print(f"  {k:5s} {best[k]:10.0f} tokens/s (median {med:8.0f})   start {start_s[k]:5.1f} s   "
              f"weight update {update_s[k] * 1e3:7.1f} ms")
    print(f"  vllm/hf throughput ratio: {best['vllm'] / best['hf']:.2f}")
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
