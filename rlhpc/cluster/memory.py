"""The device mesh of each role and its memory per GPU, estimated from the config before anything starts.

The launcher prints this with the plan (`dry_run=true`) and refuses a run that cannot fit or whose sizes do not divide
(`MemoryPlan.refusal`), naming the keys to change. Everything here is arithmetic over the model's Hugging Face config;
no model is built and no GPU is needed. A role without GPUs (`on_gpus`) is planned as what it will be: CPU processes,
whose memory is the host's (not checked), computing in the master dtype where `trainer.param_dtype=auto` (bfloat16 on
a GPU). The formulas (docs/scaling.md, "Memory per GPU, estimated"):

trainer rank (one GPU each; FSDP2 over all `trainer.num_ranks` = dp_shard x ep x cp; with `trainer.ep` > 1 the
routed experts R of the largest block leave its FSDP unit and a rank gathers R / ep of them, in the compute dtype with
float32 gradients, instead of all R; routing is assumed balanced, so activations stay; with `trainer.cp` > 1 a rank
holds T / cp of the micro-batch's positions, so the activations and the head's rows divide by cp, the attention mask
does not):
    model state  = P x master bytes x (1 parameters + 1 gradients + 2 AdamW moments) / dp_shard
    FSDP working = largest block x (2 x compute bytes + 4)     one block all-gathered, the next prefetched, and the
                                                               block's gradients reduce-scattered in float32
                 + root unit x compute bytes                   embeddings, final norm, lm_head, gathered all step
    activations  = T x sum over blocks of a(block) x compute bytes                (no activation checkpointing)
                 = T x (L x H + max a(block)) x compute bytes                     (checkpointing: block inputs + one
                                                                                   block recomputed in its backward)
    logprob head = 2 x logprob_chunk_tokens x V x 4     (one chunk's float32 logits and their gradient;
                 = 3 x T x V x 4                         without chunks: logits, log-softmax and gradient of all T)
    attention mask = M x (1 + compute bytes) x (L if M = T x W else 1), M = min(T x W, attention_block_elements)
                   (trainer.packing=shared_prefix, rows of at most W = max(pack_row_tokens, max_model_len) tokens:
                   rlhpc/train/attention.py builds the mask from the rows' segments, as bool and the kernel's float
                   copy; when the whole mask fits attention_block_elements each of the L layers keeps its copy for the
                   backward, otherwise one block at a time lives and nothing is kept)
    DSA indexer  = (2 x index_n_heads + 1) x min(T / cp x T, attention_block_elements) x 4   (GLM-5: the indexer
                   scores the rank's T / cp queries against every key of the row in float32, a block of queries at a
                   time, one layer at a time; 0 for other models)
                   + (T / cp x (index_n_heads x index_head_dim + index_topk) + T x index_head_dim) x 4
                                                        (its queries, keys and choice)
with P parameters (`count_parameters`), T = max(trainer.micro_batch_tokens, inference.max_model_len) tokens in the
largest micro-batch (micro-batches pack samples up to micro_batch_tokens padded tokens; a longer sample, at most
max_model_len tokens, gets one of its own) and a(block) the activation elements saved per token by one block
(`block_activation_elements`). With trainer.ep > 1 the routed experts must divide by ep and over num_ranks (refused
naming trainer.ep otherwise); with trainer.cp > 1 the attention heads must divide by cp and the model must take packed
rows (refused naming trainer.cp otherwise; DeepSeek-V3.2's sparse attention does not).

inference instance (tensor_parallel_size GPUs, vLLM; over inference.nodes_per_instance nodes, tp / nodes_per_instance
GPUs on each, when one node's GPUs cannot hold it; the estimate per GPU is the same):
    weights  = (P - embeddings - lm_head) x serving bytes / tp + (embeddings + lm_head) x model.dtype bytes / tp
               (fp8: 1 byte; vLLM keeps the vocabulary matrices in the checkpoint's dtype)
    KV cache = max_model_len x kv bytes per token, against gpu_memory_gb x gpu_memory_utilization - weights
               (vLLM refuses to start without room for one sequence of max_model_len)
    kv bytes per token: GQA  2 x max(kv_heads / tp, 1) x head_dim x layers x kv dtype bytes
                        MLA  (kv_lora_rank + qk_rope_head_dim [+ index_head_dim with DSA]) x layers x kv dtype bytes,
                             the same on every tp rank (one latent head: replicated, not split)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}

# The published shapes of the real-size presets (conf/model/*.yaml), for a plan made where model.path is not readable
# (a dry run on a login node for a checkpoint on the cluster's filesystem). A readable model.path always wins.
# glm_moe_dsa's and minimax_m2's transformers defaults are GLM-5's and MiniMax-M2's configs; the Qwen3 ones are the
# config.json files of Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B.
REFERENCE_SHAPES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "glm5": ("glm_moe_dsa", {}),
    "minimax_m2": ("minimax_m2", {}),
    "qwen3_0_6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True)),
    "qwen3_30b_a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                                        tie_word_embeddings=False)),
}


# ---- the model's shape -----------------------------------------------------------------------------------------------


# What this module reads of a model's Hugging Face config (None where the config has no such setting).
SHAPE_KEYS = ("attention_bias", "decoder_sparse_step", "first_k_dense_replace", "head_dim", "hidden_size",
              "index_head_dim", "index_n_heads", "index_topk", "intermediate_size", "kv_lora_rank", "mlp_layer_types",
              "mlp_only_layers", "model_type", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
              "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
              "num_local_experts", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "tie_word_embeddings",
              "v_head_dim", "vocab_size")


@dataclass(frozen=True)
class Shape:
    """The settings of a model's config that the plan reads (SHAPE_KEYS), as plain values: learned once per model
    and remembered (rlhpc/modeling/remembered.py), so that a launch of a model planned before imports no
    transformers."""

    settings: Dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        if name not in SHAPE_KEYS:
            raise AttributeError(f"{name} is not among memory.SHAPE_KEYS")
        return self.settings.get(name)

    @classmethod
    def of(cls, hf) -> "Shape":
        values = {k: getattr(hf, k, None) for k in SHAPE_KEYS}
        return cls({k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None})


def model_shape(cfg) -> Tuple[Optional[Shape], str]:
    """(the shape of `cfg.model`, where it came from); (None, why) when it cannot be known here. model.path readable
    here: its config.json; no model.path: the tiny model rlhpc builds in code; otherwise the published shape of the
    preset (REFERENCE_SHAPES). Remembered per model (rlhpc/modeling/remembered.py)."""
    from rlhpc.modeling import remembered

    k = remembered.key(cfg.model, [Path(__file__)])
    known = remembered.recall("model-shapes", k)
    if known is not None:
        return (Shape(known["settings"]) if known["settings"] is not None else None), known["source"]
    hf, source = _hf_config(cfg)
    shape = Shape.of(hf) if hf is not None else None
    remembered.remember("model-shapes", k, {"settings": shape.settings if shape else None, "source": source})
    return shape, source


def _hf_config(cfg) -> Tuple[Optional[Any], str]:
    from transformers import AutoConfig

    m = cfg.model
    if m.path and (Path(m.path) / "config.json").is_file():
        return AutoConfig.from_pretrained(m.path), f"{m.path}/config.json"
    if not m.path:
        from rlhpc.modeling import models

        tok = models.build_tokenizer(m.tokenizer_merges, m.tokenizer_added_tokens, m.tokenizer_corpus)
        return models._arch_config(m, len(tok), tok), f"the {m.name} model built in code"
    if m.name in REFERENCE_SHAPES:
        arch, keys = REFERENCE_SHAPES[m.name]
        return AutoConfig.for_model(arch, **keys), f"the published {m.name} shape (model.path is not readable here)"
    return None, f"model.path={m.path} is not readable here and {m.name!r} has no published shape in rlhpc"


def _get(hf, *names, default=None):
    for n in names:
        v = getattr(hf, n, None)
        if v is not None:
            return v
    return default


def is_mla(hf) -> bool:
    """Multi-head latent attention (DeepSeek-V3, GLM-5): keys and values through a low-rank latent."""
    return _get(hf, "kv_lora_rank") is not None


def head_dim(hf) -> int:
    return _get(hf, "head_dim", default=hf.hidden_size // hf.num_attention_heads)


def num_experts(hf) -> int:
    return _get(hf, "n_routed_experts", "num_experts", "num_local_experts", default=0)


def moe_layers(hf) -> List[bool]:
    """Per decoder block: whether its MLP is a mixture of experts (else a dense MLP of intermediate_size)."""
    L, E = hf.num_hidden_layers, num_experts(hf)
    if not E:
        return [False] * L
    types = _get(hf, "mlp_layer_types")
    if types:  # glm_moe_dsa: "dense" | "sparse", derived from first_k_dense_replace
        return [t != "dense" for t in types]
    if _get(hf, "first_k_dense_replace") is not None:  # deepseek_v3, glm4_moe
        return [i >= hf.first_k_dense_replace for i in range(L)]
    dense = set(_get(hf, "mlp_only_layers", default=[]) or [])  # qwen3_moe
    step = _get(hf, "decoder_sparse_step", default=1)
    return [i not in dense and (i + 1) % step == 0 for i in range(L)]


# Per-head RMSNorm of queries and keys (Qwen3), or over the whole projection (MiniMax-M2).
_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "minimax_m2": "full"}


@dataclass
class ParamCount:
    """Parameters of a decoder-only causal LM, by part."""

    embeddings: int
    lm_head: int  # 0 when tied to the embeddings
    final_norm: int
    blocks: List[int]  # one entry per decoder block

    @property
    def total(self) -> int:
        return self.embeddings + self.lm_head + self.final_norm + sum(self.blocks)

    @property
    def root(self) -> int:
        """What FSDP2's root unit holds: everything outside the decoder blocks."""
        return self.embeddings + self.lm_head + self.final_norm


