"""The per-head norms, the rotary embedding and the paged write, in pure jnp: the model's own
definitions (`jaxrl.model` calls these), the CPU and TPU path of `qk_rope_write`, and the GPU
kernel's oracle.

Shapes: n tokens, h query heads, k kv heads, e head dim, f = e // 2 rotary frequencies, p pages,
z page size (slots per page).
"""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
  """RMS norm over the last axis in float32, rounded to `x`'s dtype before the scale (as
  transformers and vLLM do, so that bf16 logits match theirs; in float32 the order makes no
  difference). `plus_one` (Gemma): times `1 + scale` in float32, then rounded, as Gemma's
  transformers code does."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if plus_one:
    return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
  return x32.astype(x.dtype) * scale.astype(x.dtype)


def apply_rope(x_he: jax.Array, cos_f: jax.Array, sin_f: jax.Array) -> jax.Array:
  """Rotary embedding in the rotate-half layout of Llama/Qwen checkpoints: `x_he` is `[...,
  heads, e]`, `cos_f`/`sin_f` float32 `[..., e // 2]` of the same leading axes (one angle per
  frequency, shared by the heads)."""
  cos, sin = cos_f[..., None, :], sin_f[..., None, :]
  x1, x2 = jnp.split(x_he.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_he.dtype)


def write_rows(pages_kpze: jax.Array, new_nke: jax.Array, rows_n: jax.Array) -> jax.Array:
  """The pool with token i's keys (or values), all heads, at row `rows_n[i]` = page * z + slot;
  a row outside `[0, p * z)` writes nothing.

  One scatter of whole rows into the pool seen as `[k * p * z, e]` (a free reshape), not a
  scatter into its page and slot axes: for that one, XLA's TPU layout assignment picks a layout
  with those axes major, unlike the paged attention kernel's, and a decode loop then copies
  every layer's whole pool at every step (compiled for a v5e at Qwen3-0.6B shapes, 64 rows: 56
  copies of 128 MiB a step, 7.3 GiB of temporaries; 0.26 GiB this way; `launch/bench.py
  kernels`). GPUs compile both ways without copies."""
  k, p, z, e = pages_kpze.shape
  rows_n = rows_n.reshape(-1)
  # A token outside the pool gets row k * p * z, past every head's rows: dropped.
  rows_n = jnp.where((rows_n >= 0) & (rows_n < p * z), rows_n, k * p * z)
  rows_kn = jnp.arange(k)[:, None] * (p * z) + rows_n
  update_kne = jnp.moveaxis(new_nke.reshape(-1, k, e), 1, 0).astype(pages_kpze.dtype)
  flat = pages_kpze.reshape(k * p * z, e)
  flat = flat.at[rows_kn.reshape(-1)].set(update_kne.reshape(-1, e), mode="drop")
  return flat.reshape(pages_kpze.shape)


def qk_rope_write(
  q_nhe, k_nke, v_nke, cos_nf, sin_nf, rows_n, k_pages_kpze, v_pages_kpze, *, q_scale_e,
  k_scale_e, eps, plus_one=False,
):  # fmt: skip
  """q and k normed (when scales are given; `plus_one` as in `rms_norm`) and rotated; k and v
  written at `rows_n`. Returns (q, k pages, v pages)."""
  if q_scale_e is not None:
    q_nhe = rms_norm(q_nhe, q_scale_e, eps, plus_one)
    k_nke = rms_norm(k_nke, k_scale_e, eps, plus_one)
  q_nhe, k_nke = apply_rope(q_nhe, cos_nf, sin_nf), apply_rope(k_nke, cos_nf, sin_nf)
  return q_nhe, write_rows(k_pages_kpze, k_nke, rows_n), write_rows(v_pages_kpze, v_nke, rows_n)
