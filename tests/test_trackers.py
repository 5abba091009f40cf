"""Experiment trackers (`metrics.trackers`, rlhpc/run/trackers.py): what W&B (offline), MLflow (its file store) and
trackio recorded of a run, read back from what they wrote, with the real packages and nothing sent anywhere; a
relaunched run goes on in the same tracker runs; a tracker that cannot start is refused before anything starts.
Tests that need the trackers' packages skip without them (`pip install -e '.[trackers]'`)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlhpc.algo  # noqa: F401  (registers the algorithms' config checks, which validate runs)
from rlhpc.config import schema as config_mod
from rlhpc.config.schema import ConfigError
from rlhpc.preflight import checks as preflight
from rlhpc.run import trackers
from rlhpc.run.metrics import Metrics
from rlhpc.run.rundir import RunDir, read_json

EXTRA = "pip install -e '.[trackers]'"

SAMPLES = [
    {"step": 2, "version": 1, "env": "reverse_text", "task_id": "t0", "reward": 1.0, "advantage": 0.5,
     "truncated": False, "prompt": "Reverse: abc", "completion": "cba"},
    {"step": 2, "version": 1, "env": "reverse_text", "task_id": "t1", "reward": 0.0, "advantage": -0.5,
     "truncated": True, "prompt": "Reverse: xyz", "completion": "xy"},
]
SUMMARY = {"heldout_reward_rl": 0.75, "rl_steps": 2, "busy": {"trainer-0": {"busy": 0.9, "waiting": 0.1}}}


@pytest.fixture(autouse=True)
def offline(tmp_path_factory, monkeypatch):
    """W&B, MLflow and trackio keep everything on this machine, under this test run's folders."""
    home = tmp_path_factory.getbasetemp() / "tracker-home"
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB__SAVE_REQUIREMENTS", "false")  # a second each run: the list of installed packages
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / "wandb"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # trackio reads its folder when imported, once per process: the same folder for every test.
    monkeypatch.setenv("TRACKIO_DIR", str(home / "trackio"))
    return home


def need(package: str):
    return pytest.importorskip(package, reason=f"{package} is not installed: {EXTRA}")


def config(run_dir: Path, *names: str, **metrics):
    return config_mod.to_typed({"run_dir": str(run_dir), "exp_name": "tracked",
                                "metrics": {"trackers": list(names), "wandb": {"mode": "offline"}, **metrics}})


def record_a_run(cfg, run: RunDir, steps=(1, 2)) -> None:
    """What the roles log, as they log it: the trainer's warm start and steps, a worker's batches and worker 0's
    held-out evaluation, the samples of the last step and the summary."""
    trackers.prepare(cfg, run)  # the launcher's part
    trainer, worker = Metrics(run, "trainer", 0, cfg), Metrics(run, "inference", 0, cfg)
    trainer.log(1, {"sft/loss": 2.5})
    for step in steps:
        trainer.log(step, {"loss/total": step / 2, "rollout/reward": step / 4})
        worker.log(step - 1, {"rollout/reward": step / 8, "perf/generate_s": 1.0})
    worker.scalars(steps[-1], {"eval/heldout_reward": 0.75}, phase="eval")
    trainer.samples(steps[-1], SAMPLES, "the samples as text")
    trainer.summary(SUMMARY)
    worker.close()
    trainer.close()


# ---- reading back what the trackers wrote ------------------------------------------------------------------------


def wandb_runs(run: RunDir, process: str) -> list:
    """Each attempt's W&B run of `process` ("trainer-0") as its offline transaction log holds it, read with W&B's own
    reader (`wandb leet inspect`): {"id", "group", "job_type", "config", "summary", "rows", "folder"}; the rows with
    their tables' fields flattened ("samples.path")."""
    out = []
    for folder in sorted(run.root.glob(f"wandb/offline-run-*-{process}")):
        records = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
        head, config, summary, rows = {}, {}, {}, []
        for r in map(json.loads, records.splitlines()):
            if r["type"] == "run":
                head = r["run"]
                config.update(head.get("config", {}).get("update", {}))
            elif r["type"] == "config":
                config.update(r["config"].get("update", {}))
            elif r["type"] == "summary":
                summary.update(r["summary"].get("update", {}))
            elif r["type"] == "history":
                rows.append({k: v for k, v in r["history"]["item"].items() if not k.startswith("_")})
        out.append({"id": head["run_id"], "group": head["run_group"], "job_type": head["job_type"], "config": config,
                    "summary": summary, "rows": rows, "folder": folder})
    return out


