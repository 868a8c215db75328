"""Flash attention in pure jnp: the definition, the CPU path and the kernels' oracle.

Blockwise, not dense: on CPU this is the attention of whole training rows, where dense
attention's float32 `[heads, q_len, kv_len]` scores (and the probabilities autodiff keeps for
the backward pass) grow with the square of the length: 1 GiB per row of 4k tokens with 16
heads, several times that through the backward pass. Here a scan walks blocks of queries, and
for each a loop runs an online softmax over the blocks of keys it can see (block skipping, so
a causal row costs about half a dense one, and a sliding window only the blocks it covers);
the backward pass recomputes the probabilities from the saved log-sum-exp in the same loops.
Temporaries stay at a few blocks' worth. When q_len and kv_len fit in one block each, this is
plain dense attention.

Also here, shared with the kernels: the visibility rule (segments, causality and an optional
sliding window), the optional logit softcap and its derivative, the padding of token axes to
whole blocks, and the per-block ranges of blocks that can see each other.

Shapes: b batch, t query tokens, s key tokens, h query heads, k kv heads, g = h // k query
heads per kv head, e head dim; n query blocks of bq tokens, m key blocks of bk tokens.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST
# Default tokens per block: scores of 16 heads x 512 x 512 in float32 are 16 MiB, small next
# to a CPU's caches' worth of work per loop step, large enough that the loop's overhead is paid
# rarely.
_DEFAULT_BLOCK = 512


class Metadata(NamedTuple):
  """Who sees whom: int32 segment ids and positions of the query and key tokens."""

  q_segment_ids_bt: jax.Array
  kv_segment_ids_bs: jax.Array
  q_positions_bt: jax.Array
  kv_positions_bs: jax.Array


def visible(
  q_segment_ids,
  q_positions,
  kv_segment_ids,
  kv_positions,
  *,
  causal: bool,
  window: int | None = None,
):
  """Query sees key: same segment id, not negative (padding), when `causal` key position <=
  query position, and with a `window` (a static int, causal only) key position > query
  position - window: the window holds `window` positions, the query's own included
  (transformers' `sliding_window_overlay`). The arguments broadcast against each other (query
  ids along the second-to-last axis, key ids along the last)."""
  vis = (q_segment_ids == kv_segment_ids) & (kv_segment_ids >= 0)
  if causal:
    vis = vis & (kv_positions <= q_positions)
  if window is not None:
    vis = vis & (kv_positions > q_positions - window)
  return vis


def scaled_logits(logits, sm_scale: float, softcap: float | None = None):
  """(logits, tanh): `sm_scale * logits`, or with a `softcap` c those capped to
  `c * tanh(sm_scale * logits / c)` (Gemma 2: no logit leaves (-c, c); the mask applies after),
  the scale folded into the tanh's argument; `tanh` is for the backward pass (`softcap_grad`),
  None without a cap."""
  if softcap is None:
    return logits * sm_scale, None
  tanh = jnp.tanh(logits * (sm_scale / softcap))
  return softcap * tanh, tanh


def softcap_grad(dlogits, tanh):
  """The gradient of the scaled logits from that of the capped ones, through the tanh of
  `scaled_logits`: times `1 - tanh**2`. Without a cap (`tanh` None) `dlogits` as it is."""
  return dlogits if tanh is None else dlogits * (1.0 - tanh * tanh)


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def pad_tokens(x, length: int, value=0):
  """Pads axis 1 (tokens) of `x` with `value` up to `length`."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, length - x.shape[1])
  return jnp.pad(x, pad, constant_values=value) if length > x.shape[1] else x


def pad_metadata(meta: Metadata, t_pad: int, s_pad: int) -> Metadata:
  """Padding tokens get segment id -1: nobody sees them and they see nobody."""
  return Metadata(
    pad_tokens(meta.q_segment_ids_bt, t_pad, -1),
    pad_tokens(meta.kv_segment_ids_bs, s_pad, -1),
    pad_tokens(meta.q_positions_bt, t_pad),
    pad_tokens(meta.kv_positions_bs, s_pad),
  )


