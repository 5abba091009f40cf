"""Routing replay (`trainer.router_replay`): the transformers engine records the experts of every token it runs through
a MoE model, they travel in the queue file, and the trainer's forward uses exactly those experts, so its logprobs of
the engine's samples are the engine's even where the routers are nearly tied; the routers still learn. A file without
routing trains as before.

The model is a tiny Qwen3-MoE whose routers are nearly tied on purpose: in each MoE layer three experts have router
rows 1e-7 apart, the others zero, so for about half of the tokens the second expert is picked among three almost
equal logits, and the engine's numerics (left-padded prefill, then one token at a time from its KV cache) and the
trainer's (whole sequences, padded or packed) pick differently for some of them."""

import multiprocessing as mp
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhpc.config.schema import EnvConfig, ModelConfig
from rlhpc.env import load
from rlhpc.env.episode import run_episodes
from rlhpc.env.pool import EnvPool
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.infer.rollout import sample_routing
from rlhpc.modeling import models, routing
from rlhpc.run.rundir import RunDir
from rlhpc.transport.queue import Group, Queue, RolloutBatch
from test_trainer_math import _trainer, first_report, free_port

MOE = ModelConfig(name="tiny_moe", arch="qwen3_moe", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, tokenizer_added_tokens=["<tool_call>", "</tool_call>"],
                  extra=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True))
GROUPS, N, NEW_TOKENS = 3, 4, 16
EXACT = 1e-5  # the engine-vs-trainer bound of the dense models (tests/test_weights.py): per-token logprobs, fp32


def near_tie(model: torch.nn.Module, gap: float = 1e-7) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for gate in routing.moe_gates(model):
            base = torch.randn(gate.weight.shape[1], generator=g) * 0.5
            gate.weight.zero_()
            for e in range(3):
                gate.weight[e] = base + gap * torch.randn(gate.weight.shape[1], generator=g)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A run directory whose model is the near-tied tiny MoE."""
    root = tmp_path_factory.mktemp("replay")
    RunDir(root).make()
    models.build(MOE, root / "model")
    model = models.load_model(root / "model")
    near_tie(model)
    model.save_pretrained(root / "model")
    return root


def batch_of(prompts, completions) -> RolloutBatch:
    """The engine's completions as a queue batch, one group per prompt, routing included when recorded."""
    tokens, logprobs, masks, routings, offsets = [], [], [], [], [0]
    for p, group in zip(prompts, completions):
        for c in group:
            ids = list(p) + c.tokens
            tokens.append(torch.tensor(ids))
            logprobs.append(torch.tensor([0.0] * len(p) + c.logprobs))
            masks.append(torch.tensor([False] * len(p) + [True] * len(c.tokens)))
            if c.routing is not None:
                routings.append(sample_routing([c.routing], len(ids)))
            offsets.append(offsets[-1] + len(ids))
    n = len(completions[0])
    return RolloutBatch(torch.cat(tokens), torch.tensor(offsets), torch.cat(logprobs), torch.cat(masks),
                        torch.randn(len(tokens), generator=torch.Generator().manual_seed(1)),
                        torch.arange(len(prompts)).repeat_interleave(n),
                        [Group(uid=str(i), env="t", task_id=str(i), version=0, num_samples=n, rewards=[0.0] * n,
                               truncated=[False] * n) for i in range(len(prompts))],
                        routing=torch.cat(routings) if routings else None)


@pytest.fixture(scope="module")
def rollouts(root):
    """Sampled completions of the near-tied model by the transformers engine, recording routing; the prompts."""
    engine = HFEngine(models.load_model(root / "model"), 0, record_routing=True)
    prompts = [list(range(5 + 7 * i, 15 + 7 * i)) for i in range(GROUPS)]
    torch.manual_seed(0)
    return prompts, engine.generate(prompts, N, 1.0, NEW_TOKENS, [])


def step_stats(root, batch, **trainer):
    tr = _trainer(root, 0, 1, 0, {"trainer": trainer})
    return tr.train_step(0, batch)


def test_the_engine_records_the_experts_of_every_prompt_and_sampled_token_it_ran(root, rollouts):
    prompts, completions = rollouts
    model = models.load_model(root / "model")
    recorder = routing.Recorder(model)
    for p, group in zip(prompts, completions):
        for c in group:
            # Every token the engine ran through the model: the prompt and the completion but its last token.
            assert c.routing.shape == (len(p) + len(c.tokens) - 1, 2, 2) and c.routing.dtype == torch.uint8
            with recorder.recording() as calls, torch.no_grad():
                model(input_ids=torch.tensor([p + c.tokens]))
            alone = torch.stack([layer[0] for layer in calls], dim=1)[:-1]
            # A forward of the sample alone agrees on the tokens without a near tie (about half), its prompt included.
            same = (alone.sort(-1).values == c.routing.sort(-1).values).all(-1).all(-1)
            assert same[: len(p)].float().mean() >= 0.3 and same.float().mean() >= 0.3
            assert int(c.routing.max()) < 8


