"""Flash attention through cuDNN (`flash_attention(impl="cudnn")`), packed rows included.

cuDNN's fused attention ran one causal 4k-token row forward + backward 2.1x faster than the
Pallas GPU kernel on an H200 (docs/BENCHMARKS.md), but `jax.nn.dot_product_attention` takes no
segment ids, and the learner's packed rows need them. jax's own wrapper of that kernel
(`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, private: the one
`jax.nn.dot_product_attention` calls) also takes cuDNN's packed layout (Hopper and later): per
row, the first token (`q_offsets`) and the length (`q_seqlen`) of each of at most M sequences,
each attending to itself alone, causally from its own first token. That is this package's
visibility rule when a batch is laid out as `jaxrl.train.packing` lays it out:
- each segment is one contiguous run of its id, and ids increase along the row (padding, a
  negative id, may lie between runs);
- with `causal`, positions increase along each run (packing restarts them at 0 in each);
- queries and keys have the same ids and positions (self-attention, q_len == kv_len);
- a row holds at most M runs (`BlockSizes.max_segments`).
`packed_layout` checks these on the device and builds the offsets; a batch that fails any of
them runs the fallback (the Pallas GPU kernel) instead, through one `lax.cond`, so the result
always follows this package's rule. (XLA's GPU runtime picks a conditional's branch on the
host: each call waits for the device once; docs/BENCHMARKS.md.) Rows without segment ids are
one sequence each: cuDNN's plain causal mask, positions (if given) checked to increase along
the row. A sliding window or a logit softcap never comes here: `flash_attention` runs the
fallback for them (cuDNN's own sliding window has not been tested against this rule; jax's
wrapper takes no cap).

Padding: cuDNN neither reads nor writes the tokens outside the segments, so their outputs and
gradients are whatever the buffers held. They are selected away: q, k and v are zeroed there
before the call (so their gradient there is zero, whatever cuDNN leaves) and so is the output.

Memory: cuDNN keeps float32 softmax statistics of `[rows * M, heads, q_len]` for the backward
pass, M times the Pallas kernel's log-sum-exp; hence a small default M.

Remat: jax names nothing inside its custom_vjp, so `jax.checkpoint` policies find cuDNN's
forward by primitive (`CUDNN_FORWARD_PRIMITIVES`; `api.save_attention_policy`).

jax < 0.11.1 scales packed kv offsets by the query heads instead of the kv heads (fixed in
0.11.1), so there packed rows with grouped-query heads repeat k and v to the query heads first.

Shapes: b batch, t tokens (queries = keys), h query heads, k kv heads, e head dim, m segment
slots (M).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

try:  # private: a jax that moves it loses impl="cudnn" (a clear error), nothing else
  from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover (every jax this project supports has it)
  _cudnn = None

# The forward primitives of jax's cuDNN attention (the core one, and the wrapper that carries
# its partitioning rules), whose outputs (attention out, softmax statistics) a remat policy keeps.
CUDNN_FORWARD_PRIMITIVES = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper")
DEFAULT_MAX_SEGMENTS = 16
_KV_OFFSETS_SCALED_BY_Q_HEADS = jax.__version_info__ < (0, 11, 1)
_DTYPES = ("bfloat16", "float16")


class PackedLayout(NamedTuple):
  """A batch's rows in cuDNN's packed layout, as jax's wrapper takes it.

  Attributes:
    seqlen_bm: int32 tokens of each row's segments in order; -1 past the row's last.
    offsets_bm: int32 `[b, m + 1]`: first token of each segment; -1 past the last.
    in_segment_bt: bool, the token belongs to a segment (not padding).
    servable: bool scalar: the batch is laid out as cuDNN's packed layout needs (module
      docstring); where False the offsets describe some other attention.
  """

  seqlen_bm: jax.Array
  offsets_bm: jax.Array
  in_segment_bt: jax.Array
  servable: jax.Array


def packed_layout(
  q_segment_ids_bt, kv_segment_ids_bt, q_positions_bt, kv_positions_bt, *, max_segments: int,
  causal: bool,
) -> PackedLayout:  # fmt: skip
  """The segments of each row as cuDNN's offsets and lengths, and whether they describe this
  package's visibility rule (`PackedLayout.servable`)."""
  b, t = q_segment_ids_bt.shape
  seg = q_segment_ids_bt.astype(jnp.int32)
  token_t = jnp.arange(t, dtype=jnp.int32)
  in_segment = seg >= 0
  before = jnp.full((b, 1), -1, jnp.int32)
  previous = jnp.concatenate([before, seg[:, :-1]], axis=1)
  starts = in_segment & (seg != previous)
  # Each run's id above every id before it: no id comes back after another run or padding.
  seen_max = jax.lax.cummax(jnp.where(in_segment, seg, -1), axis=1)
  earlier_max = jnp.concatenate([before, seen_max[:, :-1]], axis=1)
  ok = jnp.all(~starts | (seg > earlier_max))
  ok &= jnp.all(kv_segment_ids_bt == q_segment_ids_bt)
  if causal:
    # Causal by position is causal by token within a run iff positions increase along it.
    ok &= jnp.all(~in_segment | starts | _increases(q_positions_bt))
    ok &= jnp.all(~in_segment | (kv_positions_bt == q_positions_bt))
  runs_b = jnp.sum(starts, axis=1, dtype=jnp.int32)
  ok &= jnp.all(runs_b <= max_segments)
  run_bt = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # run of each token (-1: none yet)
  rows_b1 = jnp.arange(b)[:, None]
  # Slot m + 1 (past the array) takes what is not a run's first token, and is dropped.
  first_slot = jnp.where(starts & (run_bt < max_segments), run_bt, max_segments + 1)
  offsets = jnp.full((b, max_segments + 1), -1, jnp.int32)
  offsets = offsets.at[rows_b1, first_slot].set(jnp.broadcast_to(token_t, (b, t)), mode="drop")
  slot = jnp.where(in_segment & (run_bt < max_segments), run_bt, max_segments)
  seqlen = jnp.zeros((b, max_segments), jnp.int32).at[rows_b1, slot].add(1, mode="drop")
  seqlen = jnp.where(jnp.arange(max_segments)[None] < runs_b[:, None], seqlen, -1)
  return PackedLayout(seqlen, offsets, in_segment, ok)