def attention_params(hf) -> int:
    """One block's attention. GQA: q (H x heads x d), k and v (H x kv_heads x d), o (heads x d x H), biases with
    attention_bias, q/k norms (per head, or over the projection). MLA: q_a (H x q_lora) + its norm + q_b (q_lora x heads
    x (nope + rope)) [or q (H x heads x (nope + rope)) without q_lora], kv_a (H x (kv_lora + rope)) + its norm, kv_b
    (kv_lora x heads x (nope + v)), o (heads x v x H); with DSA the indexer: wq_b (q_lora x index_heads x index_dim),
    wk (H x index_dim), a LayerNorm of index_dim (weight and bias), weights_proj (H x index_heads)."""
    H, heads = hf.hidden_size, hf.num_attention_heads
    if is_mla(hf):
        nope, rope, v, kv_lora = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim, hf.kv_lora_rank
        q_lora = _get(hf, "q_lora_rank")
        n = (H * q_lora + q_lora + q_lora * heads * (nope + rope)) if q_lora else H * heads * (nope + rope)
        n += H * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v) + heads * v * H
        if _get(hf, "index_n_heads"):
            ih, idim = hf.index_n_heads, hf.index_head_dim
            n += q_lora * ih * idim + H * idim + 2 * idim + H * ih
        return n
    d, kv = head_dim(hf), hf.num_key_value_heads
    n = H * heads * d + 2 * H * kv * d + heads * d * H
    if _get(hf, "attention_bias", default=False):
        n += heads * d + 2 * kv * d + H
    norm = _QK_NORM.get(hf.model_type)
    if norm == "head":
        n += 2 * d
    elif norm == "full":
        n += heads * d + kv * d
    return n


