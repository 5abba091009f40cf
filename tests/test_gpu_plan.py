"""Where each role computes on GPUs, checked without one: the Slurm job a GPU cluster preset asks for, the local
launcher's choice per process, and how a Slurm task learns its GPU. What ran on a real GPU is in docs/gpu.md."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlhpc.cluster.local_launcher import local_gpus

SMALL = ["+exp=reverse_text", "sft.steps=5", "eval.num_tasks=8", "eval.interval=0", "model.hidden_size=32",
         "model.intermediate_size=64", "model.num_layers=1"]
# conf/cluster/gpu_example.yaml: 2 trainer nodes and 4 inference nodes of 8 GPUs each.
GPU_CLUSTER = ["cluster=gpu_example", "trainer.num_ranks=16", "inference.num_workers=8", "inference.engine=vllm",
               "inference.tensor_parallel_size=4", "inference.engines_per_node=2"]


def composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from rlhpc.config import schema as config_mod
    from rlhpc.config.schema import CONF_DIR

    config_mod.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return config_mod.to_typed(compose(config_name="config", overrides=[*SMALL, "run_dir=/tmp/x", *overrides]))


def components(script: str) -> tuple[str, str]:
    trainer, _, inference = script.partition("#SBATCH hetjob")
    return trainer, inference.partition("\nexport ")[0]


def test_each_component_of_a_gpu_job_requests_its_nodes_gpus():
    from rlhpc.cluster.hetjob import make_plan, render_script

    trainer, inference = components(render_script(make_plan(composed(*GPU_CLUSTER))))
    assert "#SBATCH --ntasks-per-node=8" in trainer and "#SBATCH --gpus-per-node=8" in trainer
    assert "#SBATCH --ntasks-per-node=2" in inference and "#SBATCH --gpus-per-node=8" in inference
    assert "--gpus-per-task" not in trainer + inference  # a worker with tensor parallelism needs several GPUs


def test_every_task_takes_its_own_gpu_by_its_rank_on_the_node():
    from rlhpc.cluster.hetjob import make_plan, render_script

    script = render_script(make_plan(composed(*GPU_CLUSTER)))
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "export LOCAL_RANK=$SLURM_LOCALID" in srun
    assert "takes its own by SLURM_LOCALID" in script


def test_the_plan_a_user_reads_names_each_roles_gpus(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlhpc.launch", *SMALL, *GPU_CLUSTER, "launcher=slurm",
                           "dry_run=true", f"run_dir={run_dir}"], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "GPUs: trainer rank -> cuda:LOCAL_RANK (1 of 8 per node), NCCL" in proc.stdout
    assert "GPUs: inference worker -> 4 GPU(s) from LOCAL_RANK x 4 (of 8 per node)" in proc.stdout
    assert "#SBATCH --gpus-per-node=8" in proc.stdout
    assert not run_dir.exists()


def test_an_instance_over_two_nodes_takes_every_gpu_of_each():
    from rlhpc.cluster.hetjob import describe, make_plan, render_script

    cfg = composed("cluster=gpu_example", "trainer.num_ranks=16", "inference.num_workers=2", "inference.engine=vllm",
                   "inference.tensor_parallel_size=16", "inference.nodes_per_instance=2")
    plan = make_plan(cfg)
    _, inference = components(render_script(plan))
    assert "#SBATCH --nodes=4" in inference and "#SBATCH --ntasks-per-node=1" in inference
    assert "#SBATCH --gpus-per-node=8" in inference
    assert "GPUs: inference instance -> tp 16 over 2 nodes, all 8 GPUs of each of its nodes (one task a node)" \
        in describe(plan, cfg, "slurm")


def test_a_cpu_only_job_says_nothing_about_gpus():
    from rlhpc.cluster.hetjob import describe, make_plan, render_script

    cfg = composed()
    plan = make_plan(cfg)
    assert "gpus" not in render_script(plan) and "GPUs:" not in describe(plan, cfg, "slurm")


def test_a_slurm_task_started_by_hand_gets_local_rank_from_slurm_localid(monkeypatch):
    from rlhpc import role

    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "3",
           "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "1",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "localhost", "RLHPC_RUN_DIR": "/shared/run"}
    for key in ("RLHPC_ROLE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")  # recorded, so that the test's own LOCAL_RANK is undone afterwards
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ident = role.identity()
    assert (ident.role, ident.rank) == ("trainer", 1)
    assert os.environ["LOCAL_RANK"] == "1"


def test_a_local_rank_set_by_the_job_script_is_kept(monkeypatch):
    from rlhpc import role

    monkeypatch.delenv("RLHPC_ROLE", raising=False)
    for key, value in {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                       "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "1",
                       "SLURM_JOB_NODELIST_HET_GROUP_0": "localhost", "RLHPC_RUN_DIR": "/shared/run",
                       "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(key, value)
    role.identity()
    assert os.environ["LOCAL_RANK"] == "3"


def local_cfg(trainer_ranks: int = 1, tp: int = 1):
    off = SimpleNamespace(enabled=False, prefill_tensor_parallel_size=0)
    return SimpleNamespace(trainer=SimpleNamespace(num_ranks=trainer_ranks),
                           inference=SimpleNamespace(tensor_parallel_size=tp, disaggregation=off))


def test_locally_each_trainer_rank_takes_the_gpu_of_its_rank():
    gpus = ["0", "1", "2", "3"]
    assert [local_gpus(local_cfg(2), "trainer", r, gpus) for r in range(2)] == [{"LOCAL_RANK": "0"},
                                                                               {"LOCAL_RANK": "1"}]


def test_locally_inference_workers_take_the_gpus_after_the_trainers():
    gpus = ["0", "1", "2", "3", "4", "5"]
    assert local_gpus(local_cfg(2), "inference", 1, gpus) == {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "0"}
    assert local_gpus(local_cfg(2, tp=2), "inference", 1, gpus) == {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_RANK": "0"}


def test_locally_a_user_chosen_device_list_is_respected():
    assert local_gpus(local_cfg(1), "inference", 0, ["5", "7"]) == {"CUDA_VISIBLE_DEVICES": "7", "LOCAL_RANK": "0"}


def test_on_one_gpu_the_trainer_and_the_worker_share_it():
    assert local_gpus(local_cfg(1), "trainer", 0, ["0"]) == {"LOCAL_RANK": "0"}
    assert local_gpus(local_cfg(1), "inference", 0, ["0"]) == {"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "0"}


def test_without_gpus_the_launcher_sets_nothing():
    assert local_gpus(local_cfg(1), "trainer", 0, []) == {}
    assert local_gpus(local_cfg(1), "inference", 0, []) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_the_hf_engine_stays_on_the_cpu_without_gpus():
    from rlhpc.infer.engines.hf import local_device

    assert local_device().type == "cpu"
