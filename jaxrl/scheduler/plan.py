"""A plan: which devices serve which stage, how, and what the cost model predicts for it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class RolloutStage:
  """Identical rollout instances on one pool.

  Attributes:
    pool: the pool they run on.
    accelerator: its accelerator type.
    instances: independent engines.
    mesh: axis sizes of each instance's mesh (tensor parallel only).
    batch_size: sequences each instance decodes at once (continuous batching limit).
    samples_per_s: finished responses per second, all instances together.
    step_seconds: one decode step of one instance at the workload's mean context.
    memory_per_device_gib: weights + KV pages + logits, per device.
  """

  pool: str
  accelerator: str
  instances: int
  mesh: dict[str, int]
  batch_size: int
  samples_per_s: float
  step_seconds: float
  memory_per_device_gib: float

  @property
  def devices(self) -> int:
    return self.instances * self.mesh["tensor"]


@dataclasses.dataclass(frozen=True)
class TrainStage:
  """The training mesh: devices taken from one or more pools of one accelerator type."""

  pools: dict[str, int]  # pool -> devices taken from it
  accelerator: str
  devices: int
  mesh: dict[str, int]
  step_seconds: float
  memory_per_device_gib: float


@dataclasses.dataclass(frozen=True)
class Plan:
  """Stages, their devices and the predicted pipeline.

  `cycle_seconds` is the time per training step in steady state; throughput is
  samples_per_step / cycle_seconds. `stage_seconds` holds the terms the cycle is made of
  (`rollout` work, `rollout_tail` latency of the longest response, `train`, `weight_sync`);
  `bottleneck` names the one that sets the cycle.
  """

  cluster: str
  model: str
  mode: str  # "sync" (staleness 0) or "async"
  max_staleness: int
  samples_per_step: int
  train: TrainStage
  rollout: tuple[RolloutStage, ...]
  cycle_seconds: float
  throughput_samples_per_s: float
  cost_per_hour: float
  stage_seconds: dict[str, float]
  bottleneck: str
  devices_used: dict[str, int]
  solve_seconds: float = 0.0

  @property
  def cost_per_1k_samples(self) -> float:
    return self.cost_per_hour / 3600 / self.throughput_samples_per_s * 1000

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["stages"] = {"train": out.pop("train"), "rollout": out.pop("rollout")}
    out["cost_per_1k_samples"] = self.cost_per_1k_samples
    return out

  def to_json(self, **kw) -> str:
    return json.dumps(self.to_dict(), **kw)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Plan:
    d = dict(d)
    stages = d.pop("stages")
    d.pop("cost_per_1k_samples", None)
    return cls(
      train=TrainStage(**stages["train"]),
      rollout=tuple(RolloutStage(**r) for r in stages["rollout"]),
      **d,
    )

  def table(self) -> str:
    """A human-readable summary."""
    lines = [
      f"plan for {self.model} on {self.cluster}: {self.mode}"
      + (f" (max staleness {self.max_staleness})" if self.mode == "async" else ""),
      f"  throughput {self.throughput_samples_per_s:.3g} samples/s, "
      f"${self.cost_per_hour:.2f}/h, ${self.cost_per_1k_samples:.4g} per 1k samples, "
      f"cycle {self.cycle_seconds:.3g} s for {self.samples_per_step} samples, "
      f"bottleneck: {self.bottleneck}",
      "",
      f"  {'stage':<8} {'pool':<16} {'type':<10} {'inst':>5} {'devices':>7} {'mesh':<22} "
      f"{'batch':>5} {'samples/s':>10} {'step s':>9} {'GiB/dev':>8}",
    ]
    t = self.train
    mesh = "x".join(f"{k}{v}" for k, v in t.mesh.items() if v > 1) or "1"
    lines.append(
      f"  {'train':<8} {'+'.join(t.pools):<16} {t.accelerator:<10} {1:>5} {t.devices:>7} "
      f"{mesh:<22} {'':>5} {'':>10} {t.step_seconds:>9.3g} {t.memory_per_device_gib:>8.2f}"
    )
    for r in self.rollout:
      lines.append(
        f"  {'rollout':<8} {r.pool:<16} {r.accelerator:<10} {r.instances:>5} {r.devices:>7} "
        f"{'tensor' + str(r.mesh['tensor']):<22} {r.batch_size:>5} {r.samples_per_s:>10.3g} "
        f"{r.step_seconds:>9.3g} {r.memory_per_device_gib:>8.2f}"
      )
    terms = ", ".join(f"{k} {v:.3g} s" for k, v in self.stage_seconds.items())
    lines += ["", f"  per step: {terms}"]
    return "\n".join(lines)
