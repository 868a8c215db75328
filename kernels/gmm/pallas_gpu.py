"""Grouped matmuls as Pallas GPU kernels (Triton lowering).

Triton has no scalar prefetch, so the group metadata are ordinary inputs, computed in jnp.

`gmm`, grid `(n_tiles, work_tiles)`: the rows of each group are cut into tiles that start at
the group's first row (MegaBlocks' layout), so a program runs one k loop with one group's
weights over `tm` rows of that group, with no rows of other groups in its tile. The rows past
the groups form one more pseudo-group whose tiles write zeros; programs past the last tile do
nothing. Loads and stores of a tile are masked to its rows, so lhs is neither padded nor
copied. A group wastes at most one partly filled tile; the layout this replaced (fixed row
tiles, each running its k loop once per group it held) took 1.5-2.3x as long at the same tiles
on an H200 (docs/BENCHMARKS.md). The column tile varies fastest in the launch, so the programs
of one row tile run together and read its rows once from memory, and the tiles of one group
read its weights once. Default tiles: `gmm_block_sizes` (on Hopper, the best of a sweep on an
H200; elsewhere small tiles any GPU's shared memory holds).

`tgmm`, grid `(g, k_tiles, n_tiles)`: a program owns one tile of `out[g]` and loops over the
row tiles of group g, masking rows of other groups to zero. Programs of large groups run
longer than others; an empty group's programs only write zeros. Default tiles:
`tgmm_block_sizes` (on Hopper, the best of a sweep on an H100).

Triton block dims are powers of two and its dot needs every dim >= 16: the k and n dims are
zero-padded up to whole tiles where they are not multiples of them.

Shapes: m rows, k contraction dim, n output columns, g groups; tm, tk, tn tiles.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl.kernels.common import output_like
from jaxrl.kernels.gmm.api import BlockSizes

# The Triton compiler-params class was `TritonCompilerParams` before it became
# `CompilerParams`; take whichever this jax has.
_TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams

_MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16.
# Small tiles that fit any CUDA GPU's shared memory (2 stages of bf16 64x32 and 32x64 operand
# tiles: 16 KiB; 32 KiB in fp32): gmm's and tgmm's defaults off Hopper.
_SMALL_TILES = BlockSizes(tm=64, tk=32, tn=64, num_warps=4, num_stages=2)
# Compute capabilities with 227 KiB of shared memory per block (Hopper, Blackwell datacenter
# parts), where gmm's swept tiles fit; others have 64-163 KiB.
_LARGE_SHARED_MEMORY = (9, 10)


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def gmm_block_sizes(m: int, g: int, itemsize: int, compute_capability: str | None) -> BlockSizes:
  """gmm's default tiles for a GPU of `compute_capability` ("9.0"; None: unknown).

  On Hopper-class GPUs, the best of a sweep on an H200 (bf16, k 2048, n 768, m 8k-16k rows over
  8-128 groups; docs/BENCHMARKS.md): 128 x 64 tiles of rows x k with 8 warps and 3 stages;
  256 columns where groups average 256 rows or more, else 128 (wider column tiles only paid
  where a group fills several row tiles). Three stages of those operand tiles take up to 144
  KiB of shared memory in bf16, so fp32 halves k (tk 32). Elsewhere, and where the GPU is not
  known (lowering on a CPU), the small tiles every CUDA GPU fits.
  """
  major = int(compute_capability.split(".")[0]) if compute_capability else 0
  if major not in _LARGE_SHARED_MEMORY:
    return _SMALL_TILES
  tn = 256 if m >= 256 * g else 128
  return BlockSizes(tm=128, tk=64 if itemsize <= 2 else 32, tn=tn, num_warps=8, num_stages=3)


def tgmm_block_sizes(itemsize: int, compute_capability: str | None) -> BlockSizes:
  """tgmm's default tiles for a GPU of `compute_capability` ("9.0"; None: unknown).

  On Hopper-class GPUs, the best of a sweep on an H100 (bf16, k 2048, n 768, m 8k-16k rows over
  8-128 groups; docs/BENCHMARKS.md): 64 rows a step into a 128 x 128 tile of `out[g]`, 4 warps,
  3 stages, the fastest of 8 tilings on all 6 shapes and 2.6-4.8x the small tiles. Three
  stages of its bf16 operand tiles take 96 KiB of shared memory; fp32 (not swept) halves k to
  stay at 144 KiB. Elsewhere, and where the GPU is not known, the small tiles.
  """
  major = int(compute_capability.split(".")[0]) if compute_capability else 0
  if major not in _LARGE_SHARED_MEMORY:
    return _SMALL_TILES
  return BlockSizes(tm=64, tk=128 if itemsize <= 2 else 64, tn=128, num_warps=4, num_stages=3)


def _compute_capability() -> str | None:
  """The default GPU's compute capability, None without one (interpret mode, CPU lowering)."""
  device = jax.devices()[0]
  return getattr(device, "compute_capability", None) if device.platform == "gpu" else None


