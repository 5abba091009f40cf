"""Prefill/decode disaggregation: one engine made of two vLLM instances joined by a vLLM KV connector.

Each inference worker with `inference.disaggregation.enabled` runs a **prefill instance** (KV role kv_producer) and a
**decode instance** (kv_consumer), both in-process `VLLMEngine`s built from the same config with different engine
arguments. A generation is routed the way vLLM's disaggregated-serving proxy routes a request:

1. prefill: every prompt goes to the prefill instance with max_tokens=1 and kv_transfer_params
   {"do_remote_decode": true}; the instance computes the prompt's KV cache and hands it to its connector, which
   returns the kv_transfer_params the decode side needs (NIXL: remote engine, block ids, host and port);
2. decode: the same prompts go to the decode instance with the caller's sampling parameters and those
   kv_transfer_params; its connector loads the transferred KV cache instead of recomputing the prompt (the last,
   partial block of the prompt is computed locally), and the decode instance samples the whole completion.
The token sampled by the prefill instance is dropped: sampling, logprobs and stop tokens are the decode instance's, so
the sampling contract is exactly VLLMEngine's (rlhpc.infer.engines.vllm).

Connectors: `NixlConnector` on GPU (GPU memory to GPU memory). On vLLM's CPU backend `ExampleConnector` is the one
that works (it writes each layer's KV of the prompt's full blocks to safetensors files under
`<run_dir>/vllm/kv/<host>-<pid>/`, keyed by the prompt's tokens, and the decode instance reads them back); those files
are deleted after every generation and every weight update, so no request ever reads KV computed by older weights.

Weights: `update_weights` loads the same tensors into both instances, which then carry one version. In-flight updates
(`weight_updates`, polled between decode steps) also land in both; a prompt whose KV was transferred before the update
keeps it, as a running request keeps its KV cache in VLLMEngine (its `min_version` is the version it was submitted at).

GPU only (not run on the CPU machines of this project): each instance gets its own GPUs of the worker's share of the
node (prefill: the first `disaggregation.prefill_tensor_parallel_size`, decode: the next `tensor_parallel_size`) and
runs its model in its own worker processes, as CUDA_VISIBLE_DEVICES is read once per process
(`_gpu_instance_config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from rlhpc.config.disaggregation import DECODE, FILE_CONNECTORS, PREFILL
from rlhpc.config.schema import DisaggregationConfig, InferenceConfig
from rlhpc.infer.engines import Completion, Engine
from rlhpc.infer.engines.vllm import VLLMEngine, _gpu_pin_devices, vllm_files
from rlhpc.run.procs import free_port

log = logging.getLogger(__name__)

# Connectors whose prefill side must keep stepping while the decode side pulls (it frees the sent blocks on the
# decode side's notification).
_PULL_CONNECTORS = ("NixlConnector",)


def instance_config(cfg: InferenceConfig, role: str, kv_dir: Path, on_gpu: bool) -> InferenceConfig:
    """The config of one instance: the worker's, with its tensor parallel size and its KV transfer config."""
    pd = cfg.disaggregation
    extra = dict(pd.connector_extra_config)
    if pd.connector in FILE_CONNECTORS:
        extra.setdefault("shared_storage_path", str(kv_dir))
    kv: Dict[str, Any] = dict(kv_connector=pd.connector, kv_role=role, kv_connector_extra_config=extra)
    if pd.connector in _PULL_CONNECTORS:
        kv["kv_buffer_device"] = pd.kv_buffer_device if on_gpu else "cpu"  # CPU backend: the KV cache is host memory
    tp = (pd.prefill_tensor_parallel_size or cfg.tensor_parallel_size) if role == PREFILL else cfg.tensor_parallel_size
    return dataclasses.replace(cfg, tensor_parallel_size=tp, engines_per_node=1, kv_transfer_config=kv,
                               disaggregation=DisaggregationConfig())


