"""rlhpc's default harness for verifiers environments: verifiers' chat loop (the `null` harness's), run in the
worker's own event loop instead of as one program per episode.

verifiers' `null` harness starts a Python program for every episode (`uv run` of its bundled chat script, which imports
openai, mcp and httpx): on the 2-core CI machine that is ~1 s of CPU per episode, 100x what generating a 16-token
answer for it costs. verifiers' Harness contract allows the loop in-process ("the interception is the contract, not
the process": every model call goes through the interception endpoint and secret, and the trace records what ran), so
nothing else changes: the same interception server, TrainClient, renderer, tools (the task's MCP servers), gate,
rewards and traces. Choose verifiers' own program with `env.args.harness={id: null}`.

verifiers imports a harness by its id as a top-level module; rlhpc.env.verifiers_env registers this module as
`rlhpc_chat` before verifiers resolves an environment's harness.
"""

from __future__ import annotations

import functools
import json
import ssl
import traceback
from contextlib import AsyncExitStack
from typing import Any, Dict, List

import httpx
from openai import APIConnectionError, APIStatusError, AsyncOpenAI
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.compaction import bound_tool_message, is_context_overflow
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    # One per process: building one (loading the CA bundle) costs ~80 ms, more than the episode's generation.
    return ssl.create_default_context()


class InProcessChatConfig(HarnessConfig):
    pass


class InProcessChatHarness(Harness[InProcessChatConfig]):
    """The `null` harness's chat loop in-process: chat until a reply without tool calls, running the model's tool
    calls on the task's MCP servers (asking the rollout's tool gate first)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint: str, secret: str, mcp_urls: Dict[str, str], data,
                     tool_interception_url: str | None = None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: List[Dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        timeout = httpx.Timeout(None, connect=5.0)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, timeout=timeout,
                             http_client=httpx.AsyncClient(timeout=timeout, verify=_ssl_context()))
        gate = httpx.AsyncClient(timeout=timeout, verify=_ssl_context()) if tool_interception_url else None
        try:
            async with AsyncExitStack() as stack:
                mcp = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
                tools, dispatch, servers = await connect_mcp({"mcpServers": mcp}, stack) if mcp else ([], {}, {})
                await self._chat(client, gate, ctx.model, messages, tools, dispatch, servers, tool_interception_url,
                                 secret)
        except APIConnectionError:  # as the program: the host reports an interception failure
            return ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", traceback.format_exc())
        except Exception:  # as the program's non-zero exit: verifiers records a HarnessError (or an expected @stop)
            return ProgramResult(1, "", traceback.format_exc())
        finally:
            await client.close()
            if gate is not None:
                await gate.aclose()
        return ProgramResult(0, "", "")

    @staticmethod
    async def _chat(client, gate, model, messages, tools, dispatch, servers, gate_url, secret) -> None:
        while True:
            try:
                completion = await client.chat.completions.create(model=model, messages=messages,
                                                                  **({"tools": tools} if tools else {}))
            except APIStatusError as error:
                if is_context_overflow(error):  # a budget limit, not a crash: the transcript so far is the episode
                    return
                raise
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return
            for call in message.tool_calls:
                name = call.function.name
                try:
                    args = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError as e:
                    args = None
                    content = f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON"
                if gate is not None:
                    asked = {"tool_call_id": call.id, "name": name,
                             "arguments": args if args is not None else call.function.arguments}
                    response = await gate.post(gate_url, headers={"Authorization": f"Bearer {secret}"}, json=asked)
                    response.raise_for_status()
                    decision = response.json()
                    if decision["action"] == "stop":
                        raise RuntimeError(decision["reason"])
                    if decision["action"] == "deny":
                        messages.append(bound_tool_message(decision["message"]))
                        continue
                if args is None:
                    pass
                elif not isinstance(args, dict):
                    content = (f"error: tool arguments must be a JSON object, got {type(args).__name__}; resend as an "
                               "object")
                elif name in dispatch:
                    content = await call_mcp(servers, dispatch, name, args)
                else:
                    content = f"error: unknown tool {name!r}"
                messages.append(bound_tool_message({"role": "tool", "tool_call_id": call.id, "content": content,
                                                    "name": name}))


__all__ = ["InProcessChatHarness"]
