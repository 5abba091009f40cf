"""End to end: a training run's workers serve the policy being trained; `rlhpc.serve` serves a checkpoint and
`rlhpc.eval` scores it through the same endpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")

from rlhpc.infer.server import VERSION_HEADER, endpoint

SMALL = ["+exp=reverse_text", "sft.steps=5", "eval.num_tasks=8", "eval.interval=0", "launcher.progress=false",
         "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1"]


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode}: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_training_run_serves_the_policy_it_trains_behind_the_run_token(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rlhpc.launch", *SMALL, f"run_dir={run_dir}", "trainer.steps=40",
                             "inference.serve=true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for rank in (0, 1):
            wait_for_file(run_dir / "rendezvous" / f"serve-{rank}.json", proc)
        ep = endpoint(run_dir, 0)
        assert ep.token == json.loads((run_dir / "rendezvous" / "weights.json").read_text())["token"]
        body = {"model": ep.model, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
        assert httpx.post(ep.url + "/inference/v1/generate", json=body).status_code == 401
        status = subprocess.run([sys.executable, "-m", "rlhpc.status", str(run_dir), "--no-slurm"], capture_output=True,
                                text=True).stdout
        assert f"serving: worker 0 at {ep.url}" in status and "serving: worker 1" in status
        versions = []
        while proc.poll() is None and len(versions) < 200:
            try:
                r = httpx.post(ep.url + "/inference/v1/generate", json=body,
                               headers={"Authorization": f"Bearer {ep.token}"})
            except httpx.TransportError:  # the run ended and the worker stopped serving
                break
            if r.status_code == 503:  # the run ended while this request waited: the closing server says so
                assert "shutting down" in r.json()["error"]["message"]
                break
            assert r.status_code == 200, r.text
            versions.append(int(r.headers[VERSION_HEADER]))
            assert versions[-1] == r.json()["weights_version"]
            time.sleep(0.05)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert versions == sorted(versions) and versions[-1] > versions[0]  # serving went on across weight updates
    assert not list((run_dir / "rendezvous").glob("serve-*.json"))  # a finished run serves nothing



@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_rlhpc_serve_refuses_a_training_runs_folder_and_writes_nothing_there(tmp_path):
    """`run_dir=runs/x` beside `model.path=runs/x/checkpoints/final` is an easy slip: the server would write its own
    config.yaml over the run's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("exp_name: mine\n")
    (run_dir / "summary.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "rlhpc.serve", f"run_dir={run_dir}"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: config key `run_dir`: {run_dir} is not empty and was not served from before")
    assert (run_dir / "config.yaml").read_text() == "exp_name: mine\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "summary.json"]
    bad = subprocess.run([sys.executable, "-m", "rlhpc.eval", "env=reverse_text", "eval.endpoint=http://127.0.0.1:9",
                          f"model.path={tmp_path / 'nothing'}"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error: config key `model.path`" in bad.stderr and "Traceback" not in bad.stderr

@pytest.mark.slow
def test_rlhpc_serve_serves_a_checkpoint_and_rlhpc_eval_scores_it_through_the_endpoints(tmp_path):
    serve_dir = tmp_path / "serve"
    server = subprocess.Popen([sys.executable, "-m", "rlhpc.serve", f"run_dir={serve_dir}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for_file(serve_dir / "rendezvous" / "serve-0.json", server)
        ep = endpoint(serve_dir)
        assert ep.token and ep.model == "tiny_qwen3"
        models = httpx.get(ep.url + "/v1/models", headers={"Authorization": f"Bearer {ep.token}"}).json()
        assert models["data"][0]["id"] == "tiny_qwen3"
        common = ["env=reverse_text", "eval.k=4", "eval.num_tasks=6", "env.pool_processes=0"]
        remote = subprocess.run([sys.executable, "-m", "rlhpc.eval", *common, f"eval.run={serve_dir}",
                                 f"eval.report={tmp_path / 'remote.json'}"], capture_output=True, text=True, timeout=300)
        assert remote.returncode == 0, remote.stderr[-3000:]
    finally:
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err[-3000:]
    assert f"at {ep.url}" in out and f"token: {ep.token}" in out
    report = json.loads((tmp_path / "remote.json").read_text())
    assert report["tasks"] == 6 and report["k"] == 4 and len(report["per_task"]) == 6
    assert 0 <= report["pass@1"] <= report["pass@4"] <= 1
    assert report["mean_reward"] == pytest.approx(
        sum(r for t in report["per_task"] for r in t["rewards"]) / 24)
    # The same checkpoint served in the eval's own process: the same greedy episodes, the same greedy reward.
    scratch = tmp_path / "tmp"  # the in-process server's files go to the temporary folder, and are removed after
    scratch.mkdir()
    local = subprocess.run([sys.executable, "-m", "rlhpc.eval", *common, f"model.path={serve_dir / 'base_model'}",
                            "model.name=tiny_qwen3", "eval.report=-"], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TMPDIR=str(scratch)))
    assert local.returncode == 0, local.stderr[-3000:]
    assert [p.name for p in scratch.iterdir() if p.name.startswith("rlhpc")] == []  # (torch keeps its own caches there)
    here = json.loads(local.stdout)
    assert [t["greedy_reward"] for t in here["per_task"]] == [t["greedy_reward"] for t in report["per_task"]]