def resolve_block_sizes(
  block_sizes: BlockSizes | None, defaults: BlockSizes, *, m: int, k: int, n: int
) -> BlockSizes:
  """Fills the None fields from `defaults`, clips tiles to the dims (rounded up to a power of
  two >= 16)."""
  bs = block_sizes or BlockSizes()
  tiles = {}
  dims = {"tm": (defaults.tm, m), "tk": (defaults.tk, k), "tn": (defaults.tn, n)}
  for name, (default, dim) in dims.items():
    tile = getattr(bs, name) or default
    if not _is_pow2(tile) or tile < _MIN_DOT:
      raise ValueError(
        f"impl='pallas_gpu' needs BlockSizes.{name} to be a power of two >= {_MIN_DOT} (Triton "
        f"block shapes and dot), got {tile}."
      )
    tiles[name] = min(tile, max(_MIN_DOT, _next_pow2(dim)))
  return BlockSizes(
    **tiles,
    num_warps=bs.num_warps or defaults.num_warps,
    num_stages=bs.num_stages or defaults.num_stages,
  )


def _precision(dtype) -> jax.lax.Precision:
  # Triton runs float32 dots in TF32 by default (about 1e-3 relative error); the reference
  # is full float32. A no-op for bf16.
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _offsets(group_sizes_g: jax.Array) -> jax.Array:
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes_g, dtype=jnp.int32)])


def _work_tiles(group_sizes_g: jax.Array, *, m: int, tm: int, num_tiles: int):
  """(group, first row, end row) of each of `num_tiles` programs' row tiles.

  Group j's rows `[offsets[j], offsets[j + 1])` are cut into `ceil(size / tm)` tiles from its
  first row; the rows past the groups, `[offsets[g], m)`, are pseudo-group g (zeros). Programs
  past the last tile get group g and the empty range `[m, m)`. `num_tiles` = `cdiv(m, tm) + g`
  bounds the tiles: the sum over g + 1 groups of ceil(size / tm) is at most that.
  """
  g = group_sizes_g.shape[0]
  offsets = _offsets(group_sizes_g)  # g + 1 starts: the groups', then the zero tail's
  ends = jnp.concatenate([offsets[1:], jnp.full((1,), m, jnp.int32)])
  tiles = (ends - offsets + tm - 1) // tm
  tiles_end = jnp.cumsum(tiles, dtype=jnp.int32)
  work = jnp.arange(num_tiles, dtype=jnp.int32)
  group = jnp.searchsorted(tiles_end, work, side="right").astype(jnp.int32)
  live = group <= g
  group = jnp.minimum(group, g)
  start = offsets[group] + (work - (tiles_end[group] - tiles[group])) * tm
  end = jnp.minimum(start + tm, ends[group])
  return group, jnp.where(live, start, m), jnp.where(live, end, m)