@pytest.mark.parametrize("packing", ["padded", "shared_prefix"])
def test_with_replay_the_trainer_gets_the_engines_logprobs_and_without_it_routing_flips_show(root, rollouts,
                                                                                            packing):
    batch = batch_of(*rollouts)
    live = step_stats(root, batch, packing=packing, router_replay=False)
    replayed = step_stats(root, batch, packing=packing, router_replay=True)
    # Without replay some tokens go to other experts than in the engine: their logprobs move by a few percent.
    assert live["loss/mismatch_kl"] > 1e-6  # ~7e-6 here
    assert max(live["loss/ratio_max"] - 1, 1 - live["loss/ratio_min"]) > 1e-2
    # With it, every token's logprob is the engine's within the dense models' bound.
    assert replayed["loss/mismatch_kl"] < 1e-8
    assert max(replayed["loss/ratio_max"] - 1, 1 - replayed["loss/ratio_min"]) < EXACT


def test_the_routers_still_learn_under_replay(root, rollouts):
    batch = batch_of(*rollouts)
    tr = _trainer(root, 0, 1, 0, {"trainer": {"router_replay": True}})
    tr.optimizer.step = lambda *a, **k: None  # keep the step's gradients
    tr.train_step(0, batch)
    gates = routing.moe_gates(tr.model)
    assert gates and all(g.weight.grad is not None and float(g.weight.grad.abs().sum()) > 0 for g in gates)


def test_replayed_experts_route_the_forward_and_their_weights_come_from_the_live_router(root):
    model = models.load_model(root / "model")
    replay, recorder = routing.Replay(model), routing.Recorder(model)
    ids = torch.tensor([[5, 9, 44, 70, 2, 3, 12, 13]])
    with recorder.recording() as calls, torch.no_grad():
        live = model(input_ids=ids).logits
    own = torch.stack([layer[0] for layer in calls], dim=1)
    with replay.forcing(own), torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, live)  # its own routing replayed: the same forward, bit for bit
    other = (own.long() + 3) % 8  # experts 3..7 and 0..1: none of the three near-tied ones picks
    with replay.forcing(other), recorder.recording() as calls:
        moved = model(input_ids=ids).logits
    assert torch.equal(torch.stack([layer[0] for layer in calls], dim=1).long(), other)  # the experts module got them
    assert float((moved.detach() - live).abs().max()) > 1e-3
    moved.sum().backward()
    assert all(float(g.weight.grad.abs().sum()) > 0 for g in replay.gates)


def test_a_file_without_routing_trains_as_before(root, rollouts):
    batch = batch_of(*rollouts)
    plain = RolloutBatch.from_bytes(RolloutBatch(**{**batch.__dict__, "routing": None}).to_bytes("p"))
    assert plain.routing is None
    with_routing = RolloutBatch.from_bytes(batch.to_bytes("p"))
    assert torch.equal(with_routing.routing, batch.routing) and with_routing.routing.dtype == torch.uint8
    # One file of a claim without routing: the claim routes live.
    assert RolloutBatch.concat([with_routing, plain]).routing is None
    before = step_stats(root, plain, router_replay=False)
    after = step_stats(root, plain, router_replay=True)
    assert after["loss/total"] == before["loss/total"] and after["loss/mismatch_kl"] == before["loss/mismatch_kl"]


def test_a_file_whose_routing_does_not_fit_the_model_is_quarantined(tmp_path, rollouts):
    batch = batch_of(*rollouts)
    queue = Queue(tmp_path / "q", routing=(2, 2, 8))
    assert queue._read(queue.publish(batch, "w", 0))[1] is None
    wrong_layers = RolloutBatch(**{**batch.__dict__, "routing": batch.routing[:, :1]})
    too_large = RolloutBatch(**{**batch.__dict__, "routing": batch.routing.clone().fill_(8)})
    for seq, b in enumerate([wrong_layers, too_large], start=1):
        f, reason = queue._read(queue.publish(b, "w", seq))
        assert f is None and "does not fit the model's (2 MoE layers x 2 of 8 experts)" in reason
    with pytest.raises(ValueError, match="routing"):  # not one row per token: no queue file at all
        RolloutBatch.from_bytes(RolloutBatch(**{**batch.__dict__, "routing": batch.routing[1:]}).to_bytes("p"))


def test_glm5s_queue_cost_and_the_tiny_twins(root):
    assert routing.storage_dtype(256) == torch.uint8 and routing.storage_dtype(257) == torch.int16
    from transformers import GlmMoeDsaConfig

    glm5 = GlmMoeDsaConfig()  # transformers' defaults are GLM-5's config: 75 MoE layers, 8 of 256 experts
    layers = glm5.mlp_layer_types.count("sparse")
    assert (layers, glm5.num_experts_per_tok, glm5.n_routed_experts) == (75, 8, 256)
    assert routing.bytes_per_token(layers, glm5.num_experts_per_tok, glm5.n_routed_experts) == 600
    assert routing.bytes_per_token(*routing.shape(models.load_model(root / "model"))) == 4


