"""Held-out evaluation runs on inference worker 0, not on the trainer: its results, the curve, the schedule."""

import gc
import json
import subprocess
import sys

import pytest

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import Config
from rlhpc.run.evaluation import eval_owed, read_curve
from rlhpc.run.rundir import RunDir

SMALL = ["+exp=reverse_text", "sft.steps=5", "eval.num_tasks=8", "launcher.progress=false",
         "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1"]


def launch(run_dir, *overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=timeout)


def schedule(interval: int, steps: int) -> Config:
    cfg = Config()
    cfg.eval.interval, cfg.trainer.steps = interval, steps
    return cfg


def test_the_curve_starts_with_the_first_version_worker_0_holds():
    assert eval_owed(schedule(10, 30), 0, None)
    assert eval_owed(schedule(10, 30), 7, None)  # sft.steps=0 and worker 0 first saw version 7


def test_due_versions_and_the_last_are_owed_once():
    cfg = schedule(10, 30)
    assert eval_owed(cfg, 10, 0) and eval_owed(cfg, 30, 20)
    assert not eval_owed(cfg, 5, 0) and not eval_owed(cfg, 10, 10) and not eval_owed(cfg, 9, 10)


def test_a_skipped_due_version_is_measured_at_the_next_version_worker_0_holds():
    cfg = schedule(10, 30)
    assert eval_owed(cfg, 11, 0)  # version 10 went by while worker 0 was generating
    assert not eval_owed(cfg, 12, 11)


def test_without_an_interval_only_the_last_version_is_owed():
    cfg = schedule(0, 30)
    assert not eval_owed(cfg, 10, 0) and eval_owed(cfg, 30, 0)


def test_the_warm_start_records_version_0_and_lets_its_model_go(tmp_path):
    from transformers import PreTrainedModel

    from rlhpc import env as env_mod
    from rlhpc.infer.rollout import evaluator
    from rlhpc.run.metrics import Metrics
    from rlhpc.train.warmstart import warm_start

    cfg = config_mod.to_typed({"run_dir": str(tmp_path), "sft": {"steps": 2, "batch_size": 2}, "eval": {"num_tasks": 2},
                               "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1}})
    def models_alive() -> set:
        gc.collect()
        return {id(o) for o in gc.get_objects() if issubclass(type(o), PreTrainedModel)}

    run = RunDir(tmp_path).make()
    metrics = Metrics(run, "trainer", 0)
    before = models_alive()
    out = warm_start(cfg, run, env_mod.load(cfg.env), metrics, 0, evaluator)
    metrics.close()
    assert read_curve(run) == [(0, out["heldout_reward_sft"])]
    assert models_alive() <= before  # nothing of the SFT model is left for RL


@pytest.mark.slow
def test_an_fsdp_run_is_evaluated_by_worker_0_and_its_curve_is_the_workers_results(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "trainer.num_ranks=2", "trainer.steps=6", "eval.interval=2", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir(run_dir)
    results = [json.loads(p.read_text()) for p in sorted((run_dir / "evals").glob("v*.json"))]
    versions = [r["version"] for r in results]
    # Version 0 is the warm start's; the rest come from worker 0, at least the final version.
    assert versions[0] == 0 and versions[-1] == 6 and len(versions) >= 2
    assert all(r["tasks"] == 8 for r in results)
    worker_log = (run_dir / "logs" / "inference-0.log").read_text()
    assert all(f"weights version {v}: held-out reward" in worker_log for v in versions[1:])
    # summary.json's curve is exactly these results, each with its weights version.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [tuple(x) for x in summary["eval_curve"]] == read_curve(run) == [(r["version"], r["reward"]) for r in results]
    assert summary["heldout_reward_sft"] == results[0]["reward"]
    assert summary["heldout_reward_rl"] == results[-1]["reward"]
    # The trainer evaluates nothing during RL: no evaluation in its metrics, nor in its log after the warm start.
    trainer_rows = [json.loads(x) for x in (run_dir / "logs" / "trainer-0.metrics.jsonl").read_text().splitlines()]
    assert not [r for r in trainer_rows if any(k.startswith("eval/") for k in r)]
    assert "held-out reward" not in (run_dir / "logs" / "trainer-0.log").read_text().split("after 5 SFT steps")[-1]
    # What the user sees at the end still reads the same.
    assert "held-out reward after RL" in proc.stdout


@pytest.mark.slow
def test_without_a_warm_start_worker_0_measures_the_starting_weights(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "sft.steps=0", "trainer.steps=3", "eval.interval=0", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = read_curve(RunDir(run_dir))
    assert [v for v, _ in curve] == [0, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout_reward_base"] == summary["heldout_reward_sft"] == curve[0][1]
    assert summary["heldout_reward_rl"] == curve[-1][1]
