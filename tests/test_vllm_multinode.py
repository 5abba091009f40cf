"""vLLM instances over several nodes (`inference.nodes_per_instance`): a leader and its followers (rlhpc/infer/follower.py).

Here the "nodes" are processes of this machine: vLLM's multi-node executor on CPU, real gloo between the leader's and
the follower's model workers, the rendezvous through a run directory. What a GPU cluster adds (NCCL, one node's GPUs
per process) is vLLM's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import rlhpc.algo  # noqa: F401  (registers the config checks)
from rlhpc.config import schema as config_mod
from rlhpc.config.schema import Config, ModelConfig
from rlhpc.infer import follower
from rlhpc.modeling import models
from rlhpc.run.identity import Identity
from rlhpc.run.rundir import RunDir, write_json
from rlhpc.run.slurm_identity import role_and_rank


def make_run(tmp_path: Path, **inference) -> tuple[Config, RunDir]:
    cfg = Config()
    cfg.inference.engine = "vllm"
    cfg.inference.tensor_parallel_size = 2
    cfg.inference.nodes_per_instance = 2
    cfg.inference.kv_cache_gb = 0.0625
    cfg.inference.max_model_len = 256
    for k, v in inference.items():
        setattr(cfg.inference, k, v)
    cfg.run_dir = str(tmp_path / "run")
    config_mod.validate(cfg)
    run = RunDir(Path(cfg.run_dir))
    run.make()
    config_mod.save(cfg, run.config)
    run.model.mkdir(parents=True, exist_ok=True)
    (run.model / "READY").touch()  # the trainer's warm start is done: workers lead their instances from here
    return cfg, run


def ident(run: RunDir, role: str, rank: int, size: int = 1) -> Identity:
    return Identity(role=role, rank=rank, size=size, run_dir=run.root, attempt="test")


# ---- where each task of the job is --------------------------------------------------------------------------------


def test_slurm_tasks_of_two_node_instances_are_a_worker_and_its_follower_in_order():
    env = {"SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "6", "SLURM_NTASKS": "7",
           "RLHPC_NODES_PER_INSTANCE": "3"}
    seen = [role_and_rank({**env, "SLURM_PROCID": str(p)}) for p in range(7)]
    assert seen == [("trainer", 0, 1), ("inference", 0, 2), ("follower", 0, 4), ("follower", 1, 4),
                    ("inference", 1, 2), ("follower", 2, 4), ("follower", 3, 4)]
    cfg = Config()
    cfg.inference.nodes_per_instance = 3
    # The follower's own reading of its rank agrees: worker 1's node ranks 1 and 2 are tasks 4 + 1 and 4 + 2.
    assert [follower.follower_place(cfg, f) for f in range(4)] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert [follower.followers_of(cfg, w) for w in range(2)] == [[0, 1], [2, 3]]  # whom each leader waits for
    with pytest.raises(Exception, match="RLHPC_NODES_PER_INSTANCE=4"):
        role_and_rank({**env, "RLHPC_NODES_PER_INSTANCE": "4", "SLURM_PROCID": "1"})


# ---- a follower's waiting, without vLLM ---------------------------------------------------------------------------


def test_a_follower_never_joins_a_record_nobody_renews_and_gives_up_after_the_startup_timeout(tmp_path, monkeypatch,
                                                                                                caplog):
    cfg, run = make_run(tmp_path, startup_timeout_s=3.0)
    write_json(follower.record_path(run, 0), {"id": "dead", "worker": 0, "addr": "127.0.0.1", "port": 1, "nnodes": 2})
    joined = []
    monkeypatch.setattr(follower, "_serve", lambda *a: joined.append(a))
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="rlhpc.infer.follower"):
        follower.run_follower(cfg, ident(run, "follower", 0), run)
    assert joined == []  # a leader that left its record behind (killed) is not joined
    assert 3.0 <= time.monotonic() - t0 < 10
    assert "no leader for worker 0 announced itself" in caplog.text
    assert "inference.startup_timeout_s=3s" in caplog.text


def test_a_follower_waits_for_its_leader_as_long_as_the_trainers_warm_start_takes(tmp_path, monkeypatch):
    cfg, run = make_run(tmp_path, startup_timeout_s=1.0)
    (run.model / "READY").unlink()  # SFT still running: the worker has not started its engine yet
    monkeypatch.setattr(follower, "_serve", lambda *a: pytest.fail("joined without a leader"))
    ended = threading.Timer(4.0, lambda: write_json(run.failed, {"role": "trainer", "rank": 0, "error": "x"}))
    ended.start()
    t0 = time.monotonic()
    follower.run_follower(cfg, ident(run, "follower", 0), run)  # ends with the run, not after 1 s
    assert time.monotonic() - t0 >= 3.5
    ended.join()


def test_a_follower_serves_each_life_of_its_leader_once_and_ends_with_the_run(tmp_path, monkeypatch):
    cfg, run = make_run(tmp_path, startup_timeout_s=60.0)
    path = follower.record_path(run, 0)
    monkeypatch.setattr(follower, "RENEW_S", 0.2)
    served = []

    def serve(cfg, run, rank, record, node_rank, path):  # what _serve does with vLLM: run until the leader is gone
        served.append((record["id"], node_rank))
        while (json.loads(path.read_text()).get("id") if path.exists() else None) == record["id"]:
            time.sleep(0.05)

    monkeypatch.setattr(follower, "_serve", serve)

    def leader_lives() -> None:
        for life in ("first", "second"):  # a leader, then the one its worker's restart brings
            write_json(path, {"id": life, "worker": 0})
            for _ in range(10):
                time.sleep(0.2)
                os.utime(path, (time.time(), time.time() + 1 + _))  # renewed
            path.unlink()
            time.sleep(1.0)
        write_json(run.done, {"step": 1})

    t = threading.Thread(target=leader_lives)
    t.start()
    follower.run_follower(cfg, ident(run, "follower", 0), run)
    t.join()
    assert served == [("first", 1), ("second", 1)]


# ---- the leader's watchdog, without vLLM: a sleeping child process stands in for the engine's processes ----------


@pytest.mark.parametrize("started", [True, False])
def test_the_leaders_watchdog_ends_only_an_engine_start_that_has_not_finished(tmp_path, monkeypatch, started):
    """No follower ever joins (no heartbeat). An engine that is up has all its nodes (vLLM's start waits for them),
    so once the worker says so the watchdog leaves it running past inference.startup_timeout_s, heartbeats or not;
    before that, the timeout kills the engine's processes and the start fails naming the follower."""
    import multiprocessing

    cfg, run = make_run(tmp_path, startup_timeout_s=0.5)
    monkeypatch.setattr(follower, "RENEW_S", 0.1)
    engine = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    try:
        with pytest.raises(RuntimeError, match=r"follower\(s\) \[0\] of worker 0 did not join") if not started \
                else contextlib.nullcontext():
            with follower.leading(cfg, ident(run, "inference", 0), run, "model", 0) as instance:
                engine.start()
                if started:
                    instance.started()
                engine.join(timeout=3.0)  # six times the timeout: the watchdog looked thirty times
                assert engine.is_alive() == started
                if not started:
                    raise OSError("the engine's processes died")  # how a killed start ends in vLLM
        assert not follower.record_path(run, 0).exists()
    finally:
        if engine.is_alive():
            engine.kill()
            engine.join(timeout=10)


# ---- a real instance over two "nodes" -----------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_an_instance_over_two_nodes_matches_transformers_after_an_update_and_its_follower_ends(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm.sh)")
    from rlhpc.infer.engines.vllm import VLLMEngine

    cfg, run = make_run(tmp_path, startup_timeout_s=120.0)
    model_dir = models.build(ModelConfig(), tmp_path / "model")
    env = {**os.environ, "RLHPC_ROLE": "follower", "RLHPC_RANK": "0", "RLHPC_ROLE_SIZE": "1",
           "RLHPC_RUN_DIR": str(run.root), "PYTHONUNBUFFERED": "1"}
    log = run.log_file("follower", 0)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlhpc.role"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    saved = dict(os.environ)  # vLLM sets process environment variables; later tests must not inherit them
    try:
        with follower.leading(cfg, ident(run, "inference", 0), run, str(model_dir), 0) as instance:
            inference = instance.inference
            assert inference.engine_args["nnodes"] == 2 and inference.engine_args["node_rank"] == 0
            engine = VLLMEngine(str(model_dir), "float32", cfg=inference, run_dir=str(run.root))
            instance.started()
            try:
                # New weights reach the follower's half of every layer too: the instance then computes what
                # transformers computes with those weights.
                model = models.load_model(model_dir).eval()
                g = torch.Generator().manual_seed(3)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g))
                engine.update_weights(list(model.state_dict().items()), version=1)
                prompt = [5, 9, 13, 2, 7]
                [[c]] = engine.generate([prompt], n=1, temperature=1.0, max_new_tokens=6, stop_token_ids=[],
                                        greedy=True)
                seq = prompt + list(c.tokens)
                with torch.no_grad():
                    logits = model(torch.tensor([seq])).logits[0, len(prompt) - 1:-1]
                ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
                assert list(c.tokens) == logits.argmax(-1).tolist()
                assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)
            finally:
                engine.close()
        assert not follower.record_path(run, 0).exists()  # the leader's end is announced...
        deadline = time.monotonic() + 60
        while "shutting the model workers down" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log.read_text()
        assert "joining worker 0's instance as node rank 1 of 2" in text
        assert "the leader of worker 0 ended (its record is gone)" in text  # ...and heard
        write_json(run.done, {"step": 0})
        assert proc.wait(timeout=60) == 0, text[-3000:]
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_leader_whose_follower_never_comes_fails_after_the_startup_timeout_naming_it(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm.sh)")
    import multiprocessing

    from rlhpc.infer.engines.vllm import VLLMEngine

    cfg, run = make_run(tmp_path, startup_timeout_s=20.0)  # no follower task was started
    model_dir = models.build(ModelConfig(), tmp_path / "model")
    saved = dict(os.environ)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"follower\(s\) \[0\] of worker 0 did not join its instance within "
                                               r"inference.startup_timeout_s=20s \(see .*follower-0.log"):
            with follower.leading(cfg, ident(run, "inference", 0), run, str(model_dir), 0) as instance:
                VLLMEngine(str(model_dir), "float32", cfg=instance.inference, run_dir=str(run.root))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert time.monotonic() - t0 < 20 + 120  # not torch.distributed's timeout
    assert not follower.record_path(run, 0).exists()
    assert not multiprocessing.active_children()  # the engine's processes were ended


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_an_async_run_over_two_nodes_survives_the_death_of_its_follower_and_ends_cleanly(tmp_path):
    """An asynchronous run whose vLLM instance spans two nodes trains, and survives the follower's death: SIGKILL of
    the follower mid-run breaks the instance (the leader's next collective fails); with inference.max_restarts both
    are started again, meet at the leader's new record, the trained weights reach the instance, and at the end the
    follower leaves and the instance's record is gone."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm.sh)")
    run_dir = tmp_path / "run"
    # Killed after two trained steps, the run trains at most one more step before it waits on the restarted pair
    # (async_level=1): 8 steps leave the restart mid-run and end soon after it.
    steps = 8
    launch = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.launch", f"run_dir={run_dir}", "sft.steps=0", f"trainer.steps={steps}",
         "trainer.groups_per_step=2", "inference.groups_per_batch=2", "algo.group_size=4", "eval.interval=0",
         "launcher.progress=false", "inference.engine=vllm", "inference.tensor_parallel_size=2",
         "inference.nodes_per_instance=2", "inference.num_workers=1", "inference.kv_cache_gb=0.0625",
         "inference.max_restarts=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        log = run_dir / "logs" / "follower-0.log"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not (log.exists() and "model workers up" in log.read_text()):
            assert launch.poll() is None, launch.communicate()[1][-3000:]
            time.sleep(1)
        # Killed after the trainer's first two steps: the restarted pair must get the newest weights while the
        # trainer waits for its rollouts (the run's only worker; before the trainer sent them again at once, the pair
        # waited for an update that only its own rollouts could bring, until trainer.rollout_timeout_s).
        ledger = run_dir / "queue" / "ledger.jsonl"
        while not (ledger.exists() and len(ledger.read_text().splitlines()) >= 2):
            assert launch.poll() is None, launch.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no trained step"
            time.sleep(0.5)
        beat = json.loads((run_dir / "status" / "follower-0.json").read_text())
        os.killpg(beat["pid"], 9)
        out, err = launch.communicate(timeout=800)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, 9)
            launch.wait(timeout=10)
    assert launch.returncode == 0, out[-2000:] + err[-3000:]
    assert "follower-0 exited with code -9; restarting it (1 of inference.max_restarts=1)" in err
    assert json.loads((run_dir / "summary.json").read_text())["rl_steps"] == steps
    text = log.read_text()
    assert "joining worker 0's instance as node rank 1 of 2" in text
    assert text.count("model workers up") == 2, text[-3000:]  # its second life served the restarted leader
    assert "follower 0 (worker 0, node rank 1): the run is done; exiting" in text
    assert f"(weights version {steps})" in (run_dir / "logs" / "inference-0.log").read_text()  # the trained weights
    assert not (run_dir / "rendezvous" / "instance-0.json").exists()


def test_vllm_sockets_of_a_deep_run_directory_go_to_a_temporary_folder_removed_when_the_process_ends(tmp_path):
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rlhpc.infer.engines.vllm import _rpc_folder\n"
        "short = Path(sys.argv[1]) / 'rpc'\n"
        "assert _rpc_folder(short) == short\n"
        "deep = _rpc_folder(Path(sys.argv[1]) / ('d' * 80) / 'rpc')\n"
        "assert deep.is_dir() and len(str(deep)) + 37 <= 107\n"
        "print(deep)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "/tmp"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    made = Path(out.stdout.strip())
    assert made.name.startswith("rlhpc-rpc-") and not made.exists()  # removed at exit
