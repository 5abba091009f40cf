"""Policy losses, off-policy corrections, KL terms and normalization, each checked against an independent reference.

The references below are written differently from rlhpc.algo.loss on purpose: explicit loops over sequences and tokens, one
scalar at a time, with Python's math where no gradient is needed. A second, outside reference is TRL's GRPOTrainer loss
(`_compute_loss`), fed the same padded tensors.
"""

import math
import subprocess
import sys
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from rlhpc.algo import checks, loss
from rlhpc.algo.loss import LossInputs
from rlhpc.config import schema as config_mod
from rlhpc.config.schema import AlgoConfig, ConfigError, to_typed
from rlhpc.config.schema import CONF_DIR

F64 = torch.float64  # the comparisons below are exact to 1e-10

# Three sequences (advantage, [(trainer logprob, trainer - inference log-ratio), ...]). Chosen so that, with clip 0.2:
# tokens are clipped above (log-ratio 0.3 and 0.2 with A > 0) and below (-0.5 with A < 0), and one token with A < 0
# lies above the clip range, where the pessimistic min keeps the unclipped ratio.
SEQS = [
    (1.0, [(-0.7, 0.0), (-1.2, 0.3), (-2.0, -0.4), (-0.3, 0.1)]),
    (-0.5, [(-1.5, -0.5), (-0.9, 0.25)]),
    (0.7, [(-0.2, 0.05), (-2.5, -0.1), (-1.1, 0.2), (-0.6, -0.02), (-1.8, 0.0)]),
]
MAX_TOKENS = 8  # the generation limit of Dr. GRPO's constant normalization
LOSSES = ["grpo", "gspo", "cispo", "aipo"]
# Clip settings the hand-built ratios cross, so that every loss has clipped and unclipped tokens (or sequences).
CLIPS = {
    "grpo": dict(clip_low=0.2, clip_high=0.2),
    "gspo": dict(clip_low=0.05, clip_high=0.05),  # sequence ratios e^0, e^-0.125 (A < 0: clipped), e^0.026
    "cispo": dict(clip_low=0.3, clip_high=0.2),
    "aipo": dict(aipo_delta=1.25),
}
CORRECTIONS = [("token", "truncate"), ("token", "mask"), ("sequence", "truncate"), ("sequence", "mask")]


def algo(**kw) -> AlgoConfig:
    return AlgoConfig(**kw)


def flat_inputs(seqs=SEQS, reference=None):
    """The trainer's view: flat loss tokens; the leaf `logprobs` gets the gradient."""
    lp = torch.tensor([t[0] for _, toks in seqs for t in toks], dtype=F64, requires_grad=True)
    inf = torch.tensor([t[0] - t[1] for _, toks in seqs for t in toks], dtype=F64)
    adv = torch.tensor([a for a, toks in seqs for _ in toks], dtype=F64)
    idx = torch.tensor([i for i, (_, toks) in enumerate(seqs) for _ in toks])
    ref = None if reference is None else torch.tensor([r for rs in reference for r in rs], dtype=F64)
    return LossInputs(lp, inf, adv, idx, len(seqs), reference_logprobs=ref), lp


def step_of(x: LossInputs, cfg: AlgoConfig, normalize: str):
    out = loss.get(cfg.name)(x, cfg)
    n_tokens = x.sample_index.numel()
    weights = loss.token_weights(x, normalize, float(n_tokens), float(x.num_samples), MAX_TOKENS)
    return out, (out.token_loss * weights).sum()


# ---- the independent reference ---------------------------------------------------------------------------------------


def ref_token(name, cfg, adv, lp, inf, seq_ratio):
    """(value, differentiable surrogate) of one token's loss; `lp` is a 0-d leaf, `inf` a float."""
    if name in ("grpo", "gspo"):
        r = torch.exp(lp - inf) if name == "grpo" else seq_ratio
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        clipped = min(max(r, torch.tensor(lo, dtype=F64)), torch.tensor(hi, dtype=F64))  # clipped: a constant
        t = -min(r * adv, clipped * adv)
        return t.item(), t
    r = math.exp(lp.item() - inf)
    w = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) if name == "cispo" else min(r, cfg.aipo_delta)
    return -w * adv, -w * adv * lp  # value -w A; gradient -w A grad(log pi)


