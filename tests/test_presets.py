"""The real-size presets (conf/exp/{qwen3_30b_a3b,minimax_m2,glm5}.yaml for 8-GPU nodes of 80 GB, their *_h200 twins
for 141 GB H200s, minimax_m2_64k and glm5_32k with context parallelism for longer samples) plan a job that fits: their dry run
on a login node (no GPU, no checkpoint, no sbatch) shows each role's mesh and its memory per GPU and passes the memory
check. GLM-5's inference on 80 GB GPUs does so with vLLM instances over 2 nodes each (docs/scaling.md, "Presets")."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_memory_plan import composed

ROOT = Path(__file__).resolve().parents[1]

# preset -> the GPU memory of its cluster preset, the trainer mesh and the inference layout it must show.
PRESETS = {
    "qwen3_30b_a3b": (80, "dp_shard=16 x ep=1 x cp=1 = 16 rank(s)", "8 worker(s) x [1 engine instance (tp=2)]"),
    "qwen3_30b_a3b_h200": (141, "dp_shard=8 x ep=1 x cp=1 = 8 rank(s)", "8 worker(s) x [1 engine instance (tp=1)]"),
    "minimax_m2": (80, "dp_shard=1 x ep=128 x cp=1 = 128 rank(s)", "8 worker(s) x [1 engine instance (tp=8)]"),
    "minimax_m2_h200": (141, "dp_shard=1 x ep=64 x cp=1 = 64 rank(s)", "8 worker(s) x [1 engine instance (tp=4)]"),
    "minimax_m2_64k": (80, "dp_shard=1 x ep=64 x cp=2 = 128 rank(s)", "8 worker(s) x [1 engine instance (tp=8)]"),
    "glm5": (80, "dp_shard=1 x ep=256 x cp=1 = 256 rank(s)",
             "4 worker(s) x [1 engine instance (tp=16 over 2 nodes, 8 GPUs a node)]"),
    "glm5_h200": (141, "dp_shard=1 x ep=128 x cp=1 = 128 rank(s)", "8 worker(s) x [1 engine instance (tp=8)]"),
    "glm5_32k": (141, "dp_shard=1 x ep=64 x cp=2 = 128 rank(s)", "8 worker(s) x [1 engine instance (tp=8)]"),
}
TRAINER_ROWS = ["parameters", "gradients", "AdamW state (2 moments)", "FSDP unsharded block",
                "FSDP root (embed, head, norm)", "activations (checkpointed)", "logprob head", "total"]
INFERENCE_ROWS = ["weights", "KV cache, one sequence", "usable"]


def dry_run(tmp_path, monkeypatch, capsys, *overrides: str):
    """(exit code, the plan printed, the refusal printed) of `python -m rlhpc.launch <overrides> launcher=slurm
    dry_run=true`, for a checkpoint this machine cannot read (as on a login node)."""
    from rlhpc.launch import launch

    monkeypatch.setenv("RLHPC_MODEL_PATH", str(tmp_path / "checkpoint-on-the-cluster"))
    rc = launch(composed(*overrides, "launcher=slurm", "dry_run=true", f"run_dir={tmp_path}/run"))
    out, err = capsys.readouterr()
    assert not (tmp_path / "run").exists()
    return rc, out, err


def per_gpu(out: str, role: str) -> dict:
    """{row name: GiB} of one role's table in the plan (the first table whose heading starts with `role`)."""
    lines = out[out.index(f"   {role}"):].splitlines()[1:]
    rows = {}
    for line in lines:
        m = re.match(r"    (\S.*?)\s{2,}([\d,.]+) (GiB|MiB)", line)
        if not m:  # the next table, or the end of the plan
            break
        rows[m[1]] = float(m[2].replace(",", "")) / (1024 if m[3] == "MiB" else 1)
    return rows


@pytest.mark.parametrize("exp", list(PRESETS))
def test_each_preset_plans_a_job_that_fits_its_gpus(exp, tmp_path, monkeypatch, capsys):
    gpu_gb, trainer_mesh, inference_mesh = PRESETS[exp]
    rc, out, err = dry_run(tmp_path, monkeypatch, capsys, f"+exp={exp}")
    assert rc == 0, err
    assert f"trainer mesh: {trainer_mesh}, one GPU each" in out
    assert f"inference mesh: {inference_mesh}" in out
    assert f"against cluster.gpu_memory_gb={gpu_gb}" in out
    trainer, inference = per_gpu(out, "trainer rank"), per_gpu(out, "inference engine instance")
    assert set(TRAINER_ROWS) <= set(trainer) and set(INFERENCE_ROWS) <= set(inference)
    assert trainer["total"] <= 0.9 * gpu_gb  # headroom for the CUDA context, NCCL and the allocator
    assert inference["weights"] + inference["KV cache, one sequence"] <= inference["usable"]
    assert "error" not in err


