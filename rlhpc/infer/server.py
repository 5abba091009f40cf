"""The policy over HTTP: OpenAI-compatible endpoints and a token-in/token-out endpoint over an inference engine.

Endpoints (docs/serving.md has the details and examples):
- `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (OpenAI API; streaming or not, `n`,
  `temperature`, `max_tokens`, `stop`, `logprobs`, `tools` rendered by the chat template; token ids with
  `return_token_ids: true`, as vLLM);
- `POST /inference/v1/generate`: token ids and sampling params in, token ids and per-token logprobs out, as vLLM's
  endpoint of that name, which verifiers' TrainClient (through the `renderers` client) and Prime-RL speak;
- `GET /health` (no token needed).
Every answer carries the weights version that generated it: the header `X-Rlhpc-Weights-Version` and the field
`weights_version`.

Sampling follows the engine contract (rlhpc.infer.engines): completions are drawn from softmax(logits / temperature),
with nothing else applied, and the logprobs are those of that distribution. So `top_p` must be 1, `top_k` 0 or -1,
penalties neutral; a request that asks otherwise gets a 400 that says so, rather than tokens from another distribution
than the one the logprobs describe. `temperature: 0` is greedy.

Requests from all clients are batched into engine calls (rlhpc.infer.batcher); the engine is shared with the worker
loop, one call at a time, so weight updates land between calls as without a server. Engine calls are not incremental:
a streamed answer (`stream: true`) is sent, token by token, once its batch has been generated.

Access: `Authorization: Bearer <token>` with the run's token (the weights group's, rendezvous/weights.json; or
rendezvous/serving-token.json with the filesystem transport) unless `inference.serve_open=true`. Where a worker serves
is written to `rendezvous/serve-<rank>.json`; `endpoint(run_dir)` reads both back for a client.

Why not vLLM's own OpenAI server with `inference.engine=vllm`: its serving classes sit on an `EngineClient` (AsyncLLM:
an engine core stepped by its own background loop, ~20 async methods, plus its renderer and model registry objects),
while rlhpc's vLLM engine is an in-process LLMEngine that the worker steps itself, so weights can land between two
decode steps. An adapter would re-implement AsyncLLM's output routing over that engine against internal APIs that move
every release. The same small server runs over both engines instead; vLLM still batches continuously inside each call.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request) at runtime.
import asyncio
import errno
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

from rlhpc.infer.batcher import Batcher, Sampling, SharedEngine, ShuttingDown
from rlhpc.infer.engines import Completion, Engine
from rlhpc.run.procs import node_address as this_node_address
from rlhpc.run.rundir import RunDir, read_json, wait_for, write_json

log = logging.getLogger(__name__)

VERSION_HEADER = "X-Rlhpc-Weights-Version"
# Completions one request may ask for (`n`, times the prompts of a /v1/completions request).
MAX_N = 128
# The largest request body read (413 beyond): a prompt that fits any context served here is far smaller.
MAX_BODY_BYTES = 16 << 20
# Text longer than this many characters a token of the context cannot fit it; refused before it is tokenized, which
# for megabytes of text takes seconds.
MAX_CHARS_PER_TOKEN = 64


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class Server:
    """An HTTP server over an engine. `start()` serves from a background thread; `close()` stops it."""

    def __init__(self, engine: Engine, tokenizer, model: str, context: int, token: Optional[str],
                 host: str = "127.0.0.1", port: int = 0, aliases: Sequence[str] = (), vocab_size: Optional[int] = None,
                 window_s: float = 0.003, max_sequences: int = 256):
        self.engine = engine if isinstance(engine, SharedEngine) else SharedEngine(engine)
        self.tok = tokenizer
        self.model = model
        self.names = {model, *aliases}
        self.context = context
        self.vocab = vocab_size or len(tokenizer)
        self.token = token
        self.host, self.port = host, port
        self.batcher = Batcher(self.engine, context, window_s=window_s, max_sequences=max_sequences)
        self.app = _make_app(self)
        self._server: Any = None
        self._thread: Optional[threading.Thread] = None
        self.rendezvous_file: Optional[Path] = None  # rendezvous/serve-<rank>.json once published

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self) -> "Server":
        import uvicorn

        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="serve-http",
                                        daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started or not self._thread.is_alive(), 30, f"the HTTP server on {self.url}")
        if not self._server.started:
            raise RuntimeError(f"the HTTP server on {self.host}:{self.port} did not start (see the log above)")
        log.info("serving %s on %s (%s)", self.model, self.url, "token required" if self.token else "open")
        return self

    def check_text(self, text: str, param: str) -> None:
        """400 for text too long to fit the context whatever its tokens, before it is tokenized."""
        if len(text) > self.context * MAX_CHARS_PER_TOKEN:
            raise ApiError(400, f"the prompt has {len(text)} characters, more than {MAX_CHARS_PER_TOKEN} for each of "
                                f"this model's {self.context} tokens of context", param)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops taking connections, answers the queued requests 503 at once, lets the engine call in progress finish
        (up to `timeout_s`: it cannot be interrupted) and its clients get their answers."""
        if self._server is not None:
            self._server.should_exit = True
        deadline = time.monotonic() + timeout_s
        self.batcher.close(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout=max(0.5, deadline - time.monotonic()))
        if self.rendezvous_file is not None:
            self.rendezvous_file.unlink(missing_ok=True)

    # ---- requests ---------------------------------------------------------------------------------------------------

    def check_token(self, authorization: Optional[str]) -> None:
        if self.token is None:
            return
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(presented.strip().encode(), self.token.encode()):
            raise ApiError(401, "missing or wrong token: send `Authorization: Bearer <token>` with the run's token "
                                "(rlhpc.infer.server.endpoint(run_dir) reads it; docs/serving.md)",
                           kind="authentication_error")

    def check_model(self, body: Dict[str, Any], required: bool = True) -> None:
        name = body.get("model")
        if name is None and not required:
            return
        if name is None:
            raise ApiError(400, f"`model` is required (this server serves {self.model!r})", "model")
        if not isinstance(name, str):
            raise ApiError(400, f"`model` must be a string (this server serves {self.model!r}), got {name!r}", "model")
        if name not in self.names:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves {self.model!r}", "model",
                           kind="not_found_error")

    def check_prompt(self, prompt: Sequence[int], max_tokens: Optional[int], param: str = "messages") -> int:
        """The completion budget of a prompt; 400 when it does not fit the context."""
        if not prompt:
            raise ApiError(400, "the prompt is empty", param)
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= self.vocab for t in prompt):
            raise ApiError(400, f"token ids must be integers in [0, {self.vocab})", param)
        if len(prompt) >= self.context:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context is {self.context} tokens "
                                "(prompt and completion together)", param)
        if max_tokens is None:
            return self.context - len(prompt)
        if len(prompt) + max_tokens > self.context:
            raise ApiError(400, f"this model's context is {self.context} tokens, but the prompt has {len(prompt)} and "
                                f"max_tokens asks for {max_tokens} more; lower max_tokens or shorten the prompt",
                           "max_tokens")
        return max_tokens

    async def run(self, prompt: List[int], sampling: Sampling, request: Any = None) -> Tuple[List[Completion], int]:
        """The completions of one prompt. With the HTTP `request`, a client that disconnects while its request waits
        takes it out of the queue: nothing is generated for no one."""
        try:
            future = self.batcher.submit(prompt, sampling)
        except ShuttingDown as e:
            raise ApiError(503, str(e), kind="service_unavailable") from None
        waiter = asyncio.wrap_future(future)
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=None if request is None else 0.25)
                if done:
                    return waiter.result()
                if await request.is_disconnected():
                    future.cancel()  # the batcher skips it (unless its engine call has begun)
                    raise ApiError(499, "the client disconnected", kind="client_closed_request")
        except ShuttingDown as e:
            raise ApiError(503, str(e), kind="service_unavailable") from None
        except asyncio.CancelledError:
            # The handler's task was cancelled: a client in this process (an in-process transport runs the handler in
            # the caller's task) that gave up, or the server stopping. Nothing is generated for no one.
            future.cancel()
            raise