def ref_correction(cfg, lps, infs, t):
    if cfg.is_level == "token":
        r = math.exp(lps[t].item() - infs[t])
    else:
        r = math.prod(math.exp(lp.item() - inf) for lp, inf in zip(lps, infs))
    if cfg.is_mode == "truncate":
        return min(max(r, cfg.is_low), cfg.is_high)
    return r if cfg.is_low <= r <= cfg.is_high else 0.0


def ref_norm_weight(normalize, seqs, i):
    n_tokens = sum(len(toks) for _, toks in seqs)
    if normalize == "token":
        return 1 / n_tokens
    if normalize == "sequence":
        return 1 / (len(seqs[i][1]) * len(seqs))
    return 1 / (len(seqs) * MAX_TOKENS)


def reference(name, cfg, normalize, seqs=SEQS, reference_lps=None):
    """Per-token loss values, the normalized step value and its gradient, by explicit loops."""
    values, step, surrogate, leaves = [], 0.0, 0.0, []
    for i, (adv, toks) in enumerate(seqs):
        lps = [torch.tensor(t[0], dtype=F64, requires_grad=True) for t in toks]
        leaves += lps
        infs = [t[0] - t[1] for t in toks]
        # With a correction on, the loss's own ratio is taken against the current (stop-gradient) policy.
        loss_infs = infs if cfg.is_level == "none" else [lp.item() for lp in lps]
        seq_ratio = torch.exp(sum(lp - inf for lp, inf in zip(lps, loss_infs)) / len(lps))
        for t, (lp, inf) in enumerate(zip(lps, infs)):
            value, term = ref_token(name, cfg, adv, lp, loss_infs[t], seq_ratio)
            if cfg.is_level != "none":
                w = ref_correction(cfg, lps, infs, t)
                value, term = value * w, term * w
            if reference_lps is not None and cfg.ref_kl_coef:
                d = reference_lps[i][t] - lp
                k3 = torch.exp(d) - d - 1
                value, term = value + cfg.ref_kl_coef * k3.item(), term + cfg.ref_kl_coef * k3
            if cfg.inference_kl_coef:
                k2 = 0.5 * (lp - inf) ** 2
                value, term = value + cfg.inference_kl_coef * k2.item(), term + cfg.inference_kl_coef * k2
            values.append(value)
            step += value * ref_norm_weight(normalize, seqs, i)
            surrogate = surrogate + term * ref_norm_weight(normalize, seqs, i)
    surrogate.backward()
    grads = [torch.zeros((), dtype=F64) if lp.grad is None else lp.grad for lp in leaves]  # None: clipped away
    return torch.tensor(values, dtype=F64), step, torch.stack(grads)


def assert_matches_reference(name, cfg, normalize, reference_lps=None):
    x, lp = flat_inputs(reference=reference_lps)
    out, step = step_of(x, cfg, normalize)
    step.backward()
    ref_values, ref_step, ref_grad = reference(name, cfg, normalize, reference_lps=reference_lps)
    torch.testing.assert_close(out.token_loss.detach(), ref_values, rtol=1e-10, atol=1e-12)
    assert step.item() == pytest.approx(ref_step, rel=1e-10)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-10, atol=1e-12)
    return out


# ---- each loss -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", ["token", "sequence", "constant"])
@pytest.mark.parametrize("name", LOSSES)
def test_each_loss_matches_the_per_sequence_reference_in_values_and_gradients(name, normalize):
    assert_matches_reference(name, algo(name=name, **CLIPS[name]), normalize)


def test_dapo_clip_higher_leaves_more_room_above_the_ratio_one():
    x, _ = flat_inputs()
    m = loss.get("dapo")(x, algo(name="dapo", clip_low=0.2, clip_high=0.28)).metrics
    assert m["clip_high_frac"] == pytest.approx(1 / 11)  # only log-ratio 0.3 is above 1.28; GRPO's 0.2 clips two
    assert m["clip_low_frac"] == pytest.approx(1 / 11)


