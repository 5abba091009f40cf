"""`python -m rlhpc.serve model.path=<hf dir>`: serve a checkpoint over HTTP on its own (docs/serving.md).

    python -m rlhpc.serve model.path=runs/x/checkpoints/final run_dir=runs/serve inference.serve_port=8000
    python -m rlhpc.serve model.path=... inference.engine=vllm inference.serve_host=0.0.0.0

The same server as a training run's workers (rlhpc.infer.server: OpenAI-compatible endpoints and
/inference/v1/generate) over one engine (`inference.engine`: hf or vllm). Without `model.path` it serves the tiny
model built in code. It prints the address and the token (none with `inference.serve_open=true`) and writes them under
`run_dir/rendezvous/` (serve-0.json, serving-token.json), where `rlhpc.eval eval.run=<run_dir>`, `rlhpc.status` and
`rlhpc.infer.server.endpoint(run_dir)` find them. Serves until Ctrl-C, SIGTERM or SIGHUP (unless started under `nohup`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Optional, Tuple

from rlhpc.run.procs import on_stop_signals

log = logging.getLogger("rlhpc.serve")


def model_dir(cfg, scratch: Path) -> Path:
    """`model.path`, or the tiny model of `cfg.model` built in code under `scratch` (once)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    from rlhpc.modeling import models

    out = scratch / "base_model"
    return out if (out / "config.json").exists() else models.build(cfg.model, out)


def start(cfg, run=None, token: Optional[str] = None, scratch: Optional[Path] = None) -> Tuple["object", Path]:
    """An engine for the config's model and a started server over it: (server, model folder). With a run directory the
    server publishes itself there (and the token unless `inference.serve_open`); otherwise it uses `token`, and its
    files (the model built in code, the engine's caches) go to `scratch`, a folder the caller removes."""
    from rlhpc.infer.engines import make_engine
    from rlhpc.infer.server import publish, shared_token, start_server

    if run is not None:
        scratch = run.root
    elif scratch is None:
        raise ValueError("start() needs a run directory or a scratch folder")
    path = model_dir(cfg, scratch)
    token_file = None
    if run is not None and not cfg.inference.serve_open:
        token_file = "serving-token.json"
        token = shared_token(run.rendezvous / token_file)
    engine = make_engine(cfg.inference.engine, str(path), cfg.model.dtype, cfg=cfg.inference,
                         run_dir=str(scratch), seed=cfg.seed)
    try:
        server = start_server(cfg, engine, path, None if cfg.inference.serve_open else token)
    except BaseException:
        engine.close()
        raise
    if run is not None:
        publish(run, 0, server, token_file, path)
    return server, path


# Marks a run directory as rlhpc.serve's: serving again there may replace its config.yaml.
SERVE_MARK = "SERVED"


def serve_dir(cfg):
    """The run directory to serve from: new, empty, or one this command served from before. Any other (a training
    run's, above all) is refused before anything is written: the server writes its own config.yaml there."""
    from rlhpc.config.schema import ConfigError
    from rlhpc.run.rundir import RunDir

    run = RunDir(Path(cfg.run_dir))
    if run.root.exists() and not run.root.is_dir():
        raise ConfigError(f"config key `run_dir`: {run.root} is a file, not a folder")
    if run.root.exists() and any(run.root.iterdir()) and not (run.root / SERVE_MARK).exists():
        raise ConfigError(f"config key `run_dir`: {run.root} is not empty and was not served from before (a training "
                          f"run's folder?); rlhpc.serve writes its config.yaml and rendezvous there: choose another "
                          f"run_dir (model.path=<run>/checkpoints/final serves a run's model)")
    return run.make()


# What the command's exit status says (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "served until Ctrl-C, SIGTERM or SIGHUP, then stopped",
    2: "refused before serving (one line naming the key): the config, model.path, a port in use, or a run_dir that "
       "holds something else",
    130: "a second Ctrl-C ended it at once, without waiting for the generation in progress",
}


def main() -> None:
    from rlhpc.commands import hydra_command
    from rlhpc.config import schema as config_mod
    from rlhpc.preflight import checks as preflight

    def _run(dcfg) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s: %(message)s", force=True)
        try:
            cfg = config_mod.to_typed(dcfg)
            config_mod.validate(cfg)
            preflight.check_model(cfg, trainer=False)
            preflight.check_serving(cfg, workers=1)  # the port, before the model is loaded
            run = serve_dir(cfg)
            config_mod.save(cfg, run.config)
            (run.root / SERVE_MARK).touch()
            server, path = start(cfg, run)  # the port may have been taken meanwhile: the same one-line error
        except config_mod.ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        stop = threading.Event()

        def on_signal(*_) -> None:
            if stop.is_set():  # a second Ctrl-C: now, without waiting for the generation in progress
                os._exit(130)
            stop.set()

        on_stop_signals(on_signal)
        print(f"serving {server.model} ({path}, engine {cfg.inference.engine}) at {server.url}", flush=True)
        print(f"token: {server.token}" if server.token else "token: none (inference.serve_open=true)", flush=True)
        print(f"rendezvous: {run.rendezvous}/serve-0.json", flush=True)
        try:
            stop.wait()
        finally:
            print("stopping: requests not answered yet get 503 (Ctrl-C again ends it at once)", flush=True)
            server.close(timeout_s=2)  # the engine call in progress is not waited for long: its clients have answers
            server.engine.close()
            print("stopped", flush=True)
            logging.shutdown()
            # Not the interpreter's teardown: a batcher thread still inside torch would abort the process there.
            os._exit(0)

    hydra_command("serve", _run)


if __name__ == "__main__":
    main()
