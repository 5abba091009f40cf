"""The vLLM engine: an in-process vLLM engine driven step by step, so new weights can land between two decode steps.

Why in-process: with `VLLM_ENABLE_V1_MULTIPROCESSING=0` and one worker (tensor_parallel_size 1) the engine core, the
scheduler and the model live in this process. Weight updates are then plain function calls on the model runner with the
tensors the weights group delivered (tensors do not pickle through vLLM's RPC), and "pausing" a generation needs no
protocol: between two `LLMEngine.step()` calls nothing runs, the scheduler keeps every request and its KV cache.

Sampling contract (the same as the transformers engine): completions are drawn from softmax(logits / temperature) with
no top-k, top-p, min-p or penalties, and each token's logprob is reported under exactly that distribution. vLLM's
default `raw_logprobs` would report log_softmax(logits), before the temperature: we run with
`logprobs_mode="processed_logprobs"`, the logprobs of the distribution the sampler actually drew from, which is what the
trainer recomputes. Generation stops at the caller's stop token ids only (the model's eos is ignored; `ignore_eos`),
and the stop token is part of the completion. Greedy completions report logprobs under softmax(logits) (temperature 1).

Weight updates (`update_weights`, HF checkpoint names):
- CPU, or `inference.weight_update=reload`, or a quantized model: `model_runner.reload_weights(weights_iterator=...)`,
  which re-runs the loader's post-processing (the CPU backend repacks weights for oneDNN; FP8 re-quantizes). A plain
  in-place `load_weights` fails on the CPU backend.
- GPU (auto): the model's own in-place `load_weights` (`_gpu_load_weights_inplace`), no re-processing.
- tensor_parallel_size > 1 (or `inference.weight_update=file`): the workers are separate processes, so the update is
  written as a safetensors file under the run directory and every worker reloads it from there (`_reload_from_file`).
After an update between generations the prefix cache is cleared, so no new request reuses KV computed by old weights.

In-flight updates: set `engine.weight_updates` to a callable returning the newest `rlhpc.transport.weights.Update` or None (the
worker's `receiver.poll`). `generate` then polls it between decode steps and applies what arrives; running requests keep
their KV cache (computed by the older weights) and continue with the new weights. vLLM labels every output token with
the weights version in force when it was sampled; each completion reports its oldest (`min_version`, conservatively the
version when its request entered the engine) and newest (`max_version`) version and the per-token spans.

Files: vLLM and torch.compile write caches under the home folder and /tmp; they go under `<run_dir>/vllm/` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from rlhpc.config.schema import InferenceConfig
from rlhpc.infer.engines import Completion, Engine
from rlhpc.patches import vllm as patches

log = logging.getLogger(__name__)

# CPU KV cache when `inference.kv_cache_gb` is 0: on CPU vLLM would read gpu_memory_utilization as a share of host RAM.
_CPU_DEFAULT_KV_CACHE_GB = 0.25


@dataclass
class VersionedCompletion(Completion):
    """A completion that also says which weights versions produced it (they differ after an in-flight update)."""

    # Oldest version whose weights computed any of its tokens or their KV cache.
    min_version: Optional[int] = None
    # Version that sampled its last token.
    max_version: Optional[int] = None
    # (version, start, end): completion tokens [start, end) were sampled by that version.
    version_spans: List[Tuple[int, int, int]] = field(default_factory=list)


def vllm_files(run_dir: Optional[str]) -> Path:
    """Points everything vLLM, torch.compile and triton write at `<run_dir>/vllm/` (set before vLLM is imported: vLLM
    freezes its environment once an engine has started). Without a run directory: a fresh temporary folder."""
    root = Path(run_dir) / "vllm" if run_dir else _temp_folder("rlhpc-vllm-")
    for sub in ("cache", "config", "inductor", "triton", "rpc", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = {
        "VLLM_CACHE_ROOT": root / "cache",
        "VLLM_CONFIG_ROOT": root / "config",
        "VLLM_RPC_BASE_PATH": _rpc_folder(root / "rpc"),
        "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
        "TRITON_CACHE_DIR": root / "triton",
    }
    for key, path in env.items():
        os.environ[key] = str(path)
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return root


# A Unix socket's path has at most 107 bytes; vLLM names its sockets `<VLLM_RPC_BASE_PATH>/<uuid4>` (37 more).
_MAX_RPC_BASE = 107 - 37


def _rpc_folder(wanted: Path) -> Path:
    """Where vLLM's Unix sockets (tensor_parallel_size > 1) go: under the run directory when its path is short enough
    for a socket name, else in a fresh folder of this node's temporary directory (a deep run directory)."""
    if len(str(wanted.absolute())) <= _MAX_RPC_BASE:
        return wanted
    return _temp_folder("rlhpc-rpc-")


