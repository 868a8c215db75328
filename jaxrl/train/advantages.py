"""Group-relative advantages for GRPO-style training.

Computed on the host with numpy: a batch's rewards are a few hundred floats, and eager `jnp`
would put them on `jax.devices()[0]`, a rollout device when the stages are disaggregated.

Shape suffixes: b = rollouts (flat, groups contiguous), g = groups (prompts), k = per-group index.
"""

import numpy as np
from numpy.typing import ArrayLike

ADVANTAGE_MODES = ("grpo", "drgrpo")


def _rewards_by_group(rewards_b: ArrayLike, group_size: int) -> np.ndarray:
  """Checks the group layout and reshapes flat rewards to `[num_groups, group_size]` in fp64."""
  rewards_b = np.asarray(rewards_b)
  if rewards_b.ndim != 1:
    raise ValueError(
      f"rewards_b must be 1-D [num_groups * group_size], got shape {rewards_b.shape}."
    )
  if group_size < 2:
    raise ValueError(
      f"group_size must be >= 2 to compare rollouts within a group, got {group_size}."
    )
  if rewards_b.shape[0] % group_size:
    raise ValueError(
      f"rewards_b has {rewards_b.shape[0]} entries, not divisible by group_size={group_size}; "
      "rewards must be [num_groups * group_size] with each group contiguous."
    )
  return rewards_b.astype(np.float64).reshape(-1, group_size)


def group_advantages(
  rewards_b: ArrayLike, group_size: int, *, mode: str = "grpo", eps: float = 1e-6
) -> np.ndarray:
  """Advantage of each rollout relative to the other rollouts of its prompt.

  Args:
    rewards_b: `[num_groups * group_size]` scalar rewards, each group's rollouts contiguous.
    group_size: rollouts per prompt, at least 2.
    mode: `"grpo"`: `(r - mean_g) / (std_g + eps)` where `std_g` is the unbiased (ddof=1)
      standard deviation of the group, as TRL and verl compute it; a group whose rewards are all
      equal gets advantage 0. `"drgrpo"` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like
      Training"): `r - mean_g`, without the std division that biases towards easy/hard prompts.
    eps: added to the std in `"grpo"` mode.

  Returns:
    `[num_groups * group_size]` fp32 advantages, in the order of `rewards_b`.

  Raises:
    ValueError: `group_size < 2`, a length not divisible by `group_size`, or an unknown mode.
  """
  if mode not in ADVANTAGE_MODES:
    raise ValueError(f"Unknown advantage mode {mode!r}; known modes: {ADVANTAGE_MODES}.")
  rewards_gk = _rewards_by_group(rewards_b, group_size)
  centred_gk = rewards_gk - rewards_gk.mean(axis=1, keepdims=True)
  if mode == "grpo":
    std_g1 = np.std(rewards_gk, axis=1, ddof=1, keepdims=True)
    centred_gk = centred_gk / (std_g1 + eps)
  # All-equal rewards: exactly 0. A mean rounds away from the common value (0.9 * 12 / 12 is
  # not 0.9 in floating point), and divided by a std of the same rounding, plus eps, that
  # residue became a uniform push of up to 0.1 on the whole group.
  equal_g1 = _all_equal(rewards_gk)[:, None]
  return np.where(equal_g1, 0.0, centred_gk).reshape(-1).astype(np.float32)


def zero_variance_groups(rewards_b: ArrayLike, group_size: int) -> np.ndarray:
  """Which groups have all-equal rewards, hence zero advantage and no learning signal.

  Args:
    rewards_b: `[num_groups * group_size]` rewards, each group contiguous.
    group_size: rollouts per prompt, at least 2.

  Returns:
    `bool[num_groups]`, True where every reward in the group is equal (e.g. for DAPO dynamic
    sampling, which drops such groups).
  """
  return _all_equal(_rewards_by_group(rewards_b, group_size))


def _all_equal(rewards_gk: np.ndarray) -> np.ndarray:
  return np.all(rewards_gk == rewards_gk[:, :1], axis=1)