# ---- request parsing ------------------------------------------------------------------------------------------------


def _number(body: Dict[str, Any], key: str, default: Any, kind=(int, float)) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ApiError(400, f"`{key}` must be a number, got {value!r}", key)
    return value


def _neutral(body: Dict[str, Any], key: str, allowed: Sequence[Any], why: str) -> None:
    value = body.get(key)
    if value is not None and value not in allowed:
        raise ApiError(400, f"`{key}`={value!r} is not supported: {why}", key)


_CONTRACT = "rlhpc samples from softmax(logits / temperature) and nothing else, so that the logprobs describe it"
_GREEDY_BELOW = 1e-5


def _flag(body: Dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"`{key}` must be true or false, got {value!r}", key)
    return bool(value)


def _object(body: Dict[str, Any], key: str) -> Dict[str, Any]:
    value = body.get(key)
    if value is not None and not isinstance(value, dict):
        raise ApiError(400, f"`{key}` must be an object, got {value!r}", key)
    return value or {}


def parse_options(body: Dict[str, Any]) -> None:
    """What a request may ask that this server does not do: refused, not ignored."""
    fmt = _object(body, "response_format")
    if fmt and fmt.get("type") not in (None, "text"):
        raise ApiError(400, f"`response_format` {fmt.get('type')!r} is not supported (only 'text')", "response_format")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise ApiError(400, "`tool_choice` must be 'auto' or 'none': the policy decides whether to call a tool",
                       "tool_choice")