# Temporary folders made by this process, removed when it ends (remove_temp_folders).
_TEMP_FOLDERS: List[Path] = []


def _temp_folder(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if not _TEMP_FOLDERS:
        atexit.register(remove_temp_folders)
    _TEMP_FOLDERS.append(path)
    return path


def remove_temp_folders() -> None:
    """Removes the temporary folders this process made for vLLM: at interpreter exit, and from rlhpc.role before its
    os._exit (which skips atexit). A process killed by SIGKILL leaves them to the node's temporary-file cleaning."""
    while _TEMP_FOLDERS:
        shutil.rmtree(_TEMP_FOLDERS.pop(), ignore_errors=True)


class _QuietRotaryReload(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" on every update: rotary embeddings have
    no checkpoint weights, and their cache is put back as it was. Other layers' warnings still pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


class VLLMEngine(Engine):
    supports_inflight_updates = True

    @property
    def loads_in_parts(self) -> bool:
        """Whether update_weights takes any subset of the tensors (weights.receive=in_place): vLLM's in-place
        load_weights does (GPU); reloading layer by layer or from a file needs the whole model at once."""
        return self._update_path() == "in-place load_weights"

    # Engines of this process whose model runs in it (tensor_parallel_size 1). They share vLLM's process-global
    # torch.distributed state, which only the last one to close may tear down.
    _in_process = 0

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        cfg: Optional[InferenceConfig] = None,
        run_dir: Optional[str] = None,
        seed: int = 0,
    ):
        cfg = cfg if cfg is not None else InferenceConfig(engine="vllm")
        if cfg.weight_update not in ("auto", "reload", "inplace", "file"):
            raise ValueError(f"config key `inference.weight_update`: {cfg.weight_update!r} is not one of auto, reload, "
                             "inplace, file")
        # In-process engine core: weight tensors reach the model by reference and generation is stepped from here.
        mp = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if mp != "0":
            raise RuntimeError("VLLM_ENABLE_V1_MULTIPROCESSING is set to 1: rlhpc's vLLM engine runs the engine core "
                               "in-process (unset it)")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # shared CPU nodes: do not pin threads to cores
        _gpu_pin_devices(cfg)  # before anything initializes CUDA
        self.files = vllm_files(run_dir)
        self.cfg = cfg
        self.model_path = model_path

        patches.check()
        from vllm import LLM
        from vllm.platforms import current_platform

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietRotaryReload())

        self.on_gpu = current_platform.is_cuda_alike()
        args = engine_args(cfg, model_path, dtype, seed, self.on_gpu)
        t0 = time.time()
        self._kv_connector: Any = None  # this engine's worker-side KV connector (see _active)
        with patches.keep_set_num_threads(), patches.tempdir(self.files / "tmp"), self._eager(), \
                patches.own_kv_connector(lambda c: setattr(self, "_kv_connector", c)):
            self.llm = LLM(**args)
        self._holds_dist = cfg.tensor_parallel_size == 1
        VLLMEngine._in_process += self._holds_dist
        self.engine = self.llm.llm_engine
        self._vocab = self.engine.model_config.get_vocab_size()
        self._tied = {name: [a for a in group if a != name]
                      for group in self.llm.collective_rpc(_tied_parameters)[0] for name in group}
        self._ids = count()
        self.version = 0  # the weights it loaded: the trainer's initial weights are version 0
        # In-flight updates: a callable returning the newest rlhpc.transport.weights.Update or None (e.g. receiver.poll).
        self.weight_updates: Optional[Callable[[], Any]] = None
        self.updates_applied = 0
        self.update_s = 0.0
        log.info("vLLM engine for %s up in %.1fs (%s, tp=%d, weight updates: %s)", model_path, time.time() - t0,
                 "GPU" if self.on_gpu else "CPU", cfg.tensor_parallel_size, self._update_path())

    # ---- versions ---------------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The weights version in force: 0 (the loaded checkpoint) until an update says otherwise."""
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        self._version = int(v)
        self.engine.set_weight_version(str(int(v)))

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
        submitted = self._version
        params = self.sampling_params(n, temperature, max_new_tokens, stop_token_ids, greedy)
        outs = self.run(prompts, params, between_steps=self._apply_inflight_update)
        return self.completions(outs, n, greedy, submitted)

    def sampling_params(self, n: int, temperature: float, max_new_tokens: int, stop_token_ids: Sequence[int],
                        greedy: bool) -> Any:
        """The sampling contract of the module docstring as vLLM SamplingParams."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1 if greedy else n,  # vLLM refuses n > 1 for greedy: the n completions are copies of one
            temperature=0.0 if greedy else temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            max_tokens=max_new_tokens,
            stop_token_ids=list(stop_token_ids),
            ignore_eos=True,
            logprobs=0,  # just the sampled token's
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        params: Any,
        kv_transfer_params: Optional[Sequence[Optional[Dict[str, Any]]]] = None,
        between_steps: Optional[Callable[[], None]] = None,
    ) -> List[Any]:
        """Adds one request per prompt and steps the engine until all are finished; returns vLLM's RequestOutputs in
        prompt order. `kv_transfer_params` (one per prompt) go to the KV connector (prefill/decode disaggregation);
        `between_steps` runs before every step, when nothing runs in the engine."""
        from vllm.exceptions import VLLMValidationError

        ids = [f"g{next(self._ids)}" for _ in prompts]
        internal: List[str] = []
        done: Dict[str, Any] = {}
        try:
            with self._active():
                for k, (i, p) in enumerate(zip(ids, prompts)):
                    request_params = params
                    if kv_transfer_params is not None:
                        request_params = params.clone()
                        request_params.extra_args = {"kv_transfer_params": kv_transfer_params[k]}
                    try:
                        internal.append(self.engine.add_request(i, {"prompt_token_ids": list(p)}, request_params))
                    except (ValueError, VLLMValidationError) as e:  # too long for max_model_len, unknown token ids
                        raise ValueError(f"vLLM refused a prompt of {len(p)} tokens with max_new_tokens="
                                         f"{params.max_tokens} (config keys `inference.max_model_len`, "
                                         f"`env.max_new_tokens`): {e}") from e
            while True:
                if between_steps is not None:
                    between_steps()
                with self._active():
                    if not self.engine.has_unfinished_requests():
                        break
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
        finally:
            left = [r for i, r in zip(ids, internal) if i not in done]
            if left:
                with self._active():
                    self.engine.abort_request(left)
        return [done[i] for i in ids]

    def completions(self, outs: Sequence[Any], n: int, greedy: bool, submitted: int) -> List[List[Completion]]:
        groups = [[self._completion(c, submitted) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]
        return [[replace(g[0]) for _ in range(n)] if greedy else g for g in groups]

    def _apply_inflight_update(self) -> None:
        """Between two steps nothing runs and every request stays scheduled: new weights can land."""
        if self.weight_updates is None or not self.cfg.inflight_updates:
            return
        update = self.weight_updates()
        if update is not None:
            with self._active():
                self._load(update.tensors)
            self.version = update.version
            log.info("weights version %d loaded in flight (%d requests running)", update.version,
                     self.engine.get_num_unfinished_requests())

    @staticmethod
    def _completion(c: Any, submitted: int) -> VersionedCompletion:
        # vLLM labels each output token with the version set when it was sampled. The request entered the engine at
        # `submitted`: its prompt's KV cache (or a prefix-cache hit) may come from that version, so that is the oldest.
        spans = [(int(s.version), s.start, s.end) for s in (c.weight_versions or [])]
        return VersionedCompletion(
            tokens=list(c.token_ids),
            logprobs=list(c.logprobs.logprobs),
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            min_version=min([submitted] + [v for v, _, _ in spans]),
            max_version=spans[-1][0] if spans else submitted,
            version_spans=spans,
        )

    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> List[List[float]]:
        """Prompt logprobs of whole sequences. vLLM computes prompt logprobs before any temperature, so at a
        temperature other than 1 this asks for the full distribution and rescales it (slow: for checking only)."""
        from vllm import SamplingParams

        full = temperature != 1.0
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1 if full else 0, flat_logprobs=True,
                                detokenize=False)
        with self._active():
            outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
        result = []
        for seq, out in zip(sequences, outs):
            flat = out.prompt_logprobs  # position 0 has none; position i: the distribution of token i given its prefix
            base = flat.start_indices[1]
            lp = torch.tensor(flat.logprobs[base:], dtype=torch.float32)
            tok = torch.tensor(flat.token_ids[base:], dtype=torch.long)
            counts = torch.tensor(flat.end_indices[1:]) - torch.tensor(flat.start_indices[1:])
            pos = torch.repeat_interleave(torch.arange(len(counts)), counts)
            target = torch.as_tensor(list(seq[1:]), dtype=torch.long)
            if full:
                # log_softmax(raw / T) == log_softmax(logits / T): a per-position shift does not change a softmax.
                table = torch.full((len(counts), self._vocab), float("-inf"))
                table[pos, tok] = lp
                picked = torch.log_softmax(table / temperature, dim=-1).gather(1, target[:, None]).squeeze(1)
            else:  # each position lists its own token (and possibly the top-1 beside it)
                hit = tok == target[pos]
                picked = torch.full((len(counts),), float("nan"))
                picked[pos[hit]] = lp[hit]
            result.append(picked.tolist())
        return result

    # ---- weights ----------------------------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: Optional[int] = None) -> None:
        """Loads tensors under their HF checkpoint names; `version` labels the tokens generated from now on."""
        with self._active():
            self._load(named_tensors)
            if version is not None:
                self.version = version
            if not self.engine.has_unfinished_requests():
                self.engine.reset_prefix_cache()

    def _update_path(self) -> str:
        if self.cfg.tensor_parallel_size > 1 or self.cfg.weight_update == "file":
            return "reload from file"
        if self.cfg.weight_update == "inplace" or (
            self.cfg.weight_update == "auto" and self.on_gpu and self.cfg.quantization is None
        ):
            return "in-place load_weights"
        return "reload_weights"

    def _eager(self) -> contextlib.AbstractContextManager:
        """With enforce_eager the model is not compiled, but vLLM still torch.compiles small sampler helpers (the rank
        of a sampled token): ~10 s of inductor compilation at the first generation on CPU, for no measurable gain.
        Dynamo is off only around this engine's own calls."""
        import torch._dynamo

        return torch._dynamo.config.patch(disable=True) if self.cfg.enforce_eager else contextlib.nullcontext()

    def _active(self) -> contextlib.AbstractContextManager:
        """Around every call into the engine: dynamo off (see _eager) and this engine's KV connector installed."""
        stack = contextlib.ExitStack()
        stack.enter_context(self._eager())
        if self._kv_connector is not None:
            stack.enter_context(patches.installed_kv_connector(self._kv_connector))
        return stack

    def _load(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        t0 = time.time()
        path = self._update_path()
        named_tensors = _with_tied(list(named_tensors), self._tied)
        if path == "reload from file":
            _reload_from_file(self.llm, self.files / f"update-{os.getpid()}", named_tensors)
        elif path == "in-place load_weights":
            if not self.on_gpu:
                raise ValueError("config key `inference.weight_update`: 'inplace' works on GPU only; the CPU backend "
                                 "repacks weights when loading (use auto or reload)")
            self.llm.collective_rpc(_gpu_load_weights_inplace, args=(named_tensors,))
        else:
            self.llm.collective_rpc(_reload_weights, args=(named_tensors,))
        self.updates_applied += 1
        self.update_s += time.time() - t0

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        VLLMEngine._in_process -= self._holds_dist
        # An in-process EngineCore tears down vLLM's process-global distributed state when it shuts down; while another
        # engine of this process still uses that state, keep it.
        keep = VLLMEngine._in_process > 0
        with patches.no_dist_cleanup() if keep else contextlib.nullcontext():
            with contextlib.suppress(Exception), self._active():
                llm.llm_engine.engine_core.shutdown()
        if self._kv_connector is not None:
            with contextlib.suppress(Exception):
                self._kv_connector.shutdown()
            self._kv_connector = None
        del llm, self.engine
        if not keep:
            with contextlib.suppress(Exception):
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()


def engine_args(cfg: InferenceConfig, model_path: str, dtype: str, seed: int, on_gpu: bool) -> Dict[str, Any]:
    """vLLM's EngineArgs for an instance of `cfg`; the leader of an instance over several nodes and its followers
    (rlhpc.infer.follower) build theirs here, so that they agree."""
    args: Dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_model_len=_max_model_len(model_path, cfg.max_model_len),
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager,
        quantization=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype,
        enable_prefix_caching=cfg.enable_prefix_caching,
        # The logprobs of softmax(logits / temperature), the distribution sampled from (see the module docstring).
        logprobs_mode="processed_logprobs",
        max_logprobs=-1,  # score() at a temperature other than 1 needs the full prompt distribution
        generation_config="vllm",  # no sampling defaults from the checkpoint's generation_config.json
    )
    if on_gpu:
        args.update(_gpu_engine_args(cfg))
    else:
        args["kv_cache_memory_bytes"] = int((cfg.kv_cache_gb or _CPU_DEFAULT_KV_CACHE_GB) * (1 << 30))
    if cfg.kv_transfer_config:
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**cfg.kv_transfer_config)
    args.update(cfg.engine_args)
    return args


