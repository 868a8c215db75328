"""DAPO dynamic sampling in the synchronous controller: uninformative groups are replaced."""

import hashlib
import os

import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.data.tasks import RewardBatch
from jaxrl.rl import job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**overrides):
  base = {"warmup.steps": 0, "eval.every": 0}
  return load_config(os.path.join(REPO, "configs", "grpo_tiny.py"), "test", base | overrides)


def _fake_scores(informative):
  """Rewards that vary within a group only for prompts where `informative(id)` holds."""

  def score(records, completions):
    del completions
    rng = np.random.default_rng()
    rewards_b = np.array(
      [rng.random() if informative(r["id"]) else 0.5 for r in records], np.float32
    )
    return RewardBatch(rewards_b, rewards_b == 1.0, timeouts=0)

  return score


@pytest.mark.parametrize("every", [2, 0])  # every 2nd prompt informative (by id hash), or none
def test_dynamic_sampling_keeps_only_informative_groups(tmp_path, every):
  cfg = _config(**{"rollout.dynamic_sampling": True, "rollout.dynamic_sampling_rounds": 3})
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  controller.publish()
  salt = str(np.random.default_rng().integers(1 << 30))

  def informative(prompt_id):
    digest = hashlib.sha256((salt + str(prompt_id)).encode()).digest()
    return bool(every) and digest[0] % every == 0

  controller.score = _fake_scores(informative)
  records, completions, rewards, info = controller.generate_groups()
  g, n = cfg.rollout.group_size, cfg.rollout.prompts_per_step
  assert len(records) == len(completions) == len(rewards) == n * g
  stds = rewards.reshape(n, g).std(axis=1)
  assert (stds == 0).sum() == info["groups_uninformative_in_batch"]
  for i in range(n):  # a kept group is informative unless it is filler
    assert (stds[i] > 0) == informative(records[i * g]["id"])
  assert 1 <= info["dynamic_rounds"] <= 3
  if not every:  # nothing informative: every round used, the batch is all filler
    assert info["dynamic_rounds"] == 3 and info["groups_uninformative_in_batch"] == n
  # Without dynamic sampling the first batch's groups are kept as they are.
  plain = job.build_controller(_config(), str(tmp_path / "plain"), show_progress=False)
  plain.publish()
  plain.score = _fake_scores(lambda _: False)
  _, _, rewards, info = plain.generate_groups()
  assert len(rewards) == n * g and "dynamic_rounds" not in info


def test_bad_dynamic_sampling_rounds():
  with pytest.raises(ConfigError, match="dynamic_sampling_rounds"):
    _config(**{"rollout.dynamic_sampling_rounds": 0})
