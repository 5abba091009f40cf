"""The typed configuration of a run.

Every key has a type and a default here; Hydra composes `conf/` on top of this schema in struct mode, so an unknown key
or a value of the wrong type fails at composition time with a message that names the key, before any process starts.
`validate` then checks what types cannot (ranges, divisibility) and names the key the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class ModelConfig:
    # A local Hugging Face checkpoint folder; None builds the tiny model below in code (no download).
    path: Optional[str] = None
    name: str = "tiny_qwen3"
    # Architecture of the model built in code when `path` is None (a transformers model_type).
    arch: str = "qwen3"
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    # Extra keys passed to the transformers config of the built model (e.g. MoE sizes).
    extra: Dict[str, Any] = field(default_factory=dict)
    # Vocabulary of the byte-level BPE built in code: 256 bytes + special tokens + this many merges.
    tokenizer_merges: int = 16
    dtype: str = "float32"
    seed: int = 0


@dataclass
class EnvConfig:
    name: str = "reverse_text"
    # A module path to an Environment class ("package.module:Class"); empty means envs/<name>.py.
    cls: str = ""
    # Keyword arguments of the environment's constructor.
    args: Dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 32


@dataclass
class AlgoConfig:
    name: str = "grpo"
    # Completions per task; the advantage baseline is the group mean.
    group_size: int = 8
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Divide advantages by the group's reward std (GRPO); False is Dr. GRPO's choice.
    std_normalize: bool = False
    # Loss normalization: "token" (mean over all loss tokens of the step) or "sequence".
    normalize: str = "token"
    # Extra keyword arguments of the chosen loss.
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    max_grad_norm: float = 1.0
    warmup_steps: int = 0


@dataclass
class SFTConfig:
    # Optimizer steps of the supervised warm start; 0 skips it.
    steps: int = 0
    batch_size: int = 32
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))


@dataclass
class TrainerConfig:
    # RL optimizer steps.
    steps: int = 100
    # Number of trainer ranks (one torch.distributed world; FSDP2 when > 1).
    num_ranks: int = 1
    # Rollout groups (tasks) consumed per optimizer step.
    groups_per_step: int = 16
    # Token budget of one micro-batch (padded tokens); a step accumulates gradients over micro-batches.
    micro_batch_tokens: int = 8192
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Wrap the model with FSDP2 fully_shard (always on when num_ranks > 1).
    fsdp: bool = False
    activation_checkpointing: bool = False
    # Save a checkpoint every this many steps (0: only at the end and on a stop signal).
    checkpoint_interval: int = 0
    # Export the final model in Hugging Face format to checkpoints/final.
    export_final: bool = True
    # Seconds to wait for rollouts of one step before failing with a clear error.
    rollout_timeout_s: float = 600.0
    threads: int = 1


@dataclass
class InferenceConfig:
    engine: str = "hf"
    num_workers: int = 2
    # Tasks per generation call; each call publishes one queue file holding that many groups.
    groups_per_batch: int = 8
    threads: int = 1
    # Seconds a worker waits for the first weights (SFT runs first on the trainer).
    startup_timeout_s: float = 900.0
    # vLLM-only settings (ignored by the transformers engine).
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    max_model_len: int = 4096
    enforce_eager: bool = True
    quantization: Optional[str] = None
    kv_cache_dtype: str = "auto"


@dataclass
class WeightsConfig:
    # "broadcast" (NCCL on GPU, gloo on CPU) or "filesystem" (safetensors snapshot + ready marker).
    transport: str = "broadcast"
    # Flat bucket size of the broadcast, in MiB.
    bucket_mb: int = 64
    # Also write a filesystem snapshot every this many versions, for late joiners (0: initial and final only).
    snapshot_interval: int = 0
    timeout_s: float = 600.0


@dataclass
class QueueConfig:
    # Back-pressure: workers pause while this many steps' worth of fresh groups are already pending.
    max_pending_steps: int = 2
    # Keep the folders of trained steps under queue/retired (otherwise delete them once checkpointed).
    keep_retired: bool = False


@dataclass
class EvalConfig:
    # Held-out evaluation (greedy) every this many RL steps, plus after SFT and at the end; 0: only those two.
    interval: int = 10
    num_tasks: int = 64


@dataclass
class SlurmGroupConfig:
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    mem_gb: int = 4


@dataclass
class ClusterConfig:
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_min: int = 60
    # Seconds before the time limit at which Slurm sends the checkpoint signal.
    grace_s: int = 120
    trainer: SlurmGroupConfig = field(default_factory=SlurmGroupConfig)
    inference: SlurmGroupConfig = field(default_factory=lambda: SlurmGroupConfig(tasks_per_node=2))
    setup: List[str] = field(default_factory=list)
    requeue: bool = True


@dataclass
class LauncherConfig:
    name: str = "local"
    # Wait for the run to end and stream progress (Slurm launchers return the job id at once otherwise).
    wait: bool = True
    # Seconds the launcher waits for the whole run before ending it (0: no limit).
    timeout_s: float = 0.0
    progress: bool = True


@dataclass
class Config:
    # Where everything of this run lives (shared filesystem on a cluster).
    run_dir: str = MISSING
    exp_name: str = "default"
    seed: int = 0
    # How many optimizer steps a rollout may lag behind the step that trains on it (0: on-policy).
    async_level: int = 1
    # Reuse a run directory that holds a finished run (its contents are replaced).
    overwrite: bool = False
    # Print the plan and start nothing.
    dry_run: bool = False
    log_level: str = "INFO"
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="rlhpc_schema", node=Config)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


_CHOICES = {
    "weights.transport": ("broadcast", "filesystem"),
    "inference.engine": ("hf", "vllm"),
    "algo.normalize": ("token", "sequence"),
    "launcher.name": ("local", "slurm", "sbatch"),
    "model.dtype": ("float32", "bfloat16", "float16"),
}


def validate(cfg: Config) -> None:
    """Checks what the types cannot; raises ConfigError naming the key."""

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"config key `{key}`: {msg}")

    for key, choices in _CHOICES.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        need(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")
    need(cfg.async_level >= 0, "async_level", "must be >= 0")
    need(cfg.algo.group_size >= 2, "algo.group_size", "needs at least 2 completions per task for a group baseline")
    need(cfg.algo.temperature > 0, "algo.temperature", "must be > 0 for sampling")
    need(cfg.trainer.steps >= 0, "trainer.steps", "must be >= 0")
    need(cfg.trainer.num_ranks >= 1, "trainer.num_ranks", "must be >= 1")
    need(cfg.inference.num_workers >= 1, "inference.num_workers", "must be >= 1")
    need(cfg.inference.groups_per_batch >= 1, "inference.groups_per_batch", "must be >= 1")
    need(
        cfg.trainer.groups_per_step % cfg.inference.groups_per_batch == 0,
        "trainer.groups_per_step",
        f"{cfg.trainer.groups_per_step} must be a multiple of inference.groups_per_batch "
        f"({cfg.inference.groups_per_batch}): a step claims whole queue files",
    )
    need(
        cfg.trainer.groups_per_step % cfg.trainer.num_ranks == 0,
        "trainer.groups_per_step",
        f"{cfg.trainer.groups_per_step} must be divisible by trainer.num_ranks ({cfg.trainer.num_ranks})",
    )
    need(cfg.queue.max_pending_steps >= 1, "queue.max_pending_steps", "must be >= 1")
    need(cfg.eval.num_tasks >= 1, "eval.num_tasks", "must be >= 1")
    need(cfg.weights.bucket_mb >= 1, "weights.bucket_mb", "must be >= 1")
    need(cfg.env.max_new_tokens >= 1, "env.max_new_tokens", "must be >= 1")
    need(
        cfg.cluster.grace_s < cfg.cluster.time_min * 60,
        "cluster.grace_s",
        f"{cfg.cluster.grace_s}s leaves no time to run within cluster.time_min={cfg.cluster.time_min}",
    )


def to_typed(cfg: DictConfig | Dict[str, Any]) -> Config:
    """Merges a plain or composed config onto the schema and returns the typed object (errors name the key)."""
    schema = OmegaConf.structured(Config)
    merged = OmegaConf.merge(schema, cfg)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def save(cfg: Config, path: Path) -> None:
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def load(run_dir: str | Path) -> Config:
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is `{run_dir}` a run directory written by rlhpc.launch?")
    return to_typed(OmegaConf.load(path))