def parse_sampling(body: Dict[str, Any], eos: Optional[int]) -> Tuple[Sampling, Optional[int], List[str]]:
    """Sampling settings of a request (OpenAI or vLLM names); max_tokens None means: up to the context."""
    temperature = float(_number(body, "temperature", 1.0))
    if not 0 <= temperature < math.inf:
        raise ApiError(400, f"`temperature` must be a finite number >= 0 (0 is greedy), got {temperature}",
                       "temperature")
    _neutral(body, "top_p", (1, 1.0), _CONTRACT + " (top_p must be 1)")
    _neutral(body, "top_k", (0, -1), _CONTRACT + " (top_k must be 0 or -1)")
    _neutral(body, "min_p", (0, 0.0), _CONTRACT)
    _neutral(body, "presence_penalty", (0, 0.0), _CONTRACT)
    _neutral(body, "frequency_penalty", (0, 0.0), _CONTRACT)
    _neutral(body, "repetition_penalty", (1, 1.0), _CONTRACT)
    _neutral(body, "min_tokens", (0,), "completions end at a stop token or max_tokens")
    if body.get("logit_bias"):
        raise ApiError(400, "`logit_bias` is not supported: " + _CONTRACT, "logit_bias")
    n = _number(body, "n", 1, int)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"`n` must be in [1, {MAX_N}], got {n}", "n")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, f"`max_tokens` must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "`stop` must be a string or a list of strings", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ApiError(400, "`stop_token_ids` must be a list of token ids", "stop_token_ids")
    if eos is not None and not body.get("ignore_eos"):
        stop_ids = [eos, *stop_ids]
    greedy = temperature < _GREEDY_BELOW  # as vLLM: dividing logits by a tinier temperature overflows them
    sampling = Sampling(greedy=greedy, temperature=1.0 if greedy else temperature, max_tokens=0,
                        stop_token_ids=tuple(dict.fromkeys(stop_ids)), n=n)
    return sampling, max_tokens, [s for s in stop if s]


def _text_parts(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content is supported (parts of type 'text')", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", "messages")


