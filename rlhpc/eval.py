"""`python -m rlhpc.eval model.path=<hf dir> env=<name>`: score a checkpoint on an environment's held-out tasks.

    python -m rlhpc.eval model.path=runs/x/checkpoints/final env=reverse_text eval.k=8
    python -m rlhpc.eval env=reverse_text eval.run=runs/x             # a training run's worker (inference.serve=true)
    python -m rlhpc.eval env=reverse_text eval.endpoint=http://node:8000 eval.token=... model.path=...

Runs `eval.k` sampled episodes (temperature `eval.temperature`) of each of the first `eval.num_tasks` held-out tasks,
plus one greedy episode each (`eval.greedy`), through the HTTP token endpoint of a served policy
(rlhpc.infer.server): a server started here over `model.path` (`inference.engine`: hf or vllm), or one already
running (`eval.run`: a run directory that serves; `eval.endpoint` + `eval.token`). Episodes are rlhpc's own
(rlhpc.env.episode), so multi-turn and tool-using environments run exactly as in training. A sample passes when its
reward is at least `eval.pass_threshold`.

It prints one line of headline figures (tasks, k, pass@1, pass@k, mean reward, greedy reward) and where the JSON report
(those figures, and per task its rewards) was written: `eval.report`, or by default `eval-<env>-<time>.json` in the
current folder (the one place this command can count on writing and the user on finding: model.path may be read-only,
a run directory another's); a default name that exists already (two evaluations in one second) takes `-2`, `-3`, ...
rather than replace it. `eval.report=-` prints the JSON report on stdout instead, and the summary line on stderr, for
scripts.

Values that cannot work (eval.k, eval.temperature, eval.concurrency, an eval.report that cannot be written, or a
current folder that cannot be written without one, a model.path without a tokenizer) are refused in one line naming
the key before anything loads (exit 2); a server that stops answering mid-evaluation ends it in one line naming the
server's key (exit 1). A report that cannot be written after all (a full disk) is printed on stdout instead, before
the one line that says so (exit 1).
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Dict, List, Sequence

from rlhpc.config.schema import Config, ConfigError, EvalConfig, need

log = logging.getLogger("rlhpc.eval")


@dataclass
class EvalCommandKeys(EvalConfig):
    """`eval.*` of `python -m rlhpc.eval`: the trainer's eval keys (num_tasks, ...) and these."""

    # Sampled episodes per task (pass@k is computed from these k samples).
    k: int = 8
    # Sampling temperature of those episodes (0 is greedy).
    temperature: float = 1.0
    # Also run one greedy episode per task (the trainer's held-out reward).
    greedy: bool = True
    # A sample passes when its reward is at least this.
    pass_threshold: float = 1.0
    # A running server's base URL ("": start a server in this process over model.path).
    endpoint: str = ""
    # That server's token ("": none, for a server started with inference.serve_open=true).
    token: str = ""
    # A run directory whose worker serves (a training run with inference.serve=true, or rlhpc.serve's run_dir).
    run: str = ""
    # Which of eval.run's workers to evaluate through (its rendezvous/serve-<worker>.json).
    worker: int = 0
    # Where the JSON report goes ("": eval-<env>-<time>.json in the current folder; "-": stdout).
    report: str = ""
    # Requests in flight at once (the server batches them).
    concurrency: int = 64


@dataclass
class EvalCommandConfig(Config):
    eval: EvalCommandKeys = field(default_factory=EvalCommandKeys)


class ServerFailed(RuntimeError):
    """The server stopped answering (or failed a request) mid-evaluation: not a config error."""


def check_keys(cfg: EvalCommandConfig) -> None:
    """The `eval.*` values that cannot work, refused before anything loads (not after the evaluation ran)."""
    e = cfg.eval
    need(e.k >= 1, "eval.k", "must be >= 1")
    need(math.isfinite(e.temperature) and e.temperature >= 0, "eval.temperature",
         f"must be a finite number >= 0 (0 is greedy), got {e.temperature}")
    need(e.concurrency >= 1, "eval.concurrency", f"must be >= 1 (requests in flight at once), got {e.concurrency}")
    need(not (e.run and e.endpoint), "eval.endpoint",
         f"set eval.run or eval.endpoint, not both (eval.run={e.run} names its own served endpoint)")
    if e.report != "-":
        check_report(e.report)