def mlp_params(hf, moe: bool) -> int:
    """One block's MLP. Dense: gate, up, down (3 x H x intermediate_size). MoE: experts x 3 x H x expert size (the
    moe_intermediate_size, or intermediate_size where the family has none) + the router (experts x H) + shared experts
    (n_shared_experts x 3 x H x expert size)."""
    H = hf.hidden_size
    if not moe:
        return 3 * H * hf.intermediate_size
    E, inter = num_experts(hf), _get(hf, "moe_intermediate_size", default=hf.intermediate_size)
    return E * 3 * H * inter + E * H + _get(hf, "n_shared_experts", default=0) * 3 * H * inter


def routed_expert_params(hf, moe: bool) -> int:
    """One block's routed experts (experts x 3 x H x expert size): what expert parallelism (trainer.ep) spreads."""
    if not moe:
        return 0
    return num_experts(hf) * 3 * hf.hidden_size * _get(hf, "moe_intermediate_size", default=hf.intermediate_size)


def count_parameters(hf) -> ParamCount:
    """The parameters of the model of a Hugging Face decoder config (qwen3, qwen3_moe, glm_moe_dsa, minimax_m2, and
    families shaped like them): embeddings (V x H), per block the attention, the MLP and two RMSNorms (2 x H), a final
    RMSNorm (H), and the lm_head (V x H) unless tied to the embeddings. Buffers (rotary frequencies, GLM-5's expert
    score correction bias) are not parameters."""
    H, V = hf.hidden_size, hf.vocab_size
    attn = attention_params(hf)
    blocks = [attn + mlp_params(hf, moe) + 2 * H for moe in moe_layers(hf)]
    tied = bool(_get(hf, "tie_word_embeddings", default=False))
    return ParamCount(embeddings=V * H, lm_head=0 if tied else V * H, final_norm=H, blocks=blocks)


# ---- activations -----------------------------------------------------------------------------------------------------


def block_activation_elements(hf, moe: bool) -> int:
    """Elements one decoder block saves for its backward, per token (a memory-efficient attention kernel: no
    tokens x tokens term). Two RMSNorms keep input and output (4 H). GQA attention, with q = heads x d and kv =
    kv_heads x d: the q/k norms' input and output, the rotary inputs, the attention's q, k, v and output: 5 q + 5 kv.
    MLA: q_a output and its norm (3 q_lora), kv_a output and its norm (kv_lora + rope + 2 kv_lora), the rotary and
    attention inputs q, k (2 x 2 heads x (nope + rope)), kv_b's output (heads x (nope + v)), v and the output (2 heads x
    v). Dense MLP: gate and up outputs, the activation and the product (4 x intermediate). MoE: per routed copy of the
    token (num_experts_per_tok) its input and the expert's gate, up, activation and product (H + 4 x expert size),
    the router's logits and probabilities (2 x experts), plus the shared experts as a dense MLP."""
    H, heads = hf.hidden_size, hf.num_attention_heads
    if is_mla(hf):
        nope, rope, v, kv_lora = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim, hf.kv_lora_rank
        q_lora = _get(hf, "q_lora_rank", default=0)
        attn = 3 * q_lora + 3 * kv_lora + rope + 4 * heads * (nope + rope) + heads * (nope + v) + 2 * heads * v
    else:
        q, kv = hf.num_attention_heads * head_dim(hf), hf.num_key_value_heads * head_dim(hf)
        attn = 5 * q + 5 * kv
    if moe:
        inter = _get(hf, "moe_intermediate_size", default=hf.intermediate_size)
        k, E = _get(hf, "num_experts_per_tok", default=1), num_experts(hf)
        mlp = k * (H + 4 * inter) + 2 * E + _get(hf, "n_shared_experts", default=0) * 4 * inter
    else:
        mlp = 4 * hf.intermediate_size
    return 4 * H + attn + mlp


def activation_bytes(hf, tokens: int, compute_bytes: int, checkpointing: bool) -> int:
    """Bytes saved for the backward of one micro-batch of `tokens` tokens by the decoder blocks and the final norm
    (2 H per token). Without checkpointing every block's activations; with it each block's input (H per token) plus
    one block's activations, recomputed during its backward."""
    per_block = [block_activation_elements(hf, moe) for moe in moe_layers(hf)]
    if checkpointing:
        elements = hf.num_hidden_layers * hf.hidden_size + max(per_block)
    else:
        elements = sum(per_block)
    return tokens * (elements + 2 * hf.hidden_size) * compute_bytes


def logprob_head_bytes(hf, tokens: int, chunk_tokens: int) -> int:
    """The output head's float32 logits: with chunks (trainer.logprob_chunk_tokens > 0) one chunk's logits and their
    gradient (2 x chunk x V x 4); without, the whole micro-batch's logits, log-softmax and gradient (3 x T x V x 4)."""
    if chunk_tokens > 0:
        return 2 * min(chunk_tokens, tokens) * hf.vocab_size * 4
    return 3 * tokens * hf.vocab_size * 4


def model_state_bytes(params: int, master_bytes: int, ranks: int) -> Dict[str, int]:
    """Parameters, gradients and AdamW's two moments, all in the master dtype, sharded over `ranks` (FSDP2)."""
    share = params * master_bytes / ranks
    return {"parameters": int(share), "gradients": int(share), "AdamW state (2 moments)": int(2 * share)}