def _increases(positions_bt):
  """bool `[b, t]`: each position above the one before it (True at the row's first)."""
  pos = positions_bt.astype(jnp.int32)
  return jnp.concatenate([jnp.ones_like(pos[:, :1], bool), pos[:, 1:] > pos[:, :-1]], axis=1)


def available() -> bool:
  """This jax has the cuDNN attention module impl="cudnn" runs through."""
  return _cudnn is not None


def check_inputs(q_bthe, k_bske, *, max_segments: int) -> None:
  """What cuDNN's flash attention takes, checked before tracing it (clear errors)."""
  if _cudnn is None:
    raise ValueError(
      f"impl='cudnn' needs jax's cuDNN attention module (jax._src.cudnn), which jax "
      f"{jax.__version__} does not have; use impl='pallas_gpu'."
    )
  if q_bthe.dtype.name not in _DTYPES:
    raise ValueError(
      f"impl='cudnn' takes {' or '.join(_DTYPES)} inputs, got {q_bthe.dtype}: cast them, or use "
      "impl='pallas_gpu' (which also takes float32)."
    )
  if q_bthe.shape[1] != k_bske.shape[1]:
    raise ValueError(
      f"impl='cudnn' is self-attention over whole rows (q_len == kv_len), got q_len "
      f"{q_bthe.shape[1]} and kv_len {k_bske.shape[1]}; a prefill chunk after cached keys "
      "takes impl='pallas_gpu'."
    )
  head_dim = q_bthe.shape[-1]
  if head_dim % 8 or head_dim > 256:
    raise ValueError(
      f"impl='cudnn' needs head_dim a multiple of 8 and at most 256 (128 before Hopper), got "
      f"{head_dim}; use impl='pallas_gpu'."
    )
  if max_segments < 2:
    raise ValueError(
      f"BlockSizes.max_segments must be >= 2 for cuDNN's packed layout, got {max_segments}."
    )


def _call(q, k, v, *, sm_scale: float, mask_type, layout: PackedLayout | None):
  """jax's cuDNN attention; NotImplementedError (an unsupported GPU or shape) made clear."""
  args = ()  # bias, mask, q and kv lengths, q and kv offsets:
  if layout is not None:
    args = (None, None, layout.seqlen_bm, layout.seqlen_bm, layout.offsets_bm, layout.offsets_bm)
  try:
    return _cudnn.dot_product_attention(
      q, k, v, *args, scale=sm_scale, mask_type=mask_type, qkv_layout="BTNH"
    )
  except (NotImplementedError, RuntimeError) as e:
    what = "packed rows (segment ids)" if layout is not None else "attention"
    raise ValueError(
      f"impl='cudnn' could not run {what} here: {e} (cuDNN flash attention needs an NVIDIA GPU "
      "with cuDNN 9, and Hopper or later for packed rows); use impl='pallas_gpu'."
    ) from e


def _packed(q_bthe, k_bske, v_bske, layout: PackedLayout, *, causal: bool, sm_scale: float):
  keep = layout.in_segment_bt[:, :, None, None]
  q, k, v = (jnp.where(keep, x, jnp.zeros((), x.dtype)) for x in (q_bthe, k_bske, v_bske))
  if _KV_OFFSETS_SCALED_BY_Q_HEADS and k.shape[2] != q.shape[2]:
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  mask = _cudnn.MaskType.PADDING_CAUSAL if causal else _cudnn.MaskType.PADDING
  out = _call(q, k, v, sm_scale=sm_scale, mask_type=mask, layout=layout)
  return jnp.where(keep, out, jnp.zeros((), out.dtype))


def attention(
  q_bthe: jax.Array,
  k_bske: jax.Array,
  v_bske: jax.Array,
  meta,
  *,
  segments: bool,
  positions: bool,
  causal: bool,
  sm_scale: float,
  max_segments: int,
  fallback: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
  """`flash_attention`'s rule through cuDNN where the batch's layout allows (module
  docstring), else `fallback(q, k, v)`. `meta`: the segment ids and positions with their
  defaults filled in (`reference.Metadata`); `segments` / `positions`: whether the caller gave
  any (without segment ids a row is one sequence: cuDNN's plain mask). Differentiable."""
  check_inputs(q_bthe, k_bske, max_segments=max_segments)
  q_seg, kv_seg, q_pos, kv_pos = meta
  if not segments:
    plain = _cudnn.MaskType.CAUSAL if causal else _cudnn.MaskType.NO_MASK
    run = functools.partial(_call, sm_scale=sm_scale, mask_type=plain, layout=None)
    if not (causal and positions):
      return run(q_bthe, k_bske, v_bske)
    servable = jnp.all(_increases(q_pos)) & jnp.all(kv_pos == q_pos)
    return jax.lax.cond(servable, run, fallback, q_bthe, k_bske, v_bske)
  layout = packed_layout(q_seg, kv_seg, q_pos, kv_pos, max_segments=max_segments, causal=causal)
  packed = functools.partial(_packed, causal=causal, sm_scale=sm_scale)
  return jax.lax.cond(
    layout.servable,
    packed,
    lambda q, k, v, _: fallback(q, k, v),
    q_bthe, k_bske, v_bske, layout,
  )  # fmt: skip
