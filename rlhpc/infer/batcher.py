"""One engine, many callers: the worker's rollouts and HTTP clients take turns on it, and clients' requests are batched.

`SharedEngine` wraps an engine so that every call (generate, update_weights, score) holds one first-come-first-served
lock: a generation of the worker loop and one for HTTP clients never overlap, and weight updates land between engine
calls, exactly as without a server. Everything else (version, weight_updates, ...) reads and writes through to the
wrapped engine, so the worker loop uses the wrapper as it would the engine.

`Batcher` gathers the requests of all clients for a few milliseconds (and whatever queued up while the engine was busy)
and makes one engine call per bucket of compatible sampling settings: the same temperature (or greedy) and the same
stop tokens. A request of `n` completions adds its prompt `n` times. Requests with different `max_tokens` share a call
that generates up to the largest, and each keeps its own first `max_tokens` tokens: the first k tokens of a longer
sample have exactly the distribution of a k-token sample, so nothing changes but wasted work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

from rlhpc.infer.engines import Completion, Engine

log = logging.getLogger(__name__)


class _TurnLock:
    """A lock taken in arrival order, so neither the worker loop nor a stream of HTTP requests can starve the other."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class SharedEngine(Engine):
    """An engine that the worker loop and the HTTP server share; one engine call at a time."""

    def __init__(self, engine: Engine):
        object.__setattr__(self, "inner", engine)
        object.__setattr__(self, "_lock", _TurnLock())

    def generate(self, prompts, n, temperature, max_new_tokens, stop_token_ids, greedy=False):
        with self._lock:
            return self.inner.generate(prompts, n, temperature, max_new_tokens, stop_token_ids, greedy=greedy)

    def generate_for_clients(self, prompts: Sequence[Sequence[int]], temperature: float, max_new_tokens: int,
                             stop_token_ids: Sequence[int], greedy: bool) -> Tuple[List[List[Completion]], int]:
        """One completion per prompt, and the weights version in force when the call started. In-flight weight updates
        (vLLM) are left to the worker's own generations: an update taken here would never reach the worker loop's
        bookkeeping of its version. Updates still land between calls, through the worker loop."""
        with self._lock:
            hook = getattr(self.inner, "weight_updates", None)
            if hook is not None:
                self.inner.weight_updates = None
            try:
                version = self.version
                return self.inner.generate(prompts, 1, temperature, max_new_tokens, stop_token_ids, greedy=greedy), version
            finally:
                if hook is not None:
                    self.inner.weight_updates = hook

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], *args: Any, **kwargs: Any) -> None:
        with self._lock:
            self.inner.update_weights(named_tensors, *args, **kwargs)

    def score(self, sequences, temperature):
        with self._lock:
            return self.inner.score(sequences, temperature)

    def close(self) -> None:
        self.inner.close()

    @property
    def version(self) -> int:
        """The weights version the engine holds (0, the initial weights, until the worker sets it)."""
        return int(getattr(self.inner, "version", 0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)


class ShuttingDown(RuntimeError):
    """A request that arrived or waited while the server closes (the HTTP answer is 503)."""


@dataclass(frozen=True)
class Sampling:
    """What a client asked for, as the engine's sampling contract can do it (rlhpc.infer.engines)."""

    greedy: bool
    temperature: float  # 1.0 when greedy: greedy logprobs are reported under softmax(logits)
    max_tokens: int
    stop_token_ids: Tuple[int, ...]
    n: int = 1

    def bucket(self) -> Tuple[bool, float, Tuple[int, ...]]:
        return (self.greedy, self.temperature, tuple(sorted(set(self.stop_token_ids))))


@dataclass
class _Request:
    prompt: List[int]
    sampling: Sampling
    future: Future = field(default_factory=Future)


class Batcher:
    """Requests of all clients in, batched engine calls out, each request's completions back through a Future."""

    def __init__(self, engine: SharedEngine, context: int, window_s: float = 0.003, max_sequences: int = 256):
        self.engine = engine
        self.context = context  # prompt + completion tokens a sequence may hold
        self.window_s = window_s
        self.max_sequences = max_sequences
        self.engine_calls = 0
        self.sequences = 0
        self._queue: "queue.Queue[Optional[_Request]]" = queue.Queue()
        self._threads = torch.get_num_threads()  # torch's thread count is per thread: the batcher's is set to this
        self._closed = False
        self._outstanding: set = set()  # requests not answered yet (their futures), for close()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="serve-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], sampling: Sampling) -> "Future[Tuple[List[Completion], int]]":
        """`sampling.n` completions of `prompt` and the weights version they were generated with."""
        if self._closed:
            raise ShuttingDown("the server is shutting down")
        req = _Request(list(prompt), sampling)
        with self._lock:
            self._outstanding.add(req.future)
        req.future.add_done_callback(self._answered)
        self._queue.put(req)
        return req.future

    @property
    def waiting(self) -> int:
        """Requests submitted and not answered yet."""
        with self._lock:
            return len(self._outstanding)

    def _answered(self, future: Future) -> None:
        with self._lock:
            self._outstanding.discard(future)

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuses new requests and answers every request not answered yet with ShuttingDown at once, those of the
        engine call in progress included; waits up to `timeout_s` for that call, which cannot be interrupted, to end."""
        self._closed = True
        self._queue.put(None)
        with self._lock:
            waiting = list(self._outstanding)
        for future in waiting:
            _settle(future, error=ShuttingDown("the server is shutting down"))
        self._thread.join(timeout=timeout_s)

    # ---- the loop ---------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        backlog: List[_Request] = []
        while True:
            if not backlog:
                first = self._queue.get()
                if first is None:
                    return
                backlog.append(first)
                window = self.window_s  # a few milliseconds for other clients' requests to join
            else:
                window = 0.0  # what arrived while the engine was busy joins at once
            if not self._take_arrivals(backlog, time.monotonic() + window):
                self._fail(backlog, ShuttingDown("the server is shutting down"))
                self._fail(self._drain(), ShuttingDown("the server is shutting down"))
                return
            backlog = [r for r in backlog if not r.future.cancelled()]  # their clients left: nothing to generate
            if not backlog:
                continue
            call, backlog = self._next_call(backlog)
            self._generate(call)

    def _drain(self) -> List[_Request]:
        out = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out
            if item is not None:
                out.append(item)

    def _take_arrivals(self, backlog: List[_Request], deadline: float) -> bool:
        """Moves requests from the queue to `backlog` until the queue is empty at `deadline`; False on shutdown."""
        while True:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            backlog.append(item)

    def _next_call(self, backlog: List[_Request]) -> Tuple[List[_Request], List[_Request]]:
        """The requests of the next engine call (the oldest request's bucket, as many as fit) and the rest."""
        key = backlog[0].sampling.bucket()
        same = sorted((r for r in backlog if r.sampling.bucket() == key), key=lambda r: -r.sampling.max_tokens)
        call: List[_Request] = []
        budget = same[0].sampling.max_tokens
        for r in same:  # every prompt must fit the longest completion of the call within the context
            if len(r.prompt) + budget > self.context and call:
                continue
            if sum(x.sampling.n for x in call) + r.sampling.n > self.max_sequences and call:
                continue
            call.append(r)
        taken = {id(r) for r in call}
        return call, [r for r in backlog if id(r) not in taken]

    def _generate(self, call: List[_Request]) -> None:
        s = call[0].sampling
        budget = max(r.sampling.max_tokens for r in call)
        prompts = [r.prompt for r in call for _ in range(r.sampling.n)]
        try:
            outs, version = self.engine.generate_for_clients(prompts, s.temperature, budget, list(s.stop_token_ids),
                                                             s.greedy)
        except Exception as e:  # noqa: BLE001 - a request the engine refuses fails alone, never its batch-mates
            if len(call) > 1:
                log.warning("a batched engine call failed (%s); retrying its %d requests one by one", e, len(call))
                for r in call:
                    self._generate([r])
                return
            log.warning("engine call for one request failed: %s", e)
            _settle(call[0].future, error=e)
            return
        self.engine_calls += 1
        self.sequences += len(prompts)
        it = iter(outs)
        for r in call:
            completions = [_truncate(next(it)[0], r.sampling.max_tokens) for _ in range(r.sampling.n)]
            _settle(r.future, result=(completions, version))

    @staticmethod
    def _fail(requests: List[_Request], error: BaseException) -> None:
        for r in requests:
            _settle(r.future, error=error)


def _settle(future: Future, result: Any = None, error: Optional[BaseException] = None) -> None:
    """Answers `future` unless it is answered already (a client gone, a server closing: from another thread)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _truncate(c: Completion, max_tokens: int) -> Completion:
    if len(c.tokens) <= max_tokens:
        return c
    cut = replace(c, tokens=c.tokens[:max_tokens], logprobs=c.logprobs[:max_tokens], finish_reason="length")
    spans = getattr(c, "version_spans", None)
    if spans:  # vLLM: the versions that sampled the tokens kept
        kept = [(v, a, min(b, max_tokens)) for v, a, b in spans if a < max_tokens]
        cut = replace(cut, version_spans=kept, max_version=kept[-1][0] if kept else c.min_version)
    return cut
