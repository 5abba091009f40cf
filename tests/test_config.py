"""Config: composition on the typed schema, and errors that name the key before anything starts."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

import rlhpc.algo  # noqa: F401  (registers the algorithms' config checks)
from rlhpc.config import schema as config_mod
from rlhpc.config.schema import CONF_DIR
from rlhpc.config.schema import ConfigError, to_typed, validate


def composed(*overrides):
    config_mod.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return to_typed(compose(config_name="config", overrides=list(overrides)))


def test_the_quick_start_experiment_composes_to_typed_values():
    cfg = composed("+exp=reverse_text", "run_dir=/tmp/x")
    assert cfg.exp_name == "reverse_text"
    assert cfg.env.name == "reverse_text" and cfg.model.arch == "qwen3"
    assert isinstance(cfg.trainer.optim.lr, float) and cfg.sft.steps > 0
    validate(cfg)


def test_an_unknown_key_fails_at_composition_naming_the_key():
    with pytest.raises(Exception, match="trainer.stepz"):
        composed("+exp=reverse_text", "trainer.stepz=3")


def test_a_value_of_the_wrong_type_fails_naming_the_key():
    with pytest.raises(Exception, match="trainer.steps"):
        composed("trainer.steps=many")


def test_a_value_out_of_range_fails_validation_naming_the_key():
    cfg = composed("run_dir=/tmp/x", "algo.group_size=1")
    with pytest.raises(ConfigError, match="algo.group_size"):
        validate(cfg)


def test_a_batch_that_does_not_split_into_whole_queue_files_is_refused():
    cfg = composed("run_dir=/tmp/x", "trainer.groups_per_step=12", "inference.groups_per_batch=8")
    with pytest.raises(ConfigError, match="trainer.groups_per_step"):
        validate(cfg)


def test_an_unknown_choice_names_the_key_and_the_choices():
    cfg = composed("run_dir=/tmp/x", "weights.transport=carrier_pigeon")
    with pytest.raises(ConfigError, match="weights.transport.*broadcast, filesystem"):
        validate(cfg)


@pytest.mark.parametrize("override,key", [
    ("trainer.param_dtype=float16", r"trainer.param_dtype.*auto, float32, bfloat16"),
    ("trainer.master_dtype=float8_e4m3fn", r"trainer.master_dtype.*float32, bfloat16"),
])
def test_an_unknown_trainer_dtype_names_the_key_and_the_choices(override, key):
    with pytest.raises(ConfigError, match=key):
        validate(composed("run_dir=/tmp/x", override))


def test_weights_loaded_in_place_are_refused_beside_the_http_endpoint_naming_the_key():
    # An HTTP request between two buckets of an update would see part-loaded weights.
    cfg = composed("run_dir=/tmp/x", "weights.receive=in_place", "inference.serve=true")
    with pytest.raises(ConfigError, match="weights.receive.*inference.serve"):
        validate(cfg)
    validate(composed("run_dir=/tmp/x", "weights.receive=in_place"))
    # vLLM reloading the whole model (tensor parallelism, quantization, reload or file) cannot load bucket by bucket.
    with pytest.raises(ConfigError, match="weights.receive.*load_weights"):
        validate(composed("run_dir=/tmp/x", "weights.receive=in_place", "inference=vllm",
                          "inference.tensor_parallel_size=2"))
    with pytest.raises(ConfigError, match="weights.receive.*buffered, in_place"):
        validate(composed("run_dir=/tmp/x", "weights.receive=inplace"))


def test_float32_compute_over_bfloat16_master_weights_is_refused_naming_the_key():
    cfg = composed("run_dir=/tmp/x", "trainer.param_dtype=float32", "trainer.master_dtype=bfloat16")
    with pytest.raises(ConfigError, match="trainer.param_dtype"):
        validate(cfg)
    validate(composed("run_dir=/tmp/x", "trainer.param_dtype=bfloat16", "trainer.master_dtype=float32"))


def test_the_launch_command_fails_on_a_wrong_key_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", f"run_dir={run_dir}", "trainer.lr=0.1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "trainer.lr" in proc.stderr
    assert not run_dir.exists()  # nothing was started or written


def test_a_saved_config_loads_back_identically(tmp_path):
    cfg = composed("+exp=reverse_text", f"run_dir={tmp_path}", "seed=7")
    config_mod.save(cfg, tmp_path / "config.yaml")
    assert config_mod.load(tmp_path) == cfg


def test_the_glm5_preset_plans_fp8_and_prefill_decode_disaggregation_without_submitting(tmp_path):
    env = dict(__import__("os").environ, RLHPC_MODEL_PATH=str(tmp_path / "glm5-checkpoint"))
    proc = subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", "+exp=glm5", "launcher=slurm", "cluster=gpu_example", "dry_run=true",
         f"run_dir={tmp_path / 'run'}",
         # A layout the preset does not use (it has no room for P/D: docs/scaling.md): 16 ranks without expert
         # parallelism, a prefill and a decode instance of tp 4 per worker.
         "trainer.num_ranks=16", "trainer.ep=1", "trainer.groups_per_step=64", "cluster.trainer.nodes=2",
         "inference.num_workers=4", "cluster.inference.nodes=4", "inference.tensor_parallel_size=4",
         "inference.disaggregation.enabled=true", "inference.disaggregation.prefill_tensor_parallel_size=4",
         "inference.nodes_per_instance=1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    # The plan is printed, then refused: 744B parameters do not fit 80 GiB GPUs without expert parallelism
    # (tests/test_memory_plan.py has the arithmetic).
    assert proc.returncode == 2, proc.stderr
    assert "this plan cannot run" in proc.stderr and "trainer.num_ranks" in proc.stderr
    assert "weights fp8, kv cache fp8" in proc.stdout and "prefill/decode disaggregation" in proc.stdout
    # The P/D layout: a prefill and a decode instance per worker, on their own GPUs, joined by NIXL.
    assert "prefill instance: kv_role kv_producer, tensor_parallel_size 4, GPUs [0, 4)" in proc.stdout
    assert "decode instance:  kv_role kv_consumer, tensor_parallel_size 4, GPUs [4, 8)" in proc.stdout
    assert "KV connector: NixlConnector" in proc.stdout
    assert "16 rank(s)" in proc.stdout and "#SBATCH hetjob" in proc.stdout
    assert not (tmp_path / "run").exists()  # nothing submitted, nothing written


@pytest.mark.parametrize("overrides,says", [
    (["trainer.num_ranks=4", "trainer.ep=3"], "must divide trainer.num_ranks"),
    (["trainer.num_ranks=2", "trainer.ep=2"], "needs a MoE model"),  # the default model is dense
    (["model=tiny_qwen3_moe", "trainer.num_ranks=16", "trainer.ep=2", "trainer.groups_per_step=16"],
     "8 routed experts must divide evenly"),
    (["trainer.ep=0"], "must be >= 1"),
])
def test_expert_parallelism_that_cannot_work_is_refused_naming_trainer_ep(overrides, says):
    cfg = composed("run_dir=/tmp/x", *overrides)
    with pytest.raises(ConfigError, match=rf"trainer\.ep`: .*{says}"):
        validate(cfg)


def test_packing_and_compile_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match=r"trainer\.packing`: 'rows' is not one of shared_prefix, padded"):
        validate(composed("run_dir=/tmp/x", "trainer.packing=rows"))
    with pytest.raises(ConfigError, match=r"trainer\.compile`: is not tested with expert parallelism"):
        validate(composed("run_dir=/tmp/x", "model=tiny_qwen3_moe", "trainer.num_ranks=2", "trainer.ep=2",
                          "trainer.compile=true"))


def test_expert_parallelism_over_the_ranks_of_a_moe_model_is_accepted():
    validate(composed("run_dir=/tmp/x", "model=tiny_glm5", "trainer.num_ranks=4", "trainer.ep=2",
                      "trainer.groups_per_step=16"))


def test_the_memory_plan_gathers_only_a_ranks_share_of_the_routed_experts_with_expert_parallelism(tmp_path,
                                                                                                   monkeypatch):
    """GLM-5 on 16 ranks: one MoE block's 256 routed experts (9.7B parameters) are all-gathered on every rank without
    expert parallelism; with trainer.ep=16 a rank gathers 16 of them and the rest of the block."""
    from rlhpc.cluster.memory import plan

    monkeypatch.setenv("RLHPC_MODEL_PATH", str(tmp_path / "glm5-checkpoint"))
    rows = {}
    for ep in (1, 16):
        cfg = composed("+exp=glm5", "cluster=gpu_example", f"run_dir={tmp_path}/run", f"trainer.ep={ep}",
                       "trainer.num_ranks=16", "trainer.groups_per_step=64", "cluster.trainer.nodes=2")
        rows[ep] = {line.split("  ")[2].strip(): line for line in plan(cfg).lines if line.startswith("    ")}
    assert "trainer mesh: dp_shard=1 x ep=16 x cp=1 = 16 rank(s)" in "\n".join(plan(cfg).lines)
    assert "routed experts (1/16)" in rows[16] and "routed experts (1/16)" not in rows[1]
    assert "FSDP root (embed, head, norm)" in rows[16]
    gib = {ep: float(rows[ep]["FSDP unsharded block"].split()[3]) for ep in rows}
    assert gib[16] < gib[1] / 10  # the block without its routed experts


# An instance over two nodes of a vLLM engine, as +exp=glm5 has it on 8-GPU nodes.
TWO_NODE_INSTANCE = ["inference=vllm", "inference.tensor_parallel_size=16", "inference.nodes_per_instance=2",
                     "cluster.inference.gpus_per_node=8"]


def test_an_instance_over_whole_nodes_of_a_vllm_engine_is_accepted():
    validate(composed("run_dir=/tmp/x", *TWO_NODE_INSTANCE))


@pytest.mark.parametrize("overrides,says", [
    (["inference.nodes_per_instance=0"], r"inference\.nodes_per_instance`: must be >= 1"),
    (["inference.engine=hf"], r"inference\.nodes_per_instance`: 2 needs inference\.engine=vllm"),
    (["inference.nodes_per_instance=3"],
     r"inference\.nodes_per_instance`: 3 nodes do not split inference\.tensor_parallel_size=16 evenly"),
    (["inference.disaggregation.enabled=true"],
     r"inference\.disaggregation\.enabled`: prefill/decode disaggregation with instances over several nodes"),
    (["inference.engines_per_node=2"], r"inference\.engines_per_node`: must be 1 when an instance spans nodes"),
    (["cluster.inference.gpus_per_node=4"],
     r"inference\.tensor_parallel_size`: 16 over inference\.nodes_per_instance=2 nodes is 8 GPUs a node, but a "
     r"node has 4 \(cluster\.inference\.gpus_per_node\)"),
])
def test_an_instance_over_nodes_that_cannot_work_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=says):
        validate(composed("run_dir=/tmp/x", *TWO_NODE_INSTANCE, *overrides))


# Values that passed validation and then stopped the run with a traceback, or ran on silently meaning nothing.
@pytest.mark.parametrize("override,key,says", [
    ("trainer.groups_per_step=0", "trainer.groups_per_step", "must be >= 1"),
    ("trainer.threads=0", "trainer.threads", "must be >= 1"),
    ("inference.threads=0", "inference.threads", "must be >= 1"),
    ("sft.batch_size=0", "sft.batch_size", "must be >= 1"),
    ("sft.steps=-1", "sft.steps", "must be >= 0"),
    ("sft.validation_tasks=0", "sft.validation_tasks", "must be >= 1"),
    ("trainer.optim.lr=-1", "trainer.optim.lr", "finite number >= 0"),
    ("trainer.optim.lr=nan", "trainer.optim.lr", "finite number >= 0"),
    ("sft.optim.lr=inf", "sft.optim.lr", "finite number >= 0"),
    ("trainer.optim.max_grad_norm=-1", "trainer.optim.max_grad_norm", "must be > 0"),
    ("trainer.optim.max_grad_norm=0", "trainer.optim.max_grad_norm", "must be > 0"),
    ("sft.optim.max_grad_norm=nan", "sft.optim.max_grad_norm", "must be > 0"),
    ("trainer.optim.beta2=1", "trainer.optim.beta2", r"in \[0, 1\)"),
    ("trainer.optim.weight_decay=-0.1", "trainer.optim.weight_decay", "finite number >= 0"),
    ("trainer.optim.warmup_steps=-1", "trainer.optim.warmup_steps", "must be >= 0"),
    ("trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens", "must be >= 1"),
    ("trainer.logprob_chunk_tokens=-1", "trainer.logprob_chunk_tokens", r"must be >= 0 \(0: the full logits\)"),
    ("trainer.checkpoint_interval=-1", "trainer.checkpoint_interval", "must be >= 0"),
    ("trainer.rollout_timeout_s=0", "trainer.rollout_timeout_s", "must be > 0"),
    ("inference.startup_timeout_s=-1", "inference.startup_timeout_s", "must be > 0"),
    ("inference.max_model_len=0", "inference.max_model_len", "must be >= 1"),
    ("inference.tensor_parallel_size=0", "inference.tensor_parallel_size", "must be >= 1"),
    ("inference.gpu_memory_utilization=1.5", "inference.gpu_memory_utilization", r"in \(0, 1\]"),
    ("inference.kv_cache_gb=-1", "inference.kv_cache_gb", "must be >= 0"),
    ("inference.max_num_seqs=0", "inference.max_num_seqs", "must be >= 1"),
    ("inference.engines_per_node=0", "inference.engines_per_node", "must be >= 1"),
    ("weights.timeout_s=-1", "weights.timeout_s", "must be > 0"),
    ("weights.snapshot_interval=-1", "weights.snapshot_interval", "must be >= 0"),
    ("eval.interval=-1", "eval.interval", "must be >= 0"),
    ("algo.temperature=inf", "algo.temperature", "finite number > 0"),
    ("algo.temperature=nan", "algo.temperature", "finite number > 0"),
    ("algo.ref_kl_coef=inf", "algo.ref_kl_coef", "must be finite and >= 0"),
    ("algo.inference_kl_coef=inf", "algo.inference_kl_coef", "must be finite and >= 0"),
    ("algo.length_penalty=inf", "algo.length_penalty", "must be finite and >= 0"),
    ("env.sandbox_limits.cpu_s=-1", "env.sandbox_limits.cpu_s", "must be >= 1"),
    ("env.sandbox_limits.memory_mb=0", "env.sandbox_limits.memory_mb", "must be >= 1"),
    ("env.sandbox_limits.processes=0", "env.sandbox_limits.processes", "must be >= 1"),
    ("env.sandbox_limits.file_size_mb=-1", "env.sandbox_limits.file_size_mb", "must be >= 0"),
    ("env.sandbox_limits.wall_s=0", "env.sandbox_limits.wall_s", "must be > 0"),
    ("launcher.timeout_s=-1", "launcher.timeout_s", "must be >= 0"),
    ("cluster.gpu_memory_gb=-80", "cluster.gpu_memory_gb", "must be >= 0"),
    ("model.hidden_size=0", "model.hidden_size", "must be >= 1"),
    ("model.num_layers=0", "model.num_layers", "must be >= 1"),
    ("model.intermediate_size=0", "model.intermediate_size", "must be >= 1"),
    ("model.num_kv_heads=0", "model.num_kv_heads", "must be >= 1"),
    ("model.max_position_embeddings=0", "model.max_position_embeddings", "must be >= 1"),
    ("model.num_heads=3", "model.num_heads", r"3 must be a multiple of model.num_kv_heads \(2\)"),
    ("model.hidden_size=12", "model.hidden_size", r"12 // model.num_heads \(4\) = 3 is each head's size"),
    ("model.tokenizer_merges=-1", "model.tokenizer_merges", "must be >= 0"),
])
def test_a_value_outside_its_range_is_refused_naming_the_key_and_the_range(override, key, says):
    cfg = composed("+exp=reverse_text", "run_dir=/tmp/x", override)
    with pytest.raises(ConfigError, match=rf"^config key `{key}`: .*{says}"):
        validate(cfg)


@pytest.mark.parametrize("override", [
    "trainer.logprob_chunk_tokens=0",  # the full logits
    "trainer.checkpoint_interval=0",  # only at the end and on a stop signal
    "eval.interval=0",  # only after SFT and at the end
    "weights.snapshot_interval=0",  # initial and final only
    "inference.kv_cache_gb=0",  # sized by the engine
    "launcher.timeout_s=0",  # no limit
    "sft.steps=0",  # no warm start
    "trainer.optim.lr=0",  # weights that never change: a control run
    "trainer.optim.lr=1e9",  # odd, but a learning rate
    "trainer.optim.max_grad_norm=inf",  # no clipping
    "env.sandbox_limits.file_size_mb=0",  # no file writes
    "model.hidden_size=130",  # heads of 32 (130 // 4) need not tile the hidden size
])
def test_a_boundary_value_with_a_documented_meaning_is_accepted(override):
    validate(composed("+exp=reverse_text", "run_dir=/tmp/x", override))


def test_the_sizes_of_a_checkpoints_model_are_its_own_config_not_the_model_keys():
    # model.path brings its config.json (checked by preflight): the keys of the model built in code are not used.
    validate(composed("+exp=reverse_text", "run_dir=/tmp/x", "model.path=/checkpoint", "model.num_layers=0",
                      "model.num_heads=3"))


def test_a_model_of_no_layers_is_refused_by_the_dry_run_in_one_line(tmp_path):
    # It used to reach the memory plan (rlhpc/cluster/memory.py) and end in a traceback there.
    proc = subprocess.run(
        [sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", f"run_dir={tmp_path / 'run'}", "dry_run=true",
         "model.num_layers=0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config key `model.num_layers`: must be >= 1", proc.stderr
    assert not (tmp_path / "run").exists()
