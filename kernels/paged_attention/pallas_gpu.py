"""Paged decode attention as a Pallas GPU kernel (Triton lowering).

Grid `(n, k * r, x)`: one program per (sequence, block of `b` query heads sharing a kv head,
part of the page axis). Triton has no scalar prefetch, so the program loads its length and,
per compute block, `pages_per_compute_block` page ids as ordinary inputs, gathers those pages
of its kv head and runs an online softmax in float32 over the blocks of its part, stopping at
the sequence's last token. Each part writes its normalised output, running max and
denominator; a few jnp ops merge the parts (split-K, "flash decoding") so that short batches
still fill the GPU.

Shapes: n sequences, h query heads, k kv heads, g = h // k, b query heads per program (g
padded to a power of two >= 16, the smallest Triton `dot`), r = ceil(g / b) head blocks per kv
head, d head dim, p pages in the pool, s tokens per page, m pages per sequence, c pages per
compute block, t = c * s tokens per block, x parts (splits) of the page axis.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl.kernels.paged_attention.api import BlockSizes

# The Triton compiler-params class was `TritonCompilerParams` before it became
# `CompilerParams`; take whichever this jax has, so every version lowers with the same values.
_TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams

_MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16.
_MAX_HEADS_PER_PROGRAM = 64
_TARGET_BLOCK_TOKENS = 128
_TARGET_PROGRAMS = 256  # about two waves on a 132-SM H100.
# A part covers at most this many compute blocks (1024 tokens at the default block), so that in
# a ragged batch the longest sequences are split over several programs instead of leaving one
# program working long after the others are done; parts past a sequence's length exit at once.
_MAX_BLOCKS_PER_SPLIT = 8
# Triton runs float32 dots in TF32 at the default precision (about 1e-3 relative error); decode
# attention is bound by memory, so full float32 costs little. A no-op for bfloat16 pools.
_PRECISION = jax.lax.Precision.HIGHEST


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def resolve_block_sizes(
  block_sizes: BlockSizes | None, *, num_programs: int, page_size: int, pages_per_seq: int
) -> BlockSizes:
  """Fills the None fields from the shapes; `num_programs` counts (sequence, head block)."""
  bs = block_sizes or BlockSizes()
  c = bs.pages_per_compute_block
  if c is None:
    c = min(_next_pow2(pages_per_seq), max(1, _TARGET_BLOCK_TOKENS // page_size))
    c = max(c, pl.cdiv(_MIN_DOT, page_size))
  x = bs.num_splits
  if x is None:
    num_blocks = pl.cdiv(pages_per_seq, c)
    x = max(1, min(num_blocks, pl.cdiv(_TARGET_PROGRAMS, num_programs)))
    x = max(x, pl.cdiv(num_blocks, _MAX_BLOCKS_PER_SPLIT))
    x = pl.cdiv(num_blocks, pl.cdiv(num_blocks, x))  # no part without blocks
  return BlockSizes(
    pages_per_compute_block=c,
    num_splits=x,
    num_warps=bs.num_warps or 4,
    num_stages=bs.num_stages or 2,
  )


def _check_shapes(*, page_size: int, head_dim: int, pages_per_block: int) -> None:
  for name, value in (
    ("page_size", page_size),
    ("head_dim", head_dim),
    ("BlockSizes.pages_per_compute_block", pages_per_block),
  ):
    if not _is_pow2(value):
      raise ValueError(
        f"impl='pallas_gpu' needs {name} to be a power of two (Triton block shapes), got "
        f"{value}; use impl='reference' for this shape."
      )
  if head_dim < _MIN_DOT or pages_per_block * page_size < _MIN_DOT:
    raise ValueError(
      f"impl='pallas_gpu' needs head_dim >= {_MIN_DOT} and pages_per_compute_block * page_size "
      f">= {_MIN_DOT} (Triton dot), got head_dim={head_dim}, pages_per_compute_block="
      f"{pages_per_block}, page_size={page_size}."
    )


def _kernel(
  length_ref,  # int32[1]
  page_indices_ref,  # int32[x * blocks_per_split * c]: this sequence's page ids, padded
  q_ref,  # [b, d]
  k_pages_ref,  # [p, s, d] of this program's kv head
  v_pages_ref,  # [p, s, d]
  o_ref,  # f32[b, d]: this part's normalised output
  max_ref,  # f32[b]: this part's max logit (-inf when it saw no token)
  denom_ref,  # f32[b]: this part's softmax denominator at that max
  *,
  sm_scale: float,
  pages_per_block: int,
  blocks_per_split: int,
):
  c = pages_per_block
  _, s, d = k_pages_ref.shape
  t = c * s
  length = length_ref[0]
  num_pages = jax.lax.div(length + s - 1, s)
  first = pl.program_id(2) * blocks_per_split
  end = jnp.minimum(first + blocks_per_split, jax.lax.div(length + t - 1, t))
  q_bd = q_ref[...]
  b = q_bd.shape[0]

  def body(i, carry):
    o_bd, max_b, denom_b = carry
    pages_c = page_indices_ref[pl.ds(i * c, c)]
    # Pages of the block past the length are swapped for its first page, which is used: the
    # gather then re-reads cached lines instead of fetching unused pages from memory. Slots
    # past the length are masked below with `where`: they may hold anything, NaN included.
    used_c = i * c + jax.lax.broadcasted_iota(jnp.int32, (c,), 0) < num_pages
    pages_c = jnp.where(used_c, pages_c, page_indices_ref[i * c])
    k_td = k_pages_ref[pages_c].reshape(t, d)
    v_td = v_pages_ref[pages_c].reshape(t, d)
    valid_t = i * t + jax.lax.broadcasted_iota(jnp.int32, (t,), 0) < length

    logits_bt = jax.lax.dot_general(
      q_bd,
      k_td,
      (((1,), (1,)), ((), ())),
      precision=_PRECISION,
      preferred_element_type=jnp.float32,
    )
    logits_bt = jnp.where(valid_t[None, :], logits_bt * sm_scale, -jnp.inf)
    new_max_b = jnp.maximum(max_b, jnp.max(logits_bt, axis=1))
    rescale_b = jnp.exp(max_b - new_max_b)  # every visited block has a token: finite max
    probs_bt = jnp.exp(logits_bt - new_max_b[:, None])
    v_td = jnp.where(valid_t[:, None], v_td, jnp.zeros_like(v_td))
    pv_bd = jax.lax.dot_general(
      probs_bt.astype(v_td.dtype),
      v_td,
      (((1,), (0,)), ((), ())),
      precision=_PRECISION,
      preferred_element_type=jnp.float32,
    )
    o_bd = o_bd * rescale_b[:, None] + pv_bd
    denom_b = denom_b * rescale_b + jnp.sum(probs_bt, axis=1)
    return o_bd, new_max_b, denom_b

  init = (
    jnp.zeros((b, d), jnp.float32),
    jnp.full((b,), -jnp.inf, jnp.float32),
    jnp.zeros((b,), jnp.float32),
  )
  o_bd, max_b, denom_b = jax.lax.fori_loop(first, end, body, init)
  inv_b = jnp.where(denom_b > 0, 1.0 / jnp.where(denom_b > 0, denom_b, 1.0), 0.0)
  o_ref[...] = o_bd * inv_b[:, None]
  max_ref[...] = max_b
  denom_ref[...] = denom_b


def _merge_splits(o_nxjbd, max_nxjb, denom_nxjb):
  """Combines the parts' softmaxes; parts that saw no token have weight 0."""
  max_njb = jnp.max(max_nxjb, axis=1)
  max_njb = jnp.where(jnp.isfinite(max_njb), max_njb, 0.0)
  weight_nxjb = denom_nxjb * jnp.exp(max_nxjb - max_njb[:, None])
  total_njb = jnp.sum(weight_nxjb, axis=1)
  o_njbd = jnp.sum(weight_nxjb[..., None] * o_nxjbd, axis=1)
  return o_njbd / jnp.where(total_njb > 0, total_njb, 1.0)[..., None]


