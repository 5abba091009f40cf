"""The typed configuration of a run.

Every key has a type and a default here; Hydra composes `conf/` on top of this schema in struct mode, so an unknown key
or a value of the wrong type fails at composition time with a message that names the key, before any process starts.
`validate` then checks what types cannot (ranges, divisibility) and names the key the same way.

The comment right above a field is that key's meaning: `--help` of every command and docs/commands.md show it with the
key's type and default (rlhpc.commands), and tests/test_commands.py fails on a key without one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from rlhpc.config import shipped

# The Hydra config folder: the repository's conf/, or its copy in an installed wheel (rlhpc.config.shipped);
# RLHPC_CONF_DIR replaces it. Folders of your own add to it: `--config-dir DIR` or `hydra.searchpath=[file://DIR]`.
CONF_DIR = Path(os.environ.get("RLHPC_CONF_DIR") or shipped.folder("conf"))


@dataclass
class ModelConfig:
    """The policy: a Hugging Face checkpoint, or a small model built in code from the sizes below."""

    # A local Hugging Face checkpoint folder; null builds the tiny model of the keys below in code (no download).
    path: Optional[str] = None
    # The model's name in logs, plans and the served model's id (when `path` is null); a preset's name.
    name: str = "tiny_qwen3"
    # Architecture of the model built in code when `path` is null (a transformers model_type).
    arch: str = "qwen3"
    # The built model's width (each head has hidden_size / num_heads dimensions unless model.extra sets head_dim).
    hidden_size: int = 128
    # The built model's MLP width.
    intermediate_size: int = 384
    # The built model's decoder blocks.
    num_layers: int = 4
    # The built model's attention (query) heads.
    num_heads: int = 4
    # The built model's key/value heads (grouped-query attention); divides num_heads.
    num_kv_heads: int = 2
    # The built model's context: the longest sequence (prompt and every turn) it takes, in tokens.
    max_position_embeddings: int = 256
    # Extra keys passed to the transformers config of the built model (e.g. MoE sizes).
    extra: Dict[str, Any] = field(default_factory=dict)
    # Vocabulary of the byte-level BPE built in code: 256 bytes + special tokens + this many merges.
    tokenizer_merges: int = 16
    # Extra text the built tokenizer learns its merges from (besides the chat roles), e.g. a tool call's JSON.
    tokenizer_corpus: List[str] = field(default_factory=list)
    # Extra tokens of the built tokenizer, each one id (e.g. "<tool_call>", "</tool_call>" for tool-using tasks).
    tokenizer_added_tokens: List[str] = field(default_factory=list)
    # Dtype of the weights the workers generate with, the trainer sends and exports ("float32", "bfloat16",
    # "float16"); the trainer's own dtypes are trainer.param_dtype and trainer.master_dtype.
    dtype: str = "float32"
    # Seed of the built model's initial weights.
    seed: int = 0


@dataclass
class SandboxLimitsConfig:
    """Limits of one sandboxed program (rlhpc.env.sandbox.Limits)."""

    # CPU seconds (RLIMIT_CPU); past them the program is killed.
    cpu_s: int = 10
    # Address space in MiB (RLIMIT_AS: a larger allocation fails); also the size of its private /tmp.
    memory_mb: int = 512
    # Processes and threads (RLIMIT_NPROC, counted per program).
    processes: int = 64
    # Largest file it may write, in MiB (RLIMIT_FSIZE; 0: no file writes).
    file_size_mb: int = 16
    # Wall-clock seconds, after which its whole process tree is killed.
    wall_s: float = 10.0


@dataclass
class EnvConfig:
    """The environment that turns tasks into episodes and rewards (docs/environments.md)."""

    # The environment: envs/<name>.py (conf/env/<name>.yaml sets its arguments).
    name: str = "reverse_text"
    # A module path to an Environment class ("package.module:Class"); empty means envs/<name>.py.
    cls: str = ""
    # Keyword arguments of the environment's constructor.
    args: Dict[str, Any] = field(default_factory=dict)
    # Tokens the policy may sample in one turn.
    max_new_tokens: int = 32
    # Benchmarks: the end-of-sequence token does not end a turn, so every completion runs to max_new_tokens and runs
    # that differ in anything else generate and train on the same number of tokens (benchmarks/async_overlap.py).
    # rlhpc's own episodes only: a verifiers environment keeps its own stops.
    ignore_eos: bool = False
    # Policy turns per episode; 0: the environment's own `max_turns` (1 for single-turn environments).
    max_turns: int = 0
    # Tokens of a whole episode (prompt, every turn, every environment reply); 0: no budget beyond the turns.
    max_episode_tokens: int = 0
    # How tool calls are parsed from the policy's text: "hermes" (Qwen3/Hermes <tool_call>{json}</tool_call>) or an
    # import path "package.module:function" (text -> list of rlhpc.env.tools.ToolCall, raising ToolCallError).
    tool_parser: str = "hermes"
    # Processes that run rewards, tools and environment replies beside generation (0: inline, no timeouts; tests).
    pool_processes: int = 2
    # Wall-clock limit of one reward, tool or reply call; past it the call's process is killed and replaced.
    call_timeout_s: float = 30.0
    # Reward of a sample whose reward or reply raised, timed out or was not finite.
    error_reward: float = 0.0
    # More failed samples than this fraction of a batch stops the run, naming the environment and the first error.
    max_error_fraction: float = 0.5
    # Where model code runs: "bwrap" (bubblewrap sandbox) or "unsandboxed" (only if you trust the code; docs/sandbox.md).
    sandbox: str = "bwrap"
    sandbox_limits: SandboxLimitsConfig = field(default_factory=lambda: SandboxLimitsConfig())


@dataclass
class AlgoConfig:
    """The RL algorithm: the policy loss, its corrections and the advantages (docs/algorithms.md)."""

    # The policy loss: a registered name (rlhpc.algo.loss.names(): grpo, dr_grpo, dapo, gspo, cispo, aipo) or an import
    # path "package.module:function". docs/algorithms.md gives each formula.
    name: str = "grpo"
    # Completions per task; the advantage baseline is computed within the group.
    group_size: int = 8
    # Sampling temperature of the workers' generations; the trainer's logprobs divide the logits by it too.
    temperature: float = 1.0
    # Clip range of the importance ratio: [1 - clip_low, 1 + clip_high] (GRPO/DAPO/GSPO: the PPO clip; CISPO: the
    # bounds of its stop-gradient weight).
    clip_low: float = 0.2
    # The upper end of that range (DAPO's clip-higher raises it above clip_low: 0.28).
    clip_high: float = 0.2
    # Divide advantages by the group's reward std (GRPO); False is Dr. GRPO's choice.
    std_normalize: bool = False
    # Advantage baseline: "mean" (the group mean, GRPO) or "loo" (the mean of the other completions, RLOO).
    baseline: str = "mean"
    # Length penalty subtracted from the reward: length_penalty * completion_tokens / env.max_new_tokens (0: off).
    length_penalty: float = 0.0
    # DAPO overlong shaping: over the last `overlong_buffer` fraction of env.max_new_tokens the reward falls linearly,
    # reaching -1 at the limit (0: off; DAPO used 4096 of 20480 tokens, 0.2).
    overlong_buffer: float = 0.0
    # DAPO dynamic sampling: workers drop groups whose rewards are all equal (zero advantage, no learning signal).
    dynamic_sampling: bool = False
    # Loss normalization: "token" (mean over all loss tokens of the step), "sequence" (mean over sequences of each
    # sequence's token mean) or "constant" (token sum / (sequences * env.max_new_tokens), Dr. GRPO).
    normalize: str = "token"
    # Off-policy correction for the trainer/inference mismatch and staleness: a stop-gradient importance weight
    # pi/mu on every token, per "token" or per "sequence" (product of the token ratios); "none" turns it off.
    is_level: str = "none"
    # "truncate": clamp the weight into [is_low, is_high]; "mask": zero it outside [is_low, is_high].
    is_mode: str = "truncate"
    # Lower bound of the off-policy importance weight (algo.is_mode).
    is_low: float = 0.0
    # Upper bound of the off-policy importance weight (algo.is_mode).
    is_high: float = 2.0
    # AIPO: cap delta of its per-token truncated importance weight min(pi/mu, delta).
    aipo_delta: float = 2.0
    # Weight of the k3 estimate of KL(pi || reference) per token (needs reference logprobs; 0: off).
    ref_kl_coef: float = 0.0
    # Weight of the squared log-ratio to the inference policy, 0.5 * (log pi - log mu)^2, per token (0: off).
    inference_kl_coef: float = 0.0
    # MoE router load balancing: weight of transformers' Switch-Transformer auxiliary loss (the model config's
    # `router_aux_loss_coef`, e.g. 0.001 for Qwen3-MoE) in the RL loss, over the whole step's loss tokens on all ranks
    # (rlhpc/train/experts.py RouterBalance; costs one extra no-grad forward of the step). 0: off, as most RL of MoE
    # models runs; GLM-5 balances its experts without such a loss and refuses it.
    router_aux_loss_coef: float = 0.0
    # Extra keyword arguments of a user-supplied loss.
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    """AdamW of one phase of training (trainer.optim: RL; sft.optim: the warm start)."""

    # Learning rate (after the warmup).
    lr: float = 1e-3
    # AdamW's decoupled weight decay (0: none).
    weight_decay: float = 0.0
    # AdamW's decay rate of the gradient's running mean.
    beta1: float = 0.9
    # AdamW's decay rate of the squared gradient's running mean.
    beta2: float = 0.99
    # Gradients are scaled down to this global norm when larger (inf: no clipping).
    max_grad_norm: float = 1.0
    # Steps over which the learning rate rises linearly to `lr` (0: none).
    warmup_steps: int = 0


@dataclass
class SFTConfig:
    """The supervised warm start on the environment's reference answers, before RL (or alone: rlhpc.sft)."""

    # Optimizer steps of the supervised warm start (the most it takes when stop_at_reward is set); 0 skips it.
    steps: int = 0
    # Tasks per SFT step, each trained on its reference answer.
    batch_size: int = 32
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))
    # Stop as soon as the greedy reward on a validation set (train-distribution tasks, never the held-out eval set)
    # reaches this value, checked every check_interval steps; 0 trains all `steps`.
    stop_at_reward: float = 0.0
    # SFT steps between two validation checks (sft.stop_at_reward).
    check_interval: int = 10
    # Tasks of the validation set (sft.stop_at_reward).
    validation_tasks: int = 64
    # The warm start saves its state (model, optimizer, step: run_dir/sft_state) every save_interval steps, so that a
    # trainer killed outright (a lost node) goes on from the last save; also whenever asked to stop. 0: only then.
    save_interval: int = 100


