"""Expert-parallel MoE layer: route, exchange tokens over the `expert` mesh axis, grouped matmuls
on each device's experts, exchange back, combine with the router weights.

Glossary: t tokens, n tokens of one device, d model width, f expert mlp width, x experts, k top-k,
e devices on the expert axis, s slots of a device, r replicas of an expert, a (token, k)
assignments of one device, m rows a device sends or receives (e * capacity).

Each device of the expert axis holds `s` expert slots: the home layout (`x // e` experts, in
order) or, with a placement, the slots a balancer chose (`jaxrl.sharding.plan_placement`). A
device routes its own tokens, sends each (token, k) assignment to the device holding the slot
that serves it, runs SwiGLU on the rows it receives with `gmm` (rows sorted by slot), sends the
results back and sums them with the router's weights. The exchange buffers hold `capacity` rows
per (sender, receiver) pair: in dropless mode the most a sender can ever send one receiver, with
a capacity factor fewer, and the assignments past it are dropped (counted in the stats).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl.kernels.gmm import IMPLS as GMM_IMPLS
from jaxrl.kernels.gmm import gmm
from jaxrl.sharding.expert_checks import (
  EXPERT_AXIS,
  ExpertBiases,
  check_biases,
  check_mesh,
  check_routes,
  check_shapes,
  check_top_k,
  token_axes_of,
  tokens_per_device,
)

if TYPE_CHECKING:
  from jaxrl.sharding import Placement

EXCHANGES = ("all_to_all", "ragged_all_to_all")
"""Token exchanges of `ExpertParallelConfig.exchange`."""


# XLA:CPU has no ragged-all-to-all; looked up at call time so a test can stand in for it.
_ragged_all_to_all = lax.ragged_all_to_all


@dataclasses.dataclass(frozen=True)
class ExpertParallelConfig:
  """How `moe_expert_parallel` dispatches tokens.

  Attributes:
    capacity_factor: None for dropless (buffers sized for the worst case). A number > 0 gives
      every (sender, receiver) pair of devices room for `ceil(capacity_factor * n * k / e)`
      assignments (1.0: exactly a receiver's even share; n: the sender's rows, not counting
      padding rows, `valid_t`) and drops the rest. A sender fills
      each receiver's rows in order (k, token), every token's first choice before any second
      choice, so first choices are dropped last; which assignments drop is deterministic.
    gmm_impl: the `jaxrl.kernels.gmm` implementation for the expert matmuls.
    exchange: `"all_to_all"` sends the padded buffers (works everywhere, CPU included);
      `"ragged_all_to_all"` sends only the filled rows (TPU and GPU; XLA:CPU cannot run it).
      Both give the same results, dropped assignments included.
  """

  capacity_factor: float | None = None
  gmm_impl: str = "auto"
  exchange: str = "all_to_all"

  def __post_init__(self):
    cf = self.capacity_factor
    if cf is not None and (
      isinstance(cf, bool) or not isinstance(cf, numbers.Real) or not 0 < cf < math.inf
    ):
      raise ValueError(
        f"ExpertParallelConfig.capacity_factor must be None (dropless) or a finite number > 0, "
        f"got {cf!r}."
      )
    if self.gmm_impl not in GMM_IMPLS:
      raise ValueError(
        f"ExpertParallelConfig.gmm_impl must be one of {GMM_IMPLS}, got {self.gmm_impl!r}."
      )
    if self.exchange not in EXCHANGES:
      raise ValueError(
        f"ExpertParallelConfig.exchange must be one of {EXCHANGES}, got {self.exchange!r}."
      )


class PlacementLayer(NamedTuple):
  """One layer of a `Placement` as arrays, a pytree that jit, scan and shard_map take as data.

  With a leading layer dim on every field (`placement_arrays(p)`), `lax.scan` over the layers
  hands the layer function one `PlacementLayer` per step.

  Attributes:
    slot_expert_ds: int32 [e, s], the expert held in each slot of each device, -1 empty.
    replica_slot_xr: int32 [x, r], flat slot (`device * s + slot`) of each replica, -1 padding.
    replica_share_xr: float32 [x, r], each replica's fraction of its expert's assignments.
  """

  slot_expert_ds: jax.Array
  replica_slot_xr: jax.Array
  replica_share_xr: jax.Array


def placement_arrays(
  placement: Placement, layer: int | None = None, *, max_replicas: int | None = None
) -> PlacementLayer:
  """A `Placement` (or one layer of it) as jnp arrays for `moe_expert_parallel`.

  Args:
    placement: the placement, from `plan_placement` or `home_placement`.
    layer: the layer to take; None keeps all layers (a leading [layers] dim, for `lax.scan`).
    max_replicas: pad the replica dim to this many (slot -1, share 0), so that placements with
      different replica counts have one shape and share one compiled function; the number of
      devices always suffices (replicas sit on distinct devices). None: the placement's own.

  Returns:
    The placement's arrays as a `PlacementLayer`.
  """
  slot_expert = np.asarray(placement.slot_expert_lds)
  replica_slot = np.asarray(placement.replica_slot_lxr)
  replica_share = np.asarray(placement.replica_share_lxr)
  have = replica_slot.shape[-1]
  if max_replicas is not None:
    if isinstance(max_replicas, bool) or not isinstance(max_replicas, numbers.Integral):
      raise ValueError(f"max_replicas must be an int or None, got {max_replicas!r}.")
    if max_replicas < have:
      raise ValueError(
        f"max_replicas={max_replicas} is fewer than the placement's {have} replicas per expert; "
        f"pass at least {have} (its number of devices, {slot_expert.shape[1]}, always fits)."
      )
    pad = [(0, 0)] * (replica_slot.ndim - 1) + [(0, max_replicas - have)]
    replica_slot = np.pad(replica_slot, pad, constant_values=-1)
    replica_share = np.pad(replica_share, pad, constant_values=0)
  if layer is not None:
    num_layers = slot_expert.shape[0]
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
      raise ValueError(f"layer must be an int or None, got {layer!r}.")
    if not -num_layers <= layer < num_layers:
      raise ValueError(f"layer={layer} is out of range for a placement of {num_layers} layers.")
    slot_expert, replica_slot, replica_share = (
      a[layer] for a in (slot_expert, replica_slot, replica_share)
    )
  return PlacementLayer(
    jnp.asarray(slot_expert, jnp.int32),
    jnp.asarray(replica_slot, jnp.int32),
    jnp.asarray(replica_share, jnp.float32),
  )


def _swiglu(gate, up):
  return jax.nn.silu(gate) * up


class _Static(NamedTuple):
  """Sizes and options fixed at trace time."""

  num_experts: int
  num_devices: int  # e, the expert axis
  slots: int  # s, per device
  top_k: int
  norm_topk_prob: bool
  tokens: int  # n, per device
  capacity: int  # rows per (sender, receiver) pair
  capacity_factor: float | None
  token_axes: tuple[str, ...]  # the axes that split the tokens, expert included
  gmm_impl: str
  exchange: str
  gated: Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden


def moe_expert_parallel(
  x_td: jax.Array,
  router_dx: jax.Array,
  w_gate_xdf: jax.Array,
  w_up_xdf: jax.Array,
  w_down_xfd: jax.Array,
  *,
  mesh: Mesh,
  top_k: int,
  norm_topk_prob: bool = True,
  config: ExpertParallelConfig = ExpertParallelConfig(),
  placement_layer: PlacementLayer | None = None,
  routes_tk: jax.Array | None = None,
  token_axes: Sequence[str] | None = None,
  valid_t: jax.Array | None = None,
  biases: ExpertBiases | None = None,
  gated: Callable[[jax.Array, jax.Array], jax.Array] = _swiglu,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """Top-k softmax-routed SwiGLU experts, expert-parallel over the mesh's `expert` axis.

  The same function as `jaxrl.model.moe.MoEMLP` (router weights renormalised over the top-k,
  `out = sum_k w_k * (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]`), with the experts spread
  over the devices of the expert axis. Call it inside or outside jit; it is differentiable in
  `x_td`, the router and the three expert weights.

  Sharding: tokens are split over `token_axes`. Expert weights enter the shard_map as
  `P("expert", None, None)`: any fsdp or tensor sharding of their other dims is all-gathered by
  JAX on the way in (and the gradients reduce-scattered back), so a tensor axis of size > 1 does
  no tensor parallelism here; put "tensor" in `token_axes` to split the tokens over it instead
  of computing them twice. With a placement, the slot weights are gathered from the expert
  weights (`w[slot_expert]`, zeros in empty slots) before the shard_map and the gradients flow
  back through that gather to the owning experts. XLA does it by all-gathering the three
  expert weight arrays over the expert axis (and all-reducing their gradients): a per-call
  cost that the home layout (no placement) does not pay.

  Args:
    x_td: [t, d] tokens (the caller flattens [batch, length, d]).
    router_dx: [d, x] router weights.
    w_gate_xdf: [x, d, f] gate projections.
    w_up_xdf: [x, d, f] up projections.
    w_down_xfd: [x, f, d] down projections.
    mesh: a mesh with an "expert" axis whose size divides x.
    top_k: experts per token, in [1, x].
    norm_topk_prob: renormalise the k combine weights to sum to one (else raw probabilities).
    config: capacity, gmm implementation and exchange.
    placement_layer: one layer of a placement (`placement_arrays(p, layer)`) for
      e = the expert axis size; None for the home layout (x // e experts per device, in order).
      Its values are data: one compiled function serves every placement of the same shapes.
    routes_tk: int32 [t, k] routing replay: these expert ids (distinct per token, in [0, x))
      instead of the router's top-k. The combine weights are the router's probabilities at
      these ids, renormalised over the k, so the router still gets gradients. Values are
      checked only when concrete.
    token_axes: the mesh axes that split the tokens, in that order (the token dim is sharded
      `P(token_axes)`, one block per device, blocks in row-major order over these axes);
      default every axis of ("data", "fsdp", "expert") with size > 1. "expert" is appended
      when missing: each device of the expert axis routes its own tokens. Tokens sharded over
      ("data", "fsdp") enter by a local slice (no communication), and the output comes back
      sharded over the expert axis too.
    valid_t: bool [t], False for padding rows (a batch's padding, rows added to split the
      tokens evenly): they are sent nowhere, so they take no capacity from real tokens, their
      output is zero, and the stats leave them out. None: every row is a token.
    biases: gpt-oss's router and expert biases (placed and exchanged like the weights), or
      None for none.
    gated: `(gate, up) -> hidden` of an expert (`jaxrl.model.moe.gated_unit`; default SwiGLU,
      `silu(gate) * up`); it must map zeros to zeros (empty rows stay zero).

  Returns:
    `(out_td, ids_tk, stats)`: the layer output [t, d] in x's dtype, the expert ids used
    (int32 [t, k]), and int32 stats summed over all devices:
      dropped: (token, k) assignments dropped for capacity (0 in dropless mode).
      routed: (token, k) assignments of valid rows (what `dropped` is a part of).
      max_received: the most rows any device ran through its experts.
      expert_loads: [x] assignments per expert before drops (planner input, `plan_placement`).
      slot_loads: [e * s] assignments each slot served (`device * s + slot`), after drops.

  Raises:
    ValueError: a mesh without an "expert" axis, an expert axis that does not divide the
      experts, a placement for another number of devices or experts, top_k out of range,
      shapes that do not fit together, or a token count that `token_axes` does not divide.
  """
  if not isinstance(config, ExpertParallelConfig):
    raise ValueError(f"config must be an ExpertParallelConfig, got {type(config).__name__}.")
  num_experts = check_shapes(x_td, router_dx, w_gate_xdf, w_up_xdf, w_down_xfd)
  num_devices = check_mesh(mesh, num_experts)
  top_k = check_top_k(top_k, num_experts)
  token_axes = token_axes_of(mesh, token_axes)
  tokens = tokens_per_device(x_td.shape[0], mesh, token_axes)
  if placement_layer is None:
    slots = num_experts // num_devices
  else:
    slots = _check_placement(placement_layer, num_devices, num_experts)
  if routes_tk is not None:
    routes_tk = check_routes(routes_tk, x_td.shape[0], top_k, num_experts)
  if valid_t is not None and valid_t.shape != x_td.shape[:1]:
    raise ValueError(f"valid_t must be [t={x_td.shape[0]}] (one per row), got {valid_t.shape}.")
  static = _Static(
    num_experts=num_experts,
    num_devices=num_devices,
    slots=slots,
    top_k=top_k,
    norm_topk_prob=bool(norm_topk_prob),
    tokens=tokens,
    capacity=int(_capacity(tokens, top_k, num_devices, slots, config.capacity_factor)),
    capacity_factor=config.capacity_factor,
    token_axes=token_axes,
    gmm_impl=config.gmm_impl,
    exchange=config.exchange,
    gated=gated,
  )

  weights = (w_gate_xdf, w_up_xdf, w_down_xfd)
  expert_biases = None if biases is None else (biases.gate_xf, biases.up_xf, biases.down_xd)
  if biases is not None:
    check_biases(biases, num_experts, w_gate_xdf.shape[2], x_td.shape[1])
  extras = {}
  if placement_layer is not None:
    slot_expert_m = placement_layer.slot_expert_ds.reshape(-1).astype(jnp.int32)
    weights = tuple(_slot_weights(w, slot_expert_m) for w in weights)
    if expert_biases is not None:
      expert_biases = tuple(_slot_weights(b, slot_expert_m) for b in expert_biases)
    extras["placement"] = placement_layer
  if biases is not None:
    extras["router_x"], extras["expert_biases"] = biases.router_x, expert_biases
  if routes_tk is not None:
    extras["routes_tk"] = routes_tk
  if valid_t is not None:
    extras["valid_t"] = valid_t.astype(bool)
  token_spec = P(token_axes, None)
  extra_specs = {
    "placement": PlacementLayer(P(), P(), P()),
    "routes_tk": token_spec,
    "valid_t": P(token_axes),
    "router_x": P(),
    "expert_biases": (P(EXPERT_AXIS, None),) * 3,
  }
  shard = jax.shard_map(
    functools.partial(_device_layer, static),
    mesh=mesh,
    in_specs=(
      token_spec,
      P(),
      P(EXPERT_AXIS, None, None),
      P(EXPERT_AXIS, None, None),
      P(EXPERT_AXIS, None, None),
      {name: extra_specs[name] for name in extras},
    ),
    out_specs=(token_spec, token_spec, P()),
  )
  return shard(x_td, router_dx, *weights, extras)


def _slot_weights(w_x__: jax.Array, slot_expert_m: jax.Array) -> jax.Array:
  """The weights (or biases) of each slot (all devices' slots, flat), zeros for an empty
  slot."""
  held_m = slot_expert_m >= 0
  w_m__ = jnp.take(w_x__, jnp.where(held_m, slot_expert_m, 0), axis=0)
  held = held_m.reshape(-1, *(1,) * (w_x__.ndim - 1))
  return jnp.where(held, w_m__, jnp.zeros((), w_x__.dtype))


def _capacity(tokens, top_k: int, num_devices: int, slots: int, capacity_factor: float | None):
  """Rows one device may send another, for `tokens` rows of it (an int or a numpy array).

  A token's k experts are distinct and a device holds at most one replica of an expert, so a
  token sends one device at most min(k, s) rows: dropless needs `n * min(k, s)`.
  """
  tokens = np.asarray(tokens, np.int64)
  dropless = tokens * min(top_k, slots)
  if capacity_factor is None:
    return np.maximum(dropless, 1)
  share = np.ceil(capacity_factor * tokens * top_k / num_devices).astype(np.int64)
  return np.maximum(1, np.minimum(dropless, share))


def _device_layer(static: _Static, x_nd, router_dx, w_gate_sdf, w_up_sdf, w_down_sfd, extras):
  """The layer on one device, inside the shard_map."""
  k, n, e, c, s = static.top_k, static.tokens, static.num_devices, static.capacity, static.slots
  me = lax.axis_index(EXPERT_AXIS)
  routes_nk = extras.get("routes_tk")
  dtype = x_nd.dtype
  logits_nx = x_nd @ router_dx.astype(dtype)
  if "router_x" in extras:
    logits_nx = logits_nx + extras["router_x"].astype(dtype)
  weights_nk, ids_nk = _route(logits_nx, k, routes_nk, static.norm_topk_prob)

  # Assignments in order (k, token), so that a capacity drops first choices last.
  expert_a = ids_nk.T.reshape(-1)
  token_a = jnp.tile(jnp.arange(n, dtype=jnp.int32), k)
  valid_a = None if "valid_t" not in extras else jnp.tile(extras["valid_t"], k)
  if "placement" in extras:
    slot_a = _choose_replicas(expert_a, extras["placement"], static.num_experts, valid_a)
  else:
    slot_a = expert_a
  dest_a = slot_a // s
  if valid_a is None:
    pos_a, count_e = _rank_in_group(dest_a, e)
    cap, keep_a = c, pos_a < c
  else:  # padding rows rank in a group of their own (e), behind no real assignment
    pos_a, count_g = _rank_in_group(jnp.where(valid_a, dest_a, e), e + 1)
    count_e = count_g[:e]
    # The capacity of this device's real rows: the same rule, so padding changes no drop.
    by_rows = _capacity(np.arange(n + 1), k, e, s, static.capacity_factor).astype(np.int32)
    cap = jnp.asarray(by_rows)[jnp.sum(extras["valid_t"])]
    keep_a = valid_a & (pos_a < cap)
  row_a = jnp.where(keep_a, dest_a * c + pos_a, e * c)  # e * c: no row (a zero row on return)

  # Send buffers: row dest * c + pos holds the token of that assignment and its slot there.
  token_m = jnp.full((e * c,), n, jnp.int32).at[row_a].set(token_a, mode="drop")
  slot_m = jnp.full((e * c,), s, jnp.int32).at[row_a].set(slot_a % s, mode="drop")
  x_md = _with_zero_row(x_nd)[token_m]
  send_e = jnp.minimum(count_e, cap)

  exchange = _EXCHANGES[static.exchange]
  x_md, slot_m, back = exchange(x_md, slot_m, send_e, me, static)
  expert_biases = extras.get("expert_biases")
  y_md = _local_experts(x_md, slot_m, w_gate_sdf, w_up_sdf, w_down_sfd, static, expert_biases)
  y_md = back(y_md)

  y_knd = _with_zero_row(y_md)[row_a].reshape(k, n, -1)
  out_nd = jnp.einsum("knd,kn->nd", y_knd, weights_nk.T.astype(dtype))

  axes = static.token_axes
  routed_a = jnp.ones_like(keep_a) if valid_a is None else valid_a
  stats = {
    "dropped": lax.psum(jnp.sum(routed_a & ~keep_a, dtype=jnp.int32), axes),
    "routed": lax.psum(jnp.sum(routed_a, dtype=jnp.int32), axes),
    "max_received": lax.pmax(jnp.sum(slot_m < s, dtype=jnp.int32), axes),
    "expert_loads": lax.psum(_counts(expert_a, static.num_experts, valid_a), axes),
    "slot_loads": lax.psum(_counts(slot_a, e * s, keep_a), axes),
  }
  return out_nd, ids_nk, stats


def _route(logits_nx, top_k: int, routes_nk, norm_topk_prob: bool):
  """(combine weights_nk in float32, expert ids_nk): top-k softmax, or the replayed routes."""
  probs_nx = jax.nn.softmax(logits_nx.astype(jnp.float32), axis=-1)
  if routes_nk is None:
    weights_nk, ids_nk = lax.top_k(probs_nx, top_k)
  else:
    ids_nk = routes_nk
    weights_nk = jnp.take_along_axis(probs_nx, ids_nk, axis=-1)
  if norm_topk_prob:
    weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
  return weights_nk, ids_nk.astype(jnp.int32)


def _counts(index_a, length: int, where_a=None):
  ones_a = jnp.ones(index_a.shape, jnp.int32) if where_a is None else where_a.astype(jnp.int32)
  return jnp.zeros((length,), jnp.int32).at[index_a].add(ones_a, mode="drop")


def _rank_in_group(group_a, num_groups: int):
  """(rank of each element among those of its group, in order; the size of each group)."""
  order_a = jnp.argsort(group_a, stable=True)
  count_g = _counts(group_a, num_groups)
  start_g = jnp.cumsum(count_g) - count_g
  index_a = jnp.arange(group_a.shape[0], dtype=jnp.int32)
  rank_sorted_a = index_a - start_g[group_a[order_a]]
  return jnp.zeros_like(index_a).at[order_a].set(rank_sorted_a), count_g


def _choose_replicas(expert_a, placement: PlacementLayer, num_experts: int, valid_a=None):
  """The flat slot that serves each assignment.

  The assignments of expert x on this device, ranked in order, are cut by the cumulative
  shares: rank q goes to the first replica r with q < cumshare[r] * count. The shares are
  normalised by their float32 sum so the last replica's bound is exactly count; padding
  replicas (share 0) get empty ranges. Assignments of padding rows (`valid_a` False) are
  not counted (their slot is a valid one that they never use).
  """
  if valid_a is None:
    rank_a, count_x = _rank_in_group(expert_a, num_experts)
  else:
    rank_a, count_g = _rank_in_group(jnp.where(valid_a, expert_a, num_experts), num_experts + 1)
    count_x = count_g[:num_experts]
  cum_ar = jnp.cumsum(placement.replica_share_xr.astype(jnp.float32)[expert_a], axis=-1)
  total_a = cum_ar[:, -1:]
  cum_ar = cum_ar / jnp.where(total_a > 0, total_a, 1)
  bound_ar = cum_ar * count_x[expert_a][:, None].astype(jnp.float32)
  replica_a = jnp.sum(rank_a[:, None].astype(jnp.float32) >= bound_ar, axis=-1)
  slot_ar = placement.replica_slot_xr[expert_a]
  # A rounding slip in the cumsum must not pick a padding replica.
  replica_a = jnp.minimum(replica_a, jnp.sum(slot_ar >= 0, axis=-1) - 1)
  return jnp.take_along_axis(slot_ar, replica_a[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _with_zero_row(x_m_):
  return jnp.concatenate([x_m_, jnp.zeros((1, x_m_.shape[1]), x_m_.dtype)])


def _local_experts(x_md, slot_m, w_gate_sdf, w_up_sdf, w_down_sfd, static: _Static, biases=None):
  """The gated expert (`static.gated`) of each received row with the weights (and `biases`:
  gate, up, down) of its slot; zeros for empty rows."""
  s, dtype = static.slots, x_md.dtype
  # The rows vary over every token axis, the weights (P("expert")) only over the expert axis;
  # gmm's custom_vjp wants its weight gradient typed like its weights, and the transpose of
  # this cast is the psum of the weight gradients over the other token axes.
  other_axes = tuple(a for a in static.token_axes if a != EXPERT_AXIS)
  if other_axes:
    w_gate_sdf, w_up_sdf, w_down_sfd = lax.pcast(
      (w_gate_sdf, w_up_sdf, w_down_sfd), other_axes, to="varying"
    )
    if biases is not None:
      biases = lax.pcast(biases, other_axes, to="varying")
  order_m = jnp.argsort(slot_m, stable=True)  # empty rows (slot s) last: gmm gives them zeros
  sizes_s = _counts(slot_m, s)
  x_md = x_md[order_m]
  mm = functools.partial(gmm, group_sizes=sizes_s, impl=static.gmm_impl)
  gate_mf = mm(x_md, w_gate_sdf.astype(dtype))
  up_mf = mm(x_md, w_up_sdf.astype(dtype))
  if biases is not None:  # each row's slot's bias; none on empty rows, which stay zero
    slot_sorted_m = slot_m[order_m]
    held_m1 = (slot_sorted_m < s)[:, None]

    def row_bias(b_s_):
      return jnp.where(held_m1, b_s_.astype(dtype)[jnp.minimum(slot_sorted_m, s - 1)], 0)

    gate_mf, up_mf = gate_mf + row_bias(biases[0]), up_mf + row_bias(biases[1])
  y_md = mm(static.gated(gate_mf, up_mf), w_down_sfd.astype(dtype))
  if biases is not None:
    y_md = y_md + row_bias(biases[2])
  index_m = jnp.arange(slot_m.shape[0], dtype=jnp.int32)
  unsort_m = jnp.zeros_like(index_m).at[order_m].set(index_m)
  return y_md[unsort_m]


def _padded_exchange(x_md, slot_m, send_e, me, static: _Static):
  """all_to_all of the padded buffers; received row src * c + pos is sender src's row pos."""
  del send_e, me
  e, c = static.num_devices, static.capacity

  def swap(a_m_):
    a_ec_ = a_m_.reshape(e, c, *a_m_.shape[1:])
    return lax.all_to_all(a_ec_, EXPERT_AXIS, 0, 0, tiled=True).reshape(a_m_.shape)

  return swap(x_md), swap(slot_m), swap


def _ragged_exchange(x_md, slot_m, send_e, me, static: _Static):
  """ragged_all_to_all of the filled rows, packed by sender on the receiver.

  The slots travel padded (ints, c per pair): the receiver learns from them where each sender's
  rows land. The results go back into the sender's padded layout.
  """
  e, c, s = static.num_devices, static.capacity, static.slots
  slot_ec = lax.all_to_all(slot_m.reshape(e, c), EXPERT_AXIS, 0, 0, tiled=True)
  sizes_ee = lax.all_gather(send_e, EXPERT_AXIS)  # [sender, receiver]
  recv_e = sizes_ee[:, me]
  recv_offset_e = jnp.cumsum(recv_e) - recv_e
  # Where this device's rows land on each receiver: after those of the lower senders.
  out_offset_e = (jnp.cumsum(sizes_ee, axis=0) - sizes_ee)[me]
  send_offset_e = jnp.arange(e, dtype=jnp.int32) * c
  x_md = _ragged_all_to_all(
    x_md, jnp.zeros_like(x_md), send_offset_e, send_e, out_offset_e, recv_e, axis_name=EXPERT_AXIS
  )
  pos_c = jnp.arange(c, dtype=jnp.int32)
  row_ec = jnp.where(pos_c < recv_e[:, None], recv_offset_e[:, None] + pos_c, e * c)
  slot_m = (
    jnp.full((e * c,), s, jnp.int32).at[row_ec.reshape(-1)].set(slot_ec.reshape(-1), mode="drop")
  )

  def back(y_md):
    home_offset_e = jnp.full((e,), me * c, jnp.int32)  # back into the sender's padded rows
    return _ragged_all_to_all(
      y_md,
      jnp.zeros_like(y_md),
      recv_offset_e,
      recv_e,
      home_offset_e,
      send_e,
      axis_name=EXPERT_AXIS,
    )

  return x_md, slot_m, back


_EXCHANGES = {"all_to_all": _padded_exchange, "ragged_all_to_all": _ragged_exchange}


def _check_placement(placement: PlacementLayer, num_devices: int, num_experts: int) -> int:
  if not isinstance(placement, PlacementLayer):
    raise ValueError(
      f"placement_layer must be a PlacementLayer (placement_arrays(p, layer)), got "
      f"{type(placement).__name__}."
    )
  slot_expert_ds, replica_slot_xr, replica_share_xr = placement
  if slot_expert_ds.ndim != 2:
    raise ValueError(
      f"placement_layer.slot_expert_ds must be [devices, slots] (one layer), got shape "
      f"{slot_expert_ds.shape}; take a layer with placement_arrays(p, layer)."
    )
  devices, slots = slot_expert_ds.shape
  if devices != num_devices:
    raise ValueError(
      f"The placement is for {devices} devices but the mesh's expert axis has {num_devices}; "
      f"plan it with num_devices={num_devices}, or change the expert axis to {devices}."
    )
  if slots < num_experts // num_devices:
    raise ValueError(
      f"The placement has {slots} slots per device, fewer than the {num_experts // num_devices}"
      f" that {num_experts} experts over {num_devices} devices need."
    )
  if replica_slot_xr.ndim != 2 or replica_slot_xr.shape[0] != num_experts:
    raise ValueError(
      f"placement_layer.replica_slot_xr must be [experts={num_experts}, replicas], got shape "
      f"{replica_slot_xr.shape}: the placement is for another number of experts."
    )
  if replica_share_xr.shape != replica_slot_xr.shape:
    raise ValueError(
      f"placement_layer.replica_share_xr {replica_share_xr.shape} must have the shape of "
      f"replica_slot_xr {replica_slot_xr.shape}."
    )
  return slots