def check_report(report: str) -> None:
    """Where the report goes can be written once the evaluation is done: `eval.report` is not a folder, and the nearest
    of its folders that exists takes a new file (the missing ones are created with the report); without eval.report,
    the current folder takes one."""
    from rlhpc.config.errors import one_line

    if report:
        path = Path(report)
        need(not path.is_dir(), "eval.report", f"{path} is a folder: name a file in it (e.g. {path / 'eval.json'})")
        folder, hint = path.absolute().parent, ""
    else:
        folder = Path.cwd()
        hint = " (the report's default place): set eval.report=<file>, or eval.report=- to print it"
    try:
        while not folder.exists():
            folder = folder.parent
        need(folder.is_dir(), "eval.report", f"{folder} is not a folder")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".rlhpc-eval-probe-"):
            pass
    except OSError as err:
        problem = err.strerror or one_line(err)
        raise ConfigError(f"config key `eval.report`: cannot write in {folder}: {problem}{hint}") from None


def default_report(env: str, started: float) -> Path:
    """eval-<env>-<time the evaluation started>.json in the current folder (the environment's name made a file name:
    verifiers:org/env is verifiers_org_env)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", env)
    return Path(f"eval-{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}.json")


def write_new(path: Path, out: Dict[str, Any]) -> Path:
    """Writes the report to `path`, or to <name>-2.json, -3, ... when that file exists: a default name never replaces
    another evaluation's report. Returns the file written; a write that fails leaves none."""
    n, where = 1, path
    while True:
        try:
            f = open(where, "x")
        except FileExistsError:
            n += 1
            where = path.with_name(f"{path.stem}-{n}{path.suffix}")
            continue
        try:
            with f:
                f.write(json.dumps(out, indent=1, sort_keys=True))
        except BaseException:
            where.unlink(missing_ok=True)
            raise
        return where


def summary(out: Dict[str, Any]) -> str:
    """The report's headline figures in one line."""
    k = out["k"]
    line = (f"{out['env']}: {out['tasks']} tasks x k={k} at temperature {out['temperature']:g}: "
            f"pass@1 {out['pass@1']:.3f}" + (f"  pass@{k} {out[f'pass@{k}']:.3f}" if k > 1 else "")
            + f"  mean reward {out['mean_reward']:.3f}")
    if "greedy_reward" in out:
        line += f"  greedy reward {out['greedy_reward']:.3f}"
    if out["errors"]:  # the figures count them at env.error_reward: a broken environment must not pass for a bad model
        line += f"  ({out['errors']} episode(s) failed in the environment: see per_task in the report)"
    return line


