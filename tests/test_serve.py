"""Serving the policy over HTTP (rlhpc.infer.server): OpenAI-compatible endpoints and the token endpoint, over the same
engine object the worker uses, with the run's token, batching, and the weights version on every answer."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="needs the serve extra: pip install -e '.[serve]'")
import torch

from rlhpc.config.schema import ModelConfig
from rlhpc.env.episode import Renderer
from rlhpc.infer.batcher import SharedEngine
from rlhpc.infer.engines import Completion, Engine
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.infer.server import VERSION_HEADER, Server, context_length
from rlhpc.modeling import models

TOKEN = "test-token"
MESSAGES = [{"role": "user", "content": "Reverse: hello"}]


class CountingEngine(Engine):
    """The HF engine, counting its generate calls and checking that no two overlap."""

    def __init__(self, inner: HFEngine):
        self.inner, self.calls, self.active, self.max_active = inner, 0, 0, 0
        self._lock = threading.Lock()

    def generate(self, *args, **kwargs):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            return self.inner.generate(*args, **kwargs)
        finally:
            with self._lock:
                self.active -= 1

    def update_weights(self, named_tensors):
        self.inner.update_weights(named_tensors)

    def score(self, sequences, temperature):
        return self.inner.score(sequences, temperature)


class Scripted(Engine):
    """Answers every prompt with the tokens of a fixed text followed by eos (logprob -0.5 per token)."""

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, prompts, n, temperature, max_new_tokens, stop_token_ids, greedy=False):
        ids = self.ids[:max_new_tokens]
        return [[Completion(list(ids), [-0.5] * len(ids), "stop" if ids[-1] in stop_token_ids else "length")
                 for _ in range(n)] for _ in prompts]

    def update_weights(self, named_tensors):
        pass

    def score(self, sequences, temperature):
        raise NotImplementedError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return models.build(ModelConfig(), tmp_path_factory.mktemp("serve") / "model")


@pytest.fixture(scope="module")
def tok(model_dir):
    return models.load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def served(model_dir, tok):
    engine = CountingEngine(HFEngine.from_pretrained(str(model_dir), seed=1))
    server = Server(engine, tok, "tiny", context_length(model_dir), TOKEN, aliases=[str(model_dir)]).start()
    yield server, engine
    server.close()


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served[0].url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


def test_requests_without_the_run_token_are_refused(served):
    url = served[0].url
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/inference/v1/generate")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, url + path, json={"model": "tiny", "prompt": "x"}, headers=headers)
            assert r.status_code == 401, (path, r.text)
            assert "token" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200  # liveness needs no token


@pytest.mark.parametrize("path, body, status, says", [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": MESSAGES}, 404, "does not exist"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]}, 400, "context"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "n": 1000}, 400, "`n`"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "top_p": 0.9}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": 17}, 400, "prompt"),
    ("/inference/v1/generate", {"token_ids": [1, 2, 10 ** 9], "sampling_params": {}}, 400, "token ids"),
    ("/inference/v1/generate", {"token_ids": [], "sampling_params": {}}, 400, "empty"),
    # Fields of the wrong type: each a 400 naming it (they were 500s), and options not supported: refused, not ignored.
    ("/v1/chat/completions", {"model": ["tiny"], "messages": MESSAGES}, 400, "`model` must be a string"),
    ("/v1/chat/completions", {"messages": MESSAGES}, 400, "`model` is required"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": "x"}, 400,
     "`chat_template_kwargs` must be an object"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "stream": "false"}, 400,
     "`stream` must be true or false"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "stream": True, "stream_options": "x"}, 400,
     "`stream_options` must be an object"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]},
     400, "tool_calls must be a list"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "temperature": float("nan")}, 400,
     "`temperature` must be a finite number"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_object"}}, 400,
     "`response_format`"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tool_choice": "required"}, 400, "`tool_choice`"),
    # Text that cannot fit the context is refused before it is tokenized; a body over the limit is not read.
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a" * 2_000_000}]}, 400,
     "characters, more than 64 for each of this model's 256 tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a" * 2_000_000}, 400, "characters"),
    ("/v1/chat/completions", b"x" * (17 << 20), 413, "the most this server reads"),
    ("/nope", {}, 404, "POST /nope: Not Found"),
])
def test_bad_requests_get_a_4xx_with_a_clear_message_and_serving_goes_on(client, path, body, status, says):
    if isinstance(body, bytes):
        r = client.post(path, content=body)
    else:  # NaN is no JSON: written as Python's json writes it
        r = client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4})
    assert ok.status_code == 200


def test_the_token_endpoint_returns_the_engines_tokens_and_sampling_logprobs(served, client, tok):
    engine = served[1]
    prompt = Renderer(tok).prompt(MESSAGES)
    r = client.post("/inference/v1/generate", json={
        "model": "tiny", "token_ids": prompt,
        "sampling_params": {"n": 3, "temperature": 0.7, "max_tokens": 12, "logprobs": 1, "skip_special_tokens": False}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_token_ids"] == prompt and len(out["choices"]) == 3
    for choice in out["choices"]:
        ids = choice["token_ids"]
        entries = choice["logprobs"]["content"]
        assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]  # what verifiers' renderers client checks
        scored = engine.score([prompt + ids], 0.7)[0][len(prompt) - 1:]
        assert [e["logprob"] for e in entries] == pytest.approx(scored, abs=1e-4)
        assert choice["finish_reason"] in ("stop", "length")
        assert len(ids) == 12 or ids[-1] == tok.eos_token_id


def test_chat_prompt_tokens_are_the_chat_templates_and_logprobs_the_engines(served, client, tok):
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 8,
                                                  "temperature": 1.0, "logprobs": True, "return_token_ids": True})
    out = r.json()
    prompt = Renderer(tok).prompt(MESSAGES)
    assert out["prompt_token_ids"] == prompt  # the same tokens rlhpc's own episodes start from
    choice = out["choices"][0]
    scored = served[1].score([prompt + choice["token_ids"]], 1.0)[0][len(prompt) - 1:]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(scored, abs=1e-4)
    assert choice["message"]["content"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_temperature_zero_is_the_engines_greedy_completion(served, client, tok):
    prompt = Renderer(tok).prompt(MESSAGES)
    want = served[1].inner.generate([prompt], 1, 1.0, 10, [tok.eos_token_id], greedy=True)[0][0]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 10,
                                             "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == want.tokens


def test_streaming_answers_add_up_to_the_whole_answer(client):
    for path, body in [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Reverse: ab"})]:
        body = {"model": "tiny", "temperature": 0, "max_tokens": 12, "logprobs": True if "messages" in body else 0,
                "stream_options": {"include_usage": True}, **body}
        whole = client.post(path, json=body).json()
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.headers[VERSION_HEADER] == "0"
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"] == whole["usage"]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        if "messages" in body:
            text = "".join(c["delta"].get("content", "") for c in choices)
            assert text == whole["choices"][0]["message"]["content"]
            streamed_lps = [e["logprob"] for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
            assert streamed_lps == [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
        else:
            assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
        assert choices[-1]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_n_and_max_tokens_shape_the_answer(client, tok):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 3, "max_tokens": 4,
                                             "return_token_ids": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for c in choices:
        assert 1 <= len(c["token_ids"]) <= 4
        assert c["finish_reason"] == ("stop" if c["token_ids"][-1] == tok.eos_token_id else "length")


def test_concurrent_clients_are_batched_into_fewer_engine_calls(served, client):
    engine = served[1]
    before = engine.calls
    bodies = [{"model": "tiny", "messages": MESSAGES, "max_tokens": 3 + 5 * (i % 2), "return_token_ids": True}
              for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda b: client.post("/v1/chat/completions", json=b), bodies))
    assert all(a.status_code == 200 for a in answers)
    assert engine.calls - before < 8
    # Requests with different max_tokens share engine calls; each keeps to its own.
    assert all(len(a.json()["choices"][0]["token_ids"]) <= b["max_tokens"] for a, b in zip(answers, bodies))
    assert served[0].batcher.sequences >= 8


def test_the_worker_loop_and_http_clients_never_use_the_engine_at_once(served, client, tok):
    shared: SharedEngine = served[0].engine  # what the worker loop uses when inference.serve=true
    prompt = Renderer(tok).prompt(MESSAGES)
    stop = threading.Event()

    def worker_loop():
        while not stop.is_set():
            shared.generate([prompt] * 4, 2, 1.0, 8, [tok.eos_token_id])

    t = threading.Thread(target=worker_loop)
    t.start()
    try:
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(lambda _: client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": MESSAGES, "max_tokens": 8}), range(12)))
    finally:
        stop.set()
        t.join()
    assert all(a.status_code == 200 for a in answers)
    assert served[1].max_active == 1


def test_the_weights_version_follows_weight_updates(model_dir, tok):
    engine = SharedEngine(HFEngine.from_pretrained(str(model_dir)))
    server = Server(engine, tok, "tiny", context_length(model_dir), None).start()
    prompt = Renderer(tok).prompt(MESSAGES)
    body = {"model": "tiny", "token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 6}}
    try:
        before = httpx.post(server.url + "/inference/v1/generate", json=body)
        assert before.headers[VERSION_HEADER] == "0" and before.json()["weights_version"] == 0
        # What the worker loop does with an update from the trainer: new weights, then their version.
        new = {n: p.detach() + 0.05 * torch.randn_like(p) for n, p in engine.inner.model.named_parameters()}
        engine.update_weights(list(new.items()))
        engine.version = 3
        after = httpx.post(server.url + "/inference/v1/generate", json=body)
        assert after.headers[VERSION_HEADER] == "3" and after.json()["weights_version"] == 3
        ids = after.json()["choices"][0]["token_ids"]
        scored = engine.score([prompt + ids], 1.0)[0][len(prompt) - 1:]  # generated by the new weights
        assert [e["logprob"] for e in after.json()["choices"][0]["logprobs"]["content"]] == pytest.approx(scored, abs=1e-4)
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["weights_version"] == 3
    finally:
        server.close()


def test_tools_reach_the_chat_template_and_tool_calls_come_back_as_openai_tool_calls(tok):
    call = '<tool_call>\n{"name": "get_text", "arguments": {"key": "a"}}\n</tool_call>'
    server = Server(Scripted(tok, call), tok, "tiny", 256, None).start()
    tools = [{"type": "function", "function": {"name": "get_text", "description": "the hidden text",
                                               "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]
    try:
        out = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "tools": tools, "return_token_ids": True}).json()
        assert "get_text(key): the hidden text" in tok.decode(out["prompt_token_ids"])
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [tc] = choice["message"]["tool_calls"]
        assert tc["function"]["name"] == "get_text" and json.loads(tc["function"]["arguments"]) == {"key": "a"}
        # The same text without tools is plain content.
        plain = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}).json()
        assert plain["choices"][0]["message"]["content"] == call and plain["choices"][0]["finish_reason"] == "stop"
    finally:
        server.close()


def test_stop_strings_end_the_answer_before_them(tok):
    server = Server(Scripted(tok, "olleh. And more"), tok, "tiny", 256, None).start()
    try:
        out = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stop": ["."],
                                                              "return_token_ids": True}).json()
        choice = out["choices"][0]
        assert choice["text"] == "olleh" and choice["finish_reason"] == "stop"
        assert tok.decode(choice["token_ids"]) == "olleh."  # the tokens up to the one that completed the stop string
    finally:
        server.close()


def test_an_openai_client_talks_to_the_server(served):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=served[0].url + "/v1", api_key=TOKEN)
    assert [m.id for m in api.models.list()] == ["tiny"]
    chat = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=2, logprobs=True)
    assert len(chat.choices) == 2 and all(len(c.logprobs.content) >= 1 for c in chat.choices)
    assert chat.model_extra["weights_version"] == 0
    text = api.completions.create(model="tiny", prompt="Reverse: ab", max_tokens=5, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, stream=True) if c.choices)
    whole = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    assert streamed == whole.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served[0].url + "/v1", api_key="wrong").models.list()
    with pytest.raises(openai.BadRequestError, match="top_p"):
        api.chat.completions.create(model="tiny", messages=MESSAGES, top_p=0.5)


def test_a_tiny_temperature_is_greedy_not_a_500(client, tok):
    """Logits divided by 1e-45 overflow: like vLLM, a temperature below 1e-5 samples greedily."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6}
    tiny = client.post("/v1/chat/completions", json={**body, "temperature": 1e-45})
    greedy = client.post("/v1/chat/completions", json={**body, "temperature": 0})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_logprob_bytes_are_each_tokens_raw_bytes_and_offsets_fall_on_characters(client, tok):
    """A byte-level token may end inside a multi-byte character: its `bytes` are its own bytes (not U+FFFD's), so
    they join into the answer's text; /v1/completions' text_offset counts characters of that text."""
    from rlhpc.infer.server import text_offsets, token_bytes_of

    raw = token_bytes_of(tok)
    ids = tok("héllo 日本", add_special_tokens=False)["input_ids"]
    assert b"".join(raw(t) for t in ids).decode() == "héllo 日本"
    assert any(raw(t) != tok.decode([t]).encode() for t in ids)  # the case that was wrong: a partial character
    offsets = text_offsets([raw(t) for t in ids])
    assert offsets[0] == 0 and offsets[-1] == len("héllo 日本") - 1 and offsets == sorted(offsets)
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "日本"}],
                                                  "logprobs": True, "max_tokens": 24, "temperature": 1.0})
    choice = r.json()["choices"][0]
    joined = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
    assert joined.decode("utf-8", "replace") == choice["message"]["content"]