def block_visibility(
  meta: Metadata, *, bq: int, bk: int, causal: bool, window: int | None = None
) -> jax.Array:
  """bool `[b, n, m]`: query block n may see some key of block m (token axes padded).

  Conservative, from per-block summaries of the non-padding tokens (the range of segment ids,
  the range of query positions and the range of key positions), so it costs `b * n * m`, not
  `b * t * s`: a block pair it keeps may still see nothing, which the masks inside the block
  handle; a pair it drops certainly sees nothing. With a `window`, a pair is dropped where even
  the block's last key lies behind the window of its first query.
  """
  big = jnp.iinfo(jnp.int32).max
  small = jnp.iinfo(jnp.int32).min

  def summary(segment_ids, positions, block):
    """Per block: any non-padding token, and the range of its segment ids and positions
    (a block of padding only gets empty ranges, lo > hi; `maybe_bnm` drops it anyway)."""
    b, length = segment_ids.shape
    seg = segment_ids.reshape(b, length // block, block)
    pos = positions.reshape(b, length // block, block)
    real = seg >= 0
    seg_lo = jnp.min(jnp.where(real, seg, big), axis=-1)
    seg_hi = jnp.max(jnp.where(real, seg, -1), axis=-1)
    pos_lo = lambda: jnp.min(jnp.where(real, pos, big), axis=-1)
    pos_hi = lambda: jnp.max(jnp.where(real, pos, small), axis=-1)
    return jnp.any(real, axis=-1), seg_lo, seg_hi, pos_lo(), pos_hi()

  q_any, q_lo, q_hi, q_pos_lo, q_pos_hi = summary(meta.q_segment_ids_bt, meta.q_positions_bt, bq)
  kv_any, kv_lo, kv_hi, kv_pos_lo, kv_pos_hi = summary(
    meta.kv_segment_ids_bs, meta.kv_positions_bs, bk
  )
  maybe_bnm = q_any[:, :, None] & kv_any[:, None, :]
  maybe_bnm &= (q_lo[:, :, None] <= kv_hi[:, None, :]) & (kv_lo[:, None, :] <= q_hi[:, :, None])
  if causal:
    maybe_bnm &= kv_pos_lo[:, None, :] <= q_pos_hi[:, :, None]
  if window is not None:
    # No overflow: a real block's positions are the caller's, and where either block is all
    # padding (q_pos_lo = int32 max, kv_pos_hi = int32 min) the pair is dropped above already.
    maybe_bnm &= kv_pos_hi[:, None, :] > q_pos_lo[:, :, None] - window
  return maybe_bnm


def block_full_visibility(
  meta: Metadata, *, bq: int, bk: int, causal: bool, window: int | None = None
) -> jax.Array:
  """bool `[b, n, m]`: every query of block n sees every key of block m (token axes padded),
  so the pair needs no mask. Exact: both blocks hold no padding and one segment, the same one,
  when `causal` the block's last key position is at most its first query position, and with a
  `window` its first key position lies inside the window of its last query (each condition
  holds for every pair of tokens iff it holds for the extreme pair)."""

  def summary(segment_ids, positions, block):
    b, length = segment_ids.shape
    seg = segment_ids.reshape(b, length // block, block)
    pos = positions.reshape(b, length // block, block)
    one_segment = (jnp.min(seg, -1) == jnp.max(seg, -1)) & (jnp.min(seg, -1) >= 0)
    return one_segment, seg[..., 0], jnp.min(pos, -1), jnp.max(pos, -1)

  q_one, q_seg, q_pos_lo, q_pos_hi = summary(meta.q_segment_ids_bt, meta.q_positions_bt, bq)
  kv_one, kv_seg, kv_pos_lo, kv_pos_hi = summary(meta.kv_segment_ids_bs, meta.kv_positions_bs, bk)
  full_bnm = q_one[:, :, None] & kv_one[:, None, :] & (q_seg[:, :, None] == kv_seg[:, None, :])
  if causal:
    full_bnm &= kv_pos_hi[:, None, :] <= q_pos_lo[:, :, None]
  if window is not None:
    full_bnm &= kv_pos_lo[:, None, :] > q_pos_hi[:, :, None] - window
  return full_bnm


def full_block_run(
  full_xy: jax.Array, lo_x: jax.Array, hi_x: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """int32 `[first, end)` along the last axis: the first run of blocks that need no mask
  (`block_full_visibility`) inside `[lo, hi)`, the range a kernel visits; first == end == hi
  where there is none. The kernels visit `[lo, first)` and `[end, hi)` with masks and the run
  without: in a causal row all but the blocks on the diagonal, in a packed row all but those
  on a segment's edges, with a sliding window all but those on its two edges. Any later run
  (a block range over several segments) is visited with the mask: slower, not wrong."""
  y = full_xy.shape[-1]
  index = jnp.arange(y, dtype=jnp.int32)
  inside = (index >= lo_x[..., None]) & (index < hi_x[..., None])
  first = jnp.min(jnp.where(full_xy & inside, index, y), axis=-1)
  first = jnp.minimum(first, hi_x)
  # The first block at or after `first` that needs a mask (or hi) ends the run.
  end = jnp.min(jnp.where(~full_xy & (index >= first[..., None]), index, y), axis=-1)
  return first.astype(jnp.int32), jnp.minimum(end, hi_x).astype(jnp.int32)


def block_ranges(maybe_xy: jax.Array) -> tuple[jax.Array, jax.Array]:
  """int32 `[lo, hi)` along the last axis: the first and one past the last True; (0, 0) where
  there is none. Blocks in between that see nothing are visited anyway (and masked)."""
  y = maybe_xy.shape[-1]
  index = jnp.arange(y, dtype=jnp.int32)
  lo = jnp.min(jnp.where(maybe_xy, index, y), axis=-1)
  hi = jnp.max(jnp.where(maybe_xy, index + 1, 0), axis=-1)
  return jnp.where(hi > 0, lo, 0).astype(jnp.int32), hi.astype(jnp.int32)


def _block(requested: int | None, length: int) -> int:
  """A requested size, clipped to the length; by default near-equal blocks of <= 512."""
  if requested is not None:
    return min(requested, length)
  return -(-length // -(-length // _DEFAULT_BLOCK))


# `BlockSizes` fields only the Triton kernels have.
GPU_SETTINGS = (
  "num_warps",
  "num_stages",
  "num_warps_bwd",
  "num_stages_bwd",
  "block_q_dq",
  "block_kv_dq",
)


def reject_gpu_settings(block_sizes, impl: str) -> None:
  """A clear error for a GPU-only `BlockSizes` field given to `impl`."""
  for name in GPU_SETTINGS:
    if getattr(block_sizes, name) is not None:
      raise ValueError(
        f"BlockSizes.{name}={getattr(block_sizes, name)} is a GPU setting; impl={impl!r} "
        "takes only block_q, block_kv, block_q_bwd and block_kv_bwd."
      )


def resolve_block_sizes(block_sizes, *, t: int, s: int, backward: bool) -> tuple[int, int]:
  """(bq, bk) for one pass; the reference takes any size and no GPU setting."""
  if block_sizes is None:
    return _block(None, t), _block(None, s)
  reject_gpu_settings(block_sizes, "reference")
  if backward:
    return _block(block_sizes.block_q_bwd, t), _block(block_sizes.block_kv_bwd, s)
  return _block(block_sizes.block_q, t), _block(block_sizes.block_kv, s)


def _prepare(q_bthe, k_bske, v_bske, meta, bq, bk, causal, window):
  """Pads to whole blocks; the union over the batch of each query block's key-block range."""
  b, t = q_bthe.shape[:2]
  s = k_bske.shape[1]
  t_pad, s_pad = round_up(t, bq), round_up(s, bk)
  meta = pad_metadata(meta, t_pad, s_pad)
  maybe_nm = jnp.any(block_visibility(meta, bq=bq, bk=bk, causal=causal, window=window), axis=0)
  lo_n, hi_n = block_ranges(maybe_nm)
  padded = (pad_tokens(q_bthe, t_pad), pad_tokens(k_bske, s_pad), pad_tokens(v_bske, s_pad))
  return padded, meta, lo_n, hi_n


def _q_blocks(x_bt, bq: int):
  """`[b, t_pad, ...]` -> `[n, b, bq, ...]`, query blocks first, for the scan."""
  b, t_pad = x_bt.shape[:2]
  return jnp.moveaxis(x_bt.reshape(b, t_pad // bq, bq, *x_bt.shape[2:]), 1, 0)


def _from_q_blocks(x_nbq, t: int):
  n, b, bq = x_nbq.shape[:3]
  return jnp.moveaxis(x_nbq, 0, 1).reshape(b, n * bq, *x_nbq.shape[3:])[:, :t]


def _kv_block(x_bs, j, bk: int):
  return lax.dynamic_slice_in_dim(x_bs, j * bk, bk, axis=1)


def _logits(
  q_bqkge, k_bske, seg_q_bq, pos_q_bq, seg_kv_bs, pos_kv_bs, *, sm_scale, softcap, causal, window
):
  """Scaled (and capped) float32 logits `[b, k, g, bq, bk]`, the tanh of the cap
  (`scaled_logits`) and where they are visible."""
  raw = jnp.einsum("bqkge,bske->bkgqs", q_bqkge, k_bske, precision=_HIGHEST)
  logits, tanh = scaled_logits(raw, sm_scale, softcap)
  vis_bqs = visible(
    seg_q_bq[:, :, None],
    pos_q_bq[:, :, None],
    seg_kv_bs[:, None, :],
    pos_kv_bs[:, None, :],
    causal=causal,
    window=window,
  )
  return logits, tanh, vis_bqs[:, None, None]


def forward(
  q_bthe,
  k_bske,
  v_bske,
  meta: Metadata,
  *,
  causal: bool,
  sm_scale: float,
  block_sizes,
  window: int | None = None,
  softcap: float | None = None,
):
  """Attention output `[b, t, h, e]` in q's dtype and the float32 log-sum-exp `[b, h, t]` of
  each query's visible (capped) logits (+inf for a query that sees no key); `window`: the
  sliding window of `visible`, `softcap`: the logit cap of `scaled_logits`, None for none."""
  b, t, h, e = q_bthe.shape
  s, kh = k_bske.shape[1:3]
  g = h // kh
  bq, bk = resolve_block_sizes(block_sizes, t=t, s=s, backward=False)
  (q_bthe, k_bske, v_bske), meta, lo_n, hi_n = _prepare(
    q_bthe, k_bske, v_bske, meta, bq, bk, causal, window
  )
  f32 = jnp.float32
  q_nbqkge = _q_blocks(q_bthe.reshape(*q_bthe.shape[:2], kh, g, e), bq)

  def q_block(xs):
    q_bqkge, seg_q_bq, pos_q_bq, lo, hi = xs
    q_bqkge = q_bqkge.astype(f32)

    def body(j, carry):
      acc_bkgqe, max_bkgq, denom_bkgq = carry
      logits, _, vis = _logits(
        q_bqkge,
        _kv_block(k_bske, j, bk).astype(f32),
        seg_q_bq,
        pos_q_bq,
        _kv_block(meta.kv_segment_ids_bs, j, bk),
        _kv_block(meta.kv_positions_bs, j, bk),
        sm_scale=sm_scale,
        softcap=softcap,
        causal=causal,
        window=window,
      )
      logits = jnp.where(vis, logits, -jnp.inf)
      new_max = jnp.maximum(max_bkgq, jnp.max(logits, axis=-1))
      # A query that has seen no key yet keeps max -inf; any finite stand-in keeps exp() at 0.
      safe_max = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
      probs = jnp.exp(logits - safe_max[..., None])
      rescale = jnp.exp(max_bkgq - safe_max)
      pv = jnp.einsum(
        "bkgqs,bske->bkgqe", probs, _kv_block(v_bske, j, bk).astype(f32), precision=_HIGHEST
      )
      acc_bkgqe = acc_bkgqe * rescale[..., None] + pv
      return acc_bkgqe, new_max, denom_bkgq * rescale + jnp.sum(probs, axis=-1)

    init = (
      jnp.zeros((b, kh, g, bq, e), f32),
      jnp.full((b, kh, g, bq), -jnp.inf, f32),
      jnp.zeros((b, kh, g, bq), f32),
    )
    acc, max_bkgq, denom_bkgq = lax.fori_loop(lo, hi, body, init)
    seen = denom_bkgq > 0
    safe_denom = jnp.where(seen, denom_bkgq, 1.0)
    o_bkgqe = jnp.where(seen[..., None], acc / safe_denom[..., None], 0.0)
    lse_bkgq = jnp.where(seen, max_bkgq + jnp.log(safe_denom), jnp.inf)
    o_bqkge = jnp.moveaxis(o_bkgqe, 3, 1).astype(q_bthe.dtype)
    return o_bqkge, jnp.moveaxis(lse_bkgq, 3, 1)

  xs = (
    q_nbqkge,
    _q_blocks(meta.q_segment_ids_bt, bq),
    _q_blocks(meta.q_positions_bt, bq),
    lo_n,
    hi_n,
  )
  o_nbqkge, lse_nbqkg = lax.map(q_block, xs)
  o_bthe = _from_q_blocks(o_nbqkge, t).reshape(b, t, h, e)
  lse_bht = jnp.moveaxis(_from_q_blocks(lse_nbqkg, t).reshape(b, t, h), 1, 2)
  return o_bthe, lse_bht


def backward(
  q_bthe,
  k_bske,
  v_bske,
  meta: Metadata,
  o_bthe,
  lse_bht,
  do_bthe,
  *,
  causal: bool,
  sm_scale: float,
  block_sizes,
  window: int | None = None,
  softcap: float | None = None,
  dlse_bht=None,
):
  """(dq, dk, dv) in the inputs' dtypes, FlashAttention-2 style: the probabilities of each
  block pair (and the cap's tanh) are recomputed from the log-sum-exp; one pass over the query
  blocks adds each pair's share to dq (carried per query block) and to dk and dv (float32,
  whole length). `dlse_bht`: a cotangent of the log-sum-exp too (f32 `[b, h, t]`; the api's
  attention sinks), or None."""
  b, t, h, e = q_bthe.shape
  s, kh = k_bske.shape[1:3]
  g = h // kh
  bq, bk = resolve_block_sizes(block_sizes, t=t, s=s, backward=True)
  f32 = jnp.float32
  # delta_i = sum_j p_ij dp_ij = do_i . o_i: the softmax's backward, one number per query.
  delta_bth = jnp.einsum(
    "bthe,bthe->bth", do_bthe.astype(f32), o_bthe.astype(f32), precision=_HIGHEST
  )
  if dlse_bht is not None:  # the log-sum-exp's own cotangent (attention sinks)
    delta_bth = delta_bth - jnp.moveaxis(dlse_bht, 1, 2)
  lse_bth = jnp.moveaxis(lse_bht, 1, 2)
  (q_p, k_p, v_p), meta, lo_n, hi_n = _prepare(q_bthe, k_bske, v_bske, meta, bq, bk, causal, window)
  t_pad, s_pad = q_p.shape[1], k_p.shape[1]

  def split(x_bth):
    return _q_blocks(x_bth.reshape(b, x_bth.shape[1], kh, g, *x_bth.shape[3:]), bq)

  def q_block(carry, xs):
    dk_bske, dv_bske = carry
    q_bqkge, do_bqkge, lse_bqkg, delta_bqkg, seg_q_bq, pos_q_bq, lo, hi = xs
    q_bqkge, do_bqkge = q_bqkge.astype(f32), do_bqkge.astype(f32)
    lse_bkgq = jnp.moveaxis(lse_bqkg, 1, 3)
    delta_bkgq = jnp.moveaxis(delta_bqkg, 1, 3)

    def body(j, carry):
      dq_bqkge, dk_bske, dv_bske = carry
      k_blk = _kv_block(k_p, j, bk).astype(f32)
      v_blk = _kv_block(v_p, j, bk).astype(f32)
      logits, tanh, vis = _logits(
        q_bqkge,
        k_blk,
        seg_q_bq,
        pos_q_bq,
        _kv_block(meta.kv_segment_ids_bs, j, bk),
        _kv_block(meta.kv_positions_bs, j, bk),
        sm_scale=sm_scale,
        softcap=softcap,
        causal=causal,
        window=window,
      )
      probs = jnp.where(vis, jnp.exp(logits - lse_bkgq[..., None]), 0.0)
      dprobs = jnp.einsum("bqkge,bske->bkgqs", do_bqkge, v_blk, precision=_HIGHEST)
      dlogits = softcap_grad(probs * (dprobs - delta_bkgq[..., None]), tanh) * sm_scale
      dq_bqkge += jnp.einsum("bkgqs,bske->bqkge", dlogits, k_blk, precision=_HIGHEST)
      dk_blk = jnp.einsum("bkgqs,bqkge->bske", dlogits, q_bqkge, precision=_HIGHEST)
      dv_blk = jnp.einsum("bkgqs,bqkge->bske", probs, do_bqkge, precision=_HIGHEST)
      dk_bske = lax.dynamic_update_slice_in_dim(
        dk_bske, _kv_block(dk_bske, j, bk) + dk_blk, j * bk, axis=1
      )
      dv_bske = lax.dynamic_update_slice_in_dim(
        dv_bske, _kv_block(dv_bske, j, bk) + dv_blk, j * bk, axis=1
      )
      return dq_bqkge, dk_bske, dv_bske

    init = (jnp.zeros_like(q_bqkge), dk_bske, dv_bske)
    dq_bqkge, dk_bske, dv_bske = lax.fori_loop(lo, hi, body, init)
    return (dk_bske, dv_bske), dq_bqkge.astype(q_bthe.dtype)

  xs = (
    split(q_p),
    split(pad_tokens(do_bthe, t_pad)),
    # Padding queries: lse +inf makes their probabilities exp(-inf) = 0.
    split(pad_tokens(lse_bth, t_pad, jnp.inf)),
    split(pad_tokens(delta_bth, t_pad)),
    _q_blocks(meta.q_segment_ids_bt, bq),
    _q_blocks(meta.q_positions_bt, bq),
    lo_n,
    hi_n,
  )
  zeros = jnp.zeros((b, s_pad, kh, e), f32)
  (dk_bske, dv_bske), dq_nbqkge = lax.scan(q_block, (zeros, zeros), xs)
  dq_bthe = _from_q_blocks(dq_nbqkge, t).reshape(b, t, h, e)
  return (
    dq_bthe,
    dk_bske[:, :s].astype(k_bske.dtype),
    dv_bske[:, :s].astype(v_bske.dtype),
  )