def _tied_parameters(worker: Any) -> List[List[str]]:
    """Names that share one parameter in the vLLM model (tied input and output embeddings)."""
    groups: Dict[int, List[str]] = {}
    for name, p in worker.model_runner.model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _with_tied(tensors: List[Tuple[str, torch.Tensor]], tied: Dict[str, List[str]]) -> List[Tuple[str, torch.Tensor]]:
    """A trainer sends a tied weight once (`model.embed_tokens.weight`, not `lm_head.weight`). vLLM's reload tracks
    loads per layer and puts back the old tensor of a layer that received nothing, which would leave the output head on
    the old weights: send the tensor under every name of the tie."""
    names = {n for n, _ in tensors}
    extra = [(alias, t) for n, t in tensors for alias in tied.get(n, ()) if alias not in names]
    return tensors + extra


def _reload_weights(worker: Any, tensors: List[Tuple[str, torch.Tensor]]) -> None:
    """vLLM's reload path: checkpoint-format tensors, loaded layer by layer with the loader's post-processing."""
    worker.model_runner.reload_weights(weights_iterator=iter(tensors))


def _max_model_len(model_path: str, wanted: int) -> int:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return wanted
    limit = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return min(wanted, int(limit)) if limit else wanted


def _reload_from_file(llm: Any, folder: Path, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """tensor_parallel_size > 1: the workers are other processes and tensors do not travel through vLLM's RPC, so the
    update goes through a safetensors file that every worker reloads (its own shard)."""
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors, seen = {}, set()
    for n, t in named_tensors:
        t = t.detach().contiguous().cpu()
        tensors[n] = t.clone() if t.data_ptr() in seen else t  # safetensors refuses two names for one buffer (ties)
        seen.add(t.data_ptr())
    save_file(tensors, str(tmp / "model.safetensors"))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True})


