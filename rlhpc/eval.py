"""`python -m rlhpc.eval model.path=<hf dir> env=<name>`: score a checkpoint on an environment's held-out tasks.

    python -m rlhpc.eval model.path=runs/x/checkpoints/final env=reverse_text eval.k=8
    python -m rlhpc.eval env=reverse_text eval.run=runs/x             # a training run's worker (inference.serve=true)
    python -m rlhpc.eval env=reverse_text eval.endpoint=http://node:8000 eval.token=... model.path=...

Runs `eval.k` sampled episodes (temperature `eval.temperature`) of each of the first `eval.num_tasks` held-out tasks,
plus one greedy episode each (`eval.greedy`), through the HTTP token endpoint of a served policy
(rlhpc.infer.server): a server started here over `model.path` (`inference.engine`: hf or vllm), or one already
running (`eval.run`: a run directory that serves; `eval.endpoint` + `eval.token`). Episodes are rlhpc's own
(rlhpc.env.episode), so multi-turn and tool-using environments run exactly as in training. A sample passes when its
reward is at least `eval.pass_threshold`. Prints a JSON report (pass@1, pass@k, mean reward, greedy reward, per task)
and writes it to `eval.report` when set.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Dict, List, Sequence

from rlhpc.config import Config, EvalConfig

log = logging.getLogger("rlhpc.eval")


@dataclass
class EvalCommandKeys(EvalConfig):
    """`eval.*` of `python -m rlhpc.eval`: the trainer's eval keys (num_tasks, ...) and these."""

    # Sampled episodes per task (pass@k is computed from these k samples).
    k: int = 8
    temperature: float = 1.0
    # Also run one greedy episode per task (the trainer's held-out reward).
    greedy: bool = True
    # A sample passes when its reward is at least this.
    pass_threshold: float = 1.0
    # A running server's base URL and token ("": start a server in this process over model.path).
    endpoint: str = ""
    token: str = ""
    # A run directory whose worker serves (a training run with inference.serve=true, or rlhpc.serve's run_dir).
    run: str = ""
    worker: int = 0
    # Where the JSON report goes ("": printed only).
    report: str = ""
    # Requests in flight at once (the server batches them).
    concurrency: int = 64


@dataclass
class EvalCommandConfig(Config):
    eval: EvalCommandKeys = field(default_factory=EvalCommandKeys)


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def report(tasks: Sequence[Any], sampled: List[List[Any]], greedy: List[List[Any]] | None, k: int,
           threshold: float) -> Dict[str, Any]:
    per_task, rewards = [], []
    for task, eps in zip(tasks, sampled):
        r = [e.reward for e in eps]
        rewards += r
        c = sum(x >= threshold for x in r)
        row = {"task": task.id, "rewards": r, "passed": c, "errors": sum(e.error is not None for e in eps)}
        if greedy is not None:
            row["greedy_reward"] = greedy[len(per_task)][0].reward
        per_task.append(row)
    out: Dict[str, Any] = {
        "tasks": len(per_task), "k": k,
        "pass@1": sum(pass_at(k, t["passed"], 1) for t in per_task) / len(per_task),
        f"pass@{k}": sum(pass_at(k, t["passed"], k) for t in per_task) / len(per_task),
        "mean_reward": sum(rewards) / len(rewards),
        "errors": sum(t["errors"] for t in per_task),
    }
    if greedy is not None:
        out["greedy_reward"] = sum(t["greedy_reward"] for t in per_task) / len(per_task)
    out["per_task"] = per_task
    return out


