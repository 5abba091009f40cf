"""verifiers overhead: the cost per episode of running a verifiers environment in rlhpc, beside rlhpc's own episodes.

    python benchmarks/verifiers_overhead.py [--tasks 16] [--n 16] [--repeats 5]

One batch is --tasks tasks x --n single-turn episodes of the reverse-text task, played by a policy that costs nothing
(an Engine that answers every prompt with the same few tokens at once: a stand-in for a model, so that what is timed
is the machinery around the model, not the model). Three ways, interleaved, best of --repeats:
- `rlhpc reverse_text`: rlhpc's own environment and episode loop (envs/reverse_text.py);
- `verifiers in-process`: `vf_reverse_text` (the test package in tests/verifiers_pkgs) run by verifiers, as rlhpc runs
  it by default: the `rlhpc_chat` harness in the worker's event loop, verifiers' interception server and TrainClient,
  which reaches rlhpc's token endpoint through an in-process transport;
- `verifiers loopback HTTP`: the same, with TrainClient reaching the endpoint over a loopback socket
  (`env.args.in_process_endpoint=false`, verifiers' own client);
- `verifiers N processes`: the batch's tasks shared by --processes processes of their own, each with its own event
  loop, reaching the endpoint over loopback HTTP (`env.args.episode_processes=N`).
Prints ms of wall time per episode and of CPU of this process (the worker's: the endpoint, and the episodes unless
they run in processes of their own), and the ratios to rlhpc's own loop, in-process/HTTP and processes/in-process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKGS = ROOT / "tests" / "verifiers_pkgs"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PKGS))  # the environment package, here and in the processes verifiers starts
os.environ["PYTHONPATH"] = os.pathsep.join([str(PKGS), os.environ.get("PYTHONPATH", "")])

from rlhpc.config.schema import EnvConfig, ModelConfig  # noqa: E402
from rlhpc.env.base import load  # noqa: E402
from rlhpc.env.pool import EnvPool  # noqa: E402
from rlhpc.infer.engines import Completion, Engine  # noqa: E402
from rlhpc.infer.rollout import episodes  # noqa: E402
from rlhpc.modeling import models  # noqa: E402


class InstantPolicy(Engine):
    """Answers every prompt with the same tokens, at no cost (not a model: the benchmark times what surrounds one)."""

    def __init__(self, answer: list):
        self.answer = answer

    def generate(self, prompts, n, temperature, max_new_tokens, stop_token_ids, greedy=False):
        c = Completion(self.answer, [-0.1] * len(self.answer), "stop")
        return [[c] * n for _ in prompts]

    def update_weights(self, named_tensors):
        pass

    def score(self, sequences, temperature):
        raise NotImplementedError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 2, help="episode_processes of the last row")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="rlhpc-vf-bench-"))
    try:
        run(args, models.build(ModelConfig(), scratch / "model"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, model_dir: Path) -> None:
    tok = models.load_tokenizer(model_dir)
    policy = InstantPolicy(tok("olleh", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])

    def vf(**more) -> EnvConfig:
        return EnvConfig(name="verifiers", cls="rlhpc.env.verifiers_env:VerifiersEnvironment", pool_processes=0,
                         max_new_tokens=16, args={"id": "vf_reverse_text", "eval_size": args.tasks, "num_tasks": 200,
                                                  **more})

    processes = f"verifiers {args.processes} processes"
    cfgs = {"rlhpc reverse_text": EnvConfig(name="reverse_text", pool_processes=0, max_new_tokens=16),
            "verifiers in-process": vf(), "verifiers loopback HTTP": vf(in_process_endpoint=False),
            processes: vf(episode_processes=args.processes)}
    runs = {}
    for label, cfg in cfgs.items():
        env = load(cfg)
        tasks = list(env.tasks("eval", 0))[:args.tasks]
        runs[label] = (env, EnvPool(cfg, processes=0, env=env), tasks, cfg)
    best = {label: (float("inf"), float("inf")) for label in runs}
    try:
        for r in range(args.repeats + 1):  # the first round warms up (imports, the servers, the renderer)
            for label, (env, pool, tasks, cfg) in runs.items():
                t, c = time.perf_counter(), time.process_time()
                groups = episodes(policy, env, pool, tok, tasks, args.n, 1.0, cfg)
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                errors = [e.error for g in groups for e in g if e.error]
                if errors:
                    raise SystemExit(f"{label}: {len(errors)} episodes failed, e.g. {errors[0]}")
                if r:
                    best[label] = (min(best[label][0], wall), min(best[label][1], cpu))
    finally:
        for env, *_ in runs.values():
            getattr(env, "close", lambda: None)()
    episodes_ = args.tasks * args.n
    print(f"verifiers overhead: {args.tasks} tasks x {args.n} single-turn episodes, a policy that costs nothing; "
          f"best of {args.repeats}")
    print(f"  {'':<26}{'ms/episode':>11}{'CPU ms (this process)':>22}{'x rlhpc loop':>14}")
    native = best["rlhpc reverse_text"][0]
    for label, (wall, cpu) in best.items():
        print(f"  {label:<26}{wall / episodes_ * 1e3:11.2f}{cpu / episodes_ * 1e3:22.2f}{wall / native:14.1f}")
    print(f"  in-process / loopback HTTP: {best['verifiers in-process'][0] / best['verifiers loopback HTTP'][0]:.2f}")
    print(f"  {args.processes} processes / in-process: {best[processes][0] / best['verifiers in-process'][0]:.2f}")


if __name__ == "__main__":
    main()
