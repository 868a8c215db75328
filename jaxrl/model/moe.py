"""Mixture-of-Experts MLP with a plain reference dispatch, and the shared parameter helper.

The reference dispatch runs every expert on every token and weights the outputs by the router
(zero for experts not in a token's top-k). It is the single-device definition that expert
parallelism is checked against; it is not meant to be fast.

Glossary: b batch, t positions, d model width, x experts, f expert mlp width, k top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.model.config import ModelConfig


def param(rngs: nnx.Rngs, shape, logical_axes, fan_in: int, dtype) -> nnx.Param:
  """A parameter drawn from N(0, 1/fan_in), annotated with its logical axes."""
  value = jax.random.normal(rngs.params(), shape, dtype) * (fan_in**-0.5)
  return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


def route(router_logits_btx: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
  """Top-k softmax routing: returns (weights_btk renormalised over the top-k, expert ids_btk)."""
  probs = jax.nn.softmax(router_logits_btx.astype(jnp.float32), axis=-1)
  weights_btk, ids_btk = jax.lax.top_k(probs, top_k)
  weights_btk = weights_btk / jnp.sum(weights_btk, axis=-1, keepdims=True)
  return weights_btk, ids_btk


class MoEMLP(nnx.Module):
  """Top-k softmax router over SwiGLU experts; returns (output, expert ids_btk chosen)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.top_k = cfg.experts_per_token
    d, x, f, pd = cfg.d_model, cfg.num_experts, cfg.moe_mlp_dim, jnp.dtype(cfg.param_dtype)
    self.router_dx = param(rngs, (d, x), ("embed", None), d, pd)
    self.w_gate_xdf = param(rngs, (x, d, f), ("expert", "embed", "mlp"), d, pd)
    self.w_up_xdf = param(rngs, (x, d, f), ("expert", "embed", "mlp"), d, pd)
    self.w_down_xfd = param(rngs, (x, f, d), ("expert", "mlp", "embed"), f, pd)

  def __call__(self, x_btd):
    dt = x_btd.dtype
    logits_btx = jnp.einsum("btd,dx->btx", x_btd, self.router_dx.get_value().astype(dt))
    weights_btk, ids_btk = route(logits_btx, self.top_k)
    num_experts = logits_btx.shape[-1]
    # Dense combine weights: zero for experts outside a token's top-k.
    combine_btx = jnp.sum(jax.nn.one_hot(ids_btk, num_experts) * weights_btk[..., None], axis=-2)
    gate = jnp.einsum("btd,xdf->btxf", x_btd, self.w_gate_xdf.get_value().astype(dt))
    up = jnp.einsum("btd,xdf->btxf", x_btd, self.w_up_xdf.get_value().astype(dt))
    out_btxd = jnp.einsum(
      "btxf,xfd->btxd", jax.nn.silu(gate) * up, self.w_down_xfd.get_value().astype(dt)
    )
    return jnp.einsum("btxd,btx->btd", out_btxd, combine_btx.astype(dt)), ids_btk
