"""Re-planning on pool events: adopt a new plan only when it pays back within the window."""

import os

import pytest

from jaxrl.model import get_preset
from jaxrl.scheduler import Workload, build_problem, load_cluster, plan
from jaxrl.scheduler.replan import decide, keep_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = get_preset("qwen3-8b")
# A light tail, so that rollout capacity (not the longest response) limits throughput.
WORKLOAD = Workload(
  prompts_per_step=64, response_median=512, response_sigma=0.5, response_cap=2048, max_staleness=2
)


def _cluster(spot_nodes):
  path = os.path.join(REPO, "configs", "clusters", "ondemand_preemptible.py")
  return load_cluster(path, str(spot_nodes))


def test_growing_spot_pool_is_adopted_only_if_it_pays_back():
  before = plan(build_problem(_cluster(1), MODEL, WORKLOAD))
  after = build_problem(_cluster(8), MODEL, WORKLOAD)
  d = decide(after, before, window_s=3600)
  assert d.adopted and not d.forced
  assert d.new_throughput > d.kept_throughput
  assert d.plan.throughput_samples_per_s == pytest.approx(d.new_throughput)
  assert d.reconfigure_seconds > 0 and d.payback_seconds <= 3600
  # The same gain does not pay for the stall within a window shorter than its payback.
  short = decide(after, before, window_s=d.payback_seconds / 2)
  assert not short.adopted
  assert short.plan.throughput_samples_per_s == pytest.approx(short.kept_throughput)


def test_shrinking_spot_pool_drops_lost_instances():
  before = plan(build_problem(_cluster(8), MODEL, WORKLOAD))
  assert before.devices_used.get("a100-spot", 0) > 8, before.table()
  after = build_problem(_cluster(1), MODEL, WORKLOAD)
  kept = keep_plan(after, before)
  assert kept.devices_used.get("a100-spot", 0) <= 8
  assert kept.throughput_samples_per_s <= before.throughput_samples_per_s
  d = decide(after, before)
  for pool, n in d.plan.devices_used.items():
    assert n <= after.cluster.pool(pool).devices


def test_losing_training_devices_forces_a_new_plan():
  cluster = _cluster(8)
  before = plan(build_problem(cluster, MODEL, WORKLOAD))
  train_pool = next(iter(before.train.pools))
  shrunk = cluster.with_pool_nodes(train_pool, cluster.pool(train_pool).nodes // 2)
  after = build_problem(shrunk, MODEL, WORKLOAD)
  if before.train.pools[train_pool] <= after.cluster.pool(train_pool).devices:
    pytest.skip("the plan's training mesh still fits")  # not expected with this cluster
  d = decide(after, before)
  assert d.forced and d.adopted and d.kept_throughput == 0
  assert d.plan.train.pools[train_pool] <= after.cluster.pool(train_pool).devices
