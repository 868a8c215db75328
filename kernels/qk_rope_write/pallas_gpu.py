"""`qk_rope_write` as one Pallas GPU kernel (Triton lowering).

Left to XLA, the step between a decode step's q/k/v projection and its paged attention is five
GPU kernels per layer (compiled for an H100, Qwen3-0.6B at 64 rows: the q norm, the k norm,
q's rotary embedding, and two scatters, k's carrying its rotary embedding), each moving a few
hundred KiB; a decode step's kernels averaged about 4 us each on an H200 (1.78 ms over about
440), so their launches, not their bytes, cost. This kernel does all of it in one launch.

Grid `(n, h + k)`: one program per (token, head). Programs `j < h` norm and rotate query head
j and write it out; programs `j >= h` norm and rotate kv head `j - h`'s key and write it and
the value into the pools, in place (the pools are aliased to the outputs), at the token's row,
or nowhere if the row is outside the pool. Each program handles e numbers, as two halves of
e / 2 (Triton cannot slice a register tensor, and the rotation pairs element i with i + e / 2).
A program does not write the blocks of the outputs it does not own (a kv program's q block,
a q program's pools); on a GPU nothing is written back implicitly, and in interpret mode the
block it was given, unchanged, is.

Shapes: n tokens, h query heads, k kv heads, e head dim, f = e // 2, p * z rows of a pool.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The Triton compiler-params class was `TritonCompilerParams` before it became
# `CompilerParams`; take whichever this jax has.
_TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams


def _normed_halves(x_ref, scale_ref, f: int, eps: float, plus_one: bool):
  """Head `x_ref` ([e]) as two float32 halves, RMS-normed with `scale_ref` when there is one,
  in `reference.rms_norm`'s order: rounded to x's dtype before the scale, or with `plus_one`
  (Gemma) multiplied by `1 + scale` in float32."""
  dtype = x_ref.dtype
  x1 = x_ref[pl.ds(0, f)].astype(jnp.float32)
  x2 = x_ref[pl.ds(f, f)].astype(jnp.float32)
  if scale_ref is None:
    return x1, x2
  inv = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / (2 * f) + eps)

  def scaled(x, lo):
    if plus_one:  # rounded once, after the float32 product, as `rms_norm` writes it
      normed = x * inv * (1.0 + scale_ref[pl.ds(lo, f)].astype(jnp.float32))
      return normed.astype(dtype).astype(jnp.float32)
    # Llama's order: the product with the scale is not rounded to x's dtype before the
    # rotation. `rms_norm` writes it as a product in x's dtype, which XLA computes in float32
    # without rounding when it fuses `rms_norm` into `apply_rope` (excess precision, its
    # default), and this kernel stands in for that fusion.
    s = scale_ref[pl.ds(lo, f)].astype(dtype).astype(jnp.float32)
    return (x * inv).astype(dtype).astype(jnp.float32) * s

  return scaled(x1, 0), scaled(x2, f)


def _kernel(*refs, h: int, f: int, eps: float, normed: bool, plus_one: bool):
  rows_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, *rest = refs
  if normed:
    q_scale_ref, k_scale_ref, _, _, q_out_ref, k_pages_ref, v_pages_ref = rest
  else:
    q_scale_ref = k_scale_ref = None
    _, _, q_out_ref, k_pages_ref, v_pages_ref = rest
  cos, sin = cos_ref[...], sin_ref[...]
  j = pl.program_id(1)

  def rotated(x_ref, scale_ref):
    x1, x2 = _normed_halves(x_ref, scale_ref, f, eps, plus_one)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin

  @pl.when(j < h)
  def _query_head():
    r1, r2 = rotated(q_ref, q_scale_ref)
    q_out_ref[pl.ds(0, f)] = r1.astype(q_out_ref.dtype)
    q_out_ref[pl.ds(f, f)] = r2.astype(q_out_ref.dtype)

  row = rows_ref[0]

  @pl.when((j >= h) & (row >= 0) & (row < k_pages_ref.shape[0]))
  def _kv_head():
    r1, r2 = rotated(k_ref, k_scale_ref)
    dtype = k_pages_ref.dtype
    k_pages_ref[row, pl.ds(0, f)] = r1.astype(k_ref.dtype).astype(dtype)
    k_pages_ref[row, pl.ds(f, f)] = r2.astype(k_ref.dtype).astype(dtype)
    v_pages_ref[row, pl.ds(0, 2 * f)] = v_ref[...].astype(v_pages_ref.dtype)


def qk_rope_write(
  q_nhe, k_nke, v_nke, cos_nf, sin_nf, rows_n, k_pages_kpze, v_pages_kpze, *, q_scale_e,
  k_scale_e, eps, plus_one: bool = False, interpret: Any = False,
):  # fmt: skip
  """`reference.qk_rope_write` in one kernel; `rows_n` int32. `interpret` goes to
  `pl.pallas_call` as is."""
  n, h, e = q_nhe.shape
  k, p, z, _ = k_pages_kpze.shape
  f = e // 2
  normed = q_scale_e is not None

  def kv_head(j):
    return jnp.clip(j - h, 0, k - 1)

  head_spec = pl.BlockSpec((None, None, e), lambda i, j: (i, jnp.minimum(j, h - 1), 0))
  # q, k and v as one array: XLA computes them with one GEMM (it merges the three projections)
  # and slices its output; three inputs made three slice kernels, this concatenation one. That
  # kernel (2.8 us a layer at 64 rows on an H100) is also where XLA sums the GEMM's split-K
  # parts (compiled without a device: four float32 parts of [64, 4096]), so it is not a bare
  # copy. Writing the projection as one einsum over concatenated weights made it worse (the
  # weights were concatenated at every step; `bench.py kernels`).
  qkv = jnp.concatenate([q_nhe, k_nke.astype(q_nhe.dtype), v_nke.astype(q_nhe.dtype)], axis=1)
  k_spec = pl.BlockSpec((None, None, e), lambda i, j: (i, h + kv_head(j), 0))
  v_spec = pl.BlockSpec((None, None, e), lambda i, j: (i, h + k + kv_head(j), 0))
  angle_spec = pl.BlockSpec((None, f), lambda i, j: (i, 0))
  pool_spec = pl.BlockSpec((None, p * z, e), lambda i, j: (kv_head(j), 0, 0))
  scale_specs = [pl.BlockSpec((e,), lambda i, j: (0,))] * 2 if normed else []
  scales = [q_scale_e, k_scale_e] if normed else []
  pools = [k_pages_kpze.reshape(k, p * z, e), v_pages_kpze.reshape(k, p * z, e)]
  first_pool = 6 + len(scales)
  q_out, k_flat, v_flat = pl.pallas_call(
    lambda *refs: _kernel(*refs, h=h, f=f, eps=eps, normed=normed, plus_one=plus_one),
    grid=(n, h + k),
    in_specs=[
      pl.BlockSpec((1,), lambda i, j: (i,)),
      angle_spec,
      angle_spec,
      head_spec,
      k_spec,
      v_spec,
      *scale_specs,
      pool_spec,
      pool_spec,
    ],
    out_specs=[head_spec, pool_spec, pool_spec],
    out_shape=[
      jax.ShapeDtypeStruct(q_nhe.shape, q_nhe.dtype),
      jax.ShapeDtypeStruct(pools[0].shape, pools[0].dtype),
      jax.ShapeDtypeStruct(pools[1].shape, pools[1].dtype),
    ],
    input_output_aliases={first_pool: 1, first_pool + 1: 2},
    compiler_params=_TritonParams(num_warps=1, num_stages=1),
    interpret=interpret,
    name="qk_rope_write_gpu",
  )(rows_n, cos_nf, sin_nf, qkv, qkv, qkv, *scales, *pools)
  return q_out, k_flat.reshape(k_pages_kpze.shape), v_flat.reshape(v_pages_kpze.shape)
