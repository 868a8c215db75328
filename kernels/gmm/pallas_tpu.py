"""Grouped matmuls as Pallas Mosaic TPU kernels.

The rows of lhs are cut into tiles of `tm` rows. A tile may hold rows of several groups, and a
group may cover several tiles, so the kernels walk a list of *visits*: one per (tile, group)
pair that share rows, in row order. The list is built in jnp from the group sizes and
scalar-prefetched into SMEM (tile, group and the group's row range per visit), where the
BlockSpec index maps read it to pick which lhs tile and which group's weights to copy in. Its
length is static, `m_tiles + g - 1` (the most visits any group sizes can need); the unused tail
repeats the last visit with no rows, so it costs grid steps but no copies.

`gmm`, grid `(n_tiles, visits, k_tiles)`: a visit accumulates `lhs_tile @ rhs[group]` over k in
a float32 VMEM scratch, then writes the rows of its group into the output tile. The visits of
one tile are consecutive, so the output block stays in VMEM across them and each group fills
in its rows; the first visit of a tile zeroes the rest. Tiles past the groups get one visit
with no rows, which writes their zeros.

`tgmm`, grid `(k_tiles, n_tiles, visits)`: a visit adds `lhs_tile.T @ grad_tile`, rows outside
its group masked to zero, to a float32 accumulator that lives through the visits of one group;
the last visit writes `out[group]`. Empty groups get one visit with no rows, which writes zeros.

Shapes: m rows, k contraction dim, n output columns, g groups, v visits; tm, tk, tn tiles.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl.kernels.common import output_like
from jaxrl.kernels.gmm.api import BlockSizes

_DEFAULT_TM = 128
# Lane-dim tiles: large enough to amortise the ~0.35 us per grid step, small enough that the
# double-buffered blocks stay a few MiB of VMEM.
_TARGET_LANE_TILE = 512
_LANES = 128


def _lane_tile(dim: int) -> int:
  """The whole dim when small, else the largest multiple of 128 <= 512 that divides it."""
  if dim <= _TARGET_LANE_TILE:
    return dim
  for tile in range(_TARGET_LANE_TILE, 0, -_LANES):
    if dim % tile == 0:
      return tile
  return _TARGET_LANE_TILE


def resolve_block_sizes(
  block_sizes: BlockSizes | None, *, m: int, k: int, n: int, dtypes
) -> BlockSizes:
  """Fills tm, tk, tn from the shapes, clips them to the dims, rejects tiles Mosaic cannot use."""
  bs = block_sizes or BlockSizes()
  for name in ("num_warps", "num_stages"):
    if getattr(bs, name) is not None:
      raise ValueError(
        f"BlockSizes.{name}={getattr(bs, name)} is a GPU setting; impl='pallas_tpu' takes only "
        "tm, tk and tn."
      )
  # A second-minor block dim is a multiple of the sublane tiling: 8 rows of 32 bits, packed
  # two (bf16) or four (8-bit) to a row.
  sublanes = 32 // min(jnp.dtype(d).itemsize for d in dtypes)
  tm = min(bs.tm or _DEFAULT_TM, m)
  tk = min(bs.tk or _lane_tile(k), k)
  tn = min(bs.tn or _lane_tile(n), n)
  if tm != m and tm % sublanes:
    raise ValueError(
      f"impl='pallas_tpu' needs BlockSizes.tm to be a multiple of {sublanes} (the TPU sublane "
      f"tiling for these dtypes) or at least m={m}, got {tm}."
    )
  for name, tile, dim in (("tk", tk, k), ("tn", tn, n)):
    if tile != dim and tile % _LANES:
      raise ValueError(
        f"impl='pallas_tpu' needs BlockSizes.{name} to be a multiple of {_LANES} (the TPU lane "
        f"count) or at least the dim it tiles ({dim}), got {tile}."
      )
  return BlockSizes(tm=tm, tk=tk, tn=tn)


def group_visits(group_sizes_g: jax.Array, *, m_tiles: int, tm: int, for_tgmm: bool):
  """The visit list: int32 `[m_tiles + g - 1]` tile, group, first row and end row per visit.

  `group_sizes_g` must be non-negative and sum to at most `m_tiles * tm`. For gmm every tile
  is visited (tiles past the groups once, with no rows); for tgmm every group is (empty ones
  once, with no rows). A visit with no rows has `lo >= hi`.
  """
  g = group_sizes_g.shape[0]
  num_visits = m_tiles + g - 1
  ends_g = jnp.cumsum(group_sizes_g)
  starts_g = ends_g - group_sizes_g
  has_rows_g = group_sizes_g > 0
  first_tile_g = jnp.minimum(starts_g // tm, m_tiles - 1)
  last_tile_g = (ends_g - 1) // tm
  span_g = jnp.where(has_rows_g, last_tile_g - first_tile_g + 1, 1 if for_tgmm else 0)
  # Owners of visits: the groups, and for gmm one more for the tiles past the groups.
  span_j, first_tile_j, lo_j, hi_j = span_g, first_tile_g, starts_g, ends_g
  if not for_tgmm:
    tail_first = (ends_g[-1] + tm - 1) // tm
    span_j = jnp.append(span_g, m_tiles - tail_first)
    first_tile_j = jnp.append(first_tile_g, tail_first)
    lo_j = jnp.append(starts_g, 0)
    hi_j = jnp.append(ends_g, 0)
  end_j = jnp.cumsum(span_j)
  v = jnp.arange(num_visits, dtype=jnp.int32)
  owner_v = jnp.minimum(jnp.searchsorted(end_j, v, side="right"), span_j.shape[0] - 1)
  used_v = v < end_j[-1]
  tile_v = first_tile_j[owner_v] + v - (end_j - span_j)[owner_v]
  tile_v = jnp.where(used_v, tile_v, tile_v[end_j[-1] - 1])
  lo_v = jnp.where(used_v, lo_j[owner_v], 0)
  hi_v = jnp.where(used_v, hi_j[owner_v], 0)
  if for_tgmm:
    # Unused visits stay on the last group (always the last one visited) and add nothing.
    group_v = jnp.where(used_v, owner_v, g - 1)
  else:
    # A visit without rows keeps the weights of the last visit with rows: no new copy.
    last_with_rows_v = jax.lax.cummax(jnp.where(hi_v > lo_v, v, -1))
    group_v = jnp.where(
      last_with_rows_v >= 0, jnp.minimum(owner_v[jnp.maximum(last_with_rows_v, 0)], g - 1), 0
    )
  return tuple(x.astype(jnp.int32) for x in (tile_v, group_v, lo_v, hi_v))


def _precision(dtype) -> jax.lax.Precision:
  # Full float32 matmuls to match the reference; bf16 operands are exact on the MXU anyway.
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _interpret(interpret: Any) -> Any:
  return pltpu.InterpretParams() if interpret is True else interpret


def _gmm_kernel(
  tile_ref,  # SMEM int32[v]
  group_ref,  # SMEM int32[v]
  lo_ref,  # SMEM int32[v]
  hi_ref,  # SMEM int32[v]
  lhs_ref,  # VMEM [tm, tk]
  rhs_ref,  # VMEM [tk, tn], or [tn, tk] when transposed
  out_ref,  # VMEM [tm, tn]
  acc_ref,  # VMEM f32[tm, tn]
  *,
  k_tiles: int,
  transpose_rhs: bool,
  precision,
):
  del group_ref  # used by the index maps only
  v, kk = pl.program_id(1), pl.program_id(2)
  tile, lo, hi = tile_ref[v], lo_ref[v], hi_ref[v]
  has_rows = hi > lo

  @pl.when(has_rows)
  def _():
    contract_rhs = 1 if transpose_rhs else 0
    prod = jax.lax.dot_general(
      lhs_ref[...],
      rhs_ref[...],
      (((1,), (contract_rhs,)), ((), ())),
      precision=precision,
      preferred_element_type=jnp.float32,
    )

    @pl.when(kk == 0)
    def _():
      acc_ref[...] = prod

    @pl.when(kk > 0)
    def _():
      acc_ref[...] += prod

  @pl.when(kk == k_tiles - 1)
  def _():
    tm, tn = out_ref.shape
    rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
    in_group = (rows >= lo) & (rows < hi)
    # Visits are sorted by tile: the first one of a tile owns its block's initial contents.
    first = (v == 0) | (tile_ref[jnp.maximum(v - 1, 0)] != tile)
    # Selects run in float32: TPUs before v6 have no bf16 vector unit.
    acc = acc_ref[...]

    @pl.when(first)
    def _():
      out_ref[...] = jnp.where(in_group, acc, 0.0).astype(out_ref.dtype)

    @pl.when(jnp.logical_not(first) & has_rows)
    def _():
      out_ref[...] = jnp.where(in_group, acc, out_ref[...].astype(jnp.float32)).astype(
        out_ref.dtype
      )


def gmm(
  lhs_mk: jax.Array,
  rhs_gkn: jax.Array,
  group_sizes_g: jax.Array,
  *,
  transpose_rhs: bool = False,
  out_dtype: Any,
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
) -> jax.Array:
  """Grouped matmul on TPU; arguments as in `jaxrl.kernels.gmm.reference.gmm`.

  `group_sizes_g` must be non-negative and sum to at most m (the public function ensures it).
  Dims that the tiles do not divide are zero-padded. `interpret=True` runs the kernel in the
  Mosaic TPU interpreter (`pltpu.InterpretParams()`); an `InterpretParams` is passed as is.
  """
  m, k = lhs_mk.shape
  n = rhs_gkn.shape[1] if transpose_rhs else rhs_gkn.shape[2]
  bs = resolve_block_sizes(block_sizes, m=m, k=k, n=n, dtypes=(lhs_mk.dtype, out_dtype))
  tm, tk, tn = bs.tm, bs.tk, bs.tn
  m_tiles, k_tiles, n_tiles = pl.cdiv(m, tm), pl.cdiv(k, tk), pl.cdiv(n, tn)
  lhs_mk = jnp.pad(lhs_mk, ((0, m_tiles * tm - m), (0, k_tiles * tk - k)))
  pad_k, pad_n = (0, k_tiles * tk - k), (0, n_tiles * tn - n)
  rhs_gkn = jnp.pad(rhs_gkn, ((0, 0), pad_n, pad_k) if transpose_rhs else ((0, 0), pad_k, pad_n))
  visits = group_visits(group_sizes_g, m_tiles=m_tiles, tm=tm, for_tgmm=False)

  def k_step(v, kk, lo_ref, hi_ref):
    # A visit without rows computes nothing: holding its k index at the last step keeps the
    # blocks of the step before, so the pipeline copies nothing for it.
    return jnp.where(hi_ref[v] > lo_ref[v], kk, k_tiles - 1)

  def lhs_map(j, v, kk, tile_ref, group_ref, lo_ref, hi_ref):
    return tile_ref[v], k_step(v, kk, lo_ref, hi_ref)

  def rhs_map(j, v, kk, tile_ref, group_ref, lo_ref, hi_ref):
    kk = k_step(v, kk, lo_ref, hi_ref)
    return (group_ref[v], j, kk) if transpose_rhs else (group_ref[v], kk, j)

  def out_map(j, v, kk, tile_ref, group_ref, lo_ref, hi_ref):
    return tile_ref[v], j

  kernel = functools.partial(
    _gmm_kernel,
    k_tiles=k_tiles,
    transpose_rhs=transpose_rhs,
    precision=_precision(lhs_mk.dtype),
  )
  out_mn = pl.pallas_call(
    kernel,
    out_shape=output_like((m_tiles * tm, n_tiles * tn), out_dtype, lhs_mk, rhs_gkn),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(n_tiles, visits[0].shape[0], k_tiles),
      in_specs=[
        pl.BlockSpec((tm, tk), lhs_map),
        pl.BlockSpec((None, tn, tk) if transpose_rhs else (None, tk, tn), rhs_map),
      ],
      out_specs=pl.BlockSpec((tm, tn), out_map),
      scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    ),
    # Output tiles are revisited across consecutive visits and k steps; only n is independent.
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary")
    ),
    interpret=_interpret(interpret),
    name="gmm_tpu",
  )(*visits, lhs_mk, rhs_gkn)
  return out_mn[:m, :n]


def _tgmm_kernel(
  tile_ref,  # SMEM int32[v]
  group_ref,  # SMEM int32[v]
  lo_ref,  # SMEM int32[v]
  hi_ref,  # SMEM int32[v]
  lhs_ref,  # VMEM [tm, tk]
  grad_ref,  # VMEM [tm, tn]
  out_ref,  # VMEM [tk, tn] of out[group]
  acc_ref,  # VMEM f32[tk, tn]
  *,
  num_visits: int,
  precision,
):
  v = pl.program_id(2)
  tile, group, lo, hi = tile_ref[v], group_ref[v], lo_ref[v], hi_ref[v]
  first = (v == 0) | (group_ref[jnp.maximum(v - 1, 0)] != group)
  last = (v == num_visits - 1) | (group_ref[jnp.minimum(v + 1, num_visits - 1)] != group)

  @pl.when(first)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(hi > lo)
  def _():
    dtype, tm = lhs_ref.dtype, lhs_ref.shape[0]
    # Both operands are masked: rows of other groups, or past the groups, may hold anything.
    # The selects run in float32, as TPUs before v6 have no bf16 vector unit.
    rows_k = tile * tm + jax.lax.broadcasted_iota(jnp.int32, lhs_ref.shape, 0)
    rows_n = tile * tm + jax.lax.broadcasted_iota(jnp.int32, grad_ref.shape, 0)
    lhs = jnp.where((rows_k >= lo) & (rows_k < hi), lhs_ref[...].astype(jnp.float32), 0.0)
    grad = jnp.where((rows_n >= lo) & (rows_n < hi), grad_ref[...].astype(jnp.float32), 0.0)
    acc_ref[...] += jax.lax.dot_general(
      lhs.astype(dtype),
      grad.astype(dtype),
      (((0,), (0,)), ((), ())),
      precision=precision,
      preferred_element_type=jnp.float32,
    )

  @pl.when(last)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm(
  lhs_mk: jax.Array,
  grad_mn: jax.Array,
  group_sizes_g: jax.Array,
  *,
  out_dtype: Any,
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
) -> jax.Array:
  """Transposed grouped matmul on TPU; arguments as in `jaxrl.kernels.gmm.reference.tgmm`.

  Same preconditions and `interpret` as `gmm`.
  """
  m, k = lhs_mk.shape
  n = grad_mn.shape[1]
  g = group_sizes_g.shape[0]
  bs = resolve_block_sizes(block_sizes, m=m, k=k, n=n, dtypes=(lhs_mk.dtype, out_dtype))
  tm, tk, tn = bs.tm, bs.tk, bs.tn
  m_tiles, k_tiles, n_tiles = pl.cdiv(m, tm), pl.cdiv(k, tk), pl.cdiv(n, tn)
  lhs_mk = jnp.pad(lhs_mk, ((0, m_tiles * tm - m), (0, k_tiles * tk - k)))
  grad_mn = jnp.pad(grad_mn, ((0, m_tiles * tm - m), (0, n_tiles * tn - n)))
  visits = group_visits(group_sizes_g, m_tiles=m_tiles, tm=tm, for_tgmm=True)
  num_visits = visits[0].shape[0]

  def lhs_map(i, j, v, tile_ref, group_ref, lo_ref, hi_ref):
    return tile_ref[v], i

  def grad_map(i, j, v, tile_ref, group_ref, lo_ref, hi_ref):
    return tile_ref[v], j

  def out_map(i, j, v, tile_ref, group_ref, lo_ref, hi_ref):
    return group_ref[v], i, j

  kernel = functools.partial(
    _tgmm_kernel, num_visits=num_visits, precision=_precision(lhs_mk.dtype)
  )
  out_gkn = pl.pallas_call(
    kernel,
    out_shape=output_like((g, k_tiles * tk, n_tiles * tn), out_dtype, lhs_mk, grad_mn),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(k_tiles, n_tiles, num_visits),
      in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), grad_map)],
      out_specs=pl.BlockSpec((None, tk, tn), out_map),
      scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    ),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=_interpret(interpret),
    name="tgmm_tpu",
  )(*visits, lhs_mk, grad_mn)
  return out_gkn[:, :k, :n]
