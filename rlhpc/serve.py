"""`python -m rlhpc.serve model.path=<hf dir>`: serve a checkpoint over HTTP on its own (docs/serving.md).

    python -m rlhpc.serve model.path=runs/x/checkpoints/final run_dir=runs/serve inference.serve_port=8000
    python -m rlhpc.serve model.path=... inference.engine=vllm inference.serve_host=0.0.0.0

The same server as a training run's workers (rlhpc.infer.server: OpenAI-compatible endpoints and
/inference/v1/generate) over one engine (`inference.engine`: hf or vllm). Without `model.path` it serves the tiny
model built in code. It prints the address and the token (none with `inference.serve_open=true`) and writes them under
`run_dir/rendezvous/` (serve-0.json, serving-token.json), where `rlhpc.eval eval.run=<run_dir>`, `rlhpc.status` and
`rlhpc.infer.server.endpoint(run_dir)` find them. Serves until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Optional, Tuple

log = logging.getLogger("rlhpc.serve")


def model_dir(cfg, scratch: Path) -> Path:
    """`model.path`, or the tiny model of `cfg.model` built in code under `scratch` (once)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    from rlhpc import models

    out = scratch / "base_model"
    return out if (out / "config.json").exists() else models.build(cfg.model, out)


def start(cfg, run=None, token: Optional[str] = None) -> Tuple["object", Path]:
    """An engine for the config's model and a started server over it: (server, model folder). With a run directory the
    server publishes itself there (and the token unless `inference.serve_open`); otherwise it uses `token`."""
    import tempfile

    from rlhpc.infer.engines import make_engine
    from rlhpc.infer.server import publish, shared_token, start_server

    scratch = run.root if run is not None else Path(tempfile.mkdtemp(prefix="rlhpc-serve-"))
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


def main() -> None:
    import hydra

    from rlhpc import algo  # noqa: F401  (registers the algorithms' config checks)
    from rlhpc import config as config_mod
    from rlhpc.config import CONF_DIR
    from rlhpc.rundir import RunDir

    config_mod.register()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def _run(dcfg) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s: %(message)s", force=True)
        try:
            cfg = config_mod.to_typed(dcfg)
            config_mod.validate(cfg)
        except config_mod.ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        run = RunDir(Path(cfg.run_dir)).make()
        config_mod.save(cfg, run.config)
        server, path = start(cfg, run)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"serving {server.model} ({path}, engine {cfg.inference.engine}) at {server.url}", flush=True)
        print(f"token: {server.token}" if server.token else "token: none (inference.serve_open=true)", flush=True)
        print(f"rendezvous: {run.rendezvous}/serve-0.json", flush=True)
        try:
            stop.wait()
        finally:
            server.close()
            server.engine.close()
            print("stopped", flush=True)

    _run()


if __name__ == "__main__":
    main()