def test_a_client_that_leaves_takes_its_queued_request_with_it(model_dir, tok):
    """Requests of clients that disconnected while queued are not generated: only the engine call already running
    (which cannot be interrupted) is spent on them."""
    import socket

    engine = CountingEngine(HFEngine.from_pretrained(str(model_dir), seed=1))
    server = Server(engine, tok, "tiny", context_length(model_dir), TOKEN, max_sequences=4).start()
    try:
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "n": 4, "ignore_eos": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        socks = []
        for _ in range(6):  # 6 requests of 4 sequences, 4 sequences a call: 6 engine calls if all were generated
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(head + body)
            socks.append(s)
        import time

        time.sleep(0.5)
        for s in socks:
            s.close()
        r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200
        assert engine.calls <= 3, f"{engine.calls} engine calls: the abandoned requests were generated"
    finally:
        server.close()


def test_an_in_process_client_that_gives_up_takes_its_queued_request_with_it(model_dir, tok):
    """A client in the server's own process (an ASGI transport over its app, as verifiers' TrainClient reaches a
    worker's private endpoint) that is cancelled while its request waits: the request leaves the queue, as a closed
    socket's does."""
    import asyncio

    engine = CountingEngine(HFEngine.from_pretrained(str(model_dir), seed=1))
    server = Server(engine, tok, "tiny", context_length(model_dir), TOKEN, max_sequences=4).start()

    async def main() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://in-process",
                                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as client:
            body = {"model": "tiny", "prompt": [5, 6, 7], "n": 4, "ignore_eos": True}
            asks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(6)]
            await asyncio.sleep(0.5)
            for a in asks:  # 6 requests of 4 sequences, 4 a call: 6 engine calls if all were generated
                a.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
            r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                                "max_tokens": 2})
            return r.status_code

    try:
        assert asyncio.run(main()) == 200
        assert engine.calls <= 3, f"{engine.calls} engine calls: the abandoned requests were generated"
    finally:
        server.close()


