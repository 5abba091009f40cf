"""Inference engines: token ids in, sampled token ids and their logprobs out.

An engine generates `n` completions per prompt from the distribution `softmax(logits / temperature)` and reports the
logprob of each sampled token under exactly that distribution, so the trainer can form importance ratios against it.
It also takes weight updates under Hugging Face checkpoint names. `hf` (transformers) is the embedded default; `vllm`
is the production engine (rlhpc.infer.engines.vllm), and with `inference.disaggregation.enabled` a pair of vLLM instances,
one for prefill and one for decode (rlhpc.infer.engines.disagg).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch


@dataclass
class Completion:
    tokens: List[int]
    logprobs: List[float]
    # "stop" when a stop token ended it (the stop token is included in `tokens`), "length" when max_new_tokens did.
    finish_reason: str
    # MoE models, when the engine records routing (trainer.router_replay): the experts of each token the engine ran
    # through the model, [prompt + completion tokens - 1, MoE layers, k] (the last sampled token was never an input;
    # rlhpc/modeling/routing.py).
    routing: Optional[torch.Tensor] = None


class Engine(ABC):
    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        temperature: float,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        greedy: bool = False,
    ) -> List[List[Completion]]:
        """Returns, for each prompt, `n` completions."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Loads tensors given under their Hugging Face checkpoint names."""

    @abstractmethod
    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> List[List[float]]:
        """Logprob of every token after the first, given its prefix (for checking the weight path)."""

    def close(self) -> None:
        pass


def make_engine(kind: str, model_path: str, dtype: str = "float32", record_routing: bool = False,
                **kwargs) -> Engine:
    """`record_routing` (trainer.router_replay): the transformers engine records a MoE model's routing; vLLM's is not
    wired yet (docs/moe.md)."""
    if kind == "hf":
        from rlhpc.infer.engines.hf import HFEngine

        return HFEngine.from_pretrained(model_path, dtype=dtype, seed=kwargs.get("seed", 0),
                                        record_routing=record_routing)
    if kind == "vllm":
        cfg = kwargs.get("cfg")
        if cfg is not None and cfg.disaggregation.enabled:
            from rlhpc.infer.engines.disagg import DisaggregatedVLLMEngine

            return DisaggregatedVLLMEngine(model_path, dtype=dtype, **kwargs)
        from rlhpc.infer.engines.vllm import VLLMEngine  # type: ignore[import-not-found]

        return VLLMEngine(model_path, dtype=dtype, **kwargs)
    raise ValueError(f"config key `inference.engine`: unknown engine {kind!r} (hf or vllm)")
