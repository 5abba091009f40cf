"""Supervised fine-tuning on its own: build or load the model, train, evaluate greedy held-out reward, export in HF format.

    python -m rlhpc.sft +exp=reverse_text run_dir=runs/sft-only     # trains, evaluates, exports to run_dir/model
"""

from __future__ import annotations

import logging
import random
import sys
import time

import torch

log = logging.getLogger("rlhpc.sft")

# What the command's exit status says (its --help and docs/commands.md show them; rlhpc.commands).
EXIT_CODES = {
    0: "trained, evaluated and exported: the held-out reward before and after is printed",
    2: "the config or the run directory was refused before anything loaded (one line naming the key)",
}


def main() -> None:
    """Standalone SFT: build or load the model, train, evaluate greedy held-out reward, export in HF format."""
    from rlhpc.commands import exit_on_help, hydra_command

    exit_on_help("sft", sys.argv[1:])  # before the imports below
    from rlhpc import env as env_mod
    from rlhpc.config import schema as config_mod
    from rlhpc.infer.engines.hf import HFEngine
    from rlhpc.infer.rollout import evaluate, evaluator
    from rlhpc.modeling import models
    from rlhpc.preflight import checks as preflight
    from rlhpc.preflight.rundir import RunDirError, prepare_run_dir
    from rlhpc.run.evaluation import heldout_tasks
    from rlhpc.run.rundir import RunDir, write_json
    from rlhpc.train.warmstart import sft_train

    def _run(dcfg) -> None:
        try:
            cfg = config_mod.to_typed(dcfg)
            config_mod.validate(cfg)
            preflight.check(cfg)  # the model, the environment and the loss, before the run directory is written
            run = prepare_run_dir(cfg)
        except (config_mod.ConfigError, RunDirError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s sft %(levelname)s: %(message)s", force=True)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        base = cfg.model.path or str(models.build(cfg.model, run.root / "base_model"))
        model, tok = models.load_model(base, cfg.model.dtype), models.load_tokenizer(base)
        env = env_mod.load(cfg.env)
        eval_tasks = heldout_tasks(env, cfg)
        engine = HFEngine(model, tok.pad_token_id)
        try:
            before = evaluate(engine, env, tok, eval_tasks, cfg.env)
            t0 = time.time()
            losses = sft_train(model, tok, env, cfg,
                               on_step=lambda s, l: s % 50 == 0 and log.info("sft step %d loss %.4f", s, l),
                               evaluator=evaluator)
            after = evaluate(engine, env, tok, eval_tasks, cfg.env)
        finally:
            env.close()
        model.save_pretrained(run.model)
        tok.save_pretrained(run.model)
        out = {"heldout_reward_before": before, "heldout_reward_sft": after, "sft_steps": len(losses),
               "wall_time_s": time.time() - t0, "model": str(run.model)}
        write_json(RunDir(run.root).summary, out)
        print(f"SFT: held-out reward {before:.3f} -> {after:.3f} in {out['wall_time_s']:.0f}s; model in {run.model}")

    hydra_command("sft", _run)


if __name__ == "__main__":
    main()