def paged_attention(
  q_nhd: jax.Array,
  k_pages_kpsd: jax.Array,
  v_pages_kpsd: jax.Array,
  lengths_n: jax.Array,
  page_indices_nm: jax.Array,
  *,
  sm_scale: float,
  block_sizes: BlockSizes | None = None,
  interpret: Any = False,
) -> jax.Array:
  """Paged decode attention on GPU; arguments as in `jaxrl.kernels.paged_attention`.

  `lengths_n` must already be clipped to `[0, m * s]` (the public function does it). q is
  cast to the pools' dtype for the matmuls (which accumulate in float32). `interpret` goes to
  `pl.pallas_call` as is.
  """
  n, h, d = q_nhd.shape
  k, _, s, _ = k_pages_kpsd.shape
  m = page_indices_nm.shape[1]
  g = h // k
  b = min(max(_MIN_DOT, _next_pow2(g)), _MAX_HEADS_PER_PROGRAM)
  r = pl.cdiv(g, b)
  bs = resolve_block_sizes(block_sizes, num_programs=n * k * r, page_size=s, pages_per_seq=m)
  c, x = bs.pages_per_compute_block, bs.num_splits
  _check_shapes(page_size=s, head_dim=d, pages_per_block=c)
  blocks_per_split = pl.cdiv(pl.cdiv(m, c), x)
  m_padded = x * blocks_per_split * c
  # Padded entries name page 0, which exists; they lie past every length, so are never read.
  page_indices_nm = jnp.pad(page_indices_nm, ((0, 0), (0, m_padded - m)))
  # [n, k * r, b, d]: query heads of one kv head, padded with zero heads up to r * b.
  q_nkgd = q_nhd.reshape(n, k, g, d).astype(k_pages_kpsd.dtype)
  q_njbd = jnp.pad(q_nkgd, ((0, 0), (0, 0), (0, r * b - g), (0, 0))).reshape(n, k * r, b, d)

  def kv_head(j):
    return jax.lax.div(j, r)

  kernel = functools.partial(
    _kernel, sm_scale=sm_scale, pages_per_block=c, blocks_per_split=blocks_per_split
  )
  pages_spec = pl.BlockSpec((None, *k_pages_kpsd.shape[1:]), lambda i, j, y: (kv_head(j), 0, 0, 0))
  f32 = jnp.float32
  o_nxjbd, max_nxjb, denom_nxjb = pl.pallas_call(
    kernel,
    grid=(n, k * r, x),
    in_specs=[
      pl.BlockSpec((1,), lambda i, j, y: (i,)),
      pl.BlockSpec((None, m_padded), lambda i, j, y: (i, 0)),
      pl.BlockSpec((None, None, b, d), lambda i, j, y: (i, j, 0, 0)),
      pages_spec,
      pages_spec,
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, b, d), lambda i, j, y: (i, y, j, 0, 0)),
      pl.BlockSpec((None, None, None, b), lambda i, j, y: (i, y, j, 0)),
      pl.BlockSpec((None, None, None, b), lambda i, j, y: (i, y, j, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((n, x, k * r, b, d), f32),
      jax.ShapeDtypeStruct((n, x, k * r, b), f32),
      jax.ShapeDtypeStruct((n, x, k * r, b), f32),
    ],
    compiler_params=_TritonParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
    interpret=interpret,
    name="paged_attention_gpu",
  )(lengths_n, page_indices_nm, q_njbd, k_pages_kpsd, v_pages_kpsd)

  o_njbd = o_nxjbd[:, 0] if x == 1 else _merge_splits(o_nxjbd, max_nxjb, denom_nxjb)
  o_nkgd = o_njbd.reshape(n, k, r * b, d)[:, :, :g]
  return o_nkgd.reshape(n, h, d).astype(q_nhd.dtype)