def parse_messages(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string `role`", "messages")
        m = dict(m)
        m["content"] = _text_parts(m.get("content"), f"messages[{i}]")
        calls = m.get("tool_calls")
        if calls:  # chat templates want the arguments as objects; OpenAI clients send them as JSON text
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise ApiError(400, f"messages[{i}].tool_calls must be a list of {{type, function: {{name, "
                                    "arguments}} objects", "messages")
            fixed = []
            for c in calls:
                c = json.loads(json.dumps(c))
                fn = c["function"]
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def apply_stop_strings(tok, c: Completion, stop: Sequence[str]) -> Tuple[Completion, str]:
    """The completion cut after the token that completes the first stop string, and its text without that string."""
    text = tok.decode(c.tokens, skip_special_tokens=True)
    hits = [text.find(s) for s in stop if s in text]
    if not hits:
        return c, text
    lo, hi = 1, len(c.tokens)
    while lo < hi:  # the shortest prefix whose text holds a stop string
        mid = (lo + hi) // 2
        if any(s in tok.decode(c.tokens[:mid], skip_special_tokens=True) for s in stop):
            hi = mid
        else:
            lo = mid + 1
    cut = replace(c, tokens=c.tokens[:lo], logprobs=c.logprobs[:lo], finish_reason="stop")
    return cut, text[:min(hits)]


def _versions(results: Sequence[Tuple[List[Completion], int]]) -> Tuple[int, int]:
    """(oldest, newest) weights version over the completions of a response."""
    lo, hi = [], []
    for completions, version in results:
        for c in completions:
            lo.append(getattr(c, "min_version", None) if getattr(c, "min_version", None) is not None else version)
            hi.append(getattr(c, "max_version", None) if getattr(c, "max_version", None) is not None else version)
    return (min(lo), max(hi)) if lo else (0, 0)


def parse_tool_calls(text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """(content before the calls, OpenAI tool_calls) of a completion in the Qwen3/Hermes format; no calls: (text, [])."""
    from rlhpc.env.tools import ToolCallError, parse_hermes

    try:
        calls = parse_hermes(text)
    except ToolCallError:
        return text, []
    if not calls:
        return text, []
    content = text[:text.find("<tool_call>")].strip() or None
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


# ---- the app --------------------------------------------------------------------------------------------------------


def _make_app(server: Server):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="rlhpc", docs_url=None, redoc_url=None, openapi_url=None)
    tok = server.tok
    eos = tok.eos_token_id

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):  # noqa: ARG001
        return JSONResponse(e.body(), status_code=e.status)

    app.add_middleware(_InternalErrors)

    async def _not_found(request: Request, e: Any):
        status = getattr(e, "status_code", 404)
        err = ApiError(status, f"{request.method} {request.url.path}: {getattr(e, 'detail', 'not found')}",
                       kind="not_found_error" if status == 404 else "invalid_request_error")
        return JSONResponse(err.body(), status_code=status)

    from starlette.exceptions import HTTPException

    app.add_exception_handler(HTTPException, _not_found)  # unknown routes and methods answer in the OpenAI shape

    async def read(request: Request) -> Dict[str, Any]:
        server.check_token(request.headers.get("authorization"))
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body has {int(size)} bytes; the most this server reads is "
                                f"{MAX_BODY_BYTES}")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes, the most this server "
                                    "reads")
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def reply(content: Dict[str, Any], version: int) -> Any:
        return JSONResponse(content, headers={VERSION_HEADER: str(version)})

    def stream(chunks: List[Dict[str, Any]], version: int) -> Any:
        async def events() -> AsyncIterator[bytes]:
            for c in chunks:
                yield f"data: {json.dumps(c)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={VERSION_HEADER: str(version)})

    raw_bytes = token_bytes_of(tok)

    def token_text(t: int, as_ids: bool) -> str:
        return f"token_id:{t}" if as_ids else tok.decode([t])

    def chat_logprobs(c: Completion, as_ids: bool, top: int) -> List[Dict[str, Any]]:
        out = []
        for t, lp in zip(c.tokens, c.logprobs):
            s = token_text(t, as_ids)
            entry = {"token": s, "logprob": lp, "bytes": list(raw_bytes(t))}
            entry["top_logprobs"] = [dict(entry)] if top else []  # the sampled token only (docs/serving.md)
            out.append(entry)
        return out

    @app.get("/health")
    async def health():
        return reply({"status": "ok", "weights_version": server.engine.version}, server.engine.version)

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_token(request.headers.get("authorization"))
        v = server.engine.version
        return reply({"object": "list", "data": [
            {"id": server.model, "object": "model", "created": 0, "owned_by": "rlhpc", "root": server.model,
             "max_model_len": server.context, "weights_version": v}]}, v)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read(request)
        server.check_model(body)
        messages = parse_messages(body)
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, "`tools` must be a list of function tools", "tools")
        parse_options(body)
        use_tools = bool(tools) and body.get("tool_choice") != "none"
        sampling, max_tokens, stop = parse_sampling(body, eos)
        kwargs = _object(body, "chat_template_kwargs")
        streaming, stream_options = _flag(body, "stream"), _object(body, "stream_options")
        server.check_text("".join(m["content"] for m in messages), "messages")

        def render() -> List[int]:
            try:
                text = tok.apply_chat_template(messages, tools=tools if use_tools else None,
                                               add_generation_prompt=body.get("add_generation_prompt", True),
                                               tokenize=False, **kwargs)
            except Exception as e:  # noqa: BLE001 - a template that refuses these messages is the request's problem
                raise ApiError(400, f"the chat template cannot render these messages: {e}", "messages") from None
            server.check_text(text, "messages")
            return tok(text, add_special_tokens=False)["input_ids"]

        prompt = await asyncio.to_thread(render)  # off the event loop: other clients are answered meanwhile
        budget = server.check_prompt(prompt, max_tokens)
        top = body.get("top_logprobs") or 0
        want_lp, as_ids = bool(body.get("logprobs")), bool(body.get("return_tokens_as_token_ids"))
        want_ids = bool(body.get("return_token_ids"))
        completions, version = await server.run(prompt, replace(sampling, max_tokens=budget), request)
        lo, hi = _versions([(completions, version)])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = []
        for i, c in enumerate(completions):
            c, text_out = apply_stop_strings(tok, c, stop)
            content, calls = parse_tool_calls(text_out) if use_tools else (text_out, [])
            message: Dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice: Dict[str, Any] = {"index": i, "message": message,
                                      "finish_reason": "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
                                      "logprobs": {"content": chat_logprobs(c, as_ids, top)} if want_lp else None}
            if want_ids:
                choice["token_ids"] = list(c.tokens)
            choices.append((choice, c))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c.tokens) for _, c in choices),
                 "total_tokens": len(prompt) + sum(len(c.tokens) for _, c in choices)}
        head = {"id": rid, "created": created, "model": server.model, "weights_version": hi, "min_weights_version": lo}
        if not streaming:
            out = {**head, "object": "chat.completion", "choices": [ch for ch, _ in choices], "usage": usage}
            if want_ids:
                out["prompt_token_ids"] = prompt
            return reply(out, hi)
        chunks = []
        for choice, c in choices:
            def chunk(delta: Dict[str, Any], finish: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
                ch = {"index": choice["index"], "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
                return {**head, "object": "chat.completion.chunk", "choices": [ch]}

            first = chunk({"role": "assistant", "content": ""})
            if want_ids:
                first["prompt_token_ids"] = prompt
            chunks.append(first)
            message = choice["message"]
            lps = choice["logprobs"]["content"] if want_lp else None
            for k, piece in enumerate(_deltas(tok, c.tokens, message["content"] or "")):
                extra: Dict[str, Any] = {}
                if lps is not None:
                    extra["logprobs"] = {"content": [lps[k]]}
                if want_ids:
                    extra["token_ids"] = [c.tokens[k]]
                chunks.append(chunk({"content": piece}, **extra))
            if message.get("tool_calls"):
                chunks.append(chunk({"tool_calls": [{"index": j, **tc} for j, tc in enumerate(message["tool_calls"])]}))
            chunks.append(chunk({}, choice["finish_reason"]))
        if stream_options.get("include_usage"):
            chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        return stream(chunks, hi)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read(request)
        server.check_model(body)
        if body.get("echo"):
            raise ApiError(400, "`echo` is not supported", "echo")
        if body.get("suffix"):
            raise ApiError(400, "`suffix` is not supported", "suffix")
        parse_options(body)
        streaming, stream_options = _flag(body, "stream"), _object(body, "stream_options")
        text_prompt = body.get("prompt")
        for p in [text_prompt] if isinstance(text_prompt, str) else text_prompt if isinstance(text_prompt, list) else []:
            if isinstance(p, str):
                server.check_text(p, "prompt")
        prompts = await asyncio.to_thread(_prompts, tok, text_prompt)
        sampling, max_tokens, stop = parse_sampling(body, eos)
        if len(prompts) * sampling.n > MAX_N:
            raise ApiError(400, f"{len(prompts)} prompts x n={sampling.n} completions is more than {MAX_N}", "n")
        budgets = [server.check_prompt(p, max_tokens, "prompt") for p in prompts]
        results = await asyncio.gather(*[server.run(p, replace(sampling, max_tokens=b), request)
                                         for p, b in zip(prompts, budgets)])
        lo, hi = _versions(results)
        want_lp = body.get("logprobs") is not None
        want_ids = bool(body.get("return_token_ids"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model,
                "weights_version": hi, "min_weights_version": lo}
        choices, n_out = [], 0
        for pi, (completions_, _) in enumerate(results):
            for j, c in enumerate(completions_):
                c, text = apply_stop_strings(tok, c, stop)
                n_out += len(c.tokens)
                lp = None
                if want_lp:
                    strs = [token_text(t, as_ids) for t in c.tokens]
                    offsets = text_offsets([raw_bytes(t) for t in c.tokens])
                    lp = {"tokens": strs, "token_logprobs": list(c.logprobs), "text_offset": offsets,
                          "top_logprobs": [{s: x} for s, x in zip(strs, c.logprobs)] if body["logprobs"] else None}
                choice = {"index": pi * sampling.n + j, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
                if want_ids:
                    choice["token_ids"] = list(c.tokens)
                    choice["prompt_token_ids"] = prompts[pi]
                choices.append((choice, c))
        usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": n_out,
                 "total_tokens": sum(len(p) for p in prompts) + n_out}
        if not streaming:
            return reply({**head, "object": "text_completion", "choices": [ch for ch, _ in choices], "usage": usage}, hi)
        chunks = []
        for choice, c in choices:
            for k, piece in enumerate(_deltas(tok, c.tokens, choice["text"])):
                ch: Dict[str, Any] = {"index": choice["index"], "text": piece, "finish_reason": None, "logprobs": None}
                if choice["logprobs"] is not None:
                    lp = choice["logprobs"]
                    ch["logprobs"] = {"tokens": lp["tokens"][k:k + 1], "token_logprobs": lp["token_logprobs"][k:k + 1],
                                      "text_offset": lp["text_offset"][k:k + 1],
                                      "top_logprobs": lp["top_logprobs"][k:k + 1] if lp["top_logprobs"] else None}
                if want_ids:
                    ch["token_ids"] = [c.tokens[k]]
                chunks.append({**head, "object": "text_completion", "choices": [ch]})
            chunks.append({**head, "object": "text_completion",
                           "choices": [{"index": choice["index"], "text": "", "finish_reason": choice["finish_reason"],
                                        "logprobs": None}]})
        if stream_options.get("include_usage"):
            chunks.append({**head, "object": "text_completion", "choices": [], "usage": usage})
        return stream(chunks, hi)

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        body = await read(request)
        server.check_model(body, required=False)
        if _flag(body, "stream"):
            raise ApiError(400, "`stream` is not supported on /inference/v1/generate (use /v1/completions)", "stream")
        if body.get("features") or body.get("content_parts"):
            raise ApiError(400, "multimodal inputs are not supported", "features")
        prompt = body.get("token_ids")
        if not isinstance(prompt, list):
            raise ApiError(400, "`token_ids` must be a non-empty list of token ids", "token_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ApiError(400, "`sampling_params` must be an object", "sampling_params")
        sampling, max_tokens, stop = parse_sampling(params, eos)
        budget = server.check_prompt(prompt, max_tokens, "token_ids")
        completions_, version = await server.run(prompt, replace(sampling, max_tokens=budget), request)
        lo, hi = _versions([(completions_, version)])
        choices = []
        for i, c in enumerate(completions_):
            if stop:
                c, _ = apply_stop_strings(tok, c, stop)
            choice: Dict[str, Any] = {
                "index": i, "token_ids": list(c.tokens), "finish_reason": c.finish_reason,
                "stop_reason": c.tokens[-1] if c.finish_reason == "stop" and c.tokens else None,
                # `token` as vLLM writes it with --return-tokens-as-token-ids (what the renderers client checks),
                # `token_id` as its tokens-only protocol does.
                "logprobs": {"content": [{"token": f"token_id:{t}", "token_id": t, "logprob": lp}
                                         for t, lp in zip(c.tokens, c.logprobs)]},
            }
            spans = getattr(c, "version_spans", None)
            if spans:
                choice["weight_versions"] = [{"version": str(v), "start": a, "end": b} for v, a, b in spans]
            choices.append(choice)
        n_out = sum(len(c["token_ids"]) for c in choices)
        return reply({"request_id": body.get("request_id") or f"gen-{uuid.uuid4().hex}", "model": server.model,
                      "created": int(time.time()), "prompt_token_ids": prompt, "choices": choices,
                      "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                                "total_tokens": len(prompt) + n_out},
                      "weights_version": hi, "min_weights_version": lo}, hi)

    return app


class _InternalErrors:
    """Any failure of a handler: one 500 in the OpenAI shape and one traceback in the log. An ASGI middleware of its
    own: an exception handler for Exception makes Starlette re-raise (uvicorn logs the traceback again), and Starlette's
    BaseHTTPMiddleware wraps `receive` so that a handler no longer sees its client disconnect."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001 - whatever a handler raised
            log.exception("serving %s failed", scope.get("path"))
            if started:
                return  # the answer had begun: the client sees it cut short
            body = json.dumps(ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="internal_error").body())
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body.encode()})


def _prompts(tok, prompt: Any) -> List[List[int]]:
    """The prompts of a /v1/completions request: text, token ids, or a list of either."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        items: List[Any] = [prompt]
    elif is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise ApiError(400, "`prompt` must be a string, a list of token ids, or a list of either", "prompt")
    return [list(p) if isinstance(p, list) else tok(p)["input_ids"] for p in items]


def _byte_level_alphabet() -> Dict[str, int]:
    """The characters a byte-level BPE (GPT-2, Qwen, GLM, MiniMax; rlhpc's built tokenizer) writes its tokens in,
    each standing for one byte: printable bytes for themselves, the others for 256 + their rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes_of(tok):
    """token id -> its raw bytes (OpenAI's `bytes` field): exact for byte-level BPE tokenizers, whose single tokens
    may end inside a multi-byte character (decoding one alone gives U+FFFD); the UTF-8 of its text otherwise."""
    alphabet = _byte_level_alphabet() if _is_byte_level(tok) else {}
    specials = set(getattr(tok, "all_special_ids", []) or [])

    def raw(t: int) -> bytes:
        piece = tok.convert_ids_to_tokens(t)
        if t not in specials and isinstance(piece, str) and piece and all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
        return tok.decode([t]).encode()

    return raw


def _is_byte_level(tok) -> bool:
    """Whether the (fast) tokenizer decodes through the byte-level alphabet (a SentencePiece one writes 'é' as itself,
    two bytes of UTF-8, where a byte-level one writes the single byte 0xE9 as 'é')."""
    backend = getattr(tok, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    if type(decoder).__name__ != "Sequence":
        return type(decoder).__name__ == "ByteLevel"
    try:
        spec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - a tokenizer that cannot describe itself: not assumed byte-level
        return False
    return any(d.get("type") == "ByteLevel" for d in spec.get("decoders", []) or [])


def text_offsets(pieces: Sequence[bytes]) -> List[int]:
    """The offset in the completion's text of the character where each token's bytes begin (a token that begins inside
    a multi-byte character: that character's)."""
    offsets, chars = [], 0
    for b in pieces:
        inside = bool(b) and b[0] & 0xC0 == 0x80 and chars > 0  # starts with a UTF-8 continuation byte
        offsets.append(chars - inside)
        chars += sum(1 for x in b if x & 0xC0 != 0x80)
    return offsets


def _deltas(tok, tokens: Sequence[int], text: str) -> List[str]:
    """The text each token adds, for streaming: pieces that concatenate to `text` (the completion's text, possibly cut
    at a stop string); a token that ends inside a multi-byte character adds nothing until the character is complete."""
    pieces, sent = [], 0
    for k in range(1, len(tokens) + 1):
        prefix = tok.decode(tokens[:k], skip_special_tokens=True)
        if prefix.endswith("\ufffd") and k < len(tokens):
            pieces.append("")
            continue
        upto = min(len(prefix), len(text))
        pieces.append(text[sent:upto] if upto > sent else "")
        sent = max(sent, upto)
    if pieces and sent < len(text):
        pieces[-1] += text[sent:]
    return pieces


# ---- rendezvous: where a worker serves, and the token ---------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one), or a ConfigError naming the key to change: a port in use
    (inference.serve_port), a host that is no address of this node (inference.serve_host)."""
    from rlhpc.config.schema import ConfigError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        key = "inference.serve_port" if e.errno == errno.EADDRINUSE else "inference.serve_host"
        raise ConfigError(f"config key `{key}`: cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


def context_length(model_dir: str | Path, max_model_len: int = 0) -> int:
    """Tokens a sequence may hold: the model's max_position_embeddings (and vLLM's max_model_len when given)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    limit = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings") or 4096
    return min(int(limit), max_model_len) if max_model_len else int(limit)


def vocab_size(model_dir: str | Path) -> Optional[int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")


def private_server(engine: Engine, model_dir: str) -> Server:
    """A started server over `engine` alone, with a fresh token, for a harness that calls the model over HTTP: the
    verifiers environments (rlhpc/env/verifiers_env.py), which receive this function from rlhpc/infer/rollout.py and so
    never import the server."""
    from rlhpc.modeling.models import load_tokenizer

    return Server(engine, load_tokenizer(model_dir), model_dir, context_length(model_dir), secrets.token_hex(16),
                  vocab_size=vocab_size(model_dir)).start()


def shared_token(path: Path) -> str:
    """The random token in `path`, made by whichever process gets there first (create-if-absent, atomic)."""
    info = read_json(path)
    if info:
        return info["token"]
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    tmp.write_text(json.dumps({"token": secrets.token_hex(16)}))
    try:
        os.link(tmp, path)  # fails if another process made it first: then theirs is the token
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return read_json(path)["token"]


def run_token(run: RunDir, transport: str, attempt: str, timeout_s: float, abort=None) -> Tuple[str, str]:
    """(token, the rendezvous file holding it): the weights group's token with the broadcast transport (published by
    trainer rank 0 for this attempt), otherwise a token of the run's own made once."""
    if transport == "broadcast":
        path = run.rendezvous / "weights.json"

        def current():
            info = read_json(path)
            return info if info and info.get("attempt") == attempt else None

        info = wait_for(current, timeout_s, f"the weights group rendezvous ({path}) for the serving token", poll_s=0.2,
                        abort=abort)
        return info["token"], path.name
    path = run.rendezvous / "serving-token.json"
    return shared_token(path), path.name


def publish(run: RunDir, rank: int, server: Server, token_file: Optional[str], model_dir: str | Path,
            attempt: str = "0") -> Path:
    """Writes `rendezvous/serve-<rank>.json`: where this worker serves, where its token is, and the model folder (a
    client renders prompts with its tokenizer). The server removes it when it closes."""
    path = run.rendezvous / f"serve-{rank}.json"
    write_json(path, {"url": server.url, "host": server.host, "port": server.port, "rank": rank, "model": server.model,
                      "model_dir": str(model_dir), "auth": "token" if server.token else "open",
                      "token_file": token_file, "attempt": attempt, "pid": os.getpid(),
                      "host_name": socket.gethostname(), "time": time.time()})
    server.rendezvous_file = path
    return path


@dataclass
class Endpoint:
    """What a client needs: the base URL, the token (None: open), the model id and the model folder (its tokenizer)."""

    url: str
    token: Optional[str]
    model: str
    model_dir: Optional[str] = None


def endpoint(run_dir: str | Path, rank: int = 0) -> Endpoint:
    """Worker `rank`'s endpoint in a run directory (a training run with inference.serve=true, or rlhpc.serve's)."""
    run = RunDir(Path(run_dir))
    info = read_json(run.rendezvous / f"serve-{rank}.json")
    if not info:
        raise FileNotFoundError(f"{run.rendezvous}/serve-{rank}.json does not exist: is the run serving "
                                f"(inference.serve=true), and has worker {rank} started?")
    token = None
    if info.get("token_file"):
        token = (read_json(run.rendezvous / info["token_file"]) or {}).get("token")
    return Endpoint(info["url"], token, info["model"], info.get("model_dir"))


def node_address(host: str = "") -> Tuple[str, str]:
    """(address to bind, address to publish): `host` if given (0.0.0.0 publishes this node's address), else this
    node's address under Slurm, loopback otherwise."""
    if host in ("0.0.0.0", "::"):
        return host, this_node_address()
    bind = host or this_node_address()
    return bind, bind


def start_server(cfg, engine: Engine, model_dir: str | Path, token: Optional[str], rank: int = 0) -> Server:
    """A server over `engine` as the config says (inference.serve_host, serve_port + rank, the model's name)."""
    from rlhpc.modeling import models

    inf = cfg.inference
    bind, published = node_address(inf.serve_host)
    server = Server(engine, models.load_tokenizer(model_dir), served_name(cfg),
                    context_length(model_dir, inf.max_model_len if inf.engine == "vllm" else 0), token, host=bind,
                    port=inf.serve_port + rank if inf.serve_port else 0, aliases=[cfg.model.name],
                    vocab_size=vocab_size(model_dir)).start()
    server.host = published
    return server


def serve_worker(cfg, ident, run: RunDir, engine: Engine) -> Server:
    """The server of an inference worker (inference.serve=true): its engine, the run's token, the published address."""
    from rlhpc.run.stop import Stop, stop_requested

    def abort() -> Optional[str]:
        if stop_requested():
            raise Stop(stop_requested())
        return run.failure()

    token, token_file = (None, None) if cfg.inference.serve_open else run_token(
        run, cfg.weights.transport, ident.attempt, cfg.weights.timeout_s, abort)
    server = start_server(cfg, engine, run.model, token, ident.rank)
    publish(run, ident.rank, server, token_file, run.model, ident.attempt)
    return server


def served_name(cfg) -> str:
    """The model id clients send: model.path when set (as vLLM names a served checkpoint), else model.name."""
    return cfg.model.path or cfg.model.name