# ---- GPU only -----------------------------------------------------------------------------------------------------


def _gpu_engine_args(cfg: InferenceConfig) -> Dict[str, Any]:
    """Engine arguments that only mean something on GPU: memory share, KV cache size."""
    args: Dict[str, Any] = {"gpu_memory_utilization": cfg.gpu_memory_utilization}
    if cfg.kv_cache_gb:
        args["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * (1 << 30))
    return args


def _gpu_pin_devices(cfg: InferenceConfig, tp: Optional[int] = None) -> None:
    """Several engines per node: the engine with local rank i takes GPUs [i*tp, (i+1)*tp), unless the launcher already
    chose its devices (CUDA_VISIBLE_DEVICES with exactly tp entries); `tp` is the engine's GPU count
    (tensor_parallel_size; both instances' together with prefill/decode disaggregation). Runs before CUDA is
    initialized (device_count asks NVML), as CUDA reads CUDA_VISIBLE_DEVICES once."""
    if cfg.engines_per_node <= 1:
        return
    tp = tp or cfg.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    devices = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if not devices or len(devices) == tp:  # no GPU (CPU backend) or already chosen
        return
    local = int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", "0")))
    mine = devices[local * tp:(local + 1) * tp]
    if len(mine) != tp:
        raise ValueError(f"config key `inference.engines_per_node`: engine {local} needs GPUs {local * tp}..{(local + 1) * tp - 1} "
                         f"but the node shows {len(devices)} ({visible or 'all'})")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


def _gpu_load_weights_inplace(worker: Any, tensors: List[Tuple[str, torch.Tensor]]) -> None:
    """Copies checkpoint tensors into the live parameters (the model's own weight mapping: stacked qkv, gate_up, ...).
    GPU only: it skips the loader's post-processing, which the CPU backend and quantized models need."""
    worker.model_runner.model.load_weights(weights=iter(tensors))
