"""Paged decode attention as a Pallas GPU kernel (Triton lowering).

Grid `(n, k * r, x)`: one program per (sequence, block of `b` query heads sharing a kv head,
part of the page axis). Triton has no scalar prefetch, so the program loads its length and,
per compute block, `pages_per_compute_block` page ids as ordinary inputs, gathers those pages
of its kv head and runs an online softmax in float32 over the blocks of its part, stopping at
the sequence's last token. With a sliding window of w tokens the parts cut the blocks from
the one holding position `length - w`, the window's first, instead of from block 0: a
sequence's window spans at most `cdiv(w - 1, t) + 1` blocks wherever it lies, so the tiling
and the number of parts are chosen for those blocks, not for the page table's capacity, and no
program is spent on the blocks before the window (rings of pages, `jaxrl.rollout.window_kv`,
keep the page table as long as the sequence). Positions before the window are masked like
those past the length.
Each part writes its normalised output, running max and denominator; a few jnp ops merge the
parts (split-K, "flash decoding") so that short batches still fill the GPU. With attention
sinks the first part starts from each head's sink (a logit whose value is zero) as if that were
a visited key, so the merge counts it once.

A decode step reads every cached key and value once and does one multiply-add with each for
each of the g query heads, so it is bound by memory unless the products are slow. Two ways
to take them, chosen per call (`BlockSizes.dot_min_group`):
- "dot": tensor-core `tl.dot` of the program's query rows with the block's keys, then of the
  softmax weights with its values. Triton's dot needs >= 16 rows, so g < 16 heads are repeated
  to 16 rows in registers (g a power of two: the program reads its g heads of q in place and
  writes g rows of output, so no padded copy of q or of the output goes through memory, and a
  decode step runs no pad or slice kernel around this one; other g are padded with zero heads
  by XLA). Only the g heads of one kv head (of one sequence) share the key tile, so the
  rows cannot be filled from other kv heads or sequences: a dot over several would compute a
  block-diagonal product, whose off-diagonal blocks are the same waste as padding. The padding
  costs tensor-core cycles only, and those are idle: 16 rows make 16 flops per byte of 16-bit
  cache against about 300 that an H100's tensor cores can do per byte of HBM bandwidth.
- "sum": broadcast multiply and sum in float32 on CUDA cores, `b = next_pow2(g)` rows, nothing
  padded to 16: g exact float32 multiply-adds per cached number. For a float32 cache with
  g <= 4 that is at most one instruction per byte read (an H100 SM reads about 15 bytes per
  clock at full bandwidth and issues 128 float32 operations), fewer than the 5 per number
  (1.25 per byte) that splitting keys and values into tensor-core parts costs (below), and
  exact. A 16-bit cache would also need a conversion per number while the tensor cores are
  idle, so 16-bit caches use "dot" whatever g is.

Float32 operands of "dot" are taken at `precision` (from the public function):
- HIGH (the default): "3xTF32". Each operand x is split into hi = x rounded to TF32 (10
  mantissa bits, round to nearest with ties away, as `cvt.rna.tf32`) and lo = (x - hi) rounded
  likewise, so |x - hi - lo| <= 2**-22 |x|. Three TF32 tensor-core dots sum lo*hi + hi*lo
  (first, being small) and hi*hi in float32; the left-out lo*lo and the split residuals bound
  each product's error by 3 * 2**-22 of its size, about 12 float32 rounding units. TF32 tensor
  cores multiply values that are already TF32 exactly, so the kernel computes the same numbers
  in interpret mode on a CPU (where the dots run in float32) as on the GPU, up to the order and
  rounding of the float32 accumulation (tensor cores need not round to nearest). Triton's own
  `inputPrecision = tf32x3` splits the same way, but a CPU cannot run it (XLA:CPU rejects the
  TF32 algorithms), so the split is written out here.
- DEFAULT: hi*hi only, one TF32 pass (2**-11 relative per product).
- HIGHEST: one IEEE float32 dot (CUDA-core multiply-adds, the slowest way).
16-bit pools are multiplied in their dtype (exact products, float32 accumulation): q and the
softmax weights are rounded to it first.

Shapes: n sequences, h query heads, k kv heads, g = h // k, b query rows per program, r =
ceil(g / b) head blocks per kv head, d head dim, p pages in the pool, s tokens per page, m pages
per sequence, c pages per compute block, t = c * s tokens per block, x parts (splits) of the
page axis.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl.kernels.paged_attention.api import BlockSizes
from jaxrl.kernels.paged_attention.reference import scale_logits
from jaxrl.kernels.tf32 import TF32_PARTS, split_dot, tf32_parts

# The Triton compiler-params class was `TritonCompilerParams` before it became
# `CompilerParams`; take whichever this jax has, so every version lowers with the same values.
_TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams

_MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16.
_MAX_HEADS_PER_PROGRAM = 64
# Tokens per compute block. "dot" with a 16-bit cache: 128 (32 KiB of keys at head_dim 128,
# the block measured in docs/BENCHMARKS.md). With a float32 cache each key is twice the bytes
# and 3xTF32 keeps two more copies of the tile (hi and lo), hence half. "sum" holds a
# [b, t, d] float32 product, kept to `_SUM_BLOCK_ELEMENTS` (64 per thread at 4 warps). Not
# measured: `BlockSizes.pages_per_compute_block` overrides.
_TARGET_BLOCK_TOKENS = 128
_TARGET_BLOCK_TOKENS_F32 = 64
_SUM_BLOCK_ELEMENTS = 8192
# A 16-bit cache whose sequences hold at most `_SHORT_CONTEXT_TOKENS` tokens (the page table's
# capacity): blocks of `_SHORT_BLOCK_TOKENS`, 2 warps, 1 stage. Inside the model (Qwen3-0.6B,
# 64 rows of 96-token capacity, H100) they took the decode step from 1.60 to 1.39 ms and the
# attention from 513 to 298 us a step, the best of 5 tilings (docs/BENCHMARKS.md). Up to
# `_MEDIUM_CONTEXT_TOKENS`: blocks of `_MEDIUM_BLOCK_TOKENS`, 2 warps, 1 stage; at a 1,088-token
# capacity (1k-token prompts) they took the attention from 3.19 to 2.92 ms a step (the step
# from 4.29 to 4.01 ms) against 128-token blocks at 4 warps and 2 stages, which longer
# capacities keep (not compared inside the model beyond 1k tokens); 32-token blocks were slower
# there (3.26 ms).
_SHORT_CONTEXT_TOKENS = 128
_SHORT_BLOCK_TOKENS = 32
_MEDIUM_CONTEXT_TOKENS = 2048
_MEDIUM_BLOCK_TOKENS = 64
_TARGET_PROGRAMS = 256  # about two waves on a 132-SM H100.
# A part covers at most this many tokens (8 compute blocks of the default dot block), so that in
# a ragged batch the longest sequences are split over several programs instead of leaving one
# program working long after the others are done; parts past a sequence's length exit at once.
_MAX_TOKENS_PER_SPLIT = 1024


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def resolve_block_sizes(
  block_sizes: BlockSizes | None,
  *,
  num_programs: int,
  page_size: int,
  pages_per_seq: int,
  target_tokens: int = _TARGET_BLOCK_TOKENS,
  min_tokens: int = _MIN_DOT,
  num_warps: int = 4,
  num_stages: int = 2,
) -> BlockSizes:
  """Fills the None tiling fields from the shapes; `num_programs` counts (sequence, head
  block); a default compute block has about `target_tokens` and at least `min_tokens` tokens
  (16 for the dots) or one page; `num_warps` and `num_stages` are the defaults of theirs."""
  bs = block_sizes or BlockSizes()
  c = bs.pages_per_compute_block
  if c is None:
    c = min(_next_pow2(pages_per_seq), max(1, target_tokens // page_size))
    c = max(c, pl.cdiv(min_tokens, page_size))
  x = bs.num_splits
  if x is None:
    num_blocks = pl.cdiv(pages_per_seq, c)
    x = max(1, min(num_blocks, pl.cdiv(_TARGET_PROGRAMS, num_programs)))
    x = max(x, pl.cdiv(num_blocks, max(1, _MAX_TOKENS_PER_SPLIT // (c * page_size))))
    x = pl.cdiv(num_blocks, pl.cdiv(num_blocks, x))  # no part without blocks
  return dataclasses.replace(
    bs,
    pages_per_compute_block=c,
    num_splits=x,
    num_warps=bs.num_warps or num_warps,
    num_stages=bs.num_stages or num_stages,
  )


def default_dot_min_group(dtype, precision: jax.lax.Precision) -> int:
  """The smallest g multiplied by tensor-core dots when `BlockSizes.dot_min_group` is None."""
  if jnp.dtype(dtype).itemsize < 4:
    return 1
  # Float32: at g <= 4 "sum" does at most 2 * 4 multiply-adds per 8 bytes of key and value,
  # splitting them for tensor cores about 10 instructions; at HIGHEST "sum" does the exact
  # multiply-adds of g rows where a padded IEEE dot does those of 16.
  return 16 if precision == jax.lax.Precision.HIGHEST else 5


def _check_shapes(*, page_size: int, head_dim: int, pages_per_block: int, dot: bool) -> None:
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
  if dot and (head_dim < _MIN_DOT or pages_per_block * page_size < _MIN_DOT):
    raise ValueError(
      f"impl='pallas_gpu' with tensor-core dots needs head_dim >= {_MIN_DOT} and "
      f"pages_per_compute_block * page_size >= {_MIN_DOT} (Triton dot), got head_dim="
      f"{head_dim}, pages_per_compute_block={pages_per_block}, page_size={page_size}; or raise "
      "BlockSizes.dot_min_group above the GQA group size to multiply without dots."
    )


def _repeat_rows(x_rd, b: int):
  """`[r, ...]` rows repeated to `b` rows (row i is row i % r): a dot's 16 rows from fewer heads,
  in registers, instead of a padded copy of q in memory."""
  r = x_rd.shape[0]
  if r == b:
    return x_rd
  return jnp.broadcast_to(x_rd[None], (b // r, *x_rd.shape)).reshape(b, *x_rd.shape[1:])


def _first_rows(x_bd, r: int):
  """The first `r` of `b` rows, the inverse of `_repeat_rows`: the other copies are zeroed and
  summed away (adding zeros is exact; Triton has no slice of a register tensor)."""
  b = x_bd.shape[0]
  if r == b:
    return x_bd
  x_crd = x_bd.reshape(b // r, r, *x_bd.shape[1:])
  first = jax.lax.broadcasted_iota(jnp.int32, x_crd.shape, 0) == 0
  return jnp.sum(jnp.where(first, x_crd, jnp.zeros_like(x_crd)), axis=0)


def _kernel(
  length_ref,  # int32[1]
  page_indices_ref,  # int32[m_padded]: this sequence's page ids, padded to whole blocks
  q_ref,  # [r, d]: this program's query heads, the pool's dtype ("dot") or float32 ("sum")
  k_pages_ref,  # [p, s, d] of this program's kv head
  v_pages_ref,  # [p, s, d]
  *refs,  # sinks_ref (f32[r]: this program's heads' sinks, with sinks), then the outputs:
  # o_ref [r, d]: this part's normalised output (float32, or q's dtype when x = 1);
  # max_ref f32[r]: this part's max logit (-inf when it saw no token and no sink);
  # denom_ref f32[r]: this part's softmax denominator at that max.
  sinks: bool = False,
  sm_scale: float,
  pages_per_block: int,
  blocks_per_split: int,
  compute_rows: int,
  dot: bool,
  parts: int,
  sliding_window: int | None,
  logit_softcap: float | None,
):
  sinks_ref, (o_ref, max_ref, denom_ref) = (refs[0], refs[1:]) if sinks else (None, refs)
  c = pages_per_block
  _, s, d = k_pages_ref.shape
  t = c * s
  length = length_ref[0]
  num_pages = jax.lax.div(length + s - 1, s)
  first = pl.program_id(2) * blocks_per_split
  if sliding_window is not None:
    # Positions from `window_start` on are seen. Parts count blocks from the one holding the
    # window's first token, so every block a part visits has a valid token (a block before
    # the length's last one is wholly at or past the window's start); a part past the length
    # gets first >= end and runs no block.
    window_start = length - sliding_window
    first_token = jnp.maximum(window_start, 0)
    first_page = jax.lax.div(first_token, s)
    first = first + jax.lax.div(first_token, t)
  end = jnp.minimum(first + blocks_per_split, jax.lax.div(length + t - 1, t))
  b = compute_rows
  q_bd = _repeat_rows(q_ref[...], b)
  q_parts = tf32_parts(q_bd, parts)  # split once, used by every block

  def body(i, carry):
    o_bd, max_b, denom_b = carry
    pages_c = page_indices_ref[pl.ds(i * c, c)]
    # Pages of the block past the length (or before the window) are swapped for its first
    # used page: the gather then re-reads cached lines instead of fetching unused pages from
    # memory. Slots past the length or before the window are masked below with `where`: they
    # may hold anything, NaN included.
    page_pos_c = i * c + jax.lax.broadcasted_iota(jnp.int32, (c,), 0)
    used_c = page_pos_c < num_pages
    if sliding_window is None:
      pages_c = jnp.where(used_c, pages_c, page_indices_ref[i * c])
    else:
      used_c &= page_pos_c >= first_page
      pages_c = jnp.where(used_c, pages_c, page_indices_ref[jnp.maximum(i * c, first_page)])
    k_td = k_pages_ref[pages_c].reshape(t, d)
    v_td = v_pages_ref[pages_c].reshape(t, d)
    pos_t = i * t + jax.lax.broadcasted_iota(jnp.int32, (t,), 0)
    valid_t = pos_t < length
    if sliding_window is not None:
      valid_t &= pos_t >= window_start
    v_td = jnp.where(valid_t[:, None], v_td, jnp.zeros_like(v_td))

    if dot:
      logits_bt = split_dot(q_parts, tf32_parts(k_td, parts), ((1,), (1,)), parts)
    else:
      k_td = k_td.astype(jnp.float32)
      logits_bt = jnp.sum(q_bd[:, None, :] * k_td[None, :, :], axis=2)
    logits_bt = scale_logits(logits_bt, sm_scale, logit_softcap)
    logits_bt = jnp.where(valid_t[None, :], logits_bt, -jnp.inf)
    new_max_b = jnp.maximum(max_b, jnp.max(logits_bt, axis=1))
    rescale_b = jnp.exp(max_b - new_max_b)  # every visited block has a token: finite max
    probs_bt = jnp.exp(logits_bt - new_max_b[:, None])
    if dot:
      probs_bt_in = probs_bt if parts else probs_bt.astype(v_td.dtype)
      probs_parts = tf32_parts(probs_bt_in, parts)
      pv_bd = split_dot(probs_parts, tf32_parts(v_td, parts), ((1,), (0,)), parts)
    else:
      pv_bd = jnp.sum(probs_bt[:, :, None] * v_td.astype(jnp.float32)[None, :, :], axis=1)
    o_bd = o_bd * rescale_b[:, None] + pv_bd
    denom_b = denom_b * rescale_b + jnp.sum(probs_bt, axis=1)
    return o_bd, new_max_b, denom_b

  init = (
    jnp.zeros((b, d), jnp.float32),
    jnp.full((b,), -jnp.inf, jnp.float32),
    jnp.zeros((b,), jnp.float32),
  )
  if sinks_ref is not None:  # the first part starts from the sink: logit, weight 1, value 0
    first_part = pl.program_id(2) == 0
    sink_b = _repeat_rows(sinks_ref[...], b)
    init = (
      init[0],
      jnp.where(first_part, sink_b, init[1]),
      jnp.where(first_part, jnp.ones_like(init[2]), init[2]),
    )
  o_bd, max_b, denom_b = jax.lax.fori_loop(first, end, body, init)
  inv_b = jnp.where(denom_b > 0, 1.0 / jnp.where(denom_b > 0, denom_b, 1.0), 0.0)
  r = q_ref.shape[0]
  o_ref[...] = _first_rows(o_bd * inv_b[:, None], r).astype(o_ref.dtype)
  max_ref[...] = _first_rows(max_b, r)
  denom_ref[...] = _first_rows(denom_b, r)


def _merge_splits(o_nxhd, max_nxh, denom_nxh):
  """Combines the parts' softmaxes; parts that saw no token have weight 0."""
  max_nh = jnp.max(max_nxh, axis=1)
  max_nh = jnp.where(jnp.isfinite(max_nh), max_nh, 0.0)
  weight_nxh = denom_nxh * jnp.exp(max_nxh - max_nh[:, None])
  total_nh = jnp.sum(weight_nxh, axis=1)
  o_nhd = jnp.sum(weight_nxh[..., None] * o_nxhd, axis=1)
  return o_nhd / jnp.where(total_nh > 0, total_nh, 1.0)[..., None]


