"""Paged decode attention as a Pallas Mosaic TPU kernel.

Grid `(n, k)`: one program per (sequence, kv head) computes the `g` query heads of that group.
Lengths and page ids are scalar-prefetched into SMEM; the pools stay in HBM and the program
copies one compute block (`pages_per_compute_block` pages) at a time into a two-slot VMEM
buffer, starting block `i + 1`'s DMAs before computing block `i`, and stops after the last block
holding tokens of its sequence (pages past the length inside that block are not copied either).
With a sliding window of w tokens the loop starts at the block holding position `length - w`,
the window's first, and pages of that block before the window are not copied; positions before
the window are masked like those past the length. An online softmax in float32 runs over the
blocks; with attention sinks it starts from each head's sink (a logit whose value is zero) as
if that were a visited key.

Shapes: n sequences, h query heads, k kv heads, g = h // k, d head dim, p pages in the pool,
s tokens per page, m pages per sequence, c pages per compute block, t = c * s tokens per block.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl.kernels.paged_attention.api import BlockSizes
from jaxrl.kernels.paged_attention.reference import scale_logits

# Tokens per compute block the defaults aim for: enough bytes per step to hide DMA latency,
# small enough that 2 slots x (k, v) stay far below VMEM.
_TARGET_BLOCK_TOKENS = 512
# Full f32 matmuls, whatever Mosaic's default: decode is bound by the HBM reads, not the MXU.
_HIGHEST = jax.lax.Precision.HIGHEST


def resolve_block_sizes(block_sizes: BlockSizes | None, *, page_size: int, pages_per_seq: int):
  """Fills the fields this kernel uses and rejects those it does not."""
  bs = block_sizes or BlockSizes()
  for name in ("num_splits", "num_warps", "num_stages", "dot_min_group"):
    value = getattr(bs, name)
    if value is not None and not (name == "num_splits" and value == 1):
      raise ValueError(
        f"BlockSizes.{name}={value} is a GPU setting; impl='pallas_tpu' takes only "
        "pages_per_compute_block."
      )
  c = bs.pages_per_compute_block
  if c is None:
    c = max(1, min(pages_per_seq, _TARGET_BLOCK_TOKENS // page_size))
  return BlockSizes(pages_per_compute_block=c)


def _kernel(
  lengths_ref,  # SMEM int32[n]
  page_indices_ref,  # SMEM int32[n * m_padded]
  q_ref,  # VMEM f32[g, d]
  k_hbm_ref,  # HBM [k, p, s, d]
  v_hbm_ref,  # HBM [k, p, s, d]
  *refs,  # sinks_ref (VMEM f32[g, 1], with sinks), then the output and the scratch below
  sm_scale: float,
  pages_per_block: int,
  pages_per_seq: int,
  sliding_window: int | None,
  logit_softcap: float | None,
  sinks: bool = False,
):
  sinks_ref, refs = (refs[0], refs[1:]) if sinks else (None, refs)
  _body(lengths_ref, page_indices_ref, q_ref, k_hbm_ref, v_hbm_ref, sinks_ref, *refs,
        sm_scale=sm_scale, pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
        sliding_window=sliding_window, logit_softcap=logit_softcap)  # fmt: skip


def _body(
  lengths_ref,
  page_indices_ref,
  q_ref,
  k_hbm_ref,
  v_hbm_ref,
  sinks_ref,  # VMEM f32[g, 1], or None
  o_ref,  # VMEM f32[g, d], also the unnormalised accumulator
  k_buf_ref,  # VMEM [2, c, s, d]
  v_buf_ref,  # VMEM [2, c, s, d]
  max_ref,  # VMEM f32[g, 1]
  denom_ref,  # VMEM f32[g, 1]
  sems,  # DMA semaphores [2 (k, v), 2 (slot)]
  *,
  sm_scale: float,
  pages_per_block: int,
  pages_per_seq: int,
  sliding_window: int | None,
  logit_softcap: float | None,
):
  seq, head = pl.program_id(0), pl.program_id(1)
  _, _, s, d = k_buf_ref.shape
  t = pages_per_block * s
  length = lengths_ref[seq]
  # lax.div/rem, not // and %: the lengths are non-negative, and Python-style integer
  # division lowers through `sign`, whose Mosaic rule asks for the TPU generation, which a
  # CPU-only export (the lowering test) cannot tell.
  num_blocks = jax.lax.div(length + t - 1, t)
  num_pages = jax.lax.div(length + s - 1, s)
  if sliding_window is None:
    first_block, first_page = 0, None
  else:
    # Positions from `window_start` on are seen; blocks and pages wholly before it are skipped.
    # The first block visited holds `window_start`, so every block visited has a valid token.
    window_start = length - sliding_window
    first_token = jnp.maximum(window_start, 0)
    first_block = jax.lax.div(first_token, t)
    first_page = jax.lax.div(first_token, s)

  def block_copies(block, slot):
    """DMA descriptors of the pages of `block` that hold tokens, with the page's guard."""
    copies = []
    for j in range(pages_per_block):
      page_pos = block * pages_per_block + j
      page = page_indices_ref[seq * pages_per_seq + page_pos]
      for src, dst, sem in (
        (k_hbm_ref, k_buf_ref, sems.at[0, slot]),
        (v_hbm_ref, v_buf_ref, sems.at[1, slot]),
      ):
        needed = page_pos < num_pages
        if first_page is not None:  # pages before the window are not copied
          needed &= page_pos >= first_page
        copies.append((needed, pltpu.make_async_copy(src.at[head, page], dst.at[slot, j], sem)))
    return copies

  def start(block, slot):
    for needed, copy in block_copies(block, slot):
      pl.when(needed)(copy.start)

  def wait(block, slot):
    for needed, copy in block_copies(block, slot):
      pl.when(needed)(copy.wait)

  o_ref[...] = jnp.zeros_like(o_ref)
  if sinks_ref is None:
    max_ref[...] = jnp.full_like(max_ref, -jnp.inf)
    denom_ref[...] = jnp.zeros_like(denom_ref)
  else:  # the sink as a first key: logit the sink, weight exp(0) = 1, value zero
    max_ref[...] = sinks_ref[...]
    denom_ref[...] = jnp.ones_like(denom_ref)

  @pl.when(num_blocks > first_block)
  def _():
    start(first_block, 0 if sliding_window is None else jax.lax.rem(first_block, 2))

  q_gd = q_ref[...]

  def body(i, carry):
    slot = jax.lax.rem(i, 2)

    @pl.when(i + 1 < num_blocks)
    def _():
      start(i + 1, 1 - slot)

    wait(i, slot)
    # Cast before merging pages: with f32 the (c, s, d) -> (t, d) reshape keeps the (8, 128)
    # tiling whenever s % 8 == 0.
    k_td = k_buf_ref[slot].astype(jnp.float32).reshape(t, d)
    v_td = v_buf_ref[slot].astype(jnp.float32).reshape(t, d)
    pos_gt = i * t + jax.lax.broadcasted_iota(jnp.int32, (q_gd.shape[0], t), 1)
    logits_gt = jax.lax.dot_general(
      q_gd, k_td, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    # `where`, not an additive mask: slots past the length, or before the window (pages not
    # copied keep an earlier block's or uninitialised data), may hold anything, NaN included.
    valid_gt = pos_gt < length
    if sliding_window is not None:
      valid_gt &= pos_gt >= window_start
    logits_gt = jnp.where(valid_gt, scale_logits(logits_gt, sm_scale, logit_softcap), -jnp.inf)
    pos_td = i * t + jax.lax.broadcasted_iota(jnp.int32, (t, d), 0)
    valid_td = pos_td < length
    if sliding_window is not None:
      valid_td &= pos_td >= window_start
    v_td = jnp.where(valid_td, v_td, 0.0)

    max_prev_g1 = max_ref[...]
    max_g1 = jnp.maximum(max_prev_g1, jnp.max(logits_gt, axis=1, keepdims=True))
    rescale_g1 = jnp.exp(max_prev_g1 - max_g1)  # every block has a valid token: max_g1 finite
    probs_gt = jnp.exp(logits_gt - max_g1)
    denom_ref[...] = rescale_g1 * denom_ref[...] + jnp.sum(probs_gt, axis=1, keepdims=True)
    max_ref[...] = max_g1
    o_ref[...] = rescale_g1 * o_ref[...] + jnp.dot(
      probs_gt, v_td, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    return carry

  jax.lax.fori_loop(first_block, num_blocks, body, 0)

  denom_g1 = denom_ref[...]
  o_ref[...] = o_ref[...] * jnp.where(denom_g1 > 0, 1.0 / denom_g1, 0.0)


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
  interpret: Any = False,
) -> jax.Array:
  """Paged decode attention on TPU; arguments as in `jaxrl.kernels.paged_attention`.

  `lengths_n` must already be clipped to `[0, m * s]` (the public function does it);
  `sliding_window` is None or an int >= 1, `logit_softcap` None or a float > 0, `sinks_h`
  None or float32 `[h]`.
  `interpret=True` runs the kernel in the Mosaic TPU
  interpreter (`pltpu.InterpretParams()`, which fills uninitialised buffers with NaN and raises
  on out-of-bounds reads); an `InterpretParams` is passed through as is.
  """
  n, h, d = q_nhd.shape
  k, _, s, _ = k_pages_kpsd.shape
  m = page_indices_nm.shape[1]
  g = h // k
  if s % 8:
    raise ValueError(
      f"impl='pallas_tpu' needs page_size to be a multiple of 8 (the TPU sublane count), got {s}."
    )
  c = resolve_block_sizes(block_sizes, page_size=s, pages_per_seq=m).pages_per_compute_block
  m_padded = pl.cdiv(m, c) * c
  # Pad the page table so the last block's page ids are in bounds; page 0 always exists and
  # the padded pages are never copied (they lie past every length).
  page_indices_flat = jnp.pad(page_indices_nm, ((0, 0), (0, m_padded - m))).reshape(-1)
  # q and out as [n, k, g, d] f32 so the block's two minor dims are whole array dims.
  q_nkgd = q_nhd.reshape(n, k, g, d).astype(jnp.float32)
  if interpret is True:
    interpret = pltpu.InterpretParams()

  qo_spec = pl.BlockSpec((None, None, g, d), lambda b, j, *_: (b, j, 0, 0))
  hbm_spec = pl.BlockSpec(memory_space=pl.ANY)
  kernel = functools.partial(
    _kernel,
    sm_scale=sm_scale,
    pages_per_block=c,
    pages_per_seq=m_padded,
    sliding_window=sliding_window,
    logit_softcap=logit_softcap,
    sinks=sinks_h is not None,
  )
  sink_inputs, sink_specs = [], []
  if sinks_h is not None:
    sink_inputs = [sinks_h.astype(jnp.float32).reshape(k, g, 1)]
    sink_specs = [pl.BlockSpec((None, g, 1), lambda b, j, *_: (j, 0, 0))]
  out_nkgd = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((n, k, g, d), jnp.float32),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(n, k),
      in_specs=[qo_spec, hbm_spec, hbm_spec, *sink_specs],
      out_specs=qo_spec,
      scratch_shapes=[
        pltpu.VMEM((2, c, s, d), k_pages_kpsd.dtype),
        pltpu.VMEM((2, c, s, d), v_pages_kpsd.dtype),
        pltpu.VMEM((g, 1), jnp.float32),
        pltpu.VMEM((g, 1), jnp.float32),
        pltpu.SemaphoreType.DMA((2, 2)),
      ],
    ),
    # Programs share nothing (double buffering is inside one program), so both axes can be
    # split across the TensorCores of a megacore chip.
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    interpret=interpret,
    name="paged_attention_tpu",
  )(lengths_n, page_indices_flat, q_nkgd, k_pages_kpsd, v_pages_kpsd, *sink_inputs)
  return out_nkgd.reshape(n, h, d).astype(q_nhd.dtype)
