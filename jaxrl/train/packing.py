"""Sequence packing: the sequences of a batch laid end to end in rows of one fixed length.

A padded batch is as long as its longest sequence, so a run whose responses grow meets new
shapes, and compiles a new update, whenever the longest one passes a length bucket. Packed,
every micro-batch has the shape `[rows, pack_length]` whatever the lengths: a row holds several
sequences, each sequence's positions restart at 0, and segment ids keep their attention apart
(`jaxrl.model.cache.dot_attention`), so every token's log-prob is the one its sequence gives it
alone. The losses take their per-sequence sums over segments instead of rows
(`policy_loss(segment_ids_bt=...)`) and keep the whole-batch normalisation, so the packed loss
and gradient are the padded ones up to float32 rounding.

Rows are filled first-fit decreasing: sequences longest first, each into the first row with
room. It is simple, deterministic, and never needs more than 11/9 of the fewest possible rows
plus one (Johnson, 1973); which row a sequence lands in does not change the loss, a sum over
sequences. A sequence is cut after its last trained target (what follows is padding), and one
with no trained target is left out: it adds nothing to the loss, its gradient or its metrics.

Glossary: n sequences (rows of the padded batch), t positions of a padded row, m micro-batches,
b packed rows per micro-batch, p positions per packed row, l layers, k experts per token.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxrl.train.batch import TrainBatch
from jaxrl.train.routing import fill_padding

log = logging.getLogger(__name__)

PACK_MULTIPLE = 8  # packed row lengths are multiples of this


class MicroBatch(NamedTuple):
  """One micro-batch as the update's loss reads it. Position t of every `_bt` array is the
  input token `inputs_bt[:, t]` and its target, the next token of the same sequence.

  Padded rows hold one sequence each (`positions_bt` and `segment_ids_bt` None, `advantages`
  one per row, `[b]`); packed rows hold several (`advantages` one per position, `[b, t]`).

  Attributes:
    inputs_bt: int32 token ids the model reads.
    targets_bt: int32 token ids whose log-probs are trained.
    mask_bt: float32 1 where the target is trained on (a response token).
    old_logp_bt: float32 log-probs the ratio is taken against (behaviour or proximal).
    behaviour_logp_bt: float32 log-probs of the policy that sampled the targets.
    advantages: float32 `[b]` (padded) or `[b, t]` (packed).
    positions_bt: int32 position of each input in its sequence (0 at each segment's start).
    segment_ids_bt: int32 sequence of each position within its row: 0, 1, ...; -1 for padding
      (attended by nothing, as `jaxrl.kernels.flash_attention` takes it too).
    routes_btlk: MoE routing replay: int32 experts of each input token per layer, or None.
  """

  inputs_bt: np.ndarray
  targets_bt: np.ndarray
  mask_bt: np.ndarray
  old_logp_bt: np.ndarray
  behaviour_logp_bt: np.ndarray
  advantages: np.ndarray
  positions_bt: np.ndarray | None = None
  segment_ids_bt: np.ndarray | None = None
  routes_btlk: np.ndarray | None = None


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def auto_pack_length(max_seq_len: int, max_new_tokens: int, longest_prompt: int | None) -> int:
  """Positions per packed row when `train.pack_length` is -1 (auto): room for the longest
  sequence the run can meet, the longest prompt plus `max_new_tokens` (capped by the model's
  `max_seq_len`, which generation never passes), less its last token, which is only a target;
  without prompt lengths, room for `max_seq_len` tokens."""
  longest = max_seq_len if longest_prompt is None else longest_prompt + max_new_tokens
  return round_up(max(min(longest, max_seq_len) - 1, 1), PACK_MULTIPLE)


def row_length(longest: int, pack_length: int) -> int:
  """The packed row length for a batch whose longest sequence needs `longest` positions:
  `pack_length`, or where that is too short, the next multiple of a quarter of it (so that the
  rare longer batch meets one of a few shapes, not a new one per length)."""
  if longest <= pack_length:
    return pack_length
  return round_up(longest, round_up(max(pack_length // 4, 1), PACK_MULTIPLE))


def sequence_lengths(mask_nt: np.ndarray) -> np.ndarray:
  """Positions each padded row needs: up to and including its last trained target; 0 for a
  row with none."""
  mask_nt = np.asarray(mask_nt) > 0
  last_n = mask_nt.shape[1] - np.argmax(mask_nt[:, ::-1], axis=1)
  return np.where(mask_nt.any(axis=1), last_n, 0)


def first_fit_decreasing(
  lengths_n: np.ndarray, capacity: int, max_per_row: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Places sequences of these lengths in rows of `capacity` positions: longest first, each in
  the first row with room (and, with `max_per_row`, fewer than that many sequences). Returns
  (row, offset) of each sequence; row -1 for length 0.

  Raises:
    ValueError: a sequence is longer than `capacity`, or `max_per_row` < 1.
  """
  if max_per_row is not None and max_per_row < 1:
    raise ValueError(f"max_per_row must be >= 1 or None, got {max_per_row}.")
  lengths_n = np.asarray(lengths_n, np.int64)
  if lengths_n.size and lengths_n.max() > capacity:
    raise ValueError(
      f"A sequence needs {lengths_n.max()} positions, more than the packed rows' {capacity}: "
      "raise train.pack_length (positions per packed row) to at least that."
    )
  row_n = np.full(lengths_n.shape, -1, np.int64)
  offset_n = np.zeros(lengths_n.shape, np.int64)
  used_r = np.zeros(lengths_n.shape, np.int64)  # never more rows than sequences
  count_r = np.zeros(lengths_n.shape, np.int64)
  room = np.iinfo(np.int64).max if max_per_row is None else max_per_row
  rows = 0
  for i in np.argsort(-lengths_n, kind="stable"):
    length = lengths_n[i]
    if length == 0:
      break  # the rest are empty too
    fits = np.flatnonzero((used_r[:rows] + length <= capacity) & (count_r[:rows] < room))
    r = int(fits[0]) if fits.size else rows
    rows = max(rows, r + 1)
    row_n[i], offset_n[i] = r, used_r[r]
    used_r[r] += length
    count_r[r] += 1
  return row_n, offset_n


@dataclasses.dataclass(frozen=True)
class PackLayout:
  """Where the positions of a padded batch `[n, t]` go in packed micro-batches `[m, b, p]`.

  Attributes:
    padded_shape: (n, t) of the padded batch.
    shape: (m, b, p) of the packed micro-batches.
    src: flat indices into `[n * t]` of the positions that are packed.
    dest: their flat indices into `[m * b * p]`, in the same order.
    seq: the padded row (sequence) of each, in the same order.
    positions_mbp: int32 position of each packed input within its sequence; padding at a row's
      end counts from 0 too.
    segment_ids_mbp: int32 0, 1, ... for the sequences of a row in order, -1 for padding.
  """

  padded_shape: tuple[int, int]
  shape: tuple[int, int, int]
  src: np.ndarray
  dest: np.ndarray
  seq: np.ndarray
  positions_mbp: np.ndarray
  segment_ids_mbp: np.ndarray

  @property
  def num_micro_batches(self) -> int:
    return self.shape[0]

  def gather(self, x_nt: np.ndarray, fill) -> np.ndarray:
    """Per-position values `[n, t, ...]` (or `[n, >= t, ...]`: the first t) into
    `[m, b, p, ...]`, `fill` at padding."""
    x_nt = np.asarray(x_nt)[:, : self.padded_shape[1]]
    rest = x_nt.shape[2:]
    out = np.full((int(np.prod(self.shape)), *rest), fill, x_nt.dtype)
    out[self.dest] = x_nt.reshape(-1, *rest)[self.src]
    return out.reshape(*self.shape, *rest)

  def spread(self, x_n: np.ndarray, fill) -> np.ndarray:
    """Per-sequence values `[n]` to every position of the sequence, `[m, b, p]`."""
    x_n = np.asarray(x_n)
    out = np.full(int(np.prod(self.shape)), fill, x_n.dtype)
    out[self.dest] = x_n[self.seq]
    return out.reshape(self.shape)

  def scatter(self, x_mbp: np.ndarray, fill=0) -> np.ndarray:
    """Packed values `[m, b, p]` back to the padded `[n, t]`, `fill` where nothing was packed."""
    x_mbp = np.asarray(x_mbp)
    out = np.full(int(np.prod(self.padded_shape)), fill, x_mbp.dtype)
    out[self.src] = x_mbp.reshape(-1)[self.dest]
    return out.reshape(self.padded_shape)


def pack_layout(
  mask_nt: np.ndarray, pack_length: int, rows: int, max_segments: int | None = None
) -> PackLayout:
  """The layout of a padded batch, given its target mask `[n, t]`, in micro-batches of `rows`
  rows of `pack_length` positions (first-fit decreasing; the last micro-batch is filled up with
  empty rows), at most `max_segments` sequences a row if given (cuDNN's packed attention has
  that many slots a row: `jaxrl.kernels.flash_attention.cudnn`). Its sequences end at their
  last trained target (`sequence_lengths`).

  Raises:
    ValueError: a sequence needs more than `pack_length` positions, or a size is < 1.
  """
  if pack_length < 1 or rows < 1:
    raise ValueError(f"pack_length and rows must be >= 1, got {pack_length} and {rows}.")
  n, t = np.shape(mask_nt)
  lengths_n = sequence_lengths(mask_nt)
  row_n, offset_n = first_fit_decreasing(lengths_n, pack_length, max_segments)
  num_rows = int(row_n.max(initial=-1)) + 1
  m = -(-num_rows // rows)
  kept = np.flatnonzero(lengths_n)
  lengths = lengths_n[kept]
  seq = np.repeat(kept, lengths)
  # Position of each packed token within its sequence: 0, 1, ... restarting per sequence.
  starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
  within = np.arange(int(lengths.sum())) - starts
  src = seq * t + within
  dest = row_n[seq] * pack_length + offset_n[seq] + within
  # Padding at the end of each row: its own positions from 0, segment -1.
  used_r = np.bincount(row_n[kept], weights=lengths, minlength=m * rows).astype(np.int64)
  positions = np.arange(pack_length)[None, :] - used_r[:, None]
  positions = positions.reshape(-1)
  positions[dest] = within
  segment_r = np.full(m * rows * pack_length, -1, np.int64)
  # Sequences numbered 0, 1, ... by their offset within the row.
  order = np.lexsort((offset_n[kept], row_n[kept]))
  rank = np.empty_like(order)
  rank[order] = np.arange(order.size)
  first_of_row = np.searchsorted(row_n[kept][order], row_n[kept])
  segment_k = rank - first_of_row
  segment_r[dest] = np.repeat(segment_k, lengths)
  shape = (m, rows, pack_length)
  return PackLayout(
    padded_shape=(n, t),
    shape=shape,
    src=src,
    dest=dest,
    seq=seq,
    positions_mbp=positions.reshape(shape).astype(np.int32),
    segment_ids_mbp=segment_r.reshape(shape).astype(np.int32),
  )


def pack_batch(
  layout: PackLayout,
  tokens_nt: np.ndarray,
  mask_nt: np.ndarray,
  old_logp_nt: np.ndarray,
  behaviour_logp_nt: np.ndarray,
  advantages_n: np.ndarray,
  routes_ntlk: np.ndarray | None = None,
  pad_id: int = 0,
) -> MicroBatch:
  """The packed micro-batches `[m, b, p]` of a padded batch: `tokens_nt` `[n, t + 1]` (input
  t scores token t + 1), the other per-position arrays `[n, t]`; routes at padding are -1
  (`jaxrl.train.routing.fill_padding` spreads them)."""
  return MicroBatch(
    inputs_bt=layout.gather(np.asarray(tokens_nt)[:, :-1], pad_id).astype(np.int32),
    targets_bt=layout.gather(np.asarray(tokens_nt)[:, 1:], pad_id).astype(np.int32),
    mask_bt=layout.gather(mask_nt, 0).astype(np.float32),
    old_logp_bt=layout.gather(old_logp_nt, 0).astype(np.float32),
    behaviour_logp_bt=layout.gather(behaviour_logp_nt, 0).astype(np.float32),
    advantages=layout.spread(np.asarray(advantages_n, np.float32), 0),
    positions_bt=layout.positions_mbp,
    segment_ids_bt=layout.segment_ids_mbp,
    routes_btlk=None if routes_ntlk is None else layout.gather(routes_ntlk, -1).astype(np.int32),
  )


def pack_train_batch(
  batch: TrainBatch,
  behaviour_bt: np.ndarray,
  *,
  pack_length: int,
  micro_batch_size: int,
  max_segments: int | None,
  num_experts: int,
  warned_lengths: set[int],
) -> tuple[PackLayout, MicroBatch]:
  """`batch` packed into micro-batches of `micro_batch_size` rows of `pack_length` positions
  (longer when a sequence needs it: warned once per length, recorded in `warned_lengths`), at
  most `max_segments` sequences a row; replayed routes at padding filled (`fill_padding`)."""
  longest = int(sequence_lengths(batch.mask_bt).max(initial=0))
  length = row_length(longest, pack_length)
  if length != pack_length and length not in warned_lengths:
    warned_lengths.add(length)
    log.warning(
      "A sequence needs %d positions, more than train.pack_length=%d: its batch packs into "
      "rows of %d, a training shape of its own (compiled now). Raise train.pack_length to at "
      "least %d to keep one shape.",
      longest, pack_length, length, longest,
    )  # fmt: skip
  layout = pack_layout(batch.mask_bt, length, micro_batch_size, max_segments)
  packed = pack_batch(
    layout,
    batch.tokens_bt,
    batch.mask_bt,
    batch.old_logp_bt,
    behaviour_bt,
    batch.advantages_b,
    batch.routes_btlk,
  )
  if packed.routes_btlk is not None:
    routes = packed.routes_btlk.reshape(-1, *packed.routes_btlk.shape[2:])
    routes = fill_padding(routes, num_experts)
    packed = packed._replace(routes_btlk=routes.reshape(packed.routes_btlk.shape))
  return layout, packed


def input_positions(mask_bt):
  """The input positions of right-padded rows that hold tokens, from the target mask: up to
  each row's last trained target (prompt and response; what follows is padding, as packing
  cuts it). A jax array, for use inside jit."""
  return jnp.flip(jnp.cumsum(jnp.flip(jnp.asarray(mask_bt), 1), 1), 1) > 0
