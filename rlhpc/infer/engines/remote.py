"""The engine interface over a served policy's token endpoint (`POST /inference/v1/generate`, rlhpc.infer.server).

rlhpc's own episodes (rlhpc.env.episode: turns, tools, replies, token-exact trajectories) run against a server exactly
as against an in-process engine: prompts go as token ids, completions come back as token ids with their sampling
logprobs and the weights versions that produced them. Every prompt of a call is its own concurrent request (several
when it asks for more than the server's MAX_N completions), so the server batches them (with other clients') into its
engine calls. Used by `rlhpc.eval` against `rlhpc.serve` or a training run's workers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from rlhpc.infer.engines import Completion, Engine
from rlhpc.infer.server import MAX_N


@dataclass
class ServedCompletion(Completion):
    min_version: Optional[int] = None
    max_version: Optional[int] = None


class RemoteEngineError(RuntimeError):
    pass


class RemoteEngine(Engine):
    def __init__(self, url: str, token: Optional[str] = None, model: Optional[str] = None, concurrency: int = 64,
                 timeout_s: float = 600.0):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.token = token
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s,
                                   limits=httpx.Limits(max_connections=concurrency,
                                                       max_keepalive_connections=concurrency))
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="remote-engine")
        self.model = model or self.models()[0]["id"]
        self.version = 0  # the newest weights version seen in an answer

    @property
    def endpoint(self) -> Tuple[str, Optional[str], str]:
        """(URL, token, model id): this engine is an endpoint already, which a harness that calls the model over HTTP
        (a verifiers environment) uses as it is."""
        return self.url, self.token, self.model

    def models(self) -> List[Dict[str, Any]]:
        return self._check(self.client.get("/v1/models"))["data"]

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int,
                 stop_token_ids: Sequence[int], greedy: bool = False) -> List[List[Completion]]:
        params = {"temperature": 0.0 if greedy else temperature, "max_tokens": max_new_tokens,
                  # The engine contract: stop at these tokens only (the server adds the eos token otherwise).
                  "stop_token_ids": list(stop_token_ids), "ignore_eos": True, "logprobs": 1}
        # One request per prompt and per MAX_N of its n completions (the most one request may ask), all concurrent.
        requests = [(i, min(MAX_N, n - done)) for i in range(len(prompts)) for done in range(0, n, MAX_N)]

        def one(request: Tuple[int, int]) -> List[Completion]:
            i, count = request
            out = self._check(self.client.post("/inference/v1/generate", json={
                "model": self.model, "token_ids": list(prompts[i]), "sampling_params": {**params, "n": count}}))
            lo, hi = out.get("min_weights_version"), out.get("weights_version")
            return [ServedCompletion(list(c["token_ids"]), [e["logprob"] for e in c["logprobs"]["content"]],
                                     "stop" if c["finish_reason"] == "stop" else "length", min_version=lo,
                                     max_version=hi)
                    for c in out["choices"]]

        groups: List[List[Completion]] = [[] for _ in prompts]
        for (i, _), completions in zip(requests, self.pool.map(one, requests)):
            groups[i] += completions
        versions = [c.max_version for g in groups for c in g if c.max_version is not None]
        if versions:
            self.version = max([self.version, *versions])
        return groups

    def _check(self, response: Any) -> Dict[str, Any]:
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - not our error format: show the body
                message = response.text[:500]
            raise RemoteEngineError(f"{self.url} answered {response.status_code}: {message}")
        return response.json()

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError("a served engine's weights change through its own run, not through a client")

    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> List[List[float]]:
        raise NotImplementedError("scoring sequences is not served over HTTP")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.client.close()