class DisaggregatedVLLMEngine(Engine):
    """A prefill VLLMEngine and a decode VLLMEngine behind the Engine interface (see the module docstring)."""

    supports_inflight_updates = True

    @property
    def loads_in_parts(self) -> bool:
        return self.prefill.loads_in_parts and self.decode.loads_in_parts

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        cfg: Optional[InferenceConfig] = None,
        run_dir: Optional[str] = None,
        seed: int = 0,
    ):
        cfg = cfg if cfg is not None else InferenceConfig(engine="vllm")
        pd = cfg.disaggregation
        self.cfg = cfg
        self.connector = pd.connector
        ptp = pd.prefill_tensor_parallel_size or cfg.tensor_parallel_size
        _gpu_pin_devices(cfg, tp=ptp + cfg.tensor_parallel_size)  # the worker's share of the node, both instances
        devices = _gpu_devices()
        self.on_gpu = bool(devices)
        self.kv_dir = vllm_files(run_dir) / "kv" / f"{socket.gethostname()}-{os.getpid()}"
        self.kv_dir.mkdir(parents=True, exist_ok=True)
        self.weight_updates: Optional[Callable[[], Any]] = None
        t0 = time.time()
        instances = []
        for role, share in ((PREFILL, slice(0, ptp)), (DECODE, slice(ptp, ptp + cfg.tensor_parallel_size))):
            icfg = instance_config(cfg, role, self.kv_dir, self.on_gpu)
            if self.on_gpu:
                icfg = _gpu_instance_config(icfg, devices[share])
            with _instance_environment(self.connector):
                instances.append(VLLMEngine(model_path, dtype=dtype, cfg=icfg, run_dir=run_dir, seed=seed))
        self.prefill, self.decode = instances
        # Prompt tokens the decode instance did not compute: taken from the connector (or its own prefix cache).
        self.transferred_tokens = 0
        log.info("prefill/decode engine up in %.1fs (%s, prefill tp=%d, decode tp=%d)", time.time() - t0,
                 self.connector, ptp, cfg.tensor_parallel_size)

    # ---- versions ---------------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.decode.version

    @version.setter
    def version(self, v: int) -> None:
        self.prefill.version = v
        self.decode.version = v

    @property
    def updates_applied(self) -> int:
        return self.decode.updates_applied

    @property
    def update_s(self) -> float:
        return self.prefill.update_s + self.decode.update_s

    # ---- generation -------------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        temperature: float,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        greedy: bool = False,
    ) -> List[List[Completion]]:
        submitted = self.version
        try:
            handoff = self.prefill_prompts(prompts)
            params = self.decode.sampling_params(n, temperature, max_new_tokens, stop_token_ids, greedy)
            outs = self.decode.run(prompts, params, kv_transfer_params=handoff, between_steps=self._between_decode_steps)
        finally:
            self._forget_transferred_kv()
        self.transferred_tokens += sum(o.num_cached_tokens or 0 for o in outs)
        return self.decode.completions(outs, n, greedy, submitted)

    def prefill_prompts(self, prompts: Sequence[Sequence[int]]) -> List[Optional[Dict[str, Any]]]:
        """Computes the prompts' KV cache on the prefill instance and hands it to the connector; returns, per prompt,
        the kv_transfer_params for the decode instance (None for connectors that find the KV by the prompt's tokens)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        outs = self.prefill.run(prompts, params, kv_transfer_params=[{"do_remote_decode": True}] * len(prompts))
        return [o.kv_transfer_params for o in outs]

    def _between_decode_steps(self) -> None:
        if self.weight_updates is not None and self.cfg.inflight_updates:
            update = self.weight_updates()
            if update is not None:
                self._load_both(update.tensors, update.version)
                log.info("weights version %d loaded in flight into both instances", update.version)
        if self.connector in _PULL_CONNECTORS:  # the prefill side releases sent blocks when it hears they arrived
            with self.prefill._active():
                self.prefill.engine.step()

    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> List[List[float]]:
        return self.decode.score(sequences, temperature)

    # ---- weights ----------------------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: Optional[int] = None) -> None:
        """The same tensors into both instances; `version` labels the tokens generated from now on."""
        self._load_both(named_tensors, version)
        self._forget_transferred_kv()

    def _load_both(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: Optional[int]) -> None:
        tensors = list(named_tensors)  # read twice
        for instance in (self.prefill, self.decode):
            with instance._active():
                instance._load(tensors)
        if version is not None:
            self.version = version
        for instance in (self.prefill, self.decode):
            with instance._active():
                if not instance.engine.has_unfinished_requests():
                    instance.engine.reset_prefix_cache()

    def _forget_transferred_kv(self) -> None:
        """File connectors find KV by the prompt's tokens alone: files left behind would serve KV of older weights
        to a later request with the same prompt (and fill the disk)."""
        if self.connector in FILE_CONNECTORS:
            for entry in self.kv_dir.iterdir():
                shutil.rmtree(entry, ignore_errors=True)

    def close(self) -> None:
        for instance in (getattr(self, "decode", None), getattr(self, "prefill", None)):
            if instance is not None:
                instance.close()
        if getattr(self, "kv_dir", None) is not None:
            shutil.rmtree(self.kv_dir, ignore_errors=True)


@contextlib.contextmanager
def _instance_environment(connector: str):
    """What one instance reads from the process environment while it starts. NIXL listens for the decode side's
    handshake on VLLM_NIXL_SIDE_CHANNEL_PORT, read when the instance starts: each instance gets a free port of its own
    (vLLM caches its environment once an engine runs, so the cache is dropped first). NIXL on the CPU backend also
    pins the starting thread to one core per NUMA node for its transfers; the worker's own threads keep their cores."""
    import vllm.envs as envs

    affinity = os.sched_getaffinity(0)
    if connector in _PULL_CONNECTORS:
        envs.disable_envs_cache()
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port(""))
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)


def _gpu_devices() -> List[str]:
    """The GPUs this worker may use (after _gpu_pin_devices), without initializing CUDA; none on the CPU backend."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d]
    return [str(i) for i in range(torch.cuda.device_count())]


# ---- GPU only -----------------------------------------------------------------------------------------------------


def _gpu_instance_config(cfg: InferenceConfig, devices: List[str]) -> InferenceConfig:
    """An instance on its own GPUs. CUDA reads CUDA_VISIBLE_DEVICES once per process, so an instance's model must live
    in worker processes started while the variable names its GPUs: the multiprocessing executor even at tensor
    parallel size 1 (this process never initializes CUDA), and weight updates through a file the workers reload
    (tensors do not travel through vLLM's RPC)."""
    if len(devices) != cfg.tensor_parallel_size:
        raise ValueError(f"config key `inference.disaggregation.prefill_tensor_parallel_size`: the instance needs "
                         f"{cfg.tensor_parallel_size} GPU(s) but the worker has {len(devices)} left ({devices})")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)  # inherited by the instance's worker processes
    engine_args = {"distributed_executor_backend": "mp", **cfg.engine_args}
    return dataclasses.replace(cfg, weight_update="file", engine_args=engine_args)
