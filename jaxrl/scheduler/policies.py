"""The policies the simulator compares, its result record, and availability traces.

A policy is a placement (colocated or disaggregated) plus a mode (synchronous, asynchronous
under a staleness bound, with partial rollouts, harvesting preemptible pools); each runs the
plan the planner makes for the cluster as that policy sees it (`policy_plan`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from jaxrl.scheduler import planner
from jaxrl.scheduler.cluster import Cluster
from jaxrl.scheduler.plan import Plan
from jaxrl.scheduler.planner import Problem
from jaxrl.scheduler.replan import PoolEvent

POLICIES = ("colocated_sync", "disagg_sync", "disagg_async", "disagg_async_partial",
            "disagg_async_partial_spot")  # fmt: skip
# Staleness of the async policies when the workload asks for 0 (synchronous).
DEFAULT_STALENESS = 2


@dataclasses.dataclass(frozen=True)
class SimResult:
  """What one simulated run did.

  Attributes:
    policy: one of `POLICIES`.
    max_staleness: the staleness bound it ran with (0 for sync policies).
    steps: training steps completed.
    samples_trained: samples consumed by those steps.
    wall_seconds: time at which the last step finished.
    samples_per_s: samples_trained / wall_seconds.
    cost_dollars: price x devices held, integrated over the run.
    cost_per_1k_samples: cost_dollars per 1000 trained samples.
    utilisation: `rollout` (decode + prefill instance-seconds over instance-seconds held) and
      `train` (training time over wall time).
    staleness_histogram: version lag -> trained samples (learner version at training minus the
      version of the sample's oldest token).
    off_policy_token_fraction: trained response tokens made by an older version than the one
      they were trained at.
    reprefilled_tokens: prompt + prefix tokens prefilled again by requests resumed on another
      instance (after a preemption or a re-plan removed theirs).
    adoption_reprefill_tokens: context tokens re-prefilled when partial rollouts switch weights.
    preemptions: rollout instances lost to reclaimed devices.
    replans: re-planning decisions taken (one per availability event that applies).
    replans_adopted: of those, how many switched to a new plan.
    plan_samples_per_s: the cost model's throughput prediction for the initial plan.
    plan_cost_per_1k_samples: its cost prediction.
    audit: conservation counters (started, finished, trained, handed_back, lost, duplicated,
      trained_twice, token_mismatch, forced_trains, stalled).
    events: events processed (the simulator's work).
    timeline: (lane, start, end, kind) segments for at most 64 lanes.
  """

  policy: str
  max_staleness: int
  steps: int
  samples_trained: int
  wall_seconds: float
  samples_per_s: float
  cost_dollars: float
  cost_per_1k_samples: float
  utilisation: dict[str, float]
  staleness_histogram: dict[int, int]
  off_policy_token_fraction: float
  reprefilled_tokens: int
  adoption_reprefill_tokens: int
  preemptions: int
  replans: int
  replans_adopted: int
  plan_samples_per_s: float
  plan_cost_per_1k_samples: float
  audit: dict[str, int]
  events: int
  timeline: tuple[tuple[str, float, float, str], ...] = ()

  @property
  def mean_staleness(self) -> float:
    n = sum(self.staleness_histogram.values())
    return sum(k * v for k, v in self.staleness_histogram.items()) / n if n else 0.0

  def to_dict(self, timeline: bool = False) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["mean_staleness"] = self.mean_staleness
    out["staleness_histogram"] = {str(k): v for k, v in self.staleness_histogram.items()}
    if not timeline:
      out.pop("timeline")
    return out


_Spec = collections.namedtuple("_Spec", "colocated sync partial spot")
_SPECS = dict(zip(POLICIES, (_Spec(*flags) for flags in (
  (True, True, False, False), (False, True, False, False), (False, False, False, False),
  (False, False, True, False), (False, False, True, True),
)), strict=True))  # fmt: skip


def policy_spec(policy: str) -> _Spec:
  """The switches of `policy`: colocated, sync, partial rollouts, harvests spot pools."""
  if policy not in _SPECS:
    raise ValueError(f"unknown policy {policy!r}; known policies: {', '.join(POLICIES)}.")
  return _SPECS[policy]


def policy_problem(problem: Problem, policy: str) -> Problem:
  """`problem` as `policy` plans it: preemptible pools emptied unless the policy harvests
  them, staleness 0 for sync policies (else the workload's, or `DEFAULT_STALENESS` if 0)."""
  spec = policy_spec(policy)
  cluster = problem.cluster
  if not spec.spot:
    for p in cluster.pools:
      if p.preemptible:
        cluster = cluster.with_pool_nodes(p.name, 0)
  eta = 0 if spec.sync else (problem.workload.max_staleness or DEFAULT_STALENESS)
  workload = dataclasses.replace(problem.workload, max_staleness=eta)
  return planner.build_problem(cluster, problem.model, workload, model_name=problem.model_name)


def policy_plan(problem: Problem, policy: str) -> tuple[Problem, Plan]:
  """The problem and plan `policy` runs with (see `policy_problem`)."""
  p = policy_problem(problem, policy)
  return p, planner.plan_colocated(p) if policy_spec(policy).colocated else planner.plan(p)


def random_trace(
  cluster: Cluster, pool: str, horizon_s: float, mean_interval_s: float, seed: int = 0
) -> list[PoolEvent]:
  """Random shrink / grow events of `pool` (between 0 and its current nodes) until horizon_s.

  Gaps are exponential with mean `mean_interval_s`; half the shrinks come with a notice of
  up to 2 minutes (grows never need one).
  """
  rng = np.random.default_rng(seed)
  top = cluster.pool(pool).nodes
  nodes, t, out = top, 0.0, []
  while top > 0:
    t += float(rng.exponential(mean_interval_s))
    if t >= horizon_s:
      break
    if nodes == top or (nodes > 0 and rng.random() < 0.5):
      nodes = int(rng.integers(0, nodes))
      notice = float(rng.uniform(5.0, 120.0)) if rng.random() < 0.5 else 0.0
    else:
      nodes, notice = int(rng.integers(nodes + 1, top + 1)), 0.0
    out.append(PoolEvent(time_s=t, pool=pool, nodes=nodes, notice_s=min(notice, t)))
  return out
