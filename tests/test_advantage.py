"""Group advantages, reward shaping and DAPO's dynamic sampling, checked against explicit per-completion references."""

import statistics

import pytest
import torch

from rlhpc.algo.advantage import group_advantages, keep_group, shaped_rewards
from rlhpc.config.schema import AlgoConfig, ConfigError

REWARDS = [1.0, 0.0, 0.5, 1.0]
LENGTHS = [10, 32, 20, 5]
MAX_TOKENS = 32


def advantages(**kw):
    return group_advantages(torch.tensor(REWARDS), torch.tensor(LENGTHS), AlgoConfig(**kw), MAX_TOKENS).tolist()


def test_the_group_mean_is_the_baseline():
    mean = sum(REWARDS) / len(REWARDS)
    assert advantages() == pytest.approx([r - mean for r in REWARDS])


def test_std_normalization_divides_by_the_group_reward_std():
    mean, std = statistics.mean(REWARDS), statistics.stdev(REWARDS)
    assert advantages(std_normalize=True) == pytest.approx([(r - mean) / (std + 1e-4) for r in REWARDS])


def test_leave_one_out_baseline_is_the_mean_of_the_other_completions():
    expected = []
    for i, r in enumerate(REWARDS):
        others = [o for j, o in enumerate(REWARDS) if j != i]
        expected.append(r - sum(others) / len(others))
    assert advantages(baseline="loo") == pytest.approx(expected)


def test_length_penalty_subtracts_a_share_of_the_generation_limit_from_the_reward():
    shaped = [r - 0.5 * n / MAX_TOKENS for r, n in zip(REWARDS, LENGTHS)]
    mean = sum(shaped) / len(shaped)
    adv = advantages(length_penalty=0.5)
    assert adv == pytest.approx([s - mean for s in shaped])
    assert adv[3] > adv[0]  # equal rewards: the shorter completion gets the larger advantage


def test_overlong_shaping_matches_dapo_soft_punishment_as_in_trl():
    from trl.rewards import get_soft_overlong_punishment

    max_tokens, lengths = 20, torch.tensor([0, 10, 15, 16, 18, 20, 23])  # buffer: the last 5 tokens, 15 < n <= 20
    trl_penalty = get_soft_overlong_punishment(max_completion_len=max_tokens, soft_punish_cache=5)
    expected = trl_penalty([[1] * int(n) for n in lengths])
    shaped = shaped_rewards(torch.zeros(len(lengths)), lengths, AlgoConfig(overlong_buffer=0.25), max_tokens)
    assert shaped.tolist() == pytest.approx(expected)
    assert min(expected) == -1.0 and max(expected) == 0.0 and any(-1.0 < e < 0.0 for e in expected)


def test_rewards_are_unshaped_by_default():
    shaped = shaped_rewards(torch.tensor(REWARDS), torch.tensor(LENGTHS), AlgoConfig(), MAX_TOKENS)
    assert shaped.tolist() == REWARDS


def test_dynamic_sampling_drops_a_group_whose_rewards_are_all_equal():
    cfg = AlgoConfig(dynamic_sampling=True)
    assert not keep_group(torch.tensor([1.0, 1.0, 1.0]), cfg)
    assert not keep_group(torch.tensor([0.0, 0.0, 0.0]), cfg)
    assert keep_group(torch.tensor([0.0, 1.0, 0.0]), cfg)


def test_without_dynamic_sampling_every_group_is_kept():
    assert keep_group(torch.tensor([1.0, 1.0, 1.0]), AlgoConfig(dynamic_sampling=False))


def test_an_unknown_baseline_names_the_key():
    with pytest.raises(ConfigError, match="algo.baseline"):
        advantages(baseline="median")


def test_an_overlong_buffer_that_is_not_a_fraction_names_the_key():
    with pytest.raises(ConfigError, match="algo.overlong_buffer"):
        advantages(overlong_buffer=20.0)
