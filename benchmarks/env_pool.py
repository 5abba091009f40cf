"""Episodes per second for an environment with its calls in the process pool, against scoring inline after generation.

    python benchmarks/env_pool.py [--env code] [--tools] [--tasks 16] [--group 4] [--batches 3] [--processes 2]

Both sides run the same episodes through rlhpc.env.episode.run_episodes: the same tasks, the same answers, the same
engine. Only where the environment's calls run differs: in `env.pool_processes` processes (rewards, replies and
tool calls of different episodes at once, and beside later turns' generation), or inline in the worker's thread
one after the other (`env.pool_processes=0`).

The policy is scripted, so that the answers exercise the sandbox (a tiny random model writes no code): the engine
answers every turn with the environment's reference episode (`reference(task)`) and, to keep generation's cost real,
runs the tiny model's `generate` for the same batch and length and discards its tokens. Named for what it is:
`ReferenceEngine`, a stand-in for the policy, used only here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhpc.config.schema import EnvConfig, ModelConfig  # noqa: E402
from rlhpc.env import load  # noqa: E402
from rlhpc.env.episode import Renderer, run_episodes  # noqa: E402
from rlhpc.env.pool import EnvPool  # noqa: E402
from rlhpc.infer.engines import Completion  # noqa: E402
from rlhpc.infer.engines.hf import HFEngine  # noqa: E402
from rlhpc.modeling import models  # noqa: E402


class ReferenceEngine:
    """Answers each turn with the reference episode's assistant turn of the task whose prompt starts the sequence;
    pays for generation by running the real tiny model on the same batch."""

    def __init__(self, hf: HFEngine, tokenizer, answers: List[tuple]):
        self.hf, self.tok, self.answers = hf, tokenizer, answers  # [(first prompt ids, [assistant texts])]
        self.assistant = tokenizer("<|im_start|>assistant", add_special_tokens=False)["input_ids"]

    def _turns_of(self, prompt: Sequence[int]) -> List[str]:
        for first, turns in self.answers:
            if list(prompt[: len(first)]) == first:
                return turns
        raise KeyError("prompt of an unknown task")

    def generate(self, prompts, n, temperature, max_new_tokens, stop_token_ids, greedy=False):
        self.hf.generate(prompts, n, temperature, max_new_tokens, stop_token_ids, greedy=greedy)  # the real cost
        out = []
        for p in prompts:
            turns = self._turns_of(p)
            k = _count(p, self.assistant) - 1  # assistant turns before this one
            ids = self.tok(turns[min(k, len(turns) - 1)], add_special_tokens=False)["input_ids"] + stop_token_ids[:1]
            out.append([Completion(list(ids), [0.0] * len(ids), "stop") for _ in range(n)])
        return out


def _count(seq: Sequence[int], sub: List[int]) -> int:
    s, L = list(seq), len(sub)
    return sum(1 for i in range(len(s) - L + 1) if s[i:i + L] == sub)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="code")
    ap.add_argument("--tools", action="store_true", help="code: the tool-using variant (env.args.tools=true)")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    env_args = {"tools": True} if args.tools else {}
    cfg = EnvConfig(name=args.env, args=env_args, max_new_tokens=args.max_new_tokens, pool_processes=args.processes)
    env = load(cfg)
    with tempfile.TemporaryDirectory() as d:
        path = models.build(ModelConfig(), Path(d) / "m")
        tok = models.load_tokenizer(path)
        hf = HFEngine.from_pretrained(str(path))
    renderer = Renderer(tok, [t.schema() for t in env.tools()])
    tasks = [t for _, t in zip(range(args.tasks * args.batches), env.tasks("eval", 0))]
    answers = []
    for t in tasks:
        ref = env.reference(t)
        turns = [ref] if isinstance(ref, str) else [m["content"] for m in ref if m["role"] == "assistant"]
        answers.append((renderer.prompt(env.messages(t)), turns))
    engine = ReferenceEngine(hf, tok, answers)
    max_turns = cfg.max_turns or env.max_turns
    results = {}
    for label, processes in (("pool", args.processes), ("inline", 0)):
        pool = EnvPool(cfg, processes=processes, env=env if processes == 0 else None)
        times, rewards = [], []
        try:
            for b in range(args.batches):
                batch = tasks[b * args.tasks:(b + 1) * args.tasks]
                t0 = time.perf_counter()
                groups = run_episodes(engine, env, pool, tok, batch, args.group, 1.0, args.max_new_tokens, max_turns)
                times.append(time.perf_counter() - t0)
                rewards += [e.reward for g in groups for e in g]
        finally:
            pool.close()
        eps = args.tasks * args.group
        results[label] = (eps / statistics.median(times), statistics.mean(rewards))
        print(f"{label:>6}: {results[label][0]:7.2f} episodes/s (median of {args.batches} batches of {eps} episodes, "
              f"{'%d processes' % processes if processes else 'inline'}), mean reward {results[label][1]:.3f}")
    print(f"ratio pool/inline: {results['pool'][0] / results['inline'][0]:.2f}x episodes/s "
          f"(env={args.env}{' tools' if args.tools else ''}, {max_turns} turn(s) at most)")


if __name__ == "__main__":
    main()