def _gmm_kernel(
  group_ref,  # int32[1]: this program's group (g: rows past the groups, written as zeros)
  start_ref,  # int32[1]: first row of its tile
  end_ref,  # int32[1]: end of its tile's rows (<= start + tm)
  lhs_ref,  # [m, k_pad] all rows, in memory
  rhs_ref,  # [g, k_pad, tn], or [g, tn, k_pad] when transposed
  out_ref,  # [m, n_pad] all rows, in memory
  *,
  tm: int,
  tk: int,
  tn: int,
  k_tiles: int,
  num_groups: int,
  transpose_rhs: bool,
  precision,
):
  group, start = group_ref[0], start_ref[0]
  rows = start + jax.lax.broadcasted_iota(jnp.int32, (tm,), 0)
  in_tile = (rows < end_ref[0])[:, None]
  weights = jnp.minimum(group, num_groups - 1)  # the zero tail reads no weights

  def k_body(kk, acc):
    lhs = plgpu.load(lhs_ref.at[pl.ds(start, tm), pl.ds(kk * tk, tk)], mask=in_tile, other=0.0)
    if transpose_rhs:
      rhs = rhs_ref[weights, :, pl.ds(kk * tk, tk)]
      dims = (((1,), (1,)), ((), ()))
    else:
      rhs = rhs_ref[weights, pl.ds(kk * tk, tk), :]
      dims = (((1,), (0,)), ((), ()))
    return acc + jax.lax.dot_general(
      lhs, rhs, dims, precision=precision, preferred_element_type=jnp.float32
    )

  steps = (group < num_groups).astype(jnp.int32) * k_tiles
  acc = jax.lax.fori_loop(0, steps, k_body, jnp.zeros((tm, tn), jnp.float32))
  column = pl.program_id(0) * tn
  plgpu.store(
    out_ref.at[pl.ds(start, tm), pl.ds(column, tn)], acc.astype(out_ref.dtype), mask=in_tile
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
  """Grouped matmul on GPU; arguments as in `jaxrl.kernels.gmm.reference.gmm`.

  `group_sizes_g` must be non-negative and sum to at most m (the public function ensures it).
  `interpret` goes to `pl.pallas_call` as is.
  """
  m, k = lhs_mk.shape
  g = rhs_gkn.shape[0]
  n = rhs_gkn.shape[1] if transpose_rhs else rhs_gkn.shape[2]
  defaults = gmm_block_sizes(m, g, lhs_mk.dtype.itemsize, _compute_capability())
  bs = resolve_block_sizes(block_sizes, defaults, m=m, k=k, n=n)
  tm, tk, tn = bs.tm, bs.tk, bs.tn
  k_tiles, n_tiles = pl.cdiv(k, tk), pl.cdiv(n, tn)
  k_pad, n_pad = k_tiles * tk, n_tiles * tn
  if k_pad != k:
    lhs_mk = jnp.pad(lhs_mk, ((0, 0), (0, k_pad - k)))
  if (k_pad, n_pad) != (k, n):
    pads = ((0, 0), (0, n_pad - n), (0, k_pad - k))
    rhs_gkn = jnp.pad(rhs_gkn, pads if transpose_rhs else (pads[0], pads[2], pads[1]))
  num_tiles = pl.cdiv(m, tm) + g
  group, start, end = _work_tiles(group_sizes_g, m=m, tm=tm, num_tiles=num_tiles)
  if transpose_rhs:
    rhs_spec = pl.BlockSpec((g, tn, k_pad), lambda j, w: (0, j, 0))
  else:
    rhs_spec = pl.BlockSpec((g, k_pad, tn), lambda j, w: (0, 0, j))
  per_tile = pl.BlockSpec((1,), lambda j, w: (w,))
  kernel = functools.partial(
    _gmm_kernel,
    tm=tm,
    tk=tk,
    tn=tn,
    k_tiles=k_tiles,
    num_groups=g,
    transpose_rhs=transpose_rhs,
    precision=_precision(lhs_mk.dtype),
  )
  out_mn = pl.pallas_call(
    kernel,
    # Columns first: the n_tiles programs of a row tile are launched together.
    grid=(n_tiles, num_tiles),
    in_specs=[per_tile, per_tile, per_tile, pl.BlockSpec(memory_space=pl.ANY), rhs_spec],
    out_specs=pl.BlockSpec(memory_space=pl.ANY),
    out_shape=output_like((m, n_pad), out_dtype, lhs_mk, rhs_gkn),
    compiler_params=_TritonParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
    interpret=interpret,
    name="gmm_gpu",
  )(group, start, end, lhs_mk, rhs_gkn)
  return out_mn if n_pad == n else out_mn[:, :n]


def _tgmm_kernel(
  offsets_ref,  # int32[g + 1]
  lhs_ref,  # [m_pad, tk]
  grad_ref,  # [m_pad, tn]
  out_ref,  # [tk, tn] of out[g]
  *,
  tm: int,
  precision,
):
  group = pl.program_id(0)
  lo, hi = offsets_ref[group], offsets_ref[group + 1]

  def tile_body(tile, acc):
    rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm,), 0)
    in_group = ((rows >= lo) & (rows < hi))[:, None]
    # Both operands are masked: rows of other groups, or past the groups, may hold anything.
    # Masked in the load (rows outside the group are not read, zeros stand in), not by a
    # select in registers: compiled for an H100, 92 registers instead of 156 at 64x64x128
    # tiles (`launch/bench.py kernel_code`).
    lhs = plgpu.load(lhs_ref.at[pl.ds(tile * tm, tm), :], mask=in_group, other=0.0)
    grad = plgpu.load(grad_ref.at[pl.ds(tile * tm, tm), :], mask=in_group, other=0.0)
    return acc + jax.lax.dot_general(
      lhs, grad, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )

  first_tile = jax.lax.div(lo, tm)
  end_tile = jnp.where(hi > lo, jax.lax.div(hi + tm - 1, tm), first_tile)
  acc = jax.lax.fori_loop(first_tile, end_tile, tile_body, jnp.zeros(out_ref.shape, jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def tgmm(
  lhs_mk: jax.Array,
  grad_mn: jax.Array,
  group_sizes_g: jax.Array,
  *,
  out_dtype: Any,
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
) -> jax.Array:
  """Transposed grouped matmul on GPU; arguments as in `jaxrl.kernels.gmm.reference.tgmm`.

  Same preconditions and `interpret` as `gmm`.
  """
  m, k = lhs_mk.shape
  n = grad_mn.shape[1]
  g = group_sizes_g.shape[0]
  defaults = tgmm_block_sizes(lhs_mk.dtype.itemsize, _compute_capability())
  bs = resolve_block_sizes(block_sizes, defaults, m=m, k=k, n=n)
  tm, tk, tn = bs.tm, bs.tk, bs.tn
  m_tiles, k_tiles, n_tiles = pl.cdiv(m, tm), pl.cdiv(k, tk), pl.cdiv(n, tn)
  m_pad = m_tiles * tm
  lhs_mk = jnp.pad(lhs_mk, ((0, m_pad - m), (0, k_tiles * tk - k)))
  grad_mn = jnp.pad(grad_mn, ((0, m_pad - m), (0, n_tiles * tn - n)))
  kernel = functools.partial(_tgmm_kernel, tm=tm, precision=_precision(lhs_mk.dtype))
  out_gkn = pl.pallas_call(
    kernel,
    grid=(g, k_tiles, n_tiles),
    in_specs=[
      pl.BlockSpec((g + 1,), lambda b, i, j: (0,)),
      pl.BlockSpec((m_pad, tk), lambda b, i, j: (0, i)),
      pl.BlockSpec((m_pad, tn), lambda b, i, j: (0, j)),
    ],
    out_specs=pl.BlockSpec((None, tk, tn), lambda b, i, j: (b, i, j)),
    out_shape=output_like((g, k_tiles * tk, n_tiles * tn), out_dtype, lhs_mk, grad_mn),
    compiler_params=_TritonParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
    interpret=interpret,
    name="tgmm_gpu",
  )(_offsets(group_sizes_g), lhs_mk, grad_mn)
  return out_gkn[:, :k, :n]