def test_closing_answers_every_waiting_request_503_at_once(model_dir, tok):
    engine = CountingEngine(HFEngine.from_pretrained(str(model_dir), seed=1))
    server = Server(engine, tok, "tiny", context_length(model_dir), TOKEN, max_sequences=4).start()
    codes = []

    def ask():
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                       json={"model": "tiny", "prompt": [5, 6, 7], "n": 4, "ignore_eos": True})
        codes.append(r.status_code)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    import time

    deadline = time.monotonic() + 60
    while (engine.calls == 0 or server.batcher.waiting < 6) and time.monotonic() < deadline:
        time.sleep(0.01)  # all six submitted, the first engine call running
    assert server.batcher.waiting == 6
    t0 = time.monotonic()
    server.close(timeout_s=2)
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - t0 < 10
    assert len(codes) == 6 and all(c in (200, 503) for c in codes) and codes.count(503) >= 4, codes
    server.close(timeout_s=120)  # the engine call it did not wait for ends before the test does


def test_a_serving_port_in_use_is_one_line_naming_the_key(tmp_path):
    import socket
    import subprocess
    import sys

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "rlhpc.serve", f"run_dir={tmp_path / 'srv'}",
                               f"inference.serve_port={port}", "inference.serve_host=127.0.0.1"],
                              capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: config key `inference.serve_port`: cannot serve on 127.0.0.1:{port}: "
                                   "Address already in use")
    assert not (tmp_path / "srv").exists()


def test_the_remote_engine_returns_the_servers_tokens_with_the_weights_versions_that_made_them(served, tok):
    """rlhpc's own client of the token endpoint (the engine of `rlhpc.eval`, and of verifiers' harnesses in training):
    its completions carry the versions the server reports, and no routing (a served engine records none)."""
    from rlhpc.infer.engines.remote import RemoteEngine

    server, engine = served
    remote = RemoteEngine(server.url, TOKEN, "tiny")
    try:
        [[a, b]] = remote.generate([tok("hello", add_special_tokens=False)["input_ids"]], n=2, temperature=1.0,
                                   max_new_tokens=4, stop_token_ids=[tok.eos_token_id])
    finally:
        remote.close()
    version = server.engine.version
    for c in (a, b):
        assert len(c.tokens) == len(c.logprobs) > 0 and c.finish_reason in ("stop", "length")
        assert (c.min_version, c.max_version) == (version, version) and c.routing is None
