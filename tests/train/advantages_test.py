"""Tests for jaxrl.train.advantages.

Shape suffixes: b = rollouts (flat, groups contiguous), g = groups, k = per-group index.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.train import advantages


def test_grpo_hand_computed_group_size_2():
  # Groups [1, 0] and [0, 1]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5).
  adv = advantages.group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 2, eps=0.0)
  a = 0.5 / np.sqrt(0.5)  # 0.7071
  np.testing.assert_allclose(adv, [a, -a, -a, a], rtol=1e-6)


def test_grpo_hand_computed_group_size_4():
  # One group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3).
  adv = advantages.group_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
  a = 0.5 / np.sqrt(1.0 / 3.0)  # 0.8660
  np.testing.assert_allclose(adv, [a, -a, -a, a], rtol=1e-6)


def test_grpo_eps_is_added_to_std():
  # Group [3, 1]: mean 2, unbiased std sqrt(1 + 1) = sqrt(2); eps = 0.5 lands in the denominator.
  adv = advantages.group_advantages(jnp.array([3.0, 1.0]), 2, eps=0.5)
  np.testing.assert_allclose(adv, [1 / (np.sqrt(2) + 0.5), -1 / (np.sqrt(2) + 0.5)], rtol=1e-6)


def test_drgrpo_hand_computed():
  # Only the group mean is subtracted: [1, 0 | 0, 1] -> means 0.5, 0.5; [1, 0, 0, 1] -> mean 0.5;
  # [2, 0, 1, 5] with k=4 -> mean 2.
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0])
  np.testing.assert_allclose(
    advantages.group_advantages(rewards, 2, mode="drgrpo"), [0.5, -0.5, -0.5, 0.5]
  )
  np.testing.assert_allclose(
    advantages.group_advantages(rewards, 4, mode="drgrpo"), [0.5, -0.5, -0.5, 0.5]
  )
  np.testing.assert_allclose(
    advantages.group_advantages(jnp.array([2.0, 0.0, 1.0, 5.0]), 4, mode="drgrpo"),
    [0.0, -2.0, -1.0, 3.0],
  )


@pytest.mark.parametrize("mode", advantages.ADVANTAGE_MODES)
def test_random_rewards_match_numpy_per_group(mode):
  rewards_gk = np.asarray(jax.random.normal(jax.random.key(0), (5, 6)) * 3.0 + 1.0)
  adv_b = advantages.group_advantages(jnp.asarray(rewards_gk.reshape(-1)), 6, mode=mode)
  expected_gk = rewards_gk - rewards_gk.mean(axis=1, keepdims=True)
  if mode == "grpo":
    expected_gk /= rewards_gk.std(axis=1, ddof=1, keepdims=True) + 1e-6
    # Each normalised group has unit unbiased std.
    np.testing.assert_allclose(np.asarray(adv_b).reshape(5, 6).std(axis=1, ddof=1), 1.0, atol=1e-5)
  assert adv_b.shape == (30,) and adv_b.dtype == jnp.float32
  np.testing.assert_allclose(adv_b, expected_gk.reshape(-1), rtol=1e-5, atol=1e-6)
  # Advantages of a group sum to zero, so groups never leak into each other.
  np.testing.assert_allclose(np.asarray(adv_b).reshape(5, 6).sum(axis=1), 0.0, atol=1e-5)


def test_integer_rewards_give_float32_host_arrays():
  adv = advantages.group_advantages(jnp.array([1, 0, 0, 0], jnp.int32), group_size=4)
  assert isinstance(adv, np.ndarray) and adv.dtype == np.float32  # never on a device
  # Mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5.
  np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5], rtol=1e-5)


def test_zero_variance_group_gets_zero_advantage():
  rewards = jnp.array([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
  adv = advantages.group_advantages(rewards, 2)
  assert np.all(np.isfinite(adv))
  np.testing.assert_array_equal(np.asarray(adv)[[0, 1, 4, 5]], 0.0)
  np.testing.assert_array_equal(advantages.zero_variance_groups(rewards, 2), [True, False, True])


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
@pytest.mark.parametrize("reward,size", [(0.9, 12), (0.7, 7), (0.6, 6), (0.3, 64), (0.2, 64)])
def test_equal_rewards_that_do_not_average_exactly_get_zero_advantage(mode, reward, size):
  """A partial or format reward shared by the whole group (0.9 * 12 / 12 is not 0.9 in float32)
  must not leave a residue that the std division turns into a push on every response."""
  other = [1.0, 0.0] * (size // 2) + [0.5] * (size % 2)
  rewards = np.array([reward] * size + other, np.float32)
  adv = advantages.group_advantages(rewards, size, mode=mode)
  np.testing.assert_array_equal(adv[:size], 0.0)
  assert np.abs(adv[size:]).max() > 0.1


def test_zero_variance_groups_random():
  rewards_gk = jax.random.bernoulli(jax.random.key(1), 0.5, (64, 3)).astype(jnp.float32)
  expected_g = np.asarray(rewards_gk).min(axis=1) == np.asarray(rewards_gk).max(axis=1)
  assert 0 < expected_g.sum() < 64  # both kinds present with this seed
  np.testing.assert_array_equal(
    advantages.zero_variance_groups(rewards_gk.reshape(-1), 3), expected_g
  )


def test_errors():
  rewards = jnp.arange(6.0)
  with pytest.raises(ValueError, match="group_size must be >= 2"):
    advantages.group_advantages(rewards, 1)
  with pytest.raises(ValueError, match="not divisible by group_size=4"):
    advantages.group_advantages(rewards, 4)
  with pytest.raises(ValueError, match=r"Unknown advantage mode 'ppo'.*'grpo', 'drgrpo'"):
    advantages.group_advantages(rewards, 2, mode="ppo")
  with pytest.raises(ValueError, match="must be 1-D"):
    advantages.group_advantages(rewards.reshape(3, 2), 2)
  with pytest.raises(ValueError, match="not divisible"):
    advantages.zero_variance_groups(rewards, 4)