def evaluate(cfg: EvalCommandConfig) -> Dict[str, Any]:
    import httpx

    from rlhpc import env as env_mod
    from rlhpc import models, preflight
    from rlhpc.config import ConfigError
    from rlhpc.env.pool import EnvPool
    from rlhpc.infer.engines.remote import RemoteEngine, RemoteEngineError
    from rlhpc.infer.rollout import episodes
    from rlhpc.infer.server import endpoint

    e = cfg.eval
    server, scratch = None, None
    if cfg.model.path:
        preflight.check_model(cfg, trainer=False)
    preflight.check_context(cfg)
    env = env_mod.load(cfg.env)
    if e.run:
        ep = endpoint(e.run, e.worker)
        url, token, model_dir, key = ep.url, ep.token, cfg.model.path or ep.model_dir, "eval.run"
    elif e.endpoint:
        if not cfg.model.path:
            raise ValueError("config key `model.path`: eval.endpoint needs the served model's folder (its tokenizer)")
        url, token, model_dir, key = e.endpoint, e.token or None, cfg.model.path, "eval.endpoint"
    else:
        from rlhpc.serve import start

        if not cfg.model.path:
            print("warning: no model.path: scoring the untrained model built in code from model.*", file=sys.stderr)
        token = secrets.token_hex(16)
        # The engine's files (and the model built in code) live as long as this evaluation.
        scratch = tempfile.TemporaryDirectory(prefix="rlhpc-eval-")
        try:
            server, path = start(cfg, token=token, scratch=Path(scratch.name))
        except BaseException:
            scratch.cleanup()
            raise
        url, model_dir, key = server.url, str(path), ""
    try:
        tasks = list(islice(env.tasks("eval", 0), cfg.eval.num_tasks))
        tokenizer = models.load_tokenizer(model_dir)
        try:
            engine = RemoteEngine(url, token, concurrency=e.concurrency)
        except (httpx.TransportError, RemoteEngineError) as err:
            raise ConfigError(f"config key `{key}`: the server at {url} cannot be used: {err}") from None
        pool = EnvPool(cfg.env)
        t0 = time.time()
        try:
            sampled = episodes(engine, env, pool, tokenizer, tasks, e.k, e.temperature, cfg.env)
            greedy = episodes(engine, env, pool, tokenizer, tasks, 1, 1.0, cfg.env, greedy=True) if e.greedy else None
        finally:
            pool.close()
            engine.close()
    finally:
        if server is not None:
            server.close()
            server.engine.close()
        if scratch is not None:
            scratch.cleanup()
    out = {"env": env.name, "model": engine.model, "endpoint": url, "temperature": e.temperature,
           "weights_version": engine.version, **report(tasks, sampled, greedy, e.k, e.pass_threshold),
           "wall_time_s": time.time() - t0}
    return out


def main() -> None:
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from rlhpc import algo  # noqa: F401  (registers the algorithms' config checks)
    from rlhpc import config as config_mod
    from rlhpc import preflight
    from rlhpc.config import CONF_DIR
    from rlhpc.rundir import write_json

    # The run's schema with the eval command's keys: a wrong key still fails at composition, naming it.
    ConfigStore.instance().store(name="rlhpc_schema", node=EvalCommandConfig)
    preflight.exit_on_composition_error(sys.argv[1:], typed=lambda dcfg: OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(EvalCommandConfig), dcfg)))

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def _run(dcfg) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s eval %(levelname)s: %(message)s", force=True)
        try:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalCommandConfig), dcfg))
            config_mod.validate(cfg)
            config_mod.need(cfg.eval.k >= 1, "eval.k", "must be >= 1")
            out = evaluate(cfg)
        except (config_mod.ConfigError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if cfg.eval.report:
            Path(cfg.eval.report).parent.mkdir(parents=True, exist_ok=True)
            write_json(Path(cfg.eval.report), out)
        print(json.dumps(out, indent=1))
        k = out["k"]
        print(f"{out['env']}: pass@1 {out['pass@1']:.3f}  pass@{k} {out[f'pass@{k}']:.3f}  "
              f"mean reward {out['mean_reward']:.3f}"
              + (f"  greedy {out['greedy_reward']:.3f}" if "greedy_reward" in out else ""), file=sys.stderr)

    _run()


if __name__ == "__main__":
    main()
