"""One RL trainer step on the quick start's model and batch shape, with each sample padded to its own row
(`trainer.packing=padded`) against a group's samples packed behind their shared prompt (`shared_prefix`), in one
process, steps of the two modes alternating so that both see the same machine load.

    python benchmarks/trainer_step.py [--prompt-tokens 24] [--completion-tokens 5 12] [--groups 16] [--group-size 16]
                                      [--threads 1] [--steps 8] [--hidden 128 --layers 4 --intermediate 384]
                                      [--compile]

The batch: `groups` tasks x `group-size` completions, each task a prompt of `prompt-tokens` random tokens shared by its
completions (the quick start's chat-formatted "Reverse: <5-10 letters>" is 21-26 tokens) and completions of a length
drawn from `completion-tokens` (the quick start's are 6-11 tokens with the end-of-turn token). The model is the quick
start's ~0.8M-parameter Qwen3 built in code (the defaults above). It prints seconds per step (median of `steps` after
one warm-up step per mode), the tokens each mode's forward covers (padding included), and the ratios. `--compile` then
compiles the blocks (`trainer.compile`, in place, so after the other modes), reports the first step's time and
measures `shared_prefix` again.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_batch(vocab: int, groups: int, group_size: int, prompt: int, completion: tuple, seed: int = 0):
    from rlhpc.transport.queue import Group, RolloutBatch

    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for _ in range(groups):
        p = torch.randint(3, vocab, (prompt,), generator=g)
        for _ in range(group_size):
            n = int(torch.randint(completion[0], completion[1] + 1, (1,), generator=g))
            seqs.append(torch.cat([p, torch.randint(3, vocab, (n,), generator=g)]))
            masks.append(torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]))
    lengths = torch.tensor([len(s) for s in seqs])
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    mask = torch.cat(masks)
    return RolloutBatch(
        tokens=torch.cat(seqs), offsets=offsets, loss_mask=mask,
        logprobs=torch.where(mask, -torch.rand(len(mask), generator=g) * 3, torch.zeros(len(mask))),
        advantages=torch.randn(len(seqs), generator=g),
        group_of=torch.arange(groups).repeat_interleave(group_size),
        groups=[Group(uid=str(i), env="bench", task_id=str(i), version=0, num_samples=group_size,
                      rewards=[0.0] * group_size, truncated=[False] * group_size) for i in range(groups)],
    )


def forwarded_tokens(trainer, batch, packing: str) -> int:
    """Tokens the step's forward passes cover, padding included."""
    step = trainer.stepper
    split = batch.offsets.diff().tolist()
    sequences = batch.tokens.split(split)
    mine = torch.arange(batch.num_samples)
    trainer.cfg.trainer.packing = packing
    total = 0
    for mb in step.plan(mine, batch.lengths, sequences, batch.group_of, True):
        if isinstance(mb, list):
            total += len(mb) * max(r.length(sequences) for r in mb)
        else:
            total += len(mb) * int(batch.lengths[mine[mb]].max())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--completion-tokens", type=int, nargs=2, default=(6, 11))
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()

    from rlhpc.config import schema as config_mod
    from rlhpc.modeling import models
    from rlhpc.run.identity import Identity
    from rlhpc.run.rundir import RunDir
    from rlhpc.train.optim import make_optimizer
    from rlhpc.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = RunDir(root)
        run.make()
        cfg = config_mod.to_typed({"run_dir": str(root), "model": {
            "hidden_size": args.hidden, "num_layers": args.layers, "intermediate_size": args.intermediate}})
        models.build(cfg.model, run.model)
        tr = Trainer(cfg, Identity("trainer", 0, 1, root, "t", "127.0.0.1", 0), run)
        tr.tokenizer = models.load_tokenizer(run.model)
        tr.model = tr.wrap(models.load_model(run.model))
        tr.optimizer = make_optimizer(tr.model.parameters(), cfg.trainer.optim)
        tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)
        tr.reference = None
        batch = make_batch(len(tr.tokenizer), args.groups, args.group_size, args.prompt_tokens,
                           tuple(args.completion_tokens))
        modes = ("padded", "shared_prefix")
        times = {m: [] for m in modes}
        for i in range(2 * (args.steps + 1)):
            mode = modes[i % 2]
            tr.cfg.trainer.packing = mode
            t0 = time.perf_counter()
            tr.train_step(i, batch)
            if i >= 2:  # one warm-up step per mode
                times[mode].append(time.perf_counter() - t0)
        tokens = {m: forwarded_tokens(tr, batch, m) for m in modes}
        first_compiled = None
        if args.compile:
            tr.cfg.trainer.packing, tr.cfg.trainer.compile = "shared_prefix", True
            t0 = time.perf_counter()
            tr.train_step(0, batch)
            first_compiled = time.perf_counter() - t0
            times["+compile"] = []
            for i in range(args.steps):
                t0 = time.perf_counter()
                tr.train_step(i, batch)
                times["+compile"].append(time.perf_counter() - t0)
            tokens["+compile"] = tokens["shared_prefix"]
        params = sum(p.numel() for p in tr.model.parameters())
    real = int(batch.lengths.sum())
    print(f"{args.groups} groups x {args.group_size} completions, prompt {args.prompt_tokens} tokens, completions "
          f"{args.completion_tokens[0]}-{args.completion_tokens[1]}; {params / 1e6:.2f}M parameters, "
          f"{args.threads} thread(s); {real} sample tokens")
    print(f"{'packing':<15}{'s/step':>8}{'min':>8}{'max':>8}{'tokens forwarded':>18}")
    for m in times:
        t = times[m]
        print(f"{m:<15}{statistics.median(t):8.3f}{min(t):8.3f}{max(t):8.3f}{tokens[m]:>18}")
    ratio = statistics.median(times["shared_prefix"]) / statistics.median(times["padded"])
    print(f"shared_prefix / padded: {ratio:.2f}x the time, {tokens['shared_prefix'] / tokens['padded']:.2f}x the "
          f"tokens")
    if first_compiled is not None:
        ratio = statistics.median(times["+compile"]) / statistics.median(times["padded"])
        print(f"shared_prefix+compile / padded: {ratio:.2f}x the time (the first compiled step took "
              f"{first_compiled:.1f}s)")


if __name__ == "__main__":
    main()