def series(rows: list, key: str, step_key: str = "step") -> list:
    return [(r[step_key], r[key]) for r in rows if key in r]


def mlflow_run(run: RunDir):
    from mlflow.tracking import MlflowClient

    state = read_json(run.trackers)["mlflow"]
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def history(client, run_id: str, key: str) -> list:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def artifact(client, run_id: str, path: str, dst: Path):
    return json.loads(Path(client.download_artifacts(run_id, path, str(dst))).read_text())


# ---- W&B -----------------------------------------------------------------------------------------------------------


def test_wandb_offline_records_each_processs_scalars_config_samples_and_summary_grouped_by_the_run(tmp_path):
    need("wandb")
    run = RunDir(tmp_path / "run").make()
    record_a_run(config(run.root, "tensorboard", "wandb"), run)
    (trainer,), (worker,) = wandb_runs(run, "trainer-0"), wandb_runs(run, "inference-0")
    assert trainer["group"] == worker["group"] == "tracked-run"
    assert (trainer["job_type"], worker["job_type"]) == ("trainer", "inference")
    assert series(trainer["rows"], "loss/total") == [(1, 0.5), (2, 1.0)]
    assert series(trainer["rows"], "sft/loss", "sft/step") == [(1, 2.5)]
    assert series(worker["rows"], "rollout/reward") == [(0, 0.125), (1, 0.25)]
    assert series(worker["rows"], "eval/heldout_reward", "eval/version") == [(2, 0.75)]
    assert trainer["config"]["metrics"]["trackers"] == ["tensorboard", "wandb"]
    assert trainer["config"]["exp_name"] == worker["config"]["exp_name"] == "tracked"
    assert trainer["summary"]["heldout_reward_rl"] == 0.75 and trainer["summary"]["busy"] == SUMMARY["busy"]
    (table,) = [r["samples.path"] for r in trainer["rows"] if "samples.path" in r]  # the reader flattens the rows
    logged = json.loads((trainer["folder"] / "files" / table).read_text())
    assert logged["columns"] == list(trackers.SAMPLE_COLUMNS)
    assert [dict(zip(logged["columns"], row)) for row in logged["data"]] == SAMPLES
    assert (run.tb / "trainer-0").is_dir()  # and TensorBoard as before


# ---- MLflow --------------------------------------------------------------------------------------------------------


def test_mlflow_records_the_whole_run_in_one_run_with_each_workers_scalars_under_its_name(tmp_path):
    need("mlflow")
    run = RunDir(tmp_path / "run").make()
    record_a_run(config(run.root, "mlflow"), run)
    client, got = mlflow_run(run)
    run_id = got.info.run_id
    assert got.info.run_name == "tracked-run" and got.info.status == "FINISHED"
    assert read_json(run.trackers)["mlflow"]["tracking_uri"] == (run.root / "mlruns").as_uri()
    assert history(client, run_id, "loss/total") == [(1, 0.5), (2, 1.0)]
    assert history(client, run_id, "sft/loss") == [(1, 2.5)]
    assert history(client, run_id, "rollout/reward") == [(1, 0.25), (2, 0.5)]
    assert history(client, run_id, "inference-0/rollout/reward") == [(0, 0.125), (1, 0.25)]
    assert history(client, run_id, "eval/heldout_reward") == [(2, 0.75)]
    assert got.data.params["trainer.steps"] == "100" and got.data.params["metrics.trackers"] == '["mlflow"]'
    assert got.data.metrics["heldout_reward_rl"] == 0.75
    assert artifact(client, run_id, "summary.json", tmp_path) == SUMMARY
    logged = artifact(client, run_id, "samples/step_000002.json", tmp_path)
    assert [dict(zip(logged["columns"], row)) for row in logged["data"]] == SAMPLES
    assert not (run.tb / "trainer-0").exists()  # tensorboard was not named


# ---- trackio -------------------------------------------------------------------------------------------------------


def test_trackio_records_each_processs_scalars_and_the_samples_table(tmp_path):
    need("trackio")
    from trackio import SQLiteStorage

    run = RunDir(tmp_path / "run").make()
    record_a_run(config(run.root, "trackio", run_name="trackio-test", trackio={"project": "rlhpc-test"}), run)
    trainer = SQLiteStorage.get_logs("rlhpc-test", "trackio-test-trainer-0")
    worker = SQLiteStorage.get_logs("rlhpc-test", "trackio-test-inference-0")
    assert series(trainer, "loss/total") == [(1, 0.5), (2, 1.0)]
    assert series(worker, "rollout/reward") == [(0, 0.125), (1, 0.25)]
    assert series(worker, "eval/heldout_reward") == [(2, 0.75)]
    assert [r["summary/heldout_reward_rl"] for r in trainer if "summary/heldout_reward_rl" in r] == [0.75]
    (table,) = [r["samples"] for r in trainer if "samples" in r]
    assert table["_value"] == SAMPLES


