"""DAPO dynamic sampling: groups whose rewards are all equal are replaced by other prompts."""

import hashlib
import os

import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.data import RewardBatch
from jaxrl.metrics import read_metrics
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


# Every 2nd prompt informative (by id hash) or none, in each mode; two of the four by default.
@pytest.mark.parametrize(
  "every,mode",
  [
    (2, "sync"),
    (0, "async"),
    pytest.param(0, "sync", marks=pytest.mark.slow),
    pytest.param(2, "async", marks=pytest.mark.slow),
  ],
)
def test_dynamic_sampling_keeps_only_informative_groups(tmp_path, every, mode):
  overrides = {"rollout.dynamic_sampling": True, "rollout.dynamic_sampling_rounds": 3}
  cfg = _config(**overrides, **{"loop.mode": mode, "train.steps": 3})
  controller = job.build_controller(cfg, str(tmp_path), show_progress=False)
  salt = str(np.random.default_rng().integers(1 << 30))

  def informative(prompt_id):
    digest = hashlib.sha256((salt + str(prompt_id)).encode()).digest()
    return bool(every) and digest[0] % every == 0

  controller.score = _fake_scores(informative)
  trained = []

  def train(step, groups):
    trained.append(list(groups))
    if mode == "sync":  # a step's groups and nothing else: every replacement took one prompt
      assert sorted(controller.groups) == sorted(group.gid for group in groups)

  controller.on_train.append(train)
  controller.run()
  g, n = cfg.rollout.group_size, cfg.rollout.prompts_per_step
  budget = (cfg.rollout.dynamic_sampling_rounds - 1) * n
  rows = [r for r in read_metrics(controller.writer.path) if r["kind"] == "train"]
  assert len(rows) == len(trained) == 3
  for groups, row in zip(trained, rows, strict=True):
    assert len(groups) == n and all(len(group.rewards) == g for group in groups)
    filler = [group for group in groups if np.ptp(group.rewards) == 0]
    assert len(filler) == row["groups_uninformative_in_batch"]
    for group in groups:  # a trained group is informative unless it is filler
      assert (np.ptp(group.rewards) > 0) == informative(group.prompt["id"])
    assert row["groups_dropped"] <= budget
    if filler and mode == "sync":  # filler only once the step's budget of replacements is
      # spent (async: a group of the next version may have been kept in an earlier step's)
      assert row["groups_dropped"] == budget
  if not every:  # nothing informative: every replacement used, each batch all filler
    assert [r["groups_uninformative_in_batch"] for r in rows] == [n, n, n]
  # Every prompt the loader gave is trained, dropped, or still held: none skipped.
  dropped = controller.counters["groups_dropped"]
  assert dropped >= sum(r["groups_dropped"] for r in rows)  # and any dropped since the last step
  assert controller.next_group == 3 * n + dropped + len(controller.groups)


def test_bad_dynamic_sampling_rounds():
  with pytest.raises(ConfigError, match="dynamic_sampling_rounds"):
    _config(**{"rollout.dynamic_sampling_rounds": 0})
