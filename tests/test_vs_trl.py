"""benchmarks/vs_trl.py's TRL side: an rlhpc run's settings reach TRL's GRPOTrainer as they are, and it trains, evaluates
and times its steps. Two steps on the tiny model built in code, with the quick start's config shrunk to 2 x 4 samples."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import CONF_DIR, to_typed
from rlhpc.modeling import models

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("trl")


def test_trl_side_trains_with_the_rlhpc_runs_settings_and_times_each_step(tmp_path):
    config_mod.register()
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = to_typed(compose(config_name="config", overrides=[
            "+exp=reverse_text", f"run_dir={run_dir}", "trainer.groups_per_step=2", "algo.group_size=4",
            "inference.groups_per_batch=2", "eval.num_tasks=4"]))
    run_dir.mkdir()
    config_mod.save(cfg, run_dir / "config.yaml")
    model = models.build(cfg.model, tmp_path / "model")
    spec = {"model": str(model), "config": str(run_dir), "seed": 0, "steps": 2, "eval_every": 1, "threads": 1,
            "out": str(tmp_path / "trl.json"), "output_dir": str(tmp_path / "trl")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "vs_trl.py"), "--trl-child",
                           str(tmp_path / "spec.json")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "trl.json").read_text())

    eos = models.load_tokenizer(model).eos_token_id
    assert out["settings"] == {
        "num_generations": 4, "batch": 8, "temperature": 0.7, "top_k": 0, "top_p": 1.0, "max_new_tokens": 16,
        "eos_token_id": [eos], "loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.0,
        "scale_rewards": "group", "num_iterations": 1, "max_grad_norm": 1.0, "bf16": False,
        "gradient_checkpointing": False,
        # rlhpc's warm-up: lr * (s + 1) / (warmup_steps + 1), warmup_steps=10, lr 5e-4
        "lrs": [round(5e-4 / 11, 10), round(5e-4 * 2 / 11, 10)],
    }
    assert out["prompts_match"] is True  # TRL's chat-template ids are rlhpc's renderer's, token for token
    assert out["completions"] == 8
    assert len(out["ends"]) == 2 and 0 < out["ends"][0] < out["ends"][1]
    assert [v for v, _ in out["curve"]] == [0, 1, 2]
    assert all(0.0 <= r <= 1.0 for _, r in out["curve"])
    assert all(g > 0 for g in out["phases"]["generate"]) and all(f > 0 for f in out["phases"]["forward+backward"])
