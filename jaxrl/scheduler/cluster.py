"""Cluster specs: pools of nodes of one accelerator type, and the links between them.

A cluster file (`configs/clusters/<name>.py`) defines `get_config()` returning a ConfigDict:

  name: str
  pools: list of dicts with the fields of `Pool`
  cross_pool_GBps: bandwidth per device between nodes of different pools (default 12.5)
  links: list of [pool_a, pool_b, GBps] for pools joined by a faster fabric
  overrides: {accelerator: {field: value}}, replacing catalog figures (prices, efficiencies)
  calibrate_cpu: measure the `cpu` entry on this machine when the cluster is loaded
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import networkx as nx

from jaxrl.scheduler.catalog import CATALOG, GB, Accelerator, calibrate_cpu, with_overrides


@dataclasses.dataclass(frozen=True)
class Pool:
  """Nodes of one accelerator type that are bought, lost and priced together.

  Attributes:
    name: unique within the cluster.
    accelerator: catalog key.
    nodes: machines in the pool (0 for a pool that is currently empty).
    devices_per_node: accelerators per machine.
    inter_node_GBps: network bandwidth per device between nodes of this pool, one way.
    preemptible: spot / preemptible capacity: cheaper, may be reclaimed.
    price_per_device_hour: $ per device-hour; -1 takes the catalog's price.
  """

  name: str
  accelerator: str
  nodes: int
  devices_per_node: int = 8
  inter_node_GBps: float = 50.0
  preemptible: bool = False
  price_per_device_hour: float = -1.0

  @property
  def devices(self) -> int:
    return self.nodes * self.devices_per_node


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Pools plus the accelerator catalog they refer to (with the spec's overrides applied)."""

  name: str
  pools: tuple[Pool, ...]
  accelerators: Mapping[str, Accelerator] = dataclasses.field(default_factory=lambda: CATALOG)
  cross_pool_GBps: float = 12.5
  links: tuple[tuple[str, str, float], ...] = ()

  def __post_init__(self):
    names = [p.name for p in self.pools]
    if len(set(names)) != len(names):
      raise ValueError(f"cluster {self.name}: pool names must be unique, got {names}.")
    if not self.pools:
      raise ValueError(f"cluster {self.name}: needs at least one pool.")
    for p in self.pools:
      where = f"cluster {self.name}, pool {p.name}"
      if p.accelerator not in self.accelerators:
        raise ValueError(
          f"{where}: unknown accelerator {p.accelerator!r}; known: {sorted(self.accelerators)}."
        )
      if p.nodes < 0 or p.devices_per_node < 1 or p.inter_node_GBps <= 0:
        raise ValueError(
          f"{where}: needs nodes >= 0, devices_per_node >= 1 and inter_node_GBps > 0."
        )
    for a, b, bw in self.links:
      if a not in names or b not in names or bw <= 0:
        raise ValueError(f"cluster {self.name}: link {(a, b, bw)} must join two pools, GBps > 0.")

  def pool(self, name: str) -> Pool:
    for p in self.pools:
      if p.name == name:
        return p
    raise KeyError(
      f"cluster {self.name} has no pool {name!r}; pools: {[p.name for p in self.pools]}."
    )

  def accelerator(self, pool: Pool) -> Accelerator:
    return self.accelerators[pool.accelerator]

  def price(self, pool: Pool) -> float:
    """$ per device-hour in `pool`."""
    if pool.price_per_device_hour >= 0:
      return pool.price_per_device_hour
    return self.accelerator(pool).price(pool.preemptible)

  @property
  def num_devices(self) -> int:
    return sum(p.devices for p in self.pools)

  def bandwidth(self, a: str, b: str) -> float:
    """Bytes/s per device between pools `a` and `b` (inter-node within one pool)."""
    if a == b:
      return self.pool(a).inter_node_GBps * GB
    for x, y, bw in self.links:
      if {x, y} == {a, b}:
        return bw * GB
    return self.cross_pool_GBps * GB

  def with_pool_nodes(self, name: str, nodes: int) -> Cluster:
    """The same cluster with pool `name` resized to `nodes` machines."""
    pools = tuple(dataclasses.replace(p, nodes=nodes) if p.name == name else p for p in self.pools)
    self.pool(name)
    return dataclasses.replace(self, pools=pools)

  def training_islands(self) -> list[tuple[str, ...]]:
    """Groups of pools one training mesh may span: same accelerator type, joined by links at
    least as fast as each pool's own inter-node network (so a mesh never straddles a slow link).

    Found as connected components of the pool graph keeping only those fast edges.
    """
    g = nx.Graph()
    g.add_nodes_from(p.name for p in self.pools if p.nodes)
    for a in g.nodes:
      for b in g.nodes:
        pa, pb = self.pool(a), self.pool(b)
        same_kind = (pa.accelerator, pa.devices_per_node) == (pb.accelerator, pb.devices_per_node)
        fast = self.bandwidth(a, b) >= min(pa.inter_node_GBps, pb.inter_node_GBps) * GB
        if a < b and same_kind and fast:
          g.add_edge(a, b)
    return sorted(tuple(sorted(c)) for c in nx.connected_components(g))


def cluster_from_dict(spec: Mapping[str, Any]) -> Cluster:
  """Builds a `Cluster` from the dict a cluster file's `get_config()` holds."""
  spec = dict(spec)
  known = {"name", "pools", "cross_pool_GBps", "links", "overrides", "calibrate_cpu"}
  unknown = sorted(set(spec) - known)
  if unknown:
    raise ValueError(f"cluster spec: unknown key(s) {unknown}; known keys: {sorted(known)}.")
  pool_fields = {f.name for f in dataclasses.fields(Pool)}
  pools = []
  for i, p in enumerate(spec.get("pools", ())):
    bad = sorted(set(p) - pool_fields)
    if bad:
      raise ValueError(
        f"cluster spec: pools[{i}] has unknown key(s) {bad}; a pool has {sorted(pool_fields)}."
      )
    pools.append(Pool(**p))
  catalog = with_overrides(CATALOG, spec.get("overrides", {}))
  if spec.get("calibrate_cpu", False):
    sharing = sum(p.devices for p in pools if p.accelerator == "cpu") or 1
    measured = calibrate_cpu(devices_sharing=sharing)
    catalog["cpu"] = dataclasses.replace(
      catalog["cpu"], flops=measured.flops, hbm_bytes_per_s=measured.hbm_bytes_per_s
    )
  return Cluster(
    name=spec.get("name", "cluster"),
    pools=tuple(pools),
    accelerators=catalog,
    cross_pool_GBps=float(spec.get("cross_pool_GBps", 12.5)),
    links=tuple((a, b, float(bw)) for a, b, bw in spec.get("links", ())),
  )


def load_cluster(path: str, arg: str | None = None) -> Cluster:
  """Loads `configs/clusters/<name>.py` (its `get_config(arg)`) into a `Cluster`."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"cluster file {path} does not exist; see configs/clusters/.")
  spec = importlib.util.spec_from_file_location("_cluster_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg) if arg is not None else module.get_config()
  config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  return cluster_from_dict(config)