def episodes_batch(episodes) -> RolloutBatch:
    """Finished episodes as a queue batch, as the inference worker packs them (rlhpc/infer/rollout.py)."""
    n = len(episodes)
    return RolloutBatch(
        torch.cat([torch.tensor(e.ids) for e in episodes]),
        torch.tensor([0] + [len(e.ids) for e in episodes]).cumsum(0),
        torch.cat([torch.tensor([0.0] * e.prompt_len + e.logprobs) for e in episodes]),
        torch.cat([torch.tensor([False] * e.prompt_len + e.mask) for e in episodes]),
        torch.randn(n, generator=torch.Generator().manual_seed(1)), torch.zeros(n, dtype=torch.long),
        [Group(uid="0", env="echo", task_id="0", version=0, num_samples=n, rewards=[0.0] * n, truncated=[False] * n)],
        routing=torch.cat([sample_routing(e.routing, len(e.ids)) for e in episodes]))


def test_multi_turn_episodes_replay_the_experts_of_every_turn_and_of_the_environments_replies(root):
    env = load(EnvConfig(cls="episode_envs:Echo", max_new_tokens=8))
    tok = models.load_tokenizer(root / "model")
    engine = HFEngine(models.load_model(root / "model"), tok.pad_token_id, record_routing=True)
    torch.manual_seed(0)
    with EnvPool(env.config, processes=0, env=env) as pool:
        (episodes,) = run_episodes(engine, env, pool, tok, [next(env.tasks("train", 0))], N, 1.0, 8, 3)
    assert all(e.turns == 3 for e in episodes)
    batch = episodes_batch(episodes)
    assert batch.routing.shape == (batch.tokens.numel(), 2, 2)
    live = step_stats(root, batch, router_replay=False)
    replayed = step_stats(root, batch, router_replay=True)
    # Each token replays its first run's experts (a later turn's prefill runs it again, and for 2-3 of ~70 near-tied
    # tokens picks others: the transformers engine keeps no KV cache across turns), so the residual is those tokens'
    # effect on later turns: mismatch KL ~2e-8 instead of ~2e-5, the worst ratio 1e-3 instead of 4e-2. A token
    # misaligned by one position would route every later token wrongly.
    assert live["loss/mismatch_kl"] > 1e-6 and replayed["loss/mismatch_kl"] < live["loss/mismatch_kl"] / 100
    assert max(replayed["loss/ratio_max"] - 1, 1 - replayed["loss/ratio_min"]) < 1e-2


def _ep_worker(root, rank, world, port, data, out):
    """A step on `world` ranks at ep=world and cp=world with replay: its loss, mismatch and the routers' gradients."""
    try:
        import torch.distributed as dist

        tr = _trainer(Path(root), rank, world, port, {"trainer": {"ep": world, "cp": world, "router_replay": True,
                                                                  "micro_batch_tokens": 64 if world > 1 else 100000}})
        tr.optimizer.step = lambda *a, **k: None  # keep the step's gradients
        stats = tr.train_step(0, RolloutBatch.from_bytes(data))
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).numpy().copy()
                 for n, p in tr.model.named_parameters() if n.endswith("mlp.gate.weight")}
        if rank == 0:
            out.put(("ok", {"loss": stats["loss/total"], "mismatch_kl": stats["loss/mismatch_kl"], "grads": grads}))
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        out.put(("error", traceback.format_exc()))


@pytest.mark.slow  # 10-17 s here: over 10 s (docs/testing.md)
def test_replay_with_experts_and_rows_split_over_two_ranks_has_the_loss_and_router_gradients_of_one_rank(root,
                                                                                                         rollouts):
    """Expert parallelism and context parallelism at once: each rank routes its half of every packed row by that
    half's recorded experts, and the experts it holds receive them by all-to-all."""
    data = batch_of(*rollouts).to_bytes("p")  # the ranks read the queue file's bytes
    one = {}
    _ep_worker(str(root), 0, 1, 0, data, type("Q", (), {"put": lambda self, x: one.setdefault("r", x)})())
    assert one["r"][0] == "ok", one["r"]
    ctx, port = mp.get_context("forkserver"), free_port()
    status, two = first_report(ctx, _ep_worker, lambda r, out: (str(root), r, 2, port, data, out), 2, timeout=120)
    assert status == "ok", two
    one = one["r"][1]
    assert one["mismatch_kl"] < 1e-8 and two["mismatch_kl"] < 1e-8
    assert abs(one["loss"] - two["loss"]) < 1e-5
    for name, g in one["grads"].items():
        assert np.abs(two["grads"][name] - g).max() <= 1e-5 * np.abs(g).max(), name