def paged_attention(
  q_nhd: jax.Array,
  k_pages_kpsd: jax.Array,
  v_pages_kpsd: jax.Array,
  lengths_n: jax.Array,
  page_indices_nm: jax.Array,
  *,
  sm_scale: float,
  sliding_window: int | None = None,
  logit_softcap: float | None = None,
  sinks_h: jax.Array | None = None,
  block_sizes: BlockSizes | None = None,
  precision: jax.lax.Precision = jax.lax.Precision.HIGH,
  interpret: Any = False,
) -> jax.Array:
  """Paged decode attention on GPU; arguments as in `jaxrl.kernels.paged_attention`.

  `lengths_n` must already be clipped to `[0, m * s]` (the public function does it);
  `sliding_window` is None or an int >= 1, `logit_softcap` None or a float > 0, `sinks_h`
  None or float32 `[h]`. `precision`
  applies to float32 pools multiplied by dots (module docstring). `interpret` goes to
  `pl.pallas_call` as is.
  """
  n, h, d = q_nhd.shape
  k, _, s, _ = k_pages_kpsd.shape
  m = page_indices_nm.shape[1]
  g = h // k
  pool_dtype = jnp.dtype(k_pages_kpsd.dtype)
  wide = pool_dtype.itemsize >= 4
  dot_min_group = (block_sizes and block_sizes.dot_min_group) or default_dot_min_group(
    pool_dtype, precision
  )
  dot = g >= dot_min_group
  parts = TF32_PARTS[precision] if dot and pool_dtype == jnp.float32 else 0
  if dot:
    b = min(max(_MIN_DOT, _next_pow2(g)), _MAX_HEADS_PER_PROGRAM)
    target = _TARGET_BLOCK_TOKENS_F32 if wide else _TARGET_BLOCK_TOKENS
  else:
    b = min(_next_pow2(g), _MAX_HEADS_PER_PROGRAM)
    target = max(1, _SUM_BLOCK_ELEMENTS // (b * d))
  r = pl.cdiv(g, b)
  # The pages a sequence's keys are read from: all m of the table, or with a window of w
  # tokens at most the cdiv(w - 1, s) + 1 pages that w tokens can span.
  read_pages = m if sliding_window is None else min(m, pl.cdiv(sliding_window - 1, s) + 1)
  # A 16-bit cache read over a short or medium span: small blocks at 2 warps and 1 stage.
  small = dot and not wide and read_pages * s <= _MEDIUM_CONTEXT_TOKENS
  if small:
    short = read_pages * s <= _SHORT_CONTEXT_TOKENS
    target = _SHORT_BLOCK_TOKENS if short else _MEDIUM_BLOCK_TOKENS
  bs = resolve_block_sizes(
    block_sizes,
    num_programs=n * k * r,
    page_size=s,
    pages_per_seq=read_pages,
    target_tokens=target,
    min_tokens=_MIN_DOT if dot else 1,
    num_warps=2 if small else 4,
    num_stages=1 if small else 2,
  )
  c, x = bs.pages_per_compute_block, bs.num_splits
  _check_shapes(page_size=s, head_dim=d, pages_per_block=c, dot=dot)
  table_blocks = pl.cdiv(m, c)
  read_blocks = table_blocks
  if sliding_window is not None:  # w tokens span at most this many blocks of t tokens
    read_blocks = min(table_blocks, pl.cdiv(sliding_window - 1, c * s) + 1)
  blocks_per_split = pl.cdiv(read_blocks, x)
  # No part reads past the length's last block, so whole blocks of the table suffice (and,
  # without a window, whole parts: the last part's blocks past the table exit at once).
  m_padded = max(x * blocks_per_split, table_blocks) * c
  # Padded entries name page 0, which exists; they lie past every length, so are never read.
  page_indices_nm = jnp.pad(page_indices_nm, ((0, 0), (0, m_padded - m)))
  q_nhd_in = q_nhd.astype(pool_dtype if dot else jnp.float32)
  if _is_pow2(g):
    # Each program reads its kv head's query heads in place (q_rows = min(g, b) of them, a
    # Triton block) and repeats them to b rows in registers; it writes q_rows rows back, so
    # that no padded copy of q or of the output passes through memory.
    q_rows, q_in = min(g, b), q_nhd_in
    sinks_in = sinks_h
  else:
    # [n, k * r * b, d]: query heads of one kv head, padded with zero heads up to r * b.
    q_nkgd = q_nhd_in.reshape(n, k, g, d)
    q_rows = b
    q_in = jnp.pad(q_nkgd, ((0, 0), (0, 0), (0, r * b - g), (0, 0))).reshape(n, k * r * b, d)
    if sinks_h is not None:  # the padded heads' sinks are 0: their outputs are dropped
      sinks_in = jnp.pad(sinks_h.reshape(k, g), ((0, 0), (0, r * b - g))).reshape(-1)
  heads = k * r * q_rows

  def kv_head(j):
    return jax.lax.div(j, r)

  kernel = functools.partial(
    _kernel,
    sm_scale=sm_scale,
    pages_per_block=c,
    blocks_per_split=blocks_per_split,
    compute_rows=b,
    dot=dot,
    parts=parts,
    sliding_window=sliding_window,
    logit_softcap=logit_softcap,
    sinks=sinks_h is not None,
  )
  sink_inputs, sink_specs = [], []
  if sinks_h is not None:
    sink_inputs = [sinks_in.astype(jnp.float32)]
    sink_specs = [pl.BlockSpec((q_rows,), lambda i, j, y: (j,))]
  pages_spec = pl.BlockSpec((None, *k_pages_kpsd.shape[1:]), lambda i, j, y: (kv_head(j), 0, 0, 0))
  f32 = jnp.float32
  # One part (x = 1) needs no merge: the kernel writes the output in q's dtype.
  out_dtype = q_nhd.dtype if x == 1 else f32
  o_nxhd, max_nxh, denom_nxh = pl.pallas_call(
    kernel,
    grid=(n, k * r, x),
    in_specs=[
      pl.BlockSpec((1,), lambda i, j, y: (i,)),
      pl.BlockSpec((None, m_padded), lambda i, j, y: (i, 0)),
      pl.BlockSpec((None, q_rows, d), lambda i, j, y: (i, j, 0)),
      pages_spec,
      pages_spec,
      *sink_specs,
    ],
    out_specs=[
      pl.BlockSpec((None, None, q_rows, d), lambda i, j, y: (i, y, j, 0)),
      pl.BlockSpec((None, None, q_rows), lambda i, j, y: (i, y, j)),
      pl.BlockSpec((None, None, q_rows), lambda i, j, y: (i, y, j)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((n, x, heads, d), out_dtype),
      jax.ShapeDtypeStruct((n, x, heads), f32),
      jax.ShapeDtypeStruct((n, x, heads), f32),
    ],
    compiler_params=_TritonParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
    interpret=interpret,
    name="paged_attention_gpu",
  )(lengths_n, page_indices_nm, q_in, k_pages_kpsd, v_pages_kpsd, *sink_inputs)

  o_nhd = o_nxhd[:, 0] if x == 1 else _merge_splits(o_nxhd, max_nxh, denom_nxh)
  if heads != h:  # padded heads (g not a power of two) dropped
    o_nhd = o_nhd.reshape(n, k, r * b, d)[:, :, :g].reshape(n, h, d)
  return o_nhd.astype(q_nhd.dtype)