def served_tokenizer(path: str | None, key: str):
    """The tokenizer of a served model's folder: all an evaluation against a running server needs of it (no weights)."""
    from rlhpc.config.errors import one_line
    from rlhpc.modeling import models
    from rlhpc.preflight.checks import TOKENIZER_FILES

    hint = " (the served model's folder; set model.path to a copy of it)" if key == "eval.run" else ""
    if not path:
        raise ConfigError(f"config key `{key}`: the server does not say where its model is{hint}")
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"config key `{key}`: {path} is not a folder{hint}")
    # transformers makes an empty tokenizer from config.json alone: ask for the tokenizer's own files.
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"config key `{key}`: no loadable tokenizer in {path}{hint}: none of "
                          f"{', '.join(TOKENIZER_FILES)}")
    try:
        return models.load_tokenizer(folder)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises, the message is what the user needs
        raise ConfigError(f"config key `{key}`: no loadable tokenizer in {path}{hint}: {one_line(err)}") from None


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

    from rlhpc.config.errors import one_line
    from rlhpc.preflight import checks as preflight

    e = cfg.eval
    server, scratch = None, None
    # Against a running server only the tokenizer of model.path is used (served_tokenizer checks it).
    if cfg.model.path and not (e.run or e.endpoint):
        preflight.check_model(cfg, trainer=False)  # a path that is no folder: said before the imports below
    from rlhpc import env as env_mod
    from rlhpc.env.pool import EnvPool
    from rlhpc.infer.engines.remote import RemoteEngine, RemoteEngineError
    from rlhpc.infer.rollout import episodes
    from rlhpc.infer.server import endpoint
    from rlhpc.modeling import models

    preflight.check_context(cfg)
    env = env_mod.load(cfg.env)
    if e.run:
        ep = endpoint(e.run, e.worker)
        url, token, key = ep.url, ep.token, "eval.run"
        tokenizer = served_tokenizer(cfg.model.path or ep.model_dir, "model.path" if cfg.model.path else "eval.run")
    elif e.endpoint:
        if not cfg.model.path:
            raise ConfigError("config key `model.path`: eval.endpoint needs the served model's folder (its tokenizer)")
        url, token, key = e.endpoint, e.token or None, "eval.endpoint"
        tokenizer = served_tokenizer(cfg.model.path, "model.path")
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
        url, key, tokenizer = server.url, "", None
    try:
        if tokenizer is None:  # the server started here serves `path`
            tokenizer = models.load_tokenizer(path)
        tasks = list(islice(env.tasks("eval", 0), cfg.eval.num_tasks))
        try:
            engine = RemoteEngine(url, token, concurrency=e.concurrency)
        except (httpx.TransportError, RemoteEngineError) as err:
            raise ConfigError(f"config key `{key}`: the server at {url} cannot be used: {err}") from None
        pool = EnvPool(cfg.env)
        t0 = time.time()
        try:
            sampled = episodes(engine, env, pool, tokenizer, tasks, e.k, e.temperature, cfg.env)
            greedy = episodes(engine, env, pool, tokenizer, tasks, 1, 1.0, cfg.env, greedy=True) if e.greedy else None
        except (httpx.TransportError, RemoteEngineError) as err:
            # A server killed or stopped mid-evaluation (or failing a request): one line, not a traceback per thread.
            which = f"`{key}`" if key else "the server started here over model.path"
            problem = (f"the server at {url} stopped answering: {one_line(err)}"
                       if isinstance(err, httpx.TransportError) else str(err))
            raise ServerFailed(f"{which}: {problem} (no report)") from None
        finally:
            pool.close()
            env.close()
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


# What the command's exit status says (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "evaluated: the summary line is printed and the report written (eval.report=-: printed on stdout)",
    1: "the server stopped answering mid-evaluation (no report), or the report could not be written (it is printed "
       "on stdout instead)",
    2: "refused before any episode ran (one line naming the key or the file)",
}


def main() -> None:
    from omegaconf import OmegaConf

    from rlhpc.commands import hydra_command
    from rlhpc.config import schema as config_mod
    from rlhpc.config.errors import one_line
    from rlhpc.run.rundir import write_json

    def _run(dcfg) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s eval %(levelname)s: %(message)s", force=True)
        started = time.time()
        try:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalCommandConfig), dcfg))
            config_mod.validate(cfg)
            check_keys(cfg)
            out = evaluate(cfg)
        except (config_mod.ConfigError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except ServerFailed as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        report = cfg.eval.report
        if report == "-":  # stdout is the report's alone, for a script to parse
            print(summary(out), file=sys.stderr)
            print(json.dumps(out, indent=1), flush=True)
            return
        print(summary(out), flush=True)
        try:
            if report:
                Path(report).parent.mkdir(parents=True, exist_ok=True)
                write_json(Path(report), out)
                written = Path(report)
            else:
                written = write_new(default_report(out["env"], started), out)
        except OSError as e:
            # The evaluation is not lost: the report goes to stdout instead.
            print(json.dumps(out, indent=1), flush=True)
            print(f"error: config key `eval.report`: the report (printed above) was not written: "
                  f"{one_line(e)}", file=sys.stderr)
            sys.exit(1)
        print(f"report: {written}")

    # The run's schema with the eval command's keys: a wrong key still fails at composition, naming it.
    hydra_command("eval", _run, schema=EvalCommandConfig)


if __name__ == "__main__":
    main()