# ---- KV cache --------------------------------------------------------------------------------------------------------


def kv_bytes_per_token(hf, tp: int, kv_dtype_bytes: int) -> Tuple[int, str]:
    """(bytes of KV cache per token on one tp rank of an instance (a GPU, or a CPU process), the formula in words)."""
    L = hf.num_hidden_layers
    if is_mla(hf):
        width = hf.kv_lora_rank + hf.qk_rope_head_dim
        what = f"(kv_lora_rank {hf.kv_lora_rank} + qk_rope_head_dim {hf.qk_rope_head_dim}"
        if _get(hf, "index_n_heads"):
            width += hf.index_head_dim
            what += f" + DSA index_head_dim {hf.index_head_dim}"
        return width * L * kv_dtype_bytes, f"{what}) x {L} layers x {kv_dtype_bytes} B, on every tp rank (MLA)"
    kv, d = hf.num_key_value_heads, head_dim(hf)
    per_gpu = max(kv // tp, 1)
    return (2 * per_gpu * d * L * kv_dtype_bytes,
            f"2 x {per_gpu} kv head(s) per tp rank x head_dim {d} x {L} layers x {kv_dtype_bytes} B")


# ---- the plan --------------------------------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    lines: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)  # one sentence each, naming the keys
    keys: List[str] = field(default_factory=list)  # the keys that change the outcome

    @property
    def refusal(self) -> Optional[str]:
        """One paragraph naming what does not fit or divide and the keys to change; None when the plan can run."""
        if not self.problems:
            return None
        keys = ", ".join(dict.fromkeys(self.keys))
        problems = " ".join(p[0].upper() + p[1:] for p in self.problems)
        return f"this plan cannot run. {problems} Change {keys} (dry_run=true prints the estimates)."

    def placed_in(self, plan: str) -> str:
        """The launcher's plan with these lines before its job script (or at its end)."""
        head, sep, script = plan.partition("\n\n----- job script -----")
        return "\n".join([head] + self.lines) + sep + script


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 1024**2:,.1f} MiB"


def _params(n: float) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"


def _row(name: str, n: float, formula: str) -> str:
    return f"    {name:<30}{_gib(n):>14}   {formula}".rstrip()


def on_gpus(cfg, role: str) -> bool:
    """Whether the processes of `role` ("trainer" or "inference") compute on GPUs, as the launcher will place them: a
    local run's when this machine has GPUs (`local_gpus` hands them out), a Slurm job's when its component asks for
    them (cluster.<role>.gpus_per_node); and wherever cluster.gpu_memory_gb gives the GPUs' memory (a plan for a GPU
    cluster made on a machine without one)."""
    if float(getattr(cfg.cluster, "gpu_memory_gb", 0) or 0):
        return True
    if cfg.launcher.name == "local":
        from rlhpc.cluster.local_launcher import local_gpus

        return bool(local_gpus(cfg, role, 0))
    return getattr(cfg.cluster, role).gpus_per_node > 0


def _unit(gpu: bool) -> str:
    """What one share of a role's memory is: a GPU's, or a CPU process's (the host's memory)."""
    return "GPU" if gpu else "CPU process"


def plan(cfg) -> MemoryPlan:
    """The device mesh of each role and the memory one of its GPUs (or, without GPUs, one of its processes) needs,
    against `cluster.gpu_memory_gb` (0 or unset: no memory check); refuses sizes that do not divide."""
    out = MemoryPlan()
    gpus = {role: on_gpus(cfg, role) for role in ("trainer", "inference")}
    per = (_unit(gpus["trainer"]) if gpus["trainer"] == gpus["inference"]
           else f"trainer {_unit(gpus['trainer'])} and inference {_unit(gpus['inference'])}")
    instances = _meshes(cfg, gpus, out)
    try:
        hf, source = model_shape(cfg)
        counts = count_parameters(hf) if hf is not None else None
    except Exception as e:  # noqa: BLE001 - a shape this module does not know must not stop a launch
        hf, source = None, f"{type(e).__name__}: {e}"
    if hf is None or counts is None:
        out.lines.append(f"  memory per {per}: not estimated ({source})")
        return out
    _experts_divide(cfg, hf, out)
    _context_divides(cfg, hf, out)
    gpu_gb = float(getattr(cfg.cluster, "gpu_memory_gb", 0) or 0)
    check = (f"against cluster.gpu_memory_gb={gpu_gb:g}" if gpu_gb else
             "not checked: no cluster.gpu_memory_gb" if any(gpus.values()) else "host memory, not checked")
    out.lines.append(f"  memory per {per}, estimated ({_params(counts.total)} parameters from {source}; {check}):")
    _trainer(cfg, hf, counts, gpu_gb, gpus["trainer"], out)
    _inference(cfg, hf, counts, gpu_gb, instances, gpus["inference"], out)
    _disk(cfg, counts, out)
    return out