# ---- a relaunched run ------------------------------------------------------------------------------------------------


def test_a_relaunched_run_goes_on_in_the_same_wandb_and_mlflow_runs(tmp_path):
    need("wandb"), need("mlflow")
    run = RunDir(tmp_path / "run").make()
    cfg = config(run.root, "wandb", "mlflow")
    record_a_run(cfg, run, steps=(1, 2))
    first = read_json(run.trackers)
    # W&B names an offline run's folder by the second its process started it: a relaunch within the same second (only
    # this test is that fast) would share the first attempt's folder.
    time.sleep(1.05 - time.time() % 1)
    record_a_run(cfg, run, steps=(3, 4))  # relaunched: the launcher prepares again, the roles start again
    assert read_json(run.trackers) == first
    attempts = wandb_runs(run, "trainer-0")
    assert [a["id"] for a in attempts] == [f"{first['wandb']['id']}-trainer-0"] * 2
    assert series(attempts[1]["rows"], "loss/total") == [(3, 1.5), (4, 2.0)]
    client, got = mlflow_run(run)
    assert history(client, got.info.run_id, "loss/total") == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]
    assert len(client.search_runs([got.info.experiment_id])) == 1


# ---- refusals --------------------------------------------------------------------------------------------------------


def test_a_tracker_whose_package_is_missing_is_refused_at_launch_naming_the_key_and_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python marks a module that cannot be imported
    with pytest.raises(ConfigError) as refused:
        preflight.check_trackers(config(tmp_path, "tensorboard", "mlflow"))
    assert str(refused.value) == ("config key `metrics.trackers`: mlflow needs the mlflow-skinny package, which is not "
                                  "installed: pip install -e '.[trackers]' (or pip install mlflow-skinny)")


def test_an_unknown_tracker_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"`metrics.trackers`: 'comet' is not one of tensorboard, wandb, mlflow"):
        config_mod.validate(config(tmp_path, "tensorboard", "comet"))


def test_without_trackers_a_process_writes_its_metrics_rows_only(tmp_path):
    run = RunDir(tmp_path / "run").make()
    metrics = Metrics(run, "trainer", 0, config(run.root))
    metrics.log(1, {"loss/total": 0.5})
    metrics.close()
    assert [r["loss/total"] for r in map(json.loads, (run.logs / "trainer-0.metrics.jsonl").open())] == [0.5]
    assert not run.tb.joinpath("trainer-0").exists() and not run.trackers.exists()


# ---- end to end ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_launched_run_sends_the_trainers_and_the_workers_scalars_and_the_samples_to_wandb_and_mlflow(tmp_path):
    need("wandb"), need("mlflow")
    run = RunDir(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", "sft.steps=0", "trainer.steps=2",
         "eval.num_tasks=2", "eval.interval=0", "model.hidden_size=32", "model.intermediate_size=64",
         "model.num_layers=1", "trainer.groups_per_step=2", "inference.groups_per_batch=2", "inference.num_workers=1",
         "algo.group_size=2", "metrics.trackers=[tensorboard,wandb,mlflow]", "metrics.wandb.mode=offline",
         "launcher.progress=false", f"run_dir={run.root}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(run.summary)
    (trainer,), (worker,) = wandb_runs(run, "trainer-0"), wandb_runs(run, "inference-0")
    assert [s for s, _ in series(trainer["rows"], "loss/total")] == [1, 2]
    assert series(worker["rows"], "rollout/reward") and series(worker["rows"], "eval/heldout_reward", "eval/version")
    assert trainer["summary"]["heldout_reward_rl"] == summary["heldout_reward_rl"]
    assert [r["step"] for r in trainer["rows"] if "samples.path" in r] == [1, 2]  # a table of each step
    client, got = mlflow_run(run)
    run_id = got.info.run_id
    assert [s for s, _ in history(client, run_id, "loss/total")] == [1, 2] and got.info.status == "FINISHED"
    assert history(client, run_id, "inference-0/rollout/reward")
    logged = artifact(client, run_id, "samples/step_000002.json", tmp_path)
    jsonl = [json.loads(line) for line in run.samples.read_text().splitlines()]
    assert [dict(zip(logged["columns"], row)) for row in logged["data"]] == [r for r in jsonl if r["step"] == 2]
