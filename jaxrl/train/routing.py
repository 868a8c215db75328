"""MoE training: routing replay from the rollout's routes, and expert placements planned per
micro-batch from those routes.

The rollout engine records, per token and MoE layer, the experts it routed to
(`Completion.prompt_routing` + `Completion.routing`, which cover exactly the learner's inputs).
With routing replay the learner sends the same tokens through the same experts, so the
gradient is that of the policy that sampled them (the router still learns from its
probabilities at those experts). Since the routes are known before the forward pass, each
micro-batch's expert loads are known too: the learner plans that micro-batch's placement
(`jaxrl.sharding.plan_placement`) before running it, so hot experts are replicated where they
are needed now rather than where they were hot on an earlier batch.

Glossary: m micro-batches, b sequences, t positions, l layers, k experts per token, x experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.sharding import METHODS, imbalance, plan_placement
from jaxrl.sharding.expert import EXCHANGES, PlacementLayer, placement_arrays


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """How the learner runs MoE layers (ignored for dense models).

  Attributes:
    routing_replay: route each token through the experts the rollout chose for it (the routes
      it recorded) instead of through the learner's router.
    placement: on a training mesh with an expert axis > 1, the expert placement planned per
      micro-batch from its replayed routes: "static" (experts stay home), "replicate_pack" or
      "least_loaded" (`jaxrl.sharding.balance`); anything but "static" needs routing_replay.
    redundant_slots: expert slots per device beyond the home ones, for replicas.
    capacity_factor: 0 for dropless, else the expert-parallel layer's capacity factor (> 0).
    gmm_impl: the grouped-matmul implementation (`jaxrl.kernels.gmm`).
    exchange: the token exchange of the expert-parallel layer (`jaxrl.sharding.EXCHANGES`).
  """

  routing_replay: bool = False
  placement: str = "static"
  redundant_slots: int = 1
  capacity_factor: float = 0.0
  gmm_impl: str = "auto"
  exchange: str = "all_to_all"

  def __post_init__(self):
    if self.placement not in METHODS:
      raise ValueError(f"MoEConfig.placement={self.placement!r}: choose one of {METHODS}.")
    if self.placement != "static" and not self.routing_replay:
      raise ValueError(
        f"MoEConfig.placement={self.placement!r} plans from the replayed routes: set "
        "routing_replay=True, or placement='static'."
      )
    if self.redundant_slots < 0:
      raise ValueError(f"MoEConfig.redundant_slots must be >= 0, got {self.redundant_slots}.")
    if self.capacity_factor < 0:
      raise ValueError(
        f"MoEConfig.capacity_factor must be 0 (dropless) or > 0, got {self.capacity_factor}."
      )
    if self.exchange not in EXCHANGES:
      raise ValueError(f"MoEConfig.exchange={self.exchange!r}: choose one of {EXCHANGES}.")


def routes_from_completions(completions: Sequence, length: int) -> np.ndarray | None:
  """int32 [b, length, layers, k] routes of the learner's inputs (prompt + response but its
  last token), -1 past each sequence; None when a completion has no routing trace."""
  if not completions or any(c.routing is None or c.prompt_routing is None for c in completions):
    return None
  first = np.asarray(completions[0].routing)
  if first.ndim != 3:
    return None
  layers, k = first.shape[1:]
  routes = np.full((len(completions), length, layers, k), -1, np.int32)
  for i, c in enumerate(completions):
    trace = np.concatenate(
      [np.asarray(c.prompt_routing).reshape(-1, layers, k), np.asarray(c.routing)]
    )
    routes[i, : len(trace)] = trace[:length]
  return routes


def replayed_routes(
  routes_btlk: np.ndarray | None, targets_shape: tuple[int, int], num_experts: int
) -> np.ndarray:
  """A batch's routes for routing replay (`[b, t, layers, k]`, `[b, t]` like its targets),
  with the padding positions filled (`fill_padding`)."""
  if routes_btlk is None:
    raise ValueError(
      "train.moe.routing_replay needs the rollout's routing trace with the batch; the paged "
      "engine records it, the static engine does not."
    )
  if routes_btlk.shape[:2] != tuple(targets_shape):
    raise ValueError(
      f"routes_btlk has shape {routes_btlk.shape}; it must be [b, t, layers, k] with "
      f"[b, t] = {tuple(targets_shape)}, like the batch's targets."
    )
  return fill_padding(routes_btlk, num_experts)


def fill_padding(routes_btlk: np.ndarray, num_experts: int) -> np.ndarray:
  """Routes with the -1 entries (padding positions) replaced by experts spread round-robin,
  so that padding loads every expert alike."""
  b, t, layers, k = routes_btlk.shape
  spread = (np.arange(t)[:, None, None] * k + np.arange(k)) % num_experts
  spread = np.broadcast_to(spread, routes_btlk.shape)
  return np.where(routes_btlk < 0, spread, routes_btlk).astype(np.int32)


def expert_loads(routes_btlk: np.ndarray, num_experts: int) -> np.ndarray:
  """[layers, experts] assignments per expert in a batch of routes."""
  layers = routes_btlk.shape[2]
  flat = np.moveaxis(routes_btlk, 2, 0).reshape(layers, -1)
  return np.stack([np.bincount(row, minlength=num_experts) for row in flat]).astype(np.float64)


def plan_micro_batches(
  routes_mbtlk: np.ndarray, num_experts: int, num_devices: int, cfg: MoEConfig
) -> tuple[PlacementLayer, dict[str, float]]:
  """One placement per micro-batch, planned from its routes; returns the arrays stacked
  [m, layers, ...] and the mean imbalance before (static) and after planning."""
  placements, before, after = [], [], []
  for routes_btlk in routes_mbtlk:
    loads_lx = expert_loads(routes_btlk, num_experts)
    static = loads_lx.reshape(loads_lx.shape[0], num_devices, -1).sum(-1)
    before.append(imbalance(static).mean())
    p = plan_placement(loads_lx, num_devices, cfg.redundant_slots, cfg.placement)
    after.append(float(np.mean(p.imbalance_l)))
    placements.append(placement_arrays(p, max_replicas=num_devices))
  stacked = PlacementLayer(*(np.stack(field) for field in zip(*placements, strict=True)))
  return stacked, {
    "moe_imbalance_static": float(np.mean(before)),
    "moe_imbalance_planned": float(np.mean(after)),
  }
