"""verifiers (v1) environments in rlhpc: `env=verifiers env.args.id=<installed environment package>` (docs/verifiers.md).

The package's taskset (and its own `Env`, harness and tools, if it ships them) is loaded with verifiers'
`load_environment`; its episodes run as verifiers runs them: each agent's program (the chat-only `null` harness by
default) in the local `subprocess` runtime, its model calls through verifiers' interception server and `TrainClient`,
which renders the prompts with the `renderers` package and POSTs token ids to an rlhpc server's
`/inference/v1/generate` (rlhpc.infer.server) over the engine it is given: the worker's engine during training (a
private loopback server with a random token, sharing the engine's lock), the trainer's for held-out evaluation, or the
served policy itself with `rlhpc.eval`. A private server is reached in-process: TrainClient's HTTP client gets an ASGI
transport over the server's app instead of a socket (the same requests, token check, handlers and answers; see
`_in_process_transport`).

Each finished episode's traces become rlhpc episodes exactly as verifiers reports them: every trainable branch of a
trainable agent's trace is one sample (its `token_ids`, `sampled_mask`, `logprobs`), rewarded with the trace's reward
(`trace.reward`, verifiers' weighted sum). With a renderer that bridges turns (the model's own typed renderer, or
`ChatTemplateRenderer` below for rlhpc's built-in chat template), the turns of a multi-turn episode extend each other
and the episode is one sample, as in Prime-RL. An episode verifiers splits into several samples counts once per sample
in its group's baseline (logged as env/split_samples).

This module imports verifiers only when an environment is used: the rest of rlhpc never needs it.
`pip install -e '.[verifiers]'` installs it (verifiers==0.4.0, and uv, which prepares the harness programs).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import os
import random
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from rlhpc.env.base import Environment, Message, Task
from rlhpc.env.episode import Episode

log = logging.getLogger(__name__)

# The environment variable verifiers' TrainClient reads the endpoint's token from ("API_KEY" in the name: verifiers'
# subprocess runtime keeps such variables out of the harness programs it starts).
TOKEN_VAR = "RLHPC_SERVE_API_KEY"


class VerifiersEnvironment(Environment):
    """An installed verifiers environment package, run by verifiers, trained on by rlhpc."""

    name = "verifiers"

    def __init__(self, id: str, env_id: str = "", taskset: Optional[Dict[str, Any]] = None,
                 harness: Optional[Dict[str, Any]] = None, runtime: Optional[Dict[str, Any]] = None,
                 agent: Optional[Dict[str, Any]] = None, env: Optional[Dict[str, Any]] = None, eval_size: int = 64,
                 max_concurrent: int = 256, renderer: Optional[Dict[str, Any]] = None, reference_field: str = "",
                 in_process_endpoint: bool = True, episode_processes: int = 0, episodes_timeout_s: float = 3600.0,
                 **taskset_args: Any):
        """`id`: the taskset package; `env_id`: a verifiers Env to pair with it ("": the package's own, else the
        single-agent env); `taskset` and any other keyword: the taskset's own config keys; `harness` (default
        {"id": "rlhpc_chat"}, verifiers' chat loop in-process), `runtime` (default {"type": "subprocess"}) and `agent`
        (max_turns, timeouts, ...): the agent seat(s); `env`: further verifiers EnvConfig keys; `eval_size`: the first
        tasks are the held-out set; `max_concurrent`: episodes in flight; `renderer`: a renderers config ("": chosen
        from the model); `reference_field`: the task data field holding a correct answer, for the SFT warm start
        ("": none); `in_process_endpoint`: reach the private token endpoint in-process (false: over loopback HTTP, as
        verifiers does by default; 1.4x the cost per episode on a small model, benchmarks/verifiers_overhead.py);
        `episode_processes`: processes that share each batch's episodes, each with its own event loop, reaching the
        endpoint over loopback HTTP (0: the caller's event loop); `episodes_timeout_s`: the longest a process may take
        for its share of a batch (then it is killed and replaced, and its episodes fail)."""
        if episode_processes < 0:
            raise ValueError(f"config key `env.args.episode_processes`: {episode_processes} is not a count >= 0")
        self.id = id
        self.name = f"verifiers:{id}"
        self.env_id = env_id
        self.taskset_args = {**(taskset or {}), **taskset_args}
        # verifiers' chat loop in this process (rlhpc.env.verifiers_harness): ~25x cheaper per episode than the `null`
        # harness's program per episode, with the same interception, traces and rewards.
        self.harness = harness or {"id": "rlhpc_chat"}
        self.runtime = runtime or {"type": "subprocess"}
        self.agent = dict(agent or {})
        self.env_args = dict(env or {})
        self.eval_size = eval_size
        self.max_concurrent = max_concurrent
        self.renderer = renderer
        self.reference_field = reference_field
        self.in_process_endpoint = in_process_endpoint
        self.episode_processes = episode_processes
        self.episodes_timeout_s = episodes_timeout_s
        self._pool: Any = None  # the processes that run episodes (episode_processes > 0), started at first use
        self._tokenizers: Dict[str, Any] = {}  # a pool process's tokenizers, by model folder
        self._env: Any = None  # the verifiers Env, built at first use
        self._tasks: Optional[List[Any]] = None
        self._server: Any = None  # a private server over the engine episodes run against

    # ---- the verifiers environment ----------------------------------------------------------------------------------

    def verifiers_env(self) -> Any:
        if self._env is None:
            # verifiers, its HTTP client and its interception server log every episode and request at INFO: thousands
            # of lines a minute in the role's log. Their warnings and errors still come through.
            for name in ("verifiers", "httpx", "aiohttp.access"):
                if logging.getLogger(name).level == logging.NOTSET:
                    logging.getLogger(name).setLevel(logging.WARNING)
            from verifiers.v1.configs.agent import agent_config_fields
            from verifiers.v1.utils.loaders import load_environment, resolve_env_config

            # verifiers imports a harness by its id as a top-level module name: `rlhpc_chat` names rlhpc's, which
            # lives inside the package, so it is registered under that name before verifiers looks for it.
            sys.modules.setdefault("rlhpc_chat", importlib.import_module("rlhpc.env.verifiers_harness"))

            cfg = getattr(self, "config", None)  # rlhpc's EnvConfig (set by rlhpc.env.load)
            agent = {"harness": self.harness, "runtime": self.runtime, **self.agent}
            if cfg is not None and cfg.max_turns:
                agent.setdefault("max_turns", cfg.max_turns)
            if cfg is not None and cfg.max_episode_tokens:
                agent.setdefault("max_total_tokens", cfg.max_episode_tokens)
            raw: Dict[str, Any] = {"taskset": {"id": self.id, **self.taskset_args}, **self.env_args}
            if self.env_id:
                raw["id"] = self.env_id
            # Every agent seat the env declares plays with these settings, except what the package pinned itself (a
            # seat's harness, say); the runtime is local unless configured (never a hosted sandbox by default).
            for seat, spec in agent_config_fields(resolve_env_config(dict(raw))).items():
                pinned = spec.model_dump(exclude_unset=True)
                raw[seat] = {**{k: v for k, v in agent.items() if k not in pinned}, **pinned, **raw.get(seat, {})}
            self._env = load_environment(resolve_env_config(raw))
        return self._env

    def warm(self) -> None:
        if self.episode_processes:  # a process that will play episodes (the worker's own pool plays none)
            importlib.import_module("rlhpc.modeling.models")  # the tokenizer loader (transformers), for `play`
            self.verifiers_env()

    def _all_tasks(self) -> List[Any]:
        if self._tasks is None:
            taskset = self.verifiers_env().taskset
            if not taskset.bounded:  # an endless taskset: hold out its first tasks, train on a window after them
                taskset = taskset.take(self.eval_size + 100_000)
            self._tasks = list(taskset)
        return self._tasks

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        tasks = self._all_tasks()
        if split == "eval":
            yield from (Task(f"eval-{i}", {"vf": t}) for i, t in enumerate(tasks[:self.eval_size]))
            return
        train = list(range(self.eval_size, len(tasks))) or list(range(len(tasks)))
        rng = random.Random(seed)
        for epoch in itertools.count():
            order = train[:]
            rng.shuffle(order)
            for i in order:
                yield Task(f"{epoch}-{i}", {"vf": tasks[i]})

    def messages(self, task: Task) -> List[Message]:
        data = task.data["vf"].data
        out: List[Message] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            out.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            out += [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in data.prompt]
        return out

    def reference(self, task: Task) -> str:
        if not self.reference_field:
            raise NotImplementedError(f"environment {self.name}: set env.args.reference_field to the task data field "
                                      "holding a correct answer to use it for SFT")
        return str(getattr(task.data["vf"].data, self.reference_field))

    # ---- episodes ---------------------------------------------------------------------------------------------------

    def run_episodes(self, engine, tokenizer, tasks: Sequence[Task], n: int, temperature: float, env_cfg,
                     version: int = 0, greedy: bool = False,
                     serve: Optional[Callable[[Any, str], Any]] = None) -> List[List[Episode]]:
        """`n` verifiers episodes of each task, against `engine`, as rlhpc episodes grouped by task (rollout.episodes
        calls this instead of rlhpc.env.episode.run_episodes). `serve(engine, model_dir)` starts a private server over
        an engine that is no endpoint yet (rlhpc.infer.server.private_server: environments never import the server)."""
        endpoint = self._endpoint(engine, tokenizer, serve)
        if self.episode_processes:
            return self._run_in_processes(endpoint, tokenizer, tasks, n, temperature, env_cfg, version, greedy)
        return self.play(endpoint, tasks, n, temperature, env_cfg, version, greedy, tokenizer)

    def play(self, endpoint: tuple, tasks: Sequence[Task], n: int, temperature: float, env_cfg, version: int,
             greedy: bool, tokenizer: Any = None) -> List[List[Episode]]:
        """The episodes of `tasks` against the token endpoint (URL, token, model id, model folder), on this process's
        event loop. A pool process (episode_processes) runs its share of a batch here, with the tokenizer of the model
        folder."""
        import verifiers.v1 as vf

        url, token, model, model_dir = endpoint
        if tokenizer is None:
            tokenizer = self._tokenizer(model_dir)
        os.environ[TOKEN_VAR] = token or "EMPTY"
        client = vf.TrainClientConfig(base_url=url + "/v1", api_key_var=TOKEN_VAR, renderer_model_name=model_dir,
                                      renderer=self._renderer_config(tokenizer))
        sampling = vf.SamplingConfig(temperature=0.0 if greedy else temperature, max_tokens=env_cfg.max_new_tokens)
        ctx = vf.ModelContext(model=model, client=client, sampling=sampling)
        env = self.verifiers_env()

        async def run_all() -> List[Any]:
            gate = asyncio.Semaphore(self.max_concurrent)

            async def one(vf_task: Any) -> Any:
                async with gate:
                    return await env.run_episode(vf_task, ctx)

            async with env.serving():
                return await asyncio.gather(*[one(t.data["vf"]) for t in tasks for _ in range(n)])

        finished = iter(_run(run_all()))
        return [[e for _ in range(n) for e in self.to_episodes(task, next(finished), version, tokenizer,
                                                               env_cfg.error_reward)]
                for task in tasks]

    def _run_in_processes(self, endpoint: tuple, tokenizer, tasks: Sequence[Task], n: int, temperature: float,
                          env_cfg, version: int, greedy: bool) -> List[List[Episode]]:
        """The batch's tasks dealt round-robin to the pool's processes (a task's n episodes stay together: one group's
        episodes share a process), each playing its share on its own event loop, over HTTP. A share whose process
        fails or runs past `episodes_timeout_s` fails its episodes (error_reward, env/errors), the batch goes on."""
        from rlhpc.env.pool import EnvPool

        if self._pool is None:
            if self.config is None:
                raise ValueError("env.args.episode_processes needs an environment built by rlhpc.env.load")
            self._pool = EnvPool(self.config, processes=self.episode_processes, timeout_s=self.episodes_timeout_s,
                                 timeout_key="env.args.episodes_timeout_s")
        shares = [list(range(i, len(tasks), self.episode_processes)) for i in range(self.episode_processes)]
        futures = [(share, self._pool.submit("play", endpoint, [tasks[i] for i in share], n,
                                             temperature, env_cfg, version, greedy))
                   for share in shares if share]
        out: List[Optional[List[Episode]]] = [None] * len(tasks)
        for share, fut in futures:
            try:
                played = fut.result(timeout=self.episodes_timeout_s + 60)  # the pool kills a share past its limit
            except Exception as e:  # noqa: BLE001 - the share's episodes fail; the batch goes on
                log.warning("verifiers episodes of %d tasks failed in a pool process: %s", len(share), e)
                played = [[self._failed(tasks[i], tokenizer, f"{type(e).__name__}: {e}", env_cfg.error_reward,
                                        version) for _ in range(n)] for i in share]
            for i, group in zip(share, played):
                for e in group:
                    e.task = tasks[i]  # the caller's own Task (the pool's is a copy)
                out[i] = group
        return out  # type: ignore[return-value]

    def _tokenizer(self, model_dir: str) -> Any:
        if model_dir not in self._tokenizers:
            from rlhpc.modeling.models import load_tokenizer

            self._tokenizers[model_dir] = load_tokenizer(model_dir)
        return self._tokenizers[model_dir]

    def to_episodes(self, task: Task, episode: Any, version: int, tokenizer, error_reward: float = 0.0) -> List[Episode]:
        """The rlhpc episodes (training samples) of one verifiers episode: one per trainable branch of each trainable
        agent's trace, with the trace's reward. An episode that produced no sample is one failed sample."""
        out: List[Episode] = []
        for trace in episode.traces:
            if not getattr(trace.agent, "trainable", True):
                continue
            branches = [b for b in trace.branches if b.trainable and any(b.sampled_mask)]
            error = None
            if not trace.ok:
                last = trace.last_error or episode.last_error
                error = f"{last.type}: {last.message}" if last is not None else "the verifiers trace did not complete"
            for b in branches:
                ids, mask, logprobs = b.token_ids, b.sampled_mask, b.logprobs
                start = mask.index(True)  # rlhpc's layout: the prompt, then what follows it (sampled or not)
                e = Episode(task, list(ids), start, [m.model_dump(exclude_none=True) for m in b.messages],
                            logprobs=list(logprobs[start:]), mask=list(mask[start:]),
                            completions=[m.content or "" for m in trace.assistant_messages], turns=len(b.calls),
                            done=True, truncated=trace.is_truncated, reward=trace.reward, error=error,
                            timed_out=trace.is_timeout, min_version=version, max_version=version)
                if len(branches) > 1:
                    e.counts["split_samples"] = 1
                out.append(e)
        if not out:  # nothing trainable came back: a sample of the prompt alone, failed with the episode's error
            last = episode.last_error or next((t.last_error for t in episode.traces if t.last_error), None)
            failed = self._failed(task, tokenizer, f"{last.type}: {last.message}" if last is not None else
                                  "the verifiers episode produced no sample", error_reward, version)
            failed.timed_out = episode.is_timeout
            out.append(failed)
        return out

    def _failed(self, task: Task, tokenizer, error: str, error_reward: float, version: int) -> Episode:
        """A failed sample of the prompt alone."""
        from rlhpc.env.episode import Renderer

        prompt = Renderer(tokenizer).prompt(self.messages(task))
        return Episode(task, prompt, len(prompt), self.messages(task), done=True, reward=error_reward, error=error,
                       min_version=version, max_version=version)

    def _endpoint(self, engine, tokenizer, serve: Optional[Callable[[Any, str], Any]]) -> tuple:
        """(URL, token, model id, model folder) of a token endpoint over `engine`."""
        model_dir = str(Path(tokenizer.name_or_path))
        served = getattr(engine, "endpoint", None)
        if served is not None:  # already an endpoint (a RemoteEngine: rlhpc.eval against a served run)
            return (*served, model_dir)
        server = self._server
        if server is None or engine not in (server.engine, server.engine.inner):
            if serve is None:
                raise ValueError("a verifiers environment runs against an endpoint: pass `serve` "
                                 "(rlhpc.infer.server.private_server) with an engine that is not one")
            self._close_server()  # one private server, over the engine in use (the trainer's warm start's is let go)
            server = self._server = serve(engine, model_dir)
            if self.in_process_endpoint and not self.episode_processes:
                _in_process_transport()
                _IN_PROCESS[server.url] = server.app
        return server.url, server.token, server.model, model_dir

    def _renderer_config(self, tokenizer) -> Any:
        """The renderers config: as given, else ChatTemplateRenderer for rlhpc's built-in chat template (it bridges
        turns), else None (renderers picks the model's own renderer)."""
        from renderers.configs import CustomRendererConfig

        if self.renderer:
            from pydantic import TypeAdapter
            from renderers import RendererConfig

            return TypeAdapter(RendererConfig).validate_python(dict(self.renderer))
        from rlhpc.modeling.models import CHAT_TEMPLATE

        if getattr(tokenizer, "chat_template", None) == CHAT_TEMPLATE:
            extra = {"tool_parser": "qwen3"} if "<tool_call>" in tokenizer.get_vocab() else {}
            return CustomRendererConfig(import_path="rlhpc.env.verifiers_env.ChatTemplateRenderer", **extra)
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._close_server()

    def _close_server(self) -> None:
        if self._server is not None:
            _IN_PROCESS.pop(self._server.url, None)
            self._server.close()
            self._server = None


# The apps of this process's private servers, by URL: verifiers clients of these URLs reach them in-process.
_IN_PROCESS: Dict[str, Any] = {}


def _in_process_transport() -> None:
    """Makes verifiers' clients of a private server of this process (a base URL in `_IN_PROCESS`) call its app
    through an httpx ASGI transport, not a socket: the same HTTP requests, token check, handlers and answers, in the
    episodes' event loop. Over loopback, every model call paid an HTTP round trip to the server's thread, and
    httpcore's connection pool, which verifiers' TrainClient keeps one of for all episodes in flight (up to 256
    connections), scans its connections on every request and every release: measured, 15 ms of CPU per single-turn
    episode over loopback, 11.0 ms in-process (benchmarks/verifiers_overhead.py). The patch of verifiers that does it
    is rlhpc.patches.libraries.in_process_httpx (its versions in rlhpc/patches/registry.py)."""
    from rlhpc.patches.libraries import in_process_httpx

    in_process_httpx(lambda url: next((a for u, a in list(_IN_PROCESS.items()) if url == u or url.startswith(u + "/")),
                                      None))


_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


def _run(coro: Any) -> Any:
    """Runs `coro` on this process's one event loop for verifiers episodes. Not a new loop per batch (asyncio.run):
    the `renderers` client that verifiers' TrainClient uses holds a module-level asyncio.Lock, which binds to the loop
    it is first contended in; on any later loop each contended call fails ("bound to a different event loop") and is
    retried or lost. That happened whenever a new endpoint came up (each SFT validation's engine)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            _LOOP = asyncio.new_event_loop()
        return _LOOP.run_until_complete(coro)


# ---- a renderer that bridges turns for a plain chat template --------------------------------------------------------

_SENTINEL = "\x00rlhpc-turn-end\x00"


def _chat_template_renderer() -> type:
    """renderers' DefaultRenderer (the model's chat template) plus `bridge_to_next_turn`: the next prompt is the
    previous prompt, the sampled completion, and the template's text for the new messages, tokenized on its own, so
    the turns of an episode extend each other (one training sample), as rlhpc.env.episode.Renderer does."""
    from renderers.base import RenderedTokens, extract_message_tool_names
    from renderers.configs import DefaultRendererConfig
    from renderers.default import DefaultRenderer, _decode_tool_call_arguments

    class ChatTemplateRenderer(DefaultRenderer):
        config_class = DefaultRendererConfig

        def _text(self, messages, tools, generation: bool) -> str:
            kwargs = dict(self.config.model_extra or {})
            if tools is not None:
                kwargs["tools"] = tools
            return self._tokenizer.apply_chat_template(_decode_tool_call_arguments(messages), tokenize=False,
                                                       add_generation_prompt=generation, **kwargs)

        def _encode(self, text: str) -> List[int]:
            return self._tokenizer.encode(text, add_special_tokens=False) if text else []

        def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None):
            if not previous_prompt_ids or not new_messages or any(m.get("role") == "assistant" for m in new_messages):
                return None
            before = [{"role": "user", "content": ""}, {"role": "assistant", "content": _SENTINEL}]
            prev = self._text(before, tools, False)
            if _SENTINEL not in prev:
                return None
            close = prev[prev.rindex(_SENTINEL) + len(_SENTINEL):]
            stops = set(self.get_stop_token_ids())
            if previous_completion_ids and previous_completion_ids[-1] in stops:
                eos = self._tokenizer.decode([previous_completion_ids[-1]])
                if not close.startswith(eos):
                    return None
                close = close[len(eos):]
            ext = self._encode(close)
            indices = [-1] * len(ext)
            done = prev
            for i in range(len(new_messages)):
                text = self._text(before + list(new_messages[:i + 1]), tools, False)
                if not text.startswith(done):  # a template that rewrites earlier turns: render in full
                    return None
                ids = self._encode(text[len(done):])
                ext += ids
                indices += [i] * len(ids)
                done = text
            full = self._text(before + list(new_messages), tools, True)
            if not full.startswith(done):
                return None
            tail = self._encode(full[len(done):])
            ext += tail
            indices += [-1] * len(tail)
            previous = list(previous_prompt_ids) + list(previous_completion_ids)
            return RenderedTokens(token_ids=previous + ext, message_indices=[-1] * len(previous) + indices,
                                  sampled_mask=[False] * (len(previous) + len(ext)),
                                  message_roles=[m.get("role") or "" for m in new_messages],
                                  message_tool_names=extract_message_tool_names(new_messages))

    return ChatTemplateRenderer


def __getattr__(name: str) -> Any:
    # `renderers` finds the renderer by import path; the class is made on first access, so that importing this module
    # needs neither verifiers nor renderers.
    if name == "ChatTemplateRenderer":
        cls = _chat_template_renderer()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def prepare_harness() -> str:
    """Prepares the program of verifiers' chat harness (`null`) in the subprocess runtime once: uv installs its
    dependencies from PyPI into verifiers' cache. Episodes do this at first use; CI and offline compute nodes do it
    ahead (`python -m rlhpc.env.verifiers_env --prepare`, on a node that reaches PyPI, with the cache on shared disk)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    async def prepare() -> str:
        runtime = SubprocessRuntime(SubprocessConfig())
        await runtime.start()
        try:
            return " ".join(await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE, {}, activate=False))
        finally:
            await runtime.teardown()

    return asyncio.run(prepare())


if __name__ == "__main__":
    if sys.argv[1:] != ["--prepare"]:
        sys.exit("usage: python -m rlhpc.env.verifiers_env --prepare")
    print(f"verifiers chat harness program ready: {prepare_harness()}")