def _disk(cfg, counts: ParamCount, out: MemoryPlan) -> None:
    """What the run writes under run_dir, against the space free there (docs/fault-tolerance.md, "A full disk"):

        checkpoint = P x master bytes x 3             (the parameters and 2 AdamW moments; 2 are kept, and the next is
                                                       written beside them)
        models     = P x model.dtype bytes each        (the warm-started model; the weights snapshots, 2 kept and the
                                                       next; the final export) + P x 4 (a model built in code)

    A launch is refused when the space free is less than what the run must write before it can resume from anything:
    the models it starts from and one checkpoint (what a resumed run has written already is not counted again); a dry
    run only says so (it may be made away from the cluster's filesystem). A note when the space is less than the most
    the run holds at once."""
    from rlhpc.run.rundir import free_bytes

    root = Path(cfg.run_dir)
    P = counts.total
    model = P * DTYPE_BYTES.get(cfg.model.dtype, 4)
    ckpt = P * DTYPE_BYTES[cfg.trainer.master_dtype] * 3
    have_ckpts = len(list((root / "checkpoints").glob("step_*")))
    have_snaps = len(list((root / "weights").glob("v*")))
    start = (0 if cfg.model.path or (root / "base_model").exists() else P * 4) + \
        (0 if (root / "model" / "READY").exists() else model) + (0 if have_snaps else model)
    least = start + ckpt
    most = start + max(0, 3 - have_ckpts) * ckpt + max(0, 3 - max(have_snaps, 1)) * model + \
        (0 if (root / "checkpoints" / "final").exists() else model)
    free = free_bytes(root)
    where = f"{_gib(free)} free" if free is not None else "free space unknown"
    out.lines.append(f"  disk under run_dir={root} ({where}), estimated:")
    out.lines.append(_row("checkpoint", ckpt, f"{_params(P)} x {DTYPE_BYTES[cfg.trainer.master_dtype]} B x 3 "
                          "(parameters + 2 AdamW moments)"))
    out.lines.append(_row("before the first checkpoint", least, "the models the run starts from + one checkpoint"))
    out.lines.append(_row("at most", most, "+ 2 more checkpoints, weights snapshots and the final export"))
    if free is None:
        return
    if free < least:
        problem = (f"the filesystem of run_dir={root} has {_gib(free)} free, and the run writes {_gib(least)} before "
                   f"it can resume from a checkpoint (the models it starts from and one checkpoint of {_params(P)} "
                   "parameters with their AdamW moments): free space there or choose another run_dir.")
        if cfg.dry_run:  # a plan made away from the cluster's filesystem: told, not refused
            out.lines.append(f"    note: a launch with this run_dir is refused: {problem}")
        else:
            out.problems.append(problem)
            out.keys.append("run_dir")
    elif free < most:
        out.lines.append(f"    note: {_gib(free)} free is less than the {_gib(most)} the run may hold at once; a full "
                         "disk stops it (it resumes from its last checkpoint once there is room)")


