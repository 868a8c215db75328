"""Plans for this process's own devices: the split the `planned` placement of the RL loop uses."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax

from jaxrl.config import ExperimentConfig
from jaxrl.scheduler.catalog import CATALOG
from jaxrl.scheduler.cluster import Cluster, Pool
from jaxrl.scheduler.cost import Workload, decode_step_seconds
from jaxrl.scheduler.plan import Plan
from jaxrl.scheduler.planner import build_problem, plan

# Substrings of `device.device_kind` -> catalog key, for accelerators this process may run on.
DEVICE_KINDS = (
  ("H200", "H200"),
  ("H100", "H100"),
  ("A100", "A100-80GB"),
  ("L40S", "L40S"),
  ("A40", "A40"),
  ("L4", "L4"),
  ("V100", "V100"),
  ("4090", "RTX4090"),
  ("MI300X", "MI300X"),
  ("v6", "v6e"),
  ("v5p", "v5p"),
  ("v5", "v5e"),
  ("v4", "v4"),
)
# The catalog's `cpu` entry is one of this many simulated devices sharing the machine.
CPU_CATALOG_SHARING = 8


def local_cluster(devices: Sequence[jax.Device]) -> Cluster:
  """One pool holding `devices` (one node: they share a host)."""
  devices = list(devices)
  platform = devices[0].platform
  if platform == "cpu":
    # Simulated devices split one machine: fewer of them get a larger share each.
    share = CPU_CATALOG_SHARING / len(devices)
    cpu = CATALOG["cpu"]
    accelerators = dict(CATALOG)
    accelerators["cpu"] = dataclasses.replace(
      cpu, flops=cpu.flops * share, hbm_bytes_per_s=cpu.hbm_bytes_per_s * share
    )
    name = "cpu"
  else:
    kind = devices[0].device_kind
    name = next((key for sub, key in DEVICE_KINDS if sub.lower() in kind.lower()), None)
    if name is None:
      raise ValueError(
        f"no catalog entry matches device kind {kind!r}; add one to "
        "jaxrl.scheduler.local.DEVICE_KINDS or set the placement's device counts by hand."
      )
    accelerators = dict(CATALOG)
  pool = Pool("local", name, nodes=1, devices_per_node=len(devices))
  return Cluster("local", (pool,), accelerators=accelerators)


def experiment_workload(cfg: ExperimentConfig, prompt_len: int) -> Workload:
  """The RL step of `cfg` as the cost model sees it (synchronous; responses up to the cap,
  spread around half of it)."""
  cap = cfg.rollout.sampling.max_new_tokens
  return Workload(
    prompts_per_step=cfg.rollout.prompts_per_step,
    group_size=cfg.rollout.group_size,
    prompt_len=prompt_len,
    response_median=max(1.0, cap / 2),
    response_sigma=0.5,
    response_cap=cap,
    max_staleness=0,
    updates_per_step=cfg.train.updates_per_step,
    extra_forward_passes=1,
    micro_batch_size=cfg.train.micro_batch_size,
  )


def plan_for_experiment(
  cfg: ExperimentConfig,
  prompt_len: int,
  devices: Sequence[jax.Device] | None = None,
  cluster: Cluster | None = None,
) -> Plan:
  """The planner's disaggregated split of this process's devices (or of `cluster`, a Ray
  cluster's spec) for `cfg`'s model and step."""
  if cluster is None:
    cluster = local_cluster(list(jax.devices() if devices is None else devices))
  workload = experiment_workload(cfg, prompt_len)
  return plan(build_problem(cluster, cfg.model, workload, model_name="experiment"))


def worker_tokens_per_s(
  cfg: ExperimentConfig, mesh_shape: dict[str, int], prompt_len: int, all_devices=None
) -> float:
  """Predicted decode rate (tokens/s) of a rollout worker with `mesh_shape` over this
  process's devices: its data-parallel replicas, each `tensor` devices wide, split the
  engine's running batch, at the mean context of a response half the cap long."""
  devices = list(jax.devices() if all_devices is None else all_devices)
  cluster = local_cluster(devices)
  acc = cluster.accelerator(cluster.pools[0])
  tensor = max(1, mesh_shape.get("tensor", 1))
  replicas = max(1, math.prod(mesh_shape.values()) // tensor)
  batch = max(1, cfg.rollout.paged.max_running // replicas)
  context = prompt_len + cfg.rollout.sampling.max_new_tokens / 2
  return replicas * batch / decode_step_seconds(cfg.model, acc, tensor, batch, context)