@dataclass
class TrainerConfig:
    """The RL trainer: its steps, ranks, batches and parallelism (docs/trainer.md)."""

    # RL optimizer steps.
    steps: int = 100
    # Number of trainer ranks (one torch.distributed world; FSDP2 when > 1).
    num_ranks: int = 1
    # Rollout groups (tasks) consumed per optimizer step.
    groups_per_step: int = 16
    # Token budget of one micro-batch (padded tokens); a step accumulates gradients over micro-batches.
    micro_batch_tokens: int = 8192
    # Logprobs and entropy are computed this many tokens at a time, so a micro-batch's full [tokens x vocabulary]
    # logits are never held at once (the backward pass recomputes each chunk's logits); 0: the full logits.
    logprob_chunk_tokens: int = 2048
    # How samples become model inputs. "shared_prefix": the samples of a group are packed into rows of at most
    # `pack_row_tokens` tokens holding their common prefix (the prompt) once, then each sample's own tokens, with an
    # attention mask that keeps samples apart (exact: every sample sees what it sees alone); the output head runs only
    # on loss tokens. "padded": one right-padded row per sample (docs/trainer.md).
    packing: str = "shared_prefix"
    # Tokens of one packed row (trainer.packing=shared_prefix).
    pack_row_tokens: int = 1024
    # Packed rows attend from their samples' boundaries, building the attention mask this many query x key elements
    # at a time: a row of W tokens with W x W above it attends in blocks of queries whose attention the backward
    # recomputes, so no [W, W] mask is kept per layer (rlhpc/train/attention.py; docs/trainer.md).
    attention_block_elements: int = 4194304
    # torch.compile each decoder block (shapes marked dynamic) on the first step: the first step takes longer (tens of
    # seconds on CPU), later ones less (docs/trainer.md); a block that fails to compile runs eagerly.
    compile: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Wrap the model with FSDP2 fully_shard (always on when num_ranks > 1). With FSDP2 the model is built on the meta
    # device and each rank loads only its shards (rlhpc/train/loading.py).
    fsdp: bool = False
    # Dtype forward and backward compute in: "auto" (bfloat16 on GPU, master_dtype on CPU), "float32" or "bfloat16"
    # (also on CPU, through autocast on one rank without FSDP). Gradients are always reduced in float32.
    param_dtype: str = "auto"
    # Dtype of the sharded parameters (master weights) and the AdamW state. "bfloat16" is pure bf16 training: updates
    # much smaller than a weight round away. Weights sent to inference and exports are cast to model.dtype.
    master_dtype: str = "float32"
    # Recompute each decoder block's activations in the backward pass: less memory, more compute.
    activation_checkpointing: bool = False
    # Expert parallelism for MoE models: each layer's routed experts are computed on `ep` ranks (E/ep experts each),
    # tokens reach them by all-to-all (rlhpc/train/experts.py). Must divide trainer.num_ranks; 1: experts are plain
    # FSDP2 parameters.
    ep: int = 1
    # Context parallelism: each packed micro-batch row is split over `cp` consecutive ranks (W / cp positions each;
    # attention exchanges heads with all-to-all, so the model's attention heads must divide by cp), which train the
    # same samples: the batch is split over num_ranks / cp groups (rlhpc/train/context.py). Needs
    # trainer.packing=shared_prefix; composes with trainer.ep. 1: a sequence is on one rank whole.
    cp: int = 1
    # MoE models: the inference engine records each token's experts per MoE layer, they travel with the tokens in the
    # queue, and the trainer's forward uses exactly those experts, with routing weights recomputed from the live
    # router (which still learns): near-tied routing cannot flip between engine and trainer (docs/moe.md). A queue
    # file without routing (a dense model, the vLLM engine for now) trains with live routing, as does `false`.
    router_replay: bool = True
    # Save a checkpoint every this many steps (0: only at the end and on a stop signal).
    checkpoint_interval: int = 0
    # Export the final model in Hugging Face format to checkpoints/final.
    export_final: bool = True
    # Seconds to wait for rollouts of one step before failing with a clear error.
    rollout_timeout_s: float = 600.0
    # A step whose advantages, loss or gradient norm is not finite is skipped (weights unchanged, republished as the
    # next version); this many skipped steps in a row stop the run (docs/fault-tolerance.md).
    max_bad_steps: int = 5
    # launcher=local: a trainer killed by a signal (kill -9, the OOM killer, a crash) or found hung
    # (cluster.hang_timeout_s) is started again, with fresh inference workers, from its newest checkpoint
    # (trainer.checkpoint_interval; with 0, from the start of RL), up to this many times within
    # trainer.restart_window_s; one that dies again the same way without a newer checkpoint in between is not. A Python
    # error in the trainer (a bug or bad input a restart would repeat) ends the run, as does 0. Under Slurm the
    # trainer's death ends the job (its requeue resumes it).
    max_restarts: int = 2
    # The window over which trainer.max_restarts counts the trainer's restarts (0: the whole launch).
    restart_window_s: float = 3600.0
    # Torch threads of each trainer rank.
    threads: int = 1


