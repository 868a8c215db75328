"""Mixture-of-Experts MLP with a plain reference dispatch, and the shared parameter helper.

The reference dispatch runs every expert on every token and weights the outputs by the router
(zero for experts not in a token's top-k). It is the single-device definition that expert
parallelism is checked against; it is not meant to be fast. On a mesh with an expert axis the
layer runs expert-parallel instead (`ExpertParallel`, `jaxrl.sharding.moe_expert_parallel`),
and with `ModelConfig.moe_dispatch="grouped"` it runs that path on a one-device expert axis
too (grouped matmuls over each expert's rows, no exchange).
Either path can replay recorded routes (`MoEInputs.routes_btlk`) instead of routing.

Glossary: b batch, t positions, d model width, x experts, f expert mlp width, k top-k.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.model.config import ModelConfig
from jaxrl.sharding.expert import (
  ExpertBiases,
  ExpertParallelConfig,
  PlacementLayer,
  moe_expert_parallel,
)
from jaxrl.sharding.expert_checks import TOKEN_AXES


def param(rngs: nnx.Rngs, shape, logical_axes, fan_in: int, dtype) -> nnx.Param:
  """A parameter drawn from N(0, 1/fan_in), annotated with its logical axes."""
  value = jax.random.normal(rngs.params(), shape, dtype) * (fan_in**-0.5)
  return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


def _silu_glu(gate, up):
  return jax.nn.silu(gate) * up


def _gelu_tanh_glu(gate, up):
  return jax.nn.gelu(gate, approximate=True) * up


def _clamped_swiglu(gate, up, *, alpha: float, limit: float):
  """gpt-oss's gated unit: the gate clipped above and the up projection both ways at `limit`,
  the gate's SiLU-like `g * sigmoid(alpha * g)` times `up + 1`."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def gated_unit(cfg: ModelConfig) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """`(gate, up) -> hidden` of a gated MLP or expert with `cfg.mlp_activation` (SwiGLU,
  Gemma's GeGLU, gpt-oss's clamped SwiGLU)."""
  if cfg.mlp_activation == "clamped_swiglu":
    return functools.partial(_clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
  return {"silu": _silu_glu, "gelu_tanh": _gelu_tanh_glu}[cfg.mlp_activation]


def route(
  router_logits_btx: jax.Array, top_k: int, norm_topk_prob: bool = True
) -> tuple[jax.Array, jax.Array]:
  """Top-k softmax routing: returns (weights_btk in float32, expert ids_btk).

  The weights are the router's softmax probabilities of the k chosen experts, renormalised to
  sum to one when `norm_topk_prob` (else left as they are, as some Qwen3-MoE checkpoints do).
  """
  probs = jax.nn.softmax(router_logits_btx.astype(jnp.float32), axis=-1)
  weights_btk, ids_btk = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    weights_btk = weights_btk / jnp.sum(weights_btk, axis=-1, keepdims=True)
  return weights_btk, ids_btk


def replay_route(
  router_logits_btx: jax.Array, ids_btk: jax.Array, norm_topk_prob: bool = True
) -> jax.Array:
  """Routing replay: the combine weights of given expert ids (the router's probabilities at
  them, renormalised over the k when `norm_topk_prob`), so that the router still gets
  gradients."""
  probs = jax.nn.softmax(router_logits_btx.astype(jnp.float32), axis=-1)
  weights_btk = jnp.take_along_axis(probs, ids_btk, axis=-1)
  if norm_topk_prob:
    weights_btk = weights_btk / jnp.sum(weights_btk, axis=-1, keepdims=True)
  return weights_btk


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """Run the MoE layers expert-parallel over `mesh`'s expert axis
  (`jaxrl.sharding.moe_expert_parallel`: grouped matmuls on each device's experts) instead of
  the reference dispatch. On an expert axis of one device this is the grouped dispatch of
  `ModelConfig.moe_dispatch`."""

  mesh: Mesh
  config: ExpertParallelConfig = ExpertParallelConfig()

  @classmethod
  def for_mesh(cls, cfg: ModelConfig, mesh: Mesh, config: ExpertParallelConfig | None = None):
    """The expert-parallel path for an MoE model on a mesh with an expert axis > 1, or with
    `cfg.moe_dispatch == "grouped"` on one without tensor parallelism; else None (the
    reference dispatch, which XLA shards like any other einsum)."""
    if not cfg.is_moe:
      return None
    spread = mesh.shape.get("expert", 1) > 1
    grouped = cfg.moe_dispatch == "grouped" and mesh.shape.get("tensor", 1) == 1
    if not (spread or grouped):
      return None
    config = config or ExpertParallelConfig()
    platform = mesh.devices.flat[0].platform
    if spread and config.exchange == "ragged_all_to_all" and platform == "cpu":
      # Caught here: XLA:CPU compiles it and fails at the first run ("UNIMPLEMENTED").
      raise ValueError(
        "train.moe.exchange='ragged_all_to_all' runs on TPU and GPU only: XLA:CPU cannot run "
        "a ragged all-to-all, and this mesh's expert axis spans CPU devices. Use "
        "exchange='all_to_all' (the same results)."
      )
    return cls(mesh, config)

  @property
  def spreads_experts(self) -> bool:
    """Whether the experts are spread over devices (an expert axis > 1): only then do
    placements, and the learner's placement planning, apply."""
    return self.mesh.shape["expert"] > 1


@dataclasses.dataclass(frozen=True)
class MoEInputs:
  """What one forward pass hands every MoE layer besides the activations.

  Attributes:
    expert_parallel: the expert-parallel path, or None for the reference dispatch.
    routes_btlk: int32 [b, t, layers, k] routing replay (the routes rollout recorded), or None
      to route with the router.
    placement: the expert placement of every layer (`placement_arrays(p)`, a leading layer
      dim), or None for the home layout; expert-parallel path only.
    valid_bt: bool [b, t], False at padding positions (right padding, a packed row's tail):
      with a capacity they take none from real tokens, and the counts leave them out; None:
      every position is a token.
  """

  expert_parallel: ExpertParallel | None = None
  routes_btlk: jax.Array | None = None
  placement: PlacementLayer | None = None
  valid_bt: jax.Array | None = None

  def layer(self, i: int) -> tuple[jax.Array | None, PlacementLayer | None]:
    routes = None if self.routes_btlk is None else self.routes_btlk[:, :, i]
    placement = None if self.placement is None else jax.tree.map(lambda a: a[i], self.placement)
    return routes, placement


class MoERouting(NamedTuple):
  """What one MoE layer routed: the expert ids each token chose (int32 `[b, t, k]`), and how
  many (token, k) assignments of real tokens it routed and dropped for capacity (int32
  scalars; none drop in dropless mode or in the reference dispatch)."""

  ids_btk: jax.Array
  routed: jax.Array
  dropped: jax.Array


class MoEMLP(nnx.Module):
  """Top-k softmax router over gated experts (`gated_unit`: SwiGLU, or gpt-oss's clamped
  SwiGLU), with `ModelConfig.moe_biases` a bias on the router's logits and on each expert's
  projections, and with `shared_expert_dim` a dense SwiGLU every token takes beside its routed
  experts (Qwen2-MoE: scaled by a sigmoid gate per token); returns (output, `MoERouting`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.top_k = cfg.experts_per_token
    self.norm_topk_prob = cfg.norm_topk_prob
    d, x, f, pd = cfg.d_model, cfg.num_experts, cfg.moe_mlp_dim, jnp.dtype(cfg.param_dtype)
    self.router_dx = param(rngs, (d, x), ("embed", None), d, pd)
    self.w_gate_xdf = param(rngs, (x, d, f), ("expert", "embed", "mlp"), d, pd)
    self.w_up_xdf = param(rngs, (x, d, f), ("expert", "embed", "mlp"), d, pd)
    self.w_down_xfd = param(rngs, (x, f, d), ("expert", "mlp", "embed"), f, pd)
    if cfg.moe_biases:
      self.router_b_x = nnx.Param(jnp.zeros((x,), pd), logical_axes=(None,))
      self.b_gate_xf = nnx.Param(jnp.zeros((x, f), pd), logical_axes=("expert", "mlp"))
      self.b_up_xf = nnx.Param(jnp.zeros((x, f), pd), logical_axes=("expert", "mlp"))
      self.b_down_xd = nnx.Param(jnp.zeros((x, d), pd), logical_axes=("expert", "embed"))
    if cfg.shared_expert_dim:
      s = cfg.shared_expert_dim
      self.w_shared_gate_ds = param(rngs, (d, s), ("embed", "mlp"), d, pd)
      self.w_shared_up_ds = param(rngs, (d, s), ("embed", "mlp"), d, pd)
      self.w_shared_down_sd = param(rngs, (s, d), ("mlp", "embed"), s, pd)
      if cfg.shared_expert_gate:
        self.shared_gate_d = param(rngs, (d,), ("embed",), d, pd)

  def _shared_expert(self, x_btd):
    """The shared expert's output (gated per token where `shared_expert_gate`)."""
    dt = x_btd.dtype
    gate = jnp.einsum("btd,ds->bts", x_btd, self.w_shared_gate_ds.get_value().astype(dt))
    up = jnp.einsum("btd,ds->bts", x_btd, self.w_shared_up_ds.get_value().astype(dt))
    out_btd = jnp.einsum(
      "bts,sd->btd", gated_unit(self.cfg)(gate, up), self.w_shared_down_sd.get_value().astype(dt)
    )
    if self.cfg.shared_expert_gate:
      logit_bt1 = jnp.einsum("btd,d->bt", x_btd, self.shared_gate_d.get_value().astype(dt))[
        ..., None
      ]
      out_btd = jax.nn.sigmoid(logit_bt1) * out_btd
    return out_btd

  def _biases(self, dt) -> ExpertBiases | None:
    if not self.cfg.moe_biases:
      return None
    values = (self.router_b_x, self.b_gate_xf, self.b_up_xf, self.b_down_xd)
    return ExpertBiases(*(v.get_value().astype(dt) for v in values))

  def __call__(self, x_btd, moe: MoEInputs | None = None, layer: int = 0):
    out_btd, routing = self._routed(x_btd, moe or MoEInputs(), layer)
    if self.cfg.shared_expert_dim:
      out_btd = out_btd + self._shared_expert(x_btd)
    return out_btd, routing

  def _routed(self, x_btd, moe: MoEInputs, layer: int):
    routes_btk, placement = moe.layer(layer)
    if moe.expert_parallel is not None:
      return self._expert_parallel(x_btd, moe.expert_parallel, routes_btk, placement, moe.valid_bt)
    if placement is not None:
      raise ValueError(
        "An expert placement needs the expert-parallel path (a mesh with an "
        "expert axis > 1); the reference dispatch has no devices to place on."
      )
    dt = x_btd.dtype
    biases = self._biases(dt)
    logits_btx = jnp.einsum("btd,dx->btx", x_btd, self.router_dx.get_value().astype(dt))
    if biases is not None:
      logits_btx = logits_btx + biases.router_x
    if routes_btk is None:
      weights_btk, ids_btk = route(logits_btx, self.top_k, self.norm_topk_prob)
    else:
      ids_btk = routes_btk.astype(jnp.int32)
      weights_btk = replay_route(logits_btx, ids_btk, self.norm_topk_prob)
    num_experts = logits_btx.shape[-1]
    # Dense combine weights: zero for experts outside a token's top-k.
    combine_btx = jnp.sum(jax.nn.one_hot(ids_btk, num_experts) * weights_btk[..., None], axis=-2)
    gate = jnp.einsum("btd,xdf->btxf", x_btd, self.w_gate_xdf.get_value().astype(dt))
    up = jnp.einsum("btd,xdf->btxf", x_btd, self.w_up_xdf.get_value().astype(dt))
    if biases is not None:
      gate, up = gate + biases.gate_xf, up + biases.up_xf
    out_btxd = jnp.einsum(
      "btxf,xfd->btxd", gated_unit(self.cfg)(gate, up), self.w_down_xfd.get_value().astype(dt)
    )
    if biases is not None:
      out_btxd = out_btxd + biases.down_xd
    out_btd = jnp.einsum("btxd,btx->btd", out_btxd, combine_btx.astype(dt))
    routed = ids_btk.size if moe.valid_bt is None else jnp.sum(moe.valid_bt) * self.top_k
    return out_btd, MoERouting(ids_btk, jnp.asarray(routed, jnp.int32), jnp.zeros((), jnp.int32))

  def _expert_parallel(self, x_btd, ep: ExpertParallel, routes_btk, placement, valid_bt):
    b, t, d = x_btd.shape
    dt = x_btd.dtype
    x_td = x_btd.reshape(b * t, d)
    routes_tk = None if routes_btk is None else routes_btk.reshape(b * t, -1).astype(jnp.int32)
    valid_t = None if valid_bt is None else valid_bt.reshape(b * t).astype(bool)
    # The tokens split evenly over the devices that share them: pad to a whole number each.
    # Padding rows are marked invalid: they take no expert capacity from real tokens.
    share = math.prod(ep.mesh.shape[a] for a in TOKEN_AXES if ep.mesh.shape.get(a, 1) > 1)
    pad = -(b * t) % share
    if pad:
      x_td = jnp.pad(x_td, ((0, pad), (0, 0)))
      if routes_tk is not None:
        spread = (jnp.arange(pad)[:, None] + jnp.arange(routes_tk.shape[1])) % self.num_experts
        routes_tk = jnp.concatenate([routes_tk, spread.astype(jnp.int32)])
      valid_t = jnp.arange(b * t + pad) < b * t if valid_t is None else jnp.pad(valid_t, (0, pad))
    out_td, ids_tk, stats = moe_expert_parallel(
      x_td,
      self.router_dx.get_value().astype(dt),
      self.w_gate_xdf.get_value().astype(dt),
      self.w_up_xdf.get_value().astype(dt),
      self.w_down_xfd.get_value().astype(dt),
      mesh=ep.mesh,
      top_k=self.top_k,
      norm_topk_prob=self.norm_topk_prob,
      config=ep.config,
      placement_layer=placement,
      routes_tk=routes_tk,
      valid_t=valid_t,
      biases=self._biases(dt),
      gated=gated_unit(self.cfg),
    )
    routing = MoERouting(ids_tk[: b * t].reshape(b, t, -1), stats["routed"], stats["dropped"])
    return out_td[: b * t].reshape(b, t, d), routing

  @property
  def num_experts(self) -> int:
    return self.router_dx.get_value().shape[1]