@pytest.mark.parametrize("name", LOSSES)
def test_on_policy_every_loss_is_reinforce(name):
    """With pi = mu no clip or weight is active: each token loss is -A, its gradient -A (a REINFORCE step)."""
    seqs = [(a, [(lp, 0.0) for lp, _ in toks]) for a, toks in SEQS]
    x, lp = flat_inputs(seqs)
    out = loss.get(name)(x, algo(name=name))
    out.token_loss.sum().backward()
    torch.testing.assert_close(out.token_loss.detach(), -x.advantages)
    torch.testing.assert_close(lp.grad, -x.advantages)


def test_gspo_gives_every_token_of_a_sequence_its_sequence_ratio():
    x, _ = flat_inputs()
    out = loss.get("gspo")(x, algo(name="gspo", clip_low=1.0, clip_high=10.0))  # no clipping: loss = -s_i A_i
    for i, (adv, toks) in enumerate(SEQS):
        s = math.exp(sum(t[1] for t in toks) / len(toks))
        assert out.token_loss[x.sample_index == i].tolist() == pytest.approx([-s * adv] * len(toks))


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    x, lp = flat_inputs()
    loss.get("cispo")(x, algo(name="cispo", clip_low=0.2, clip_high=0.2)).token_loss.sum().backward()
    clipped = torch.exp(x.logprobs - x.inference_logprobs).detach() > 1.2
    assert clipped.any() and (lp.grad[clipped] != 0).all()
    torch.testing.assert_close(lp.grad[clipped], -1.2 * x.advantages[clipped])


# ---- metrics ---------------------------------------------------------------------------------------------------------


def test_grpo_reports_the_fractions_of_tokens_clipped_below_and_above():
    x, _ = flat_inputs()
    m = loss.get("grpo")(x, algo()).metrics
    assert m["clip_low_frac"] == pytest.approx(1 / 11)  # log-ratio -0.5 with A < 0
    assert m["clip_high_frac"] == pytest.approx(2 / 11)  # log-ratios 0.3 and 0.2 with A > 0