@pytest.mark.parametrize("exp,cluster,passes", [("minimax_m2", "gpu_h200", True), ("glm5_h200", "gpu_example", False)])
def test_a_cluster_on_the_command_line_replaces_the_presets_and_is_checked(exp, cluster, passes, tmp_path,
                                                                           monkeypatch, capsys):
    # An 80 GB sizing runs on 141 GB GPUs too; GLM-5's H200 sizing (109.0 GiB a trainer rank) on 80 GB GPUs is refused.
    rc, out, err = dry_run(tmp_path, monkeypatch, capsys, f"+exp={exp}", f"cluster={cluster}")
    assert f"against cluster.gpu_memory_gb={141 if cluster == 'gpu_h200' else 80}" in out
    if passes:
        assert rc == 0, err
    else:
        assert rc == 2 and "error: this plan cannot run. A trainer rank needs about" in err
        assert "trainer.num_ranks" in err and "cluster.gpu_memory_gb" in err


def test_glm5_on_80_gb_gpus_runs_each_inference_instance_over_two_nodes(tmp_path, monkeypatch, capsys):
    """GLM-5's FP8 weights are 694.6 GiB: over a node's 8 GPUs 86.8 GiB each, more than the 72 GiB an 80 GB GPU
    offers at gpu_memory_utilization 0.9; over 16 GPUs of 2 nodes 43.4 GiB. 4 workers take the 8 inference nodes, a
    leader and a follower each, one task a node."""
    rc, out, err = dry_run(tmp_path, monkeypatch, capsys, "+exp=glm5")
    assert rc == 0, err
    inference = per_gpu(out, "inference engine instance")
    assert inference["weights"] == pytest.approx(43.4, abs=0.05)
    assert "inference engine instance, per GPU of tp=16 over 2 nodes" in out
    assert "component 1 inference 8 node(s) x 1 task(s) = 8 task(s): 4 worker(s) x 2 nodes" in out
    assert "instance 3: nodes 6-7 of component 1, leader on 6, follower on 7" in out
    assert "weights group: 5 members" in out
    script_inference = out.partition("#SBATCH hetjob")[2]
    for line in ("# component 1: inference (8 tasks)", "#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8"):
        assert line in script_inference


def test_the_dry_run_needs_no_slurm_command_and_no_checkpoint(tmp_path):
    # A login node's view: sbatch is not on PATH, the checkpoint folder is not readable; the published shape plans.
    python_only = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=python_only, PYTHONPATH=str(ROOT), RLHPC_MODEL_PATH=str(tmp_path / "nowhere"))
    proc = subprocess.run([sys.executable, "-m", "rlhpc.launch", "+exp=glm5_h200", "launcher=slurm", "dry_run=true",
                           f"run_dir={tmp_path}/run"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "743.91B parameters from the published glm5 shape (model.path is not readable here)" in proc.stdout
    assert "component 0 trainer   16 node(s) x 8 task(s) = 128 rank(s)" in proc.stdout
    assert "DSA indexer scores (transient)" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_minimax_m2_on_h200s_fits_prefill_decode_disaggregation_in_a_node(tmp_path, monkeypatch, capsys):
    # A worker per node: a prefill and a decode instance of tp 4 each, 53.5 GiB of FP8 weights a GPU. GLM-5 cannot do
    # this on 8-GPU nodes of either kind: one instance alone takes all 8 H200s.
    rc, out, err = dry_run(tmp_path, monkeypatch, capsys, "+exp=minimax_m2_h200", "inference.num_workers=4",
                           "inference.engines_per_node=1", "inference.disaggregation.enabled=true",
                           "inference.disaggregation.prefill_tensor_parallel_size=4")
    assert rc == 0, err
    assert "inference mesh: 4 worker(s) x [1 prefill instance (tp=4) + 1 decode instance (tp=4)]" in out
    assert "prefill instance: kv_role kv_producer, tensor_parallel_size 4, GPUs [0, 4)" in out
    assert "decode instance:  kv_role kv_consumer, tensor_parallel_size 4, GPUs [4, 8)" in out
    for role in ("inference prefill instance", "inference decode instance"):
        rows = per_gpu(out, role)
        assert rows["weights"] + rows["KV cache, one sequence"] <= rows["usable"]
