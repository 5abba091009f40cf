"""Tensors travel under Hugging Face checkpoint names: the trainer's stream is exactly what save_pretrained writes (MoE
experts in their per-expert names), and an engine that receives it computes what the trainer computes."""

import pytest
import torch
from safetensors.torch import load_file

from rlhpc.config import schema as config_mod
from rlhpc.config.schema import ModelConfig
from rlhpc.infer.engines.hf import HFEngine
from rlhpc.modeling import models
from rlhpc.run.identity import Identity
from rlhpc.run.rundir import RunDir

SIZES = dict(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
ARCHS = {
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
    # GLM-5: MLA attention (as many kv heads as heads) with the DSA indexer, a dense first layer, shared experts.
    "glm_moe_dsa": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                        first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, index_topk=4,
                        index_head_dim=8, index_n_heads=2),
    # block_sparse_moe.experts.{j}.w1/w2/w3 in the checkpoint.
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
}
# More of the two checkpoint families (rlhpc/modeling/names.py), for the names alone.
MORE_ARCHS = {
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
                        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, head_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}
IDS = torch.tensor([[5, 9, 44, 70, 2, 3, 120, 121], [7, 8, 100, 101, 102, 2, 60, 61]])


@pytest.fixture(scope="module", params=list(ARCHS))
def model_dir(request, tmp_path_factory):
    arch = request.param
    return models.build(ModelConfig(arch=arch, extra=ARCHS[arch], **SIZES), tmp_path_factory.mktemp(arch))


def trainer_of(model, root):
    """A one-rank Trainer (no process group) around `model`."""
    from rlhpc.train.trainer import Trainer

    cfg = config_mod.to_typed({"run_dir": str(root)})
    tr = Trainer(cfg, Identity("trainer", 0, 1, root, "t"), RunDir(root).make())
    tr.model = model
    return tr


def perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("arch", [*ARCHS, *MORE_ARCHS])
def test_the_stream_is_exactly_what_save_pretrained_writes(arch, tmp_path):
    extra = {**ARCHS, **MORE_ARCHS}[arch]
    model_dir = models.build(ModelConfig(arch=arch, extra=extra, **SIZES), tmp_path / "model")
    model = models.load_model(model_dir)
    saved = load_file(str(model_dir / "model.safetensors"))
    streamed = {}
    for name, t in trainer_of(model, tmp_path / "run").full_state():
        assert name not in streamed, f"{name} streamed twice"
        streamed[name] = t
    assert sorted(streamed) == sorted(saved)
    for name, t in saved.items():
        assert streamed[name].shape == t.shape, name
        assert torch.equal(streamed[name], t), name  # the same values: the expert slices are the right ones


def test_the_layout_known_before_streaming_is_the_streams(model_dir, tmp_path):
    from rlhpc.modeling.names import checkpoint_layout

    model = models.load_model(model_dir)
    streamed = [(n, tuple(t.shape), t.dtype) for n, t in trainer_of(model, tmp_path).full_state()]
    assert checkpoint_layout(model) == streamed


def test_an_engine_updated_from_the_stream_computes_the_trainers_logits(model_dir, tmp_path):
    from rlhpc.modeling import sparse

    trainer_model = perturbed(models.load_model(model_dir)).eval()
    sparse.install(trainer_model)  # GLM-5: the choice among tied keys the trainer and the engine both make
    engine = HFEngine.from_pretrained(str(model_dir))
    with torch.no_grad():
        want = trainer_model(input_ids=IDS).logits
        before = engine.model(input_ids=IDS).logits
        engine.update_weights(trainer_of(trainer_model, tmp_path).full_state())
        got = engine.model(input_ids=IDS).logits
    assert (before - want).abs().max() > 1e-3  # the update has something to do
    assert torch.equal(got, want)


def test_an_update_naming_a_tensor_the_model_lacks_fails_with_its_name(model_dir):
    engine = HFEngine.from_pretrained(str(model_dir))
    with pytest.raises(KeyError, match=r"model\.layers\.7\.mlp\.experts\.0\.gate_proj\.weight"):
        engine.update_weights([("model.layers.7.mlp.experts.0.gate_proj.weight", torch.zeros(2, 2))])


def test_an_update_of_the_wrong_shape_fails_with_its_name(model_dir):
    engine = HFEngine.from_pretrained(str(model_dir))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape \(3,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_blocks_wrapped_for_activation_checkpointing_stream_under_the_same_names(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model_dir = models.build(ModelConfig(arch="qwen3_moe", extra=ARCHS["qwen3_moe"], **SIZES), tmp_path / "m")
    model = models.load_model(model_dir)
    # Blocks wrapped by torch's checkpoint_wrapper (how apply_fsdp checkpointed before it used transformers' own).
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(block)
    streamed = [name for name, _ in trainer_of(model, tmp_path / "run").full_state()]
    assert sorted(streamed) == sorted(load_file(str(model_dir / "model.safetensors")))