@dataclass
class DisaggregationConfig:
    """Prefill/decode disaggregation (vLLM only; docs/vllm.md): each inference worker runs a prefill instance (vLLM
    kv_role kv_producer) and a decode instance (kv_consumer); the prompt is computed on the first, its KV cache moves
    through `connector` to the second, which samples the completion."""

    # Run each worker as a prefill instance and a decode instance.
    enabled: bool = False
    # vLLM KV connector joining the two: "NixlConnector" (GPU memory to GPU memory, RDMA/NVLink; GPU path) or
    # "ExampleConnector" (KV cache through files under <run_dir>/vllm/kv/; the one that runs on vLLM's CPU backend).
    connector: str = "NixlConnector"
    # GPUs of the prefill instance (its tensor parallel size); 0: inference.tensor_parallel_size. The decode instance
    # has inference.tensor_parallel_size GPUs. A worker takes both instances' GPUs of its node (GPU only).
    prefill_tensor_parallel_size: int = 0
    # Where NixlConnector registers the KV cache for transfer: "cuda" (GPU memory) or "cpu" (a host staging buffer).
    kv_buffer_device: str = "cuda"
    # Extra kv_connector_extra_config of both instances, passed as given.
    connector_extra_config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class InferenceConfig:
    """The inference workers: their engine, how many, how they generate (and serve)."""

    # "hf" (transformers, the embedded default) or "vllm" (rlhpc.infer.engines.vllm; see docs/vllm.md).
    engine: str = "hf"
    # Inference workers, each with its own engine (with +attach=inference: the workers to add).
    num_workers: int = 2
    # Tasks per generation call; each call publishes one queue file holding that many groups.
    groups_per_batch: int = 8
    # Torch threads of each inference worker.
    threads: int = 1
    # Seconds a worker waits for the first weights (SFT runs first on the trainer).
    startup_timeout_s: float = 900.0
    # A worker stops with an error when nothing has moved for this long: it published nothing, received no weights,
    # and the trainer claimed no step (0: wait forever).
    idle_timeout_s: float = 1800.0
    # A worker (or follower) that dies is started again, up to this many times per worker within
    # inference.restart_window_s (by the local launcher, or inside the Slurm job by its task); it rejoins at the next
    # update (broadcast) or the newest snapshot (filesystem). One that dies again the same way (exit code and last log
    # line) without doing any work in between (a worker: publishing a batch; a follower: joining its leader) is not
    # restarted again: the run ends, saying why. 0: a dead worker ends the run.
    max_restarts: int = 3
    # The window over which inference.max_restarts counts a worker's restarts (0: the whole run).
    restart_window_s: float = 3600.0
    # Seconds before a restart; doubled with each restart of the same worker within the window, up to 60 s.
    restart_backoff_s: float = 1.0
    # ---- vLLM-only settings (ignored by the transformers engine) ----
    # GPUs of one vLLM instance (tensor parallelism).
    tensor_parallel_size: int = 1
    # GPU: share of GPU memory vLLM may take (weights + KV cache). Not used on CPU, where vLLM reads it as a share of
    # host memory: there `kv_cache_gb` sizes the KV cache.
    gpu_memory_utilization: float = 0.85
    # Clamped to the model's max_position_embeddings.
    max_model_len: int = 4096
    # No CUDA graphs or torch.compile in vLLM: a faster start, slower decoding.
    enforce_eager: bool = True
    # "fp8": weights quantized to FP8 when loaded (GPU only); updates then take the reload path, which re-quantizes.
    quantization: Optional[str] = None
    # "fp8" (or "fp8_e4m3", "fp8_e5m2"): FP8 KV cache (GPU only).
    kv_cache_dtype: str = "auto"
    # KV cache size in GiB; 0 means: sized from gpu_memory_utilization on GPU, 0.25 GiB on CPU.
    kv_cache_gb: float = 0.0
    # Sequences decoded together; a generation call of groups_per_batch * group_size sequences should fit in one.
    max_num_seqs: int = 256
    # vLLM's prefix caching: a group's shared prompt is computed once.
    enable_prefix_caching: bool = True
    # Apply new weights between two decode steps of a running generation (requests and their KV cache are kept), not
    # only between generations. Needs the worker to hand the engine its receiver (docs/vllm.md).
    inflight_updates: bool = True
    # How new weights land: "auto" (in-place load_weights on GPU, the reload path on CPU or with quantization),
    # "reload" (vLLM reload_weights: re-runs the loader's post-processing, e.g. CPU repacking, FP8 quantization),
    # "inplace" (GPU only) or "file" (a safetensors file every worker process reloads; always so when
    # tensor_parallel_size > 1).
    weight_update: str = "auto"
    # vLLM engines (inference workers) per node; with local rank i an engine uses GPUs [i*tp, (i+1)*tp) where
    # tp = tensor_parallel_size (GPU only; cluster.inference.tasks_per_node should match).
    engines_per_node: int = 1
    # Nodes one vLLM instance spans (a model too large for one node's GPUs): tensor_parallel_size GPUs over this many
    # nodes, tensor_parallel_size / nodes_per_instance on each. Worker w's instance is a leader process (the rlhpc
    # worker; node rank 0) and nodes_per_instance - 1 followers that run only vLLM's model workers
    # (rlhpc.infer.follower). Under Slurm the inference component then has num_workers x nodes_per_instance tasks.
    nodes_per_instance: int = 1
    # Prefill/decode disaggregation: separate prefill and decode vLLM instances per worker (see DisaggregationConfig).
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    # vLLM's kv_transfer_config of a single (not disaggregated) engine, passed as given (e.g. a KV offloading
    # connector); empty: none. With `disaggregation.enabled` the two instances' configs are made from that section.
    kv_transfer_config: Dict[str, Any] = field(default_factory=dict)
    # Further vLLM EngineArgs, passed as given; they override everything above.
    engine_args: Dict[str, Any] = field(default_factory=dict)
    # ---- serving the policy over HTTP (docs/serving.md) ----
    # Each worker serves its engine (OpenAI-compatible endpoints and /inference/v1/generate) beside its rollouts; the
    # address goes to rendezvous/serve-<rank>.json.
    serve: bool = False
    # Answer requests that do not carry the run's token (`Authorization: Bearer <token>`): trusted networks only.
    serve_open: bool = False
    # Port of worker 0 (worker i listens on serve_port + i); 0: any free port.
    serve_port: int = 0
    # Address to listen on: "" is this node's address (loopback in a local run); "0.0.0.0": every interface.
    serve_host: str = ""


