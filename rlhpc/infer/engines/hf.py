"""The transformers engine: `generate` on a plain Hugging Face model, the embedded default."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from rlhpc.infer.engines import Completion, Engine
from rlhpc.modeling import routing, sparse
from rlhpc.modeling.models import load_model


class HFEngine(Engine):
    loads_in_parts = True  # update_weights takes any subset of the tensors (weights.receive=in_place)

    def __init__(self, model: torch.nn.Module, pad_token_id: int, record_routing: bool = False):
        """`record_routing`: a MoE model's completions carry the experts of their tokens (trainer.router_replay);
        no effect on a dense model."""
        self.model = model
        self.pad = pad_token_id
        self._params = dict(model.named_parameters())
        self.recorder = routing.Recorder(model) if record_routing and routing.moe_gates(model) else None

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32", seed: int = 0,
                        record_routing: bool = False) -> "HFEngine":
        torch.manual_seed(seed)  # each worker samples its own stream
        model = load_model(path, dtype=dtype).eval().to(local_device())
        sparse.install(model)  # GLM-5: the trainer's choice of keys among ties, so its logprobs are the trainer's
        return cls(model, model.config.pad_token_id if model.config.pad_token_id is not None else 0, record_routing)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        temperature: float,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        greedy: bool = False,
    ) -> List[List[Completion]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p) :] = torch.as_tensor(p)
            mask[i, width - len(p) :] = 1
        device = next(self.model.parameters()).device  # the worker's GPU (local_device), else the CPU
        ids, mask = ids.to(device), mask.to(device)  # one copy each, after the padding is laid out
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if not greedy else dict(do_sample=False)
        was_training = self.model.training
        self.model.eval()
        with self.recording() as calls:
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                eos_token_id=list(stop_token_ids),
                pad_token_id=self.pad,
                output_scores=True,
                return_dict_in_generate=True,
                **sampling,
            )
        self.model.train(was_training)
        new = out.sequences[:, width:]  # [B*n, steps]
        experts = _routing(calls, new.shape[0]) if calls is not None else None
        # `scores` are the processed logits the tokens were drawn from (already divided by the temperature).
        scores = torch.stack(out.scores, dim=1).float()  # [B*n, steps, V]
        if greedy:
            scores = scores / temperature
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        stops = torch.as_tensor(list(stop_token_ids), device=new.device)
        is_stop = torch.isin(new, stops)
        # Length of each completion: up to and including its first stop token.
        first_stop = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full_like(new[:, 0], new.shape[1]))
        tokens, lps, lens = new.tolist(), logprobs.tolist(), first_stop.tolist()
        stopped = is_stop.any(1).tolist()
        result: List[List[Completion]] = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                k = i * n + j
                L = lens[k]
                # Prompt and completion less the last token: what row k ran through the model, after its padding.
                mine = experts[k, width - len(prompts[i]) : width + L - 1] if experts is not None else None
                group.append(Completion(tokens[k][:L], lps[k][:L], "stop" if stopped[k] else "length", mine))
            result.append(group)
        return result

    @contextmanager
    def recording(self) -> Iterator[Optional[List[List[torch.Tensor]]]]:
        if self.recorder is None:
            yield None
        else:
            with self.recorder.recording() as calls:
                yield calls

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Tensors under Hugging Face checkpoint names (in-memory names work too); per-expert MoE tensors are written
        into their slices of the model's fused experts (rlhpc/modeling/names.py)."""
        from rlhpc.modeling.names import Loader

        loader = getattr(self, "_loader", None)
        if loader is None:
            loader = self._loader = Loader(self.model)
        for name, tensor in named_tensors:
            loader.load(name, tensor)

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> List[List[float]]:
        out = []
        for seq in sequences:
            ids = torch.as_tensor([list(seq)], device=next(self.model.parameters()).device)
            logits = self.model(input_ids=ids).logits[0, :-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist())
        return out


def _routing(calls: List[List[torch.Tensor]], rows: int) -> torch.Tensor:
    """[rows, positions, MoE layers, k] of one `generate`, from each layer's ids of its forwards: the prefill of the
    padded prompts, then one decode step per sampled token but the last."""
    layers = [torch.cat([c.view(rows, -1, c.shape[-1]) for c in layer], dim=1) for layer in calls]
    return torch.stack(layers, dim=2).cpu()


def local_device() -> torch.device:
    """This worker's GPU: cuda:LOCAL_RANK among the visible ones (the launchers set both; rlhpc/cluster), made the
    current device so that the NCCL weights group receives there too; the CPU without GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
