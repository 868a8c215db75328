"""Host-side scheduler: which accelerators serve which stage, and what a plan would do.

`catalog` (accelerator types), `cluster` (pools and links, loaded from configs/clusters/),
`cost` (roofline cost model of rollout and training), `planner` (MILP over per-pool stage
configurations), `plan` (the result), `replan` (events and when a new plan pays off),
`simulator` (discrete-event runs of an RL job under a plan).
"""

from jaxrl.scheduler.catalog import CATALOG, Accelerator, calibrate_cpu, fit_decode_efficiency
from jaxrl.scheduler.cluster import Cluster, Pool, cluster_from_dict, load_cluster
from jaxrl.scheduler.cost import Workload
from jaxrl.scheduler.plan import Plan, RolloutStage, TrainStage
from jaxrl.scheduler.planner import PlannerConfig, PlanningError, build_problem, evaluate, plan

__all__ = [
  "CATALOG",
  "Accelerator",
  "Cluster",
  "Plan",
  "PlannerConfig",
  "PlanningError",
  "Pool",
  "RolloutStage",
  "TrainStage",
  "Workload",
  "build_problem",
  "calibrate_cpu",
  "cluster_from_dict",
  "evaluate",
  "fit_decode_efficiency",
  "load_cluster",
  "plan",
]