@dataclass
class WeightsConfig:
    """How new weights travel from the trainer to the workers."""

    # "broadcast" (NCCL on GPU, gloo on CPU) or "filesystem" (safetensors snapshot + ready marker).
    transport: str = "broadcast"
    # Flat bucket size of the broadcast, in MiB.
    bucket_mb: int = 64
    # Also write a filesystem snapshot every this many versions, for late joiners (0: initial and final only).
    snapshot_interval: int = 0
    # Seconds to wait for every first member of the weights group (workers start after the SFT warm start).
    timeout_s: float = 600.0
    # Seconds one broadcast (or forming the group) may wait for a member; a member that takes longer (stalled, or its
    # node gone without closing its connections) is left out and joins again at a later update.
    member_timeout_s: float = 60.0
    # How a worker takes an update over the broadcast transport. "buffered": received into a copy of the weights while
    # the worker generates, loaded between generations (the trainer never waits for a generation; the worker holds the
    # model twice). "in_place": loaded bucket by bucket straight into the engine (no second copy; two buckets of
    # weights.bucket_mb) once the worker is between generations: the trainer's broadcast waits for that, and vLLM's
    # in-flight updates are off. Needs an engine that loads part of the model at a time (hf; vLLM on GPU).
    receive: str = "buffered"


@dataclass
class QueueConfig:
    """The rollout queue under run_dir/queue/ (docs/fault-tolerance.md)."""

    # Back-pressure: workers pause while this many steps' worth of fresh groups are already pending.
    max_pending_steps: int = 2
    # Keep the folders of trained steps under queue/retired (otherwise delete them once checkpointed).
    keep_retired: bool = False
    # Seconds an in-flight marker (a batch a worker is generating) counts against back-pressure without being renewed;
    # the worker renews it every lease_s/3, so a dead worker's marker stops counting after at most lease_s.
    lease_s: float = 60.0
    # Longest wait between two looks at the queue of a waiting worker (waits back off from 10 ms to this, and start
    # again at 10 ms after progress): bounds the filesystem metadata operations per second of each worker.
    poll_max_s: float = 0.5
    # Files kept in queue/dropped (the newest; older ones are deleted, totals are counted).
    keep_dropped: int = 100
    # Files kept in queue/quarantine (the newest; older ones are deleted, totals are counted).
    keep_quarantined: int = 100


@dataclass
class EvalConfig:
    """The held-out evaluation of a training run."""

    # Held-out evaluation (greedy) every this many RL steps, plus after SFT and at the end; 0: only those two. During
    # RL inference worker 0 evaluates, with the run's engine, into run_dir/evals/ (rlhpc/run/evaluation.py).
    interval: int = 10
    # Held-out tasks evaluated: the first this many of the environment's eval split.
    num_tasks: int = 64
    # How long the trainer waits after its last step for worker 0's evaluation of the final weights (seconds).
    timeout_s: float = 600.0


# The experiment trackers metrics.trackers may name (rlhpc/run/trackers.py).
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