def test_every_loss_reports_importance_ratio_statistics_and_mismatch_kl():
    x, _ = flat_inputs()
    ratios = [math.exp(t[1]) for _, toks in SEQS for t in toks]
    for name in LOSSES:
        m = loss.get(name)(x, algo(name=name)).metrics
        assert m["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios))
        assert m["ratio_min"] == pytest.approx(min(ratios)) and m["ratio_max"] == pytest.approx(max(ratios))
        assert m["mismatch_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / len(ratios))


def test_a_correction_reports_the_fraction_truncated_or_masked_and_the_mean_weight():
    x, _ = flat_inputs()
    ratios = [math.exp(t[1]) for _, toks in SEQS for t in toks]
    outside = sum(not 0.8 <= r <= 1.25 for r in ratios) / len(ratios)
    assert outside > 0
    trunc = loss.get("grpo")(x, algo(is_level="token", is_mode="truncate", is_low=0.8, is_high=1.25)).metrics
    mask = loss.get("grpo")(x, algo(is_level="token", is_mode="mask", is_low=0.8, is_high=1.25)).metrics
    assert trunc["is_truncated_frac"] == pytest.approx(outside) and trunc["is_masked_frac"] == 0
    assert mask["is_masked_frac"] == pytest.approx(outside) and mask["is_truncated_frac"] == 0
    kept = [r for r in ratios if 0.8 <= r <= 1.25]
    assert mask["is_weight_mean"] == pytest.approx(sum(kept) / len(ratios))
    assert trunc["is_weight_mean"] == pytest.approx(sum(min(max(r, 0.8), 1.25) for r in ratios) / len(ratios))


def test_metrics_stay_finite_on_a_micro_batch_without_loss_tokens():
    empty = torch.zeros(0, requires_grad=True)
    x = LossInputs(empty, torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long), 0)
    out = loss.get("grpo")(x, algo(is_level="sequence"))
    assert out.token_loss.numel() == 0
    assert all(math.isfinite(float(v)) for v in out.metrics.values())


# ---- off-policy corrections ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("level,mode", CORRECTIONS)
@pytest.mark.parametrize("name", LOSSES)
def test_each_correction_composes_with_each_loss_as_in_the_reference(name, level, mode):
    bounds = dict(is_low=0.8, is_high=1.25) if level == "token" else dict(is_low=0.5, is_high=1.5)
    cfg = algo(name=name, is_level=level, is_mode=mode, **bounds, **CLIPS[name])
    assert_matches_reference(name, cfg, "token")


def test_sequence_weights_of_long_sequences_stay_finite():
    seqs = [(1.0, [(-1.0, 0.5)] * 2000), (1.0, [(-1.0, -0.5)] * 2000)]  # sequence ratios e^1000 and e^-1000
    x, _ = flat_inputs(seqs)
    trunc, _ = loss.importance_weights(x, algo(is_level="sequence", is_mode="truncate", is_low=0.5, is_high=2.0))
    mask, _ = loss.importance_weights(x, algo(is_level="sequence", is_mode="mask", is_low=0.5, is_high=2.0))
    assert trunc[:2000].eq(2.0).all() and trunc[2000:].eq(0.5).all()
    assert mask.eq(0.0).all()


def test_a_correction_weight_carries_no_gradient():
    x, lp = flat_inputs()
    w, _ = loss.importance_weights(x, algo(is_level="token"))
    assert not w.requires_grad


# ---- KL terms --------------------------------------------------------------------------------------------------------


def test_kl_terms_match_the_reference_in_values_and_gradients():
    ref = [[-0.9, -1.0, -1.7, -0.35], [-1.2, -1.1], [-0.25, -2.0, -1.3, -0.5, -1.6]]
    cfg = algo(ref_kl_coef=0.3, inference_kl_coef=0.7)
    out = assert_matches_reference("grpo", cfg, "sequence", reference_lps=ref)
    flat_ref = [r for rs in ref for r in rs]
    lps = [t[0] for _, toks in SEQS for t in toks]
    k3 = [math.exp(r - lp) - (r - lp) - 1 for r, lp in zip(flat_ref, lps)]
    assert out.metrics["ref_kl"] == pytest.approx(sum(k3) / len(k3))
    assert out.metrics["inference_kl_k2"] == pytest.approx(sum(0.5 * t[1] ** 2 for _, ts in SEQS for t in ts) / 11)


def test_reference_kl_without_reference_logprobs_names_the_key():
    x, _ = flat_inputs()
    with pytest.raises(ValueError, match="algo.ref_kl_coef"):
        loss.get("grpo")(x, algo(ref_kl_coef=0.1))


# ---- normalization ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", ["token", "sequence", "constant"])
def test_a_step_split_into_micro_batches_sums_to_the_normalized_objective(normalize):
    """Weights from the step totals make the sum over micro-batches independent of the split."""
    total_tokens, total_samples = 11.0, 3.0
    per_token = {0: [1.0, 2.0, 3.0, 4.0], 1: [5.0, 6.0], 2: [7.0, 8.0, 9.0, 10.0, 11.0]}
    step = 0.0
    for micro_batch in ([0], [1, 2]):
        toks = [(j, v) for j, i in enumerate(micro_batch) for v in per_token[i]]
        idx = torch.tensor([j for j, _ in toks])
        x = LossInputs(torch.zeros(len(toks)), torch.zeros(len(toks)), torch.zeros(len(toks)), idx, len(micro_batch))
        w = loss.token_weights(x, normalize, total_tokens, total_samples, MAX_TOKENS)
        step += float((w * torch.tensor([v for _, v in toks])).sum())
    expected = {
        "token": sum(sum(v) for v in per_token.values()) / total_tokens,
        "sequence": sum(sum(v) / len(v) for v in per_token.values()) / total_samples,
        "constant": sum(sum(v) for v in per_token.values()) / (total_samples * MAX_TOKENS),
    }[normalize]
    assert step == pytest.approx(expected)


def test_an_unknown_normalization_names_the_key():
    x, _ = flat_inputs()
    with pytest.raises(ValueError, match="algo.normalize"):
        loss.token_weights(x, "tokens", 11.0, 3.0, MAX_TOKENS)


# ---- names, configs, user losses -------------------------------------------------------------------------------------


def test_every_algo_config_composes_and_names_a_loss_that_runs(tmp_path):
    config_mod.register()
    yamls = sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml"))
    assert {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "aipo", "grpo_kl"} <= set(yamls)
    x, _ = flat_inputs(reference=[[-1.0] * len(toks) for _, toks in SEQS])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for name in yamls:
            cfg = to_typed(compose(config_name="config", overrides=[f"algo={name}", f"run_dir={tmp_path}"])).algo
            out = loss.get(cfg.name)(x, cfg)
            assert torch.isfinite(out.token_loss).all(), name


@pytest.fixture
def user_losses(tmp_path, monkeypatch):
    """A module of the user's, importable as `user_losses`."""
    (tmp_path / "user_losses.py").write_text(textwrap.dedent("""
        from rlhpc.algo.loss import LossOutputs

        def reinforce(x, cfg):
            return LossOutputs(-x.advantages * x.logprobs, {"mine": x.logprobs.detach().mean()})
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_losses"
    sys.modules.pop("user_losses", None)


def test_a_loss_named_by_import_path_is_used(user_losses):
    x, _ = flat_inputs()
    out = loss.get(f"{user_losses}:reinforce")(x, algo(name=f"{user_losses}:reinforce"))
    torch.testing.assert_close(out.token_loss, -x.advantages * x.logprobs)
    assert out.metrics["mine"] == pytest.approx(float(x.logprobs.detach().mean()))


def test_a_correction_applies_to_a_loss_named_by_import_path(user_losses):
    x, _ = flat_inputs()
    cfg = algo(name=f"{user_losses}:reinforce", is_level="token", is_mode="mask", is_low=0.8, is_high=1.25)
    out = loss.get(cfg.name)(x, cfg)
    ratios = torch.exp(x.logprobs - x.inference_logprobs).tolist()
    expected = [-a * lp * (r if 0.8 <= r <= 1.25 else 0.0) for a, lp, r in
                zip(x.advantages.tolist(), x.logprobs.tolist(), ratios)]
    assert out.token_loss.tolist() == pytest.approx(expected)


def test_an_unknown_loss_names_the_key_and_the_known_losses():
    with pytest.raises(ValueError, match=r"algo.name.*aipo, cispo, dapo, dr_grpo, grpo, gspo"):
        loss.get("ppo")


def test_the_launchers_torch_free_list_of_losses_is_the_registered_one():
    assert list(checks.LOSSES) == loss.names()


def test_validating_a_config_imports_no_torch():
    """The launcher checks a config (and refuses a bad key) before it starts anything: torch is not imported for it."""
    code = ("import sys, rlhpc.algo\n"
            "from rlhpc.config.schema import Config, validate\n"
            "from rlhpc.preflight.checks import check_loss\n"
            "cfg = Config(); validate(cfg); check_loss(cfg)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_loss_path_that_does_not_import_names_the_key():
    with pytest.raises(ValueError, match="algo.name.*cannot import"):
        loss.get("no_such_module_xyz:fn")


def test_an_unknown_correction_level_names_the_key():
    x, _ = flat_inputs()
    with pytest.raises(ConfigError, match="algo.is_level"):
        loss.get("grpo")(x, algo(is_level="tokens"))


def test_correction_bounds_that_leave_no_range_name_the_key():
    with pytest.raises(ConfigError, match="algo.is_low"):
        checks.loss_keys(algo(is_level="token", is_low=2.0, is_high=1.5))


# ---- TRL's GRPOTrainer loss on identical inputs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_loss():
    """TRL's GRPOTrainer._compute_loss, called on a stand-in trainer whose model returns our padded logprobs."""
    import importlib

    # vLLM plays no part in the loss and takes seconds to import: tell TRL it is absent.
    importlib.import_module("trl.import_utils").is_vllm_available = lambda *a, **k: False
    GRPOTrainer = importlib.import_module("trl.trainer.grpo_trainer").GRPOTrainer

    def compute(loss_type, level, eps_low, eps_high, sampling_mode=None, is_low=None, is_high=None):
        T = max(len(toks) for _, toks in SEQS)
        lp = torch.zeros(len(SEQS), T, dtype=F64)
        inf = torch.zeros(len(SEQS), T, dtype=F64)
        mask = torch.zeros(len(SEQS), T, dtype=F64)
        for i, (_, toks) in enumerate(SEQS):
            for t, (l, d) in enumerate(toks):
                lp[i, t], inf[i, t], mask[i, t] = l, l - d, 1.0
        lp.requires_grad_(True)
        inputs = {
            "prompt_ids": torch.zeros(len(SEQS), 1, dtype=torch.long),
            "prompt_mask": torch.ones(len(SEQS), 1, dtype=torch.long),
            "completion_ids": torch.zeros(len(SEQS), T, dtype=torch.long),
            "completion_mask": mask,
            "advantages": torch.tensor([a for a, _ in SEQS], dtype=F64),
            "num_items_in_batch": mask.sum(),
        }
        if sampling_mode is None:
            inputs["old_per_token_logps"] = inf  # the ratio is taken against the inference policy, as in rlhpc
        else:  # TRL's vLLM importance-sampling correction (its formula, restated on the padded tensors)
            diff = (lp.detach() - inf) * mask
            log_w = diff.sum(-1, keepdim=True) if sampling_mode.startswith("sequence") else diff
            w = torch.exp(log_w)
            if sampling_mode.endswith("truncate"):
                w = torch.clamp(w, min=is_low, max=is_high)
            else:
                w = w.masked_fill((w < is_low) | (w > is_high), 0.0)
            inputs["importance_sampling_ratio"] = w
        accelerator = SimpleNamespace(num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t,
                                      reduce=lambda t, reduction: t)
        stand_in = SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0,
            loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
            args=SimpleNamespace(delta=None, use_bias_correction_kl=False),
            use_vllm=sampling_mode is not None, vllm_importance_sampling_correction=sampling_mode is not None,
            model=SimpleNamespace(training=False), _entropy_bonus_enabled=False, aux_loss_enabled=False,
            _metrics=defaultdict(lambda: defaultdict(list)), max_completion_length=MAX_TOKENS, accelerator=accelerator,
        )
        value = GRPOTrainer._compute_loss(stand_in, None, inputs)
        value.backward()
        return value.item(), lp.grad[mask.bool()]

    return compute


def ours(name, cfg, normalize):
    x, lp = flat_inputs()
    _, step = step_of(x, cfg, normalize)
    step.backward()
    return step.item(), lp.grad


@pytest.mark.parametrize(
    "name,trl_type,level,normalize,clip_high",
    [
        ("grpo", "grpo", "token", "sequence", 0.2),  # TRL's grpo: mean over sequences of token means
        ("dapo", "dapo", "token", "token", 0.28),  # clip-higher, mean over all tokens of the batch
        ("dr_grpo", "dr_grpo", "token", "constant", 0.2),  # token sum / (sequences * max completion length)
        ("gspo", "grpo", "sequence", "sequence", 0.2),  # TRL's GSPO setting: sequence-level ratio, grpo loss
    ],
)
def test_loss_matches_trl_grpo_trainer_in_value_and_gradient(trl_loss, name, trl_type, level, normalize, clip_high):
    trl_value, trl_grad = trl_loss(trl_type, level, 0.2, clip_high)
    value, grad = ours(name, algo(name=name, clip_low=0.2, clip_high=clip_high), normalize)
    assert value == pytest.approx(trl_value, rel=1e-10)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-10, atol=1e-12)


def test_cispo_gradient_matches_trl_grpo_trainer(trl_loss):
    """TRL's cispo caps the weight at epsilon_high (absolute), i.e. rlhpc's 1 + clip_high with no lower bound; its loss
    value is -w A log(pi), rlhpc's -w A, so only the gradients compare."""
    _, trl_grad = trl_loss("cispo", "token", 0.0, 1.2)
    _, grad = ours("cispo", algo(name="cispo", clip_low=1.0, clip_high=0.2), "token")
    torch.testing.assert_close(grad, trl_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("level,mode", CORRECTIONS)
def test_correction_matches_trl_vllm_importance_sampling_correction(trl_loss, level, mode):
    lo, hi = (0.8, 1.25) if level == "token" else (0.5, 1.5)
    trl_value, trl_grad = trl_loss("dapo", "token", 0.2, 0.28, f"{level}_{mode}", lo, hi)
    cfg = algo(name="dapo", clip_low=0.2, clip_high=0.28, is_level=level, is_mode=mode, is_low=lo, is_high=hi)
    value, grad = ours("dapo", cfg, "token")
    assert value == pytest.approx(trl_value, rel=1e-10)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-10, atol=1e-12)
