"""Argument checks of the expert-parallel MoE layer (`moe_expert_parallel`): shapes, mesh,
top-k, token axes and recorded routes, each failing with a message that says what to change.

Glossary: t tokens, d model width, f expert mlp width, x experts, k top-k.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

EXPERT_AXIS = "expert"
TOKEN_AXES = ("data", "fsdp", "expert")  # split the tokens by default, those of size > 1


def check_shapes(x_td, router_dx, w_gate_xdf, w_up_xdf, w_down_xfd) -> int:
  if x_td.ndim != 2:
    raise ValueError(
      f"x_td must be [tokens, d], got shape {x_td.shape}; flatten [batch, length, d] first."
    )
  d = x_td.shape[1]
  if router_dx.ndim != 2 or router_dx.shape[0] != d:
    raise ValueError(f"router_dx must be [d={d}, experts], got shape {router_dx.shape}.")
  x = router_dx.shape[1]
  if w_gate_xdf.ndim != 3 or w_gate_xdf.shape[:2] != (x, d):
    raise ValueError(f"w_gate_xdf must be [x={x}, d={d}, f], got shape {w_gate_xdf.shape}.")
  f = w_gate_xdf.shape[2]
  if w_up_xdf.shape != (x, d, f):
    raise ValueError(f"w_up_xdf must be [x={x}, d={d}, f={f}], got shape {w_up_xdf.shape}.")
  if w_down_xfd.shape != (x, f, d):
    raise ValueError(f"w_down_xfd must be [x={x}, f={f}, d={d}], got shape {w_down_xfd.shape}.")
  for name, w in (("x_td", x_td), ("w_gate_xdf", w_gate_xdf), ("w_down_xfd", w_down_xfd)):
    if not jnp.issubdtype(w.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {w.dtype}.")
  return x


def check_mesh(mesh: Mesh, num_experts: int) -> int:
  if EXPERT_AXIS not in mesh.axis_names:
    raise ValueError(
      f"The mesh has axes {tuple(mesh.axis_names)} but no {EXPERT_AXIS!r} axis to spread the "
      "experts over; build it with jaxrl.sharding.make_mesh (it has every axis, size 1 if "
      "unused)."
    )
  e = mesh.shape[EXPERT_AXIS]
  if num_experts % e:
    divisors = [size for size in range(1, num_experts + 1) if num_experts % size == 0]
    raise ValueError(
      f"The expert axis has {e} devices, which does not divide the {num_experts} experts; use "
      f"an expert axis size among {divisors}."
    )
  return e


def check_top_k(top_k, num_experts: int) -> int:
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
    raise ValueError(f"top_k must be an int, got {top_k!r}.")
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k={top_k} must be in [1, {num_experts}] (the number of experts).")
  return int(top_k)


def token_axes_of(mesh: Mesh, token_axes) -> tuple[str, ...]:
  """The axes that split the tokens: `token_axes` (default: those of TOKEN_AXES of size > 1), with
  "expert" appended when missing, since each device of the expert axis routes its own tokens."""
  names = tuple(mesh.axis_names)
  if token_axes is None:
    token_axes = tuple(a for a in names if a in TOKEN_AXES and mesh.shape[a] > 1)
  elif isinstance(token_axes, str):
    token_axes = (token_axes,)
  token_axes = tuple(token_axes)
  unknown = [a for a in token_axes if a not in names]
  if unknown or len(set(token_axes)) != len(token_axes):
    raise ValueError(
      f"token_axes={token_axes} must name distinct axes of the mesh {names}; unknown: {unknown}."
    )
  return token_axes if EXPERT_AXIS in token_axes else (*token_axes, EXPERT_AXIS)


def tokens_per_device(num_tokens: int, mesh: Mesh, token_axes: tuple[str, ...]) -> int:
  shards = math.prod(mesh.shape[a] for a in token_axes)
  if num_tokens % shards or num_tokens == 0:
    sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in token_axes)
    raise ValueError(
      f"{num_tokens} tokens do not split evenly over the {shards} devices of token_axes "
      f"({sizes}); make the token count (batch * length) a positive multiple of {shards}, or "
      "pass token_axes naming fewer axes (the expert axis always splits the tokens)."
    )
  return num_tokens // shards


def check_routes(routes_tk, num_tokens: int, top_k: int, num_experts: int):
  if routes_tk.shape != (num_tokens, top_k):
    raise ValueError(f"routes_tk must be [tokens={num_tokens}, k={top_k}], got {routes_tk.shape}.")
  if not jnp.issubdtype(routes_tk.dtype, jnp.integer):
    raise ValueError(f"routes_tk must hold integer expert ids, got dtype {routes_tk.dtype}.")
  if not isinstance(routes_tk, jax.core.Tracer):
    routes = np.asarray(routes_tk)
    if routes.size and (routes.min() < 0 or routes.max() >= num_experts):
      raise ValueError(f"routes_tk must hold expert ids in [0, {num_experts}).")
    sorted_tk = np.sort(routes, axis=1)
    if (sorted_tk[:, 1:] == sorted_tk[:, :-1]).any():
      raise ValueError("routes_tk names an expert twice for one token; a token's k must differ.")
  return jnp.asarray(routes_tk, jnp.int32)


class ExpertBiases(NamedTuple):
  """gpt-oss's MoE biases (`moe_expert_parallel(biases=...)`): on the router's logits ([x])
  and on each expert's gate and up ([x, f]) and down ([x, d]) projections."""

  router_x: jax.Array
  gate_xf: jax.Array
  up_xf: jax.Array
  down_xd: jax.Array


def check_biases(biases: ExpertBiases, x: int, f: int, d: int) -> None:
  want = ExpertBiases((x,), (x, f), (x, f), (x, d))
  for name, b, shape in zip(ExpertBiases._fields, biases, want, strict=True):
    if b.shape != shape:
      raise ValueError(f"biases.{name} must be {list(shape)}, got {list(b.shape)}.")