@dataclass
class WandbConfig:
    """Weights & Biases (metrics.trackers=[...,wandb]): one W&B run per process (trainer-0, inference-0, ...), grouped
    by the run's name (docs/quickstart.md, "Experiment trackers")."""

    # The W&B project.
    project: str = "rlhpc"
    # The W&B entity (a team or user); empty: the default entity of the API key.
    entity: str = ""
    # online: uploads as the run goes; offline: writes run_dir/wandb/ only, for `wandb sync` later (compute nodes
    # without internet); disabled: records nothing.
    mode: str = "online"
    # Tags of every W&B run of this run.
    tags: List[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    """MLflow (metrics.trackers=[...,mlflow]): one MLflow run for the whole run, the inference workers' scalars under
    inference-<rank>/ (docs/quickstart.md, "Experiment trackers")."""

    # A tracking server (http://host:5000) or a store; empty: MLFLOW_TRACKING_URI if set, else MLflow's file store in
    # run_dir/mlruns.
    tracking_uri: str = ""
    # The MLflow experiment the run goes into (created if missing).
    experiment: str = "rlhpc"


@dataclass
class TrackioConfig:
    """trackio (metrics.trackers=[...,trackio]): one trackio run per process, grouped by the run's name, in trackio's
    local database (TRACKIO_DIR, by default ~/.cache/huggingface/trackio)."""

    # The trackio project.
    project: str = "rlhpc"


@dataclass
class MetricsConfig:
    """What a run records besides its scalars, and where (docs/quickstart.md, "What the model writes")."""

    # Rollouts of each trained step kept as text (prompt, completion, reward, advantage, the weights version that wrote
    # it): in run_dir/samples.jsonl, in TensorBoard's text tab (trainer-0) and as a table in each tracker; 0: none.
    samples_per_step: int = 2
    # Where every role's scalars, the config, the samples and the summary go, besides logs/*.metrics.jsonl and
    # samples.jsonl: any of tensorboard (run_dir/tb), wandb, mlflow, trackio (`pip install -e '.[trackers]'`).
    trackers: List[str] = field(default_factory=lambda: ["tensorboard"])
    # The run's name in the trackers: the W&B and trackio group of its processes' runs (each named
    # <run_name>-<role>-<rank>) and the MLflow run's name; empty: <exp_name>-<run_dir's folder name>. Fixed at the
    # first launch: a resumed run keeps it.
    run_name: str = ""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    trackio: TrackioConfig = field(default_factory=TrackioConfig)


@dataclass
class SlurmGroupConfig:
    """The Slurm resources of one role: one component of the heterogeneous job (trainer: 0, inference: 1)."""

    # Nodes of this component.
    nodes: int = 1
    # Tasks (role processes) per node; 0 derives it: trainer.num_ranks (or inference.num_workers) / nodes.
    tasks_per_node: int = 0
    # CPUs of each task (`--cpus-per-task`).
    cpus_per_task: int = 1
    # GPUs of each node (0: none).
    gpus_per_node: int = 0
    # Memory per node in GB (0: the partition's default).
    mem_gb: int = 4
    # Time limit of this component in minutes (0: cluster.time_min).
    time_min: int = 0
    # Further `#SBATCH --key=value` options of this component (e.g. {constraint: h100, exclusive: ""}).
    extra: Dict[str, str] = field(default_factory=dict)


@dataclass
class ContainerConfig:
    """The image every role runs in on Slurm (ignored by launcher=local; docs/slurm.md, "Containers"). run_dir is
    mounted at its own path: the roles write there, and the launcher reads it from outside."""

    # "" (none) | pyxis (NVIDIA's pyxis/enroot: srun --container-image) | apptainer (each task runs under
    # `apptainer exec`; Singularity too, with exe=singularity).
    runtime: str = ""
    # pyxis: a registry image (nvcr.io#nvidia/pytorch:24.05-py3) or a squashfs file; apptainer: a .sif file (or
    # docker://...). It must have rlhpc installed; cluster.python names its Python ("": python3 on the image's PATH).
    image: str = ""
    # More host folders in the container, `src:dst[:flags]` (pyxis --container-mounts, apptainer --bind).
    mounts: List[str] = field(default_factory=list)
    # The working directory in the container ("": the runtime's default).
    workdir: str = ""
    # apptainer: the program that runs the image (singularity on clusters that have only that; a path works too).
    exe: str = "apptainer"


@dataclass
class ClusterConfig:
    """Where and how the Slurm launchers run the job (ignored by launcher=local)."""

    # Slurm partition ("": the cluster's default).
    partition: str = ""
    # Slurm account to charge ("": the user's default).
    account: str = ""
    # Slurm quality of service ("": the default).
    qos: str = ""
    # Job name in squeue/sacct ("": rlhpc-<exp_name>).
    job_name: str = ""
    # Time limit of the job in minutes.
    time_min: int = 60
    # Seconds before the time limit at which Slurm sends SIGUSR1 to the batch shell (forwarded to the roles: the
    # trainer checkpoints and the job requeues). Slurm may send it up to a minute early.
    grace_s: int = 120
    # launcher=local: seconds the trainer's heartbeat (each RL step and checkpoint, from the first RL step on) may stand
    # still before the launcher calls the run hung, at least 20 times the slowest recent step (0: never). It then writes
    # every role's Python stacks into its log, names where each waits, and kills stuck inference workers for the restart
    # policy to start again (the trainer waiting for rollouts), or ends the run, resumable (rlhpc/cluster/watchdog.py).
    hang_timeout_s: float = 900.0
    trainer: SlurmGroupConfig = field(default_factory=SlurmGroupConfig)
    inference: SlurmGroupConfig = field(default_factory=SlurmGroupConfig)
    # Shell lines run in the batch script before the roles start (module load, conda activate, exports).
    setup: List[str] = field(default_factory=list)
    # The Python on the compute nodes ("": the one running the launcher; with cluster.container, python3 in the image).
    python: str = ""
    # More options of every srun line that starts the roles (the job script's, an attach job's), e.g.
    # [--cpu-bind=cores, --mpi=none]; each is one shell word.
    srun_args: List[str] = field(default_factory=list)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    # Requeue the job when the trainer checkpointed on a signal (time limit, `scancel --signal=USR1 --batch`).
    requeue: bool = True
    # Memory of one GPU in GB as sold (H100: 80, H200: 141; the estimate reads it as GiB, which nvidia-smi shows as
    # 79.6 and 140.4). The launcher checks its estimate of each role's memory per GPU against it and refuses a plan
    # that does not fit (rlhpc/cluster/memory.py, docs/scaling.md); 0: no check (a plan on CPU processes, or on GPUs of
    # unstated memory).
    gpu_memory_gb: float = 0.0


@dataclass
class ResumeConfig:
    """Launching again into the run_dir of an unfinished run, which resumes it (docs/fault-tolerance.md)."""

    # Relaunching an unfinished run whose saved config.yaml differs in a key that changes training (the model, the
    # environment, the algorithm, the optimizer, ...) is refused, listing the differences; true trains on with the new
    # values (the change is appended to run_dir/config_changes.jsonl).
    allow_config_change: bool = False


@dataclass
class LauncherConfig:
    """How the roles are started: local processes, or one Slurm job."""

    # local | slurm (one heterogeneous job through submitit) | sbatch (the same job script through the sbatch command)
    name: str = "local"
    # Wait for the run to end and stream progress (the Slurm launchers return the job id at once otherwise).
    wait: bool = True
    # Seconds the launcher waits for the whole run before ending it (0: no limit; Slurm: the job is cancelled).
    timeout_s: float = 0.0
    # A progress bar of the trainer's steps while waiting.
    progress: bool = True
    # Slurm launchers: submit the job script; false only writes it to run_dir/job.sbatch (to submit by hand).
    submit: bool = True
    # launcher=local: a role waiting on the other (workers on back-pressure, the trainer on rollouts) lends its threads
    # (trainer.threads, inference.threads), and the other role's processes use them until it works again, never more
    # than the machine's cores (rlhpc/run/cores.py): 6-9% faster steps (docs/performance.md). false keeps every role's
    # threads fixed (a thread count that changes within a step changes floating-point sums in their last bits).
    lend_cores: bool = True
    # launcher=local: the roles fork from one process that imported torch, transformers and rlhpc once (Linux;
    # rlhpc/run/preload.py): a launch reaches its first step seconds sooner (~7 s of CPU saved per process, and per
    # restarted worker). false starts each role as a new interpreter.
    preload: bool = True


@dataclass
class Config:
    """The whole config of a run."""

    # Where everything of this run lives (shared filesystem on a cluster). conf/config.yaml makes it
    # runs/<exp_name>/<launch time> (in a sweep, one folder per point).
    run_dir: str = MISSING
    # The experiment's name: in the default run_dir and the Slurm job's name.
    exp_name: str = "default"
    # Seed of the run: task order, sampling, the trainer's randomness.
    seed: int = 0
    # How many optimizer steps a rollout may lag behind the step that trains on it (0: on-policy).
    async_level: int = 1
    # Reuse a run directory that holds a finished run (its contents are replaced).
    overwrite: bool = False
    # Print the plan and start nothing.
    dry_run: bool = False
    # Level of the roles' logs (DEBUG, INFO, WARNING, ERROR).
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
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    # "inference": add inference workers to the running run in run_dir (its saved config.yaml holds the rest; see
    # docs/fault-tolerance.md); null: launch (or resume) the run itself.
    attach: Optional[str] = None


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="rlhpc_schema", node=Config)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