def _meshes(cfg, gpus: Dict[str, bool], out: MemoryPlan) -> List[Tuple[str, int, str]]:
    """The trainer's mesh (dp_shard x ep x cp = num_ranks) and the inference instances (name, tp, its config key), on
    GPUs or CPU processes (`gpus`: on_gpus of each role)."""
    ranks, inf, ep, cp = cfg.trainer.num_ranks, cfg.inference, cfg.trainer.ep, cfg.trainer.cp
    mesh = {"dp_shard": ranks // max(ep * cp, 1), "ep": ep, "cp": cp}
    how = "FSDP2 over all ranks" if ranks > 1 or cfg.trainer.fsdp else "one process, no FSDP"
    parts = []
    if ep > 1:
        parts.append(f"routed experts: each rank computes 1/{ep} of them, all-to-all over {ep} ranks; every parameter "
                     f"stored over all {ranks} ranks")
    else:
        parts.append(f"{how}; trainer.ep spreads a MoE's routed experts")
    if cp > 1:
        parts.append(f"context: {cp} consecutive ranks split each packed row, {ranks // cp} group(s) split the batch")
    else:
        parts.append("trainer.cp splits a sequence over ranks")
    out.lines.append(f"  trainer mesh: dp_shard={mesh['dp_shard']} x ep={ep} x cp={cp} = {math.prod(mesh.values())} "
                     f"rank(s), one {_unit(gpus['trainer'])} each ({'; '.join(parts)})")
    if math.prod(mesh.values()) != ranks:  # config validation keeps ep | num_ranks; the check the mesh must keep
        out.problems.append(f"the trainer mesh {mesh} does not multiply to trainer.num_ranks={ranks}.")
        out.keys.append("trainer.num_ranks")
    pd = inf.disaggregation
    if inf.engine != "vllm":
        where = "one GPU" if gpus["inference"] else "the CPU"
        out.lines.append(f"  inference mesh: {inf.num_workers} worker(s) x 1 {inf.engine} engine on {where} (tp=1)")
        return []
    instances = [("decode" if pd.enabled else "engine", inf.tensor_parallel_size, "inference.tensor_parallel_size")]
    if pd.enabled:
        instances.insert(0, ("prefill", pd.prefill_tensor_parallel_size or inf.tensor_parallel_size,
                             "inference.disaggregation.prefill_tensor_parallel_size"))
    n = inf.nodes_per_instance  # config validation keeps it >= 1, dividing tp, and 1 with disaggregation
    per_node = f"{inf.tensor_parallel_size // n} {'GPUs' if gpus['inference'] else 'CPU processes'} a node"
    over = f" over {n} nodes, {per_node}" if n > 1 else ""
    layout = " + ".join(f"1 {name} instance (tp={tp}{over})" for name, tp, _ in instances)
    out.lines.append(f"  inference mesh: {inf.num_workers} worker(s) x [{layout}]")
    return instances


def _experts_divide(cfg, hf, out: MemoryPlan) -> None:
    """With expert parallelism (trainer.ep > 1): the model is a MoE whose routed experts divide over the ep groups
    (each computes experts / ep) and over the trainer.num_ranks ranks that store them (one dim-0 shard each). The
    config check knows the expert count of a model built in code only; this one knows it from the model's shape."""
    ep, ranks, E = cfg.trainer.ep, cfg.trainer.num_ranks, num_experts(hf)
    if ep <= 1:
        return
    if not E:
        out.problems.append(f"expert parallelism trainer.ep={ep} needs a MoE model, and {cfg.model.name} has no routed "
                            "experts (set trainer.ep=1).")
    elif E % ep:
        out.problems.append(f"the model's {E} routed experts do not divide into trainer.ep={ep} groups.")
    elif E % ranks:
        out.problems.append(f"the model's {E} routed experts do not divide over the trainer.num_ranks={ranks} ranks "
                            "that store them (one shard of whole experts each).")
    else:
        return
    out.keys += ["trainer.ep", "trainer.num_ranks"]


def _context_divides(cfg, hf, out: MemoryPlan) -> None:
    """With context parallelism (trainer.cp > 1): each of the cp ranks attends with heads / cp of the model's heads
    (key/value heads repeated until cp divides them), and the model takes split rows (DeepSeek-V3.2 does not).
    The same checks as the trainer makes when it installs cp (rlhpc/train/context.py), here from the model's shape."""
    cp, heads = cfg.trainer.cp, hf.num_attention_heads
    if cp <= 1:
        return
    kv = getattr(hf, "num_key_value_heads", None) or heads
    if getattr(hf, "model_type", None) == "deepseek_v32":
        out.problems.append(f"context parallelism trainer.cp={cp}: {cfg.model.name}'s sparse attention takes no packed "
                            "rows, which cp splits (set trainer.cp=1).")
    elif heads % cp:
        out.problems.append(f"context parallelism trainer.cp={cp} does not divide the model's {heads} attention heads.")
    elif heads % math.lcm(kv, cp):
        out.problems.append(f"context parallelism trainer.cp={cp}: the model's {kv} key/value heads cannot be repeated "
                            f"to a multiple of cp that divides its {heads} attention heads.")
    else:
        return
    out.keys.append("trainer.cp")


def attention_mask_bytes(cfg, hf, tokens: int, compute_bytes: int) -> Tuple[int, str]:
    """The attention masks of packed rows (module docstring), and how the figure is made. 0 when samples are padded
    one per row (trainer.packing=padded). GLM-5 builds each block's mask of the chosen keys besides (one more byte an
    element), and keeps the indexer's choice of every query of the row for the backward, T x index_topk x 4 B a layer
    (one layer with activation checkpointing)."""
    tr = cfg.trainer
    sparse = bool(_get(hf, "index_n_heads"))
    if tr.packing != "shared_prefix":
        return 0, ""
    width = min(tokens, max(tr.pack_row_tokens, cfg.inference.max_model_len))
    whole = tokens * width
    elements = min(whole, tr.attention_block_elements)
    layers = hf.num_hidden_layers if whole <= tr.attention_block_elements else 1
    per = f"({1 + sparse} + {compute_bytes}) B"
    how = (f"T={tokens} x row {width} x {per} x {layers} layers, kept for the backward"
           if layers > 1 else f"a block of attention_block_elements={elements} x {per} at a time")
    total = elements * (1 + sparse + compute_bytes) * layers
    if sparse:
        kept = 1 if tr.activation_checkpointing else hf.num_hidden_layers
        total += tokens * hf.index_topk * 4 * kept
        how += f"; the choice T x index_topk {hf.index_topk} x 4 B x {kept} layer(s)"
    return total, how


def indexer_scores_bytes(hf, tokens: int, cp: int = 1, block_elements: int = 0) -> int:
    """GLM-5's DSA indexer as transformers computes it (GlmMoeDsaIndexer, without gradients): float32 scores of every
    query against every key for each indexer head, [B, L, index_heads, L], at most index_heads x T x T x 4 B when one
    row fills the micro-batch; the next elementwise op (scale, relu) makes a copy while they live, and their weighted
    sum over heads adds T x T x 4 B: (2 x index_heads + 1) x T x T x 4 B at the peak. Beside them its queries
    (index_heads x index_head_dim a query), keys (index_head_dim a key) and choice (index_topk a query), 4 B each.
    Transient, one layer at a time (again in each block's recompute with checkpointing); 0 for a model without the
    indexer. The trainer's indexer (rlhpc/modeling/sparse.py) scores a rank's T / cp queries (context parallelism)
    `block_elements` / T at a time (trainer.attention_block_elements): (2 x index_heads + 1) x min(T / cp x T,
    block_elements) x 4 B, and the rest as before for its T / cp queries and the row's T keys."""
    heads = _get(hf, "index_n_heads")
    if not heads:
        return 0
    queries = -(-tokens // cp)
    elements = queries * tokens
    scores = (2 * heads + 1) * (min(elements, max(block_elements, tokens)) if block_elements else elements)
    rest = queries * (heads * hf.index_head_dim + hf.index_topk) + tokens * hf.index_head_dim
    return (scores + rest) * 4


def _trainer(cfg, hf, counts: ParamCount, gpu_gb: float, gpu: bool, out: MemoryPlan) -> None:
    """The rows of one trainer rank (module docstring), their total, and the refusal when it exceeds the GPU. `gpu`:
    the ranks compute on GPUs (else CPU processes)."""
    tr, ranks, P = cfg.trainer, cfg.trainer.num_ranks, counts.total
    master = DTYPE_BYTES[tr.master_dtype]
    # auto: bfloat16 on a GPU, the master dtype on the CPU (rlhpc/train/parallel.py)
    compute_dtype = tr.param_dtype if tr.param_dtype != "auto" else "bfloat16" if gpu else tr.master_dtype
    compute = DTYPE_BYTES[compute_dtype]
    tokens = max(tr.micro_batch_tokens, cfg.inference.max_model_len)
    local = -(-tokens // max(tr.cp, 1))  # the positions one rank holds: T / cp
    state = model_state_bytes(P, master, ranks)
    rows = [(k, v, f"{_params(P)} x {master} B{' x 2' if 'AdamW' in k else ''} / {ranks}") for k, v in state.items()]
    if (ranks > 1 or tr.fsdp) and tr.ep > 1:  # the block's routed experts leave FSDP: E/ep of them are gathered
        routed = max(routed_expert_params(hf, moe) for moe in moe_layers(hf))
        block = max(b - routed_expert_params(hf, moe) for b, moe in zip(counts.blocks, moe_layers(hf)))
        rows.append(("FSDP unsharded block", block * (2 * compute + 4),
                     f"{_params(block)} without routed experts x ({compute} B + {compute} B prefetched + 4 B fp32 "
                     "gradients)"))
        rows.append((f"routed experts (1/{tr.ep})", routed // tr.ep * (compute + 4),
                     f"{_params(routed)} / ep={tr.ep} x ({compute} B + 4 B fp32 gradients)"))
    elif ranks > 1 or tr.fsdp:
        block = max(counts.blocks)
        rows.append(("FSDP unsharded block", block * (2 * compute + 4),
                     f"{_params(block)} x ({compute} B + {compute} B prefetched + 4 B fp32 gradients)"))
    if ranks > 1 or tr.fsdp:
        rows.append(("FSDP root (embed, head, norm)", counts.root * compute, f"{_params(counts.root)} x {compute} B"))
    act = activation_bytes(hf, local, compute, tr.activation_checkpointing)
    on = "checkpointed" if tr.activation_checkpointing else "no checkpointing"
    per_rank = f"T={tokens} / cp={tr.cp} = {local}" if tr.cp > 1 else f"T={tokens}"
    rows.append((f"activations ({on})", act,
                 f"{per_rank} tokens x {act // local // compute:,} elements x {compute} B"))
    mask, how = attention_mask_bytes(cfg, hf, tokens, compute)
    if mask:
        rows.append(("attention mask", mask, how))
    scores = indexer_scores_bytes(hf, tokens, tr.cp, tr.attention_block_elements)
    if scores:
        queries = f"T / cp={tr.cp}" if tr.cp > 1 else "T"
        what = (f"{queries} x T" if local * tokens <= tr.attention_block_elements else
                f"a block of attention_block_elements={tr.attention_block_elements} of the {queries} x T scores")
        rows.append(("DSA indexer scores (transient)", scores,
                     f"(2 x index_n_heads {hf.index_n_heads} + 1) x {what} x 4 B, and queries, keys and choice; one "
                     "layer at a time"))
    head = logprob_head_bytes(hf, local, tr.logprob_chunk_tokens)
    chunk = min(tr.logprob_chunk_tokens, local)
    rows.append(("logprob head", head, f"2 x {chunk} x V={hf.vocab_size} x 4 B" if tr.logprob_chunk_tokens > 0
                 else f"3 x {local} x V={hf.vocab_size} x 4 B"))
    total = sum(r[1] for r in rows)
    other = activation_bytes(hf, local, compute, not tr.activation_checkpointing)
    dtype = (f"{compute_dtype} (trainer.param_dtype=auto on {'a GPU' if gpu else 'the CPU'})"
             if tr.param_dtype == "auto" else compute_dtype)
    out.lines.append(f"   trainer rank (master {tr.master_dtype}, compute {dtype}):")
    out.lines += [_row(*r) for r in rows]
    out.lines.append(_row("total", total, f"of {gpu_gb:g} GiB" if gpu_gb else ""))
    out.lines.append(_row("(activations if flipped)", other,
                          f"trainer.activation_checkpointing={str(not tr.activation_checkpointing).lower()}"))
    budget = gpu_gb * GIB
    if not gpu_gb or total <= budget:
        return
    fixed = total - sum(state.values())  # what more ranks do not divide
    E = num_experts(hf)
    if fixed < budget:
        ranks_needed = math.ceil(P * master * 4 / (budget - fixed))
        how = f"about {ranks_needed} ranks would fit (trainer.num_ranks)"
        if tr.ep > 1 and E:  # the ranks store whole experts: their number must divide the expert count
            fitting = [n for n in range(ranks_needed, E + 1) if E % n == 0]
            how = (f"{fitting[0]} ranks would fit (trainer.num_ranks, which must divide the model's {E} experts)"
                   if fitting else f"about {ranks_needed} ranks would fit, more than the model's {E} experts can be "
                   "stored over (trainer.num_ranks, trainer.ep)")
    else:
        how = (f"no number of ranks fits: what the ranks do not divide (all but the sharded model state, at "
               f"T={tokens} tokens) alone takes {_gib(fixed)} (expert parallelism, trainer.ep, gathers 1/ep of a "
               "block's routed experts; context parallelism, trainer.cp, splits T's activations over cp ranks)")
    out.problems.append(f"a trainer rank needs about {_gib(total)}, more than the GPU's {gpu_gb:g} GiB "
                        f"(cluster.gpu_memory_gb); {how}.")
    out.keys += ["trainer.num_ranks", "trainer.ep", "trainer.cp", "trainer.activation_checkpointing",
                 "trainer.micro_batch_tokens", "cluster.gpu_memory_gb"]


def _inference(cfg, hf, counts: ParamCount, gpu_gb: float, instances, gpu: bool, out: MemoryPlan) -> None:
    """Divisibility by tp, and the rows of one GPU (`gpu`; else one CPU process) of each vLLM instance (module
    docstring), with the refusal when the weights and one max_model_len sequence of KV cache exceed gpu_memory_gb x
    gpu_memory_utilization."""
    inf, P = cfg.inference, counts.total
    budget = gpu_gb * GIB
    dtype_bytes = DTYPE_BYTES.get(cfg.model.dtype, 4)
    if not instances:  # the hf engine: the whole model on one device, KV cache as the batch needs it
        w = P * dtype_bytes
        out.lines.append(f"   inference worker ({inf.engine}, {cfg.model.dtype}):")
        out.lines.append(_row("weights", w, f"{_params(P)} x {dtype_bytes} B; its KV cache grows with the batch"))
        if gpu_gb and w > budget:
            out.problems.append(f"an inference worker's weights take {_gib(w)}, more than the GPU's {gpu_gb:g} GiB "
                                f"(cluster.gpu_memory_gb); use inference.engine=vllm with tensor parallelism.")
            out.keys += ["inference.engine", "cluster.gpu_memory_gb"]
        return
    serve = 1 if inf.quantization == "fp8" else dtype_bytes
    kv_dtype = 1 if str(inf.kv_cache_dtype).startswith("fp8") else dtype_bytes
    vocab = counts.embeddings + counts.lm_head
    usable = budget * inf.gpu_memory_utilization

    def need(tp: int) -> Tuple[float, float]:  # weights, one max_model_len sequence of KV cache
        w = ((P - vocab) * serve + vocab * dtype_bytes) / tp
        return w, kv_bytes_per_token(hf, tp, kv_dtype)[0] * inf.max_model_len

    for name, tp, key in instances:
        divides = _divides(hf, tp)
        if divides:
            out.problems.append(f"the {name} instance's tensor parallelism {tp} ({key}) {divides}.")
            out.keys.append(key)
        w, kv_seq = need(tp)
        nodes = f" over {inf.nodes_per_instance} nodes" if inf.nodes_per_instance > 1 else ""
        out.lines.append(f"   inference {name} instance, per {_unit(gpu)} of tp={tp}{nodes} (weights "
                         f"{inf.quantization or cfg.model.dtype}, kv cache {inf.kv_cache_dtype}):")
        out.lines.append(_row("weights", w, f"{_params(P)} x {serve} B / {tp} (vocabulary matrices at "
                                            f"{dtype_bytes} B)"))
        out.lines.append(_row("KV cache, one sequence", kv_seq,
                              f"max_model_len {inf.max_model_len} x {kv_bytes_per_token(hf, tp, kv_dtype)[1]}"))
        if not gpu_gb:
            continue
        fits = int((usable - w) // kv_seq) if usable > w else 0
        out.lines.append(_row("usable", usable, f"{gpu_gb:g} GiB x gpu_memory_utilization {inf.gpu_memory_utilization}"
                                                f": KV room for {fits} sequence(s) of max_model_len"))
        if w + kv_seq <= usable:
            continue
        tps = [t for t in (2, 4, 8, 16, 32, 64) if t > tp and not _divides(hf, t) and sum(need(t)) <= usable]
        how, more = _larger_tp(cfg, tps, key)
        out.problems.append(f"the {name} instance needs {_gib(w + kv_seq)} per GPU (weights and one max_model_len "
                            f"sequence of KV cache), more than the {_gib(usable)} usable; {how}.")
        out.keys += [key, *more, "inference.quantization", "inference.max_model_len",
                     "inference.gpu_memory_utilization", "cluster.gpu_memory_gb"]


def _larger_tp(cfg, tps: List[int], key: str) -> Tuple[str, List[str]]:
    """What the refusal of an instance too large for its GPUs proposes, of the tensor parallelisms `tps` that would
    fit (smallest first), and the keys that proposal adds. One that exceeds a node's GPUs is an instance over whole
    nodes: tp / gpus_per_node of them (inference.nodes_per_instance), which prefill/decode disaggregation does not
    take."""
    node = cfg.cluster.inference.gpus_per_node
    if not tps:
        return "no tensor parallelism up to 64 fits", []
    if not node or tps[0] <= node:
        return f"tensor parallelism {tps[0]} would fit ({key})", []
    whole = [t for t in tps if t % node == 0]
    if not whole:
        return (f"tensor parallelism {tps[0]} would fit, more GPUs than a node's {node} and not a multiple of them "
                "(an instance over several nodes takes every GPU of each; cluster.inference.gpus_per_node)", [])
    t = whole[0]
    how = f"tensor parallelism {t} would fit, as one instance over {t // node} nodes of {node} GPUs: set "
    if cfg.inference.disaggregation.enabled:  # a prefill/decode pair shares one node; a multi-node instance is alone
        return (how + f"inference.disaggregation.enabled=false, inference.tensor_parallel_size={t} and "
                f"inference.nodes_per_instance={t // node} (one instance per worker: prefill/decode disaggregation "
                "keeps a worker's instances in one node)",
                ["inference.tensor_parallel_size", "inference.nodes_per_instance",
                 "inference.disaggregation.enabled"])
    return how + f"{key}={t} and inference.nodes_per_instance={t // node}", ["inference.nodes_per_instance"]


def _divides(hf, tp: int) -> str:
    """Why `tp` cannot split the model's attention ("" when it can): vLLM gives each GPU heads / tp heads, and
    key/value heads either split over the GPUs or repeat on them."""
    heads = hf.num_attention_heads
    if heads % tp:
        return f"does not divide the model's {heads} attention heads"
    kv = hf.num_key_value_heads
    if not is_mla(hf) and kv % tp and tp % kv:
        return f"and the model's {kv} key/value heads do not divide one another"
    return ""
