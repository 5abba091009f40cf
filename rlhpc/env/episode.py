"""Episodes from tasks: a batch of episodes advanced together, turn by turn, token-exact.

Each turn is one batched engine call over every episode still running (finished ones drop out). The first turn
samples `n` completions of each task's prompt (a group); later turns continue each episode from its own tokens.
Between turns the environment answers in the pool of processes (rlhpc.env.pool), all episodes' replies and tool calls
at once; rewards of finished episodes are scored there while the others keep generating.

Token-exact: an episode's token ids only ever grow. The policy's sampled tokens are appended as sampled (never decoded
and re-encoded) with their sampling logprobs and loss mask 1; the environment's reply is rendered by the chat
template as the text that follows the conversation so far, tokenized on its own and appended with loss mask 0.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from rlhpc.env.base import Environment, Message, Task

log = logging.getLogger(__name__)

_SENTINEL = "\x00rlhpc-turn-end\x00"


class EnvironmentFailure(RuntimeError):
    """Too many samples of a batch failed in the environment: the run stops, naming the environment and an error."""


@dataclass
class Episode:
    task: Task
    ids: List[int]
    prompt_len: int
    messages: List[Message]
    logprobs: List[float] = field(default_factory=list)  # per token after the prompt (0 for environment tokens)
    mask: List[bool] = field(default_factory=list)  # per token after the prompt: True where the policy sampled it
    state: Optional[Dict[str, Any]] = None
    completions: List[str] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    reward: float = 0.0
    error: Optional[str] = None
    timed_out: bool = False
    budget_spent: bool = False  # env.max_episode_tokens reached
    counts: Dict[str, float] = field(default_factory=dict)
    min_version: Optional[int] = None
    max_version: Optional[int] = None
    # MoE models with recorded routing: the experts of each token the engine has run through the model so far, as
    # it first ran it (later turns' prefills run the earlier tokens again; the first run is the one the earlier
    # turns' logprobs came from), in pieces of [tokens, layers, k], one per turn. None when a turn came without.
    routing: Optional[List[Any]] = None

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)


class Renderer:
    """Token ids of prompts and of the environment's replies, through the tokenizer's chat template."""

    def __init__(self, tokenizer, tools: Sequence[Dict[str, Any]] = ()):
        self.tok = tokenizer
        self.tools = list(tools) or None
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        self._warned = False

    def _render(self, messages: List[Message], generation: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False, **kwargs)

    def prompt(self, messages: List[Message]) -> List[int]:
        text = self._render(messages, True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def reply(self, history: List[Message], stopped: bool, new: List[Message]) -> List[int]:
        """Tokens that follow the policy's last turn: the end of that turn as the template writes it (less the stop
        token the policy already sampled), then `new` messages and the next generation prompt."""
        before = history[:-1] + [{"role": "assistant", "content": _SENTINEL}]
        prev = self._render(before, False)
        close = prev[prev.rindex(_SENTINEL) + len(_SENTINEL):]
        if stopped and self.eos_text and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]
        text = self._render(before + new, True)
        if text.startswith(prev):
            suffix = text[len(prev):]
        else:  # a template that rewrites earlier turns (e.g. drops past reasoning): render the new messages alone
            if not self._warned:
                log.warning("the chat template rewrites earlier turns; environment replies are rendered on their own")
                self._warned = True
            suffix = self._render(new, True)
        return self.tok(close + suffix, add_special_tokens=False)["input_ids"]


def _overrides(env: Environment, method: str) -> bool:
    return getattr(type(env), method) is not getattr(Environment, method)


def run_episodes(engine, env: Environment, pool, tokenizer, tasks: Sequence[Task], n: int, temperature: float,
                 max_new_tokens: int, max_turns: int, max_tokens: int = 0, version: int = 0, greedy: bool = False,
                 error_reward: float = 0.0, timeout_s: float = 600.0,
                 ignore_eos: bool = False) -> List[List[Episode]]:
    """Runs `n` episodes of each task to the end and scores them; returns them grouped by task. With `ignore_eos`
    (config `env.ignore_eos`) a turn ends at max_new_tokens only."""
    renderer = Renderer(tokenizer, [t.schema() for t in env.tools()])
    stop = [] if ignore_eos else [tokenizer.eos_token_id]
    prompts = [renderer.prompt(env.messages(t)) for t in tasks]
    groups = [[Episode(t, list(p), len(p), list(env.messages(t))) for _ in range(n)] for t, p in zip(tasks, prompts)]
    episodes = [e for g in groups for e in g]
    if _overrides(env, "start"):
        for e, fut in [(e, pool.submit("start", e.task)) for e in episodes]:
            _settle(e, fut, timeout_s, lambda e, s: setattr(e, "state", s), error_reward)
    for e in episodes:
        e.state = e.state if e.state is not None else {}
    scores: List[tuple] = []

    def end(e: Episode) -> None:
        e.done = True
        if e.error is None:
            scores.append((e, pool.submit("score", e.task, e.state, e.completions)))

    active = [e for e in episodes if not e.done]
    first = True
    while active:
        if first:  # the group: n samples of each task's prompt in one call
            outs = [c for group in engine.generate(prompts, n, temperature, max_new_tokens, stop, greedy=greedy)
                    for c in (group * n if greedy and len(group) == 1 else group)]
            turn = [(e, c) for e, c in zip(episodes, outs) if not e.done]
            first = False
        else:
            outs = engine.generate([e.ids for e in active], 1, temperature, max_new_tokens, stop, greedy=greedy)
            turn = [(e, g[0]) for e, g in zip(active, outs)]
        replies = []
        for e, c in turn:
            _append_turn(e, c, max_tokens, version)
            text = tokenizer.decode(c.tokens, skip_special_tokens=True)
            e.completions.append(text)
            e.messages.append({"role": "assistant", "content": text})
            if e.turns >= max_turns or e.budget_spent:
                end(e)
            else:
                replies.append((e, c.finish_reason == "stop", pool.submit("respond", e.task, e.state, text)))
        for e, stopped, fut in replies:
            reply = _settle(e, fut, timeout_s, None, error_reward)
            if reply is None:  # the reply failed: the episode ends with the error reward
                e.done = True
                continue
            e.state, reply = reply
            for k, v in reply.counts.items():
                e.counts[k] = e.counts.get(k, 0) + v
            if reply.done:
                end(e)
                continue
            extra = renderer.reply(e.messages, stopped, reply.messages)
            if max_tokens and len(e.ids) + len(extra) >= max_tokens:
                e.truncated = e.budget_spent = True
                end(e)
                continue
            e.ids += extra
            e.logprobs += [0.0] * len(extra)
            e.mask += [False] * len(extra)
            e.messages += reply.messages
        active = [e for e in active if not e.done]
    for e, fut in scores:
        _settle(e, fut, timeout_s, _set_reward, error_reward)
    if _overrides(env, "finish"):
        finishing = [pool.submit("finish", e.task, e.state) for e in episodes]
        wait_futures(finishing, timeout=timeout_s)
    return groups


def _append_turn(e: Episode, c, max_tokens: int, version: int) -> None:
    tokens, logprobs = list(c.tokens), list(c.logprobs)
    # A turn cut by max_new_tokens leaves the episode going (the environment answers what it got); the episode's
    # token budget ends it.
    e.truncated = c.finish_reason == "length"
    if max_tokens and len(e.ids) + len(tokens) >= max_tokens:
        keep = max(max_tokens - len(e.ids), 0)
        tokens, logprobs = tokens[:keep], logprobs[:keep]
        e.truncated = e.budget_spent = True
    routing = getattr(c, "routing", None)
    if routing is None:
        e.routing = None
    elif e.turns == 0:
        e.routing = [routing]
    elif e.routing is not None:  # the turn's prompt repeats the episode so far: only its new tokens' experts
        e.routing.append(routing[sum(len(r) for r in e.routing):])
    e.ids += tokens
    e.logprobs += logprobs
    e.mask += [True] * len(tokens)
    e.turns += 1
    lo = getattr(c, "min_version", None)
    hi = getattr(c, "max_version", None)
    lo = version if lo is None else lo
    hi = version if hi is None else hi
    e.min_version = lo if e.min_version is None else min(e.min_version, lo)
    e.max_version = hi if e.max_version is None else max(e.max_version, hi)


def _set_reward(e: Episode, value: Any) -> None:
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward is {reward}")
    e.reward = reward


def _settle(e: Episode, fut: Future, timeout_s: float, apply, error_reward: float) -> Any:
    """The result of an environment call for episode `e`; a failure becomes the episode's error (reward
    `error_reward`), logged with the task id and counted, and None is returned."""
    from rlhpc.env.pool import CallTimeout

    try:
        value = fut.result(timeout=timeout_s)
        if apply is not None:
            apply(e, value)
        return value
    except Exception as err:  # noqa: BLE001 - an environment's failure costs its sample, never the run
        e.timed_out = isinstance(err, (CallTimeout, TimeoutError))
        e.error = f"{type(err).__name__}: {err}".strip()
        e.reward = error_reward
        e.done = True
        log.warning("environment call failed for task %s: %s", e.task.id, e.error.splitlines()[0][:300])
        return None


def failures(episodes: Sequence[Episode]) -> Dict[str, float]:
    """env/errors and env/timeouts of a batch, plus the summed counters its replies reported."""
    out: Dict[str, float] = {"env/errors": sum(e.error is not None for e in episodes),
                             "env/timeouts": sum(e.timed_out for e in episodes)}
    for e in episodes:
        for k, v in e.counts.items():
            out[f"env/{k}"] = out.get(f"env/{k}", 0) + v
    return out


def check_failures(env: Environment, episodes: Sequence[Episode], max_fraction: float) -> None:
    failed = [e for e in episodes if e.error is not None]
    if episodes and len(failed) > max_fraction * len(episodes):
        first = failed[0]
        # The one-line report names the error; its traceback (from a pool process) goes to the role's log.
        log.error("first failed sample (task %s): %s", first.task.id, first.error)
        headline = (first.error.strip().splitlines() or [""])[0]
        raise EnvironmentFailure(
            f"environment {env.name!r}: {len(failed)} of {len(episodes)} samples failed, more than "
            f"env.max_error_fraction={max_fraction:g}; first error (task {first.task.id}): {headline}")