_CHOICES = {
    "weights.transport": ("broadcast", "filesystem"),
    "weights.receive": ("buffered", "in_place"),
    "inference.engine": ("hf", "vllm"),
    "inference.weight_update": ("auto", "reload", "inplace", "file"),
    "algo.normalize": ("token", "sequence", "constant"),
    "launcher.name": ("local", "slurm", "sbatch"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "trainer.param_dtype": ("auto", "float32", "bfloat16"),
    "trainer.master_dtype": ("float32", "bfloat16"),
    "trainer.packing": ("shared_prefix", "padded"),
    "metrics.wandb.mode": ("online", "offline", "disabled"),
}


def need(ok: bool, key: str, msg: str) -> None:
    """Raises ConfigError naming `key` unless `ok`: the one way every module checks a config value."""
    if not ok:
        raise ConfigError(f"config key `{key}`: {msg}")


# Checks that the parts owning a config section register (the algorithms check algo.*); validate runs them all. The
# parts register themselves on import, so config never imports them: `import rlhpc.algo` before validating.
_CHECKS: Dict[str, Callable[[Config], None]] = {}


def register_check(name: str, check: Callable[[Config], None]) -> None:
    _CHECKS[name] = check


def validate(cfg: Config) -> None:
    """Checks what the types cannot; raises ConfigError naming the key."""
    if not _CHECKS:
        raise RuntimeError("no config checks are registered: import rlhpc.algo before rlhpc.config.schema.validate")
    for key, choices in _CHOICES.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        need(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")
    need(cfg.attach in (None, "inference"), "attach", f"{cfg.attach!r} is not one of: inference (or unset)")
    need(cfg.async_level >= 0, "async_level", "must be >= 0")
    need(cfg.algo.group_size >= 2, "algo.group_size", "needs at least 2 completions per task for a group baseline")
    need(0 < cfg.algo.temperature < math.inf, "algo.temperature", "must be a finite number > 0 for sampling")
    need(0 <= cfg.algo.router_aux_loss_coef < math.inf, "algo.router_aux_loss_coef", "must be finite and >= 0 (0: off)")
    need(not (cfg.trainer.compile and cfg.algo.router_aux_loss_coef > 0), "trainer.compile",
         "is not tested with the router's load-balancing term (its hooks read the routers inside the compiled "
         "blocks): set trainer.compile=false or algo.router_aux_loss_coef=0")
    _check_built_model(cfg)
    need(cfg.trainer.steps >= 0, "trainer.steps", "must be >= 0")
    need(cfg.trainer.num_ranks >= 1, "trainer.num_ranks", "must be >= 1")
    need(cfg.trainer.groups_per_step >= 1, "trainer.groups_per_step", "must be >= 1")
    need(cfg.trainer.threads >= 1, "trainer.threads", "must be >= 1 (torch threads of each trainer rank)")
    need(cfg.trainer.max_bad_steps >= 1, "trainer.max_bad_steps", "must be >= 1")
    need(cfg.trainer.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", "must be >= 1")
    need(cfg.trainer.logprob_chunk_tokens >= 0, "trainer.logprob_chunk_tokens", "must be >= 0 (0: the full logits)")
    need(cfg.trainer.pack_row_tokens >= 1, "trainer.pack_row_tokens", "must be >= 1")
    need(cfg.trainer.attention_block_elements >= 1, "trainer.attention_block_elements", "must be >= 1")
    need(cfg.trainer.checkpoint_interval >= 0, "trainer.checkpoint_interval",
         "must be >= 0 (0: only at the end and on a stop signal)")
    need(cfg.trainer.rollout_timeout_s > 0, "trainer.rollout_timeout_s", "must be > 0 seconds")
    _check_optim(cfg.trainer.optim, "trainer.optim")
    need(not (cfg.trainer.compile and cfg.trainer.ep > 1), "trainer.compile",
         "is not tested with expert parallelism (its all-to-all runs inside the blocks): set trainer.compile=false or "
         "trainer.ep=1")
    _check_expert_parallel(cfg)
    _check_context_parallel(cfg)
    need(not (cfg.trainer.param_dtype == "float32" and cfg.trainer.master_dtype == "bfloat16"),
         "trainer.param_dtype", "float32 compute over bfloat16 master weights gains nothing: set "
         "trainer.master_dtype=float32 (mixed precision) or trainer.param_dtype=bfloat16 (pure bf16)")
    need(cfg.inference.num_workers >= 1, "inference.num_workers", "must be >= 1")
    need(cfg.inference.groups_per_batch >= 1, "inference.groups_per_batch", "must be >= 1")
    need(cfg.inference.threads >= 1, "inference.threads", "must be >= 1 (torch threads of each inference worker)")
    need(cfg.inference.startup_timeout_s > 0, "inference.startup_timeout_s", "must be > 0 seconds")
    need(cfg.inference.tensor_parallel_size >= 1, "inference.tensor_parallel_size", "must be >= 1")
    need(0 < cfg.inference.gpu_memory_utilization <= 1, "inference.gpu_memory_utilization",
         "must be in (0, 1] (a share of the GPU's memory)")
    need(cfg.inference.max_model_len >= 1, "inference.max_model_len",
         "must be >= 1 (tokens; larger values are clamped to the model's max_position_embeddings)")
    need(cfg.inference.kv_cache_gb >= 0, "inference.kv_cache_gb",
         "must be >= 0 (0: from gpu_memory_utilization on GPU, 0.25 GiB on CPU)")
    need(cfg.inference.max_num_seqs >= 1, "inference.max_num_seqs", "must be >= 1")
    need(cfg.inference.engines_per_node >= 1, "inference.engines_per_node", "must be >= 1")
    need(0 <= cfg.inference.serve_port < 65536, "inference.serve_port", "must be a TCP port (0: any free port)")
    _check_instance_nodes(cfg)
    pd = cfg.inference.disaggregation
    if pd.enabled:
        need(cfg.inference.engine == "vllm", "inference.disaggregation.enabled",
             f"prefill/decode disaggregation needs inference.engine=vllm (not {cfg.inference.engine!r})")
        need(bool(pd.connector), "inference.disaggregation.connector", "names the vLLM KV connector (NixlConnector)")
        need(pd.prefill_tensor_parallel_size >= 0, "inference.disaggregation.prefill_tensor_parallel_size",
             "must be >= 0 (0: inference.tensor_parallel_size)")
        need(pd.kv_buffer_device in ("cuda", "cpu"), "inference.disaggregation.kv_buffer_device",
             f"{pd.kv_buffer_device!r} is not one of cuda, cpu")
        need(not cfg.inference.kv_transfer_config, "inference.kv_transfer_config",
             "must be empty with inference.disaggregation.enabled: the two instances' KV transfer configs are made "
             "from inference.disaggregation")
        gpus = cfg.cluster.inference.gpus_per_node
        per_worker = (pd.prefill_tensor_parallel_size or cfg.inference.tensor_parallel_size) \
            + cfg.inference.tensor_parallel_size
        need(not gpus or per_worker * cfg.inference.engines_per_node <= gpus,
             "inference.disaggregation.prefill_tensor_parallel_size",
             f"a worker's prefill and decode instances need {per_worker} GPUs (prefill_tensor_parallel_size + "
             f"inference.tensor_parallel_size) x inference.engines_per_node={cfg.inference.engines_per_node}, but a "
             f"node has {gpus} (cluster.inference.gpus_per_node)")
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
    need(cfg.sft.steps >= 0, "sft.steps", "must be >= 0 (0: no warm start)")
    need(cfg.sft.batch_size >= 1, "sft.batch_size", "must be >= 1")
    need(cfg.sft.check_interval >= 1, "sft.check_interval", "must be >= 1")
    need(cfg.sft.save_interval >= 0, "sft.save_interval", "must be >= 0 (0: saved only when asked to stop)")
    need(cfg.sft.validation_tasks >= 1, "sft.validation_tasks", "must be >= 1")
    need(0.0 <= cfg.sft.stop_at_reward <= 1.0, "sft.stop_at_reward", "must be in [0, 1] (0: no early stop)")
    _check_optim(cfg.sft.optim, "sft.optim")
    need(cfg.queue.max_pending_steps >= 1, "queue.max_pending_steps", "must be >= 1")
    need(cfg.queue.lease_s > 0, "queue.lease_s", "must be > 0")
    need(cfg.queue.poll_max_s > 0, "queue.poll_max_s", "must be > 0")
    need(cfg.queue.keep_dropped >= 0, "queue.keep_dropped", "must be >= 0")
    need(cfg.queue.keep_quarantined >= 0, "queue.keep_quarantined", "must be >= 0")
    need(cfg.inference.idle_timeout_s >= 0, "inference.idle_timeout_s", "must be >= 0 (0: wait forever)")
    need(cfg.inference.max_restarts >= 0, "inference.max_restarts", "must be >= 0")
    need(cfg.trainer.max_restarts >= 0, "trainer.max_restarts", "must be >= 0 (0: a dead trainer ends the run)")
    need(cfg.trainer.restart_window_s >= 0, "trainer.restart_window_s", "must be >= 0 (0: the whole launch)")
    need(cfg.cluster.hang_timeout_s >= 0, "cluster.hang_timeout_s", "must be >= 0 (0: no hang watchdog)")
    need(cfg.inference.restart_window_s >= 0, "inference.restart_window_s", "must be >= 0 (0: the whole run)")
    need(cfg.inference.restart_backoff_s >= 0, "inference.restart_backoff_s", "must be >= 0")
    need(cfg.weights.member_timeout_s > 0, "weights.member_timeout_s", "must be > 0")
    need(cfg.weights.timeout_s > 0, "weights.timeout_s", "must be > 0 seconds")
    need(cfg.weights.snapshot_interval >= 0, "weights.snapshot_interval", "must be >= 0 (0: initial and final only)")
    need(cfg.weights.receive == "buffered" or not cfg.inference.serve, "weights.receive",
         "in_place cannot be combined with inference.serve=true (an HTTP request could see part-loaded weights); "
         "use weights.receive=buffered")
    inf = cfg.inference
    whole = inf.engine == "vllm" and (inf.tensor_parallel_size > 1 or inf.weight_update in ("reload", "file")
                                      or inf.quantization is not None)
    need(cfg.weights.receive == "buffered" or not whole, "weights.receive",
         "in_place needs vLLM's in-place load_weights (GPU, inference.tensor_parallel_size=1, no quantization, "
         "inference.weight_update auto or inplace): this vLLM setup reloads the whole model; use weights.receive=buffered")
    need(cfg.eval.interval >= 0, "eval.interval", "must be >= 0 (0: only after SFT and at the end)")
    need(cfg.eval.num_tasks >= 1, "eval.num_tasks", "must be >= 1")
    need(cfg.eval.timeout_s > 0, "eval.timeout_s", "must be > 0")
    need(cfg.metrics.samples_per_step >= 0, "metrics.samples_per_step", "must be >= 0 (0: no rollout text)")
    for name in cfg.metrics.trackers:
        need(name in TRACKERS, "metrics.trackers", f"{name!r} is not one of {', '.join(TRACKERS)}")
    need(len(set(cfg.metrics.trackers)) == len(cfg.metrics.trackers), "metrics.trackers", "names a tracker twice")
    need(cfg.weights.bucket_mb >= 1, "weights.bucket_mb", "must be >= 1")
    need(cfg.env.max_new_tokens >= 1, "env.max_new_tokens", "must be >= 1")
    need(cfg.env.max_turns >= 0, "env.max_turns", "must be >= 0 (0: the environment's own)")
    need(cfg.env.max_episode_tokens >= 0, "env.max_episode_tokens", "must be >= 0 (0: no budget)")
    need(cfg.env.pool_processes >= 0, "env.pool_processes", "must be >= 0 (0: run calls inline)")
    need(cfg.env.call_timeout_s > 0, "env.call_timeout_s", "must be > 0")
    need(0.0 <= cfg.env.max_error_fraction <= 1.0, "env.max_error_fraction", "must be in [0, 1]")
    need(cfg.env.sandbox in ("bwrap", "unsandboxed"), "env.sandbox", f"{cfg.env.sandbox!r} is not one of bwrap, unsandboxed")
    _check_sandbox_limits(cfg.env.sandbox_limits)
    _check_container(cfg.cluster.container)
    need(cfg.launcher.timeout_s >= 0, "launcher.timeout_s", "must be >= 0 seconds (0: no limit)")
    need(cfg.cluster.gpu_memory_gb >= 0, "cluster.gpu_memory_gb", "must be >= 0 (0: no memory check)")
    for check in _CHECKS.values():
        check(cfg)
    need(
        cfg.cluster.grace_s < cfg.cluster.time_min * 60,
        "cluster.grace_s",
        f"{cfg.cluster.grace_s}s leaves no time to run within cluster.time_min={cfg.cluster.time_min}",
    )


# transformers' config keys for the number of routed experts, by family (qwen3_moe, glm/deepseek, mixtral/minimax).
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def _check_built_model(cfg: Config) -> None:
    """model.*: the sizes of the model built in code (a checkpoint at `model.path` brings its own config, which
    preflight and the trainer read)."""
    m = cfg.model
    if m.path:
        return
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "max_position_embeddings"):
        need(getattr(m, key) >= 1, f"model.{key}", "must be >= 1")
    need(m.num_heads % m.num_kv_heads == 0, "model.num_heads",
         f"{m.num_heads} must be a multiple of model.num_kv_heads ({m.num_kv_heads}): each key/value head serves a "
         "whole group of query heads")
    if "head_dim" not in m.extra:  # else model.extra sets each head's size
        head_dim = m.hidden_size // m.num_heads
        need(head_dim >= 2 and head_dim % 2 == 0, "model.hidden_size",
             f"{m.hidden_size} // model.num_heads ({m.num_heads}) = {head_dim} is each head's size, which rotary "
             "position embeddings need even and >= 2")
    need(m.tokenizer_merges >= 0, "model.tokenizer_merges", "must be >= 0")


def _check_optim(optim: OptimConfig, key: str) -> None:
    """One optimizer section (trainer.optim, sft.optim): AdamW's ranges, and a clip norm that only ever shrinks."""
    need(0 <= optim.lr < math.inf, f"{key}.lr", "must be a finite number >= 0")
    need(0 <= optim.weight_decay < math.inf, f"{key}.weight_decay", "must be a finite number >= 0 (0: none)")
    need(0 <= optim.beta1 < 1, f"{key}.beta1", "must be in [0, 1)")
    need(0 <= optim.beta2 < 1, f"{key}.beta2", "must be in [0, 1)")
    # clip_grad_norm_ scales gradients by max_grad_norm / norm (at most 1): 0 zeroes them, a negative value flips them.
    need(optim.max_grad_norm > 0, f"{key}.max_grad_norm", "must be > 0 (inf: no clipping)")
    need(optim.warmup_steps >= 0, f"{key}.warmup_steps", "must be >= 0 (0: no warmup)")


def _check_sandbox_limits(lim: SandboxLimitsConfig) -> None:
    """env.sandbox_limits: the rlimits and the wall clock of one sandboxed program (rlhpc/env/sandbox.py)."""
    key = "env.sandbox_limits"
    need(lim.cpu_s >= 1, f"{key}.cpu_s", "must be >= 1 second")
    need(lim.memory_mb >= 1, f"{key}.memory_mb", "must be >= 1")
    need(lim.processes >= 1, f"{key}.processes", "must be >= 1")
    need(lim.file_size_mb >= 0, f"{key}.file_size_mb", "must be >= 0 (0: no file writes)")
    need(lim.wall_s > 0, f"{key}.wall_s", "must be > 0 seconds")


# An image of each runtime, as the messages suggest one.
_IMAGE_EXAMPLES = {"pyxis": "nvcr.io#nvidia/pytorch:24.05-py3 (a registry image) or /shared/images/rlhpc.sqsh",
                   "apptainer": "/shared/images/rlhpc.sif"}


def _check_container(c: ContainerConfig) -> None:
    """cluster.container: a runtime rlhpc knows, with an image; mounts and a working directory the runtimes accept."""
    key = "cluster.container"
    need(c.runtime in ("", *_IMAGE_EXAMPLES), f"{key}.runtime",
         f"{c.runtime!r} is not one of: pyxis (srun --container-image, NVIDIA's pyxis/enroot), apptainer (apptainer "
         "exec; Singularity with cluster.container.exe=singularity), or \"\" for none")
    if not c.runtime:
        need(not (c.image or c.mounts or c.workdir), f"{key}.runtime",
             "is empty (no container), but cluster.container.image, mounts or workdir is set: set "
             "cluster.container.runtime=pyxis or apptainer to run the roles in that image")
        return
    need(bool(c.image.strip()), f"{key}.image",
         f"cluster.container.runtime={c.runtime} needs an image, e.g. {key}.image={_IMAGE_EXAMPLES[c.runtime]}")
    for m in c.mounts:
        need(bool(m) and "," not in m and m.startswith("/"), f"{key}.mounts",
             f"{m!r} is not one mount: give each as its own item, src:dst[:flags] with an absolute src, e.g. "
             f"[/shared/data:/data:ro, /scratch]")
    need(not c.workdir or c.workdir.startswith("/"), f"{key}.workdir",
         f"{c.workdir!r} must be an absolute path inside the image, e.g. /workspace (or \"\": the runtime's default)")
    if c.runtime == "apptainer":
        need(bool(c.exe.strip()), f"{key}.exe", "is empty: give the program, e.g. apptainer or singularity")


def _check_instance_nodes(cfg: Config) -> None:
    inf = cfg.inference
    n = inf.nodes_per_instance
    need(n >= 1, "inference.nodes_per_instance", "must be >= 1")
    if n == 1:
        return
    need(inf.engine == "vllm", "inference.nodes_per_instance",
         f"{n} needs inference.engine=vllm (an instance over several nodes is vLLM's; not {inf.engine!r})")
    need(inf.tensor_parallel_size % n == 0, "inference.nodes_per_instance",
         f"{n} nodes do not split inference.tensor_parallel_size={inf.tensor_parallel_size} evenly")
    need(not inf.disaggregation.enabled, "inference.disaggregation.enabled",
         "prefill/decode disaggregation with instances over several nodes (inference.nodes_per_instance="
         f"{n}) is not supported")
    need(inf.engines_per_node == 1, "inference.engines_per_node",
         f"must be 1 when an instance spans nodes (inference.nodes_per_instance={n})")
    gpus = cfg.cluster.inference.gpus_per_node
    need(not gpus or inf.tensor_parallel_size // n == gpus, "inference.tensor_parallel_size",
         f"{inf.tensor_parallel_size} over inference.nodes_per_instance={n} nodes is "
         f"{inf.tensor_parallel_size // n} GPUs a node, but a node has {gpus} (cluster.inference.gpus_per_node): an "
         "instance that spans nodes takes every GPU of each")


def _check_expert_parallel(cfg: Config) -> None:
    """trainer.ep: divides the ranks; for a model built in code, a MoE whose experts divide over the ranks (a model
    from `model.path` is checked when the trainer shards it)."""
    ep, ranks = cfg.trainer.ep, cfg.trainer.num_ranks
    need(ep >= 1, "trainer.ep", "must be >= 1")
    need(ranks % ep == 0, "trainer.ep", f"{ep} must divide trainer.num_ranks ({ranks})")
    if ep == 1 or cfg.model.path is not None:
        return
    experts = next((cfg.model.extra[k] for k in _EXPERT_KEYS if k in cfg.model.extra), None)
    need(experts is not None, "trainer.ep",
         f"{ep} needs a MoE model; model.arch={cfg.model.arch!r} sets no routed experts (set trainer.ep=1)")
    need(experts % ranks == 0, "trainer.ep",
         f"the model's {experts} routed experts must divide evenly over the trainer.num_ranks={ranks} ranks that "
         "store them")


def _check_context_parallel(cfg: Config) -> None:
    """trainer.cp: divides the ranks, runs on packed rows, and for a model built in code divides its heads (a model
    from `model.path` is checked when the trainer installs it: rlhpc/train/context.py)."""
    cp, ranks = cfg.trainer.cp, cfg.trainer.num_ranks
    need(cp >= 1, "trainer.cp", "must be >= 1")
    if cp == 1:
        return
    need(ranks % (cp * cfg.trainer.ep) == 0, "trainer.cp",
         f"{cp} x trainer.ep={cfg.trainer.ep} must divide trainer.num_ranks ({ranks}): the ranks form a "
         "dp_shard x ep x cp mesh")
    need(cfg.trainer.packing == "shared_prefix", "trainer.cp",
         f"{cp} splits packed rows: set trainer.packing=shared_prefix (not {cfg.trainer.packing!r})")
    need(not cfg.trainer.compile, "trainer.compile",
         "is not tested with context parallelism (its all-to-all runs inside attention): set trainer.compile=false "
         "or trainer.cp=1")
    if cfg.model.path is not None:
        return
    need(cfg.model.arch != "deepseek_v32", "trainer.cp",
         f"{cp}: {cfg.model.arch}'s sparse attention takes no packed rows, which context parallelism splits "
         "(set trainer.cp=1)")
    need(cfg.model.num_heads % cp == 0, "trainer.cp",
         f"{cp} must divide the model's {cfg.model.num_heads} attention heads (model.num_heads)")


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
