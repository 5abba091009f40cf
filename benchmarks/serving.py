"""Tokens per second through the HTTP token endpoint with many concurrent clients, against the same engine called
in-process with the same prompts in one batch per round (the best a client-free caller can do).

    python benchmarks/serving.py                      # tiny model built in code, 32 clients
    python benchmarks/serving.py --model-path DIR --clients 32 --max-tokens 128 --rounds 5

Every completion is exactly --max-tokens long (no stop token), so both sides generate the same number of tokens.
Prints both rates, their ratio, and how the server batched the clients' requests (engine calls, sequences per call).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="", help="a Hugging Face folder (default: the tiny model built in code)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import httpx

    from rlhpc.config.schema import ModelConfig
    from rlhpc.env.episode import Renderer
    from rlhpc.infer.engines.hf import HFEngine
    from rlhpc.infer.server import Server, context_length
    from rlhpc.modeling import models

    path = Path(args.model_path) if args.model_path else models.build(ModelConfig(), Path(tempfile.mkdtemp()) / "m")
    tok = models.load_tokenizer(path)
    engine = HFEngine.from_pretrained(str(path))
    prompts = [Renderer(tok).prompt([{"role": "user", "content": f"Reverse: text number {i}"}])
               for i in range(args.clients)]
    n_tokens = args.clients * args.max_tokens * args.rounds

    engine.generate(prompts, 1, 1.0, args.max_tokens, [])  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        outs = engine.generate(prompts, 1, 1.0, args.max_tokens, [])
        assert all(len(g[0].tokens) == args.max_tokens for g in outs)
    in_process = n_tokens / (time.perf_counter() - t0)

    server = Server(engine, tok, "bench", context_length(path), None).start()
    params = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True, "logprobs": 1}
    errors: list = []

    def client(i: int, rounds: int) -> None:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            for _ in range(rounds):
                r = c.post("/inference/v1/generate", json={"token_ids": prompts[i], "sampling_params": params})
                if r.status_code != 200 or len(r.json()["choices"][0]["token_ids"]) != args.max_tokens:
                    errors.append(r.text[:200])

    def run_clients(rounds: int) -> float:
        threads = [threading.Thread(target=client, args=(i, rounds)) for i in range(args.clients)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    run_clients(1)  # warm-up (connections, the server's first batches)
    calls0, seqs0 = server.batcher.engine_calls, server.batcher.sequences
    over_http = n_tokens / run_clients(args.rounds)
    calls, seqs = server.batcher.engine_calls - calls0, server.batcher.sequences - seqs0
    server.close()
    assert not errors, errors[:3]
    print(f"model {path.name}, {args.clients} clients x {args.rounds} requests x {args.max_tokens} tokens, "
          f"torch threads {args.threads}")
    print(f"in-process engine.generate ({args.clients} prompts per call): {in_process:,.0f} tokens/s")
    print(f"HTTP /inference/v1/generate, {args.clients} concurrent clients: {over_http:,.0f} tokens/s "
          f"({calls} engine calls, {seqs / max(calls, 1):.1f} sequences per call)")
    print(f"ratio HTTP / in-process: {over_http / in_process:.2f}")


if __name__ == "__main__":
    main()
